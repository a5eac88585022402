"""Seed fragility 6: a running ``aiolayer node`` answers every frame, random or truncated, and keeps serving.

Hypothesis sends batches of multipart frames (random bytes, truncated and bit-flipped valid
messages, wrong frame counts, bad request ids) to the node's control socket; at least 10,000 frames
in all, each of which must get exactly one decodable reply. A real transfer then still verifies.
"""

from __future__ import annotations

import threading

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers_node import apply_mc_env

apply_mc_env()

from aiolayer import Runtime, TransferSpec
from aiolayer.config import KVShape, NodeConfig
from aiolayer.kvcache import PagedKVCache, checksums
from aiolayer.protocol import messages as m
from aiolayer.harness.node import NodeProcess

SHAPE = KVShape(num_layers=2, num_blocks=16, block_size=16, kv_heads=2, head_dim=64)
VALID = [m.encode(x) for x in (m.StatusRequest(transfer_id="t"), m.LayoutRequest(requester="fuzz"),
                               m.Done(transfer_id="fz", sender="fuzz"), m.VerifyRequest(transfer_id="nope"),
                               m.AllocRequest(transfer_id="a", num_blocks=10 ** 9),
                               m.DoneBatch(items=[m.Done(transfer_id="fz", sender="fuzz")] * 3),
                               m.LayoutBatch(items=[m.LayoutRequest(requester="fuzz", transfer_id="fz")] * 3),
                               m.TopologyRequest(requester="fuzz"))]
SENT = {"frames": 0}


@pytest.fixture(scope="module")
def node():
    with NodeProcess(SHAPE) as proc:
        yield proc


@pytest.fixture(scope="module")
def dealer(node):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(node.control)
    yield sock
    sock.close(0)
    ctx.term()


def _mutated(data, payload: bytes) -> bytes:
    choice = data.draw(st.sampled_from(["truncate", "flip", "append"]))
    if choice == "truncate":
        return payload[: data.draw(st.integers(0, len(payload) - 1))]
    if choice == "flip":
        i = data.draw(st.integers(0, len(payload) - 1))
        return payload[:i] + bytes([payload[i] ^ data.draw(st.integers(1, 255))]) + payload[i + 1:]
    return payload + data.draw(st.binary(min_size=1, max_size=16))


def _frames(data) -> list[bytes]:
    kind = data.draw(st.sampled_from(["random", "mutated", "frames", "rid"]))
    rid = m.pack_request_id(data.draw(st.integers(1, 2 ** 64 - 1)))
    if kind == "random":
        return [rid, data.draw(st.binary(max_size=96))]
    if kind == "mutated":
        return [rid, _mutated(data, data.draw(st.sampled_from(VALID)))]
    if kind == "frames":
        return data.draw(st.lists(st.binary(max_size=24), min_size=1, max_size=5))
    return [data.draw(st.binary(max_size=12)), data.draw(st.sampled_from(VALID))]


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_every_fuzzed_frame_gets_exactly_one_reply(dealer, data):
    batch = [_frames(data) for _ in range(data.draw(st.integers(25, 30)))]   # 500 x >= 25: over 10,000 frames
    for frames in batch:
        dealer.send_multipart(frames)
    for frames in batch:
        reply = dealer.recv_multipart()       # RCVTIMEO: a missing reply raises zmq.Again
        if frames[0] == b"":                  # read as a REQ peer's delimiter: echoed back
            assert reply[0] == b""
            reply, frames = reply[1:], frames[1:]
        assert len(reply) == 2
        msg = m.decode(reply[1])
        if len(frames) >= 1 and len(frames[0]) == 8:
            assert reply[0] == frames[0]      # a valid request id is echoed, even on a Nack
        assert isinstance(msg, (m.Nack, m.StatusReply, m.LayoutReply, m.Ack, m.VerifyReply, m.Replies,
                                m.LayoutReplies, m.TopologyReply))
    assert not dealer.poll(0)                 # exactly one reply per frame: nothing extra
    SENT["frames"] += len(batch)


def test_node_still_serves_a_verified_transfer_after_the_fuzz(node):
    assert SENT["frames"] >= 10_000, SENT
    p_shape = KVShape(num_layers=SHAPE.num_layers, num_blocks=4, block_size=16, kv_heads=2, head_dim=64)
    cache = PagedKVCache(p_shape)
    cache.buffer[:] = 0x5A
    with Runtime(NodeConfig(engine_id="after-fuzz")) as rt:
        rt.register_kv_memory(cache.k_base, cache.v_base, p_shape.block_bytes, p_shape.num_blocks)
        alloc = rt.request(node.control, m.AllocRequest(transfer_id="after-fuzz", num_blocks=4))
        spec = TransferSpec.from_registration(alloc, src_blocks=[0, 1, 2, 3], peer=node.control)

        def forward() -> None:
            rt.sender.begin_step(1, [spec])
            for layer in range(p_shape.num_layers):
                rt.sender.layer_ready(1, layer)
            rt.sender.end_step(1)

        thread = threading.Thread(target=forward)
        thread.start()
        thread.join(10)
        assert rt.sender.wait("after-fuzz", 20).ok
        reply = rt.request(node.control, m.VerifyRequest(transfer_id="after-fuzz"))
        assert (reply.crc_k, reply.crc_v) == checksums(cache.blocks, [0, 1, 2, 3])
