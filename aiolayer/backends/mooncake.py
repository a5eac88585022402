"""Mooncake transfer engine backend: TCP on one host (P2PHANDSHAKE, no metadata server), RDMA across hosts.

Every run is submitted as its own single-request batch (``transfer_submit_write``) because
``transfer_check_status`` only looks at a batch's first request and frees the batch when that one
is done, and Mooncake's waiters for a whole batch spin a core (so ``batch_transfer_async_write``,
whose batch only those could watch, is not used). The runs of one ``write`` call form a group with
ONE future, watched by one poller task (``mooncake_poll.GroupPoller``: O(targets) per tick, not
O(writes in flight)). The first write to a new target opens its segment, a network handshake, so
it is submitted from a worker thread. Mooncake holds one lock across that handshake that every
submit takes, whatever its target: while one runs, ``start_write`` declines (None), ``write`` submits
from the submit thread (``mooncake_thread``) and the poller's top-ups wait, so the loop never blocks.

Every exception ``write`` raises carries, in ``pending``, a future for each run that may still
land (``TransferTimeout``, ``WriteRefused``): a thread cannot be cancelled, so a submit that
outlives its deadline is adopted when it returns and watched like any timed-out run.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

import numpy as np

from ..errors import BackendError, TransferTimeout
from ..transport import MOONCAKE_IPV6, Transport, check_rdma_devices
from .mooncake_names import SegmentNames
from .mooncake_poll import MAX_RUNS_PER_TARGET, GroupPoller, Group
from .mooncake_thread import GATE_WAIT_S, INVALID_IDS as _INVALID_IDS, Job, SubmitThread

log = logging.getLogger(__name__)

# Set in every process before an engine exists (docs/mooncake.md: "queue-full" beyond ~2,048).
ENGINE_ENV = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
    "MC_LOG_LEVEL": "WARNING",
}


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


class MooncakeBackend:
    name = "mooncake"

    def __init__(self, transport: Transport | None = None, max_runs_per_target: int = MAX_RUNS_PER_TARGET) -> None:
        self.transport = transport or Transport()
        self.host = ""                      # the advertised host, resolved at open (no I/O here)
        self._engine: Any = None            # Mooncake's TransferEngine (untyped), at open
        self._session = ""
        self._regions: dict[int, int] = {}
        self._opened_targets: set[str] = set()
        self._names = SegmentNames()   # the name written to for each process behind a session
        self.target_for = self._names.target_for
        self._poll = GroupPoller(max_runs_per_target)
        self._opening: set[asyncio.Future] = set()          # settled of submits still running in a thread
        self._openers: dict[str, asyncio.Future] = {}       # target -> the threaded first submit opening it
        self._thread = SubmitThread(self._job_ended)         # submits made while a segment is being opened
        self._poller: asyncio.Task | None = None
        self.runs_submitted = 0
        self.bytes_submitted = 0
        self.writes_started = 0   # write/start_write calls that submitted (groups)

    @property
    def session(self) -> str:
        return self._session

    @property
    def registered_regions(self) -> int:
        return len(self._regions)

    @property
    def quarantined(self) -> int:
        return len(self._quarantine) + len(self._opening) + len(self._thread.late)

    @property
    def inflight(self) -> int:
        """Submitted runs not yet settled."""
        return self._poll.runs

    @property
    def peak_runs_per_target(self) -> int:
        """The most runs that were in flight to one target at once (capped at ``max_runs_per_target``)."""
        return self._poll.peak_runs

    @property
    def _quarantine(self) -> dict:   # id -> settled, of runs that timed out and may still land
        return self._poll._quarantine

    def table_sizes(self) -> dict[str, int]:
        # inflight: target -> unsettled groups; quarantine: runs that timed out and may still land
        return {"opened_targets": len(self._opened_targets), "inflight": len(self._poll._inflight),
                "quarantine": len(self._quarantine)}

    async def open(self, spawn) -> None:
        for key, value in ENGINE_ENV.items():
            os.environ.setdefault(key, value)
        t = self.transport
        if t.protocol == "rdma":
            check_rdma_devices(t.device_name)   # Mooncake would fall back to TCP, or wait, without one
        engine_cls = _import_engine()
        engine = engine_cls()
        self.host = t.advertised()
        if ":" in self.host:   # a wildcard bind that routes over IPv6 only (check_mooncake: the rest)
            raise BackendError(MOONCAKE_IPV6.format(self.host))
        rc = await asyncio.to_thread(engine.initialize, self.host, t.metadata_server, t.protocol, t.device_name)
        if rc != 0:
            raise BackendError(f"Mooncake initialize({self.host}, {t.metadata_server}, {t.protocol}, "
                               f"device {t.device_name or 'auto'}) returned {rc}")
        self._engine = engine
        self._session = f"{self.host}:{engine.get_rpc_port()}"
        self._poll.start(engine.transfer_check_status, self._top_up)
        self._poller = spawn(self._poll.run(), name="mooncake-poller")

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
        settled = self.start_write(target, src, dst, lengths, timeout)
        if settled is None:   # the target's segment is not open yet, or another one's is being opened
            settled = await self._open_and_submit(target, src.tolist(), dst.tolist(), lengths.tolist(), timeout)
        # Settle everything already submitted before reporting, so the caller may trust its fence.
        # Cancelled here, the group is still watched to its end (timed-out runs quarantined).
        await settled

    def start_write(self, target: str, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray,
                    timeout: float) -> asyncio.Future | None:
        """``write`` with no coroutine, for callers of many small writes (``runtime.stream``): submits
        now and returns a future that settles as ``write`` would return or raise. None, with nothing
        submitted, while the target's segment is not open (``write`` opens it) or while a segment is
        being opened (``write`` submits from the submit thread)."""
        if self._engine is None:
            raise BackendError("Mooncake backend is not open")
        if target not in self._opened_targets or self._openers or self._thread.busy:   # _submits_block
            return None
        loop = asyncio.get_running_loop()
        lens = lengths.tolist()
        group = Group(loop.create_future(), loop.time() + timeout, timeout, target, sum(lens))
        self._submit_all(target, group, src.tolist(), dst.tolist(), lens, 0)
        self._settle_or_watch(target, group)
        return group.future

    async def _open_and_submit(self, target: str, srcs: list, dsts: list, lens: list,
                               timeout: float) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        group = Group(loop.create_future(), loop.time() + timeout, timeout, target, sum(lens))
        first = 0
        if target not in self._opened_targets and lens and target in self._openers:
            await self._wait_opened(target, group.deadline, timeout, loop)   # submits nothing until then
        if target not in self._opened_targets and lens:
            group.ids.append(await self._open_target(target, (srcs[0], dsts[0], lens[0]), timeout, loop))
            first = 1
        if self._submits_block():
            await self._submit_in_thread(target, group, (srcs, dsts, lens), first)
        else:
            self._submit_all(target, group, srcs, dsts, lens, first)
        self._settle_or_watch(target, group)
        return group.future

    def _submits_block(self) -> bool:
        """A submit made now could wait on a segment's opening (Mooncake's lock), or would overtake
        earlier submits still in the submit thread."""
        return bool(self._openers) or self._thread.busy > 0

    async def _submit_in_thread(self, target: str, group: Group, runs: tuple[list, list, list],
                                first: int) -> None:
        """Runs ``first``.. of a new write from the submit thread, as far as the target has room (the
        rest left in ``group.backlog``), until the write's deadline. Past it, the runs the thread
        still submits go to ``group.late`` as one future; cancelled, the group is watched anyway."""
        if first == len(runs[2]):   # the opening submitted the only run
            return
        room = self._thread.room(target, self._poll.room(target))
        job = Job(target, runs, first, min(len(runs[2]), first + room))
        if job.stop == first:   # no room: every run waits for the poller's top-ups
            group.backlog, group.next = runs, first
            return
        try:
            late = await self._thread.run(job, self._engine.transfer_submit_write, group.deadline,
                                          self._poll.adopt)
        except BaseException:
            if not job.abandoned:   # the job ended (cancelled as it returned): its runs are the group's
                group.ids += job.ids
            group.future.cancel()   # nobody awaits it: the runs it holds are still watched to their end
            self._settle_or_watch(target, group)
            raise
        if late is not None:
            group.late.append(late)
            group.stuck = True
            return
        group.ids += job.ids
        if job.refused is not None:
            group.refused = self._refusal(target, *job.refused)
        elif job.stop < len(runs[2]):
            group.backlog, group.next = runs, job.stop

    def _job_ended(self, job: Job) -> None:
        """A job of the submit thread ended (in time or late): counted; a refusal closes the target."""
        self.runs_submitted += len(job.ids)
        self.bytes_submitted += job.submitted
        if job.refused is not None:
            self._opened_targets.discard(job.target)

    def _top_up(self, target: str, group: Group, limit: int) -> None:
        """The poller's top-up: none while submits would block (the runs wait, their deadline runs)."""
        if not self._submits_block():
            self._submit_backlog(target, group, limit)

    def _settle_or_watch(self, target: str, group: Group) -> None:
        if group.ids or group.waiting:
            self.writes_started += 1
            self._poll.watch(target, group)
        else:   # nothing submitted: empty, or refused at once
            group.finish()

    def _submit_all(self, target: str, group: Group, srcs: list, dsts: list, lens: list, first: int) -> None:
        """Runs ``first``.. of a new write: submitted as far as the target has room, the rest left in
        ``group.backlog`` for the poller; a refusal stops it (``group.refused``)."""
        group.backlog, group.next = (srcs, dsts, lens), first
        self._submit_backlog(target, group, self._poll.room(target))

    def _submit_backlog(self, target: str, group: Group, limit: int) -> None:
        """Up to ``limit`` of the group's waiting runs (also the poller's top-up); a refusal drops the rest."""
        if group.backlog is None:   # its deadline dropped the rest meanwhile
            return
        srcs, dsts, lens = group.backlog
        stop = min(len(lens), group.next + limit)
        group.refused = self._submit_range(target, group, srcs, dsts, lens, group.next, stop)
        group.next = stop
        if group.refused is not None or stop == len(lens):
            group.backlog, group.next = None, 0

    def _submit_range(self, target: str, group: Group, srcs: list, dsts: list, lens: list,
                      first: int, stop: int) -> BackendError | None:
        submit, ids, refused = self._engine.transfer_submit_write, group.ids, None
        done = len(ids)
        for i in range(first, stop):
            bid = submit(target, srcs[i], dsts[i], lens[i])
            if bid in _INVALID_IDS:
                refused = self._refusal(target, lens[i], bid)
                break
            ids.append(bid)
        self.runs_submitted += len(ids) - done
        self.bytes_submitted += sum(lens[first:first + len(ids) - done])
        return refused

    def _refusal(self, target: str, length: int, bid: int) -> BackendError:
        self._opened_targets.discard(target)
        return BackendError(f"Mooncake refused a write of {length} bytes to {target} (submit returned {bid})")

    async def _open_target(self, target: str, run: tuple[int, int, int], timeout: float, loop) -> int:
        """Submit the first run to a new target from a worker thread (opening its segment is a
        handshake that blocks, e.g. while the peer is stopped). Past ``timeout`` the thread still
        runs and its submit may still happen: ``TransferTimeout`` hands a future that settles when
        that submit was refused or its batch ended."""
        gave_up = threading.Event()   # its thread submits nothing once set (it may wait for the gate)
        submit = loop.run_in_executor(None, self._open, target, *run, gave_up)
        self._openers[target] = submit   # concurrent writes to the target wait for it (_wait_opened)

        def opened(fut: asyncio.Future) -> None:   # before any waiter resumes: the target is usable
            if self._openers.get(target) is fut:
                del self._openers[target]
            if not fut.cancelled() and fut.exception() is None:
                self._opened_targets.add(target)
        submit.add_done_callback(opened)
        try:
            await asyncio.wait({submit}, timeout=timeout)
        except BaseException:   # cancelled, maybe as the submit returned: its run is watched to its end
            gave_up.set()
            self._adopt_late(submit, loop)
            raise
        if not submit.done():
            gave_up.set()
            raise TransferTimeout("layer_write", timeout, f"opening the segment of {target}; the submit "
                                  "may still happen", pending=[self._adopt_late(submit, loop)])
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
                self._poll.adopt(fut.result(), settled)

        submit.add_done_callback(adopt)
        return settled

    def _open(self, target: str, src: int, dst: int, length: int, gave_up: threading.Event) -> int:
        """``_submit`` in an opening's thread, holding the submit thread's gate across the handshake. The
        gate is taken in short waits (another target's handshake may hold it for a minute): a write that
        gave up meanwhile submits nothing (D may have reused its blocks by then)."""
        gate = self._thread.gate
        while not gate.acquire(timeout=GATE_WAIT_S):
            if gave_up.is_set():
                raise BackendError(f"the write to {target} gave up while another segment was being opened; "
                                   "nothing was submitted")
        try:
            if gave_up.is_set():
                raise BackendError(f"the write to {target} gave up before its submit; nothing was submitted")
            return self._submit(target, src, dst, length)
        finally:
            gate.release()

    def _submit(self, target: str, src: int, dst: int, length: int) -> int:
        bid = self._engine.transfer_submit_write(target, src, dst, length)
        if bid in _INVALID_IDS:
            self._opened_targets.discard(target)
            raise BackendError(f"Mooncake refused a write of {length} bytes to {target} (submit returned {bid})")
        self.runs_submitted += 1
        self.bytes_submitted += length
        return bid

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None
        self._poll.close()
        self._thread.close()
        for settled in self._opening:
            settled.cancel()
        self._opening.clear()
        if self._engine is not None:
            for addr in list(self._regions):
                try:
                    self.unregister(addr)
                except BackendError as exc:
                    log.warning("%s", exc)
            # Destroying an engine joins its threads (~1 s) holding the GIL, so the process pauses
            # once, here, at close: this must be the last reference (the poller dropped its own).
            # An engine left in a reference cycle is destroyed by whichever thread next collects,
            # another runtime's loop included (docs/mooncake.md). A submit still blocked in
            # Mooncake holds it until that submit returns.
            holder = [self._engine]
            self._engine = None
            await asyncio.to_thread(holder.clear)
