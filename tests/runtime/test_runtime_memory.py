"""In-process P -> D transfers over the memory backend: data integrity, outcomes, failures, clean-up."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from aiolayer import Identity, TransferSpec, Timeouts
from aiolayer.backends import memory
from aiolayer.errors import ConfigError, ControlRejected, DeadlineExceeded, MetadataError, RuntimeStateError
from aiolayer.kvcache import PagedKVCache, checksums
from aiolayer.protocol import messages as m
from aiolayer.runtime.control.plane import open_sockets

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pd(memory_runtime, memory_decode_node, small_shape):
    """A started D node, a started P runtime and P's filled KV cache (published as P's layout)."""
    d = memory_decode_node(small_shape, engine_id="d")
    p = memory_runtime("p")
    pc = PagedKVCache(small_shape)
    pc.buffer[:] = np.random.default_rng(0).integers(0, 256, pc.buffer.size, dtype=np.uint8)
    p.register_kv_memory(pc.k_base, pc.v_base, small_shape.block_bytes, small_shape.num_blocks)
    return p, d, pc


def alloc(p, d, tid: str, n: int, contiguous: bool) -> m.AllocReply:
    reply = p.request(d.control_endpoint, m.AllocRequest(transfer_id=tid, num_blocks=n, contiguous=contiguous))
    assert isinstance(reply, m.AllocReply) and reply.transfer_id == tid and len(reply.block_ids) == n
    return reply


def spec(d, tid: str, src: list[int], rep: m.AllocReply) -> TransferSpec:
    return TransferSpec.from_registration(rep, src_blocks=src, peer=d.control_endpoint)


def run_step(p, step: int, specs: list[TransferSpec], layers: int) -> None:
    p.sender.begin_step(step, specs)
    for layer in range(layers):
        p.sender.layer_ready(step, layer)
    p.sender.end_step(step)


def verify(p, d, pc, tid: str, src: list[int]) -> m.VerifyReply:
    v = p.request(d.control_endpoint, m.VerifyRequest(transfer_id=tid), timeout=10)
    assert isinstance(v, m.VerifyReply)
    ck, cv = checksums(pc.blocks, src)
    assert v.crc_k == ck and v.crc_v == cv, f"{tid}: KV at D differs from P's source blocks"
    return v


def status(p, d, tid: str) -> m.StatusReply:
    return p.request(d.control_endpoint, m.StatusRequest(transfer_id=tid))


def status_when(p, d, tid: str, want: str, limit: float = 5.0) -> m.StatusReply:
    """P publishes a failure at once and tells D right after: poll D, bounded."""
    deadline = time.monotonic() + limit
    st = status(p, d, tid)
    while st.state != want and time.monotonic() < deadline:
        time.sleep(0.01)
        st = status(p, d, tid)
    return st


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "scattered"])
@pytest.mark.parametrize("src_kind", ["contiguous", "scattered"])
def test_transfer_lands_intact(pd, small_shape, contiguous, src_kind):
    p, d, pc = pd
    n = 10
    src = list(range(3, 3 + n)) if src_kind == "contiguous" else [40, 2, 3, 4, 17, 63, 0, 1, 30, 31]
    rep = alloc(p, d, "t1", n, contiguous)
    if contiguous:
        assert rep.block_ids == list(range(rep.block_ids[0], rep.block_ids[0] + n))
    assert rep.incarnation == d.runtime.incarnation
    run_step(p, 0, [spec(d, "t1", src, rep)], small_shape.num_layers)
    out = p.sender.wait("t1", 10)
    assert out.ok, out.reason
    assert out.reason == ""
    assert out.bytes == 2 * small_shape.num_layers * n * small_shape.block_bytes
    assert [t.layer for t in out.layers] == list(range(small_shape.num_layers))
    for t in out.layers:
        assert t.handed_s <= t.submitted_s <= t.landed_s <= out.finished_s
    v = verify(p, d, pc, "t1", src)
    assert v.state == "finished" and v.reason == ""
    assert status(p, d, "t1").state == "finished"
    assert isinstance(p.request(d.control_endpoint, m.ReleaseRequest(transfer_id="t1")), m.Ack)
    assert d.allocator.free == small_shape.num_blocks
    assert [o.transfer_id for o in p.sender.pop_outcomes()] == ["t1"]


def test_debug_tables_show_a_transfer_while_it_lives_and_nothing_once_it_ended(pd, small_shape):
    """``Runtime.debug_tables``: the plain sizes a leak report compares, read without private attributes."""
    p, d, _ = pd
    rep = alloc(p, d, "dbg", 4, True)
    assert d.runtime.debug_tables()["receiver_entries"] == 1
    run_step(p, 0, [spec(d, "dbg", [1, 2, 3, 4], rep)], small_shape.num_layers)
    assert p.sender.wait("dbg", 10).ok
    p.pop_outcomes()
    p.pop_released()
    tables = p.debug_tables()
    assert all(isinstance(v, int) for v in tables.values()), tables
    assert tables["control_clients"] == 1, tables                  # one client to the one D
    assert tables["sender_live"] == tables["sender_waiters"] == tables["sender_steps"] == 0, tables
    assert tables["sender_outcomes_queued"] == tables["sender_released_queued"] == 0, tables
    assert tables["layout_entries"] == 0 and tables["backend_late"] == 0, tables
    assert isinstance(p.request(d.control_endpoint, m.ReleaseRequest(transfer_id="dbg")), m.Ack)
    assert d.runtime.debug_tables()["receiver_entries"] == 0


def test_untouched_blocks_at_d_stay_zero(pd, small_shape):
    p, d, pc = pd
    rep = alloc(p, d, "t", 4, True)
    run_step(p, 0, [spec(d, "t", [5, 6, 7, 8], rep)], small_shape.num_layers)
    assert p.sender.wait("t", 10).ok
    others = sorted(set(range(small_shape.num_blocks)) - set(rep.block_ids))
    assert not d.cache.blocks[:, :, others].any()      # writes landed only where they were aimed


def test_many_requests_in_one_step(pd, small_shape):
    p, d, pc = pd
    srcs = {"a": [0, 1, 2, 3], "b": [10, 12, 14], "c": [63], "d": list(range(20, 36))}
    reps = {tid: alloc(p, d, tid, len(src), contiguous=(tid != "b")) for tid, src in srcs.items()}
    run_step(p, 7, [spec(d, tid, src, reps[tid]) for tid, src in srcs.items()], small_shape.num_layers)
    for tid, src in srcs.items():
        out = p.sender.wait(tid, 10)
        assert out.ok, (tid, out.reason)
        assert out.bytes == 2 * small_shape.num_layers * len(src) * small_shape.block_bytes
        verify(p, d, pc, tid, src)
    assert p.sender.active == 0


def test_consecutive_steps(pd, small_shape):
    p, d, pc = pd
    for step in range(5):
        tid = f"s{step}"
        src = list(range(step * 8, step * 8 + 8))[::-1]   # reversed: no two blocks merge
        rep = alloc(p, d, tid, 8, contiguous=False)
        run_step(p, step, [spec(d, tid, src, rep)], small_shape.num_layers)
        assert p.sender.wait(tid, 10).ok
        verify(p, d, pc, tid, src)
        p.request(d.control_endpoint, m.ReleaseRequest(transfer_id=tid))
    assert d.allocator.free == small_shape.num_blocks


def test_forward_thread_calls_return_at_once(pd, small_shape):
    """begin_step / layer_ready / end_step only enqueue: bounded and fast on the calling thread."""
    p, d, pc = pd
    rep = alloc(p, d, "fast", 16, True)
    d.runtime.backend.faults.delay_s = 0.2                # slow writes must not slow the forward
    worst = 0.0
    t0 = time.perf_counter()
    p.sender.begin_step(0, [spec(d, "fast", list(range(16)), rep)])
    for layer in range(small_shape.num_layers):
        t = time.perf_counter()
        p.sender.layer_ready(0, layer)
        worst = max(worst, time.perf_counter() - t)
    p.sender.end_step(0)
    assert time.perf_counter() - t0 < 0.1 and worst < 0.05
    out = p.sender.wait("fast", 10)
    assert out.ok
    verify(p, d, pc, "fast", list(range(16)))


# --- failures end in a terminal state on both sides -----------------------------------------------------

def test_backend_failure_is_reported_to_d(pd, small_shape, caplog):
    """Fragility 5: a failed transfer still tells D (FAILED), so D does not wait forever; both sides log it by id."""
    p, d, pc = pd
    rep = alloc(p, d, "bad", 6, False)
    d.runtime.backend.faults.fail = True
    caplog.set_level("WARNING", logger="aiolayer")
    run_step(p, 0, [spec(d, "bad", [1, 2, 3, 4, 5, 6], rep)], small_shape.num_layers)
    out = p.sender.wait("bad", 10)
    assert not out.ok
    assert "injected failure" in out.reason
    st = status_when(p, d, "bad", "failed")
    assert st.state == "failed"
    logged = {r.name for r in caplog.records
              if "transfer bad " in r.getMessage() and "injected failure" in r.getMessage()}
    assert logged >= {"aiolayer.runtime.send.sender", "aiolayer.runtime.receive.receiver"}, caplog.text
    assert "P reported" in st.reason and "injected failure" in st.reason
    # D may free the blocks of a failed transfer (its timer was settled by FAILED)
    assert isinstance(p.request(d.control_endpoint, m.ReleaseRequest(transfer_id="bad")), m.Ack)
    # and the next transfer works again once the fault is gone
    d.runtime.backend.faults.fail = False
    rep2 = alloc(p, d, "good", 3, True)
    run_step(p, 1, [spec(d, "good", [7, 8, 9], rep2)], small_shape.num_layers)
    assert p.sender.wait("good", 10).ok
    verify(p, d, pc, "good", [7, 8, 9])


def test_frozen_peer_times_out_and_d_is_told(memory_runtime, memory_decode_node, small_shape):
    d = memory_decode_node(small_shape, engine_id="d-frozen")
    p = memory_runtime("p-frozen", Timeouts(layer_write=0.2, done_delivery=3))
    pc = PagedKVCache(small_shape)
    p.register_kv_memory(pc.k_base, pc.v_base, small_shape.block_bytes, small_shape.num_blocks)
    rep = alloc(p, d, "frozen", 2, True)
    d.runtime.backend.faults.freeze = True
    t0 = time.monotonic()
    run_step(p, 0, [spec(d, "frozen", [0, 1], rep)], small_shape.num_layers)
    out = p.sender.wait("frozen", 10)
    assert time.monotonic() - t0 < 3
    assert not out.ok and "TransferTimeout" in out.reason
    assert status_when(p, d, "frozen", "failed").state == "failed"


def test_bad_source_block_fails_once_and_tells_d(pd, small_shape):
    p, d, pc = pd
    rep = alloc(p, d, "oob", 2, True)
    run_step(p, 0, [spec(d, "oob", [0, small_shape.num_blocks], rep)], small_shape.num_layers)
    out = p.sender.wait("oob", 10)
    assert not out.ok and "source block id out of range" in out.reason
    assert status_when(p, d, "oob", "failed").state == "failed"


def test_mismatched_block_counts_fail(pd, small_shape):
    p, d, pc = pd
    rep = alloc(p, d, "mm", 3, True)
    run_step(p, 0, [spec(d, "mm", [0, 1], rep)], small_shape.num_layers)
    out = p.sender.wait("mm", 10)
    # D's blocks are of P's size: 2 of P's cannot pair with D's 3 (of other sizes they may, by tokens)
    assert not out.ok and "D's 3 blocks do not pair with our 2" in out.reason, out
    assert status_when(p, d, "mm", "failed").state == "failed"


def test_a_refused_send_writes_nothing_and_d_fails_with_its_reason(pd, small_shape):
    p, d, pc = pd
    rep = alloc(p, d, "refused", 2, True)
    p.refuse_send(spec(d, "refused", [0, 1], rep), "planned for another tensor-parallel size")
    out = p.wait_outcome("refused", 10)
    assert not out.ok and out.bytes == 0 and "another tensor-parallel size" in out.reason
    st = status_when(p, d, "refused", "failed")
    assert st.state == "failed" and "another tensor-parallel size" in st.reason, st
    assert "refused" in p.pop_released()


def test_a_runtime_answers_the_topology_query_with_its_identity_and_no_address(pd, small_shape):
    p, d, pc = pd
    bare = p.request(d.control_endpoint, m.TopologyRequest())
    assert (bare.role, bare.tp_rank, bare.tp_size, bare.dp_rank, bare.dp_size, bare.model) == ("", 0, 1, 0, 1, "")
    assert bare.engine_id == "d" and bare.control == d.control_endpoint and bare.incarnation
    p.set_identity(Identity(role="producer", tp_rank=1, tp_size=2, dp_rank=0, dp_size=3, model="tiny/0a1b"))
    reply = d.runtime.request(p.control_endpoint, m.TopologyRequest())
    said = (reply.role, reply.tp_rank, reply.tp_size, reply.dp_size, reply.model)
    assert said == ("producer", 1, 2, 3, "tiny/0a1b"), said
    assert (reply.incarnation, reply.control) == (p.incarnation, p.control_endpoint)
    assert (reply.num_layers, reply.block_bytes) == (small_shape.num_layers, small_shape.block_bytes)
    assert not {f for f in reply.__struct_fields__ if "base" in f or f == "layers"}   # the layout's summary only
    for bad in (Identity(role="prefill"), Identity(tp_rank=2, tp_size=2), Identity(dp_size=0)):
        with pytest.raises(ConfigError):
            p.set_identity(bad)
    assert p.identity.model == "tiny/0a1b"   # a refused identity changes nothing


def test_stale_incarnation_is_refused(pd, small_shape):
    """Fragility 16: blocks allocated on another incarnation of D are never written."""
    p, d, pc = pd
    rep = alloc(p, d, "stale", 2, True)
    old = TransferSpec(transfer_id="stale", peer=d.control_endpoint, src_blocks=[0, 1], dst_blocks=rep.block_ids,
                       dst_incarnation="an-older-incarnation", token=rep.token)
    run_step(p, 0, [old], small_shape.num_layers)
    out = p.sender.wait("stale", 10)
    assert not out.ok and "StaleLayout" in out.reason
    assert d.runtime.backend.bytes_written == 0


def test_unreachable_d_fails_bounded(memory_runtime, small_shape):
    """Fragilities 1/2: a D that never answers fails the request once, within its deadlines."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    p = memory_runtime("p-dead", Timeouts(control_call=0.2, layout_fetch=0.5, done_delivery=0.5))
    pc = PagedKVCache(small_shape)
    p.register_kv_memory(pc.k_base, pc.v_base, small_shape.block_bytes, small_shape.num_blocks)
    t0 = time.monotonic()
    p.sender.begin_step(0, [TransferSpec(transfer_id="x", peer=dead, src_blocks=[0], dst_blocks=[0],
                                         dst_incarnation="never-seen", token="t" * 32)])
    for layer in range(small_shape.num_layers):
        p.sender.layer_ready(0, layer)                  # never blocks, even with D dead
    assert time.monotonic() - t0 < 0.05
    p.sender.end_step(0)
    out = p.sender.wait("x", 5)
    assert time.monotonic() - t0 < 2.5
    assert not out.ok and out.reason
    assert p.layouts.fetches[dead] == 1                 # one fetch for the request, not one per layer


def test_stop_mid_transfer_publishes_an_outcome(memory_decode_node, small_shape):
    from aiolayer import NodeConfig, Runtime

    d = memory_decode_node(small_shape, engine_id="d-mid")
    p = Runtime(NodeConfig(engine_id="p-mid", backend="memory")).start()
    try:
        pc = PagedKVCache(small_shape)
        p.register_kv_memory(pc.k_base, pc.v_base, small_shape.block_bytes, small_shape.num_blocks)
        rep = alloc(p, d, "mid", 2, True)
        p.sender.begin_step(0, [spec(d, "mid", [0, 1], rep)])
        p.sender.layer_ready(0, 0)                      # the other layers never come
        time.sleep(0.1)
    finally:
        t0 = time.monotonic()
        p.stop()
        assert time.monotonic() - t0 < p.timeouts.shutdown
    out = p.sender.wait("mid", 1)
    assert not out.ok and out.reason
    assert status_via(d, "mid") in ("registered", "failed")   # never "finished": not all layers came


def status_via(d, tid: str) -> str:
    async def get():
        return d.runtime.receiver.state_of(tid)[0]
    return d.runtime.loop_thread.call(get(), timeout=2)


def test_receiver_deadline_fails_the_transfer(memory_runtime, memory_decode_node, small_shape):
    """Seed fragility 8: D's deadline ends the transfer, but its blocks stay fenced until its writer cannot write
    any more (here a P rank that fetched the layout and then cannot be reached: the whole grace)."""
    d = memory_decode_node(small_shape, engine_id="d-deadline", timeouts=Timeouts(receive=0.2, fence_grace=0.4))
    p = memory_runtime("p-deadline")
    rep = alloc(p, d, "late", 2, True)
    p.request(d.control_endpoint, m.LayoutRequest(requester="p-gone", transfer_id="late", token=rep.token,
                                                  control="tcp://127.0.0.1:1"))
    assert status(p, d, "late").state == "registered"
    time.sleep(0.35)
    st = status(p, d, "late")
    assert st.state == "aborting" and "no DONE/FAILED" in st.reason
    with pytest.raises(ControlRejected) as info:        # fenced: P might still be writing
        p.request(d.control_endpoint, m.ReleaseRequest(transfer_id="late"))
    assert info.value.code == "busy"
    time.sleep(0.4)
    st = status(p, d, "late")
    assert st.state == "failed" and "no DONE/FAILED" in st.reason
    assert isinstance(p.request(d.control_endpoint, m.ReleaseRequest(transfer_id="late")), m.Ack)
    assert rep.block_ids


def test_receiver_deadline_frees_at_once_a_transfer_no_p_rank_reached(memory_runtime, memory_decode_node, small_shape):
    """No P rank ever fetched the layout: none can learn where to write any more, so the deadline's
    fence ends at once instead of holding the blocks for the grace."""
    d = memory_decode_node(small_shape, engine_id="d-unreached", timeouts=Timeouts(receive=0.2, fence_grace=30))
    p = memory_runtime("p-unreached")
    rep = alloc(p, d, "unreached", 2, True)
    time.sleep(0.35)
    st = status(p, d, "unreached")
    assert st.state == "failed" and "no DONE/FAILED" in st.reason
    assert isinstance(p.request(d.control_endpoint, m.ReleaseRequest(transfer_id="unreached")), m.Ack)
    with pytest.raises(ControlRejected) as info:        # and a late P is refused the layout
        p.request(d.control_endpoint, m.LayoutRequest(requester="late-p", transfer_id="unreached", token=rep.token))
    assert info.value.code == "auth"


def test_wait_is_bounded(pd):
    p, d, pc = pd
    with pytest.raises(KeyError):
        p.sender.wait("never-begun", 0.1)
    p.sender.begin_step(0, [spec(d, "w", [0], alloc(p, d, "w", 1, True))])
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        p.sender.wait("w", 0.2)                         # layers never come; wait still returns
    assert time.monotonic() - t0 < 0.7


def test_begin_step_before_layout_is_refused(memory_runtime):
    p = memory_runtime("p-nolayout")
    with pytest.raises(RuntimeStateError):
        p.sender.begin_step(0, [])


# --- clean-up --------------------------------------------------------------------------------------------

def test_stop_leaves_no_region_socket_or_thread(small_shape):
    from aiolayer import DecodeNode, NodeConfig, Runtime

    d = DecodeNode(small_shape, NodeConfig(engine_id="d-clean", backend="memory")).start()
    p = Runtime(NodeConfig(engine_id="p-clean", backend="memory")).start()
    try:
        pc = PagedKVCache(small_shape)
        p.register_kv_memory(pc.k_base, pc.v_base, small_shape.block_bytes, small_shape.num_blocks)
        assert p.backend.registered_regions == 2 * small_shape.num_layers
        assert d.runtime.backend.registered_regions == 2 * small_shape.num_layers
        rep = alloc(p, d, "c", 4, False)
        run_step(p, 0, [spec(d, "c", [1, 2, 3, 4], rep)], small_shape.num_layers)
        assert p.sender.wait("c", 10).ok
        assert open_sockets() >= 3                      # D's server, P's server, P's client to D
    finally:
        t0 = time.monotonic()
        p.stop()
        d.stop()
        assert time.monotonic() - t0 < 2 * p.timeouts.shutdown
    assert p.backend.registered_regions == 0
    assert d.runtime.backend.registered_regions == 0
    assert open_sockets() == 0
    assert p.backend.session not in memory._registry and d.runtime.backend.session not in memory._registry
    assert not p.loop_thread.alive and not d.runtime.loop_thread.alive
    assert not [t for t in threading.enumerate() if t.name in ("aiolayer-p-clean", "aiolayer-d-clean")]
    p.stop()                                            # stopping twice is harmless
    with pytest.raises(RuntimeStateError):
        p.start()


# --- layer identity, device events, collectives (seed fragilities 14, 15, 18) ------------------------

def test_layers_are_identified_by_index_not_by_arrival_order(pd, small_shape):
    """Extra hooks (MTP) shifted a counter-based layer id in the seed (fragility 14); the caller names the layer."""
    p, d, pc = pd
    rep = alloc(p, d, "shuffled", 3, False)
    p.sender.begin_step(7, [spec(d, "shuffled", [4, 5, 6], rep)])
    for layer in reversed(range(small_shape.num_layers)):
        p.sender.layer_ready(7, layer)
    p.sender.end_step(7)
    assert p.sender.wait("shuffled", 10).ok
    verify(p, d, pc, "shuffled", [4, 5, 6])     # every layer's K/V landed in that layer's tensors


def test_events_are_polled_never_a_device_wide_synchronize():
    import ast
    import asyncio
    import pathlib

    import aiolayer
    from aiolayer.errors import DeadlineExceeded
    from aiolayer.runtime.send.events import wait_event

    root = pathlib.Path(aiolayer.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                assert node.attr != "synchronize", f"{path.name} calls synchronize()"

    class PendingEvent:
        def __init__(self, ready_after: int) -> None:
            self.queries, self.ready_after = 0, ready_after

        def query(self) -> bool:
            self.queries += 1
            return self.queries > self.ready_after

    event = PendingEvent(ready_after=5)
    asyncio.run(wait_event(event, timeout=2))
    assert event.queries == 6
    with pytest.raises(DeadlineExceeded):
        asyncio.run(wait_event(PendingEvent(ready_after=10 ** 9), timeout=0.05))


def test_no_collective_on_the_connector_path():
    import ast
    import pathlib

    import aiolayer

    for path in pathlib.Path(aiolayer.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("torch.distributed") for n in names), f"{path.name} imports {names}"


def test_source_released_only_after_every_write_settled(memory_runtime, memory_decode_node, small_shape):
    """The seed freed P's blocks with sends still queued (fragility 9); here release waits for the last write."""
    d = memory_decode_node(small_shape, engine_id="d-slow")
    p = memory_runtime("p-fence")
    pc = PagedKVCache(small_shape)
    p.register_kv_memory(pc.k_base, pc.v_base, small_shape.block_bytes, small_shape.num_blocks)
    d.runtime.backend.faults.delay_s = 0.05      # every write takes a while to land
    rep = alloc(p, d, "held", 2, True)
    run_step(p, 1, [spec(d, "held", [0, 1], rep)], small_shape.num_layers)
    released_at = None
    deadline = time.monotonic() + 10
    while released_at is None and time.monotonic() < deadline:
        if "held" in p.sender.pop_released():
            released_at = time.perf_counter()
        time.sleep(0.002)
    assert released_at is not None
    out = p.sender.wait("held", 1)
    assert out.ok and out.source_released and len(out.layers) == small_shape.num_layers
    assert max(t.landed_s for t in out.layers) <= released_at   # no write was still reading the source
    assert status(p, d, "held").state == "finished"


def test_layout_fetch_refused_for_a_stale_token_does_not_fail_the_valid_transfers(pd):
    """D restarted on the same port: transfers allocated on the old one share a fetch with new ones."""
    import asyncio

    p, d, pc = pd
    valid = [alloc(p, d, f"new-{i}", 1, True) for i in range(2)]
    stale = ("gone-with-the-old-incarnation", "s" * 32)

    async def fetch_all():
        waiters = [p.layouts.get(d.control_endpoint, stale)]
        waiters += [p.layouts.get(d.control_endpoint, (r.transfer_id, r.token)) for r in valid]
        return await asyncio.gather(*waiters, return_exceptions=True)

    results = p.loop_thread.call(fetch_all(), timeout=10)
    assert isinstance(results[0], MetadataError) and "auth" in str(results[0]), results[0]
    assert all(getattr(r, "engine_id", None) == "d" for r in results[1:]), results
    assert p.layouts.fetches[d.control_endpoint] <= 1 + len(valid)
