"""The sender's results read from two threads (``runtime.results``): one thread in ``wait`` and another
in ``pop_outcomes`` never lose the waiter's wake-up, whatever the interleaving with the loop's
``flush``. The deterministic test runs the other thread's pop at exactly the point between the
outcome becoming poppable and its waiter being answered; the stress test runs both threads freely.
"""

from __future__ import annotations

import collections
import threading
import time

import pytest

from aiolayer.errors import DeadlineExceeded, UnknownTransfer
from aiolayer.runtime.send.results import Results
from aiolayer.runtime.spec import Outcome

pytestmark = pytest.mark.timeout(30)


class _Spec:
    def __init__(self, transfer_id: str) -> None:
        self.transfer_id = transfer_id


class _PopOnAppend(collections.deque):
    """The outcomes deque, with another reader's ``pop_outcomes`` run the moment an outcome is appended."""

    def __init__(self, results: Results) -> None:
        super().__init__()
        self.results = results
        self.popped: list[Outcome] = []

    def append(self, item) -> None:
        super().append(item)
        self.popped.extend(self.results.pop_outcomes())


class _SignalOnGet(dict):
    """The waiters table, telling the test when ``wait`` has taken its slot."""

    def __init__(self, table: dict) -> None:
        super().__init__(table)
        self.taken = threading.Event()

    def get(self, key, default=None):
        value = super().get(key, default)
        self.taken.set()
        return value


def _outcome(tid: str) -> Outcome:
    return Outcome(transfer_id=tid, ok=True, finished_s=time.perf_counter())


def test_a_pop_between_publish_and_answer_does_not_lose_the_wake_up():
    results = Results()
    results.expect([_Spec("t")])
    results.waiters = _SignalOnGet(results.waiters)
    results.outcomes = popper = _PopOnAppend(results)
    answer: list = []
    waiter = threading.Thread(target=lambda: answer.append(_wait(results, "t", 2.0)))
    waiter.start()
    try:
        assert results.waiters.taken.wait(5), "wait never looked up its slot"
        results.waiters.taken.clear()
        results.publish(_outcome("t"))   # no loop running here: flushed at once, on this thread
    finally:
        waiter.join(5)
    assert [o.transfer_id for o in popper.popped] == ["t"]
    assert len(answer) == 1 and isinstance(answer[0], Outcome) and answer[0].ok, answer
    assert "t" not in results.waiters   # answered, then forgotten by the pop or the wait


def test_wait_and_pop_outcomes_on_two_threads_never_sleep_to_the_timeout():
    """Thousands of outcomes: every ``wait`` returns the outcome or finds it already popped
    (``UnknownTransfer``), never its deadline with the outcome published."""
    count = 3000
    results = Results()
    results.expect([_Spec(f"t{i}") for i in range(count)])
    stop = threading.Event()
    popped: list[Outcome] = []
    lost: list[str] = []

    def pop_loop() -> None:
        while not stop.is_set():
            popped.extend(results.pop_outcomes())

    def wait_loop() -> None:
        for i in range(count):
            got = _wait(results, f"t{i}", 1.0)
            if isinstance(got, DeadlineExceeded):
                lost.append(f"t{i}")

    threads = [threading.Thread(target=pop_loop), threading.Thread(target=wait_loop)]
    for t in threads:
        t.start()
    start = time.monotonic()
    try:
        for i in range(count):
            results.publish(_outcome(f"t{i}"))
            if i % 64 == 0:
                time.sleep(0)   # let the readers interleave
    finally:
        threads[1].join(20)
        stop.set()
        threads[0].join(5)
    popped.extend(results.pop_outcomes())
    assert not lost, f"{len(lost)} waits slept to their timeout with the outcome published: {lost[:5]}"
    assert len(popped) == count and time.monotonic() - start < 20


def _wait(results: Results, tid: str, timeout: float):
    try:
        return results.wait(tid, timeout)
    except (DeadlineExceeded, UnknownTransfer) as exc:
        return exc
