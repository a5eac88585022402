"""Control plane over real zmq sockets on 127.0.0.1: replies to every frame, deadlines, retries."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import zmq

from aiolayer.config import Timeouts
from aiolayer.errors import ControlError, ControlRejected, ControlTimeout, RuntimeStateError
from aiolayer.protocol import messages as m
from aiolayer.runtime.control.plane import ControlClient, ControlServer, shared_context

pytestmark = pytest.mark.timeout(30)

from helpers_control import MAX_FRAME, EchoHandler, free_port


async def make_client(endpoint, spawn, closer, **timeouts) -> ControlClient:
    client = ControlClient(endpoint, Timeouts(**timeouts))
    closer(client)
    await client.start(spawn)
    return client


def raw_dealer(endpoint: str, closer) -> zmq.Socket:
    sock = shared_context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    closer(sock)
    sock.connect(endpoint)
    return sock


async def no_more_frames(sock, wait: float = 0.2) -> bool:
    return await sock.poll(int(wait * 1000)) == 0


# --- request / reply ---------------------------------------------------------------------------------

async def test_request_reply(server, spawn, closer):
    client = await make_client(server.endpoint, spawn, closer)
    reply = await client.call(m.StatusRequest(transfer_id="t1"), timeout=2)
    assert reply == m.StatusReply(transfer_id="t1", state="echo")
    assert server.endpoint.startswith("tcp://127.0.0.1:") and server.port > 0


async def test_nack_raises_control_rejected(server, spawn, closer):
    client = await make_client(server.endpoint, spawn, closer)
    with pytest.raises(ControlRejected) as info:
        await client.call(m.Ack(), timeout=2)
    assert info.value.code == "unknown" and "Ack" in info.value.reason
    with pytest.raises(ControlRejected) as info:
        await client.call(m.StatusRequest(transfer_id="boom"), timeout=2)
    assert info.value.code == "internal" and "handler bug" in info.value.reason


async def test_concurrent_calls_get_their_own_replies(server, spawn, closer):
    client = await make_client(server.endpoint, spawn, closer)
    rng = random.Random(7)
    ids = [f"sleep:{rng.uniform(0, 0.02):.4f}#{i}" for i in range(200)]

    async def one(tid):
        return tid, await client.call(m.StatusRequest(transfer_id=tid), timeout=10)

    # random handler delays make the replies come back out of order; each id is unique
    results = await asyncio.wait_for(asyncio.gather(*(one(t) for t in ids)), 20)
    assert len(results) == 200
    for tid, reply in results:
        assert reply == m.StatusReply(transfer_id=tid, state="echo")
    assert client.late_replies == 0
    assert server.frames_received == 200


async def test_two_clients_are_isolated(server, spawn, closer):
    a = await make_client(server.endpoint, spawn, closer)
    b = await make_client(server.endpoint, spawn, closer)
    ra, rb = await asyncio.gather(a.call(m.StatusRequest(transfer_id="sleep:0.05")),
                                  b.call(m.StatusRequest(transfer_id="b")))
    assert ra.transfer_id == "sleep:0.05" and rb.transfer_id == "b"


# --- a reply to every frame ----------------------------------------------------------------------------

RID = m.pack_request_id(777)
BAD_RID = m.pack_request_id(0)

CASES = [
    # (name, frames sent by the DEALER, expected reply request-id frame, expected Nack code or None)
    ("garbage", [RID, b"\xff\xfe not msgpack"], RID, "decode"),
    ("empty payload", [RID, b""], RID, "decode"),
    ("unknown tag", [RID, b"\x81\xa4type\xa3zzz"], RID, "decode"),
    ("one frame", [b"just one frame"], BAD_RID, "frame"),
    ("three frames", [RID, m.encode(m.Ack()), b"extra"], RID, "frame"),  # a valid id is echoed
    ("short request id", [b"abc", m.encode(m.StatusRequest(transfer_id="x"))], BAD_RID, "frame"),
    ("long request id", [b"123456789", m.encode(m.StatusRequest(transfer_id="x"))], BAD_RID, "frame"),
    ("oversized", [RID, b"\x00" * (MAX_FRAME + 1)], RID, "size"),
    ("wrong version", [RID, m.encode(m.Ack(v=m.PROTOCOL_VERSION + 1))], RID, "version"),
    ("not served", [RID, m.encode(m.Ack(detail="?"))], RID, "unknown"),
    ("rejected", [RID, m.encode(m.ReleaseRequest(transfer_id="t"))], RID, "busy"),
    ("handler bug", [RID, m.encode(m.StatusRequest(transfer_id="boom"))], RID, "internal"),
    ("valid", [RID, m.encode(m.StatusRequest(transfer_id="ok"))], RID, None),
]


async def test_every_frame_gets_exactly_one_reply(server, closer):
    """Seed fragility 6: the listener answers unexpected and undecodable frames too."""
    sock = raw_dealer(server.endpoint, closer)
    for name, frames, want_rid, code in CASES:
        await sock.send_multipart(frames)
        reply = await asyncio.wait_for(sock.recv_multipart(), 3)
        assert len(reply) == 2, name
        assert reply[0] == want_rid, name
        msg = m.decode(reply[1])
        if code is None:
            assert msg == m.StatusReply(transfer_id="ok", state="echo"), name
        else:
            assert isinstance(msg, m.Nack), name
            assert msg.code == code, (name, msg)
            assert msg.reason, name
        assert await no_more_frames(sock, 0.05), f"{name}: more than one reply"
    assert await no_more_frames(sock, 0.2)
    assert server.frames_received == len(CASES)
    assert server.nacks_sent == sum(1 for c in CASES if c[3] is not None)


async def test_garbage_burst_all_answered(server, closer):
    """Many undecodable frames at once: each one is answered (nobody is left blocked)."""
    sock = raw_dealer(server.endpoint, closer)
    rng = random.Random(3)
    n = 100
    for i in range(n):
        await sock.send_multipart([m.pack_request_id(i + 1), rng.randbytes(rng.randint(0, 64))])
    seen = set()
    for _ in range(n):
        rid, payload = await asyncio.wait_for(sock.recv_multipart(), 5)
        try:
            msg = m.decode(payload)
        except m.DecodeFailure:
            pytest.fail("the server's reply must always decode")
        assert isinstance(msg, (m.Nack, m.StatusReply))
        seen.add(m.unpack_request_id(rid))
    assert seen == set(range(1, n + 1))
    assert await no_more_frames(sock)


async def test_frame_beyond_socket_limit_drops_only_that_peer(server, spawn, closer):
    big = raw_dealer(server.endpoint, closer)
    await big.send_multipart([RID, b"\x00" * (5 * MAX_FRAME)])   # past ZMQ_MAXMSGSIZE: peer dropped
    assert await no_more_frames(big, 0.3)
    client = await make_client(server.endpoint, spawn, closer)
    reply = await client.call(m.StatusRequest(transfer_id="still serving"), timeout=2)
    assert reply.transfer_id == "still serving"


# --- deadlines ------------------------------------------------------------------------------------------

async def test_call_to_nobody_times_out(spawn, closer):
    client = await make_client(f"tcp://127.0.0.1:{free_port()}", spawn, closer)
    t0 = time.monotonic()
    with pytest.raises(ControlTimeout) as info:
        await client.call(m.StatusRequest(transfer_id="t"), timeout=0.3)
    elapsed = time.monotonic() - t0
    assert 0.25 <= elapsed < 0.3 + 0.5
    assert info.value.phase == "control_call"
    assert client._pending == {}


async def test_default_timeout_comes_from_timeouts(spawn, closer):
    client = await make_client(f"tcp://127.0.0.1:{free_port()}", spawn, closer, control_call=0.2)
    t0 = time.monotonic()
    with pytest.raises(ControlTimeout):
        await client.call(m.StatusRequest(transfer_id="t"))
    assert time.monotonic() - t0 < 0.2 + 0.5


async def test_late_reply_is_dropped_and_never_answers_the_next_call(server, spawn, closer):
    """Fragility 3: a reply that arrives after its call gave up must not satisfy a later call."""
    client = await make_client(server.endpoint, spawn, closer)
    t0 = time.monotonic()
    with pytest.raises(ControlTimeout):
        await client.call(m.StatusRequest(transfer_id="sleep:0.4"), timeout=0.1)
    assert time.monotonic() - t0 < 0.6
    # the next call is in flight when the late reply (at ~0.4 s) arrives; its own comes at ~0.6 s
    reply = await client.call(m.StatusRequest(transfer_id="sleep:0.5"), timeout=3)
    assert reply == m.StatusReply(transfer_id="sleep:0.5", state="echo")
    assert client.late_replies == 1
    # and the client keeps working afterwards
    assert (await client.call(m.StatusRequest(transfer_id="after"), timeout=2)).transfer_id == "after"
    assert client.late_replies == 1


async def test_handler_past_deadline_then_quick_call(server, spawn, closer):
    client = await make_client(server.endpoint, spawn, closer)
    with pytest.raises(ControlTimeout):
        await client.call(m.StatusRequest(transfer_id="sleep:0.2"), timeout=0.05)
    await asyncio.sleep(0.3)                           # the late reply has arrived by now
    reply = await client.call(m.StatusRequest(transfer_id="quick"), timeout=2)
    assert reply.transfer_id == "quick"
    assert client.late_replies == 1


async def test_close_fails_pending_calls(server, spawn, closer):
    client = await make_client(server.endpoint, spawn, closer)
    pending = asyncio.ensure_future(client.call(m.StatusRequest(transfer_id="sleep:5"), timeout=10))
    await asyncio.sleep(0.1)
    t0 = time.monotonic()
    await client.close()
    with pytest.raises(ControlError):
        await asyncio.wait_for(pending, 2)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(RuntimeStateError):
        await client.call(m.StatusRequest(transfer_id="x"))


async def test_reply_to_departed_peer_is_counted_not_fatal(server, spawn, closer):
    client = ControlClient(server.endpoint, Timeouts())
    await client.start(spawn)
    with pytest.raises(ControlTimeout):
        await client.call(m.StatusRequest(transfer_id="sleep:0.3"), timeout=0.05)
    await client.close()
    for _ in range(40):
        if server.send_errors:
            break
        await asyncio.sleep(0.05)
    assert server.send_errors == 1
    other = await make_client(server.endpoint, spawn, closer)
    assert (await other.call(m.StatusRequest(transfer_id="alive"), timeout=2)).transfer_id == "alive"


# --- retries --------------------------------------------------------------------------------------------

async def test_call_with_retries_succeeds_when_server_appears(spawn, closer):
    port = free_port()
    client = await make_client(f"tcp://127.0.0.1:{port}", spawn, closer, control_call=0.3, control_retries=20)
    handler = EchoHandler()
    t0 = time.monotonic()
    attempt = asyncio.ensure_future(client.call_with_retries(m.StatusRequest(transfer_id="r"), deadline_s=5))
    await asyncio.sleep(0.5)
    assert not attempt.done()
    srv = ControlServer("127.0.0.1", port, handler)
    closer(srv)
    await srv.start(spawn)
    reply = await asyncio.wait_for(attempt, 6)
    assert reply == m.StatusReply(transfer_id="r", state="echo")
    assert 0.5 <= time.monotonic() - t0 < 5
    assert handler.calls >= 1


async def test_call_with_retries_gives_up_after_attempts_the_last_waiting_out_the_deadline(spawn, closer):
    """A slow peer, not a gone one, still answers within the caller's deadline (D checking a DONE)."""
    client = await make_client(f"tcp://127.0.0.1:{free_port()}", spawn, closer,
                               control_call=0.1, control_retries=3)
    t0 = time.monotonic()
    with pytest.raises(ControlTimeout):
        await client.call_with_retries(m.StatusRequest(transfer_id="r"), deadline_s=1.5)
    elapsed = time.monotonic() - t0
    assert 1.5 <= elapsed < 1.5 + 0.5


async def test_call_with_retries_respects_its_deadline(spawn, closer):
    client = await make_client(f"tcp://127.0.0.1:{free_port()}", spawn, closer,
                               control_call=1.0, control_retries=5)
    t0 = time.monotonic()
    with pytest.raises(ControlTimeout):
        await client.call_with_retries(m.StatusRequest(transfer_id="r"), deadline_s=0.25)
    assert time.monotonic() - t0 < 0.25 + 0.5


async def test_call_with_retries_does_not_retry_a_nack(server, spawn, closer):
    client = await make_client(server.endpoint, spawn, closer, control_retries=5)
    with pytest.raises(ControlRejected) as info:
        await client.call_with_retries(m.ReleaseRequest(transfer_id="t"), deadline_s=5)
    assert info.value.code == "busy"
    assert server.test_handler.calls == 1
