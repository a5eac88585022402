"""``aiolayer bench``: P in this process, D in a child process, the same seeded KV through each mode.

Modes (one run, same shape, same bytes, same D process; see bench/README.md):
  layerwise     aiolayer as designed: each layer handed over as soon as it is written.
  bulk          aiolayer moving all layers after the last one is computed (whole-request connectors).
  auto          aiolayer with the bulk fallback below --auto-min-tokens (protocol.plan.use_layerwise).
  threaded      the thread-and-blocking-socket design aiolayer replaces (bench/threaded.py).
  raw_mooncake  the same bytes with Mooncake called directly, no runtime, no compute: the ceiling.
  raw_tcp       plain sockets on 127.0.0.1; memcpy: one copy in memory. Physical limits.
Requests of all modes are interleaved (round-robin) so that the noise of a small VM hits them alike.
For every request the receiver's bytes are checked (CRC32 per layer's K and V).
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

from aiolayer.cli import Command
from aiolayer.config import KVShape

from . import cpus
from .harness import MODES, NEEDS_MOONCAKE, Harness
from .node_proc import BENCH_ENV
from .report import Progress, derive, print_table, summarize

# Compute per layer ~ the transfer of one layer alone here (8 MiB at ~2.5 GB/s on one host core: ~3.2 ms).
DEFAULT_LAYER_MS = 3.0
# The sweep (bench/README.md): layer-wise beat bulk at every prompt length measured, 16 tokens (one block)
# included, so auto falls back to bulk only below one block. Hosts with dearer per-layer work can raise it.
DEFAULT_AUTO_MIN_TOKENS = 16


SCENARIO_REQUESTS = {"transfer": 7, "faults": 0, "scale": 1000, "soak": 10000}   # --requests by default


def add_bench_args(p: argparse.ArgumentParser) -> None:
    d = KVShape()
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--requests", type=int, default=None,
                   help="measured requests per mode (transfer, default 7); transfers in all (scale: 1000, soak: 10000)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests per mode")
    p.add_argument("--layer-ms", type=float, default=DEFAULT_LAYER_MS,
                   help="simulated compute per layer (ms) at --prompt-tokens")
    p.add_argument("--auto-min-tokens", type=int, default=DEFAULT_AUTO_MIN_TOKENS,
                   help="auto mode: layer-wise from this prompt length up, bulk below (measure it with --sweep)")
    p.add_argument("--num-layers", type=int, default=d.num_layers)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--kv-heads", type=int, default=d.kv_heads)
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--dtype", default=d.dtype, choices=["float16", "bfloat16", "float32", "int8", "uint8"])
    p.add_argument("--scatter", action="store_true", help="D allocates non-contiguous blocks")
    p.add_argument("--backend", default="mooncake", choices=["mooncake", "memory"],
                   help="memory runs D in-process (no real data plane; threaded and raw_mooncake are skipped)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="share every CPU between the simulated compute and the transfer (see bench/cpus.py)")
    p.add_argument("--no-raw-under-compute", dest="raw_under_compute", action="store_false",
                   help="skip raw_mooncake's extra variant measured while a thread does the forward's compute")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default="bench/results", help="directory for latest.json, the CSV and the PNGs")
    p.add_argument("--timeline", action="store_true", help="also write timeline.png: one request per mode")
    p.add_argument("--sweep", action="store_true",
                   help="sweep prompt length, layer count and block size; writes sweep.csv and sweep.png")
    from .sweep import add_sweep_args
    add_sweep_args(p)
    p.add_argument("--scenario", default="transfer", choices=list(SCENARIO_REQUESTS),
                   help="transfer: the modes side by side; faults: peer faults against real processes; "
                        "scale: concurrent transfers between P and D rank processes (TP mapping); "
                        "soak: many transfers with faults injected, memory and latency over time")
    g = p.add_argument_group("scale and soak")
    g.add_argument("--prefill-ranks", type=int, default=2, help="scale: P tensor-parallel rank processes")
    g.add_argument("--decode-ranks", type=int, default=4, help="scale and soak: D rank (node) processes")
    g.add_argument("--kv-layout", default="HND", choices=["HND", "NHD"],
                   help="scale: block layout; NHD splits each head slice into one write per token")
    g.add_argument("--fault-rate", type=float, default=0.05,
                   help="soak: fraction of transfers that get a fault (kill, freeze, refuse, drop DONE)")


def run_bench(args: argparse.Namespace) -> int:
    for key, value in BENCH_ENV.items():
        os.environ.setdefault(key, value)
    if args.requests is None:
        args.requests = SCENARIO_REQUESTS[args.scenario]
    problem = scenario_arg_problem(args)
    if problem:
        print(f"aiolayer bench: {problem}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)  # the simulated compute is one thread, on one core (bench/cpus.py)
    if args.scenario == "faults":
        from .faults import run_faults
        return run_faults(args)
    if args.scenario == "scale":
        from .scale import run_scale
        return run_scale(args)
    if args.scenario == "soak":
        from .soak import run_soak
        return run_soak(args)
    # Before any thread or child exists: they inherit the host CPUs, the forward takes the device one.
    args.device_cpus, args.host_cpus = cpus.plan(getattr(args, "pin", True))
    cpus.pin_this_thread(args.host_cpus)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        from .sweep import run_sweep
        return run_sweep(args, out)
    modes = parse_modes(args)
    if modes is None:
        return 2
    busy = os.getloadavg()[0]
    if busy > 0.5:  # the figures compare modes on 2 cores: someone else's work skews every one of them
        print(f"note: load average {busy:.2f} before the run; other processes are using the CPU and the "
              f"figures will be noisier", file=sys.stderr)
    report = measure(args, modes, Progress(total=len(modes) * (args.requests + args.warmup)))
    (out / "latest.json").write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"\nwrote {out / 'latest.json'}  (verified: {str(report['verified']).lower()})")
    if args.timeline:
        from .plots import plot_timeline
        path = plot_timeline(report, out / "timeline.png")
        print(f"wrote {path}")
    return 0 if report["verified"] else 1


def scenario_arg_problem(args) -> str:
    """What is wrong with the scale/soak arguments, in words ("" when nothing)."""
    if args.scenario not in ("scale", "soak"):
        return ""
    if args.requests < 1:
        return f"--requests must be >= 1, got {args.requests}"
    if not 0.0 <= args.fault_rate <= 1.0:
        return f"--fault-rate must be within [0, 1], got {args.fault_rate}"
    if args.decode_ranks < 1 or (args.scenario == "scale" and args.prefill_ranks < 1):
        return "--prefill-ranks and --decode-ranks must be >= 1"
    if args.scenario == "scale":
        from aiolayer.protocol.plan import map_ranks
        try:
            map_ranks(args.kv_heads, args.prefill_ranks, args.decode_ranks)
        except ValueError as exc:
            return f"--kv-heads {args.kv_heads} with {args.prefill_ranks} P and {args.decode_ranks} D ranks: {exc}"
    return ""


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
    return modes


def shapes(args) -> tuple[KVShape, KVShape]:
    """P holds one request; D twice that, so that a scattered allocation has room to scatter."""
    n_blocks = math.ceil(args.prompt_tokens / args.block_size)
    fields = dict(num_layers=args.num_layers, block_size=args.block_size, kv_heads=args.kv_heads,
                  head_dim=args.head_dim, dtype=args.dtype)
    return KVShape(num_blocks=n_blocks, **fields), KVShape(num_blocks=2 * n_blocks, **fields)


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


COMMAND = Command("the layer-wise transfer benchmark", add_bench_args, run_bench)
