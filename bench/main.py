"""``aiolayer bench``: P in this process, D in a child process, the same seeded KV through each mode.

Modes (one run, same shape, same bytes, same processes):
  layerwise  aiolayer as designed: each layer handed over as soon as it is written.
  bulk       aiolayer moving all layers after the last one is computed (whole-request connectors).
For every request D's bytes are checked against P's (per-layer CRC32 of K and V).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from aiolayer.config import KVShape, NodeConfig, Timeouts
from aiolayer.kvcache import PagedKVCache, checksums
from aiolayer.protocol import messages as m

from .node_proc import BENCH_ENV, NodeProcess
from .report import Progress, mode_summary, print_table

MODES = ("layerwise", "bulk")
HANDOFF = {"layerwise": "per_layer", "bulk": "after"}


def add_bench_args(p: argparse.ArgumentParser) -> None:
    d = KVShape()
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--requests", type=int, default=5, help="measured requests per mode")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests per mode")
    p.add_argument("--layer-ms", type=float, default=4.0, help="simulated compute per layer (ms)")
    p.add_argument("--num-layers", type=int, default=d.num_layers)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--kv-heads", type=int, default=d.kv_heads)
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--dtype", default=d.dtype, choices=["float16", "bfloat16", "float32", "int8", "uint8"])
    p.add_argument("--scatter", action="store_true", help="D allocates non-contiguous blocks")
    p.add_argument("--backend", default="mooncake", choices=["mooncake", "memory"],
                   help="memory runs D in-process (no real data plane)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default="bench/results", help="directory for latest.json")
    p.add_argument("--scenario", default="transfer", choices=["transfer", "faults"],
                   help="transfer: the modes side by side; faults: peer faults against real processes")


def run_bench(args: argparse.Namespace) -> int:
    for key, value in BENCH_ENV.items():
        os.environ.setdefault(key, value)
    import torch

    torch.set_num_threads(1)  # the forward thread gets one core; the data plane and D the other
    if args.scenario == "faults":
        from .faults import run_faults
        return run_faults(args)
    modes = [x.strip() for x in args.modes.split(",") if x.strip()]
    unknown = [x for x in modes if x not in MODES]
    if unknown:
        print(f"unknown mode(s) {unknown}; choose from {MODES}", file=sys.stderr)
        return 2
    n_blocks = math.ceil(args.prompt_tokens / args.block_size)
    p_shape = KVShape(num_layers=args.num_layers, num_blocks=n_blocks, block_size=args.block_size,
                      kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype)
    d_shape = KVShape(**{**{f: getattr(p_shape, f) for f in p_shape.__struct_fields__}, "num_blocks": 2 * n_blocks})
    config = {"num_layers": p_shape.num_layers, "kv_heads": p_shape.kv_heads, "head_dim": p_shape.head_dim,
              "dtype": p_shape.dtype, "block_size": p_shape.block_size, "prompt_tokens": args.prompt_tokens,
              "blocks_per_request": n_blocks, "block_bytes": p_shape.block_bytes,
              "bytes_per_request": 2 * p_shape.num_layers * n_blocks * p_shape.block_bytes,
              "layer_ms": args.layer_ms, "requests": args.requests, "warmup": args.warmup,
              "backend": args.backend, "scatter": args.scatter, "modes": modes, "seed": args.seed}
    progress = Progress(total=len(modes) * (args.requests + args.warmup))
    started = time.perf_counter()
    with _Setup(p_shape, d_shape, args) as setup:
        results = {mode: setup.run_mode(mode, args, progress) for mode in modes}
    progress.close()
    report = {"config": config, "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                            "platform": platform.platform()},
              "elapsed_s": round(time.perf_counter() - started, 2),
              "verified": all(r["verified"] for r in results.values()), "modes": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest.json").write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"\nwrote {out / 'latest.json'}  (verified: {str(report['verified']).lower()})")
    return 0 if report["verified"] else 1


class _Setup:
    """D node (child process, or in-process for the memory backend), P runtime, P cache, forward."""

    def __init__(self, p_shape: KVShape, d_shape: KVShape, args) -> None:
        self.p_shape, self.d_shape, self.args = p_shape, d_shape, args
        self.node = None
        self.runtime = None

    def __enter__(self) -> "_Setup":
        from aiolayer import DecodeNode, Runtime

        from .forward import SimulatedForward, seeded_kv

        args = self.args
        if args.backend == "mooncake":
            self.node = NodeProcess(self.d_shape, backend="mooncake").start()
            self.d_control = self.node.control
        else:
            self.node = DecodeNode(self.d_shape, NodeConfig(engine_id="bench-d", backend="memory")).start()
            self.d_control = self.node.control_endpoint
        self.runtime = Runtime(NodeConfig(engine_id="bench-p", backend=args.backend), Timeouts()).start()
        self.cache = PagedKVCache(self.p_shape)
        self.runtime.publish_layout(self.cache.k_base, self.cache.v_base, self.p_shape.block_bytes,
                                    self.p_shape.num_blocks)
        self.forward = SimulatedForward(self.cache, args.layer_ms)
        self.base_kv = seeded_kv(self.p_shape.num_layers, self.p_shape.num_blocks, self.p_shape.block_bytes,
                                 args.seed)
        self.step = 0
        return self

    def __exit__(self, *exc) -> None:
        if self.runtime is not None:
            self.runtime.stop()
        if self.node is not None:
            self.node.stop()

    def run_mode(self, mode: str, args, progress: "Progress") -> dict:
        samples = []
        for i in range(args.warmup + args.requests):
            sample = self.run_request(mode, i)
            progress.advance(f"{mode} {i + 1}/{args.warmup + args.requests} "
                             f"ttft {sample['ttft_ms']:.1f} ms{' (warm-up)' if i < args.warmup else ''}")
            if i >= args.warmup:
                samples.append(sample)
        return mode_summary(samples)

    def run_request(self, mode: str, index: int) -> dict:
        from aiolayer import TransferSpec

        from .forward import RequestKV

        rt, n = self.runtime, self.p_shape.num_blocks
        self.step += 1
        tid = f"bench-{mode}-{self.step}"
        alloc = rt.request(self.d_control, m.AllocRequest(transfer_id=tid, num_blocks=n,
                                                          contiguous=not self.args.scatter))
        src = list(range(n))
        kv = RequestKV(self.base_kv, self.step)
        spec = TransferSpec(transfer_id=tid, peer=self.d_control, src_blocks=src, dst_blocks=alloc.block_ids,
                            dst_incarnation=alloc.incarnation)
        timing = self.forward.run(rt.sender, self.step, [spec], kv, src, HANDOFF[mode])
        outcome = rt.sender.wait(tid, timeout=120)
        verified = False
        if outcome.ok:
            reply = rt.request(self.d_control, m.VerifyRequest(transfer_id=tid), timeout=30)
            crc_k, crc_v = checksums(self.cache.blocks, src)
            expect_k, expect_v = checksums(kv.data, range(n))  # what the forward meant to write
            verified = reply.crc_k == crc_k == expect_k and reply.crc_v == crc_v == expect_v
        try:
            rt.request(self.d_control, m.ReleaseRequest(transfer_id=tid))
        except Exception as exc:  # noqa: BLE001 - a failed release is reported, the run goes on
            print(f"release of {tid} failed: {exc}", file=sys.stderr)
        return _sample(outcome, timing, verified)


def _busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals: the time at least one write was in flight."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _sample(outcome, timing: dict, verified: bool) -> dict:
    spans = [(lt.submitted_s, lt.landed_s) for lt in outcome.layers]
    busy = _busy_seconds(spans)
    return {
        "ok": outcome.ok, "reason": outcome.reason, "verified": verified, "bytes": outcome.bytes,
        "ttft_ms": (outcome.finished_s - timing["t0"]) * 1e3,
        "exposed_ms": (outcome.finished_s - timing["t_forward_end"]) * 1e3,
        "forward_ms": (timing["t_forward_end"] - timing["t0"]) * 1e3,
        "transfer_busy_ms": busy * 1e3,
        "gbps": outcome.bytes / busy / 1e9 if busy > 0 else 0.0,
        "handoff_ns": timing["handoff_ns"],
        "layers": [[lt.layer, lt.handed_s - timing["t0"], lt.submitted_s - timing["t0"], lt.landed_s - timing["t0"]]
                   for lt in outcome.layers],
    }
