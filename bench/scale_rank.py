"""A P (prefill) rank of ``bench --scenario scale``, run as ``python -m aiolayer_bench.scale_rank RANK CONFIG``.

It fills a paged KV cache with its local heads of the global seeded KV (``kv_layer``), starts its
own Runtime (Mooncake over TCP), prints ``SCALE {"kind": "ready", "control": ...}``, reads the path
of its plan (a msgspec JSON list of ``PlanItem``) from stdin, begins ONE step with every transfer,
marks every layer ready at once, waits for every outcome (bounded by ``wait_s``) and prints a
``summary`` line. The data model lives here so that the driver (bench/scale.py) computes the same
bytes for its verification.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import msgspec
import numpy as np

from aiolayer import Runtime, TransferSpec
from aiolayer.config import DTYPE_BYTES, KVShape, NodeConfig, Timeouts
from aiolayer.kvcache import PagedKVCache
from aiolayer.protocol.plan import HeadGeometry, RankRoute, local_heads

P_TIMEOUTS = Timeouts(control_call=5.0, layout_fetch=20.0, layer_write=60.0, done_delivery=30.0, quarantine=60.0)
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
    dst_blocks: list[int]
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


# --- a P rank (child process) -----------------------------------------------------------------------

def _say(**msg) -> None:
    sys.stdout.write("SCALE " + json.dumps(msg) + "\n")
    sys.stdout.flush()


def rank_main(rank: int, cfg: ScaleConfig) -> int:
    """Fill the local heads, start the runtime, say ready; read the plan path; stream; report."""
    t0 = time.perf_counter()
    heads = rank_heads(cfg.kv_heads, cfg.p_tp, rank)
    shape = cfg.shape(len(heads), cfg.total_blocks)
    cache = PagedKVCache(shape)
    for layer in range(cfg.num_layers):
        cache.blocks[layer] = kv_layer(cfg, heads, range(cfg.total_blocks), layer)
    rt = Runtime(NodeConfig(engine_id=f"scale-p{rank}"), P_TIMEOUTS).start()
    try:
        rt.publish_layout(cache.k_base, cache.v_base, shape.block_bytes, shape.num_blocks, kv_heads=len(heads),
                          geometry=HeadGeometry(cfg.block_size, cfg.head_bytes, cfg.layout))
        _say(kind="ready", rank=rank, control=rt.control_endpoint, setup_s=round(time.perf_counter() - t0, 3))
        line = sys.stdin.readline().strip()
        if not line:
            return 2   # the driver went away
        items = msgspec.json.decode(Path(line).read_bytes(), type=list[PlanItem])
        specs = [TransferSpec(transfer_id=it.transfer_id, peer=it.peer, src_blocks=request_blocks(cfg, it.request),
                              dst_blocks=it.dst_blocks, dst_incarnation=it.incarnation, token=it.token,
                              route=it.route) for it in items]
        _say(kind="summary", rank=rank, **_stream(rt, cfg, specs, rank))
    finally:
        rt.stop()
    return 0


def _stream(rt: Runtime, cfg: ScaleConfig, specs: list[TransferSpec], rank: int) -> dict:
    """One step with every transfer, every layer ready at once; every outcome, bounded by wait_s."""
    sender, backend = rt.sender, rt.backend
    t_begin = time.perf_counter()
    sender.begin_step(1, specs)
    for layer in range(cfg.num_layers):
        sender.layer_ready(1, layer)
    sender.end_step(1)
    outcomes: dict = {}
    peak_active = peak_writes = 0
    last_note = t_begin
    while len(outcomes) < len(specs) and time.perf_counter() - t_begin < cfg.wait_s:
        time.sleep(0.02)
        outcomes.update((o.transfer_id, o) for o in sender.pop_outcomes())
        peak_active = max(peak_active, sender.active)
        writes = _writes_in_flight(backend)
        peak_writes = max(peak_writes, writes)
        if time.perf_counter() - last_note > 1.0:
            last_note = time.perf_counter()
            _say(kind="progress", rank=rank, done=len(outcomes), total=len(specs), writes=writes)
    failed = {tid: o.reason for tid, o in outcomes.items() if not o.ok}
    return {"specs": len(specs), "ok": len(outcomes) - len(failed), "failed": len(failed),
            "lost": len(specs) - len(outcomes), "bytes": sum(o.bytes for o in outcomes.values()),
            "t_begin": t_begin, "t_end": max((o.finished_s for o in outcomes.values()), default=t_begin),
            "peak_active": peak_active, "peak_backend_writes": peak_writes,
            "writes_submitted": getattr(backend, "runs_submitted", 0),
            "finished": {tid: o.finished_s for tid, o in outcomes.items()},
            "reasons": dict(list(failed.items())[:20])}



def _writes_in_flight(backend) -> int:
    value = getattr(backend, "inflight", None)   # Mooncake: submitted runs not yet settled
    return int(value) if value is not None else len(getattr(backend, "_inflight", ()))


if __name__ == "__main__":
    sys.exit(rank_main(int(sys.argv[1]), msgspec.json.decode(Path(sys.argv[2]).read_bytes(), type=ScaleConfig)))
