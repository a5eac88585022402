"""A step's layers reach the loop through the step's own inbox, with no wake-up per layer.

``Runtime.begin_step`` wakes the loop once (the step's item); from then on the loop looks into the
step's inbox every poll tick until the step ends, and in host memory ``step.layer_ready`` is the
inbox's C ``append``. What must hold: a layer handed over long after the previous one (longer than the
bridge lingers after a batch) is still taken within a tick, not at the step's end; the step's layers
are all taken before its end is handled; an accelerator's recorded event travels with its layer.
"""

from __future__ import annotations

import collections
import time

import pytest

from aiolayer import KVShape, NodeConfig, ReceiveSpec, Runtime, Timeouts, TransferSpec
from aiolayer.kvcache import PagedKVCache, checksums
from aiolayer.runtime.send import sender as sender_module
from aiolayer.runtime.send.events import READY, DeviceStep
from helpers_memory import host_cache

pytestmark = pytest.mark.timeout(60)
SHAPE = KVShape(num_layers=4, num_blocks=16, block_size=4, kv_heads=2, head_dim=8, dtype="float16")


@pytest.fixture
def pair():
    made = []

    def start(engine_id: str, seed: int | None) -> tuple[Runtime, PagedKVCache]:
        rt = Runtime(NodeConfig(engine_id=engine_id, backend="memory"), Timeouts(receive=20)).start()
        made.append(rt)
        return rt, host_cache(rt, SHAPE, seed, host_memory=True)

    try:
        yield start("p-inbox", 7), start("d-inbox", None)
    finally:
        for rt in made:
            rt.stop()


def _landed(d: Runtime, dcache: PagedKVCache, block: int, layer: int, pcache: PagedKVCache, src: int) -> bool:
    return bool((dcache.blocks[layer, :, block] == pcache.blocks[layer, :, src]).all())


def test_a_layer_handed_over_after_a_long_gap_is_written_before_the_step_ends(pair):
    (p, pcache), (d, dcache) = pair
    reg = d.receive(ReceiveSpec(transfer_id="slow", block_ids=[5]))
    linger = p.bridge.linger_s
    with p.begin_step([TransferSpec.from_registration(reg, src_blocks=[2])]) as step:
        for layer in range(SHAPE.num_layers):
            time.sleep(2 * linger)   # longer than the loop lingers after a batch: it would have gone idle
            step.layer_ready(layer)
            deadline = time.monotonic() + 1.0   # a tick is 1 ms; a loaded box may take tens
            while not _landed(d, dcache, 5, layer, pcache, 2):
                assert time.monotonic() < deadline, f"layer {layer} waited for the step's end"
                time.sleep(0.002)
    assert p.wait_outcome("slow", 10).ok
    received = d.wait_received("slow", 10)
    assert received.ok, received.reason
    assert checksums(dcache.blocks, [5]) == checksums(pcache.blocks, [2])


def test_layers_handed_over_right_before_the_end_are_all_taken(pair):
    (p, pcache), (d, dcache) = pair
    time.sleep(0.3)       # an idle loop first: a layer's wait counts from its step's begin, not the last look
    for i in range(20):   # end() right after the last append: the end must not overtake the layers
        tid = f"burst{i}"
        reg = d.receive(ReceiveSpec(transfer_id=tid, block_ids=[i % 8 + 8]))
        with p.begin_step([TransferSpec.from_registration(reg, src_blocks=[i % 8])]) as step:
            for layer in range(SHAPE.num_layers):
                step.layer_ready(layer)
        outcome = p.wait_outcome(tid, 10)
        assert outcome.ok, outcome.reason
        assert [t.layer for t in outcome.layers] == list(range(SHAPE.num_layers))
        assert d.wait_received(tid, 10).ok
    assert p.metrics_snapshot()["handoff_p99_s"] <= 0.1   # no layer's wait counted from the idle time


def test_a_steps_end_takes_its_last_layers_without_waiting_for_the_poll_tick(pair):
    (p, pcache), (d, dcache) = pair
    p.bridge.poll_s = p.bridge.max_poll_s = 3.0   # the loop looks into an open step's inbox every 3 s only
    reg = d.receive(ReceiveSpec(transfer_id="ended", block_ids=[6]))
    with p.begin_step([TransferSpec.from_registration(reg, src_blocks=[3])]) as step:
        time.sleep(0.2)   # the loop took the step and naps for its tick
        for layer in range(SHAPE.num_layers):
            step.layer_ready(layer)
        ended = time.monotonic()
        assert type(step).layer_ready is collections.deque.append   # host memory: no Python frame per layer
    outcome = p.wait_outcome("ended", 10)
    assert outcome.ok, outcome.reason
    assert time.monotonic() - ended < 1.5, "the step's end waited for the loop's next tick"
    assert checksums(dcache.blocks, [6]) == checksums(pcache.blocks, [3])


def test_an_accelerators_event_and_hand_off_time_travel_with_its_layer(pair, monkeypatch):
    (p, _), (d, _) = pair
    recorded = []

    class Event:
        def query(self) -> bool:
            recorded.append("queried")
            return True

    monkeypatch.setattr(sender_module, "device_recorder", Event)
    reg = d.receive(ReceiveSpec(transfer_id="dev", block_ids=[1]))
    with p.begin_step([TransferSpec.from_registration(reg, src_blocks=[0])]) as step:
        assert isinstance(step, DeviceStep)
        handed = []
        for layer in range(SHAPE.num_layers):
            handed.append(time.perf_counter())
            step.layer_ready(layer)
    outcome = p.wait_outcome("dev", 10)
    assert outcome.ok, outcome.reason
    assert len(recorded) >= SHAPE.num_layers   # every layer's write waited on its own event
    for timing, before in zip(outcome.layers, handed):
        assert before <= timing.handed_s <= before + 0.01   # the forward's time, not the loop's look
    assert READY.query()


@pytest.mark.parametrize("layers, gap, most_looks", [(16, 0.02, 56), (12, 0.12, 170)], ids=["20ms", "120ms"])
def test_layers_at_a_steady_rhythm_cost_few_looks_and_still_wait_at_most_a_tick(layers, gap, most_looks):
    """A prefill hands a layer every ~20 ms; the loop sleeps through most of each gap (LayerPace)
    rather than ticking through it (1, 2, then every 4 ms: ~6 looks per layer), and no layer waits
    for its look much longer than the bridge's longest tick (measured on a 2-core VM: 40-43 looks
    against 97-98 without the pace; median wait 0.9-1.3 ms either way). A slow CPU prefill, a layer
    every 120 ms: ~30 ticks before the first, then ~6 looks per layer (~240 in all were the nap
    capped at 50 ms)."""
    shape = KVShape(num_layers=layers, num_blocks=4, block_size=4, kv_heads=1, head_dim=8, dtype="float16")
    p2 = Runtime(NodeConfig(engine_id="p-pace", backend="memory"), Timeouts(receive=20)).start()
    d2 = Runtime(NodeConfig(engine_id="d-pace", backend="memory"), Timeouts(receive=20)).start()
    try:
        host_cache(p2, shape, 3, host_memory=True)
        host_cache(d2, shape, None, host_memory=True)
        reg = d2.receive(ReceiveSpec(transfer_id="paced", block_ids=[1]))
        looks, handed = p2.sender.inbox_looks, []
        with p2.begin_step([TransferSpec.from_registration(reg, src_blocks=[2])]) as step:
            for layer in range(layers):
                time.sleep(gap)
                handed.append(time.perf_counter())
                step.layer_ready(layer)
        looks = p2.sender.inbox_looks - looks
        outcome = p2.wait_outcome("paced", 10)
        assert outcome.ok and d2.wait_received("paced", 10).ok
    finally:
        p2.stop()
        d2.stop()
    # in host memory a layer's handed_s is the look that took it from the inbox
    waits = sorted(t.handed_s - handed[t.layer] for t in outcome.layers)
    assert waits[0] >= 0, waits
    assert looks <= most_looks, f"{looks} looks for {layers} layers {gap * 1e3:.0f} ms apart"
    # the median layer: within the longest tick (4 ms) plus a loaded box's scheduling delay
    assert waits[layers // 2] < p2.bridge.max_poll_s + 0.006, waits
