"""Issue 14, head-slice speed: the backend's task-less write keeps the write contract, and the scale
report compares with the faster of two raw-Mooncake methods.

- ``MooncakeBackend.start_write`` (a write with no coroutine) submits nothing to a target whose
  segment is not open, and its future settles as ``write`` would: failed runs reported only once
  every run settled, the good ones landed (real engine, real ``aiolayer node``).
- The scale report gives both raw-Mooncake methods with the faster as the baseline. No test asserts
  a speed. (The streamer's use of ``start_write``, one write for the layers ready together, is on
  the ``issue14-speed`` branch: see the session-6 note.)
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from helpers_node import SMALL_SHAPE, apply_mc_env, mooncake_p, stoppable_node

apply_mc_env()  # before any Mooncake engine exists in this process

from aiolayer.errors import BackendError  # noqa: E402
from aiolayer.protocol import messages as m  # noqa: E402
from aiolayer.bench.scenarios.scale.driver import run_scenario  # noqa: E402
from aiolayer.bench.scenarios.scale.model import ScaleConfig  # noqa: E402

pytestmark = pytest.mark.timeout(90)
SHAPE = SMALL_SHAPE
HALF = SHAPE.block_bytes // 2


@pytest.fixture
def d_node():
    with stoppable_node(SHAPE) as node:
        yield node


@pytest.fixture
def p_side():
    with mooncake_p("p-i14-speed", 41, SHAPE) as side:
        yield side


def test_issue14_speed_start_write_settles_as_write_does(p_side, d_node):
    rt, cache = p_side
    backend = rt.backend
    rep = rt.request(d_node.control, m.AllocRequest(transfer_id="sw", num_blocks=32, contiguous=False), timeout=5)
    layout = rt.request(d_node.control, m.LayoutRequest(transfer_id="sw", token=rep.token), timeout=5)
    src, dst = [], []
    for i, b in enumerate(rep.block_ids):
        for half in (0, HALF):
            src.append(cache.k_base[0] + i * SHAPE.block_bytes + half)
            dst.append(layout.layers[0].k_base + b * SHAPE.block_bytes + half)
    src, dst = np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)
    lengths = np.full(src.size, HALF, dtype=np.int64)
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
    assert crc == zlib.crc32(b"".join(cache.blocks[0][0][i].tobytes() for i in range(32)))


@pytest.mark.timeout(240)   # three processes start; slow only on a loaded host
def test_issue14_speed_raw_has_both_methods_and_the_faster_is_the_baseline():
    cfg = ScaleConfig(p_tp=1, d_tp=2, requests=12, blocks_per_request=1, num_layers=6, kv_heads=4, head_dim=64,
                      wait_s=60.0)
    report = run_scenario(cfg)
    assert report["all_verified"], report["failures"]
    p = report["per_p_rank"][0]
    methods = report["raw_methods"]
    assert set(methods) == {"batch", "single"}
    assert all(x["writes"] == p["writes_submitted"] and x["failed_batches"] == 0 for x in methods.values())
    best = max(methods, key=lambda name: methods[name]["gbps"])
    assert report["raw_best"] == best and report["raw_gbps"] == methods[best]["gbps"]
