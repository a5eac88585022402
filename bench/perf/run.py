"""``aiolayer bench`` (``--scenario transfer``, the default): the modes side by side, or ``--sweep``.

Modes (one run, same shape, same bytes, same D process; see bench/README.md):
  layerwise     aiolayer as designed: each layer handed over as soon as it is written.
  bulk          aiolayer moving all layers after the last one is computed (whole-request connectors).
  auto          aiolayer with the bulk fallback below --auto-min-tokens (protocol.plan.use_layerwise).
  checked       layerwise with the end-to-end integrity check on every transfer (the other aiolayer
                modes run without it): its cost, scaled to the default sampling rate, is reported.
  threaded      the thread-and-blocking-socket design aiolayer replaces (perf/threaded.py).
  raw_mooncake  the same bytes with Mooncake called directly, no runtime, no compute: the ceiling.
  raw_tcp       plain sockets on 127.0.0.1; memcpy: one copy in memory. Physical limits.
Requests of all modes are interleaved (round-robin) so that the noise of a small VM hits them alike.
For every request the receiver's bytes are checked (CRC32 per layer's K and V).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..provenance import write_result
from . import cpus
from .harness import MODES
from .measure import measure, parse_modes
from .report import Progress, print_table
from .sweep import add_sweep_args, run_sweep

# Compute per layer ~ the transfer of one layer alone here (8 MiB at ~2.5 GB/s on one host core: ~3.2 ms).
DEFAULT_LAYER_MS = 3.0
# The sweep (bench/README.md): layer-wise beat bulk at every prompt length measured, 16 tokens (one block)
# included, so auto falls back to bulk only below one block. Hosts with dearer per-layer work can raise it.
DEFAULT_AUTO_MIN_TOKENS = 16


def add_args(p: argparse.ArgumentParser) -> None:
    """The transfer benchmark's own options (the shape flags and --requests/--seed/--out are common)."""
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--prompt-tokens", type=int, default=2048,
                   help="tokens per request: its KV is ceil(tokens / --block-size) blocks per layer")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests per mode")
    p.add_argument("--layer-ms", type=float, default=DEFAULT_LAYER_MS,
                   help="simulated compute per layer (ms) at --prompt-tokens")
    p.add_argument("--auto-min-tokens", type=int, default=DEFAULT_AUTO_MIN_TOKENS,
                   help="auto mode: layer-wise from this prompt length up, bulk below (measure it with --sweep)")
    p.add_argument("--scatter", action="store_true", help="D allocates non-contiguous blocks")
    p.add_argument("--backend", default="mooncake", choices=["mooncake", "memory"],
                   help="memory runs D in-process (no real data plane; threaded and raw_mooncake are skipped)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="share every CPU between the simulated compute and the transfer (see perf/cpus.py)")
    p.add_argument("--no-raw-under-compute", dest="raw_under_compute", action="store_false",
                   help="skip raw_mooncake's extra variant measured while a thread does the forward's compute")
    p.add_argument("--timeline", action="store_true", help="also write timeline.png: one request per mode")
    p.add_argument("--sweep", action="store_true",
                   help="sweep prompt length, layer count and block size; writes sweep.csv and sweep.png")
    add_sweep_args(p)
    from .two_hosts import add_two_hosts_args
    add_two_hosts_args(p)


def run_transfer(args: argparse.Namespace) -> int:
    if args.two_hosts:   # before any pinning: the P and D children it starts must inherit every CPU
        from .two_hosts import run_two_hosts
        return run_two_hosts(args, Path(args.out))
    # Before any thread or child exists: they inherit the host CPUs, the forward takes the device one.
    args.device_cpus, args.host_cpus = cpus.plan(getattr(args, "pin", True))
    cpus.pin_this_thread(args.host_cpus)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        return run_sweep(args, out)
    modes = parse_modes(args)
    if modes is None:
        return 2
    busy = os.getloadavg()[0]
    if busy > 0.5:  # the figures compare modes on 2 cores: someone else's work skews every one of them
        print(f"note: load average {busy:.2f} before the run; other processes are using the CPU and the "
              f"figures will be noisier", file=sys.stderr)
    report = measure(args, modes, Progress(total=len(modes) * (args.requests + args.warmup)))
    write_result(out / "latest.json", report)
    print_table(report)
    print(f"\nwrote {out / 'latest.json'}  (verified: {str(report['verified']).lower()})")
    if args.timeline:
        from .plots import plot_timeline   # matplotlib only when a PNG is asked for
        path = plot_timeline(report, out / "timeline.png")
        print(f"wrote {path}")
    return 0 if report["verified"] else 1
