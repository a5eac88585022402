"""Option checks the scenarios share."""

from __future__ import annotations


def ranks_problem(args) -> str:
    """The checks scale and soak share."""
    if args.requests < 1:
        return f"--requests must be >= 1, got {args.requests}"
    if not 0.0 <= args.fault_rate <= 1.0:
        return f"--fault-rate must be within [0, 1], got {args.fault_rate}"
    if args.decode_ranks < 1:
        return "--prefill-ranks and --decode-ranks must be >= 1"
    return ""
