"""TP/DP rank mapping: P -> D head routes, head-slice byte spans, DP endpoint lookup.

The core property copies real bytes: every P rank's cache is built from one global KV array,
every route's spans are applied as byte copies, and each D rank must end up holding exactly its
own heads of that array at its destination blocks, with every other byte untouched.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiolayer.protocol.plan import (
    HeadGeometry,
    RankRoute,
    _merge_spans,
    dp_endpoint,
    local_heads,
    map_ranks,
    merge_runs,
    routes_from,
    run_addresses,
    slice_addresses,
)

KV_CHOICES = [1, 2, 3, 4, 6, 8]
MAX_TP = 16


def _valid_tps(kv_heads: int) -> list[int]:
    return [t for t in range(1, MAX_TP + 1)
            if (t <= kv_heads and kv_heads % t == 0) or (t > kv_heads and t % kv_heads == 0)]


def _held_heads(kv_heads: int, tp: int, mla: bool, rank: int) -> list[int]:
    """Reference: the global heads a rank holds, written straight from the TP sharding rule."""
    if mla:
        return [0]
    if tp <= kv_heads:
        per = kv_heads // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // kv_heads)]


@st.composite
def topologies(draw):
    mla = draw(st.sampled_from([False, False, False, True]))
    kv = draw(st.sampled_from(KV_CHOICES))
    if mla:
        return kv, draw(st.integers(1, 8)), draw(st.integers(1, 8)), True
    return kv, draw(st.sampled_from(_valid_tps(kv))), draw(st.sampled_from(_valid_tps(kv))), False


@st.composite
def block_pairs(draw, max_blocks: int = 6):
    """(src_ids, dst_ids, p_num_blocks, d_num_blocks): distinct ids, sometimes runs, sometimes not."""
    n = draw(st.integers(0, max_blocks))
    p_blocks = n + draw(st.integers(0, 4))
    d_blocks = n + draw(st.integers(0, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def ids(total: int) -> np.ndarray:
        if draw(st.booleans()):
            start = int(rng.integers(0, total - n + 1))
            return np.arange(start, start + n, dtype=np.int64)
        return rng.choice(total, size=n, replace=False).astype(np.int64)

    return ids(p_blocks), ids(d_blocks), p_blocks, d_blocks


def _rank_cache(data: np.ndarray, heads: list[int], ids: np.ndarray, num_blocks: int,
                layout: str, fill: np.ndarray | None) -> np.ndarray:
    """One rank's flat byte buffer: ``data``'s ``heads`` at blocks ``ids``, ``fill`` elsewhere."""
    _, bs, _, hb = data.shape
    cache = np.zeros((num_blocks, bs, len(heads), hb), np.uint8) if fill is None else fill.copy()
    cache[ids] = data[:, :, heads, :]
    if layout == "HND":
        cache = cache.transpose(0, 2, 1, 3)
    return np.ascontiguousarray(cache).reshape(-1)


# --- the byte-copy property -----------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(topo=topologies(), blocks=block_pairs(), layout=st.sampled_from(["NHD", "HND"]),
       block_size=st.integers(1, 4), head_dim=st.integers(1, 4), dtype_bytes=st.sampled_from([1, 2, 4]),
       seed=st.integers(0, 2**32 - 1))
def test_applied_spans_give_each_d_rank_exactly_its_heads(topo, blocks, layout, block_size,
                                                          head_dim, dtype_bytes, seed):
    kv, p_tp, d_tp, mla = topo
    src_ids, dst_ids, p_blocks, d_blocks = blocks
    hb = head_dim * dtype_bytes
    geom = HeadGeometry(block_size, hb, layout)
    hp, hd = local_heads(kv, p_tp, mla), local_heads(kv, d_tp, mla)
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (src_ids.size, block_size, 1 if mla else kv, hb), dtype=np.uint8)
    # P blocks outside the transfer hold garbage, so reading a wrong block is caught.
    p_bufs = [_rank_cache(data, _held_heads(kv, p_tp, mla, p), src_ids, p_blocks, layout,
                          rng.integers(0, 256, (p_blocks, block_size, hp, hb), dtype=np.uint8))
              for p in range(p_tp)]
    d_bufs = [np.zeros(d_blocks * block_size * hd * hb, np.uint8) for _ in range(d_tp)]
    written = [np.zeros(buf.size, np.int64) for buf in d_bufs]

    runs = merge_runs(src_ids, dst_ids)
    for route in map_ranks(kv, p_tp, d_tp, mla):
        src, dst, length = slice_addresses(runs, 0, 0, hp, hd, route, geom)
        assert src.dtype == dst.dtype == length.dtype == np.int64
        assert (length > 0).all()
        if src.size > 1:   # the merge left no span that continues its predecessor on both sides
            assert not ((src[1:] == src[:-1] + length[:-1]) & (dst[1:] == dst[:-1] + length[:-1])).any()
        for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist()):
            d_bufs[route.d_rank][d:d + n] = p_bufs[route.p_rank][s:s + n]
            written[route.d_rank][d:d + n] += 1

    block_bytes = block_size * hd * hb
    for d in range(d_tp):
        want = _rank_cache(data, _held_heads(kv, d_tp, mla, d), dst_ids, d_blocks, layout, None)
        np.testing.assert_array_equal(d_bufs[d], want, err_msg=f"D rank {d}")
        in_dst = np.zeros((d_blocks, block_bytes), np.int64)
        in_dst[dst_ids] = 1
        # Exactly once inside destination blocks (no gap, no overlap), never outside them.
        np.testing.assert_array_equal(written[d], in_dst.reshape(-1), err_msg=f"D rank {d}")


# --- route structure ------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(topo=topologies())
def test_routes_fill_every_d_slot_once_from_a_holder(topo):
    kv, p_tp, d_tp, mla = topo
    routes = map_ranks(kv, p_tp, d_tp, mla)
    hp, hd = local_heads(kv, p_tp, mla), local_heads(kv, d_tp, mla)
    assert routes == sorted(routes, key=lambda r: (r.p_rank, r.d_rank, r.dst_head))
    slots: Counter = Counter()
    for r in routes:
        assert 0 <= r.p_rank < p_tp and 0 <= r.d_rank < d_tp and r.num_heads >= 1
        assert 0 <= r.src_head and r.src_head + r.num_heads <= hp
        assert 0 <= r.dst_head and r.dst_head + r.num_heads <= hd
        p_held = _held_heads(kv, p_tp, mla, r.p_rank)[r.src_head:r.src_head + r.num_heads]
        d_held = _held_heads(kv, d_tp, mla, r.d_rank)[r.dst_head:r.dst_head + r.num_heads]
        assert p_held == d_held, f"{r} sends heads {p_held} into slots holding {d_held}"
        slots.update((r.d_rank, r.dst_head + i) for i in range(r.num_heads))
    assert slots == Counter({(d, j): 1 for d in range(d_tp) for j in range(hd)})
    # Merged as far as possible: no two routes of one (P, D) pair continue each other.
    ends = {(r.p_rank, r.d_rank, r.src_head + r.num_heads, r.dst_head + r.num_heads) for r in routes}
    assert not any((r.p_rank, r.d_rank, r.src_head, r.dst_head) in ends for r in routes)
    by_p = [routes_from(routes, p) for p in range(p_tp)]
    assert sorted((r for rs in by_p for r in rs), key=routes.index) == routes
    assert all(r.p_rank == p for p, rs in enumerate(by_p) for r in rs)


@settings(max_examples=300, deadline=None)
@given(topo=topologies())
def test_replicated_heads_are_sent_by_different_p_ranks(topo):
    kv, p_tp, d_tp, mla = topo
    routes = map_ranks(kv, p_tp, d_tp, mla)
    senders: dict[int, set[int]] = {}
    readers: Counter = Counter()
    for r in routes:
        for i in range(r.num_heads):
            head = _held_heads(kv, d_tp, mla, r.d_rank)[r.dst_head + i]
            senders.setdefault(head, set()).add(r.p_rank)
            readers[head] += 1
    for head, ps in senders.items():
        replicas = sum(head in _held_heads(kv, p_tp, mla, p) for p in range(p_tp))
        assert len(ps) == min(replicas, readers[head]), f"head {head} sent by {sorted(ps)}"
    if mla:
        assert [(r.d_rank, r.p_rank) for r in sorted(routes, key=lambda r: r.d_rank)] == \
            [(d, d % p_tp) for d in range(d_tp)]
        if p_tp >= d_tp:
            assert len({r.p_rank for r in routes}) == d_tp


def test_known_topologies():
    R = RankRoute   # noqa: N806 - one letter keeps the expected tables readable
    # P_tp < D_tp: each P rank splits its 4 heads over two D ranks.
    assert map_ranks(8, 2, 4) == [R(0, 0, 0, 0, 2), R(0, 1, 2, 0, 2), R(1, 2, 0, 0, 2),
                                  R(1, 3, 2, 0, 2)]
    # P_tp > D_tp: four P ranks write 2-head slices into one D rank's 4 heads.
    assert map_ranks(8, 4, 2) == [R(0, 0, 0, 0, 2), R(1, 0, 0, 2, 2), R(2, 1, 0, 0, 2),
                                  R(3, 1, 0, 2, 2)]
    # Same TP: whole-rank routes.
    assert map_ranks(4, 2, 2) == [R(0, 0, 0, 0, 2), R(1, 1, 0, 0, 2)]
    # P replicates each of 2 heads twice; D (tp=1) reads them from different replica slots.
    assert map_ranks(2, 4, 1) == [R(0, 0, 0, 0, 1), R(3, 0, 0, 1, 1)]
    # D replicates: both D replicas of a head read the one P rank holding it.
    assert map_ranks(2, 1, 4) == [R(0, 0, 0, 0, 1), R(0, 1, 0, 0, 1), R(0, 2, 1, 0, 1),
                                  R(0, 3, 1, 0, 1)]
    # Both sides replicate: D replicas of a head spread over P's replicas of it.
    assert map_ranks(2, 4, 4) == [R(0, 0, 0, 0, 1), R(1, 1, 0, 0, 1), R(2, 2, 0, 0, 1),
                                  R(3, 3, 0, 0, 1)]
    assert map_ranks(1, 4, 2, mla=True) == [R(0, 0, 0, 0, 1), R(1, 1, 0, 0, 1)]
    assert map_ranks(1, 2, 4, mla=True) == [R(0, 0, 0, 0, 1), R(0, 2, 0, 0, 1), R(1, 1, 0, 0, 1),
                                            R(1, 3, 0, 0, 1)]
    assert routes_from(map_ranks(8, 2, 4), 1) == [R(1, 2, 0, 0, 2), R(1, 3, 2, 0, 2)]


def test_local_heads():
    assert local_heads(8, 2) == 4
    assert local_heads(8, 8) == 1
    assert local_heads(2, 8) == 1
    assert local_heads(1, 4, mla=True) == 1
    assert local_heads(128, 3, mla=True) == 1   # MLA never splits, whatever kv_heads says


@pytest.mark.parametrize("kv, p_tp, d_tp", [
    (6, 4, 1), (6, 1, 4), (4, 3, 1), (3, 2, 1), (3, 1, 2), (2, 3, 1),
    (0, 1, 1), (4, 0, 1), (4, 1, 0), (-2, 1, 1), (4, -1, 1), (4, 1, -2), (4, 1.0, 1), (4, True, 1),
])
def test_invalid_topologies_raise(kv, p_tp, d_tp):
    with pytest.raises(ValueError):
        map_ranks(kv, p_tp, d_tp)


def test_invalid_topologies_raise_for_mla_sizes_too():
    for args in [(1, 0, 1), (1, 1, 0), (0, 1, 1)]:
        with pytest.raises(ValueError):
            map_ranks(*args, mla=True)


# --- head geometry and slice addresses -----------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    dict(block_size=16, head_bytes=128, layout="NDH"), dict(block_size=16, head_bytes=128, layout="nhd"),
    dict(block_size=0, head_bytes=128), dict(block_size=16, head_bytes=0), dict(block_size=-1, head_bytes=8),
])
def test_bad_geometry_raises(kwargs):
    with pytest.raises(ValueError):
        HeadGeometry(**kwargs)


@settings(max_examples=100, deadline=None)
@given(blocks=block_pairs(max_blocks=12), heads=st.integers(1, 4), block_size=st.integers(1, 8),
       head_bytes=st.integers(1, 64), layout=st.sampled_from(["NHD", "HND"]),
       src_base=st.integers(0, 1 << 40), dst_base=st.integers(0, 1 << 40))
def test_whole_block_route_is_run_addresses(blocks, heads, block_size, head_bytes, layout,
                                            src_base, dst_base):
    src_ids, dst_ids, _, _ = blocks
    runs = merge_runs(src_ids, dst_ids)
    got = slice_addresses(runs, src_base, dst_base, heads, heads, RankRoute(0, 0, 0, 0, heads),
                          HeadGeometry(block_size, head_bytes, layout))
    want = run_addresses(runs, src_base, dst_base, block_size * heads * head_bytes)
    assert len(got) == 3
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_slice_spans_by_hand():
    runs = merge_runs([3, 4], [0, 1])
    # HND, P holds 1 head, D holds 2: one span per block, P's whole block into D's head 1.
    src, dst, n = slice_addresses(runs, 1000, 0, 1, 2, RankRoute(0, 0, 0, 1, 1), HeadGeometry(4, 8, "HND"))
    assert src.tolist() == [1000 + 3 * 32, 1000 + 4 * 32]
    assert dst.tolist() == [32, 64 + 32] and n.tolist() == [32, 32]
    # NHD, P holds 2 heads, D holds 1: one span per token, P's head 1 into D's only head.
    src, dst, n = slice_addresses(runs, 0, 500, 2, 1, RankRoute(0, 0, 1, 0, 1), HeadGeometry(2, 8, "NHD"))
    assert src.tolist() == [3 * 32 + 8, 3 * 32 + 24, 4 * 32 + 8, 4 * 32 + 24]
    assert dst.tolist() == [500, 508, 516, 524] and n.tolist() == [8, 8, 8, 8]
    empty = slice_addresses(merge_runs([], []), 0, 0, 2, 1, RankRoute(0, 0, 1, 0, 1), HeadGeometry(2, 8))
    assert [a.size for a in empty] == [0, 0, 0]


def test_merge_spans_joins_only_where_both_sides_continue():
    src = np.array([0, 10, 20, 30, 50], np.int64)
    dst = np.array([100, 110, 125, 135, 145], np.int64)
    length = np.full(5, 10, np.int64)
    s, d, n = _merge_spans(src, dst, length)
    assert s.tolist() == [0, 20, 50] and d.tolist() == [100, 125, 145] and n.tolist() == [20, 20, 10]


@pytest.mark.parametrize("src_heads, dst_heads, route", [
    (2, 2, RankRoute(0, 0, 1, 0, 2)), (2, 2, RankRoute(0, 0, 0, 1, 2)), (2, 2, RankRoute(0, 0, -1, 0, 1)),
    (2, 2, RankRoute(0, 0, 0, 0, 0)), (0, 2, RankRoute(0, 0, 0, 0, 1)), (2, 4, RankRoute(0, 0, 0, 3, 2)),
])
def test_slice_rejects_heads_outside_the_tensors(src_heads, dst_heads, route):
    with pytest.raises(ValueError):
        slice_addresses(merge_runs([0], [0]), 0, 0, src_heads, dst_heads, route, HeadGeometry(4, 8))


# --- data parallel endpoints ----------------------------------------------------------------------

@settings(max_examples=50, deadline=None)
@given(dp=st.integers(1, 6), tp=st.integers(1, 8))
def test_dp_endpoint_is_a_bijection(dp, tp):
    endpoints = [f"tcp://10.0.{i}.1:{5000 + j}" for i in range(dp) for j in range(tp)]
    got = [dp_endpoint(endpoints, dp, tp, i, j) for i in range(dp) for j in range(tp)]
    assert got == endpoints   # dp-major, and so every (dp, tp) pair gets a distinct endpoint
    assert len(set(got)) == dp * tp
    for bad in [(dp, 0), (-1, 0), (0, tp), (0, -1)]:
        with pytest.raises(ValueError):
            dp_endpoint(endpoints, dp, tp, *bad)


@pytest.mark.parametrize("endpoints, dp, tp", [
    (["a", "b", "c"], 2, 2), (["a"] * 5, 2, 2), ([], 1, 1), (["a"], 0, 1), (["a"], 1, 0), ("ab", 1, 2),
])
def test_dp_endpoint_rejects_bad_shapes(endpoints, dp, tp):
    with pytest.raises(ValueError):
        dp_endpoint(endpoints, dp, tp, 0, 0)
