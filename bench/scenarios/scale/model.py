"""The data of ``aiolayer bench scale``, shared by the driver and the P rank processes: its config, a
P rank's plan items, which heads a rank holds, and the global seeded KV from which any process
computes any rank's bytes (the driver's verification recomputes what each P rank sent).
"""

from __future__ import annotations

import msgspec
import numpy as np

from aiolayer.config import DTYPE_BYTES, KVShape
from aiolayer.protocol.plan import RankRoute, local_heads

GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class ScaleConfig(msgspec.Struct, frozen=True, kw_only=True):
    p_tp: int
    d_tp: int
    requests: int
    blocks_per_request: int = 1
    num_layers: int = 8
    block_size: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "float16"
    layout: str = "HND"
    seed: int = 1234
    contiguous: bool = True      # D allocates each request's blocks contiguously
    wait_s: float = 300.0        # P: begin -> every outcome; D's receive deadline is this plus a margin
    gc_freeze: bool = True       # P ranks gc.freeze() their start-up heap once ready (as vLLM's workers do)

    @property
    def head_bytes(self) -> int:
        return self.head_dim * DTYPE_BYTES[self.dtype]

    def shape(self, heads: int, num_blocks: int) -> KVShape:
        return KVShape(num_layers=self.num_layers, num_blocks=num_blocks, block_size=self.block_size,
                       kv_heads=heads, head_dim=self.head_dim, dtype=self.dtype, layout=self.layout)

    @property
    def total_blocks(self) -> int:
        return self.requests * self.blocks_per_request


class PlanItem(msgspec.Struct, frozen=True, array_like=True):
    transfer_id: str
    request: int
    peer: str
    block_ids: list[int]       # D's registration (its AllocReply), as TransferSpec.from_registration takes it
    incarnation: str
    token: str
    route: RankRoute


# --- the global KV: any rank's bytes from (seed, layer, plane, global head, global block) ---------

def rank_heads(kv_heads: int, tp: int, rank: int) -> list[int]:
    """Global heads that ``rank`` of ``tp`` holds (replicated when tp > kv_heads), as map_ranks assumes."""
    n = local_heads(kv_heads, tp)
    return list(range(rank * n, rank * n + n)) if tp <= kv_heads else [rank // (tp // kv_heads)]


def kv_layer(cfg: ScaleConfig, heads: list[int], blocks, layer: int) -> np.ndarray:
    """[2 (K, V), len(blocks), block_bytes] uint8 of global ``blocks`` for ``heads``, in cfg.layout.

    Each (layer, plane, head) has its own random slab of one block's tokens, XORed with a salt per
    block: every token, head, block, layer and plane differs, so any misplaced span changes a CRC.
    """
    slab = cfg.block_size * cfg.head_bytes
    words = -(-slab // 8)
    salts = (np.asarray(blocks, dtype=np.uint64) + np.uint64(1)) * GOLDEN
    out = np.empty((2, salts.size, len(heads), slab), dtype=np.uint8)
    for plane in (0, 1):
        for i, head in enumerate(heads):
            pool = np.random.default_rng([cfg.seed, layer, plane, head]).integers(0, 1 << 63, words, dtype=np.uint64)
            out[plane, :, i] = (salts[:, None] ^ pool[None, :]).view(np.uint8)[:, :slab]
    if cfg.layout == "NHD":   # [plane, block, head, token, dim] -> [plane, block, token, head, dim]
        out = out.reshape(2, salts.size, len(heads), cfg.block_size, cfg.head_bytes).transpose(0, 1, 3, 2, 4)
    return np.ascontiguousarray(out).reshape(2, salts.size, -1)


def request_blocks(cfg: ScaleConfig, request: int) -> list[int]:
    first = request * cfg.blocks_per_request
    return list(range(first, first + cfg.blocks_per_request))
