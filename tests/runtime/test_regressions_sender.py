"""Regressions on P's side (sender, Mooncake backend): no FAILED or release while a write may land,
cancels, bad specs, early aborts.

Memory-backend tests run P and D in this process; ``faults.stall_s`` makes a write outlive its
deadline and land later, as a timed-out Mooncake write may. The Mooncake tests run D as an
``aiolayer node`` subprocess and stop it (SIGSTOP) to hold a real write in flight.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import numpy as np
import pytest

from helpers_node import SMALL_SHAPE, apply_mc_env, freeze, stoppable_node, until_streaming
from helpers_step import d_state

apply_mc_env()  # before any Mooncake engine exists in this process

from aiolayer import NodeConfig, Runtime, Timeouts, TransferSpec
from aiolayer.errors import ConfigError, ControlRejected, WriteRefused
from aiolayer.kvcache import PagedKVCache, checksums
from aiolayer.protocol import messages as m
from aiolayer.runtime.send.fence import MAX_EARLY_ABORTS

pytestmark = pytest.mark.timeout(90)
SHAPE = SMALL_SHAPE


def p_runtime(make, engine_id: str, timeouts: Timeouts | None = None):
    p = make(engine_id, timeouts)
    cache = PagedKVCache(SHAPE)
    cache.buffer[:] = np.random.default_rng(11).integers(1, 256, cache.buffer.size, dtype=np.uint8)
    p.register_kv_memory(cache.k_base, cache.v_base, SHAPE.block_bytes, SHAPE.num_blocks)
    return p, cache


def alloc(p, endpoint: str, tid: str, n: int, **kw) -> m.AllocReply:
    reply = p.request(endpoint, m.AllocRequest(transfer_id=tid, num_blocks=n, **kw), timeout=5)
    assert isinstance(reply, m.AllocReply), reply
    return reply


def spec_for(endpoint: str, tid: str, src: list[int], rep: m.AllocReply, **kw) -> TransferSpec:
    fields = dict(transfer_id=tid, peer=endpoint, src_blocks=src, dst_blocks=rep.block_ids,
                  dst_incarnation=rep.incarnation, token=rep.token)
    fields.update(kw)
    return TransferSpec(**fields)


def run_step(p, step: int, specs, layers: int = SHAPE.num_layers) -> None:
    p.sender.begin_step(step, specs)
    for layer in range(layers):
        p.sender.layer_ready(step, layer)
    p.sender.end_step(step)


def abort_at_p(p, tid: str, token: str) -> str:
    """What D's fence hears from P (``Abort`` over P's control port): "stopped" or the Nack code."""
    try:
        return p.request(p.control_endpoint, m.Abort(transfer_id=tid, reason="test", token=token), timeout=5).detail
    except ControlRejected as exc:
        return exc.code


def released_within(p, tid: str, limit: float) -> float | None:
    """perf_counter when ``tid`` came out of ``pop_released``, or None within ``limit`` seconds."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if tid in p.sender.pop_released():
            return time.perf_counter()
        time.sleep(0.01)
    return None


# --- FAILED / "stopped" only once no write can land -------------------------------------------------

def test_failed_and_stopped_only_once_no_write_can_land(memory_runtime, memory_decode_node):
    """A write timed out and still lands 3 s later; the quarantine (0.5 s) ends first. Until the
    write ended, D's abort must get ``settling`` and D must not hear FAILED (it would free the
    blocks the write then lands in)."""
    d = memory_decode_node(SHAPE, engine_id="d-landing")
    p, cache = p_runtime(memory_runtime, "p-landing", Timeouts(layer_write=0.3, quarantine=0.5, cleanup=0.3,
                                                         done_delivery=1.0, control_call=0.5))
    rep = alloc(p, d.control_endpoint, "landing", 2)
    d.runtime.backend.faults.stall_s = 3.0
    t0 = time.perf_counter()
    run_step(p, 0, [spec_for(d.control_endpoint, "landing", [4, 5], rep)])
    out = p.sender.wait("landing", 5)
    assert not out.ok and "TransferTimeout" in out.reason and not out.source_released
    time.sleep(max(0.0, t0 + 1.4 - time.perf_counter()))         # past quarantine + cleanup
    assert p.sender.fence_timeouts == 1
    assert d_state(p, d.control_endpoint, "landing") == "registered"   # no FAILED while the write may land
    assert abort_at_p(p, "landing", rep.token) == "settling"
    assert "landing" not in p.sender.pop_released()
    landed = released_within(p, "landing", 5)
    assert landed is not None and landed - t0 >= 2.9, "source released before the stalled write landed"
    assert abort_at_p(p, "landing", rep.token) == "stopped"            # now nothing can land
    v = p.request(d.control_endpoint, m.VerifyRequest(transfer_id="landing"), timeout=5)
    assert v.crc_k[0] == checksums(cache.blocks, [4, 5])[0][0]   # the late write did land at D
    assert d_state(p, d.control_endpoint, "landing") == "registered"   # D's own deadline and fence take over


def test_an_id_started_again_after_its_outcome_is_out_gets_a_failure_of_its_own(memory_runtime,
                                                                              memory_decode_node):
    """The id's transfer has its outcome out but still runs (a write timed out and may land: the source
    stays held). Starting the id again is ignored, and its ``wait`` answers at once with a failure (it
    would sleep to its timeout); it is popped like any outcome and leaves no slot behind."""
    d = memory_decode_node(SHAPE, engine_id="d-again")
    p, _ = p_runtime(memory_runtime, "p-again", Timeouts(layer_write=0.3, quarantine=0.5, cleanup=0.3,
                                                         done_delivery=1.0, control_call=0.5))
    spec = spec_for(d.control_endpoint, "again", [4, 5], alloc(p, d.control_endpoint, "again", 2))
    d.runtime.backend.faults.stall_s = 3.0
    run_step(p, 0, [spec])
    first = p.sender.wait("again", 5)
    assert not first.ok and not first.source_released, first
    assert [o.reason for o in p.sender.pop_outcomes()] == [first.reason]
    for step, again in ((1, lambda: run_step(p, 1, [spec])), (2, lambda: p.sender.refuse(spec, "no room"))):
        again()
        t0 = time.monotonic()
        second = p.sender.wait("again", 5)
        assert time.monotonic() - t0 < 1 and not second.ok and "again while" in second.reason, (step, second)
        assert [o.reason for o in p.sender.pop_outcomes()] == [second.reason]
    assert p.sender.table_sizes()["waiters"] == 0 and p.sender.outcome_counts["duplicate"] == 2
    assert released_within(p, "again", 5) is not None   # the first one's source, once its write ended


def test_sender_stop_does_not_declare_live_writes_quiet(memory_runtime, memory_decode_node):
    """The sender's loop ends (its bridge closed) with writes still in flight: the transfers must
    stay not-quiet (abort: ``settling``, no FAILED) until those writes ended; FAILED after that."""
    d = memory_decode_node(SHAPE, engine_id="d-live")
    p, _ = p_runtime(memory_runtime, "p-live", Timeouts(layer_write=0.3, quarantine=10.0, cleanup=0.3,
                                                       done_delivery=1.0, control_call=0.5))
    ep = d.control_endpoint
    reps = {tid: alloc(p, ep, tid, 2) for tid in ("aborted", "told")}
    d.runtime.backend.faults.stall_s = 2.5
    t0 = time.perf_counter()
    run_step(p, 0, [spec_for(ep, "aborted", [1, 2], reps["aborted"]), spec_for(ep, "told", [3, 4], reps["told"])])
    assert not p.sender.wait("aborted", 5).ok and not p.sender.wait("told", 5).ok
    p.bridge.close("test: the sender's loop side ends")
    time.sleep(0.3)
    assert d_state(p, ep, "told") == "registered"               # no FAILED while its writes may land
    assert abort_at_p(p, "aborted", reps["aborted"].token) == "settling"
    assert released_within(p, "told", 5) is not None
    deadline = time.monotonic() + 3
    while d_state(p, ep, "told") != "failed" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert d_state(p, ep, "told") == "failed"
    assert time.perf_counter() - t0 >= 2.4                        # FAILED reached D only after the writes ended
    assert abort_at_p(p, "aborted", reps["aborted"].token) == "stopped"


# --- every exception of Mooncake's write() carries what may still land -------------------------------

@pytest.fixture
def frozen_d():
    with stoppable_node(SHAPE) as node:
        yield node


@pytest.fixture
def mooncake_p():
    made = []

    def make(engine_id: str, timeouts: Timeouts):
        rt = Runtime(NodeConfig(engine_id=engine_id, backend="mooncake"), timeouts).start()
        made.append(rt)
        return rt

    yield make
    for rt in made:
        rt.stop()


def test_first_write_to_a_stopped_peer_stays_fenced_until_its_submit_ends(frozen_d, mooncake_p):
    """The first write to a new target opens its segment in a thread; D is stopped, so that blocks
    past the deadline and the submit happens later. P must keep the source until then."""
    p, cache = p_runtime(lambda e, t: mooncake_p(e, t), "p-first-write",
                         Timeouts(layer_write=1.0, quarantine=30.0, done_delivery=1.0, control_call=0.5))
    src = list(range(8, 16))
    rep = alloc(p, frozen_d.control, "first-write", len(src))
    spec = spec_for(frozen_d.control, "first-write", src, rep)
    p.sender.begin_step(0, [spec])
    until_streaming(p, "first-write")
    freeze(frozen_d.pid)   # every thread stopped: a run could otherwise still land before it
    for layer in range(SHAPE.num_layers):
        p.sender.layer_ready(0, layer)
    p.sender.end_step(0)
    out = p.sender.wait("first-write", 10)
    assert not out.ok and "TransferTimeout" in out.reason, out
    assert not out.source_released, "the submit still running in its thread was not fenced"
    assert released_within(p, "first-write", 1.0) is None
    assert p.backend.quarantined >= 1
    os.kill(frozen_d.pid, signal.SIGCONT)
    assert released_within(p, "first-write", 15) is not None
    assert p.backend.quarantined == 0
    v = p.request(frozen_d.control, m.VerifyRequest(transfer_id="first-write"), timeout=5)
    assert v.crc_k[0] == checksums(cache.blocks, src)[0][0]     # the late submit did write D's blocks


class _RefuseSecondSubmit:
    """The real engine, except that its second ``transfer_submit_write`` is refused (returns 0), as
    Mooncake does when a segment cannot be opened: a refusal cannot be timed otherwise."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.calls = 0

    def transfer_submit_write(self, *args):
        self.calls += 1
        return 0 if self.calls == 2 else self._engine.transfer_submit_write(*args)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_refused_submit_after_a_timed_out_run_hands_over_its_pending(frozen_d, mooncake_p):
    p, cache = p_runtime(lambda e, t: mooncake_p(e, t), "p-refused", Timeouts(layer_write=2.0, control_call=0.5))
    rep = alloc(p, frozen_d.control, "refused", 4)
    layout = p.request(frozen_d.control, m.LayoutRequest(transfer_id="refused", token=rep.token), timeout=5)
    dst = layout.layers[0].k_base + rep.block_ids[0] * SHAPE.block_bytes
    src = cache.k_base[0]
    one = np.array([src], dtype=np.int64), np.array([dst], dtype=np.int64), np.array([SHAPE.block_bytes])
    backend = p.backend
    p.loop_thread.call(backend.write(layout.session, *one, 2.0), timeout=5)   # opens the segment
    real = backend._engine
    backend._engine = _RefuseSecondSubmit(real)
    freeze(frozen_d.pid)   # every thread stopped: a run could otherwise still land before it
    two = [np.concatenate([a, a]) for a in one]

    async def write() -> BaseException | None:
        try:
            await backend.write(layout.session, *two, 0.5)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc
        return None

    try:
        exc = p.loop_thread.call(write(), timeout=5)
    finally:
        backend._engine = real
    assert isinstance(exc, WriteRefused) and len(exc.pending) == 1, repr(exc)
    assert not exc.pending[0].done() and backend.quarantined == 1
    os.kill(frozen_d.pid, signal.SIGCONT)

    async def settled() -> None:
        await asyncio.wait_for(asyncio.shield(exc.pending[0]), 10)
    p.loop_thread.call(settled(), timeout=12)
    assert backend.quarantined == 0


# --- the engine cancels a running send -----------------------------------------------------------------

def test_cancel_stops_the_send_fails_it_and_tells_d_once_quiet(memory_runtime, memory_decode_node):
    d = memory_decode_node(SHAPE, engine_id="d-cancel")
    p, cache = p_runtime(memory_runtime, "p-cancel")
    rep = alloc(p, d.control_endpoint, "cancel", 3)
    d.runtime.backend.faults.delay_s = 0.4            # layer 0's write is in flight when the cancel comes
    before = p.request(d.control_endpoint, m.VerifyRequest(transfer_id="cancel"), timeout=5)
    p.sender.begin_step(0, [spec_for(d.control_endpoint, "cancel", [7, 8, 9], rep)])
    p.sender.layer_ready(0, 0)
    time.sleep(0.15)
    p.sender.cancel("cancel", "preempted by the scheduler")
    p.sender.cancel("no-such-transfer", "ignored")
    for layer in range(1, SHAPE.num_layers):
        p.sender.layer_ready(0, layer)
    p.sender.end_step(0)
    out = p.sender.wait("cancel", 5)
    assert not out.ok and "preempted by the scheduler" in out.reason, out
    assert [t.layer for t in out.layers] == [0]       # no layer submitted after the cancel
    released = released_within(p, "cancel", 5)
    assert released is not None and released >= out.layers[0].landed_s
    deadline = time.monotonic() + 3
    while d_state(p, d.control_endpoint, "cancel") != "failed" and time.monotonic() < deadline:
        time.sleep(0.02)
    after = p.request(d.control_endpoint, m.VerifyRequest(transfer_id="cancel"), timeout=5)
    assert after.state == "failed" and "preempted by the scheduler" in after.reason, after
    assert after.crc_k[0] == checksums(cache.blocks, [7, 8, 9])[0][0]
    assert after.crc_k[1:] == before.crc_k[1:] and after.crc_v[1:] == before.crc_v[1:]
    d.runtime.backend.faults.delay_s = 0.0
    rep2 = alloc(p, d.control_endpoint, "cancel-next", 2)
    run_step(p, 1, [spec_for(d.control_endpoint, "cancel-next", [1, 2], rep2)])
    assert p.sender.wait("cancel-next", 5).ok


# --- one bad spec fails alone ------------------------------------------------------------------------

def test_bad_specs_fail_alone_and_the_runtime_keeps_serving(memory_runtime, memory_decode_node):
    d = memory_decode_node(SHAPE, engine_id="d-bad-spec")
    p, cache = p_runtime(memory_runtime, "p-bad-spec", Timeouts(control_call=0.5, done_delivery=1.0, layout_fetch=1.0))
    ep = d.control_endpoint
    reps = {tid: alloc(p, ep, tid, 2) for tid in ("good-1", "huge", "negative", "lengths", "garbage", "good-2")}
    bad = {
        "huge": spec_for(ep, "huge", [0, 1], reps["huge"], dst_blocks=[2 ** 63, 1]),
        "negative": spec_for(ep, "negative", [0, 1], reps["negative"], dst_blocks=[-1, 0]),
        "lengths": spec_for(ep, "lengths", [0, 1, 2], reps["lengths"]),
        "garbage": spec_for(ep, "garbage", "ab", reps["garbage"]),
        "surrogate": TransferSpec(transfer_id="surrogate", peer="tcp://127.0.0.1:1\ud800", src_blocks=[0],
                                  dst_blocks=[0], dst_incarnation="x", token="t" * 32),
    }
    good = [spec_for(ep, "good-1", [10, 11], reps["good-1"]), spec_for(ep, "good-2", [20, 21], reps["good-2"])]
    run_step(p, 0, [good[0], *bad.values(), {"not": "a spec"}, good[1]])
    for spec in good:
        assert p.sender.wait(spec.transfer_id, 5).ok, spec.transfer_id
    for tid in bad:
        out = p.sender.wait(tid, 5)
        # unequal block lists are a valid spec (P's and D's blocks may differ in size): D's layout, whose
        # blocks are of P's size here, refuses that one
        why = "do not pair with our 3" if tid == "lengths" else "invalid transfer spec"
        assert not out.ok and why in out.reason, (tid, out)
    for tid in ("huge", "negative", "lengths", "garbage"):   # D heard FAILED: it frees at once
        deadline = time.monotonic() + 3
        while d_state(p, ep, tid) != "failed" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert d_state(p, ep, tid) == "failed", tid
    with pytest.raises(ConfigError):                          # the worker's own check stays
        TransferSpec(transfer_id="empty", peer=ep, src_blocks=[0], dst_blocks=[0], dst_incarnation="x", token="")
    rep = alloc(p, ep, "later", 3)
    run_step(p, 1, [spec_for(ep, "later", [30, 31, 32], rep)])
    assert p.sender.wait("later", 5).ok
    assert p.loop_thread.alive


# --- a flood of stranger aborts cannot keep out a genuine early abort ---------------------------------

def test_stranger_abort_flood_cannot_refuse_a_genuine_early_abort(memory_runtime, memory_decode_node):
    d = memory_decode_node(SHAPE, engine_id="d-flood", timeouts=Timeouts(fence_grace=6.0))
    p, _ = p_runtime(memory_runtime, "p-flood")
    stranger = memory_runtime("stranger")

    async def flood() -> int:
        client = await stranger.peers.get(p.control_endpoint)
        replies = await asyncio.gather(*(client.call(m.Abort(transfer_id=f"x{i}", token="s" * 32), timeout=20)
                                         for i in range(MAX_EARLY_ABORTS + 50)), return_exceptions=True)
        return sum(isinstance(r, m.Ack) and r.detail == "stopped" for r in replies)

    assert stranger.loop_thread.call(flood(), timeout=60) > 0
    rep = alloc(p, d.control_endpoint, "flood", 2)
    before = p.request(d.control_endpoint, m.VerifyRequest(transfer_id="flood"), timeout=5)
    t0 = time.monotonic()
    p.request(d.control_endpoint, m.AbortRequest(transfer_id="flood", reason="client gone", token=rep.token))
    while d_state(p, d.control_endpoint, "flood") != "failed" and time.monotonic() - t0 < 8:
        time.sleep(0.02)
    assert time.monotonic() - t0 < 3.0, "no P rank reached it: D's fence must end at once"
    # a genuine early Abort (a peer that knew the transfer) reaches P before its step, despite the flood
    assert stranger.request(p.control_endpoint, m.Abort(transfer_id="flood", reason="client gone", token=rep.token),
                            timeout=5).detail == "stopped"
    run_step(p, 0, [spec_for(d.control_endpoint, "flood", [3, 4], rep)])   # P's step comes after all
    out = p.sender.wait("flood", 5)
    assert not out.ok and "aborted by D before it started" in out.reason, out
    after = p.request(d.control_endpoint, m.VerifyRequest(transfer_id="flood"), timeout=5)
    assert (after.crc_k, after.crc_v) == (before.crc_k, before.crc_v)   # not one byte written


def test_a_cancel_stops_only_the_transfer_it_met_never_a_later_one_of_the_same_id(memory_runtime,
                                                                                    memory_decode_node):
    """An id cancelled (its transfer failed and released), or cancelled before any transfer of it began,
    is started again later: that transfer is not cancelled by the old call, and its ``wait`` answers
    with its own outcome, not the unpopped one of the id's earlier transfer."""
    d1, d2 = memory_decode_node(SHAPE, engine_id="d-reuse-1"), memory_decode_node(SHAPE, engine_id="d-reuse-2")
    p, _ = p_runtime(memory_runtime, "p-reuse")
    p.sender.cancel("never-begun", "cancelled before its step")
    p.sender.begin_step(0, [spec_for(d1.control_endpoint, "reused", [1], alloc(p, d1.control_endpoint, "reused", 1))])
    p.sender.cancel("reused", "preempted")
    p.sender.end_step(0)
    assert "preempted" in p.sender.wait("reused", 5).reason
    assert released_within(p, "reused", 5) is not None   # the engine may start the id again now
    run_step(p, 1, [spec_for(d2.control_endpoint, "reused", [2], alloc(p, d2.control_endpoint, "reused", 1)),
                    spec_for(d2.control_endpoint, "never-begun", [3], alloc(p, d2.control_endpoint, "never-begun", 1))])
    second, late = p.sender.wait("reused", 5), p.sender.wait("never-begun", 5)
    assert second.ok and len(second.layers) == SHAPE.num_layers, second
    assert late.ok, late
    assert released_within(p, "reused", 5) is not None
    # an engine that frees on release and never waits: the id's ok outcome stays unpopped, and the id's
    # next transfer (D refuses its token) must be what ``wait`` answers
    run_step(p, 2, [spec_for(d1.control_endpoint, "unwaited", [4], alloc(p, d1.control_endpoint, "unwaited", 1))])
    assert released_within(p, "unwaited", 5) is not None
    rep = alloc(p, d2.control_endpoint, "unwaited", 1)
    run_step(p, 3, [spec_for(d2.control_endpoint, "unwaited", [5], rep, token="0" * 32)])
    third = p.sender.wait("unwaited", 5)
    assert not third.ok, third
    assert [o.ok for o in p.sender.pop_outcomes() if o.transfer_id == "unwaited"] == [True, False]


def test_a_cancel_while_the_done_is_being_made_still_ends_in_failed(memory_runtime, memory_decode_node,
                                                                    monkeypatch):
    """The cancel comes while P digests the sampled transfer for its DONE (the digest reads the source the
    engine freed): no DONE goes out, the outcome fails and D is told FAILED."""
    from aiolayer.runtime.send import ending

    d = memory_decode_node(SHAPE, engine_id="d-digest")
    p, _ = p_runtime(memory_runtime, "p-digest")
    p.sender.integrity_sample = 1.0
    digesting = threading.Event()

    async def slow_check(self, req):   # a large transfer's digest: takes a while
        digesting.set()
        await asyncio.sleep(0.5)
        return None

    monkeypatch.setattr(ending.TransferEnding, "_sampled_check", slow_check)
    run_step(p, 0, [spec_for(d.control_endpoint, "digest", [5], alloc(p, d.control_endpoint, "digest", 1))])
    assert digesting.wait(5)
    p.sender.cancel("digest", "preempted while digesting")
    out = p.sender.wait("digest", 5)
    assert not out.ok and "preempted while digesting" in out.reason, out
    deadline = time.monotonic() + 3
    while d_state(p, d.control_endpoint, "digest") != "failed" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert d_state(p, d.control_endpoint, "digest") == "failed"


def test_a_transfer_live_as_the_sender_stops_gets_one_outcome_that_wait_and_pop_agree_on(memory_runtime,
                                                                                        memory_decode_node):
    """The bridge closes (stop's first act) while a transfer's DONE is at D: ``wait`` answered "sender
    stopped" at once while the transfer went on and queued its real outcome too (ok, source released), so
    ``wait`` and ``pop_outcomes`` told the engine two different things."""
    d = memory_decode_node(SHAPE, engine_id="d-stopping")
    p, _ = p_runtime(memory_runtime, "p-stopping")
    handler = d.runtime.server.handler

    async def slow_done(msg):   # D takes a while to answer a DONE
        if isinstance(msg, (m.Done, m.DoneBatch)):
            await asyncio.sleep(0.3)
        return await handler(msg)

    d.runtime.server.handler = slow_done
    run_step(p, 0, [spec_for(d.control_endpoint, "stopping", [1, 2], alloc(p, d.control_endpoint, "stopping", 2))])
    time.sleep(0.1)                       # the DONE is at D
    p.bridge.close("runtime stopped")     # as stop() begins
    waited = p.sender.wait("stopping", 5)
    time.sleep(0.5)                       # D's answer comes; the transfer ends on its own
    popped = [o for o in p.sender.pop_outcomes() if o.transfer_id == "stopping"]
    assert popped == [waited], (waited, popped)
    assert not waited.ok and not waited.source_released
    assert released_within(p, "stopping", 5) is not None   # its source, once its writes ended
