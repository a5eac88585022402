"""Late binding: P starts a transfer before D registered it and learns D's blocks from D itself.

P's spec names only D's control endpoint, the transfer id and its token (``TransferSpec.late_bound``);
its forward never waits: the layers queue while the sender's waiting lookup (``LookupRequest`` with
``wait``) is held by D until D registers the transfer. D records P as a writer before it answers, and
the answer carries D's blocks and layout. Real runtimes on the memory backend over real control
sockets; D is a decode node that registers a transfer when the test sends its ``AllocRequest``.
"""

from __future__ import annotations

import concurrent.futures
import secrets
import time

import msgspec
import pytest

from aiolayer import Timeouts, TransferSpec
from aiolayer.errors import ControlRejected
from aiolayer.kvcache import checksums
from aiolayer.protocol import messages as m

from helpers_step import d_state
from test_regressions_sender import SHAPE, alloc, p_runtime, run_step

pytestmark = pytest.mark.timeout(60)


def late_spec(d, tid: str, token: str, src: list[int]) -> TransferSpec:
    return TransferSpec.late_bound(transfer_id=tid, peer=d.control_endpoint, src_blocks=src, token=token)


def register(p, d, tid: str, token: str, n: int) -> m.AllocReply:
    """D registers the transfer now (its scheduler got to the request): the node's AllocRequest."""
    return alloc(p, d.control_endpoint, tid, n, token=token)


def wait_d_state(p, d, tid: str, want: str, limit: float = 5.0) -> str:
    end = time.monotonic() + limit
    while (got := d_state(p, d.control_endpoint, tid)) != want and time.monotonic() < end:
        time.sleep(0.01)
    return got


def assert_landed(p, d, cache, tid: str, src: list[int]) -> None:
    v = p.request(d.control_endpoint, m.VerifyRequest(transfer_id=tid), timeout=5)
    ck, cv = checksums(cache.blocks, src)
    assert (v.crc_k, v.crc_v) == (ck, cv), f"{tid}: the KV at D is not P's source"


def test_registration_after_the_last_layer_still_lands_every_layer(memory_runtime, memory_decode_node):
    """P's whole forward ran before D registered: every layer waited, queued, and lands once D answers."""
    d = memory_decode_node(SHAPE, engine_id="d-late")
    p, cache = p_runtime(memory_runtime, "p-late")
    token, src = secrets.token_hex(16), [3, 5, 6]
    run_step(p, 0, [late_spec(d, "late", token, src)])          # every layer handed over, step ended
    time.sleep(0.3)
    assert p.sender.pop_outcomes() == [] and "late" not in p.sender.pop_released()   # waiting, source held
    rep = register(p, d, "late", token, len(src))
    out = p.sender.wait("late", 10)
    assert out.ok, out.reason
    assert [t.layer for t in out.layers] == list(range(SHAPE.num_layers))
    assert out.bytes == 2 * SHAPE.num_layers * len(src) * SHAPE.block_bytes
    assert wait_d_state(p, d, "late", "finished") == "finished"
    assert_landed(p, d, cache, "late", src)
    assert rep.block_ids and p.layouts.lookups[d.control_endpoint] == 1
    assert sum(p.layouts.fetches.values()) == 0                  # the layout came with the registration


def test_registration_that_never_comes_fails_p_at_its_deadline(memory_runtime, memory_decode_node):
    """D never registers within P's ``lookup_call``: P fails having written nothing, releases its
    source only then, and tells D, which fails the transfer as soon as it does register it."""
    d = memory_decode_node(SHAPE, engine_id="d-never", timeouts=Timeouts(lookup_wait=30))
    limits = Timeouts(lookup_wait=0.4, control_call=0.3, done_delivery=1.0)
    p, _ = p_runtime(memory_runtime, "p-never", limits)
    token = secrets.token_hex(16)
    t0 = time.monotonic()
    run_step(p, 0, [late_spec(d, "never", token, [1, 2])])
    time.sleep(0.3)
    assert "never" not in p.sender.pop_released()                # held while the lookup may still bind it
    out = p.sender.wait("never", 5)
    took = time.monotonic() - t0
    assert not out.ok and "lookup_call" in out.reason and out.bytes == 0, out
    assert limits.lookup_call <= took < limits.lookup_call + 2.0
    end = time.monotonic() + 5
    while "never" not in p.sender.pop_released():
        assert time.monotonic() < end, "source never released"
        time.sleep(0.01)
    time.sleep(0.3)                                             # P's FAILED reached D (kept: not registered)
    assert d.runtime.debug_tables()["receiver_lookups_waiting"] == 1   # D still holds P's (abandoned) lookup
    register(p, d, "never", token, 2)
    assert wait_d_state(p, d, "never", "failed") == "failed"   # D was told: its blocks are free at once
    assert d.runtime.debug_tables()["receiver_lookups_waiting"] == 0


def test_a_second_registration_or_lookup_writes_once_into_the_same_blocks(memory_runtime, memory_decode_node):
    """D's registration arriving twice is refused (``duplicate``); a second lookup of the writer answers
    the same blocks and admits no new writer; the transfer writes once."""
    d = memory_decode_node(SHAPE, engine_id="d-twice")
    p, cache = p_runtime(memory_runtime, "p-twice")
    token, src = secrets.token_hex(16), [2, 4]
    run_step(p, 0, [late_spec(d, "twice", token, src)])
    rep = register(p, d, "twice", token, len(src))
    with pytest.raises(ControlRejected) as again:
        register(p, d, "twice", token, len(src))
    assert again.value.code == "duplicate"
    out = p.sender.wait("twice", 10)
    assert out.ok, out.reason
    assert wait_d_state(p, d, "twice", "finished") == "finished"
    with pytest.raises(ControlRejected) as ended:                # finished: nothing more to bind to
        p.request(d.control_endpoint, m.LookupRequest(transfer_id="twice", token=token, wait=True), timeout=5)
    assert ended.value.code == "ended"
    assert out.bytes == 2 * SHAPE.num_layers * len(src) * SHAPE.block_bytes
    assert d.runtime.receiver.bytes_received == out.bytes      # one DONE, one transfer's bytes
    assert p.layouts.lookups[d.control_endpoint] == 1          # P asked once
    assert_landed(p, d, cache, "twice", src)
    assert rep.block_ids


def test_a_repeated_writer_lookup_answers_the_same_blocks(memory_runtime, memory_decode_node):
    """While the transfer takes writes, the writer's lookup again gets the same blocks; another P rank
    with the token is refused (one writer registered), so no second writer can learn where to write."""
    d = memory_decode_node(SHAPE, engine_id="d-rep")
    p, _ = p_runtime(memory_runtime, "p-rep")
    token = secrets.token_hex(16)
    rep = register(p, d, "rep", token, 2)

    def lookup(requester: str) -> m.Message:
        return p.request(d.control_endpoint, m.LookupRequest(
            transfer_id="rep", token=token, wait=True, requester=requester, control=p.control_endpoint,
            incarnation=p.incarnation), timeout=5)

    first, second = lookup("p-rep"), lookup("p-rep")
    assert first.block_ids == second.block_ids == rep.block_ids
    # the same layout; each answer's window is the time left when it was given, so the later is not longer
    assert msgspec.structs.replace(first.layout, window=None) == msgspec.structs.replace(second.layout, window=None)
    assert 0 < second.layout.window <= first.layout.window <= Timeouts().receive
    with pytest.raises(ControlRejected) as other:
        lookup("p-other")
    assert other.value.code == "sender"
    assert d_state(p, d.control_endpoint, "rep") == "registered"


def test_a_stranger_without_the_token_learns_nothing(memory_runtime, memory_decode_node):
    """A waiting lookup with a wrong token, before and after the registration: ``auth``, no blocks, no
    layout, no writer recorded; the genuine late transfer finishes."""
    d = memory_decode_node(SHAPE, engine_id="d-auth")
    p, cache = p_runtime(memory_runtime, "p-auth")
    stranger = memory_runtime("stranger")
    token, src = secrets.token_hex(16), [1, 7]
    ask = m.LookupRequest(transfer_id="guarded", token="w" * 32, wait=True, requester="stranger",
                          control=stranger.control_endpoint, incarnation=stranger.incarnation)
    run_step(p, 0, [late_spec(d, "guarded", token, src)])
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        early = pool.submit(stranger.request, d.control_endpoint, ask, 5)   # waits for the registration
        time.sleep(0.2)
        register(p, d, "guarded", token, len(src))
        for answer in (early, None):
            with pytest.raises(ControlRejected) as refused:
                answer.result(5) if answer is not None else stranger.request(d.control_endpoint, ask, timeout=5)
            assert refused.value.code == "auth" and "block" not in refused.value.reason
    finally:
        pool.shutdown()
    out = p.sender.wait("guarded", 10)
    assert out.ok, out.reason
    assert wait_d_state(p, d, "guarded", "finished") == "finished"
    assert_landed(p, d, cache, "guarded", src)


def test_cancel_while_waiting_for_the_registration_ends_at_once(memory_runtime, memory_decode_node):
    """P's engine cancels the request while the lookup waits: the transfer fails at once (not at the
    lookup's deadline), having written nothing, and D, registering later, finds it failed."""
    d = memory_decode_node(SHAPE, engine_id="d-cancel")
    p, _ = p_runtime(memory_runtime, "p-cancel", Timeouts(lookup_wait=20))
    token = secrets.token_hex(16)
    run_step(p, 0, [late_spec(d, "cancel", token, [1])])
    time.sleep(0.2)
    t0 = time.monotonic()
    p.sender.cancel("cancel", "preempted")
    out = p.sender.wait("cancel", 5)
    assert not out.ok and out.bytes == 0 and time.monotonic() - t0 < 2.0, out
    time.sleep(0.3)
    register(p, d, "cancel", token, 1)
    assert wait_d_state(p, d, "cancel", "failed") == "failed"


def test_d_fences_against_the_writer_its_lookup_admitted(memory_runtime, memory_decode_node):
    """P bound its transfer through the lookup (no layout request): D's abort still asks that P rank to
    stop, and P, told, submits no further layer; nothing lands after D failed the transfer."""
    d = memory_decode_node(SHAPE, engine_id="d-fence", timeouts=Timeouts(fence_grace=30))
    p, cache = p_runtime(memory_runtime, "p-fence")
    token, src = secrets.token_hex(16), [2, 3]
    p.sender.begin_step(0, [late_spec(d, "fenced", token, src)])
    p.sender.layer_ready(0, 0)
    rep = register(p, d, "fenced", token, len(src))
    ck, cv = checksums(cache.blocks, src)
    end = time.monotonic() + 5
    # layer 0 is P's source at D (an unwritten block has a CRC too): P bound the transfer and wrote it
    while (v := p.request(d.control_endpoint, m.VerifyRequest(transfer_id="fenced"), timeout=5)) and \
            (v.crc_k[0], v.crc_v[0]) != (ck[0], cv[0]):
        assert time.monotonic() < end, "layer 0 never landed"
        time.sleep(0.01)
    p.request(d.control_endpoint, m.AbortRequest(transfer_id="fenced", reason="client gone", token=token))
    assert wait_d_state(p, d, "fenced", "failed") == "failed"
    at_fail = p.request(d.control_endpoint, m.VerifyRequest(transfer_id="fenced"), timeout=5)
    for layer in range(1, SHAPE.num_layers):                 # P's forward goes on
        p.sender.layer_ready(0, layer)
    p.sender.end_step(0)
    out = p.sender.wait("fenced", 10)
    assert not out.ok and "client gone" in out.reason, out   # the lookup's writer was the one asked to stop
    after = p.request(d.control_endpoint, m.VerifyRequest(transfer_id="fenced"), timeout=5)
    assert (after.crc_k, after.crc_v) == (at_fail.crc_k, at_fail.crc_v), "a layer landed after D failed it"
    assert d.runtime.receiver.fences_unconfirmed == 0 and rep.block_ids


def test_lookups_waiting_for_made_up_ids_do_not_stop_the_control_port():
    """A waiting lookup held one of the control server's 1,024 slots for all of ``lookup_wait``: that
    many (a stranger's made-up ids, or a busy D's late transfers) stopped every other frame, DONEs and
    Aborts included. Waits give their slot back; their own table bounds them (``busy`` beyond)."""
    import zmq

    from aiolayer import NodeConfig, Runtime

    d = Runtime(NodeConfig(engine_id="d-flooded", backend="memory"), Timeouts(lookup_wait=5.0)).start()
    ctx = zmq.Context()
    flood, asker = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for sock in (flood, asker):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(d.control_endpoint)
        for i in range(1100):
            junk = m.LookupRequest(transfer_id=f"junk-{i}", wait=True)
            flood.send_multipart([m.pack_request_id(i + 1), m.encode(junk)])
        end = time.monotonic() + 5
        while d.receiver.lookups.count < 1024:
            assert time.monotonic() < end, f"only {d.receiver.lookups.count} lookups wait"
            time.sleep(0.01)
        asked = time.monotonic()
        asker.send_multipart([m.pack_request_id(1), m.encode(m.TopologyRequest())])
        assert asker.poll(2000), "the control port answered nothing while lookups waited"
        assert isinstance(m.decode(asker.recv_multipart()[1]), m.TopologyReply)
        assert time.monotonic() - asked < 1.0
        assert d.receiver.lookups.count == 1100
    finally:
        flood.close(0)
        asker.close(0)
        ctx.term()
        d.stop()
