"""D fences against the P ranks that actually reached a transfer, never against a named endpoint.

The design aiolayer replaces let D believe whichever P endpoint the deployment named: with a prefill
engine of several data-parallel ranks the proxy can name only one, and when another rank ran the
request D's abort asked the wrong one, which answered "stopped" at once (it had no such transfer):
D freed the blocks while the real writer kept writing into them. Here D learns its writers from
their layout requests (engine id, own control endpoint, incarnation) and asks exactly those.

Real runtimes on the memory backend talking over real control sockets; D is a decode node whose
blocks can be checksummed (``VerifyRequest``) before and after.
"""

from __future__ import annotations

import time

import msgspec
import pytest

from aiolayer import KVShape, ReceiveSpec, Timeouts, TransferSpec
from aiolayer.errors import ControlRejected, DeadlineExceeded
from aiolayer.kvcache import checksums
from aiolayer.protocol import messages as m

from helpers_memory import host_cache
from helpers_step import d_crcs as crcs, d_state
from test_regressions_sender import SHAPE, alloc, p_runtime, spec_for

pytestmark = pytest.mark.timeout(60)


def wait_state(p, endpoint: str, tid: str, want: str, limit: float) -> float:
    """Seconds until D's transfer is in state ``want``; fails after ``limit``."""
    start = time.monotonic()
    while (got := d_state(p, endpoint, tid)) != want:
        assert time.monotonic() - start < limit, f"{tid} still {got!r} after {limit}s"
        time.sleep(0.01)
    return time.monotonic() - start


def test_d_fence_asks_the_p_rank_that_wrote_not_the_one_it_was_named(memory_runtime, memory_decode_node):
    """P's DP rank 1 runs the request; the registration names DP rank 0 (all a proxy can name). D's
    abort must wait for rank 1 to be quiet: rank 0's instant "stopped" (it never had the transfer)
    must not free blocks rank 1 still writes into."""
    d = memory_decode_node(SHAPE, engine_id="d-dp", timeouts=Timeouts(fence_grace=30))
    rank0 = memory_runtime("p-dp0")                        # named, never runs the transfer
    rank1, _ = p_runtime(memory_runtime, "p-dp1")          # runs it
    rep = alloc(rank1, d.control_endpoint, "dp", 3, sender_control=rank0.control_endpoint)
    empty = crcs(rank1, d.control_endpoint, "dp")
    rank1.sender.begin_step(0, [spec_for(d.control_endpoint, "dp", [4, 5, 6], rep)])
    rank1.sender.layer_ready(0, 0)
    deadline = time.monotonic() + 5
    while crcs(rank1, d.control_endpoint, "dp")[0][0] == empty[0][0]:   # until layer 0 landed
        assert time.monotonic() < deadline, "layer 0 never landed"
        time.sleep(0.01)

    rank1.request(d.control_endpoint, m.AbortRequest(transfer_id="dp", reason="client gone", token=rep.token))
    took = wait_state(rank1, d.control_endpoint, "dp", "failed", limit=10)
    at_release = crcs(rank1, d.control_endpoint, "dp")
    rank1.request(d.control_endpoint, m.ReleaseRequest(transfer_id="dp"))
    reused = alloc(rank0, d.control_endpoint, "next", 3)
    assert reused.block_ids == rep.block_ids               # the freed blocks belong to another transfer now
    before_next = crcs(rank0, d.control_endpoint, "next")

    for layer in range(1, SHAPE.num_layers):               # rank 1's forward goes on, as a real engine's does
        rank1.sender.layer_ready(0, layer)
    rank1.sender.end_step(0)
    out = rank1.sender.wait("dp", 10)
    print(f"D failed the transfer {took * 1e3:.1f} ms after the abort; rank 1: {out.reason!r}")
    assert not out.ok and "client gone" in out.reason, out   # rank 1 itself was told to stop
    assert crcs(rank0, d.control_endpoint, "next") == before_next, "a write landed in blocks D had released"
    assert at_release[0][1:] == empty[0][1:], "layers rank 1 was never handed over landed before the abort"


def test_a_plan_with_another_number_of_writers_fails_before_any_write(memory_runtime, memory_decode_node):
    """D registered one writer (the proxy was told P has TP=1) but P's plan says two P ranks write head
    slices: D refuses the layout and fails the transfer at once, naming both numbers, instead of
    finishing on one rank's DONE with half the heads never written."""
    d = memory_decode_node(SHAPE, engine_id="d-w", timeouts=Timeouts(fence_grace=30))
    p, _ = p_runtime(memory_runtime, "p-w")
    rep = alloc(p, d.control_endpoint, "w", 2)
    before = crcs(p, d.control_endpoint, "w")
    spec = spec_for(d.control_endpoint, "w", [1, 2], rep, writers=2)
    p.sender.begin_step(0, [spec])
    for layer in range(SHAPE.num_layers):
        p.sender.layer_ready(0, layer)
    p.sender.end_step(0)
    out = p.sender.wait("w", 10)
    assert not out.ok and out.bytes == 0 and "writers" in out.reason, out
    assert "2 P ranks" in out.reason and "for 1" in out.reason, out.reason
    assert wait_state(p, d.control_endpoint, "w", "failed", limit=2) < 2
    status = p.request(d.control_endpoint, m.StatusRequest(transfer_id="w"), timeout=5)
    assert "disagree" in status.reason, status
    assert crcs(p, d.control_endpoint, "w") == before


def test_a_p_rank_beyond_the_registered_writers_is_refused_the_layout(memory_runtime, memory_decode_node):
    d = memory_decode_node(SHAPE, engine_id="d-x")
    first = memory_runtime("p-first")
    second, _ = p_runtime(memory_runtime, "p-second")
    rep = alloc(first, d.control_endpoint, "x", 2)
    first.request(d.control_endpoint, m.LayoutRequest(requester="p-first", transfer_id="x", token=rep.token,
                                                      control=first.control_endpoint))
    with pytest.raises(ControlRejected) as info:
        second.request(d.control_endpoint, m.LayoutRequest(requester="p-second", transfer_id="x", token=rep.token,
                                                           control=second.control_endpoint))
    assert info.value.code == "sender" and "p-first" in info.value.reason
    with pytest.raises(ControlRejected) as info:          # the same id from another process: refused too
        second.request(d.control_endpoint, m.LayoutRequest(requester="p-first", transfer_id="x", token=rep.token,
                                                           control=second.control_endpoint))
    assert info.value.code == "sender"
    with pytest.raises(ControlRejected) as info:          # ... also one naming no control (no fence could ask it)
        second.request(d.control_endpoint, m.LayoutRequest(requester="p-first", transfer_id="x", token=rep.token))
    assert info.value.code == "sender"
    again = first.request(d.control_endpoint, m.LayoutRequest(requester="p-first", transfer_id="x", token=rep.token,
                                                              control=first.control_endpoint))
    assert isinstance(again, m.LayoutReply)               # the writer itself may ask again
    assert d_state(first, d.control_endpoint, "x") == "registered"


def test_two_writers_each_confirming_ends_the_fence_without_the_grace(memory_runtime, memory_decode_node):
    """Head slices from two P ranks: each reached the transfer and each answers 'stopped' for itself;
    once both did, nothing can land and the fence ends long before its grace."""
    d = memory_decode_node(SHAPE, engine_id="d-2w", timeouts=Timeouts(fence_grace=30))
    a, b = memory_runtime("p-a"), memory_runtime("p-b")
    rep = alloc(a, d.control_endpoint, "2w", 2, senders=2)
    for p in (a, b):
        p.request(d.control_endpoint, m.LayoutRequest(requester=p.node.engine_id, transfer_id="2w", token=rep.token,
                                                      control=p.control_endpoint, incarnation=p.incarnation))
    a.request(d.control_endpoint, m.AbortRequest(transfer_id="2w", reason="client gone", token=rep.token))
    assert wait_state(a, d.control_endpoint, "2w", "failed", limit=5) < 5
    assert d.runtime.receiver.fences_unconfirmed == 0


def test_a_fence_that_ends_on_the_grace_alone_is_counted(memory_runtime, memory_decode_node):
    """A writer that reached the transfer and then went away can never say it stopped: D frees the blocks
    on time alone, ``fence_grace`` after the writer's window ended (it may have been cut off from the
    Abort only, and writes until then: docs/fencing.md, rule 8), and counts it
    (``aiolayer_fences_unconfirmed_total``: a release not on its writers' word, which a test or an
    operator can watch)."""
    limits = Timeouts(fence_grace=1.0, receive=2.5)
    d = memory_decode_node(SHAPE, engine_id="d-gone", timeouts=limits)
    gone, asker = memory_runtime("p-gone"), memory_runtime("p-asker")
    registered = time.monotonic()
    rep = alloc(gone, d.control_endpoint, "gone", 2)
    granted = gone.request(d.control_endpoint, m.LayoutRequest(
        requester=gone.node.engine_id, transfer_id="gone", token=rep.token, control=gone.control_endpoint,
        incarnation=gone.incarnation))
    assert 0 < granted.window <= limits.receive
    gone.stop()
    asker.request(d.control_endpoint, m.AbortRequest(transfer_id="gone", reason="client gone", token=rep.token))
    assert d_state(asker, d.control_endpoint, "gone") == "aborting"
    wait_state(asker, d.control_endpoint, "gone", "failed", limit=10)
    took = time.monotonic() - registered
    assert limits.receive + limits.fence_grace - 0.1 < took < limits.receive + limits.fence_grace + 3, took
    assert d.runtime.receiver.fences_unconfirmed == 1
    assert "aiolayer_fences_unconfirmed_total 1.0" in d.runtime.metrics_text()


def test_a_done_for_another_process_of_d_finishes_nothing(memory_runtime, memory_decode_node):
    """The DONE names the incarnation of D its writes went to: one for an earlier process of this D (the
    same id and token registered again after a restart) vouches for blocks nobody wrote here. Refused,
    alone or in a batch; the transfer waits for its own writer's DONE."""
    d = memory_decode_node(SHAPE, engine_id="d-inc")
    p = memory_runtime("p-inc")
    rep = alloc(p, d.control_endpoint, "inc", 2)
    stale = m.Done(transfer_id="inc", sender="p-inc", token=rep.token, incarnation="an-earlier-d", layers=1, bytes=1)
    with pytest.raises(ControlRejected) as info:
        p.request(d.control_endpoint, stale)
    assert info.value.code == "sender" and "another process" in info.value.reason
    (item,) = p.request(d.control_endpoint, m.DoneBatch(items=[stale]), timeout=5).items
    assert isinstance(item, m.Nack) and item.code == "sender", item
    assert d_state(p, d.control_endpoint, "inc") == "registered"
    done = msgspec.structs.replace(stale, incarnation=rep.incarnation)
    assert p.request(d.control_endpoint, done, timeout=5).detail == "finished"


def test_a_word_from_another_process_under_the_writers_id_settles_nothing(memory_runtime):
    """Two P processes under one engine id (replicas sharing a config) both get transfer x. D shows the
    layout to the first and refuses the second (another process); the second then fails having written
    nothing, and its FAILED, under the same sender name, was the writer's word: D settled the transfer and
    released the blocks while the first still wrote into them. Now it is refused; the writer's own DONE ends it."""
    d, p1, p2 = memory_runtime("d-twin"), memory_runtime("p-twin"), memory_runtime("p-twin")
    shape = KVShape(num_layers=4, num_blocks=16, block_size=16, kv_heads=2, head_dim=64)
    landed = host_cache(d, shape, None)
    source = host_cache(p1, shape, 1)
    host_cache(p2, shape, 2)
    reg = d.receive(ReceiveSpec(transfer_id="x", block_ids=[0, 1, 2, 3], token="t" * 32))
    spec = TransferSpec.from_registration(reg, src_blocks=[4, 5, 6, 7])
    first = p1.begin_step([spec])
    first.layer_ready(0)
    deadline = time.monotonic() + 5
    while not ((entry := d.receiver._entries.get("x")) and entry.writers.knows("p-twin")):   # shown the layout
        assert time.monotonic() < deadline, "the first P never asked for the layout"
        time.sleep(0.01)
    second = p2.begin_step([spec])
    for layer in range(shape.num_layers):
        second.layer_ready(layer)
    second.end()
    assert "another process" in p2.wait_outcome("x", 10).reason
    with pytest.raises(DeadlineExceeded):   # no result (the release) while the first still writes
        d.wait_received("x", 1.0)
    for layer in range(1, shape.num_layers):
        first.layer_ready(layer)
    first.end()
    assert p1.wait_outcome("x", 10).ok and d.wait_received("x", 10).ok
    assert checksums(landed.blocks, [0, 1, 2, 3]) == checksums(source.blocks, [4, 5, 6, 7])


def test_a_writer_that_already_ended_its_part_is_not_shown_the_layout_again(memory_runtime, memory_decode_node):
    """Head slices from two P ranks: A fails its part (its FAILED marks it quiet) while B still writes. A
    new start of the id at A (its engine may start it again once released) asking for the layout is
    ``ended``: granted, it would write while D counts it quiet, and B's word would settle the transfer,
    or an abort's fence ask only B, with A's writes still landing."""
    d = memory_decode_node(SHAPE, engine_id="d-again")
    a, b = memory_runtime("p-a2"), memory_runtime("p-b2")
    rep = alloc(a, d.control_endpoint, "again", 2, senders=2)

    def layout(p):
        return p.request(d.control_endpoint, m.LayoutRequest(requester=p.node.engine_id, transfer_id="again",
                                                             token=rep.token, control=p.control_endpoint,
                                                             incarnation=p.incarnation), timeout=5)
    layout(a), layout(b)
    a.request(d.control_endpoint, m.Failed(transfer_id="again", sender="p-a2", reason="cancelled", token=rep.token,
                                           sender_incarnation=a.incarnation), timeout=5)
    with pytest.raises(ControlRejected) as info:
        layout(a)
    assert info.value.code == "ended" and "already ended" in info.value.reason
    assert isinstance(layout(b), m.LayoutReply)   # B, still writing, is shown it as before
