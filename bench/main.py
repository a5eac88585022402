"""``aiolayer bench``: the command line, one subcommand per benchmark, each with its own options.
``transfer`` (also what a bare ``aiolayer bench`` runs) is the transfer benchmark (``perf/``: P in this
process, D in a child process, the same seeded KV through each mode); ``faults``, ``scale`` and ``soak``
are in ``scenarios/``; ``vllm`` is the real-engine benchmark (``engines/``). See bench/README.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from aiolayer.cli import HELP_FORMAT, Command
from aiolayer.harness.node import MOONCAKE_ENV

from . import scenarios
from .scenarios.options import add_out, add_run_args

TRANSFER_REQUESTS = 7   # --requests by default of the transfer benchmark (measured requests per mode)
DEFAULT = "transfer"    # what ``aiolayer bench`` with no subcommand runs (make bench)
HELPS = {"transfer": "the transfer modes side by side (also --sweep and --two-hosts); the default",
         **{name: s.help for name, s in scenarios.SCENARIOS.items()},
         "vllm": "time to first token on real vLLM CPU engines, each P/D system side by side (make bench-vllm)"}


# argparse's subcommand action is the one hook that runs once the subcommand is known, before its parsing.
class LazySubcommands(argparse._SubParsersAction):  # noqa: SLF001
    """Subcommands whose options are added only to the one being run (or asked for with ``populate``):
    the transfer benchmark's import torch, which ``aiolayer bench --help`` must not."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.populated: set[str] = set()

    def __call__(self, parser, namespace, values, option_string=None):
        self.populate(values[0])
        super().__call__(parser, namespace, values, option_string)

    def populate(self, name: str) -> argparse.ArgumentParser:
        sub = self.choices[name]
        if name in HELPS and name not in self.populated:
            add_subcommand_args(name, sub)
            self.populated.add(name)
        return sub


def add_transfer_args(p: argparse.ArgumentParser) -> None:
    from .perf import run as perf   # here, not at import: it imports torch, which `aiolayer --help` must not

    perf.add_args(p)
    add_run_args(p, TRANSFER_REQUESTS, "measured requests per mode")
    add_out(p)


def add_subcommand_args(name: str, p: argparse.ArgumentParser) -> None:
    if name == "transfer":
        add_transfer_args(p)
    elif name == "vllm":
        from .engines import options
        options.add_args(p)
        add_out(p)
    else:
        scenarios.SCENARIOS[name].add_args(p)


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """The subcommands with their help lines; each one's options come when it runs (``LazySubcommands``)."""
    sub = p.add_subparsers(dest="bench", metavar="BENCHMARK", action=LazySubcommands, required=True,
                           help=f"with none: {DEFAULT}")
    for name, text in HELPS.items():
        sub.add_parser(name, help=text, description=text, formatter_class=HELP_FORMAT)


def bench_argv(words: list[str]) -> list[str]:
    """The words after ``aiolayer bench``: the default subcommand when none is named, and the old spellings
    (``--scenario NAME``, ``--engine vllm`` with ``--engine-*`` options) turned into the new ones."""
    from .deprecated import old_spellings

    words = old_spellings(words, ("transfer", *scenarios.SCENARIOS))
    if words and (words[0] in HELPS or words[0] in ("-h", "--help")):
        return words
    return [DEFAULT, *words]


def _unwind_on_sigterm() -> None:
    """SIGTERM (a ``timeout``, a CI runner) unwinds the bench as Ctrl-C does, so that the engines, proxies
    and network namespaces it started are stopped and deleted by their own clean-up, not left behind."""
    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, interrupt)


def transfer_problem(args: argparse.Namespace) -> str:
    """What is wrong with the transfer benchmark's own numbers ("" if nothing), before any engine starts:
    an endless --layer-ms overflowed a deadline after the harness was up, zero requests "measured" nothing."""
    if args.requests < 1 or args.warmup < 0 or args.prompt_tokens < 1 or args.auto_min_tokens < 0:
        return "--requests and --prompt-tokens must be >= 1, --warmup and --auto-min-tokens >= 0"
    if not 0 <= args.layer_ms <= 60_000:   # NaN fails too
        return f"--layer-ms must be 0 to 60000 (ms of simulated compute per layer), got {args.layer_ms}"
    return ""


def run_bench(args: argparse.Namespace) -> int:
    _unwind_on_sigterm()
    for key, value in MOONCAKE_ENV.items():
        os.environ.setdefault(key, value)
    if args.bench == "vllm":   # real engines: no torch, no simulated forward in this process
        from .engines.link import run_vllm
        return run_vllm(args)
    scenario = scenarios.SCENARIOS.get(args.bench)
    problem = scenario.check(args) if scenario else transfer_problem(args)
    if problem:
        print(f"aiolayer bench {args.bench}: {problem}", file=sys.stderr)
        return 2
    import torch

    from .perf import run as perf

    torch.set_num_threads(1)  # the simulated compute is one thread, on one core (perf/cpus.py)
    if scenario is not None:
        return scenario.run(args)
    return perf.run_transfer(args)


COMMAND = Command("the benchmarks: transfer (the default), faults, scale, soak, vllm", add_bench_args, run_bench,
                  bench_argv)
