"""The sender's results, read by other threads: outcomes, ``wait`` slots and released transfer ids.

The loop appends; any thread pops. Deque appends and pops are atomic under the GIL, and each
item is a finished value (an ``Outcome`` or an id), so a reader never sees one half-made.

A ``wait`` and a ``pop_outcomes`` on two threads: the loop answers an outcome's waiter BEFORE the
outcome can be popped, and popping forgets only a slot that is answered, so a pop in between never
takes the slot from under its waiter (the waiter would sleep to its timeout, the outcome published).

What the loop publishes is staged and made visible together once per pass of the loop (a
``call_soon``): ``on_change`` (the runtime's metrics snapshot) runs once for all of them, not once
per outcome and once per release.

Outcomes nobody pops (an embedder that only calls ``wait``) are kept up to ``max_outcomes``, the oldest
dropped beyond (counted, warned once): each holds its per-layer timings, and they piled up forever.
Released ids are never dropped: they are how the source blocks come back.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from collections.abc import Container, Sequence
from typing import Callable, TypeVar

from ...config import wait_limit
from ...errors import DeadlineExceeded, UnknownTransfer
from ..spec import Outcome

_T = TypeVar("_T")
log = logging.getLogger(__name__)
MAX_QUEUED_OUTCOMES = 4096


class Results:
    def __init__(self, on_change: Callable[[], None] | None = None, max_outcomes: int = MAX_QUEUED_OUTCOMES) -> None:
        # called on the loop before an outcome or a release becomes visible to other threads, so
        # what they read alongside it (the published metrics) already counts it
        self.on_change = on_change
        self.waiters: dict[str, concurrent.futures.Future[Outcome]] = {}
        self.outcomes: collections.deque[Outcome] = collections.deque(maxlen=max_outcomes)
        self.outcomes_dropped = 0   # never popped, and pushed out by newer ones
        self.released: collections.deque[str] = collections.deque()
        self._staged: list[tuple[str, Outcome | str]] = []   # ("publish" | "resolve", Outcome), ("release", id)

    def expect(self, specs: Sequence[object]) -> list[str]:
        """Make ``wait`` slots for the specs' ids (before they reach the loop); returns the new ones. A slot
        already answered is an earlier transfer of the id whose outcome nobody popped: replaced, else
        ``wait`` would hand the new transfer that old outcome."""
        ids = {getattr(spec, "transfer_id", None) for spec in specs}
        added = [tid for tid in ids if isinstance(tid, str) and not _waiting(self.waiters.get(tid))]
        for tid in added:
            self.waiters[tid] = concurrent.futures.Future()
        return added

    def forget(self, ids: list[str]) -> None:
        for tid in ids:
            self.waiters.pop(tid, None)

    def publish(self, outcome: Outcome) -> None:
        """The outcome (and the answer to its ``wait``), visible to other threads in this pass of the loop."""
        self._stage("publish", outcome)

    def resolve(self, outcome: Outcome) -> None:
        """Answer ``wait`` for the outcome's id unless it is answered already (in order with ``publish``)."""
        self._stage("resolve", outcome)

    def release(self, transfer_id: str) -> None:
        self._stage("release", transfer_id)

    def _stage(self, kind: str, item: Outcome | str) -> None:
        self._staged.append((kind, item))
        if len(self._staged) == 1:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:   # no loop running here: visible at once
                self.flush()

    def flush(self) -> None:
        """Everything staged, visible now: ``on_change`` first, so readers find it counted."""
        staged, self._staged = self._staged, []
        if not staged:
            return
        if self.on_change is not None:
            self.on_change()
        for kind, item in staged:
            if isinstance(item, str):         # a release
                self.released.append(item)
            else:                             # publish or resolve
                self._answer(item)            # first: once appended, another thread may pop it
                if kind == "publish":
                    self._queue(item)

    def _queue(self, outcome: Outcome) -> None:
        if len(self.outcomes) == self.outcomes.maxlen:   # the append drops the oldest
            if not self.outcomes_dropped:
                log.warning("%d outcomes were never popped (pop_outcomes): the oldest are dropped from now on",
                            len(self.outcomes))
            self.outcomes_dropped += 1
        self.outcomes.append(outcome)

    def _answer(self, outcome: Outcome) -> None:
        waiter = self.waiters.get(outcome.transfer_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(outcome)

    def fail_unpublished(self, reason: str, live: Container[str]) -> None:
        """Every ``wait`` not answered yet gets a failure (the sender stops); what is staged goes first."""
        self.flush()
        for tid, fut in list(self.waiters.items()):
            if not fut.done():
                fut.set_result(Outcome(transfer_id=tid, ok=False, reason=reason, finished_s=time.perf_counter(),
                                       source_released=tid not in live))

    # --- any thread -------------------------------------------------------------------------

    def pop_outcomes(self) -> list[Outcome]:
        outcomes = _drain(self.outcomes)
        for outcome in outcomes:
            fut = self.waiters.get(outcome.transfer_id)
            if fut is not None and fut.done():   # never a slot whose waiter is not answered yet
                self.waiters.pop(outcome.transfer_id, None)
        return outcomes

    def pop_released(self) -> list[str]:
        return _drain(self.released)

    def wait(self, transfer_id: str, timeout: float) -> Outcome:
        wait_limit(timeout, "wait_outcome")
        fut = self.waiters.get(transfer_id)
        if fut is None:
            raise UnknownTransfer(f"no outcome to wait for: transfer {transfer_id} was never started here, "
                                  "or its outcome was already popped")
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            raise DeadlineExceeded("wait", timeout, f"transfer {transfer_id}") from None
        finally:
            if fut.done() and self.waiters.get(transfer_id) is fut:   # not a new transfer's slot of the id
                self.waiters.pop(transfer_id, None)


def _waiting(fut: concurrent.futures.Future[Outcome] | None) -> bool:
    return fut is not None and not fut.done()


def _drain(queue: collections.deque[_T]) -> list[_T]:
    out: list[_T] = []
    while True:
        try:
            out.append(queue.popleft())
        except IndexError:   # empty, or another thread popping at once took the last one
            return out
