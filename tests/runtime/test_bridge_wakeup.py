"""LayerBridge wake-ups: a put is seen by the loop within a bound even when no further put follows.

The race that matters is the consumer deciding to sleep while a producer puts: the consumer finds the
deque empty, a producer appends and sees nobody asleep (no wake-up), then the consumer goes to sleep
and that item waits for the next put, which may never come. Here every producer puts one item and
waits until the loop has it before the next, so a lost wake-up is an item that is never seen; a profile
hook hands the GIL over at random calls, so the threads interleave inside the consumer's going-to-sleep
steps (a flag set after the emptiness check, without a re-check, loses a wake-up here within seconds).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from aiolayer.runtime.send.bridge import LayerBridge
from aiolayer.runtime.loop import LoopThread

BOUND_S = 2.0   # far above any wake-up on a loaded 2-core VM (a few ms); a lost one is never seen at all


def _preempt(seed: int):
    """A profile hook that now and then lets other threads run at a call or return: the GIL handed over
    at an arbitrary point of the consumer or a producer, as the interpreter may do at any function call."""
    rng = random.Random(seed)

    def hook(frame, event, arg):
        if event in ("call", "return") and rng.random() < 0.2:
            time.sleep(rng.choice((0, 0, 20e-6)))   # releases the GIL
    return hook


@pytest.fixture
def loop_thread():
    """A loop thread and, started after it, producers whose calls are preempted at random points."""
    threading.setprofile(_preempt(1))
    lt = LoopThread(name="aiolayer-test-loop")
    lt.start()
    yield lt
    threading.setprofile(None)
    lt.stop(timeout=5)
    assert not lt.alive


def _consume(bridge: LayerBridge, seen: list[int], waited: list[float]):
    async def consume() -> None:
        while batch := await bridge.drain():
            now = time.perf_counter()
            for pid, put_at in batch:
                waited.append(now - put_at)
                seen[pid] += 1   # only the loop writes it; the producer spins on it, to race the next put
    return consume()


def _produce(bridge: LayerBridge, pid: int, puts: int, seen: list[int], lost: list[int],
             rng: random.Random) -> None:
    for seq in range(puts):
        bridge.put((pid, time.perf_counter()))
        deadline = time.perf_counter() + BOUND_S
        while seen[pid] <= seq:   # no further put comes until this one is seen
            if time.perf_counter() > deadline:
                lost.append(seq)
                return
            time.sleep(0)   # let the loop thread have the GIL
        spin_until = time.perf_counter() + rng.uniform(0, 30e-6)   # vary the phase against the consumer
        while time.perf_counter() < spin_until:
            pass


@pytest.mark.timeout(120)
@pytest.mark.parametrize("linger_s", [0.0, 0.0005])
def test_every_put_is_seen_within_a_bound_while_the_consumer_goes_to_sleep(loop_thread, linger_s):
    producers, puts = 1, 3000
    bridge = LayerBridge(linger_s=linger_s, poll_s=0.0001)

    async def attach() -> None:
        bridge.attach(asyncio.get_running_loop())
    loop_thread.call(attach(), timeout=5)
    seen = [0] * producers
    waited: list[float] = []
    lost: list[int] = []
    consumer = loop_thread.submit(_consume(bridge, seen, waited))
    threads = [threading.Thread(target=_produce, args=(bridge, pid, puts, seen, lost, random.Random(pid)))
               for pid in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not any(t.is_alive() for t in threads)
    bridge.close("test over")
    consumer.result(timeout=5)
    assert lost == [], f"{len(lost)} puts never reached the loop (a lost wake-up), after {bridge.wakeups} wake-ups"
    assert len(waited) == producers * puts
    assert max(waited) < BOUND_S
    assert bridge.wakeups >= 1   # the consumer really went to sleep between puts


NAP_S = 3.0   # a tick far longer than the bound below: an item seen within the bound was woken for


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nap", ["polling", "lingering"])
def test_a_woken_put_ends_the_consumers_nap_and_a_plain_one_waits_for_the_tick(nap):
    """A step's end (``put(wake=True)``) is seen at once by a consumer that naps for a tick, whether it
    polls an open step's inbox (``drain(poll=...)``) or lingers after a batch; a plain put is not."""
    lt = LoopThread(name="aiolayer-test-loop")
    lt.start()
    try:
        bridge = LayerBridge(linger_s=NAP_S if nap == "lingering" else 0.0, poll_s=NAP_S, max_poll_s=NAP_S)

        async def attach() -> None:
            bridge.attach(asyncio.get_running_loop())
        lt.call(attach(), timeout=5)

        async def one_look() -> list:
            return await bridge.drain(poll=NAP_S if nap == "polling" else 0.0)

        for wake, bound in ((True, 1.0), (False, None)):
            look = lt.submit(one_look())
            time.sleep(0.2)   # the consumer is napping now
            put_at = time.monotonic()
            bridge.put(("end", 1), wake=wake)
            if bound is not None:
                assert look.result(timeout=bound) == [("end", 1)]
                assert time.monotonic() - put_at < bound
            else:   # only the tick ends the nap: the plain put waited for it
                assert look.result(timeout=NAP_S + 5) == [("end", 1)]
                assert time.monotonic() - put_at > 1.0
        bridge.close("test over")
    finally:
        lt.stop(timeout=5)
