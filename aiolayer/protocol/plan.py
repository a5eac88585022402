"""Block planning: block ids -> merged contiguous runs -> (src, dst, len) byte arrays, vectorised.

Runs are computed once per request (in block units) and turned into addresses per layer by adding
that layer's base addresses, so the per-layer cost is a few numpy operations.

Rank mapping: which P (prefill) TP rank sends which KV heads to which D (decode) TP rank
(GQA replication and MLA included), the byte spans of such a head slice, and DP endpoint lookup.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
from numpy.typing import ArrayLike

from ..errors import ConfigError


class BlockRuns(msgspec.Struct, frozen=True):
    """Maximal runs where both source and destination block ids increase by one."""

    src_start: np.ndarray   # int64, first source block of each run
    dst_start: np.ndarray   # int64, first destination block of each run
    length: np.ndarray      # int64, blocks in each run

    @property
    def num_runs(self) -> int:
        return int(self.length.shape[0])

    @property
    def num_blocks(self) -> int:
        return int(self.length.sum())


def merge_runs(src_blocks: ArrayLike, dst_blocks: ArrayLike) -> BlockRuns:
    """Merge pairs (src[i], dst[i]) into runs contiguous on both sides, keeping the given order."""
    src = np.asarray(src_blocks, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_blocks, dtype=np.int64).reshape(-1)
    if src.shape != dst.shape:
        raise ValueError(f"{src.shape[0]} source blocks but {dst.shape[0]} destination blocks")
    if src.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return BlockRuns(empty, empty, empty)
    if (src < 0).any() or (dst < 0).any():
        raise ValueError("block ids must be >= 0")
    breaks = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    ends = np.concatenate((starts[1:], [src.size]))
    return BlockRuns(src[starts], dst[starts], ends - starts)


Spans = tuple[np.ndarray, np.ndarray, np.ndarray]   # (src_addrs, dst_addrs, lengths), int64


def run_addresses(runs: BlockRuns, src_base: int, dst_base: int, block_bytes: int) -> Spans:
    """Byte addresses of every run for one tensor: (src_addrs, dst_addrs, lengths) as int64 arrays."""
    src_addr = runs.src_start * block_bytes + src_base
    dst_addr = runs.dst_start * block_bytes + dst_base
    return src_addr, dst_addr, runs.length * block_bytes


def check_block_bounds(block_ids: ArrayLike, num_blocks: int, side: str) -> None:
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        raise ValueError(f"{side} block id out of range [0, {num_blocks})")


def use_layerwise(num_tokens: int, min_tokens: int) -> bool:
    """The auto policy: layer-wise pays only from ``min_tokens`` up; shorter prompts go in bulk.

    Per-layer submission has a fixed cost per layer; for short prompts the whole transfer is
    shorter than that overhead is worth (an engine measured +18% TTFT at 256 tokens).
    """
    return num_tokens >= min_tokens


# --- tensor / data parallel rank mapping ----------------------------------------------------------

class RankRoute(msgspec.Struct, frozen=True):
    """P rank ``p_rank`` copies its local heads [src_head, +num_heads) into D rank ``d_rank``'s
    local heads [dst_head, +num_heads), for every block of a transfer."""

    p_rank: int
    d_rank: int
    src_head: int
    dst_head: int
    num_heads: int


def _check_positive(**sizes: int) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def local_heads(kv_heads: int, tp: int, mla: bool = False) -> int:
    """KV heads each of ``tp`` ranks holds; MLA's single latent head (``kv_heads`` unused) is 1."""
    _check_positive(kv_heads=kv_heads, tp=tp)
    if mla:
        return 1
    if tp <= kv_heads:
        if kv_heads % tp:
            raise ValueError(f"{kv_heads} KV heads do not split evenly over tp={tp}")
        return kv_heads // tp
    if tp % kv_heads:
        raise ValueError(f"tp={tp} is not a multiple of {kv_heads} KV heads, so they cannot be "
                         "replicated evenly")
    return 1


def _first_head(kv_heads: int, tp: int, mla: bool, rank: int) -> int:
    """Global index of the first head that ``rank`` holds (topology already validated)."""
    if mla:
        return 0
    if tp <= kv_heads:
        return rank * (kv_heads // tp)
    return rank // (tp // kv_heads)


def _holder(head: int, kv_heads: int, tp: int, mla: bool, pick: int) -> tuple[int, int]:
    """(rank, local head) that sends global ``head``; ``pick`` chooses among replicas."""
    if mla:
        return pick % tp, 0
    if tp <= kv_heads:
        per_rank = kv_heads // tp
        return head // per_rank, head % per_rank
    replicas = tp // kv_heads
    return head * replicas + pick % replicas, 0


def map_ranks(kv_heads: int, p_tp: int, d_tp: int, mla: bool = False) -> list[RankRoute]:
    """Routes writing every D rank's every local head exactly once, from a P rank holding it.

    Sorted by (p_rank, d_rank, dst_head). Consecutive heads merge into one route when they are
    consecutive on both ranks.
    """
    local_heads(kv_heads, p_tp, mla)   # validates the P topology
    d_heads = local_heads(kv_heads, d_tp, mla)
    merged: list[list[int]] = []   # [p_rank, d_rank, src_head, dst_head, num_heads]
    for d_rank in range(d_tp):
        first = _first_head(kv_heads, d_tp, mla, d_rank)
        for slot in range(d_heads):
            # Picking the replica by the D slot's global ordinal sends the D ranks that share a
            # head (and MLA's D ranks) to different P replicas, spreading the sending load.
            p_rank, src = _holder(first + slot, kv_heads, p_tp, mla, d_rank * d_heads + slot)
            last = merged[-1] if merged else None
            if (last is not None and last[0] == p_rank and last[1] == d_rank
                    and last[2] + last[4] == src and last[3] + last[4] == slot):
                last[4] += 1
            else:
                merged.append([p_rank, d_rank, src, slot, 1])
    routes = [RankRoute(*r) for r in merged]
    routes.sort(key=lambda r: (r.p_rank, r.d_rank, r.dst_head))
    return routes


def routes_from(routes: Sequence[RankRoute], p_rank: int) -> list[RankRoute]:
    """The routes one P rank process sends, in their original order."""
    return [r for r in routes if r.p_rank == p_rank]


def dp_endpoint(endpoints: Sequence[str], dp_size: int, tp_size: int, dp_rank: int,
                tp_rank: int) -> str:
    """D's control endpoint for (dp_rank, tp_rank); ``endpoints`` is listed dp-major."""
    _check_positive(dp_size=dp_size, tp_size=tp_size)
    if isinstance(endpoints, str):
        raise ValueError("endpoints must be a sequence of endpoint strings, not one string")
    if len(endpoints) != dp_size * tp_size:
        raise ValueError(f"expected dp_size*tp_size = {dp_size}*{tp_size} = {dp_size * tp_size} "
                         f"endpoints, got {len(endpoints)}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} out of range [0, {dp_size})")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range [0, {tp_size})")
    return endpoints[dp_rank * tp_size + tp_rank]


class HeadGeometry(msgspec.Struct, frozen=True):
    """Per-block shape of one K or V tensor, enough to locate a head slice in bytes."""

    block_size: int     # tokens per block
    head_bytes: int     # head_dim * dtype bytes
    layout: str = "NHD"  # "NHD": [block, token, head, dim]; "HND": [block, head, token, dim]
    # What a head's bytes in one block hold token by token (copying tokens between blocks of other
    # sizes needs it; whole blocks and head slices do not): "" rows, one per token; "kv-slabs" (HND) a
    # K slab then a V slab, each a row per token; "kv-slabs-kt<e>" (HND) the same but the K slab is
    # [head size][tokens] of e-byte elements (vLLM CPU's "vec" kernels); "opaque": not known.
    interior: str = ""

    def __post_init__(self) -> None:
        _check_positive(block_size=self.block_size, head_bytes=self.head_bytes)
        if self.layout not in ("NHD", "HND"):
            raise ValueError(f"layout must be 'NHD' or 'HND', got {self.layout!r}")
        slabs, k_elem = interior_of(self.interior)
        if slabs > 1 and (self.layout != "HND" or self.head_bytes % (2 * max(k_elem, 1))):
            raise ValueError(f"interior {self.interior!r} needs an HND layout and head bytes that split into "
                             f"K and V of whole elements, got {self.layout} and {self.head_bytes}")


def interior_of(interior: str) -> tuple[int, int]:
    """(slabs per head, bytes of a K element stored tokens innermost or 0) of ``HeadGeometry.interior``;
    slabs 0: not known token by token. ``ValueError`` for anything else."""
    if interior == "":
        return 1, 0
    if interior == "opaque" or interior.startswith("opaque-"):   # "opaque-<kernel>": whose, not how
        return 0, 0
    if interior == "kv-slabs":
        return 2, 0
    if interior.startswith("kv-slabs-kt") and interior[11:].isdigit() and 0 < int(interior[11:]) <= 16:
        return 2, int(interior[11:])
    raise ValueError(f"unknown block interior {interior[:40]!r}")


def check_geometry(block_bytes: int, kv_heads: int, geometry: HeadGeometry | None) -> None:
    """A published head geometry must describe the blocks exactly; ``ConfigError`` otherwise.

    A V base of 0 (K and V in one plane, e.g. vLLM's CPU cache: per (block, head) a K slab then a
    V slab) is fine: the geometry then describes that one plane, ``head_bytes`` covering K and V.
    """
    if geometry is None:
        if kv_heads:
            raise ConfigError("kv_heads given without its geometry (block_size, head_bytes, layout)")
        return
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, (int, np.integer)) or kv_heads < 1:
        raise ConfigError(f"kv_heads must be a positive integer with a geometry, got {kv_heads!r}")
    if kv_heads * geometry.block_size * geometry.head_bytes != block_bytes:
        raise ConfigError(f"{kv_heads} heads x {geometry.block_size} tokens x {geometry.head_bytes} bytes "
                          f"is not the block size {block_bytes}")


def _expand_runs(runs: BlockRuns) -> tuple[np.ndarray, np.ndarray]:
    """Every (src, dst) block of the runs, in order."""
    run_of = np.repeat(np.arange(runs.num_runs, dtype=np.int64), runs.length)
    run_first = np.repeat(np.cumsum(runs.length) - runs.length, runs.length)
    within = np.arange(run_of.size, dtype=np.int64) - run_first
    return runs.src_start[run_of] + within, runs.dst_start[run_of] + within


def _merge_spans(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> Spans:
    """Join each span onto its predecessor where both sides continue exactly where it ended."""
    if src.size < 2:
        return src, dst, length
    joins = (src[1:] == src[:-1] + length[:-1]) & (dst[1:] == dst[:-1] + length[:-1])
    if not joins.any():
        return src, dst, length
    starts = np.concatenate(([0], np.flatnonzero(~joins) + 1))
    return src[starts], dst[starts], np.add.reduceat(length, starts)


def slice_addresses(runs: BlockRuns, src_base: int, dst_base: int, src_heads: int, dst_heads: int,
                    route: RankRoute, geom: HeadGeometry) -> Spans:
    """Byte spans (src_addrs, dst_addrs, lengths), int64, copying ``route``'s heads of every block.

    ``src_heads``/``dst_heads`` are the local heads per block of the P and D tensors. A route
    covering whole blocks on both sides gives exactly ``run_addresses``; otherwise HND gives one
    span per block and NHD one per token, joined where both sides happen to be contiguous.
    """
    _check_positive(src_heads=src_heads, dst_heads=dst_heads, num_heads=route.num_heads)
    n = route.num_heads
    if not (0 <= route.src_head and route.src_head + n <= src_heads):
        raise ValueError(f"route heads [{route.src_head}, {route.src_head + n}) outside the "
                         f"{src_heads} source heads")
    if not (0 <= route.dst_head and route.dst_head + n <= dst_heads):
        raise ValueError(f"route heads [{route.dst_head}, {route.dst_head + n}) outside the "
                         f"{dst_heads} destination heads")
    bs, hb = geom.block_size, geom.head_bytes
    if src_heads == dst_heads == n:
        return run_addresses(runs, src_base, dst_base, bs * n * hb)
    src_blocks, dst_blocks = _expand_runs(runs)
    src_block = src_blocks * (bs * src_heads * hb) + src_base
    dst_block = dst_blocks * (bs * dst_heads * hb) + dst_base
    if geom.layout == "HND":
        src = src_block + route.src_head * bs * hb
        dst = dst_block + route.dst_head * bs * hb
        span = n * bs * hb
    else:
        tokens = np.arange(bs, dtype=np.int64)
        src = (src_block[:, None] + (tokens * src_heads + route.src_head) * hb).reshape(-1)
        dst = (dst_block[:, None] + (tokens * dst_heads + route.dst_head) * hb).reshape(-1)
        span = n * hb
    return _merge_spans(src, dst, np.full(src.shape, span, dtype=np.int64))


def _tokens_both_hold(src_n: int, dst_n: int, first_token: int, bs: int, bd: int) -> int:
    """The tokens to copy. Each side's blocks hold one request's tokens (from ``first_token`` on), its last
    block partly filled: both must end in each other's last block, or one side would keep tokens the
    other never got (a D whose tail blocks nobody writes would decode from stale KV)."""
    have, room = src_n * bs - first_token, dst_n * bd
    if first_token < 0 or have <= 0 or room <= 0:
        raise ValueError(f"no token to copy: {src_n} source blocks of {bs} tokens from token "
                         f"{first_token}, {dst_n} destination blocks of {bd}")
    if not (have > room - bd and room > have - bs):
        raise ValueError(f"{src_n} source blocks of {bs} tokens from token {first_token} ({have} tokens) and "
                         f"{dst_n} destination blocks of {bd} ({room}) cannot hold the same request")
    return min(have, room)


def token_spans(src_blocks: ArrayLike, dst_blocks: ArrayLike, first_token: int, geom: HeadGeometry,
                dst_block_size: int, src_heads: int, dst_heads: int, route: RankRoute | None = None) -> Spans:
    """Byte spans (src, dst, lengths) relative to one plane's base, copying tokens between blocks of
    other sizes: token ``first_token + i`` of ``src_blocks`` (``geom.block_size`` tokens each,
    counted from the first one's first token) into token ``i`` of ``dst_blocks`` (``dst_block_size``
    tokens each), for every token both hold. Both sides share ``geom`` but for the block size; every
    local head moves, or ``route``'s. A span never crosses a block on either side.
    """
    src_ids = np.asarray(src_blocks, dtype=np.int64).reshape(-1)
    dst_ids = np.asarray(dst_blocks, dtype=np.int64).reshape(-1)
    _check_positive(dst_block_size=dst_block_size, src_heads=src_heads, dst_heads=dst_heads)
    bs, bd, hb = geom.block_size, dst_block_size, geom.head_bytes
    count = _tokens_both_hold(src_ids.size, dst_ids.size, first_token, bs, bd)
    if route is None:
        if src_heads != dst_heads:
            raise ValueError(f"{src_heads} source heads but {dst_heads} destination heads and no route")
        route = RankRoute(0, 0, 0, 0, src_heads)
    n = route.num_heads
    if route.src_head < 0 or route.src_head + n > src_heads or route.dst_head < 0 or route.dst_head + n > dst_heads:
        raise ValueError(f"route {route} outside {src_heads} source / {dst_heads} destination heads")
    # a segment: tokens in one block on both sides (cut where either side's next block begins)
    starts = np.union1d(np.arange(0, count, bd, dtype=np.int64),
                        np.arange((-first_token) % bs, count, bs, dtype=np.int64))
    seg_len = np.diff(np.append(starts, count))
    src_tok = starts + first_token
    src_at = src_ids[src_tok // bs] * (src_heads * bs * hb)
    dst_at = dst_ids[starts // bd] * (dst_heads * bd * hb)
    src_in, dst_in = src_tok % bs, starts % bd
    slabs, k_elem = interior_of(geom.interior)
    if not slabs:
        raise ValueError("the blocks' interior is not known token by token: blocks copy whole only")
    if geom.layout == "HND":
        heads = np.arange(n, dtype=np.int64)[None, :]
        src_head = src_at[:, None] + (route.src_head + heads) * bs * hb     # [segment, head]
        dst_head = dst_at[:, None] + (route.dst_head + heads) * bd * hb
        unit = hb // slabs                          # one token's bytes in one slab
        parts = []
        for slab in range(slabs):
            if slab == 0 and k_elem:                # K as [head size][tokens]: one span per element row
                row = np.arange(unit // k_elem, dtype=np.int64)[None, None, :]
                parts.append(((src_head + src_in[:, None] * k_elem)[:, :, None] + row * bs * k_elem,
                              (dst_head + dst_in[:, None] * k_elem)[:, :, None] + row * bd * k_elem,
                              np.broadcast_to((seg_len * k_elem)[:, None, None], (len(seg_len), n, row.size))))
            else:
                parts.append(((src_head + slab * bs * unit + src_in[:, None] * unit)[:, :, None],
                              (dst_head + slab * bd * unit + dst_in[:, None] * unit)[:, :, None],
                              np.broadcast_to((seg_len * unit)[:, None, None], (len(seg_len), n, 1))))
        src, dst, length = (np.concatenate([np.ascontiguousarray(part[i]).reshape(len(seg_len), -1)
                                            for part in parts], axis=1) for i in range(3))
    elif n == src_heads == dst_heads:               # NHD, every head: a segment is one run
        src, dst = src_at + src_in * n * hb, dst_at + dst_in * n * hb
        length = seg_len * n * hb
    else:                                           # NHD head slice: one span per token
        tok = np.arange(count, dtype=np.int64)
        s_tok = tok + first_token
        src = src_ids[s_tok // bs] * (src_heads * bs * hb) + ((s_tok % bs) * src_heads + route.src_head) * hb
        dst = dst_ids[tok // bd] * (dst_heads * bd * hb) + ((tok % bd) * dst_heads + route.dst_head) * hb
        length = np.full(count, n * hb, dtype=np.int64)
    return _merge_spans(src.reshape(-1), dst.reshape(-1), np.ascontiguousarray(length).reshape(-1))
