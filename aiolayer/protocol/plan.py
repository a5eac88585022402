"""Block planning: block ids -> merged contiguous runs -> (src, dst, len) byte arrays, vectorised.

Runs are computed once per request (in block units) and turned into addresses per layer by adding
that layer's base addresses, so the per-layer cost is a few numpy operations.
"""

from __future__ import annotations

import msgspec
import numpy as np


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


def merge_runs(src_blocks, dst_blocks) -> BlockRuns:
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


def run_addresses(runs: BlockRuns, src_base: int, dst_base: int, block_bytes: int):
    """Byte addresses of every run for one tensor: (src_addrs, dst_addrs, lengths) as int64 arrays."""
    src_addr = runs.src_start * block_bytes + src_base
    dst_addr = runs.dst_start * block_bytes + dst_base
    return src_addr, dst_addr, runs.length * block_bytes


def check_block_bounds(block_ids, num_blocks: int, side: str) -> None:
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        raise ValueError(f"{side} block id out of range [0, {num_blocks})")


def use_layerwise(num_tokens: int, min_tokens: int) -> bool:
    """The auto policy: layer-wise pays only from ``min_tokens`` up; shorter prompts go in bulk.

    Per-layer submission has a fixed cost per layer; for short prompts the whole transfer is
    shorter than that overhead is worth (an engine measured +18% TTFT at 256 tokens).
    """
    return num_tokens >= min_tokens
