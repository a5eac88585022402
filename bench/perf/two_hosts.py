"""``aiolayer bench transfer --two-hosts``: the transfer benchmark over a real link, P and D on two "hosts".

Two network namespaces joined by one veth pair (``aiolayer.harness.netns``): D is an ``aiolayer node``
bound to host B's address, P is this same benchmark re-run as a child inside host A with
``--d-control`` (D's endpoint: it starts no D of its own) and ``--bind-host`` (A's address, for its
runtime and its own Mooncake engine). Nothing else joins the two, so every byte crosses the link.
For each ``--link-gbit`` rate (tbf on both ends; 0 = unlimited) the child measures the modes against
the one D and writes its latest.json; this process collects, per rate, the hidden fraction and TTFT
of each mode into two_hosts.json and two_hosts.png. raw_mooncake (over the same link) is the
transfer alone that the hidden fraction is measured against.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from aiolayer.harness.child import ChildProcess
from aiolayer.harness.netns import available, two_hosts
from aiolayer.harness.node import MOONCAKE_ENV, shape_flags

from ..provenance import write_result
from .harness import MODES
from .measure import shapes

TWO_HOSTS_MODES = "layerwise,bulk,threaded,raw_mooncake"
LOCAL_ONLY = ("raw_tcp", "memcpy")     # measured inside one namespace: they would not cross the link
CHILD_LIMIT_S = 1800


def add_two_hosts_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("two hosts (root: network namespaces)")
    g.add_argument("--two-hosts", action="store_true",
                   help="P and D in two network namespaces joined by one veth pair; one run per --link-gbit "
                        f"(modes default to {TWO_HOSTS_MODES}); writes two_hosts.json and two_hosts.png")
    g.add_argument("--link-gbit", default="1,4,16,0",
                   help="--two-hosts: link rates in Gbit/s (tbf), comma-separated; 0 = unlimited")
    g.add_argument("--d-control", default="", help="use this running D (its control endpoint); start none")
    g.add_argument("--bind-host", default="", help="P's address (runtime and Mooncake); default loopback")


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or any(r < 0 for r in rates):
        raise ValueError(f"--link-gbit wants rates >= 0 (0 = unlimited), got {text!r}")
    return rates


def _label(gbit: float) -> str:
    return "unlimited" if gbit == 0 else f"{gbit:g}gbit"


def _modes(args) -> str:
    explicit = args.modes if args.modes != ",".join(MODES) else ""   # the plain default: this run's own
    modes = [x for x in (explicit or TWO_HOSTS_MODES).split(",") if x and x not in LOCAL_ONLY]
    if "raw_mooncake" not in modes:   # the transfer alone: the hidden fraction's basis
        modes.append("raw_mooncake")
    return ",".join(modes)


def _p_command(args, modes: str, d_control: str, bind_host: str, out: Path) -> list[str]:
    p_shape, _ = shapes(args)
    cmd = [sys.executable, "-m", "aiolayer", "bench", "transfer", "--modes", modes, "--d-control", d_control,
           "--bind-host", bind_host, "--out", str(out), "--requests", str(args.requests),
           "--warmup", str(args.warmup), "--prompt-tokens", str(args.prompt_tokens),
           "--layer-ms", str(args.layer_ms), "--auto-min-tokens", str(args.auto_min_tokens),
           "--seed", str(args.seed), "--no-raw-under-compute",
           *shape_flags(p_shape, skip=("num_blocks", "layout"))]
    return cmd + (["--scatter"] if args.scatter else []) + ([] if args.pin else ["--no-pin"])


def _start_d(hosts, d_shape) -> ChildProcess:
    cmd = ["ip", "netns", "exec", hosts.b.ns, sys.executable, "-m", "aiolayer", "node", "--role", "decode",
           "--backend", "mooncake", "--bind-host", hosts.b.address, *shape_flags(d_shape)]
    d = ChildProcess(cmd, env={**os.environ, **MOONCAKE_ENV}, name="decode node (host B)").start()
    try:
        d.info = d.read_json(60, require="control")
    except BaseException:
        d.stop()
        raise
    return d


def _row(gbit: float, report: dict, layer_bytes: int, layer_ms: float) -> dict:
    """One rate: the modes' figures, and where one layer's transfer stands against one layer's compute."""
    layer_xfer_ms = layer_bytes * 8 / (gbit * 1e9) * 1e3 if gbit else None
    regime = ("unlimited" if layer_xfer_ms is None else "below" if layer_xfer_ms < 0.8 * layer_ms
              else "above" if layer_xfer_ms > 1.25 * layer_ms else "equal")
    modes = {name: {k: r.get(k) for k in ("ttft_ms", "exposed_ms", "forward_ms", "transfer_ms", "gbps",
                                           "hidden_fraction", "verified", "failures")}
             for name, r in report["modes"].items()}
    lw, bulk = report["modes"].get("layerwise", {}), report["modes"].get("bulk", {})
    raw = report["modes"].get("raw_mooncake", {})
    measured = raw["transfer_ms"] / report["config"]["num_layers"] if raw.get("transfer_ms") else None
    return {"link_gbit": gbit or None, "label": _label(gbit), "layer_transfer_ms_at_rate": layer_xfer_ms,
            "layer_transfer_ms_measured": round(measured, 3) if measured else None,
            "layer_compute_ms": layer_ms, "transfer_vs_compute": regime, "verified": report["verified"],
            "hidden_fraction_layerwise": lw.get("hidden_fraction"), "hidden_fraction_bulk": bulk.get("hidden_fraction"),
            "ttft_ms_layerwise": lw.get("ttft_ms"), "ttft_ms_bulk": bulk.get("ttft_ms"),
            "ttft_layerwise_vs_bulk": round(lw["ttft_ms"] / bulk["ttft_ms"], 3)
            if lw.get("ttft_ms") and bulk.get("ttft_ms") else None,
            "link_gbps_raw": report["modes"].get("raw_mooncake", {}).get("gbps"), "modes": modes}


def _one_rate(args, hosts, gbit: float, modes: str, d_shape, where: Path) -> dict | None:
    """The link at ``gbit``, a fresh D in host B (each P run numbers its transfers from 1), P's run in
    host A; P's latest.json, or None (said on stderr) when it wrote none."""
    hosts.shape(gbit or None)
    (where / "latest.json").unlink(missing_ok=True)
    d = _start_d(hosts, d_shape)
    try:
        print(f"[two hosts] link {_label(gbit)}: P in {hosts.a.ns} ({hosts.a.address}) -> "
              f"D in {hosts.b.ns} ({hosts.b.address})", file=sys.stderr, flush=True)
        cmd = ["ip", "netns", "exec", hosts.a.ns, *_p_command(args, modes, d.info["control"], hosts.a.address, where)]
        done = subprocess.run(cmd, env={**os.environ, **MOONCAKE_ENV}, timeout=CHILD_LIMIT_S,
                              stdout=subprocess.PIPE, text=True)
        print(done.stdout, flush=True)
    finally:
        d.stop()
    if not (where / "latest.json").exists():
        print(f"aiolayer bench transfer --two-hosts: P at {_label(gbit)} exited {done.returncode} without latest.json",
              file=sys.stderr)
        return None
    return json.loads((where / "latest.json").read_text())


def run_two_hosts(args, out: Path) -> int:
    try:
        rates = _rates(args.link_gbit)
    except ValueError as exc:
        print(f"aiolayer bench: {exc}", file=sys.stderr)
        return 2
    why = available()
    if why:
        print(f"aiolayer bench transfer --two-hosts: {why}", file=sys.stderr)
        return 2
    p_shape, d_shape = shapes(args)
    modes, rows = _modes(args), []
    out.mkdir(parents=True, exist_ok=True)
    with two_hosts() as hosts:
        for gbit in rates:
            report = _one_rate(args, hosts, gbit, modes, d_shape, out / "two_hosts" / _label(gbit))
            if report is None:
                return 1
            rows.append(_row(gbit, report, 2 * p_shape.layer_bytes, args.layer_ms))   # K and V
    result = {"config": {"modes": modes, "link_gbit": rates, "prompt_tokens": args.prompt_tokens,
                         "layer_ms": args.layer_ms, "layer_bytes": 2 * p_shape.layer_bytes,
                         "num_layers": p_shape.num_layers, "requests": args.requests, "warmup": args.warmup,
                         "p_host": "namespace A", "d_host": "namespace B (aiolayer node)"},
              "verified": all(r["verified"] for r in rows), "rates": rows}
    write_result(out / "two_hosts.json", result)
    from .plots import plot_two_hosts   # matplotlib only here
    png = plot_two_hosts(rows, out / "two_hosts.png")
    _print_rows(rows)
    print(f"\nwrote {out / 'two_hosts.json'} and {png}  (verified: {str(result['verified']).lower()})")
    return 0 if result["verified"] else 1


def _print_rows(rows: list[dict]) -> None:
    print(f"\n{'link':<10} {'layer xfer/compute ms':>21} {'measured':>8} {'hidden lw':>9} {'hidden bulk':>11} "
          f"{'TTFT lw':>9} {'TTFT bulk':>9} {'lw/bulk':>7} {'raw GB/s':>8} verified")
    for r in rows:
        x = r["layer_transfer_ms_at_rate"]
        ratio = f"{x:.1f}/{r['layer_compute_ms']:g}" if x is not None else f"-/{r['layer_compute_ms']:g}"
        print(f"{r['label']:<10} {ratio:>21} {r['layer_transfer_ms_measured']!s:>8} "
              f"{r['hidden_fraction_layerwise']!s:>9} {r['hidden_fraction_bulk']!s:>11} {r['ttft_ms_layerwise']!s:>9} "
              f"{r['ttft_ms_bulk']!s:>9} {r['ttft_layerwise_vs_bulk']!s:>7} {r['link_gbps_raw']!s:>8} {r['verified']}")
