"""The TransferBackend protocol: register memory, write batches asynchronously, close.

``write`` returns only when every run it submitted has settled (landed, failed or timed out), so a
caller that awaited it knows no write from that call still reads its source memory, except runs
that timed out: those are counted in ``quarantined`` and their regions must be treated as unknown.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from ..runtime.loop import Spawn

# Optional on a backend (Mooncake's ``start_write``): ``write`` with no coroutine, for many small writes.
# The future settles as ``write`` would return or raise; None, with nothing submitted, where ``write``
# must run instead (e.g. to open the target first).
StartWrite = Callable[[str, np.ndarray, np.ndarray, np.ndarray, float], Optional[asyncio.Future[Any]]]


@runtime_checkable
class TransferBackend(Protocol):
    name: str

    @property
    def session(self) -> str:
        """How peers name this process as a transfer target (valid after ``open``)."""

    @property
    def registered_regions(self) -> int:
        """Regions currently registered (for leak checks)."""

    @property
    def quarantined(self) -> int:
        """Writes that timed out and may still land."""

    def table_sizes(self) -> dict[str, int]:
        """Sizes of the backend's per-target and per-write tables (``Runtime.debug_tables``; growth = a leak)."""

    async def open(self, spawn: Spawn) -> None:
        """Connect; ``spawn`` starts the backend's own tasks on the runtime's loop (a poller)."""

    def register(self, addr: int, length: int) -> None: ...

    def unregister(self, addr: int) -> None: ...

    async def write(self, target: str, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray,
                    timeout: float) -> None: ...

    async def close(self) -> None: ...
