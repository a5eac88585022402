"""Head-slice speed: the Mooncake backend's grouped writes keep their contract, slices merge
where both sides are contiguous, and ``aiolayer bench scale`` reports the raw-Mooncake baseline.

The backend tests use the real engine against an ``aiolayer node`` subprocess: a group of many small
runs with some to an address D never registered (Mooncake fails those, the rest land), and one with
D stopped (SIGSTOP) past the deadline (runs still pending go to quarantine and land once D resumes).
Either way, ``write`` returns only when every run of the call settled. No test asserts a speed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import zlib

import numpy as np
import pytest

from helpers_node import SMALL_SHAPE, apply_mc_env, freeze, mooncake_p, stoppable_node

apply_mc_env()  # before any Mooncake engine exists in this process

from aiolayer.errors import BackendError, TransferTimeout
from aiolayer.protocol import messages as m
from aiolayer.protocol.plan import HeadGeometry, RankRoute, map_ranks, merge_runs, run_addresses, slice_addresses
from aiolayer.bench.scenarios.scale.driver import run_scenario
from aiolayer.bench.scenarios.scale.model import ScaleConfig

pytestmark = pytest.mark.timeout(90)
SHAPE = SMALL_SHAPE
HALF = SHAPE.block_bytes // 2


@pytest.fixture
def d_node():
    with stoppable_node(SHAPE) as node:
        yield node


@pytest.fixture
def p_side():
    with mooncake_p("p-i14", 14, SHAPE) as side:
        yield side


def _target(rt, node, tid: str, n: int):
    """Blocks allocated at D for ``tid`` and D's layout (its session and bases)."""
    rep = rt.request(node.control, m.AllocRequest(transfer_id=tid, num_blocks=n, contiguous=False), timeout=5)
    assert isinstance(rep, m.AllocReply), rep
    layout = rt.request(node.control, m.LayoutRequest(transfer_id=tid, token=rep.token), timeout=5)
    return rep, layout


def _half_block_runs(cache, rep, layout, layer: int = 0):
    """Layer ``layer``'s K of P's blocks 0..n-1 into D's blocks, two runs per block (half a block each)."""
    src, dst = [], []
    for i, b in enumerate(rep.block_ids):
        for half in (0, HALF):
            src.append(cache.k_base[layer] + i * SHAPE.block_bytes + half)
            dst.append(layout.layers[layer].k_base + b * SHAPE.block_bytes + half)
    return np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64), np.full(len(src), HALF, dtype=np.int64)


def _write(rt, session, src, dst, lengths, timeout: float):
    async def go():
        try:
            await rt.backend.write(session, src, dst, lengths, timeout)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc
        return None
    return rt.loop_thread.call(go(), timeout=timeout + 30)


def _d_crc_k(rt, node, tid: str) -> int:
    return rt.request(node.control, m.VerifyRequest(transfer_id=tid), timeout=5).crc_k[0]


def test_group_with_failed_runs_settles_every_run_before_write_returns(p_side, d_node):
    rt, cache = p_side
    rep, layout = _target(rt, d_node, "g-fail", 32)
    src, dst, lengths = _half_block_runs(cache, rep, layout)
    _write(rt, layout.session, src[:1], dst[:1], lengths[:1], 5.0)   # opens the segment
    bad = dst.copy()
    bad[5::8] = layout.layers[0].k_base + (1 << 36)   # far past any region D registered
    exc = _write(rt, layout.session, src, bad, lengths, 10.0)
    assert isinstance(exc, BackendError) and "8 of 64 writes" in str(exc), repr(exc)
    assert rt.backend.inflight == 0 and rt.backend.quarantined == 0
    # the good runs landed: writing only the failed ones now makes D's blocks whole
    assert _write(rt, layout.session, src[5::8], dst[5::8], lengths[5::8], 10.0) is None
    expected = zlib.crc32(b"".join(cache.blocks[0][0][i].tobytes() for i in range(32)))
    assert _d_crc_k(rt, d_node, "g-fail") == expected


def test_group_past_its_deadline_quarantines_what_is_pending(p_side, d_node):
    rt, cache = p_side
    rep, layout = _target(rt, d_node, "g-late", 32)
    src, dst, lengths = _half_block_runs(cache, rep, layout)
    _write(rt, layout.session, src[:1], dst[:1], lengths[:1], 5.0)   # opens the segment
    freeze(d_node.pid)   # every thread stopped: a run could otherwise still land before it
    exc = _write(rt, layout.session, src, dst, lengths, 0.5)
    assert isinstance(exc, TransferTimeout), repr(exc)
    pending = exc.pending
    assert 1 <= len(pending) <= 64 and not any(f.done() for f in pending)
    assert rt.backend.inflight == 0, "a run of the group was neither settled nor quarantined"
    assert rt.backend.quarantined == len(pending)
    os.kill(d_node.pid, signal.SIGCONT)

    async def settle():
        await asyncio.wait_for(asyncio.gather(*(asyncio.shield(f) for f in pending)), 20)
    rt.loop_thread.call(settle(), timeout=25)
    assert rt.backend.quarantined == 0
    expected = zlib.crc32(b"".join(cache.blocks[0][0][i].tobytes() for i in range(32)))
    assert _d_crc_k(rt, d_node, "g-late") == expected   # the timed-out runs landed after all


def test_many_concurrent_groups_all_land(p_side, d_node):
    """Every layer of a transfer as its own group, all in flight together, on one target."""
    rt, cache = p_side
    rep, layout = _target(rt, d_node, "g-many", 32)

    async def all_layers():
        writes = [rt.backend.write(layout.session, *_half_block_runs(cache, rep, layout, layer), 10.0)
                  for layer in range(SHAPE.num_layers)]
        return await asyncio.gather(*writes, return_exceptions=True)
    assert rt.loop_thread.call(all_layers(), timeout=40) == [None] * SHAPE.num_layers
    assert rt.backend.inflight == 0 and rt.backend.quarantined == 0
    reply = rt.request(d_node.control, m.VerifyRequest(transfer_id="g-many"), timeout=5)
    for layer in range(SHAPE.num_layers):
        assert reply.crc_k[layer] == zlib.crc32(b"".join(cache.blocks[layer][0][i].tobytes() for i in range(32)))


def test_slices_contiguous_on_both_sides_merge():
    """P TP == D TP: each route is whole blocks, so contiguous blocks give one span per run."""
    runs = merge_runs(range(10, 18), range(40, 48))
    for layout in ("HND", "NHD"):
        geom = HeadGeometry(16, 256, layout)
        for route in map_ranks(8, 2, 2):
            spans = slice_addresses(runs, 0, 0, 4, 4, route, geom)
            whole = run_addresses(runs, 0, 0, 16 * 4 * 256)
            assert all(np.array_equal(a, b) for a, b in zip(spans, whole)) and spans[0].size == 1
        # a slice contiguous on neither side stays one span per block (HND) or per token (NHD)
        half = slice_addresses(runs, 0, 0, 4, 2, RankRoute(0, 0, 2, 0, 2), geom)
        assert half[0].size == (8 if layout == "HND" else 8 * 16)


@pytest.mark.timeout(240)   # three processes start; slow only on a loaded host
def test_scale_reports_raw_mooncake_for_the_same_slices():
    """One P rank's heads split over two D ranks (head slices, NHD: one span per token)."""
    cfg = ScaleConfig(p_tp=1, d_tp=2, requests=20, blocks_per_request=2, num_layers=2, kv_heads=4, head_dim=64,
                      layout="NHD", wait_s=60.0)
    report = run_scenario(cfg)
    assert report["all_verified"], report["failures"]
    assert report["raw"]["failed_batches"] == 0 and report["raw"]["writes"] > 0
    assert report["raw_same_spans"], (report["raw"], [p["writes_submitted"] for p in report["per_p_rank"]])
    assert report["raw_gbps"] > 0 and report["raw_ratio"] > 0
    assert set(report["cpu_s_per_gb"]) == {"loop", "process", "raw_process"}
    assert all(p["raw_gbps"] > 0 and p["loop_cpu_s"] >= 0 for p in report["per_p_rank"])
    json.dumps(report)   # what bench writes to scale.json
