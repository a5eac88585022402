"""The one exception tree of aiolayer, grouped by the phase that failed.

Backend, socket and decoding errors are mapped onto these classes at the boundary where they occur,
so callers only ever catch ``AiolayerError`` subclasses.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator


class AiolayerError(Exception):
    """Base of every error aiolayer raises on purpose."""


class ConfigError(AiolayerError, ValueError):
    """A configuration value is invalid; raised before any I/O happens."""


class DeadlineExceeded(AiolayerError, TimeoutError):
    """A named phase ran past its deadline from ``Timeouts``."""

    def __init__(self, phase: str, seconds: float, detail: str = "") -> None:
        self.phase = phase
        self.seconds = seconds
        text = f"{phase} exceeded its {seconds:g}s deadline"
        super().__init__(f"{text}: {detail}" if detail else text)


# --- runtime ---------------------------------------------------------------------------------

class RuntimeStateError(AiolayerError, RuntimeError):
    """The runtime is not in a state that allows the call (not started, stopped, dead)."""


class UnknownTransfer(AiolayerError, KeyError):
    """No such transfer to wait for here: never started, or its result was already taken."""


class BridgeClosed(RuntimeStateError):
    """The loop side of the layer bridge is gone; the producer must stop handing layers over."""


class BridgeFull(RuntimeStateError):
    """The layer bridge reached its bound; the loop side is not keeping up."""


# --- control plane ---------------------------------------------------------------------------

class ControlError(AiolayerError):
    """A control-plane exchange failed."""


class ControlTimeout(ControlError, DeadlineExceeded):
    """A control request got no reply within its deadline."""


class ControlRejected(ControlError):
    """The peer answered with a NACK; ``code`` is a ``protocol.codes.NackCode`` (or, from a newer
    peer, a code this side does not know: compare with the enum's members, never with a literal)."""

    def __init__(self, code: str, reason: str) -> None:
        self.code = code
        self.reason = reason
        super().__init__(f"peer rejected the request ({code}): {reason}")


class ProtocolError(ControlError):
    """A frame or message could not be decoded or is not valid in this exchange."""


class DeliveryFailed(ControlError):
    """P's DONE or FAILED did not reach D (all attempts); ``cause`` is the error of the last one."""

    def __init__(self, cause: BaseException) -> None:
        self.cause = cause
        super().__init__(f"{type(cause).__name__}: {cause}")


class FrameDropped(ControlError):
    """Fault injection only: a handler raises it so the server sends no reply (a message lost on the way)."""


# --- metadata --------------------------------------------------------------------------------

class MetadataError(AiolayerError):
    """The remote layout could not be obtained or does not fit this side."""


class LayoutMismatch(MetadataError):
    """The peer's KV layout is incompatible with ours (layers, block size)."""


class StaleLayout(MetadataError):
    """A cached layout belongs to an older incarnation of the peer."""


# --- transfer --------------------------------------------------------------------------------

class TransferError(AiolayerError):
    """Moving KV bytes failed."""


class BackendError(TransferError):
    """The transfer backend reported a failure (its codes mapped here)."""


class TransferTimeout(TransferError, DeadlineExceeded):
    """A write did not complete within its deadline; the remote region is now unknown.

    ``pending`` holds futures that resolve when the backend sees those writes end (land or fail):
    until then the source memory may still be read.
    """

    def __init__(self, phase: str, seconds: float, detail: str = "", pending=()) -> None:
        super().__init__(phase, seconds, detail)
        self.pending = list(pending)


class WriteRefused(BackendError):
    """The backend refused a run part-way through a write call, while runs it had already
    submitted may still land: ``pending`` as in ``TransferTimeout`` (hold the source until they settle)."""

    def __init__(self, detail: str, pending=()) -> None:
        super().__init__(detail)
        self.pending = list(pending)


class TransferFailed(TransferError):
    """A transfer reached the failed state; ``reason`` says why."""

    def __init__(self, transfer_id: str, reason: str) -> None:
        self.transfer_id = transfer_id
        self.reason = reason
        super().__init__(f"transfer {transfer_id} failed: {reason}")


class TransferStopped(TransferError):
    """P's transfer ends without DONE; ``str()`` is the reason as its outcome publishes it.
    ``settled_s``: when every write submitted for it had settled (perf_counter), 0.0 if none was."""

    def __init__(self, reason: str, settled_s: float = 0.0) -> None:
        self.settled_s = settled_s
        super().__init__(reason)


class LayerWriteFailed(TransferStopped):
    """One layer's write failed: ``cause`` is what planning or the backend raised; ``pending`` the
    runs that may still land (the cause's own ``pending``, see ``TransferTimeout``)."""

    def __init__(self, layer: int, cause: BaseException) -> None:
        self.layer = layer
        self.cause = cause
        self.pending = list(getattr(cause, "pending", ()))
        super().__init__(f"layer {layer}: {type(cause).__name__}: {cause}")


@contextlib.contextmanager
def map_errors(wrap: Callable[[Exception], AiolayerError]) -> Iterator[None]:
    """At a boundary (a backend, a socket): any ``Exception`` raised inside leaves as ``wrap(exc)``,
    chained to it; cancellation (a ``BaseException``) passes through untouched."""
    try:
        yield
    except Exception as exc:  # mapped, not swallowed
        raise wrap(exc) from exc
