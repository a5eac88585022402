"""``aiolayer bench transfer --sweep``: TTFT by mode over prompt length, layer count and block size.

One axis at a time around the default shape (a full grid would take hours on a small VM): prompt
length at the default layers and block size, layer count at the default prompt, block size with D's
blocks scattered (contiguous blocks merge into one run per layer, so block size would not matter).
Compute per layer grows with the prompt (``--compute-scaling linear``: ``--layer-ms`` is the time at
``--prompt-tokens``), as a real prefill's does. Each point is its own set-up (D process, P runtime).
Writes sweep.csv, sweep.json and sweep.png, and the shortest prompt from which layer-wise beats bulk:
the measured threshold for ``--auto-min-tokens``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import sys
import time
from pathlib import Path

from ..provenance import write_result
from .measure import measure, parse_modes, shapes
from .report import Progress

CSV_FIELDS = ("axis", "prompt_tokens", "num_layers", "block_size", "scatter", "layer_ms", "bytes_per_request",
              "mode", "choice", "ttft_ms", "exposed_ms", "forward_ms", "transfer_ms", "gbps", "hidden_fraction",
              "efficiency", "verified")
_SETUP_S = 5.0          # D process and engines up and down, per point (measured here: 4-5 s)
_CRC_GBPS = 3.0         # verification: three CRC32 passes over the request's bytes
_XFER_GBPS = 1.2        # a pessimistic transfer rate for the estimate


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sweep (with --sweep)")
    g.add_argument("--sweep-tokens", default="16,64,256,1024,2048,4096,16384",
                   help="prompt lengths (below 256 to find where layer-wise stops paying)")
    g.add_argument("--sweep-layers", default="8,16,32,64", help="layer counts (at --prompt-tokens)")
    g.add_argument("--sweep-block-sizes", default="16,64,256", help="tokens per block (D's blocks scattered)")
    g.add_argument("--sweep-modes", default="layerwise,bulk,auto,threaded,raw_mooncake",
                   help="comma-separated modes measured at each point (as --modes)")
    g.add_argument("--sweep-requests", type=int, default=2,
                   help="measured requests per mode and point (up to 4x as many below --prompt-tokens)")
    g.add_argument("--sweep-budget-s", type=float, default=300,
                   help="stop starting new points after this many seconds (the rest are reported as skipped)")
    g.add_argument("--compute-scaling", choices=["linear", "fixed"], default="linear",
                   help="linear: compute per layer proportional to the prompt length; fixed: --layer-ms everywhere")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def sweep_points(args) -> list[tuple[str, dict]]:
    """(axis, overrides) per point; the default shape is measured once and shared by the axes."""
    points = [("prompt_tokens", {"prompt_tokens": t}) for t in _ints(args.sweep_tokens)]
    points += [("num_layers", {"num_layers": n}) for n in _ints(args.sweep_layers)]
    points += [("block_size", {"block_size": b, "scatter": True}) for b in _ints(args.sweep_block_sizes)]
    return points


def point_args(args, overrides: dict, modes: list[str]) -> argparse.Namespace:
    a = copy.copy(args)
    for key, value in overrides.items():
        setattr(a, key, value)
    # Short prompts are cheap and their TTFT gaps are small against the noise: measure them more often.
    base = args.sweep_requests
    a.requests = min(4 * base, max(base, round(base * args.prompt_tokens / a.prompt_tokens)))
    a.warmup = 1
    a.modes = ",".join(modes)
    if args.compute_scaling == "linear":
        a.layer_ms = args.layer_ms * a.prompt_tokens / args.prompt_tokens
    return a


def _key(a) -> tuple:
    return (a.prompt_tokens, a.num_layers, a.block_size, a.scatter)


def estimate_s(a, modes: list[str]) -> float:
    """Rough wall time of one point: set-up, forward, transfer and verification of every request."""
    p_shape, _ = shapes(a)
    gb = p_shape.total_bytes / 1e9
    forward = p_shape.num_layers * (a.layer_ms / 1e3 + p_shape.layer_bytes * 2 / 8e9)
    per_request = forward + gb / _XFER_GBPS + gb / _CRC_GBPS * 3
    return _SETUP_S + len(modes) * (a.warmup + a.requests) * per_request


def run_sweep(args, out: Path) -> int:
    modes = parse_modes(argparse.Namespace(modes=args.sweep_modes, backend=args.backend))
    if modes is None:
        return 2
    plan, seen = [], set()
    for axis, overrides in sweep_points(args):
        a = point_args(args, overrides, modes)
        plan.append((axis, a, _key(a) in seen))
        seen.add(_key(a))
    fresh = [(axis, a) for axis, a, dup in plan if not dup]
    est = sum(estimate_s(a, modes) for _, a in fresh)
    print(f"sweep: {len(fresh)} set-ups, {len(modes)} modes, {args.sweep_requests}+1 or more requests each; "
          f"estimated {est / 60:.1f} min (budget {args.sweep_budget_s:.0f} s)", file=sys.stderr)
    steps = {id(a): len(modes) * (a.warmup + a.requests) for _, a in fresh}
    progress = Progress(total=sum(steps.values()), total_weight=est)
    started, reports, skipped = time.monotonic(), {}, []
    for axis, a in fresh:
        label = f"{axis}={getattr(a, axis)}"
        if time.monotonic() - started > args.sweep_budget_s:
            skipped.append(label)
            progress.advance(f"skipped {label} (budget)", steps[id(a)], estimate_s(a, modes))
            continue
        reports[_key(a)] = measure(a, modes, _PointProgress(progress, label, estimate_s(a, modes) / steps[id(a)]))
    progress.close()
    rows = [_row(axis, reports[_key(a)], mode) for axis, a, _ in plan if _key(a) in reports
            for mode in reports[_key(a)]["modes"]]
    threshold = crossover(rows)
    summary = {"modes": modes, "elapsed_s": round(time.monotonic() - started, 1), "skipped": skipped,
               "auto_min_tokens_measured": threshold, "auto_min_tokens_used": args.auto_min_tokens,
               "compute_scaling": args.compute_scaling, "base_layer_ms": args.layer_ms,
               "base_prompt_tokens": args.prompt_tokens, "rows": rows}
    _write(out, rows, summary)
    from .plots import plot_sweep   # matplotlib only when a PNG is written
    png = plot_sweep(rows, out / "sweep.png", threshold=threshold, auto_min_tokens=args.auto_min_tokens)
    print(f"wrote {out / 'sweep.csv'}, {out / 'sweep.json'}, {png}")
    print(f"layer-wise TTFT beats bulk from {threshold} tokens up" if threshold else
          "layer-wise never beat bulk at every length from some point up in this sweep")
    verified = all(r["verified"] for r in rows)
    if skipped:
        print(f"skipped for the time budget: {', '.join(skipped)}", file=sys.stderr)
    return 0 if verified and rows else 1


class _PointProgress:
    """Forwards one point's request updates to the sweep's progress bar, prefixed with the point."""

    def __init__(self, progress: Progress, label: str, weight: float) -> None:
        self.progress, self.label, self.weight = progress, label, weight

    def advance(self, text: str, units: int = 1) -> None:
        self.progress.advance(f"{self.label}: {text}", units, self.weight * units)

    def close(self) -> None:
        pass


def _row(axis: str, report: dict, mode: str) -> dict:
    cfg, r = report["config"], report["modes"][mode]
    row = {"axis": axis, **{k: cfg[k] for k in ("prompt_tokens", "num_layers", "block_size", "scatter",
                                                  "layer_ms", "bytes_per_request")}, "mode": mode}
    for key in CSV_FIELDS:
        if key not in row:
            row[key] = r.get(key)
    row["choice"] = r.get("choice", "")
    return row


def crossover(rows: list[dict]) -> int | None:
    """The shortest prompt from which layer-wise TTFT is below bulk's at every longer prompt too."""
    ttft = {}
    for row in rows:
        if row["axis"] == "prompt_tokens" and row["mode"] in ("layerwise", "bulk"):
            ttft.setdefault(row["prompt_tokens"], {})[row["mode"]] = row["ttft_ms"]
    lengths = sorted(t for t, v in ttft.items() if len(v) == 2)
    threshold = None
    for t in reversed(lengths):
        if ttft[t]["layerwise"] < ttft[t]["bulk"]:
            threshold = t
        else:
            break
    return threshold


def _write(out: Path, rows: list[dict], summary: dict) -> None:
    with open(out / "sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k) for k in CSV_FIELDS})
    write_result(out / "sweep.json", summary)
