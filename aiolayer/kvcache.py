"""A paged KV cache in host memory: per layer one K and one V tensor [num_blocks, block_size, heads, dim].

All layers live in one page-aligned buffer (K0, V0, K1, V1, ...), touched once at creation so the
first transfer does not pay page faults. Used by the standalone decode node and the benchmark.
"""

from __future__ import annotations

import zlib

import numpy as np

from .config import KVShape

_NP_DTYPE = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32, "int8": np.int8,
             "uint8": np.uint8}


class PagedKVCache:
    def __init__(self, shape: KVShape) -> None:
        self.shape = shape
        self.buffer = np.zeros(shape.total_bytes + 4096, dtype=np.uint8)
        offset = (-self.buffer.ctypes.data) % 4096
        self.buffer = self.buffer[offset:offset + shape.total_bytes]
        self.buffer.fill(0)  # fault every page in now, not during a transfer
        self.blocks = self.buffer.reshape(shape.num_layers, 2, shape.num_blocks, shape.block_bytes)

    @property
    def k_base(self) -> list[int]:
        return [self.blocks[layer, 0].ctypes.data for layer in range(self.shape.num_layers)]

    @property
    def v_base(self) -> list[int]:
        return [self.blocks[layer, 1].ctypes.data for layer in range(self.shape.num_layers)]

    def layer_view(self, layer: int, kind: int) -> np.ndarray:
        """K (kind 0) or V (kind 1) of ``layer`` as [num_blocks, block_size, heads, dim] (NHD)
        or [num_blocks, heads, block_size, dim] (HND)."""
        s = self.shape
        inner = (s.block_size, s.kv_heads) if s.layout == "NHD" else (s.kv_heads, s.block_size)
        return self.blocks[layer, kind].view(_NP_DTYPE[s.dtype]).reshape(s.num_blocks, *inner, s.head_dim)

    def checksums(self, block_ids) -> tuple[list[int], list[int]]:
        """Per layer CRC32 of K and of V over ``block_ids`` in that order."""
        return checksums(self.blocks, block_ids)


def checksums(blocks: np.ndarray, block_ids) -> tuple[list[int], list[int]]:
    """``blocks`` is [layers, 2, num_blocks, block_bytes] uint8."""
    ids = np.asarray(block_ids, dtype=np.int64)
    crc_k, crc_v = [], []
    for layer in range(blocks.shape[0]):
        crc_k.append(zlib.crc32(np.ascontiguousarray(blocks[layer, 0, ids]).data))
        crc_v.append(zlib.crc32(np.ascontiguousarray(blocks[layer, 1, ids]).data))
    return crc_k, crc_v


class BlockAllocator:
    """Free list of block ids; contiguous allocation when possible."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = np.ones(num_blocks, dtype=bool)

    @property
    def free(self) -> int:
        return int(self._free.sum())

    def allocate(self, n: int, contiguous: bool = True, rng: np.random.Generator | None = None) -> list[int] | None:
        free_ids = np.flatnonzero(self._free)
        if free_ids.size < n:
            return None
        if contiguous:
            # first window of n consecutive free ids, else fall back to the first n free ones
            if n and free_ids.size >= n:
                gaps = free_ids[n - 1:] - free_ids[: free_ids.size - n + 1]
                hits = np.flatnonzero(gaps == n - 1)
                ids = free_ids[hits[0]: hits[0] + n] if hits.size else free_ids[:n]
            else:
                ids = free_ids[:n]
        else:
            rng = rng or np.random.default_rng()
            ids = rng.permutation(free_ids)[:n]
        self._free[ids] = False
        return ids.tolist()

    def release(self, block_ids) -> None:
        self._free[np.asarray(block_ids, dtype=np.int64)] = True
