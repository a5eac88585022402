"""What the forward thread hands over is checked: a layer handed over twice, out of range or that is no
layer number fails its transfers (the old design counted layers down and said DONE over a layer never
written), a numpy integer is a layer number, and the sender goes on with the next step. Real runtimes
(memory backend) and a real decode node over real control sockets."""

from __future__ import annotations

import time

import numpy as np
import pytest

from aiolayer import KVShape, NodeConfig, Runtime, Timeouts, TransferSpec
from aiolayer.kvcache import PagedKVCache, checksums
from aiolayer.node import DecodeNode
from aiolayer.protocol import messages as m

SHAPE = KVShape(num_layers=4, num_blocks=64, block_size=16, kv_heads=2, head_dim=64)
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pair():
    d = DecodeNode(SHAPE, NodeConfig(engine_id="d-handoff", backend="memory")).start()
    p = Runtime(NodeConfig(engine_id="p-handoff", backend="memory"), Timeouts(layer_gap=2.0)).start()
    try:
        cache = PagedKVCache(SHAPE)
        cache.buffer[:] = np.random.default_rng(3).integers(1, 256, cache.buffer.size, dtype=np.uint8)
        p.register_kv_memory(cache.k_base, cache.v_base, SHAPE.block_bytes, SHAPE.num_blocks)
        yield p, d, cache
    finally:
        p.stop()
        d.stop()


def _spec(p, d, tid: str, src: list[int]) -> TransferSpec:
    reply = p.request(d.control_endpoint, m.AllocRequest(transfer_id=tid, num_blocks=len(src)), timeout=5)
    return TransferSpec.from_registration(reply, src_blocks=src, peer=d.control_endpoint)


def _hand_over(p, spec: TransferSpec, layers, pause_s: float = 0.0) -> None:
    with p.begin_step([spec]) as step:
        for layer in layers:
            step.layer_ready(layer)
            time.sleep(pause_s)   # the loop looks into the step between layers, as during a forward


def _landed(p, d, cache, tid: str, src: list[int]) -> bool:
    reply = p.request(d.control_endpoint, m.VerifyRequest(transfer_id=tid), timeout=5)
    return [reply.crc_k, reply.crc_v] == list(checksums(cache.blocks, src))


@pytest.mark.parametrize("layers, why", [
    ([0, 0, 1, 2, 3], "layer 0 handed over twice"),
    ([0, 1, 2, -1], "the model has layers 0 to 3"),
    ([0, 1, 2, "3"], "not a layer number"),
])
def test_a_bad_layer_fails_its_transfer_never_a_done_and_the_next_step_goes_on(pair, layers, why):
    p, d, cache = pair
    _hand_over(p, _spec(p, d, "bad", [1, 2]), layers)
    outcome = p.wait_outcome("bad", 10)
    assert not outcome.ok and why in outcome.reason, outcome
    end = time.monotonic() + 10
    while (state := p.request(d.control_endpoint, m.StatusRequest(transfer_id="bad"), timeout=5).state) != "failed":
        assert time.monotonic() < end, f"D still says {state!r}"   # P's FAILED, never a DONE
        time.sleep(0.02)
    _hand_over(p, _spec(p, d, "after", [3]), range(SHAPE.num_layers))
    assert p.wait_outcome("after", 10).ok
    assert _landed(p, d, cache, "after", [3])


def test_numpy_layer_numbers_are_layer_numbers(pair):
    """A numpy integer failed the type check on the loop and ended the sender: every later step refused."""
    p, d, cache = pair
    _hand_over(p, _spec(p, d, "np", [1, 2]), np.arange(SHAPE.num_layers), pause_s=0.05)
    assert p.wait_outcome("np", 10).ok
    assert _landed(p, d, cache, "np", [1, 2])
    _hand_over(p, _spec(p, d, "after-np", [3]), range(SHAPE.num_layers))
    assert p.wait_outcome("after-np", 10).ok


def test_a_step_never_ended_leaves_the_sender_once_its_transfers_ended(pair):
    """The loop looked into an open step's inbox every tick: a step the forward forgot to end kept the
    loop from ever going idle."""
    p, d, cache = pair
    step = p.begin_step([_spec(p, d, "unended", [1])])
    for layer in range(SHAPE.num_layers):
        step.layer_ready(layer)
    assert p.wait_outcome("unended", 10).ok
    end = time.monotonic() + 5
    while p.debug_tables()["sender_steps"]:
        assert time.monotonic() < end, p.debug_tables()
        time.sleep(0.01)
    step.end()   # late: nothing to end any more, and nothing breaks
    _hand_over(p, _spec(p, d, "after-unended", [3]), range(SHAPE.num_layers))
    assert p.wait_outcome("after-unended", 10).ok
