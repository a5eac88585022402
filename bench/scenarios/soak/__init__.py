"""``aiolayer bench soak``: many transfers with faults injected; nothing lost, nothing hung, memory flat.

``driver`` holds the ``Soak`` class and defines the outcome classes; ``nodes`` (D node processes and
their faults), ``pipeline`` (allocation, forward, outcomes), ``checks`` (D's verdicts) and ``report``
are its parts; ``common`` the sizes and deadlines they share, ``shape`` the default KV shape."""

from __future__ import annotations


def add_args(p) -> None:
    from ..options import add_decode_ranks, add_out, add_run_args
    from .shape import SOAK_SHAPE

    add_run_args(p, 10000, "transfers in all", **SOAK_SHAPE)
    add_decode_ranks(p)
    p.add_argument("--fault-rate", type=float, default=0.05,
                   help="fraction of transfers that get a fault (kill, freeze, refuse, drop DONE)")
    add_out(p)


def check(args) -> str:
    from ..options import ranks_problem

    if not 0.0 <= args.fault_rate <= 1.0:
        return f"--fault-rate must be within [0, 1], got {args.fault_rate}"
    return ranks_problem(args)


def run(args) -> int:
    from .driver import run_soak
    return run_soak(args)
