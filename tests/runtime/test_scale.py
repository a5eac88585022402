"""Head-slice transfers between TP ranks of different sizes, and ``aiolayer bench scale``.

In process (memory backend, bytes checked exactly): every topology's routes (``map_ranks``) land
each D rank's heads where they belong, in both block layouts; D ends a transfer written by k P
ranks only once all k reported; incompatible geometries fail with LayoutMismatch. Then the scale
scenario for real: P rank and D rank processes over Mooncake, every transfer verified at D.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import numpy as np
import pytest

from aiolayer import DecodeNode, KVShape, NodeConfig, Runtime, TransferSpec
from aiolayer.config import Timeouts
from aiolayer.errors import ConfigError, ControlRejected
from aiolayer.kvcache import PagedKVCache
from aiolayer.protocol import messages as m
from aiolayer.protocol.plan import HeadGeometry, RankRoute, map_ranks, routes_from
from aiolayer.runtime.receive.receiver import Receiver
from aiolayer.bench.scenarios.scale.driver import run_scale, run_scenario
from aiolayer.bench.scenarios.scale.model import ScaleConfig, rank_heads

LAYERS, BLOCK_SIZE, HEAD_DIM, NUM_BLOCKS = 3, 4, 8, 24
TOKEN = "t" * 32


def _shape(heads: int, layout: str) -> KVShape:
    return KVShape(num_layers=LAYERS, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, kv_heads=heads,
                   head_dim=HEAD_DIM, dtype="float16", layout=layout)


def _geometry(layout: str) -> HeadGeometry:
    return HeadGeometry(BLOCK_SIZE, HEAD_DIM * 2, layout)


def _as_layout(view: np.ndarray, layout: str) -> np.ndarray:
    """A cache's [block, token, head, dim] (NHD) or [block, head, token, dim] (HND) view as
    [block, head, token, dim]."""
    return view.transpose(0, 2, 1, 3) if layout == "NHD" else view


class _P:
    """One P rank in process: its local heads of the global KV, published with their geometry."""

    def __init__(self, rank: int, heads: list[int], kv: np.ndarray, layout: str, geometry: bool = True) -> None:
        self.cache = PagedKVCache(_shape(len(heads), layout))
        for layer in range(LAYERS):
            for plane in (0, 1):
                _as_layout(self.cache.layer_view(layer, plane), layout)[:] = kv[layer, plane][:, heads]
        self.rt = Runtime(NodeConfig(engine_id=f"p{rank}", backend="memory")).start()
        geo = dict(kv_heads=len(heads), geometry=_geometry(layout)) if geometry else {}
        self.rt.register_kv_memory(self.cache.k_base, self.cache.v_base, self.cache.shape.block_bytes, NUM_BLOCKS,
                                   **geo)


def _global_kv(kv_heads: int, seed: int) -> np.ndarray:
    """[layer, plane, block, head, token, dim] float16, random."""
    bits = np.random.default_rng(seed).integers(0, 1 << 16, (LAYERS, 2, NUM_BLOCKS, kv_heads, BLOCK_SIZE, HEAD_DIM),
                                                dtype=np.uint16)
    return bits.view(np.float16)


def _run_topology(kv_heads, p_tp, d_tp, layout, src_blocks, contiguous=False, seed=0):
    """Every P rank sends its routes of one request to every D rank; returns (D nodes, P ranks, outcomes)."""
    kv = _global_kv(kv_heads, seed)
    routes = map_ranks(kv_heads, p_tp, d_tp)
    d_heads = [rank_heads(kv_heads, d_tp, d) for d in range(d_tp)]
    nodes = [DecodeNode(_shape(len(h), layout), NodeConfig(engine_id=f"d{d}", backend="memory")).start()
             for d, h in enumerate(d_heads)]
    ps: list[_P] = []
    try:
        ps = [_P(p, rank_heads(kv_heads, p_tp, p), kv, layout) for p in range(p_tp)]
        writers = {d: {r.p_rank for r in routes if r.d_rank == d} for d in range(d_tp)}
        allocs = [ps[0].rt.request(nodes[d].control_endpoint, m.AllocRequest(
            transfer_id=f"t-d{d}", num_blocks=len(src_blocks), contiguous=contiguous, token=TOKEN,
            senders=len(writers[d]))) for d in range(d_tp)]
        for p, rank in enumerate(ps):
            specs = [TransferSpec.from_registration(allocs[r.d_rank], src_blocks=src_blocks,
                                                    peer=nodes[r.d_rank].control_endpoint, route=r)
                     for r in routes_from(routes, p)]
            rank.rt.sender.begin_step(0, specs)
            for layer in range(LAYERS):
                rank.rt.sender.layer_ready(0, layer)
            rank.rt.sender.end_step(0)
        outcomes = {(p, r.d_rank): ps[p].rt.sender.wait(f"t-d{r.d_rank}", 10) for p in range(p_tp)
                    for r in routes_from(routes, p)}
        for d, node in enumerate(nodes):   # exactly the global KV's heads of this rank, every layer and plane
            ids = allocs[d].block_ids
            for layer in range(LAYERS):
                for plane in (0, 1):
                    got = _as_layout(node.cache.layer_view(layer, plane), layout)[ids]
                    want = kv[layer, plane][src_blocks][:, d_heads[d]]
                    assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), (d, layer, plane)
        return nodes, ps, outcomes, allocs
    finally:
        for rank in ps:
            rank.rt.stop()
        for node in nodes:
            node.stop()


pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("kv_heads,p_tp,d_tp", [(4, 2, 1), (4, 1, 2), (8, 2, 4), (8, 4, 2), (2, 1, 4), (2, 4, 1),
                                                (4, 2, 2)], ids=lambda v: str(v))
def test_head_slices_land_exactly(kv_heads, p_tp, d_tp, layout):
    src = [5, 6, 7, 20, 2]   # runs broken on purpose; D allocates scattered blocks
    nodes, ps, outcomes, allocs = _run_topology(kv_heads, p_tp, d_tp, layout, src)
    assert all(o.ok for o in outcomes.values()), {k: o.reason for k, o in outcomes.items() if not o.ok}
    d_block = nodes[0].shape.block_bytes
    for (p, d), out in outcomes.items():
        route = next(r for r in routes_from(map_ranks(kv_heads, p_tp, d_tp), p) if r.d_rank == d)
        assert out.bytes == 2 * LAYERS * len(src) * d_block * route.num_heads // nodes[d].shape.kv_heads


def _one_p_one_d(p_heads: int, d_shape: KVShape, p_layout: str, route: RankRoute, p_geometry: bool = True):
    kv = _global_kv(max(p_heads, d_shape.kv_heads), 1)
    node = DecodeNode(d_shape, NodeConfig(engine_id="d-mis", backend="memory")).start()
    rank = None
    try:
        rank = _P(0, list(range(p_heads)), kv, p_layout, geometry=p_geometry)
        rep = rank.rt.request(node.control_endpoint, m.AllocRequest(transfer_id="x", num_blocks=2, token=TOKEN))
        spec = TransferSpec.from_registration(rep, src_blocks=[0, 1], peer=node.control_endpoint, route=route)
        rank.rt.sender.begin_step(0, [spec])
        for layer in range(LAYERS):
            rank.rt.sender.layer_ready(0, layer)
        rank.rt.sender.end_step(0)
        out = rank.rt.sender.wait("x", 10)
        deadline = time.monotonic() + 5
        state = node.runtime.receiver.state_of("x")[0]
        while state != "failed" and time.monotonic() < deadline:   # FAILED follows the outcome at once
            time.sleep(0.02)
            state = node.runtime.receiver.state_of("x")[0]
        return out, state
    finally:
        if rank is not None:
            rank.rt.stop()
        node.stop()


@pytest.mark.parametrize("case", ["layout", "block_size", "heads_out_of_range", "p_without_geometry"])
def test_incompatible_geometry_fails_with_layout_mismatch(case):
    d_shape, p_layout, p_geo = _shape(2, "HND"), "HND", True
    route = RankRoute(0, 0, 0, 0, 2)
    if case == "layout":
        d_shape = _shape(2, "NHD")
    elif case == "block_size":
        d_shape = KVShape(**{**{f: getattr(d_shape, f) for f in d_shape.__struct_fields__}, "block_size": 8,
                             "head_dim": HEAD_DIM // 2})   # same block bytes, other geometry
    elif case == "heads_out_of_range":
        route = RankRoute(0, 0, 1, 1, 2)
    else:
        p_geo = False
    out, d_state = _one_p_one_d(4, d_shape, p_layout, route, p_geo)
    assert not out.ok and "LayoutMismatch" in out.reason, out.reason
    assert d_state == "failed"


def test_register_kv_memory_refuses_a_geometry_that_does_not_describe_the_blocks(memory_runtime):
    rt = memory_runtime("p-geo")
    cache = PagedKVCache(_shape(2, "HND"))
    with pytest.raises(ConfigError, match="is not the block size"):
        rt.register_kv_memory(cache.k_base, cache.v_base, cache.shape.block_bytes, NUM_BLOCKS, kv_heads=3,
                          geometry=_geometry("HND"))
    with pytest.raises(ConfigError, match="is not the block size"):   # one plane (V bases 0): same check
        rt.register_kv_memory(cache.k_base, [0] * LAYERS, cache.shape.block_bytes, NUM_BLOCKS, kv_heads=3,
                          geometry=_geometry("HND"))
    with pytest.raises(ConfigError, match="without its geometry"):
        rt.register_kv_memory(cache.k_base, cache.v_base, cache.shape.block_bytes, NUM_BLOCKS, kv_heads=2)
    with pytest.raises(ConfigError, match="layout"):
        KVShape(layout="XYZ")


def test_decode_node_publishes_its_geometry(memory_runtime):
    node = DecodeNode(_shape(2, "HND"), NodeConfig(engine_id="d-pub", backend="memory")).start()
    try:
        reply = node.runtime.layout_reply
        assert ((reply.kv_heads, reply.block_size, reply.head_bytes, reply.kv_layout)
                == (2, BLOCK_SIZE, 2 * HEAD_DIM, "HND"))
        assert m.decode(m.encode(reply)) == reply
    finally:
        node.stop()


# --- D: one transfer, k senders -------------------------------------------------------------------

def _done(sender: str, nbytes: int = 10) -> m.Done:
    return m.Done(transfer_id="k", sender=sender, bytes=nbytes, token=TOKEN)


async def test_receiver_waits_for_every_sender():
    rx = Receiver(Timeouts())
    try:
        rx.register("k", [1, 2], token=TOKEN, senders=2)
        assert rx.pending == 1
        assert rx.handle(_done("p0")).detail == "1 of 2 senders reported"
        assert rx.pending == 1
        assert rx.state_of("k")[0] == "registered"    # p1 may still write: the blocks stay fenced
        assert rx.handle(_done("p0")).detail == "1 of 2 senders reported"
        assert rx.duplicates == 1
        assert rx.handle(_done("p1")).detail == "finished"
        assert rx.state_of("k")[0] == "finished"
        assert rx.pending == 0
        assert [r.ok for r in rx.pop_results()] == [True]
        assert rx.handle(_done("p1")).detail == "already finished"
        with pytest.raises(ControlRejected, match="already has its 2 writer"):
            rx.handle(_done("p2"))
    finally:
        rx.close()


async def test_receiver_k_senders_one_failed():
    rx = Receiver(Timeouts())
    try:
        rx.register("k", [1], token=TOKEN, senders=2)
        rx.handle(m.Failed(transfer_id="k", sender="p1", reason="boom", token=TOKEN))
        assert rx.state_of("k")[0] == "registered"    # p0 has not said it is quiet yet
        rx.handle(_done("p0"))
        state, reason = rx.state_of("k")
        assert state == "failed" and "boom" in reason
        with pytest.raises(ConfigError):
            rx.register("k2", [2], token=TOKEN, senders=0)
    finally:
        rx.close()


async def test_receiver_counts_unsettled_transfers_through_every_ending():
    """``pending`` (the metrics' receiving queue) is kept as a count: it must match the entries not
    settled yet through DONE, duplicate DONE, abort + fence grace, release, and early words."""
    rx = Receiver(Timeouts(fence_grace=0.05))
    rx.bind(lambda coro, name: asyncio.ensure_future(coro), stop_sender=None)
    try:
        for tid in ("a", "b", "c"):
            rx.register(tid, [1], token=TOKEN)
        assert rx.pending == 3
        rx.handle(m.Done(transfer_id="a", sender="p0", bytes=1, token=TOKEN))
        rx.handle(m.Done(transfer_id="a", sender="p0", bytes=1, token=TOKEN))   # a duplicate settles nothing
        assert rx.pending == 2
        rx.abort("b", "test")
        assert rx.pending == 2   # aborting: fenced, not settled
        for _ in range(100):
            if rx.state_of("b")[0] == "failed":
                break
            await asyncio.sleep(0.01)
        assert rx.state_of("b")[0] == "failed" and rx.pending == 1
        assert rx.release("a") and rx.release("b") and rx.pending == 1
        rx.handle(m.Done(transfer_id="d", sender="p0", bytes=1, token=TOKEN))   # early: kept for "d"
        rx.register("d", [2], token=TOKEN)   # settles at once with the early DONE
        assert rx.state_of("d")[0] == "finished" and rx.pending == 1
        assert rx.pending == sum(1 for tid in "abcd" if rx.state_of(tid)[0] == "registered")
    finally:
        rx.close()
    assert rx.pending == 0


# --- the scenario, for real: processes over Mooncake ----------------------------------------------

def _children() -> set[int]:
    pids: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids.update(int(x) for x in f.read().split())
        except OSError:
            pass
    return pids


def _assert_all_verified(report: dict) -> None:
    assert report["verified"] == report["transfers"] == report["requests"] * report["decode_ranks"], report["failures"]
    assert report["failed"] == 0 and report["lost"] == 0 and report["all_verified"], report["failures"]
    assert report["concurrent"] >= 0.9 * report["requests"]   # one step per rank: all in flight together
    assert all(p["ok"] == p["specs"] for p in report["per_p_rank"])


def test_scale_two_p_ranks_to_four_d_ranks(tmp_path):
    from aiolayer.bench.main import add_bench_args
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    args = parser.parse_args(["scale", "--prefill-ranks", "2", "--decode-ranks", "4",
                              "--requests", "150", "--num-layers", "4", "--head-dim", "64", "--out", str(tmp_path),
                              "--against-whole-blocks"])
    before = _children()
    t0 = time.monotonic()
    assert run_scale(args) == 0
    assert time.monotonic() - t0 < 120
    report = __import__("json").loads((tmp_path / "scale.json").read_text())
    _assert_all_verified(report)
    assert [d["senders"] for d in report["per_d_rank"]] == [1, 1, 1, 1]
    whole = report["whole_blocks"]   # the same requests again, 2 P -> 2 D, in the same run
    assert whole["decode_ranks"] == 2 and whole["all_verified"] and whole["verified"] == whole["transfers"] == 300
    assert whole["loop_cpu_head_slices_over_whole_blocks"] > 0 and whole["raw_cpu_head_slices_over_whole_blocks"] > 0
    assert report["loop_us_per_run"] > 0 and whole["loop_us_per_run"] > 0   # loop CPU over runs submitted
    assert whole["loop_cpu_per_run_head_slices_over_whole_blocks"] > 0
    assert _children() <= before, "a P or D rank process is still running"


def test_scale_more_p_ranks_than_d_ranks_nhd():
    """P_tp > D_tp: two P ranks write disjoint head slices of each D transfer (senders=2); NHD spans per token."""
    cfg = ScaleConfig(p_tp=4, d_tp=2, requests=100, blocks_per_request=2, num_layers=4, kv_heads=8, head_dim=64,
                      layout="NHD", contiguous=False, wait_s=60.0)
    before = _children()
    report = run_scenario(cfg)
    _assert_all_verified(report)
    assert [d["senders"] for d in report["per_d_rank"]] == [2, 2]
    assert _children() <= before, "a P or D rank process is still running"
