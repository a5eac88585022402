"""Copying a request's tokens between P's and D's blocks of other sizes (``plan.token_spans``).

Each case fills P's cache with values naming (token, head, K or V), applies the spans as byte copies
into a zeroed D cache, and reads every token back at D's block size: the mapping is checked by what
lands, in vLLM CPU's layout (per block and head a K slab then a V slab), flash's NHD planes and head
slices, with P's blocks bigger than D's and D's bigger than P's.
"""

from __future__ import annotations

import numpy as np
import pytest

from aiolayer.protocol.plan import HeadGeometry, RankRoute, run_addresses, merge_runs, token_spans

D = 4           # head size (float32 elements)
F32 = 4


def _copy(src: np.ndarray, dst: np.ndarray, spans) -> None:
    s, d = src.reshape(-1).view(np.uint8), dst.reshape(-1).view(np.uint8)
    for a, b, n in zip(*spans):
        d[b:b + n] = s[a:a + n]


def _value(token: int, head: int, kv: int) -> float:
    return token * 100.0 + head * 10.0 + kv


def _slab_cache(blocks: list[int], size: int, heads: int, tokens: int, num_blocks: int) -> np.ndarray:
    """vLLM CPU ("vec" kernels): [B, H, 2 x N x D], per block and head K as [D][N] then V as [N][D]."""
    cache = np.zeros((num_blocks, heads, 2 * size * D), dtype=np.float32)
    for t in range(tokens):
        for h in range(heads):
            k, v = _kv(cache, blocks[t // size], h, size)
            k[:, t % size] = _value(t, h, 0) + np.arange(D) / 8
            v[t % size, :] = _value(t, h, 1) + np.arange(D) / 8
    return cache


def _kv(cache: np.ndarray, block: int, head: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Views of one block's head: K [D][N] and V [N][D]."""
    return cache[block, head, :size * D].reshape(D, size), cache[block, head, size * D:].reshape(size, D)


def _slab_tokens(cache: np.ndarray, blocks: list[int], size: int, count: int) -> np.ndarray:
    """[count, H, 2, D] of what D holds, token i at block blocks[i // size], slot i % size."""
    heads = cache.shape[1]
    return np.stack([[[_kv(cache, blocks[i // size], h, size)[0][:, i % size],
                       _kv(cache, blocks[i // size], h, size)[1][i % size, :]] for h in range(heads)]
                     for i in range(count)])


def _want(first: int, count: int, heads) -> np.ndarray:
    return np.array([[[_value(first + i, h, kv) + np.arange(D) / 8 for kv in (0, 1)] for h in heads]
                     for i in range(count)], dtype=np.float32)


@pytest.mark.parametrize("p_size,d_size", [(128, 32), (32, 64), (32, 128), (64, 32)])
@pytest.mark.parametrize("first_d_block", [0, 1, 2])
def test_vllm_cpu_slabs_land_token_for_token_at_ds_block_size(p_size, d_size, first_d_block):
    heads, prompt = 2, 300
    p_blocks = [7, 2, 5, 0, 9, 4, 1, 3, 8, 6][: -(-prompt // p_size)]
    first = first_d_block * d_size                        # D already holds the tokens before it
    d_blocks = [11, 3, 4, 12, 0, 6, 2, 9, 10, 1][: -(-prompt // d_size) - first_d_block]
    p = _slab_cache(p_blocks, p_size, heads, prompt, 10)
    d = np.zeros((13, heads, 2 * d_size * D), dtype=np.float32)
    geom = HeadGeometry(p_size, 2 * D * F32, "HND", "kv-slabs-kt4")
    spans = token_spans(p_blocks, d_blocks, first, geom, d_size, heads, heads)
    _copy(p, d, spans)
    got = _slab_tokens(d, d_blocks, d_size, prompt - first)
    assert (got == _want(first, prompt - first, range(heads))).all()
    # a span never crosses a block on either side: per segment, head and element of K one, of V one
    assert (spans[2] <= d_size * D * F32).all()
    assert len(spans[0]) <= (D + 1) * heads * (len(p_blocks) + len(d_blocks))


def test_rows_per_token_slabs_land_token_for_token():
    """"kv-slabs": K and V slabs both a row per token (no kernel transposes K)."""
    heads, prompt, p_size, d_size = 1, 70, 32, 64
    p = np.zeros((3, heads, 2, p_size, D), dtype=np.float32)
    for t in range(prompt):
        p[[2, 0, 1][t // p_size], 0, :, t % p_size] = [[_value(t, 0, 0)], [_value(t, 0, 1)]]
    d = np.zeros((2, heads, 2, d_size, D), dtype=np.float32)
    spans = token_spans([2, 0, 1], [1, 0], 0, HeadGeometry(p_size, 2 * D * F32, "HND", "kv-slabs"), d_size, 1, 1)
    _copy(p, d, spans)
    got = [d[[1, 0][t // d_size], 0, :, t % d_size, 0].tolist() for t in range(prompt)]
    assert got == [[_value(t, 0, 0), _value(t, 0, 1)] for t in range(prompt)]


def test_whole_blocks_across_other_sizes_would_scramble_the_tokens():
    """The negative control: block-for-block copying (what equal sizes use) puts P's tokens in the
    wrong slots at D, so the check above sees a wrong mapping."""
    heads, prompt, p_size, d_size = 2, 128, 64, 32
    p_blocks, d_blocks = [1, 0], [3, 2, 1, 0]
    p = _slab_cache(p_blocks, p_size, heads, prompt, 2)
    d = np.zeros((4, heads, 2 * d_size * D), dtype=np.float32)
    block_bytes = heads * 2 * d_size * D * F32
    _copy(p, d, run_addresses(merge_runs(d_blocks, d_blocks), 0, 0, block_bytes))
    assert not (_slab_tokens(d, d_blocks, d_size, prompt) == _want(0, prompt, range(heads))).all()


@pytest.mark.parametrize("p_size,d_size", [(64, 16), (16, 48)])
def test_nhd_planes_every_head_one_run_per_segment(p_size, d_size):
    heads, prompt = 3, 100
    p_blocks = [2, 0, 5, 1, 3, 4, 6][: -(-prompt // p_size)]
    d_blocks = list(range(-(-prompt // d_size)))[::-1]
    p = np.zeros((7, p_size, heads, D), dtype=np.float32)      # one plane (K) of flash's [2, B, N, H, D]
    for t in range(prompt):
        p[p_blocks[t // p_size], t % p_size] = np.array([_value(t, h, 0) for h in range(heads)])[:, None]
    d = np.zeros((len(d_blocks), d_size, heads, D), dtype=np.float32)
    spans = token_spans(p_blocks, d_blocks, 0, HeadGeometry(p_size, D * F32, "NHD"), d_size, heads, heads)
    _copy(p, d, spans)
    got = np.array([d[d_blocks[i // d_size], i % d_size, :, 0] for i in range(prompt)])
    assert (got == np.array([[_value(t, h, 0) for h in range(heads)] for t in range(prompt)])).all()
    cuts = len(set(range(0, prompt, p_size)) | set(range(0, prompt, d_size)))
    assert len(spans[0]) <= cuts


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_a_head_slice_lands_in_ds_heads_at_ds_block_size(layout):
    """P (TP=1, 2 heads) into a D rank holding head 1 only, blocks of 32 at P and 64 at D."""
    p_size, d_size, prompt = 32, 64, 150
    p_blocks, d_blocks = [4, 1, 3, 0, 2], [1, 2, 0]
    shape = (5, 2, p_size, D) if layout == "HND" else (5, p_size, 2, D)
    p = np.zeros(shape, dtype=np.float32)
    for t in range(prompt):
        for h in range(2):
            idx = (p_blocks[t // p_size], h, t % p_size) if layout == "HND" else (p_blocks[t // p_size], t % p_size, h)
            p[idx] = _value(t, h, 0)
    d = np.zeros((3, 1, d_size, D) if layout == "HND" else (3, d_size, 1, D), dtype=np.float32)
    spans = token_spans(p_blocks, d_blocks, 0, HeadGeometry(p_size, D * F32, layout), d_size, 2, 1,
                        RankRoute(p_rank=0, d_rank=1, src_head=1, dst_head=0, num_heads=1))
    _copy(p, d, spans)
    got = [d[d_blocks[i // d_size], 0, i % d_size, 0] if layout == "HND" else d[d_blocks[i // d_size], i % d_size, 0, 0]
           for i in range(prompt)]
    assert got == [_value(t, 1, 0) for t in range(prompt)]


def test_nothing_to_copy_unknown_interiors_or_heads_that_do_not_fit_are_refused():
    geom = HeadGeometry(32, 8, "HND", "kv-slabs")
    with pytest.raises(ValueError, match="no token"):
        token_spans([0], [0], 32, geom, 64, 1, 1)            # P's blocks end where D's first begins
    with pytest.raises(ValueError, match="heads"):
        token_spans([0], [0], 0, geom, 64, 2, 1)             # no route, other head counts
    with pytest.raises(ValueError, match="HND"):
        HeadGeometry(32, 8, "NHD", "kv-slabs")
    with pytest.raises(ValueError, match="not known token by token"):
        token_spans([0], [0], 0, HeadGeometry(32, 8, "HND", "opaque"), 64, 1, 1)
    with pytest.raises(ValueError, match="unknown block interior"):
        HeadGeometry(32, 8, "HND", "kv-slabs-kt")


@pytest.mark.parametrize("p_blocks,d_blocks,first,fits", [
    (4, 2, 0, True),      # P 4 x 32: 97..128 tokens; D 2 x 64: 65..128
    (4, 3, 0, False),     # D 3 x 64: 129..192 tokens: its last block would stay unwritten
    (4, 1, 0, False),     # D 1 x 64: P holds tokens D has no room for
    (8, 3, 64, True),     # from D's second block: P's 256 tokens less 64, D 3 x 64 = 129..192
])
def test_block_lists_that_cannot_end_together_are_refused(p_blocks, d_blocks, first, fits):
    """P's blocks of 32 and D's of 64 hold one request's tokens, each side's last block partly filled:
    lists that cannot end in each other's last block belong to different requests, and a copy of the
    shorter one would leave D's tail blocks with stale KV that D then reports as received."""
    geom = HeadGeometry(32, 8, "HND", "kv-slabs")
    if fits:
        assert token_spans(list(range(p_blocks)), list(range(d_blocks)), first, geom, 64, 1, 1)[0].size
        return
    with pytest.raises(ValueError, match="cannot hold the same request"):
        token_spans(list(range(p_blocks)), list(range(d_blocks)), first, geom, 64, 1, 1)
