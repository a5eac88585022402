"""In-process backend: ``memmove`` between regions of one process, with fault injection.

For fast deterministic tests of the runtime (P and D in one process). Targets are session names in
a process-wide registry; a write outside a registered destination region is refused, as Mooncake
does. ``faults`` lets a test delay, fail or freeze writes, or stall them past the caller's deadline
so that they land later, as a timed-out Mooncake write may (``pending`` futures, ``quarantined``).
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .. import compat
from ..errors import BackendError, TransferTimeout

if TYPE_CHECKING:
    from ..runtime.loop import Spawn

_registry: dict[str, "MemoryBackend"] = {}
_names = itertools.count(1)


@dataclass
class Faults:
    delay_s: float = 0.0        # added before each write lands
    fail: bool = False          # every write fails (like Mooncake's -1)
    freeze: bool = False        # writes never complete (like a SIGSTOPped peer)
    stall_s: float = 0.0        # each write lands this long after it was submitted, whatever the caller's
                                # deadline: past it write() times out and the data lands later anyway


class MemoryBackend:
    name = "memory"

    def __init__(self, session: str = "") -> None:
        self._session = session or f"memory-{next(_names)}"
        self._regions: dict[int, int] = {}
        self.faults = Faults()
        self.bytes_written = 0
        self._spawn: Spawn | None = None
        self._late: set[asyncio.Future] = set()   # settled futures of stalled writes not landed yet

    @property
    def session(self) -> str:
        return self._session

    @property
    def registered_regions(self) -> int:
        return len(self._regions)

    @property
    def quarantined(self) -> int:
        return len(self._late)

    def table_sizes(self) -> dict[str, int]:
        return {"late": len(self._late)}

    async def open(self, spawn: Spawn) -> None:
        if self._session in _registry:
            raise BackendError(f"memory session {self._session!r} already open")
        _registry[self._session] = self
        self._spawn = spawn

    def register(self, addr: int, length: int) -> None:
        self._regions[addr] = length

    def unregister(self, addr: int) -> None:
        self._regions.pop(addr, None)

    def _check_destination(self, dst: int, length: int) -> None:
        for base, size in self._regions.items():
            if base <= dst and dst + length <= base + size:
                return
        raise BackendError(f"destination {dst:#x}+{length} is not inside a registered region")

    async def write(self, target: str, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray,
                    timeout: float) -> None:
        peer = _registry.get(target)
        if peer is None:
            raise BackendError(f"no memory backend named {target!r}")
        faults = peer.faults
        if faults.stall_s > timeout:
            if self._spawn is None:
                raise BackendError("memory backend is not open")
            settled = asyncio.get_running_loop().create_future()
            self._late.add(settled)
            self._spawn(self._land_late(peer, src, dst, lengths, faults.stall_s, settled), name=f"late write {target}")
            await asyncio.sleep(timeout)
            raise TransferTimeout("layer_write", timeout, f"memory peer {target} stalled; the write lands later",
                                  pending=[settled])
        try:
            async with compat.timeout(timeout):
                if faults.freeze:
                    await asyncio.Event().wait()
                if faults.delay_s or faults.stall_s:
                    await asyncio.sleep(faults.delay_s + faults.stall_s)
        except TimeoutError:
            raise TransferTimeout("layer_write", timeout, f"memory peer {target} frozen") from None
        if faults.fail:
            raise BackendError(f"injected failure writing to {target}")
        _land(peer, src, dst, lengths)

    async def _land_late(self, peer: "MemoryBackend", src, dst, lengths, delay: float,
                         settled: asyncio.Future) -> None:
        try:
            await asyncio.sleep(delay)
            _land(peer, src, dst, lengths)
        except asyncio.CancelledError:
            settled.cancel()   # closing: whether it landed is unknown to the caller, keep it held
            raise
        except BackendError:
            pass               # refused where it landed: it ended all the same
        finally:
            self._late.discard(settled)
        if not settled.done():
            settled.set_result(None)

    async def close(self) -> None:
        _registry.pop(self._session, None)
        self._regions.clear()
        for settled in list(self._late):
            settled.cancel()
        self._late.clear()


def _land(peer: MemoryBackend, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> None:
    for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist()):
        peer._check_destination(d, n)   # noqa: SLF001 - another MemoryBackend, checked as itself
        ctypes.memmove(d, s, n)
        peer.bytes_written += n
