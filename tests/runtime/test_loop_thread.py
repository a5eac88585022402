"""LoopThread (the loop's owner thread), alone and under a real Runtime's sender."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from aiolayer.errors import BridgeClosed, DeadlineExceeded, RuntimeStateError
from aiolayer.runtime.loop import LoopThread


# --- LoopThread -------------------------------------------------------------------------------------

def test_submit_and_call_return_results(loop_thread):
    async def add(a, b):
        await asyncio.sleep(0.001)
        return a + b

    fut = loop_thread.submit(add(1, 2))
    assert isinstance(fut, concurrent.futures.Future)
    assert fut.result(timeout=5) == 3
    assert loop_thread.call(add(2, 3), timeout=5) == 5

    async def on_loop():
        return threading.current_thread().name

    assert loop_thread.call(on_loop(), timeout=5) == "aiolayer-test-loop"


def test_submit_and_call_propagate_exceptions(loop_thread):
    async def boom():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        loop_thread.submit(boom()).result(timeout=5)
    with pytest.raises(ValueError, match="boom"):
        loop_thread.call(boom(), timeout=5)
    # a failed submission does not take the loop (or its TaskGroup) down
    assert loop_thread.alive
    assert loop_thread.call(asyncio.sleep(0, result="still here"), timeout=5) == "still here"


def test_call_deadline_on_a_coroutine_that_never_ends(loop_thread):
    cancelled = threading.Event()

    async def forever():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded) as info:
        loop_thread.call(forever(), timeout=0.2)
    elapsed = time.monotonic() - t0
    assert 0.15 <= elapsed < 1.0
    assert info.value.phase == "loop call"
    assert cancelled.wait(2), "the abandoned coroutine must be cancelled, not left running"
    assert loop_thread.alive


def test_call_that_times_out_and_then_finishes_keeps_the_loop_alive(loop_thread):
    """Regression: a result arriving after ``call`` gave up used to crash the TaskGroup."""
    finished = threading.Event()

    async def slow():
        try:
            await asyncio.sleep(0.3)
        finally:
            finished.set()
        return "late"

    with pytest.raises(DeadlineExceeded):
        loop_thread.call(slow(), timeout=0.05)
    assert finished.wait(2)
    time.sleep(0.05)
    assert loop_thread.alive
    assert loop_thread.call(asyncio.sleep(0, result=1), timeout=5) == 1


def test_stop_is_bounded_with_tasks_that_sleep_forever():
    lt = LoopThread(name="aiolayer-test-stop")
    exits: list = []
    lt.on_exit(exits.append)
    lt.start()
    sleeper = lt.submit(asyncio.sleep(3600))

    async def spawn_sleeper():
        return lt.spawn(asyncio.sleep(3600), name="sleeper")

    task = lt.call(spawn_sleeper(), timeout=5)
    t0 = time.monotonic()
    lt.stop(timeout=3)
    assert time.monotonic() - t0 < 2.0
    assert not lt.alive
    assert task.cancelled()
    assert sleeper.cancelled()
    assert exits == [None]
    coro = asyncio.sleep(0)
    with pytest.raises(RuntimeStateError):
        lt.submit(coro)
    assert coro.cr_frame is None                        # the refused coroutine was closed, not leaked
    with pytest.raises(RuntimeStateError):
        lt.call(asyncio.sleep(0), timeout=1)
    lt.stop(timeout=1)                                  # idempotent


def test_stop_raises_when_a_task_refuses_cancellation():
    lt = LoopThread(name="aiolayer-test-stubborn")
    lt.start()
    release = threading.Event()

    async def stubborn():
        while not release.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                pass                                   # swallows cancellation: a bug in a task

    lt.submit(stubborn())
    time.sleep(0.05)
    try:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            lt.stop(timeout=0.3)
        assert time.monotonic() - t0 < 1.0
    finally:
        release.set()
        lt.stop(timeout=5)
    assert not lt.alive


def test_a_crashing_spawned_task_is_logged_and_counted_and_the_loop_goes_on(caplog):
    """One task's error (one bad request) must not cancel its TaskGroup siblings."""
    lt = LoopThread(name="aiolayer-test-crash")
    exits: list = []
    lt.on_exit(exits.append)
    lt.start()

    async def crash():
        raise RuntimeError("task bug")

    async def spawn_crash():
        return lt.spawn(crash(), name="crash")

    task = lt.call(spawn_crash(), timeout=5)
    lt._thread.join(0.2)
    assert lt.alive and not exits
    assert lt.task_errors == 1 and task.done() and task.result() is None
    assert any("'crash'" in r.getMessage() and "task bug" in r.exc_text for r in caplog.records if r.exc_text)
    assert lt.call(asyncio.sleep(0, result="still serving"), timeout=5) == "still serving"
    lt.stop(timeout=1)
    assert exits == [None]
    with pytest.raises(RuntimeStateError):
        lt.submit(asyncio.sleep(0))


def test_on_stop_closers_run_even_after_a_crash():
    lt = LoopThread(name="aiolayer-test-closer")
    ran: list[str] = []

    async def closer():
        await asyncio.sleep(0)
        ran.append(threading.current_thread().name)

    lt.on_stop(closer)
    lt.start()

    async def spawn_crash():
        async def crash():
            raise RuntimeError("x")
        lt.spawn(crash(), name="crash")

    lt.call(spawn_crash(), timeout=5)
    lt._thread.join(5)
    lt.stop(timeout=1)
    assert ran == ["aiolayer-test-closer"]


def test_lifecycle_errors():
    lt = LoopThread(name="aiolayer-test-life")
    lt.stop()                                           # stop before start: nothing to do
    with pytest.raises(RuntimeStateError):
        lt.loop
    coro = asyncio.sleep(0)
    with pytest.raises(RuntimeStateError):
        lt.submit(coro)
    lt.start()
    try:
        assert lt.alive
        with pytest.raises(RuntimeStateError):
            lt.start()
    finally:
        lt.stop(timeout=5)
    assert not lt.alive
    coro = asyncio.sleep(0)
    with pytest.raises(RuntimeStateError):
        lt.spawn(coro, name="after stop")               # no task group any more
    coro.close()


# --- through the real Runtime: the forward thread learns the sender is gone ------------------------------

def test_layer_ready_after_runtime_stop_raises(memory_runtime):
    rt = memory_runtime("p17a")
    rt.sender.layer_ready(0, 0)                         # fine while the sender is alive
    rt.stop()
    t0 = time.perf_counter()
    with pytest.raises(BridgeClosed):
        rt.sender.layer_ready(0, 1)
    assert time.perf_counter() - t0 < 0.05


def _cancel_task_named(rt, name: str) -> bool:
    async def cancel():
        for task in asyncio.all_tasks():
            if task.get_name() == name:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return True
        return False
    return rt.loop_thread.call(cancel(), timeout=5)


def test_layer_ready_after_sender_task_died_raises(memory_runtime):
    rt = memory_runtime("p17b")
    assert _cancel_task_named(rt, "sender")
    assert rt.loop_thread.alive                         # only the consumer died, not the runtime
    with pytest.raises(BridgeClosed, match="sender stopped"):
        rt.sender.layer_ready(0, 0)
    with pytest.raises(BridgeClosed):
        rt.sender.end_step(0)


def test_sender_crash_closes_bridge_and_stop_leaves_nothing(memory_runtime):
    from aiolayer.runtime.control.plane import open_sockets

    rt = memory_runtime("p17c")

    async def broken_drain():
        raise RuntimeError("drain bug")

    rt.bridge.drain = broken_drain                      # fault injection: the sender task itself crashes
    rt.bridge.put(("end", 0))                           # wakes it; its next drain raises
    deadline = time.monotonic() + 5
    while rt.loop_thread.task_errors == 0:
        assert time.monotonic() < deadline, "the sender task never crashed"
        time.sleep(0.01)
    assert rt.loop_thread.alive                         # a task's crash is not the runtime's
    with pytest.raises(BridgeClosed):                   # but the forward thread learns the sender is gone
        rt.sender.layer_ready(0, 0)
    t0 = time.monotonic()
    rt.stop()
    assert time.monotonic() - t0 < 1.0
    assert rt.backend.registered_regions == 0
    assert open_sockets() == 0                          # stop closed every socket


def test_stop_while_a_transfer_waits_for_ds_layout_leaves_no_socket(memory_runtime):
    """stop() closes the control peers while a transfer still waits for D's layout: the transfer fails
    and then tells D FAILED, which reopened a client to D after the close, a socket that outlived stop."""
    import zmq

    from aiolayer import TransferSpec
    from aiolayer.kvcache import KVShape, PagedKVCache
    from aiolayer.runtime.control.plane import open_sockets

    silent = zmq.Context.instance().socket(zmq.ROUTER)   # a D that takes requests and never answers
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        rt = memory_runtime("p-stop-fetch")
        shape = KVShape(num_layers=2, num_blocks=8, block_size=4, kv_heads=1, head_dim=8)
        cache = PagedKVCache(shape)
        rt.register_kv_memory(cache.k_base, cache.v_base, shape.block_bytes, shape.num_blocks)
        spec = TransferSpec(transfer_id="mid-fetch", peer=f"tcp://127.0.0.1:{port}", src_blocks=[0, 1],
                            dst_blocks=[0, 1], dst_incarnation="d-inc", token="t" * 32)
        step = rt.begin_step([spec])
        for layer in range(shape.num_layers):
            step.layer_ready(layer)
        step.end()
        assert silent.poll(5000), "P never asked D for its layout"
        rt.stop()
        assert open_sockets() == 0
    finally:
        silent.close()


def test_blocking_calls_from_the_loop_thread_are_refused_at_once(memory_runtime):
    """stop(), wait_outcome() or a control request from a callback on the loop (announce, on_outcome)
    blocked the loop for their whole deadline, then raised Python's "cannot join current thread"."""
    from aiolayer.errors import ConfigError
    from aiolayer.protocol import messages as m

    rt = memory_runtime("p-on-loop")

    async def on_the_loop() -> list[str]:
        refused = []
        for call in (rt.stop, lambda: rt.wait_outcome("x", 5), lambda: rt.wait_received("x", 5),
                     lambda: rt.request(rt.control_endpoint, m.StatusRequest(transfer_id="x"), timeout=5)):
            t0 = time.monotonic()
            try:
                call()
            except RuntimeStateError as exc:
                assert time.monotonic() - t0 < 0.5 and "loop thread" in str(exc), exc
                refused.append(type(exc).__name__)
        return refused

    assert rt.loop_thread.call(on_the_loop(), timeout=30) == ["RuntimeStateError"] * 4
    assert rt.loop_thread.alive   # nothing was stopped by the refused stop()
    for timeout in ("soon", None, float("nan"), True):
        with pytest.raises(ConfigError):
            rt.wait_outcome("x", timeout)


def test_stop_racing_start_waits_for_the_open_and_leaves_no_port_bound():
    """stop() from another thread while start() opens the backend: the close ran beside the open, which
    then bound the control port after it; start() returned success and the port stayed bound."""
    import socket

    from aiolayer import NodeConfig, Runtime
    from aiolayer.backends.memory import MemoryBackend
    from aiolayer.runtime.control.plane import open_sockets

    class SlowToOpen(MemoryBackend):
        async def open(self, spawn) -> None:
            await asyncio.sleep(0.3)   # Mooncake's initialize, in a thread
            await super().open(spawn)

        async def close(self) -> None:
            await asyncio.sleep(0.5)
            await super().close()

    rt = Runtime(NodeConfig(engine_id="p-race", backend="memory"), backend=SlowToOpen())
    raised: list[BaseException] = []

    def start() -> None:
        try:
            rt.start()
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            raised.append(exc)

    starter = threading.Thread(target=start)
    starter.start()
    time.sleep(0.1)
    rt.stop()
    starter.join(10)
    assert [type(e) for e in raised] == [RuntimeStateError] and "stopped while it started" in str(raised[0])
    assert not rt.loop_thread.alive
    assert open_sockets() == 0
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", rt.server.port)) != 0   # nobody listens there any more
    with pytest.raises(RuntimeStateError):
        rt.start()
