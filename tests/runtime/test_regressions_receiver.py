"""Regressions of D's side and the runtime's plumbing: late DONEs, fences that always end, bad endpoints,
stats from another thread, several senders, the layout only for an accepted transfer.

Real runtimes on the memory backend talking over real control sockets; D's receiver is driven
on its own loop, as the vLLM worker and the decode node drive it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time

import numpy as np
import pytest

from aiolayer import NodeConfig, Runtime, Timeouts, TransferSpec
from aiolayer.errors import ControlError, ControlRejected
from aiolayer.kvcache import PagedKVCache, checksums
from aiolayer.protocol import messages as m
from aiolayer.runtime.control.plane import open_sockets

pytestmark = pytest.mark.timeout(60)

TOKEN = "t" * 32
WRONG = "w" * 32


@pytest.fixture
def runtimes(memory_runtime):
    """Factory: ``runtimes(engine_id, timeouts=None)`` -> a started memory Runtime (conftest's)."""
    return memory_runtime


def on_loop(rt: Runtime, fn, timeout: float = 5.0):
    """Run ``fn()`` on the runtime's loop (where the receiver lives) and return its result."""
    async def run():
        return fn()
    return rt.loop_thread.call(run(), timeout)


def register(rt: Runtime, tid: str, blocks=(1, 2), **kw) -> None:
    # forget=True: as the vLLM bridge registers (the engine owns the blocks; no entry after the result)
    on_loop(rt, lambda: rt.receiver.register(tid, list(blocks), token=kw.pop("token", TOKEN), forget=True, **kw))


def reached(rt: Runtime, tid: str, sender: str, control: str = "") -> None:
    """``sender`` (a P rank at ``control``) fetched the transfer's layout: D's fence asks it from now on."""
    msg = m.LayoutRequest(requester=sender, transfer_id=tid, token=TOKEN, control=control, incarnation="i")
    on_loop(rt, lambda: rt.receiver.admit_writer(msg))


def state(rt: Runtime, tid: str) -> str:
    return on_loop(rt, lambda: rt.receiver.state_of(tid))[0]


def wait_result(rt: Runtime, tid: str, limit: float):
    """(D's published result for ``tid``, seconds it took); fails after ``limit``."""
    start = time.monotonic()
    while True:
        for result in on_loop(rt, rt.receiver.pop_results):
            if result.transfer_id == tid:
                return result, time.monotonic() - start
        assert time.monotonic() - start < limit, f"no result for {tid} after {limit}s (state {state(rt, tid)!r})"
        time.sleep(0.02)


def fence_tasks(rt: Runtime, tid: str) -> int:
    return on_loop(rt, lambda: sum(1 for t in asyncio.all_tasks() if t.get_name() == f"fence {tid}" and not t.done()))


def fence_tasks_after_settling(rt: Runtime, tid: str, within: float = 2.0) -> int:
    """The fence tasks left once the settled transfer's own ends ran: the task finishes a few loop passes
    after the outcome is published (seen still running at the outcome on a loaded box)."""
    deadline = time.monotonic() + within
    while (left := fence_tasks(rt, tid)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


# --- a late DONE for a settled transfer -------------------------------------------------------------

def test_late_done_for_settled_transfer_is_not_applied_to_reregistration(runtimes):
    """A retried DONE after the transfer settled (and was forgotten, as under vLLM) is answered how it
    ended ('already finished'): never kept as an early DONE that a re-registration of the id would
    take as its own success."""
    d = runtimes("d3", Timeouts(receive=30))
    p = runtimes("p3")
    register(d, "t3")
    done = m.Done(transfer_id="t3", sender="p3", layers=4, bytes=4096, token=TOKEN)
    assert p.request(d.control_endpoint, done).detail == "finished"
    assert [r.ok for r in on_loop(d, d.receiver.pop_results)] == [True]

    late = p.request(d.control_endpoint, done)              # the retry of a DONE whose ack was lost
    codes = {}
    for what, call in (("stranger", lambda: p.request(d.control_endpoint, m.Failed(
                            transfer_id="t3", sender="x", reason="x", token=WRONG))),
                       ("register", lambda: register(d, "t3"))):   # the same request parked again
        try:
            call()
        except ControlRejected as exc:
            codes[what] = exc.code
    after = on_loop(d, d.receiver.pop_results)
    assert not any(r.ok for r in after), f"D reported success for blocks never written: {after}"
    assert isinstance(late, m.Ack) and late.detail == "already finished", late
    assert codes == {"stranger": "auth", "register": "settled"}


def test_settled_ids_are_kept_for_the_receive_deadline_only(runtimes):
    """Bounded in time: after Timeouts.receive the id is forgotten and may be registered afresh."""
    d = runtimes("d3b", Timeouts(receive=0.3, fence_grace=0.2))
    register(d, "t3b")
    done = m.Done(transfer_id="t3b", sender="p", token=TOKEN)
    assert on_loop(d, lambda: d.receiver.handle(done)).detail == "finished"
    with pytest.raises(ControlRejected):
        register(d, "t3b")
    time.sleep(0.4)
    register(d, "t3b")                                      # accepted again: nothing early was kept for it
    assert state(d, "t3b") == "registered"


# --- bad endpoints, fences that always end, tasks that cannot cancel the runtime ---------------------

def _refused_without_a_leak(p: Runtime, endpoint) -> None:
    before = open_sockets()
    with pytest.raises(ControlError):
        p.request(endpoint, m.Abort(transfer_id="t5", token=TOKEN))
    assert open_sockets() == before
    with pytest.raises(ControlRejected, match="not served"):     # the runtime still serves
        p.request(p.control_endpoint, m.StatusRequest(transfer_id="x"))


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:\udc80", "tcp://127.0.0.1:5\x00", 12345])
def test_bad_peer_endpoint_is_refused_with_a_control_error_and_no_socket_leaks(runtimes, endpoint):
    _refused_without_a_leak(runtimes("p5"), endpoint)


@pytest.mark.parametrize("endpoint", ["tcp://ü:1", "no-scheme"])
def test_endpoints_zmq_itself_refuses_are_control_errors_too(runtimes, endpoint):
    _refused_without_a_leak(runtimes("p5z"), endpoint)


def _fence_ends(d: Runtime, control: str) -> None:
    register(d, "t5")
    reached(d, "t5", "p", control)
    assert not wait_result(d, "t5", limit=5.0)[0].ok
    assert fence_tasks_after_settling(d, "t5") == 0


def test_fence_ends_when_the_prefill_control_cannot_be_reached(runtimes):
    """A prefill_control D cannot even connect to still ends in failed (was: aborting forever)."""
    _fence_ends(runtimes("d5", Timeouts(receive=0.2, fence_grace=0.6)), "tcp://127.0.0.1:\udc80")


def test_fence_ends_when_the_prefill_control_is_ds_own(runtimes):
    d = runtimes("d5s", Timeouts(receive=0.2, fence_grace=0.6))
    _fence_ends(d, d.control_endpoint)


def test_fence_ends_after_the_grace_when_asking_p_raises(runtimes):
    """A bug in the stop call neither leaves the transfer aborting nor frees its blocks early: the
    grace decides, counted from the end of the writer's window (docs/fencing.md, rule 8)."""
    limits = Timeouts(receive=2.0, fence_grace=1.0)
    d = runtimes("d5b", limits)

    async def broken_stop_sender(*_):
        raise RuntimeError("bug in the stop call")

    on_loop(d, lambda: d.receiver.bind(d.loop_thread.spawn, broken_stop_sender))
    start = time.monotonic()
    register(d, "t5b")
    reached(d, "t5b", "p", "tcp://127.0.0.1:1")
    on_loop(d, lambda: d.receiver.abort("t5b", "client gone"))
    time.sleep(0.3)
    assert state(d, "t5b") == "aborting"                    # P's state is unknown: the grace decides
    assert not wait_result(d, "t5b", limit=8.0)[0].ok
    assert time.monotonic() - start >= limits.receive + limits.fence_grace - 0.1


def test_a_task_that_raises_does_not_cancel_the_runtime(runtimes, caplog):
    d = runtimes("d5c")

    async def bad_request():
        raise OverflowError("Python int too large to convert to C long")

    caplog.set_level(logging.ERROR, logger="aiolayer.runtime.loop")
    on_loop(d, lambda: d.loop_thread.spawn(bad_request(), name="send bad-one"))
    time.sleep(0.2)
    assert d.loop_thread.alive
    register(d, "t5c")                                       # the runtime still serves
    done = m.Done(transfer_id="t5c", sender="p", token=TOKEN)
    assert on_loop(d, lambda: d.receiver.handle(done)).detail == "finished"
    assert d.metrics_snapshot()["task_errors"] == 1
    assert "aiolayer_task_errors_total 1.0" in d.metrics_text()
    assert any("send bad-one" in r.getMessage() for r in caplog.records)


# --- stats from the model-runner thread ------------------------------------------------------------

def test_stats_from_another_thread_while_the_loop_churns_transfers():
    """vLLM's get_kv_connector_stats runs on the model-runner thread: it must never walk the loop's
    dicts (RuntimeError: dictionary changed during iteration), and every count still arrives."""
    pytest.importorskip("vllm")
    import torch
    from aiolayer_vllm.config import BridgeConfig
    from aiolayer_vllm.ranks import Topology
    from aiolayer_vllm.worker import WorkerSide

    blocks = 64
    config = BridgeConfig(node=NodeConfig(engine_id="d6", backend="memory"), timeouts=Timeouts(receive=30))
    worker = WorkerSide(config, is_producer=False, is_consumer=True, num_blocks=blocks,
                        topology=Topology(total_kv_heads=2), block_size=16, head_size=4)
    kv = {f"model.layers.{i}.attn": torch.zeros(blocks, 2, 16, 8) for i in range(2)}   # vLLM CPU's [B, H, N, 2*D]
    worker.register_kv_caches(kv)
    rt = worker.runtime
    stop = threading.Event()
    settled = []

    async def churn():
        n = 0
        while not stop.is_set():
            for _ in range(200):                       # keep many entries alive, add and drop some each turn
                rt.receiver.register(f"c{n}", [1], token=TOKEN, forget=True)
                if n >= 2000:
                    rt.receiver.handle(m.Done(transfer_id=f"c{n - 2000}", sender="p", bytes=1, token=TOKEN))
                    settled.append(n)
                n += 1
            rt.receiver.pop_results()
            await asyncio.sleep(0)

    errors: list[BaseException] = []
    reported = {"receives_finished": 0, "bytes_received": 0}

    read_done = threading.Event()

    def read_stats():
        deadline = time.monotonic() + 3.0
        try:
            while time.monotonic() < deadline:
                try:
                    stats = worker.stats()
                except RuntimeError as exc:
                    errors.append(exc)
                    return
                if stats is not None:
                    for k in reported:
                        reported[k] += stats.data[k]
        finally:
            read_done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)                          # switch threads often: races show up in seconds
    try:
        churner = rt.loop_thread.submit(churn())
        reader = threading.Thread(target=read_stats)
        reader.start()
        read_done.wait(10)   # not join() at this switch interval: CPython 3.11's join can trip its own assert
    finally:
        sys.setswitchinterval(old)
    reader.join(10)
    stop.set()
    churner.result(10)
    try:
        assert not errors, f"stats() raised on the model-runner thread: {errors[0]!r}"
        assert settled, "the loop settled no transfer"
        deadline = time.monotonic() + 5.0                # the last outcomes arrive with a later report
        while reported["receives_finished"] < len(settled) and time.monotonic() < deadline:
            stats = worker.stats()
            if stats is not None:
                for k in reported:
                    reported[k] += stats.data[k]
            time.sleep(0.02)
        assert reported == {"receives_finished": len(settled), "bytes_received": len(settled)}
    finally:
        worker.shutdown()


# --- several senders -------------------------------------------------------------------------------

def test_one_senders_stop_does_not_end_the_fence_of_several(runtimes):
    """Two P ranks write head slices; only rank 0 can be reached to be told to stop. Its 'stopped'
    speaks for itself: the blocks stay fenced until every rank's word (or the grace)."""
    d = runtimes("d10", Timeouts(receive=30, fence_grace=10))
    p = runtimes("p10")                                   # answers 'stopped': it runs nothing of t10
    register(d, "t10", senders=2)
    reached(d, "t10", "rank-0", p.control_endpoint)
    reached(d, "t10", "rank-1", "tcp://127.0.0.1:1")      # nothing listens there: it never confirms
    ack = p.request(d.control_endpoint, m.AbortRequest(transfer_id="t10", reason="client gone", token=TOKEN))
    assert ack.detail == "aborting"
    time.sleep(1.0)
    assert state(d, "t10") == "aborting", "one rank's 'stopped' freed blocks the other rank may still write"
    start = time.monotonic()
    p.request(d.control_endpoint, m.Done(transfer_id="t10", sender="rank-0", bytes=10, token=TOKEN))
    assert state(d, "t10") == "aborting"
    p.request(d.control_endpoint, m.Failed(transfer_id="t10", sender="rank-1", reason="stopped", token=TOKEN))
    assert not wait_result(d, "t10", limit=2.0)[0].ok      # every rank spoke: no need to wait for the grace
    assert time.monotonic() - start < 2.0
    assert fence_tasks_after_settling(d, "t10") == 0


def test_a_single_sender_still_ends_the_fence_with_its_stop(runtimes):
    """The control for ``test_one_senders_stop_does_not_end_the_fence_of_several``: with one sender, its
    'stopped' ends the fence at once."""
    d = runtimes("d10b", Timeouts(receive=30, fence_grace=10))
    p = runtimes("p10b")
    register(d, "t10b")
    reached(d, "t10b", "p10b", p.control_endpoint)
    on_loop(d, lambda: d.receiver.abort("t10b", "client gone"))
    result, took = wait_result(d, "t10b", limit=3.0)
    assert not result.ok and took < 3.0


# --- the layout only for a transfer D accepts -------------------------------------------------------

def _send(p: Runtime, step: int, spec: TransferSpec, layers: int):
    p.sender.begin_step(step, [spec])
    for layer in range(layers):
        p.sender.layer_ready(step, layer)
    p.sender.end_step(step)
    return p.sender.wait(spec.transfer_id, 20)


@pytest.mark.parametrize("dispatch", ["stale", "wrong_token"])
def test_a_transfer_d_refuses_gets_no_layout_and_writes_nothing(memory_decode_node, runtimes, small_shape,
                                                                      dispatch):
    """P already holds D's layout (an earlier transfer). A transfer D would refuse (one D gave up and
    whose blocks now belong to another transfer, or a wrong token) must not write a byte there."""
    d = memory_decode_node(small_shape, engine_id="d11", timeouts=Timeouts(receive=30, fence_grace=0.2))
    p = runtimes("p11")
    pc = PagedKVCache(small_shape)
    pc.buffer[:] = np.random.default_rng(11).integers(1, 256, pc.buffer.size, dtype=np.uint8)
    p.register_kv_memory(pc.k_base, pc.v_base, small_shape.block_bytes, small_shape.num_blocks)
    layers = small_shape.num_layers

    def spec(tid, rep, token=None):
        return TransferSpec(transfer_id=tid, peer=d.control_endpoint, src_blocks=[5, 6], dst_blocks=rep.block_ids,
                            dst_incarnation=rep.incarnation, token=token or rep.token)

    first = p.request(d.control_endpoint, m.AllocRequest(transfer_id="a", num_blocks=2))
    assert _send(p, 1, spec("a", first), layers).ok                      # P now knows D's layout
    gone = p.request(d.control_endpoint, m.AllocRequest(transfer_id="b", num_blocks=2))
    p.request(d.control_endpoint, m.AbortRequest(transfer_id="b", token=gone.token))
    deadline = time.monotonic() + 5
    while p.request(d.control_endpoint, m.StatusRequest(transfer_id="b")).state != "failed":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    p.request(d.control_endpoint, m.ReleaseRequest(transfer_id="b"))
    owner = p.request(d.control_endpoint, m.AllocRequest(transfer_id="c", num_blocks=2))
    assert owner.block_ids == gone.block_ids                            # b's blocks are c's now
    before = p.request(d.control_endpoint, m.VerifyRequest(transfer_id="c"))

    late = spec("b", gone) if dispatch == "stale" else spec("b2", owner, token=WRONG)
    out = _send(p, 2, late, layers)
    after = p.request(d.control_endpoint, m.VerifyRequest(transfer_id="c"))
    assert (after.crc_k, after.crc_v) == (before.crc_k, before.crc_v), "a refused transfer wrote into c's blocks"
    assert not out.ok and out.bytes == 0, out
    assert "auth" in out.reason, out.reason                               # refused before the first write
    assert (after.crc_k, after.crc_v) != checksums(pc.blocks, [5, 6])


# --- no fence task outlives its transfer -------------------------------------------------------------

def test_settled_transfer_leaves_no_fence_task(runtimes):
    d = runtimes("d12", Timeouts(receive=30, fence_grace=30))
    p = runtimes("p12")
    register(d, "t12")
    reached(d, "t12", "p12")                               # an endpoint it never said: the fence waits the grace
    on_loop(d, lambda: d.receiver.abort("t12", "client gone"))
    assert fence_tasks(d, "t12") == 1
    p.request(d.control_endpoint, m.Failed(transfer_id="t12", sender="p12", reason="stopped", token=TOKEN))
    assert not wait_result(d, "t12", limit=2.0)[0].ok
    assert fence_tasks_after_settling(d, "t12") == 0, "the fence task sleeps on after its transfer settled"


def test_an_allocation_of_no_blocks_or_fewer_is_refused_and_takes_nothing(memory_decode_node, memory_runtime):
    """``num_blocks=-1`` took all blocks but one, 0 registered an empty transfer: both are bad_request."""
    d = memory_decode_node(engine_id="d-alloc-bounds")
    p = memory_runtime("p-alloc-bounds", Timeouts())
    free = d.allocator.free
    for num_blocks, contiguous in ((-1, False), (-1, True), (0, False)):
        with pytest.raises(ControlRejected) as exc:
            p.request(d.control_endpoint, m.AllocRequest(transfer_id=f"n{num_blocks}{contiguous}",
                                                         num_blocks=num_blocks, contiguous=contiguous), timeout=5)
        assert exc.value.code == "bad_request" and "num_blocks" in str(exc.value), exc.value
    assert d.allocator.free == free
    assert isinstance(p.request(d.control_endpoint, m.AllocRequest(transfer_id="one", num_blocks=1), timeout=5),
                      m.AllocReply)
