"""The Mooncake backend's submit thread: the submits the loop must not make while a segment opens.

Mooncake's Python engine holds one lock across ``openSegment`` in ``transfer_submit_write``, the
handshake with a new peer, which waits up to 60 s on a stopped one; every submit takes that lock,
whatever its target. While a segment is being opened, a submit made on the loop would stall the loop
and with it every deadline of the process (docs/mooncake.md), so ``mooncake`` hands those submits to
this one thread (one, so that they reach each target in the order they were made). A job still
running at its write's deadline is abandoned: it submits nothing more, and the runs it did submit are
handed back as one future that settles once they all have (``late``), for the caller's fence.
"Nothing more" holds because a job never waits inside Mooncake's lock: an opening holds ``gate``
across its handshake, and a job takes the gate before each submit, in short waits that look at
``abandoned`` in between. A submit blocked in the lock would go out whenever the handshake ended,
however long after its deadline, and D may free the blocks on time alone by then (docs/fencing.md).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from concurrent.futures import ThreadPoolExecutor

INVALID_IDS = (0, -1, (1 << 64) - 1)
GATE_WAIT_S = 0.01   # how often a job waiting for an opening to end looks whether it was abandoned


class Job:
    """Runs ``first``..``stop`` of one write, submitted in the thread; read on the loop once it ended."""

    __slots__ = ("target", "runs", "first", "stop", "ids", "refused", "abandoned")

    def __init__(self, target: str, runs: tuple[list, list, list], first: int, stop: int) -> None:
        self.target, self.runs, self.first, self.stop = target, runs, first, stop
        self.ids: list[int] = []
        self.refused: tuple[int, int] | None = None   # (length, id returned) of the submit refused
        self.abandoned = False                         # set on the loop: the write gave up on this job

    def run(self, submit, gate: threading.Lock) -> None:
        srcs, dsts, lens = self.runs
        for i in range(self.first, self.stop):
            while not gate.acquire(timeout=GATE_WAIT_S):   # a segment is being opened
                if self.abandoned:
                    return
            try:
                if self.abandoned:   # the write already failed: submit nothing more of it
                    return
                bid = submit(self.target, srcs[i], dsts[i], lens[i])
            finally:
                gate.release()
            if bid in INVALID_IDS:
                self.refused = (lens[i], bid)
                return
            self.ids.append(bid)

    @property
    def submitted(self) -> int:
        return sum(self.runs[2][self.first:self.first + len(self.ids)])


class SubmitThread:
    """The thread, the jobs in it (``busy``), the runs they reserve per target and abandoned runs."""

    def __init__(self, ended) -> None:
        self._ended = ended          # (job): called on the loop for every job once the thread ran it
        self._pool: ThreadPoolExecutor | None = None
        self.busy = 0                # jobs queued or running
        self._reserved: collections.Counter[str] = collections.Counter()   # runs a job may submit
        self._cut: collections.Counter[str] = collections.Counter()        # jobs that left a backlog
        self.late: set[asyncio.Future] = set()   # of abandoned jobs still in the thread
        self.gate = threading.Lock()   # held by an opening's thread across its handshake (``Job.run``)
        self._jobs: set[Job] = set()   # queued or running

    def room(self, target: str, room: int) -> int:
        """Of ``room`` (the poller's), what a new job to ``target`` may submit: none while an earlier
        job left runs for the poller, so that those go first."""
        return 0 if self._cut[target] else max(0, room - self._reserved[target])

    async def run(self, job: Job, submit, deadline: float, adopt) -> asyncio.Future | None:
        """Run ``job`` in the thread until it ends (None) or ``deadline``: then it is abandoned, and
        the future returned settles once every run it still submits has (``adopt(bid, future)``
        watches one). Cancelled, the job is abandoned the same way (its future in ``late``)."""
        loop = asyncio.get_running_loop()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="mooncake-submit")
        target, count, cut = job.target, job.stop - job.first, job.stop < len(job.runs[2])
        self._reserved[target] += count
        self._cut[target] += cut
        self.busy += 1
        self._jobs.add(job)
        ran = loop.run_in_executor(self._pool, job.run, submit, self.gate)

        def ended(fut: asyncio.Future) -> None:
            self.busy -= 1
            self._jobs.discard(job)
            for counter, n in ((self._reserved, count), (self._cut, cut)):
                counter[target] -= n
                if not counter[target]:
                    del counter[target]
            if not fut.cancelled():   # cancelled: the backend closed, the pool with it
                self._ended(job)
        ran.add_done_callback(ended)
        late = None
        try:
            await asyncio.wait({ran}, timeout=max(0.0, deadline - loop.time()))
        finally:
            if not ran.done():
                job.abandoned = True
                late = self._adopt_late(ran, job, adopt, loop)
        return late

    def _adopt_late(self, ran: asyncio.Future, job: Job, adopt, loop) -> asyncio.Future:
        settled = loop.create_future()
        self.late.add(settled)

        def adopted(fut: asyncio.Future) -> None:
            self.late.discard(settled)   # from now on its runs are quarantined, each on its own
            if settled.done():   # the backend closed meanwhile
                return
            if fut.cancelled():   # the pool was shut down: whether it submitted is unknown
                settled.cancel()
                return
            left = [loop.create_future() for _ in job.ids]
            for bid, one in zip(job.ids, left):
                adopt(bid, one)
            if not left:
                settled.set_result(None)
                return
            count = [len(left)]

            def one_settled(one: asyncio.Future) -> None:
                count[0] -= 1
                if one.cancelled():   # the backend closed: whether it landed is unknown
                    settled.cancel()
                elif not count[0] and not settled.done():
                    settled.set_result(None)
            for one in left:
                one.add_done_callback(one_settled)

        ran.add_done_callback(adopted)
        return settled

    def close(self) -> None:
        """The backend closes: a job blocked in Mooncake still ends there, but none starts, and one
        waiting for an opening submits nothing."""
        for job in self._jobs:
            job.abandoned = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        for settled in self.late:
            settled.cancel()
        self.late.clear()
