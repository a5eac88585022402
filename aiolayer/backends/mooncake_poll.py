"""The Mooncake backend's poller: every write's runs as one group, settled by one task.

Split off ``mooncake`` (that module submits; this one watches). A group (``Group``) holds the runs
of one ``write`` call with ONE future. The poller task checks, per timer tick and per target, a few
pending groups from their first unsettled run (``_SCAN_AHEAD``), in submission order, and stops at
the first run still pending (a peer's writes complete roughly in order): a tick costs O(targets),
not O(writes in flight). Where the first write to each target is not due for a while yet (``WritePace``:
its bytes over the rate that target's writes settled at), the poller naps through most of that
instead of ticking. A group's every remaining run is checked only at its deadline; the runs
still pending then are quarantined (they may still land) and handed back in ``group.late``. Near
the time a write of 2 ms or more is due, the poller looks more often than it ticks (``_FINE_*`` below).
Mooncake's status call frees an id once it reported 1 or -1: an id is never checked again after that.

Each target has at most ``max_runs`` runs in flight: Mooncake's queue per peer holds 65,535 (set in
``ENGINE_ENV``), and past it the link to that peer breaks for 30 s or more (docs/mooncake.md). A
write's runs beyond the cap wait in its group (``backlog``) and are submitted, in write order, as
runs to that target settle; a write whose deadline comes first fails with those runs never sent.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import time
from typing import Any, Callable

from ..errors import BackendError, TransferTimeout, WriteRefused
from .fine_sleep import FineSleep
from .mooncake_pace import WritePace

# The poller's tick. uvloop timers tick in whole milliseconds: a shorter sleep returns at once and
# would spin a core. Yielding at once after progress (as before) spun a core while writes streamed,
# taking it from Mooncake's own threads; a tick sees every run that ended since the last one.
POLL_TICK_S = 0.001
# Timed-out writes only need to be seen ending, not fast: checking a backlog of them every tick
# would keep a core busy (a refusing peer's backlog drains at ~5 writes per second).
_QUARANTINE_POLL_S = 0.05
# Pending groups looked at per target and tick: completions to one peer come nearly in submission
# order (measured: a few inversions in 20,000, at most ~130 places apart), so the groups behind
# these are, almost always, pending too; they are reached as the ones ahead settle.
_SCAN_AHEAD = 4
# Runs in flight per target (Mooncake's per-peer queue, ENGINE_ENV, holds 65,535; several writers of
# one process share it). The raw push of bench scale is fastest with 16,384 in flight.
MAX_RUNS_PER_TARGET = 16384
# While a write is expected to take long (its bytes over the rate its target's writes settled at), the
# poller naps through this share of what is left of it instead of ticking: across a slow link a layer's
# write takes tens of ms, and each tick is a wake-up on the core the forward runs on (at 1 Gbit/s the
# loop's CPU went down by ~15%, docs/results.md). The last few ms are ticked as before, so a write is
# seen settled as soon as without the nap. Writes due sooner than ``_NAP_FROM_S`` are only ticked: on
# loopback (`make bench`, ~4 ms per layer) naps from 5 ms on lowered the streamed layers' rate by ~0.06
# of raw Mooncake's; from 10 ms on it takes none there.
_NAP_SHARE = 0.8
_NAP_FROM_S = 0.01
_MAX_NAP_S = 0.01
# From ``_FINE_FROM_S`` before the first write is due to ``_FINE_FOR_S`` after, the poller looks every
# ``_FINE_TICK_S``: a loopback layer's write of 8 MiB (~4 ms at 2 GB/s) was seen ~0.5 ms late on average at 1 ms
# ticks, an eighth of its time, and its landing varies by about a millisecond either side of the
# estimate. Outside the window the estimate was wrong (the link slowed): ticks, so a stalled write
# costs no extra wake-ups.
_FINE_TICK_S = 0.00025
_FINE_FROM_S = 0.001
_FINE_FOR_S = 0.001
# Only for writes expected to take this long, so that the looks cover at most their last half: a vLLM
# layer's write on loopback (~0.5 MB, well under 1 ms) looked at every 0.25 ms from its start took the
# core P's Mooncake threads push it from, and was seen landed later (docs/results.md).
_FINE_MIN_WRITE_S = 0.002


class Group:
    """The runs of one ``write`` call: ids in submission order, settled up to ``cursor``; its
    ``future`` settles, once every run did, as the write returns or raises (``finish``)."""

    __slots__ = ("ids", "cursor", "failed", "late", "future", "deadline", "timeout", "target", "refused",
                 "backlog", "next", "unsent", "stuck", "nbytes", "watched")

    def __init__(self, future: asyncio.Future, deadline: float, timeout: float, target: str,
                 nbytes: int = 0) -> None:
        self.ids: list[int] = []
        self.nbytes = nbytes                    # the write's bytes (its pace: ``WritePace``)
        self.watched = 0.0                      # when the poller began to watch it (time.monotonic)
        self.backlog: tuple[list, list, list] | None = None   # (srcs, dsts, lens) while runs wait for room
        self.next = 0                           # backlog[.][next:] not submitted yet
        self.unsent = 0                         # runs never submitted: the deadline came first
        self.cursor = 0                         # ids[:cursor] settled (and freed by Mooncake)
        self.failed = 0                         # runs Mooncake reported failed (-1)
        self.late: list[asyncio.Future] = []    # runs timed out, quarantined: settle when they end
        self.future = future
        self.deadline = deadline
        self.timeout = timeout
        self.target = target
        self.refused: BackendError | None = None   # the refusal that stopped the submits, if one did
        self.stuck = False                      # its submit thread's job outlived the deadline (in late)

    @property
    def waiting(self) -> int:
        """Runs not submitted yet (the target had no room)."""
        return len(self.backlog[2]) - self.next if self.backlog is not None else 0

    @property
    def settled(self) -> bool:
        return self.cursor == len(self.ids) and not self.waiting

    def finish(self) -> None:
        """Every run settled (or none was submitted): the write's outcome into ``future``. Each
        exception carries, in ``pending``, every run that may still land (docs/fencing.md)."""
        if self.future.done():   # its waiter was cancelled, or the backend closed
            return
        exc = self.outcome()
        if exc is None:
            self.future.set_result(None)
        else:
            self.future.set_exception(exc)

    def outcome(self) -> Exception | None:
        pending, refused = self.late, self.refused
        if refused is not None:
            if not pending:
                return refused
            return WriteRefused(f"{refused}; {len(pending)} runs submitted before it still pending", pending)
        if self.unsent:
            return TransferTimeout("layer_write", self.timeout, f"{self.unsent} runs to {self.target} never "
                                   f"submitted (its queue was full), {len(pending)} still pending", pending=pending)
        if self.stuck:
            return TransferTimeout("layer_write", self.timeout, f"submits to {self.target} still blocked in "
                                   "Mooncake (a segment is being opened); remote region unknown", pending=pending)
        if pending:
            return TransferTimeout("layer_write", self.timeout, f"{len(pending)} of {len(self.ids)} runs to "
                                   f"{self.target} still pending; remote region unknown", pending=pending)
        if self.failed:
            return BackendError(f"Mooncake reported {self.failed} of {len(self.ids)} writes to {self.target} failed")
        return None


def _not_started(*_: object) -> Any:
    raise BackendError("the Mooncake poller is not started")


class GroupPoller:
    """The groups in flight, by target in submission order, their deadlines, and quarantined runs."""

    def __init__(self, max_runs: int = MAX_RUNS_PER_TARGET) -> None:
        self.check: Callable[[int], Any] = _not_started   # the engine's transfer_check_status, at start
        self.submit: Callable[[str, Group, int], None] = _not_started   # (target, group, limit): at start
        self.max_runs = max_runs
        self.peak_runs = 0                                    # most runs in flight to one target
        self._inflight: dict[str, list[Group]] = {}         # target -> its unsettled groups, in order
        self._target_runs: collections.Counter[str] = collections.Counter()   # submitted, unsettled
        self._waiting: dict[str, collections.deque[Group]] = {}   # target -> groups with a backlog, in order
        self._deadlines: list[tuple[float, int, Group]] = []  # heap; settled groups dropped lazily
        self._seq = itertools.count()
        self._groups = 0                                      # unsettled groups
        self._runs = 0                                        # unsettled runs in them
        self._quarantine: dict[int, asyncio.Future] = {}     # timed out, may still land: id -> settled
        self._wake = asyncio.Event()                         # made again at start, on the loop
        self._quarantine_due = 0.0
        self.pace = WritePace()
        self.naps = 0                                         # naps taken instead of a tick (a write not yet due)
        self.fine: FineSleep | None = None                   # sub-ms sleeps (opened at start)

    @property
    def runs(self) -> int:
        """Submitted runs not yet settled."""
        return self._runs

    def start(self, check, submit) -> None:
        """On the loop that runs ``run``: the engine's calls, and the fine timer where there is one."""
        self.check, self.submit = check, submit
        self._wake = asyncio.Event()
        if self.fine is None:
            self.fine = FineSleep.open(asyncio.get_running_loop())

    def room(self, target: str) -> int:
        """Runs a new write may submit to ``target`` now (none while earlier writes wait for room)."""
        if self._waiting.get(target):
            return 0
        return max(0, self.max_runs - self._target_runs[target])

    def watch(self, target: str, group: Group) -> None:
        """Watch a group whose submits were made (``room``), its ``backlog`` holding the rest."""
        group.watched = time.monotonic()
        self._inflight.setdefault(target, []).append(group)
        heapq.heappush(self._deadlines, (group.deadline, next(self._seq), group))
        self._groups += 1
        self._count(target, len(group.ids))
        if group.waiting:
            self._waiting.setdefault(target, collections.deque()).append(group)
        self._wake.set()

    def _count(self, target: str, runs: int) -> None:
        """``runs`` more (or fewer) in flight to ``target``."""
        self._runs += runs
        now = self._target_runs[target] + runs
        if now:
            self._target_runs[target] = now
            self.peak_runs = max(self.peak_runs, now)
        else:   # no entry per target ever written to (dead peers)
            self._target_runs.pop(target, None)

    def adopt(self, bid: int, settled: asyncio.Future) -> None:
        """A run submitted after its write gave up on it (a late threaded submit): watch it to its end."""
        self._quarantine[bid] = settled
        self._wake.set()

    async def run(self) -> None:
        """Check the groups in flight once per timer tick (the backend's task, until cancelled)."""
        loop = asyncio.get_running_loop()
        while True:
            if not self._groups and not self._quarantine:
                self._wake.clear()
                await self._wake.wait()
            self._check_all(loop.time())
            if self._groups:
                await self._sleep(self._tick(time.monotonic()))
            else:   # only quarantined writes left: look rarely, but a new write wakes us at once
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), _QUARANTINE_POLL_S)
                except asyncio.TimeoutError:
                    pass

    def _tick(self, now: float) -> float:
        """How long to sleep before the next look: one tick, or a nap through most of what is left of
        the first write due (never past a deadline, nor while runs wait for room)."""
        if self._waiting or self._quarantine:
            return POLL_TICK_S
        until = (self._deadlines[0][0] - now) if self._deadlines else _MAX_NAP_S
        first: Group | None = None   # the write due first
        for queue in self._inflight.values():
            due = self.pace.due(queue[0]) if queue else None
            if due is None:   # a target not measured yet: tick
                return POLL_TICK_S
            if due - now < until:
                until, first = due - now, queue[0]
        if until < _NAP_FROM_S:
            return self._near(until, first)
        nap = min(_NAP_SHARE * until, _MAX_NAP_S)
        self.naps += 1
        return nap

    def _near(self, until: float, first: Group | None) -> float:
        """The sleep while the first write due is near (``until`` its due time, negative past it): fine
        ticks from ``_FINE_FROM_S`` before it to ``_FINE_FOR_S`` after; ticks outside, for a short write,
        or without a fine timer."""
        if self.fine is None or first is None or until < -_FINE_FOR_S:
            return POLL_TICK_S
        if self.pace.takes(first) < _FINE_MIN_WRITE_S:
            return POLL_TICK_S
        if until > _FINE_FROM_S:
            return min(POLL_TICK_S, until - _FINE_FROM_S)
        return _FINE_TICK_S

    async def _sleep(self, seconds: float) -> None:
        if self.fine is not None and seconds < POLL_TICK_S:
            await self.fine.sleep(seconds)
        else:
            await asyncio.sleep(seconds)

    def _check_all(self, now: float) -> None:
        check = self.check
        heap = self._deadlines
        while heap and heap[0][0] <= now:   # first, so that the scan below drops them from their queue
            group = heapq.heappop(heap)[2]
            if not group.settled:
                self._expire(group, check)
        if len(heap) > 2 * self._groups + 1024:   # settled groups' entries: drop them now and then
            self._deadlines = heap = [e for e in heap if not e[2].settled]
            heapq.heapify(heap)
        for target, queue in list(self._inflight.items()):
            self._check_target(target, queue, check)
            if self._waiting.get(target):
                self._top_up(target)
            if not queue:
                del self._inflight[target]
        if self._quarantine and now >= self._quarantine_due:
            self._quarantine_due = now + _QUARANTINE_POLL_S
            self._check_quarantine(check)

    def _check_target(self, target: str, queue: list[Group], check) -> None:
        """Advance the first groups of one target's queue; drop the settled ones from it."""
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
                self._count(target, group.cursor - cursor)
                group.cursor = cursor
                if group.settled:
                    self._settle(group)
            if not group.settled:
                ahead += 1
        if scanned:
            head = queue[:scanned]
            kept = [g for g in head if not g.settled]
            if len(kept) != len(head):
                queue[:scanned] = kept

    def _top_up(self, target: str) -> None:
        """Submit waiting runs to ``target``, oldest write first, as far as its room allows."""
        waiting = self._waiting[target]
        while waiting:
            group = waiting[0]
            if group.waiting:   # else its deadline dropped the rest: nothing left to submit
                room = self.max_runs - self._target_runs[target]
                if room <= 0:
                    return
                before = len(group.ids)
                self.submit(target, group, room)   # a refusal drops the rest (group.refused)
                self._count(target, len(group.ids) - before)
                if group.waiting:
                    return
                if group.settled:   # refused, and every run submitted before had settled
                    self._settle(group)
            waiting.popleft()
        del self._waiting[target]

    def _expire(self, group: Group, check) -> None:
        """The group's deadline: check every run left once; the pending ones go to quarantine, the
        ones still waiting for room are dropped (never submitted)."""
        group.unsent = group.waiting
        group.backlog = None   # stays in its target's waiting deque until the next top-up drops it
        for bid in group.ids[group.cursor:]:
            status = check(bid)
            if status == -1:
                group.failed += 1
            elif status != 1:   # pending (0) or Mooncake's timeout (-2): the data may still land
                group.late.append(self._quarantine_run(bid))
        self._count(group.target, group.cursor - len(group.ids))
        group.cursor = len(group.ids)
        self._settle(group)

    def _settle(self, group: Group) -> None:
        self._groups -= 1
        if not (group.failed or group.late or group.unsent or group.refused):   # a rate only from writes that landed
            self.pace.settled(group, time.monotonic())
        group.finish()

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

    def close(self) -> None:
        """The backend closes: every group still in flight fails, every quarantined run is cancelled."""
        for queue in self._inflight.values():
            for group in queue:
                if not group.future.done():
                    group.future.set_exception(BackendError("backend closed with the write in flight"))
        self._inflight.clear()
        self._waiting.clear()
        self._target_runs.clear()
        self._deadlines.clear()
        self._groups = self._runs = 0
        for settled in self._quarantine.values():
            settled.cancel()
        self._quarantine.clear()
        # The engine's bound method would keep the engine alive in this object's cycle with the
        # backend (``submit``): it must die when the backend drops it, not in the garbage collector.
        self.check = self.submit = _not_started
        if self.fine is not None:
            self.fine.close()
            self.fine = None
