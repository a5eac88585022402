"""The bench's scenarios beside the transfer benchmark: name -> ``Scenario`` (its options, a check of them,
its run). ``aiolayer bench NAME`` runs one; each module is imported only when it runs."""

from __future__ import annotations

import argparse
from typing import Callable, NamedTuple

from . import scale, soak


class Scenario(NamedTuple):
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]  # every option of its subcommand
    check: Callable[[argparse.Namespace], str]           # what is wrong with the options ("" when nothing)
    run: Callable[[argparse.Namespace], int]             # the exit status


def _faults_args(p: argparse.ArgumentParser) -> None:
    from .options import add_out
    add_out(p)   # the faults have their own shape and deadlines (faults.py)


def _no_problem(args) -> str:
    return ""


def _run_faults(args) -> int:
    from .faults import run_faults
    return run_faults(args)


SCENARIOS: dict[str, Scenario] = {
    "faults": Scenario("each peer and network fault against real processes", _faults_args, _no_problem,
                       _run_faults),
    "scale": Scenario("concurrent transfers between P and D rank processes (TP mapping)",
                      scale.add_args, scale.check, scale.run),
    "soak": Scenario("many transfers with faults injected, memory and latency over time",
                     soak.add_args, soak.check, soak.run),
}

