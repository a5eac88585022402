"""``aiolayer bench``: the command line. ``--scenario transfer`` (the default) is the transfer benchmark
(``perf/``: P in this process, D in a child process, the same seeded KV through each mode); the others
are in ``scenarios/`` (faults, scale, soak). See bench/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys

from aiolayer.cli import Command

from . import scenarios
from .node import MOONCAKE_ENV, add_shape_args

TRANSFER_REQUESTS = 7   # --requests by default of the transfer benchmark (measured requests per mode)


def add_bench_args(p: argparse.ArgumentParser) -> None:
    from .perf import run as perf   # here, not at import: it imports torch, which `aiolayer --help` must not

    perf.add_args(p)
    p.add_argument("--requests", type=int, default=None,
                   help="measured requests per mode (transfer, default 7); transfers in all (scale: 1000, soak: 10000)")
    add_shape_args(p, skip=("num_blocks", "layout"))
    p.add_argument("--seed", type=int, default=1234, help="seed of the KV bytes written (each request salts it)")
    p.add_argument("--out", default="bench/results", help="directory for latest.json, the CSV and the PNGs")
    p.add_argument("--scenario", default="transfer", choices=["transfer", *scenarios.SCENARIOS],
                   help="transfer: the modes side by side; "
                        + "; ".join(f"{name}: {s.help}" for name, s in scenarios.SCENARIOS.items()))
    scenarios.add_args(p)
    from .engines import options
    options.add_args(p)


def run_bench(args: argparse.Namespace) -> int:
    for key, value in MOONCAKE_ENV.items():
        os.environ.setdefault(key, value)
    if args.engine == "vllm":   # real engines: no torch, no simulated forward in this process
        from .engines.run import run_engines
        return run_engines(args)
    scenario = scenarios.SCENARIOS.get(args.scenario)
    if args.requests is None:
        args.requests = scenario.requests if scenario else TRANSFER_REQUESTS
    problem = scenario.check(args) if scenario else ""
    if problem:
        print(f"aiolayer bench: {problem}", file=sys.stderr)
        return 2
    import torch

    from .perf import run as perf

    torch.set_num_threads(1)  # the simulated compute is one thread, on one core (perf/cpus.py)
    if scenario is not None:
        return scenario.run(args)
    return perf.run_transfer(args)


COMMAND = Command("the layer-wise transfer benchmark", add_bench_args, run_bench)
