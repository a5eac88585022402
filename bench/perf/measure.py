"""One measurement of the transfer benchmark: the shapes of P's and D's caches, the modes asked for, and
every mode's requests through one ``Harness`` (one D process, one P runtime), summarised per mode.
Both the plain run and every point of the sweep measure through here."""

from __future__ import annotations

import math
import os
import platform
import sys
import time

from aiolayer.config import KVShape
from aiolayer.harness.node import shape_from_args

from .harness import MODES, NEEDS_MOONCAKE, Harness
from .report import Progress, derive, summarize


def parse_modes(args) -> list[str] | None:
    modes = [x.strip() for x in args.modes.split(",") if x.strip()]
    unknown = [x for x in modes if x not in MODES]
    if unknown:
        print(f"unknown mode(s) {unknown}; choose from {MODES}", file=sys.stderr)
        return None
    if args.backend != "mooncake":
        skipped = [x for x in modes if x in NEEDS_MOONCAKE]
        if skipped:
            print(f"backend {args.backend}: skipping {skipped} (they need Mooncake)", file=sys.stderr)
        modes = [x for x in modes if x not in NEEDS_MOONCAKE]
    if not modes:   # nothing measured would be "verified": all() of no rows is True
        print(f"no mode to run: choose from {MODES}" + (" (without Mooncake: not those)" if args.backend != "mooncake"
                                                        else ""), file=sys.stderr)
        return None
    return modes


def shapes(args) -> tuple[KVShape, KVShape]:
    """P holds one request; D twice that, so that a scattered allocation has room to scatter."""
    n_blocks = math.ceil(args.prompt_tokens / args.block_size)
    return (shape_from_args(args, num_blocks=n_blocks, layout=KVShape().layout),
            shape_from_args(args, num_blocks=2 * n_blocks, layout=KVShape().layout))


def measure(args, modes: list[str], progress: Progress | None = None) -> dict:
    """One set-up, every mode: warm-ups first, then the measured requests round-robin across modes."""
    p_shape, d_shape = shapes(args)
    config = {"num_layers": p_shape.num_layers, "kv_heads": p_shape.kv_heads, "head_dim": p_shape.head_dim,
              "dtype": p_shape.dtype, "block_size": p_shape.block_size, "prompt_tokens": args.prompt_tokens,
              "blocks_per_request": p_shape.num_blocks, "block_bytes": p_shape.block_bytes,
              "bytes_per_request": p_shape.total_bytes, "layer_ms": args.layer_ms,
              "auto_min_tokens": args.auto_min_tokens, "requests": args.requests, "warmup": args.warmup,
              "backend": args.backend, "scatter": args.scatter, "modes": modes, "seed": args.seed,
              "device_cpus": sorted(getattr(args, "device_cpus", None) or []),
              "host_cpus": sorted(getattr(args, "host_cpus", None) or [])}
    load_before = [round(x, 2) for x in os.getloadavg()]
    started = time.perf_counter()
    warm: dict[str, list] = {mode: [] for mode in modes}
    measured: dict[str, list] = {mode: [] for mode in modes}
    with Harness(p_shape, d_shape, args, modes, getattr(args, "device_cpus", None)) as harness:
        for rnd in range(args.warmup + args.requests):
            for mode in modes:
                sample = harness.run_request(mode)
                (warm if rnd < args.warmup else measured)[mode].append(sample)
                if progress is not None:
                    progress.advance(_progress_text(mode, rnd, args, sample))
    if progress is not None:
        progress.close()
    results = {mode: summarize(measured[mode], warm[mode]) for mode in modes}
    basis = derive(results)
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
               "loadavg_before": load_before, "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    return {"config": config, "machine": machine,
            "elapsed_s": round(time.perf_counter() - started, 2), "basis": basis,
            "verified": all(r["verified"] for r in results.values()), "modes": results}


def _progress_text(mode: str, rnd: int, args, sample: dict) -> str:
    what = f"ttft {sample['ttft_ms']:.1f} ms" if "ttft_ms" in sample else "limit"
    tag = " (warm-up)" if rnd < args.warmup else ""
    ok = "" if sample["verified"] else " NOT VERIFIED"
    return f"{mode} {rnd + 1}/{args.warmup + args.requests} {what}{tag}{ok}"
