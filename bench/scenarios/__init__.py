"""The bench's scenarios beside the transfer benchmark: name -> ``Scenario`` (its options, a check of them,
its run). ``aiolayer bench --scenario NAME`` picks one; each module is imported only when it runs."""

from __future__ import annotations

import argparse
from typing import Callable, NamedTuple

from . import scale, soak


class Scenario(NamedTuple):
    help: str
    requests: int                                        # --requests when not given
    add_args: Callable[[argparse._ArgumentGroup], None]  # its own options, into the "scale and soak" group
    check: Callable[[argparse.Namespace], str]           # what is wrong with the options ("" when nothing)
    run: Callable[[argparse.Namespace], int]             # the exit status


def _no_args(g) -> None:
    pass


def _no_problem(args) -> str:
    return ""


def _run_faults(args) -> int:
    from .faults import run_faults
    return run_faults(args)


SCENARIOS: dict[str, Scenario] = {
    "faults": Scenario("peer faults against real processes", 0, _no_args, _no_problem, _run_faults),
    "scale": Scenario("concurrent transfers between P and D rank processes (TP mapping)", 1000,
                      scale.add_args, scale.check, scale.run),
    "soak": Scenario("many transfers with faults injected, memory and latency over time", 10000,
                     soak.add_args, soak.check, soak.run),
}


def add_args(p: argparse.ArgumentParser) -> None:
    """Every scenario's options; ``--decode-ranks`` is shared by scale and soak."""
    g = p.add_argument_group("scale and soak")
    g.add_argument("--decode-ranks", type=int, default=4, help="scale and soak: D rank (node) processes")
    for scenario in SCENARIOS.values():
        scenario.add_args(g)
