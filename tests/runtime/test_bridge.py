"""LayerBridge (forward thread -> loop) and LoopThread (the loop's owner thread)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from aiolayer.errors import BridgeClosed, BridgeFull
from aiolayer.runtime.send.bridge import LayerBridge
from aiolayer.runtime.loop import LoopThread


def _attach(lt: LoopThread, bridge: LayerBridge) -> None:
    async def attach():
        bridge.attach(asyncio.get_running_loop())
    lt.call(attach(), timeout=5)


# --- LayerBridge ------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("linger_s", [0.0, 0.05])
def test_concurrent_producers_lose_and_duplicate_nothing(loop_thread, linger_s):
    producers, per_producer = 4, 20_000
    total = producers * per_producer
    bridge = LayerBridge(capacity=total + 1, drain_batch=256, linger_s=linger_s)
    _attach(loop_thread, bridge)

    async def consume():
        got = []
        while len(got) < total:
            batch = await bridge.drain()
            if not batch:
                break
            got.extend(batch)
            if len(got) % 4096 < 256:
                await asyncio.sleep(0)  # let the loop breathe now and then, like a real consumer
        return got

    consumer = loop_thread.submit(consume())
    start = threading.Barrier(producers)
    errors: list[BaseException] = []

    def produce(pid: int) -> None:
        try:
            start.wait(5)
            for seq in range(per_producer):
                bridge.put((pid, seq))
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(pid,)) for pid in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    got = consumer.result(timeout=30)
    assert len(got) == total
    assert len(set(got)) == total                       # nothing duplicated (and so nothing lost)
    for pid in range(producers):
        assert [seq for p, seq in got if p == pid] == list(range(per_producer))  # per-producer order
    assert len(bridge) == 0


def test_put_never_blocks_without_a_consumer():
    bridge = LayerBridge(capacity=100)
    worst = 0.0
    for i in range(100):
        t0 = time.perf_counter()
        bridge.put(i)
        worst = max(worst, time.perf_counter() - t0)
    assert worst < 0.05
    assert len(bridge) == 100
    t0 = time.perf_counter()
    with pytest.raises(BridgeFull):
        bridge.put("one too many")
    assert time.perf_counter() - t0 < 0.05
    assert len(bridge) == 100                           # the refused item was not enqueued


def test_put_never_blocks_with_a_slow_consumer(loop_thread):
    bridge = LayerBridge(capacity=50, drain_batch=1, linger_s=0.0)
    _attach(loop_thread, bridge)
    drained: list = []

    async def slow_consumer():
        while not bridge.closed:
            batch = await bridge.drain()
            if not batch:
                return
            drained.extend(batch)
            await asyncio.sleep(0.05)                   # much slower than the producer

    consumer = loop_thread.submit(slow_consumer())
    full = 0
    worst = 0.0
    deadline = time.monotonic() + 1.0
    i = 0
    while time.monotonic() < deadline and full < 10:
        t0 = time.perf_counter()
        try:
            bridge.put(i)
        except BridgeFull:
            full += 1
        worst = max(worst, time.perf_counter() - t0)
        i += 1
        time.sleep(0.0005)
    assert full >= 1, "a consumer this slow must make the bridge fill up"
    assert worst < 0.05
    assert len(bridge) <= bridge.capacity
    bridge.close("test over")
    consumer.result(timeout=5)
    assert drained == sorted(drained) and len(drained) >= 1


def test_idle_consumer_is_woken(loop_thread):
    bridge = LayerBridge(linger_s=0.0)
    _attach(loop_thread, bridge)
    first = loop_thread.submit(bridge.drain())
    time.sleep(0.05)                                    # consumer is now idle, waiting for a wake-up
    assert not first.done()
    bridge.put("x")
    assert first.result(timeout=2) == ["x"]
    assert bridge.wakeups == 1


def test_close_wakes_a_waiting_consumer(loop_thread):
    bridge = LayerBridge(linger_s=0.0)
    _attach(loop_thread, bridge)
    pending = loop_thread.submit(bridge.drain())
    time.sleep(0.05)
    bridge.close("bye")
    assert pending.result(timeout=2) == []


def test_close_then_put_raises_bridge_closed():
    bridge = LayerBridge()
    bridge.put(1)
    bridge.close("consumer gone")
    bridge.close("second reason is ignored")
    assert bridge.closed
    t0 = time.perf_counter()
    with pytest.raises(BridgeClosed, match="consumer gone"):
        bridge.put(2)
    assert time.perf_counter() - t0 < 0.05
    assert len(bridge) == 1                             # nothing enqueued after the close


def test_items_queued_before_close_are_still_drained(loop_thread):
    bridge = LayerBridge(drain_batch=2, linger_s=0.0)
    _attach(loop_thread, bridge)
    for i in range(5):
        bridge.put(i)
    bridge.close("done")

    async def drain_all():
        out = []
        while batch := await bridge.drain():
            out.append(batch)
        return out

    assert loop_thread.call(drain_all(), timeout=5) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("consumer_state", ["idle", "lingering", "none"])
def test_put_after_loop_thread_stopped_raises(consumer_state):
    lt = LoopThread(name="aiolayer-test-dead")
    bridge = LayerBridge(linger_s=0.0 if consumer_state != "lingering" else 30.0)
    lt.on_exit(lambda error: bridge.close(error or BridgeClosed("loop thread exited")))
    lt.start()
    try:
        _attach(lt, bridge)
        if consumer_state != "none":
            lt.submit(bridge.drain())
            time.sleep(0.05)
    finally:
        lt.stop(timeout=5)
    assert not lt.alive
    assert bridge.closed
    t0 = time.perf_counter()
    with pytest.raises(BridgeClosed):
        bridge.put(("layer", 0, 0))
    assert time.perf_counter() - t0 < 0.05
    assert len(bridge) == 0


def test_put_after_loop_closed_without_on_exit_raises():
    """Even without the on_exit hook an idle consumer's closed loop is noticed by the producer."""
    lt = LoopThread(name="aiolayer-test-dead2")
    lt.start()
    bridge = LayerBridge(linger_s=0.0)
    try:
        _attach(lt, bridge)
        lt.submit(bridge.drain())
        time.sleep(0.05)
    finally:
        lt.stop(timeout=5)
    with pytest.raises(BridgeClosed):
        bridge.put(1)
    assert bridge.closed
    with pytest.raises(BridgeClosed):
        bridge.put(2)
