"""Mooncake transfer engine backend: TCP on one host (P2PHANDSHAKE, no metadata server), RDMA across hosts.

Every run is submitted as its own single-request batch (``transfer_submit_write``) because
``transfer_check_status`` only looks at a batch's first request and frees the batch when that one
is done, and Mooncake's waiters for a whole batch spin a core. The runs of one ``write`` call form
a group with ONE future, polled by one poller task with a cursor in submission order: each tick
checks a group from its first unsettled run and stops at the first still pending (a peer's writes
complete roughly in order), and per target looks at only a few pending groups ahead, so a tick
costs O(targets), not O(writes in flight). A group's every remaining run is checked only at its
deadline. Mooncake's status call frees an id once it reported 1 or -1: an id is never checked again
after that. The first write to a new target opens its segment, a network handshake, so it is
submitted from a worker thread.

Every exception ``write`` raises carries, in ``pending``, a future for each run that may still
land (``TransferTimeout``, ``WriteRefused``): a thread cannot be cancelled, so a submit that
outlives its deadline is adopted when it returns and watched like any timed-out run.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
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
# The poller's tick. uvloop timers tick in whole milliseconds: a shorter sleep returns at once and
# would spin a core. Yielding at once after progress (as before) spun a core while writes streamed,
# taking it from Mooncake's own threads; a tick sees every run that ended since the last one.
_POLL_TICK_S = 0.001
# Timed-out writes only need to be seen ending, not fast: checking a backlog of them every tick
# would keep a core busy (a refusing peer's backlog drains at ~5 writes per second).
_QUARANTINE_POLL_S = 0.05
# Pending groups looked at per target and tick: completions to one peer come nearly in submission
# order (measured: a few inversions in 20,000, at most ~130 places apart), so the groups behind
# these are, almost always, pending too; they are reached as the ones ahead settle.
_SCAN_AHEAD = 4


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


class _Group:
    """The runs of one ``write`` call: ids in submission order, settled up to ``cursor``."""

    __slots__ = ("ids", "cursor", "failed", "late", "future", "deadline", "timeout")

    def __init__(self, future: asyncio.Future, deadline: float, timeout: float) -> None:
        self.ids: list[int] = []
        self.cursor = 0                         # ids[:cursor] settled (and freed by Mooncake)
        self.failed = 0                         # runs Mooncake reported failed (-1)
        self.late: list[asyncio.Future] = []    # runs timed out, quarantined: settle when they end
        self.future = future                    # set once every run settled
        self.deadline = deadline
        self.timeout = timeout

    @property
    def settled(self) -> bool:
        return self.cursor == len(self.ids)


class MooncakeBackend:
    name = "mooncake"

    def __init__(self, transport: Transport | None = None) -> None:
        self.transport = transport or Transport()
        self.host = ""                      # the advertised host, resolved at open (no I/O here)
        self._engine = None
        self._session = ""
        self._regions: dict[int, int] = {}
        self._opened_targets: set[str] = set()
        self._inflight: dict[str, list[_Group]] = {}         # target -> its unsettled groups, in order
        self._deadlines: list[tuple[float, int, _Group]] = []  # heap; settled groups dropped lazily
        self._seq = itertools.count()
        self._groups = 0                                      # unsettled groups
        self._runs = 0                                        # unsettled runs in them
        self._quarantine: dict[int, asyncio.Future] = {}   # timed out, may still land: id -> settled
        self._opening: set[asyncio.Future] = set()          # settled of submits still running in a thread
        self._openers: dict[str, asyncio.Future] = {}       # target -> the threaded first submit opening it
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
        return self._runs

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
        group = _Group(loop.create_future(), loop.time() + timeout, timeout)
        srcs, dsts, lens = src.tolist(), dst.tolist(), lengths.tolist()
        first = 0
        if target not in self._opened_targets and lens and target in self._openers:
            await self._wait_opened(target, group.deadline, timeout, loop)   # submits nothing until then
        if target not in self._opened_targets and lens:
            group.ids.append(await self._open_target(target, (srcs[0], dsts[0], lens[0]), timeout, loop))
            first = 1
        refused = self._submit_all(target, group, srcs, dsts, lens, first)
        if group.ids:
            self._watch(target, group)
            # Settle everything already submitted before reporting, so the caller may trust its fence.
            # Cancelled here, the group is still watched to its end (timed-out runs quarantined).
            await group.future
        pending = group.late
        if refused is not None:
            if not pending:
                raise refused
            raise WriteRefused(f"{refused}; {len(pending)} runs submitted before it still pending", pending)
        if pending:
            raise TransferTimeout("layer_write", timeout, f"{len(pending)} of {len(group.ids)} runs to {target} "
                                  "still pending; remote region unknown", pending=pending)
        if group.failed:
            raise BackendError(f"Mooncake reported {group.failed} of {len(group.ids)} writes to {target} failed")

    def _submit_all(self, target: str, group: _Group, srcs: list, dsts: list, lens: list,
                    first: int) -> BackendError | None:
        """Submit runs ``first``.. into ``group.ids``; the refusal that stopped it, if one did."""
        submit, ids, refused = self._engine.transfer_submit_write, group.ids, None
        done = len(ids)
        for i in range(first, len(lens)):
            bid = submit(target, srcs[i], dsts[i], lens[i])
            if bid in _INVALID_IDS:
                self._opened_targets.discard(target)
                refused = BackendError(f"Mooncake refused a write of {lens[i]} bytes to {target} "
                                       f"(submit returned {bid})")
                break
            ids.append(bid)
        self.runs_submitted += len(ids) - done
        self.bytes_submitted += sum(lens[first:first + len(ids) - done])
        return refused

    def _watch(self, target: str, group: _Group) -> None:
        self._inflight.setdefault(target, []).append(group)
        heapq.heappush(self._deadlines, (group.deadline, next(self._seq), group))
        self._groups += 1
        self._runs += len(group.ids)
        self._wake.set()

    async def _open_target(self, target: str, run: tuple[int, int, int], timeout: float, loop) -> int:
        """Submit the first run to a new target from a worker thread (opening its segment is a
        handshake that blocks, e.g. while the peer is stopped). Past ``timeout`` the thread still
        runs and its submit may still happen: ``TransferTimeout`` hands a future that settles when
        that submit was refused or its batch ended."""
        submit = loop.run_in_executor(None, self._submit, target, *run)
        self._openers[target] = submit   # concurrent writes to the target wait for it (_wait_opened)

        def opened(fut: asyncio.Future) -> None:   # before any waiter resumes: the target is usable
            if self._openers.get(target) is fut:
                del self._openers[target]
            if not fut.cancelled() and fut.exception() is None:
                self._opened_targets.add(target)
        submit.add_done_callback(opened)
        settled = None
        try:
            await asyncio.wait({submit}, timeout=timeout)
        finally:
            if not submit.done():
                settled = self._adopt_late(submit, loop)
        if settled is not None:
            raise TransferTimeout("layer_write", timeout, f"opening the segment of {target}; the submit "
                                  "may still happen", pending=[settled])
        return submit.result()   # BackendError if refused: nothing was submitted

    async def _wait_opened(self, target: str, deadline: float, timeout: float, loop) -> None:
        """Another write is opening ``target`` in a thread: wait for it rather than start a thread of
        our own per write. Nothing of this write is submitted before it ends, so a timeout here hands
        no pending run, and a refused opening refuses this write too (the next write tries again)."""
        opener = self._openers[target]
        waiter = loop.create_future()   # not asyncio.wait: thousands of writes may wait at once here

        def wake(_=None) -> None:
            if not waiter.done():
                waiter.set_result(None)
        opener.add_done_callback(wake)
        timer = loop.call_at(deadline, wake)
        try:
            await waiter
        finally:
            timer.cancel()
            if not opener.done():
                opener.remove_done_callback(wake)
        if not opener.done():
            raise TransferTimeout("layer_write", timeout, f"the segment of {target} is still being opened; "
                                  "nothing of this write was submitted", pending=[])
        if opener.cancelled() or opener.exception() is not None:
            why = "cancelled" if opener.cancelled() else str(opener.exception())
            raise BackendError(f"opening the segment of {target} failed ({why}); nothing of this write was submitted")

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

    async def _poll(self) -> None:
        """Check the groups in flight once per timer tick."""
        loop = asyncio.get_running_loop()
        while True:
            if not self._groups and not self._quarantine:
                self._wake.clear()
                await self._wake.wait()
            self._check_all(loop.time())
            if self._groups:
                await asyncio.sleep(_POLL_TICK_S)
            else:   # only quarantined writes left: look rarely, but a new write wakes us at once
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), _QUARANTINE_POLL_S)
                except asyncio.TimeoutError:
                    pass

    def _check_all(self, now: float) -> bool:
        check = self._engine.transfer_check_status
        progressed = False
        heap = self._deadlines
        while heap and heap[0][0] <= now:   # first, so that the scan below drops them from their queue
            group = heapq.heappop(heap)[2]
            if not group.settled:
                self._expire(group, check)
                progressed = True
        if len(heap) > 2 * self._groups + 1024:   # settled groups' entries: drop them now and then
            self._deadlines = heap = [e for e in heap if not e[2].settled]
            heapq.heapify(heap)
        for target, queue in list(self._inflight.items()):
            progressed |= self._check_target(queue, check)
            if not queue:
                del self._inflight[target]
        if self._quarantine and now >= self._quarantine_due:
            self._quarantine_due = now + _QUARANTINE_POLL_S
            self._check_quarantine(check)
        return progressed

    def _check_target(self, queue: list[_Group], check) -> bool:
        """Advance the first groups of one target's queue; drop the settled ones from it."""
        progressed = False
        ahead = scanned = 0
        for group in queue:
            if ahead >= _SCAN_AHEAD:
                break
            scanned += 1
            ids, cursor = group.ids, group.cursor
            end = len(ids)
            while cursor < end:
                status = check(ids[cursor])
                if status == 0:
                    break
                if status == -1:
                    group.failed += 1
                elif status != 1:   # -2, Mooncake's own timeout: the data may still land later
                    group.late.append(self._quarantine_run(ids[cursor]))
                cursor += 1
            if cursor != group.cursor:
                progressed = True
                self._runs -= cursor - group.cursor
                group.cursor = cursor
                if cursor == end:
                    self._settle(group)
            if cursor != end:
                ahead += 1
        if scanned:
            head = queue[:scanned]
            kept = [g for g in head if not g.settled]
            if len(kept) != len(head):
                queue[:scanned] = kept
        return progressed

    def _expire(self, group: _Group, check) -> None:
        """The group's deadline: check every run left once; the pending ones go to quarantine."""
        for bid in group.ids[group.cursor:]:
            status = check(bid)
            if status == -1:
                group.failed += 1
            elif status != 1:   # pending (0) or Mooncake's timeout (-2): the data may still land
                group.late.append(self._quarantine_run(bid))
        self._runs -= len(group.ids) - group.cursor
        group.cursor = len(group.ids)
        self._settle(group)

    def _settle(self, group: _Group) -> None:
        self._groups -= 1
        if not group.future.done():
            group.future.set_result(None)

    def _quarantine_run(self, bid: int) -> asyncio.Future:
        settled = asyncio.get_running_loop().create_future()
        self._quarantine[bid] = settled
        return settled

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
        for queue in self._inflight.values():
            for group in queue:
                if not group.future.done():
                    group.future.set_exception(BackendError("backend closed with the write in flight"))
        self._inflight.clear()
        self._deadlines.clear()
        self._groups = self._runs = 0
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
