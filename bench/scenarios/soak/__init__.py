"""``--scenario soak``: many transfers with faults injected; nothing lost, nothing hung, memory flat.

``driver`` holds the ``Soak`` class and defines the outcome classes; ``nodes`` (D node processes and
their faults), ``pipeline`` (allocation, forward, outcomes), ``checks`` (D's verdicts) and ``report``
are its parts; ``common`` the sizes and deadlines they share."""

from __future__ import annotations


def add_args(g) -> None:
    g.add_argument("--fault-rate", type=float, default=0.05,
                   help="soak: fraction of transfers that get a fault (kill, freeze, refuse, drop DONE)")


def check(args) -> str:
    from ..options import ranks_problem
    return ranks_problem(args)


def run(args) -> int:
    from .driver import run_soak
    return run_soak(args)
