"""Mooncake transfer engine backend: TCP on one host (P2PHANDSHAKE, no metadata server), RDMA across hosts.

Every run is submitted as its own single-request batch (``transfer_submit_write``) because
``transfer_check_status`` only looks at a batch's first request and frees the batch when that one
is done. One poller task checks all in-flight ids without blocking and resolves their futures;
Mooncake's own blocking waiters (which spin a core) are never called. The first write to a new
target opens its segment, a network handshake, so it is submitted from a worker thread.

Every exception ``write`` raises carries, in ``pending``, a future for each run that may still
land (``TransferTimeout``, ``WriteRefused``): a thread cannot be cancelled, so a submit that
outlives its deadline is adopted when it returns and watched like any timed-out run.
"""

from __future__ import annotations

import asyncio
import logging
import os

import numpy as np

from ..errors import BackendError, TransferTimeout, WriteRefused
from ..transport import Transport, check_rdma_devices

log = logging.getLogger(__name__)

# Set in every process before an engine exists (docs/mooncake.md: "queue-full" beyond ~2,048).
ENGINE_ENV = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
    "MC_LOG_LEVEL": "WARNING",
}
_INVALID_IDS = (0, -1, (1 << 64) - 1)
# uvloop timers tick in whole milliseconds: a shorter sleep returns at once and would spin a core.
_POLL_IDLE_S = 0.001
# Timed-out writes only need to be seen ending, not fast: checking a backlog of them every tick
# would keep a core busy (a refusing peer's backlog drains at ~5 writes per second).
_QUARANTINE_POLL_S = 0.05


def _import_engine():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise BackendError(
            "Mooncake is not importable: pip install 'aiolayer[mooncake]' (CPU hosts), "
            "mooncake-transfer-engine (CUDA) or mooncake-transfer-engine-npu (Ascend); "
            f"it needs libibverbs1 (apt-get install -y libibverbs1). Import error: {exc}"
        ) from exc
    return TransferEngine


class _Inflight:
    __slots__ = ("future", "deadline", "timeout")

    def __init__(self, future: asyncio.Future, deadline: float, timeout: float) -> None:
        self.future = future
        self.deadline = deadline
        self.timeout = timeout


class MooncakeBackend:
    name = "mooncake"

    def __init__(self, transport: Transport | None = None) -> None:
        self.transport = transport or Transport()
        self.host = ""                      # the advertised host, resolved at open (no I/O here)
        self._engine = None
        self._session = ""
        self._regions: dict[int, int] = {}
        self._opened_targets: set[str] = set()
        self._inflight: dict[int, _Inflight] = {}
        self._quarantine: dict[int, asyncio.Future] = {}   # timed out, may still land: id -> settled
        self._opening: set[asyncio.Future] = set()          # settled of submits still running in a thread
        self._wake: asyncio.Event | None = None
        self._quarantine_due = 0.0
        self._poller: asyncio.Task | None = None
        self.runs_submitted = 0
        self.bytes_submitted = 0

    @property
    def session(self) -> str:
        return self._session

    @property
    def registered_regions(self) -> int:
        return len(self._regions)

    @property
    def quarantined(self) -> int:
        return len(self._quarantine) + len(self._opening)

    @property
    def inflight(self) -> int:
        """Submitted runs not yet settled."""
        return len(self._inflight)

    async def open(self, spawn) -> None:
        for key, value in ENGINE_ENV.items():
            os.environ.setdefault(key, value)
        t = self.transport
        if t.protocol == "rdma":
            check_rdma_devices(t.device_name)   # Mooncake would fall back to TCP, or wait, without one
        engine_cls = _import_engine()
        engine = engine_cls()
        self.host = t.advertised()
        rc = await asyncio.to_thread(engine.initialize, self.host, t.metadata_server, t.protocol, t.device_name)
        if rc != 0:
            raise BackendError(f"Mooncake initialize({self.host}, {t.metadata_server}, {t.protocol}, "
                               f"device {t.device_name or 'auto'}) returned {rc}")
        self._engine = engine
        self._session = f"{self.host}:{engine.get_rpc_port()}"
        self._wake = asyncio.Event()
        self._poller = spawn(self._poll(), name="mooncake-poller")

    def register(self, addr: int, length: int) -> None:
        rc = self._engine.register_memory(addr, length)
        if rc != 0:
            raise BackendError(f"Mooncake register_memory({addr:#x}, {length}) returned {rc}")
        self._regions[addr] = length

    def unregister(self, addr: int) -> None:
        if self._regions.pop(addr, None) is not None:
            rc = self._engine.unregister_memory(addr)
            if rc != 0:
                raise BackendError(f"Mooncake unregister_memory({addr:#x}) returned {rc}")

    async def write(self, target: str, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray,
                    timeout: float) -> None:
        if self._engine is None:
            raise BackendError("Mooncake backend is not open")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        runs = list(zip(src.tolist(), dst.tolist(), lengths.tolist()))
        futures: list[asyncio.Future] = []
        if target not in self._opened_targets and runs:
            bid = await self._open_target(target, runs.pop(0), timeout, loop)
            futures.append(self._track(bid, deadline, timeout, loop))
        refused: BackendError | None = None
        for run in runs:
            try:
                futures.append(self._track(self._submit(target, *run), deadline, timeout, loop))
            except BackendError as exc:
                refused = exc
                break
        self._wake.set()
        # Settle everything already submitted before reporting, so the caller may trust its fence.
        results = await asyncio.gather(*futures, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        timeouts = [r for r in failures if isinstance(r, TransferTimeout)]
        pending = [f for t in timeouts for f in t.pending]
        if refused is not None:
            if not pending:
                raise refused
            raise WriteRefused(f"{refused}; {len(timeouts)} runs submitted before it still pending", pending)
        if timeouts:
            raise TransferTimeout("layer_write", timeout, f"{len(timeouts)} of {len(results)} runs to {target} "
                                  "still pending; remote region unknown", pending=pending)
        if failures:
            raise failures[0]

    async def _open_target(self, target: str, run: tuple[int, int, int], timeout: float, loop) -> int:
        """Submit the first run to a new target from a worker thread (opening its segment is a
        handshake that blocks, e.g. while the peer is stopped). Past ``timeout`` the thread still
        runs and its submit may still happen: ``TransferTimeout`` hands a future that settles when
        that submit was refused or its batch ended."""
        submit = loop.run_in_executor(None, self._submit, target, *run)
        settled = None
        try:
            await asyncio.wait({submit}, timeout=timeout)
        finally:
            if not submit.done():
                settled = self._adopt_late(submit, loop)
        if settled is not None:
            raise TransferTimeout("layer_write", timeout, f"opening the segment of {target}; the submit "
                                  "may still happen", pending=[settled])
        bid = submit.result()   # BackendError if refused: nothing was submitted
        self._opened_targets.add(target)
        return bid

    def _adopt_late(self, submit: asyncio.Future, loop) -> asyncio.Future:
        settled = loop.create_future()
        self._opening.add(settled)

        def adopt(fut: asyncio.Future) -> None:
            self._opening.discard(settled)
            if settled.done():   # the backend closed meanwhile
                return
            if fut.cancelled():   # the loop gave up on the thread: whether it submitted is unknown
                settled.cancel()
            elif fut.exception() is not None:   # refused: nothing was submitted
                settled.set_result(None)
            else:
                self._quarantine[fut.result()] = settled
                self._wake.set()

        submit.add_done_callback(adopt)
        return settled

    def _submit(self, target: str, src: int, dst: int, length: int) -> int:
        bid = self._engine.transfer_submit_write(target, src, dst, length)
        if bid in _INVALID_IDS:
            self._opened_targets.discard(target)
            raise BackendError(f"Mooncake refused a write of {length} bytes to {target} (submit returned {bid})")
        self.runs_submitted += 1
        self.bytes_submitted += length
        return bid

    def _track(self, bid: int, deadline: float, timeout: float, loop) -> asyncio.Future:
        future = loop.create_future()
        self._inflight[bid] = _Inflight(future, deadline, timeout)
        return future

    async def _poll(self) -> None:
        """Check every in-flight id; yield once after progress, else sleep one timer tick."""
        loop = asyncio.get_running_loop()
        while True:
            if not self._inflight and not self._quarantine:
                self._wake.clear()
                await self._wake.wait()
            progressed = self._check_all(loop.time())
            if progressed or self._inflight:
                await asyncio.sleep(0 if progressed else _POLL_IDLE_S)
            else:   # only quarantined writes left: look rarely, but a new write wakes us at once
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), _QUARANTINE_POLL_S)
                except asyncio.TimeoutError:
                    pass

    def _check_all(self, now: float) -> bool:
        check = self._engine.transfer_check_status
        progressed = False
        for bid, item in list(self._inflight.items()):
            status = check(bid)
            if status == 0 and now < item.deadline:
                continue
            progressed = True
            del self._inflight[bid]
            if item.future.done():
                continue
            if status == 1:
                item.future.set_result(None)
            elif status == -1:
                item.future.set_exception(BackendError("Mooncake reported the write failed"))
            else:  # -2 (engine timeout) or our deadline: the data may still land later
                settled = asyncio.get_running_loop().create_future()
                self._quarantine[bid] = settled
                item.future.set_exception(TransferTimeout(
                    "layer_write", item.timeout, "write still pending; remote region unknown", pending=[settled]))
        if self._quarantine and now >= self._quarantine_due:
            self._quarantine_due = now + _QUARANTINE_POLL_S
            self._check_quarantine(check)
        return progressed

    def _check_quarantine(self, check) -> None:
        for bid, settled in list(self._quarantine.items()):
            if check(bid) in (1, -1):
                del self._quarantine[bid]
                if not settled.done():
                    settled.set_result(None)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None
        for item in self._inflight.values():
            if not item.future.done():
                item.future.set_exception(BackendError("backend closed with the write in flight"))
        self._inflight.clear()
        for settled in [*self._quarantine.values(), *self._opening]:
            settled.cancel()
        self._quarantine.clear()
        self._opening.clear()
        if self._engine is not None:
            for addr in list(self._regions):
                try:
                    self.unregister(addr)
                except BackendError as exc:
                    log.warning("%s", exc)
            # Destroying an engine blocks for about a second (it joins its threads): not on the loop.
            holder = [self._engine]
            self._engine = None
            await asyncio.to_thread(holder.clear)
