"""In-process P -> D transfers over the memory backend that fail: each ends in a terminal state on both sides."""

from __future__ import annotations

import time

import pytest

from aiolayer import Identity, TransferSpec, Timeouts
from aiolayer.errors import ConfigError, ControlRejected, DeadlineExceeded, RuntimeStateError
from aiolayer.kvcache import PagedKVCache
from aiolayer.protocol import messages as m
from helpers_memory import alloc, run_step, spec, status, status_via, status_when, verify

pytestmark = pytest.mark.timeout(60)


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
