"""The value types of the embedding API that are not the sender's: D's receive spec, the registration
D hands to P, P's per-step handle, and the identity a runtime answers a topology query with. No I/O
here; ``Runtime`` does the work (runtime.py).
"""

from __future__ import annotations

import collections
from typing import Any, Awaitable, Callable, Protocol

import msgspec

from ..errors import ConfigError
from ..protocol.checks import check_senders, check_token


class ReceiveSpec(msgspec.Struct, frozen=True, kw_only=True):
    """D: the blocks that will receive one transfer, and whom it comes from."""

    transfer_id: str
    block_ids: list[int]
    token: str = ""               # the transfer's secret (>= 16 characters) P must present; "" = mint one
    # Not used: D learns its writers (each P rank that fetched the transfer's layout, with its own
    # control endpoint) and its fence asks exactly those (docs/fencing.md). Kept so that callers of
    # the earlier API still construct; a P named here is never believed.
    sender_control: str = ""
    first_block: int = 0          # blocks before this index of the request were already at D (prefix hit)
    senders: int = 1              # P ranks that each write a head slice and each say DONE/FAILED

    def check(self) -> None:
        """Raise ``ConfigError`` for a spec no receiver could serve (before anything is handed over)."""
        tid = self.transfer_id
        if not isinstance(tid, str) or not tid:
            raise ConfigError(f"transfer id must be a non-empty string, got {tid!r}")
        check_token(tid, self.token)
        if not isinstance(self.block_ids, list) or not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in self.block_ids):
            raise ConfigError(f"transfer {tid}: block_ids must be a list of non-negative integers")
        check_senders(tid, self.senders)
        if isinstance(self.first_block, bool) or not isinstance(self.first_block, int) or self.first_block < 0:
            raise ConfigError(f"transfer {tid}: first_block must be a non-negative integer")


class Registration(msgspec.Struct, frozen=True, kw_only=True):
    """What D publishes once a transfer is registered: P builds its spec from it
    (``TransferSpec.from_registration``). Plain data: send it to P by any means (msgspec, JSON)."""

    transfer_id: str
    block_ids: list[int]
    first_block: int
    token: str
    incarnation: str              # D's runtime instance: P never writes into another one's blocks
    decode_control: str           # D's control endpoint


ROLES = ("producer", "consumer", "both", "")
MAX_PARALLEL = 1 << 16


class Identity(msgspec.Struct, frozen=True, kw_only=True):
    """Who a runtime is in its engine, as the embedder knows it (``Runtime.set_identity``): what it
    answers a ``TopologyRequest`` with, so that whoever routes requests learns the engine's parallel
    layout and model from the engine itself instead of being told. A bare runtime is rank 0 of 1."""

    role: str = ""                # "producer" (P), "consumer" (D), "both", or "" (not said)
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    model: str = ""               # a fingerprint of what must match between P and D (model, dtype, geometry)
    # P can start a send before D's blocks are known (``TransferSpec.late_bound``): the proxy's ``auto``
    # binding then sends the request to P and D at once. Not where the embedder pairs its blocks with D's
    # itself (vLLM's hybrid KV cache groups, sliding windows); False (not said): D first
    late_binding: bool = False

    def check(self) -> None:
        """Raise ``ConfigError`` for an identity no engine can have."""
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, got {self.role!r}")
        for rank, size, what in ((self.tp_rank, self.tp_size, "tp"), (self.dp_rank, self.dp_size, "dp")):
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in (rank, size)) \
                    or not 0 <= rank < size <= MAX_PARALLEL:
                raise ConfigError(f"{what} rank {rank!r} of size {size!r}: not 0 <= rank < size <= {MAX_PARALLEL}")
        if not isinstance(self.model, str) or len(self.model) > 256:
            raise ConfigError("model must be a string of at most 256 characters")
        if not isinstance(self.late_binding, bool):
            raise ConfigError(f"late_binding must be a bool, got {self.late_binding!r}")


Announce = Callable[[Registration], Awaitable[None]]   # runs on the runtime's loop; raising aborts the transfer


class StepSink(Protocol):
    """What a ``Step`` ends through (the sender; a protocol, so the shared API needs no side)."""

    def end_step(self, step: int) -> None: ...


class Step(collections.deque[Any]):
    """P: one forward step's transfers. ``layer_ready(layer)`` after each layer's KV is written, ``end()``
    after the last; as a context manager it ends on exit. Called from the forward thread; never blocks.

    A step is itself the inbox the runtime's loop takes its layers from: in host memory ``layer_ready``
    is deque's own C ``append``, found on the type, which the interpreter calls directly. Kept as a
    bound method in an attribute it cost ~1.5 us more per layer right after the forward's KV write had
    evicted the caches (docs/results.md). The deque's other methods are not part of the API."""

    __slots__ = ("_sender", "_id", "_ended")
    layer_ready = collections.deque.append
    __eq__ = object.__eq__   # a step is itself, not the layers waiting in it
    __hash__ = object.__hash__   # type: ignore[assignment]

    def __init__(self, sender: StepSink, step_id: int) -> None:
        super().__init__()
        self._sender = sender
        self._id = step_id
        self._ended = False

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Step({self._id})"

    @property
    def id(self) -> int:
        return self._id

    def end(self) -> None:
        """Close the step (idempotent): layers never handed over fail their transfers by deadline."""
        if not self._ended:
            self._ended = True
            self._sender.end_step(self._id)

    def __enter__(self) -> "Step":
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()
