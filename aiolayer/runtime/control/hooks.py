"""Switches for the processes built on the runtime (``DecodeNode``, the benchmark's fault injection,
tests): not part of the embedding API, so they stay off ``Runtime``'s signatures.

``install_hooks(runtime, ...)`` before ``start()``.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Protocol, TypeVar

import msgspec

from ...errors import RuntimeStateError
from ...protocol import messages as m

ExtraHandler = Callable[[m.Message], Awaitable[m.Message]]
InboundFilter = Callable[[m.Message], None]   # raises FrameDropped or ControlRejected to stop a message


class Hooks(msgspec.Struct, frozen=True, kw_only=True):
    extra_handler: ExtraHandler | None = None    # control messages the runtime does not serve (a node's)
    inbound_filter: InboundFilter | None = None  # sees every message first (fault injection drops some)
    refuse_writes: bool = False                  # publish the KV layout but register no memory: every write fails


NO_HOOKS = Hooks()


class Hookable(Protocol):
    """What takes hooks (``Runtime``; not imported: it imports this module)."""

    _hooks: Hooks

    @property
    def started(self) -> bool: ...


_Runtime = TypeVar("_Runtime", bound=Hookable)


def install_hooks(runtime: _Runtime, **hooks: Any) -> _Runtime:
    """Give a runtime that is not started yet the node's or test's hooks (``Hooks``' fields)."""
    if runtime.started:
        raise RuntimeStateError("hooks go in before the runtime starts")
    runtime._hooks = Hooks(**hooks)   # noqa: SLF001 - this module is the one way in
    return runtime
