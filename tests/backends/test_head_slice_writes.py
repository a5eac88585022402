"""Head-slice speed: what made the scale scenario fast keeps the write contract.

- ``LayerPlan`` (every layer's addresses in one numpy pass per transfer) gives exactly what
  ``layer_runs`` gives, layer by layer and for layers written together.
- ``MooncakeBackend.start_write`` (a write with no coroutine) submits nothing to a target whose
  segment is not open, and its future settles as ``write`` would: failed runs reported only once
  every run settled, the good ones landed (real engine, real ``aiolayer node``).
- A target never has more runs in flight than the backend's cap (Mooncake's per-peer queue breaks
  the link past 65,535): the rest wait and go as runs settle, in write order, and land; a write
  whose deadline comes while runs still wait fails with them never submitted.
- The streamer sends the layers that are ready together as ONE backend write, and the scale report
  gives both raw-Mooncake methods with the faster as the baseline. No test asserts a speed.
"""

from __future__ import annotations

import asyncio
import zlib

import numpy as np
import pytest

from helpers_node import SMALL_SHAPE, apply_mc_env, mooncake_p, stoppable_node

apply_mc_env()  # before any Mooncake engine exists in this process

from aiolayer.backends.mooncake import MooncakeBackend
from aiolayer.errors import BackendError, TransferTimeout
from aiolayer.protocol import messages as m
from aiolayer.protocol.plan import HeadGeometry, RankRoute, merge_runs, slice_addresses
from aiolayer.runtime.spec import LocalLayout, layer_runs
from aiolayer.runtime.send.stream import LayerPlan
from aiolayer.bench.scenarios.scale.driver import run_scenario
from aiolayer.bench.scenarios.scale.model import ScaleConfig

pytestmark = pytest.mark.timeout(90)
SHAPE = SMALL_SHAPE
HALF = SHAPE.block_bytes // 2


class _DLayout:
    """The fields of D's layout that address writes (as the sender's layout entry has them)."""

    def __init__(self, k_base, v_base) -> None:
        self.k_base, self.v_base = k_base, v_base


@pytest.mark.parametrize("planes", ["KV", "K", "mixed"])
@pytest.mark.parametrize("sliced", [False, True])
def test_layer_plan_gives_exactly_what_layer_runs_gives(planes, sliced):
    rng = np.random.default_rng(len(planes) + sliced)
    layers, block_bytes = 5, 4 * 16 * 256
    k = rng.integers(1 << 20, 1 << 40, layers)
    v = rng.integers(1 << 20, 1 << 40, layers) if planes != "K" else np.zeros(layers, dtype=np.int64)
    if planes == "mixed":
        v[2] = 0
    local = LocalLayout(k_base=k, v_base=v, block_bytes=block_bytes, num_blocks=64,
                        geometry=HeadGeometry(16, 256, "HND"), heads=4)
    d = _DLayout(rng.integers(1 << 20, 1 << 40, layers).tolist(), rng.integers(1 << 20, 1 << 40, layers))
    runs = merge_runs([3, 4, 5, 9, 20], [7, 8, 9, 30, 2])
    spans = slice_addresses(runs, 0, 0, 4, 2, RankRoute(0, 1, 2, 0, 2), local.geometry) if sliced else None
    plan = LayerPlan(local, runs, spans, d)
    for group in ([0], [1, 2, 3], list(range(layers)), [4, 0], [0, 4, 2]):
        src, dst, lengths, nbytes = plan.rows(group)
        want = [np.concatenate([layer_runs(local, runs, spans, d, layer)[i] for layer in group]) for i in range(3)]
        assert np.array_equal(src, want[0]) and np.array_equal(dst, want[1]) and np.array_equal(lengths, want[2])
        assert nbytes == int(want[2].sum())


@pytest.fixture
def d_node():
    with stoppable_node(SHAPE) as node:
        yield node


@pytest.fixture
def p_side():
    with mooncake_p("p-i14-speed", 41, SHAPE) as side:
        yield side


def half_block_runs(rt, cache, d_control: str, tid: str):
    """A transfer allocated at D, scattered: layer 0's K as 64 half-block runs (src, dst, lengths, layout)."""
    rep = rt.request(d_control, m.AllocRequest(transfer_id=tid, num_blocks=32, contiguous=False), timeout=5)
    layout = rt.request(d_control, m.LayoutRequest(transfer_id=tid, token=rep.token), timeout=5)
    src, dst = [], []
    for i, b in enumerate(rep.block_ids):
        for half in (0, HALF):
            src.append(cache.k_base[0] + i * SHAPE.block_bytes + half)
            dst.append(layout.layers[0].k_base + b * SHAPE.block_bytes + half)
    src, dst = np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)
    return src, dst, np.full(src.size, HALF, dtype=np.int64), layout


def layer0_k_crc(cache) -> int:
    return zlib.crc32(b"".join(cache.blocks[0][0][i].tobytes() for i in range(32)))


def test_start_write_submits_nothing_unopened_and_settles_as_write_does(p_side, d_node):
    rt, cache = p_side
    backend = rt.backend
    src, dst, lengths, layout = half_block_runs(rt, cache, d_node.control, "sw")
    bad = dst.copy()
    bad[3::8] = layout.layers[0].k_base + (1 << 36)   # past any region D registered: Mooncake fails these

    async def go():
        before = backend.runs_submitted
        unopened = backend.start_write(layout.session, src, dst, lengths, 10.0)
        assert unopened is None and backend.runs_submitted == before, "submitted to an unopened target"
        await backend.write(layout.session, src[:1], dst[:1], lengths[:1], 10.0)   # opens the segment
        settled = backend.start_write(layout.session, src, bad, lengths, 10.0)
        assert settled is not None and backend.runs_submitted == before + 1 + src.size
        try:
            await settled
        except BackendError as exc:
            assert backend.inflight == 0, "the future settled before every run of the call"
            return str(exc)
        return "no error"
    assert "8 of 64 writes" in rt.loop_thread.call(go(), timeout=40)
    assert rt.backend.quarantined == 0

    async def rest():   # the failed runs alone, as one more task-less write
        await backend.start_write(layout.session, src[3::8], dst[3::8], lengths[3::8], 10.0)
    rt.loop_thread.call(rest(), timeout=40)
    crc = rt.request(d_node.control, m.VerifyRequest(transfer_id="sw"), timeout=5).crc_k[0]
    assert crc == layer0_k_crc(cache)


@pytest.fixture
def p_capped():
    with mooncake_p("p-i14-cap", 43, SHAPE, backend=MooncakeBackend(max_runs_per_target=8)) as side:
        yield side


def test_a_target_never_has_more_runs_in_flight_than_the_cap(p_capped, d_node):
    rt, cache = p_capped
    backend = rt.backend
    first = half_block_runs(rt, cache, d_node.control, "cap-a")
    second = half_block_runs(rt, cache, d_node.control, "cap-b")

    async def go():
        src, dst, lengths, layout = first
        await backend.write(layout.session, src[:1], dst[:1], lengths[:1], 10.0)   # opens the segment
        settled = [backend.start_write(layout.session, *runs[:3], 20.0) for runs in (first, second)]
        assert backend.inflight == 8, "more than the cap submitted at once"
        await asyncio.gather(*settled)
        return backend.runs_submitted
    assert rt.loop_thread.call(go(), timeout=40) >= 129
    assert backend.peak_runs_per_target == 8 and backend.inflight == 0
    for tid in ("cap-a", "cap-b"):   # every waiting run was submitted in the end, and landed
        assert rt.request(d_node.control, m.VerifyRequest(transfer_id=tid), timeout=5).crc_k[0] == layer0_k_crc(cache)

    async def late():   # 64 runs, 8 at a time, one top-up per 1 ms tick: not all submitted in 3 ms
        src, dst, lengths, layout = first
        try:
            await backend.start_write(layout.session, src, dst, lengths, 0.003)
        except TransferTimeout as exc:
            await asyncio.wait_for(asyncio.gather(*exc.pending), 20)   # those submitted still end
            return str(exc)
        return "no error"
    reason = rt.loop_thread.call(late(), timeout=40)
    assert "never submitted (its queue was full)" in reason, reason
    assert backend.inflight == 0 and backend.peak_runs_per_target == 8


@pytest.mark.timeout(240)   # three processes start; slow only on a loaded host
def test_layers_ready_together_go_as_one_write_and_the_report_has_both_raw_methods():
    cfg = ScaleConfig(p_tp=1, d_tp=2, requests=12, blocks_per_request=1, num_layers=6, kv_heads=4, head_dim=64,
                      wait_s=60.0)
    report = run_scenario(cfg)
    assert report["all_verified"], report["failures"]
    p = report["per_p_rank"][0]
    # every layer is ready before the transfers start: one write per transfer, not one per layer
    # (a transfer that reaches D first may still open the segment with a write of its own)
    assert p["backend_writes"] < p["specs"] * cfg.num_layers // 2, p
    methods = report["raw_methods"]
    assert set(methods) == {"batch", "single"}
    assert all(x["writes"] == p["writes_submitted"] and x["failed_batches"] == 0 for x in methods.values())
    best = max(methods, key=lambda name: methods[name]["gbps"])
    assert report["raw_best"] == best and report["raw_gbps"] == methods[best]["gbps"]
