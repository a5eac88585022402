"""``aiolayer bench soak``: many transfers with faults injected; nothing lost, nothing hung, memory flat.

``driver`` holds the ``Soak`` class and defines the outcome classes; ``nodes`` (D node processes and
their faults), ``pipeline`` (allocation, forward, outcomes), ``checks`` (D's verdicts) and ``report``
are its parts; ``common`` the sizes and deadlines they share."""

from __future__ import annotations

from typing import Any

# A small model by default: the soak is about many transfers and faults, not bytes (4 KiB blocks).
SOAK_SHAPE: dict[str, Any] = dict(num_layers=4, block_size=16, kv_heads=2, head_dim=64, dtype="float16")


def add_args(p) -> None:
    from ..options import add_decode_ranks, add_out, add_run_args

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
