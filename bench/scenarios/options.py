"""Options and option checks the benchmarks share."""

from __future__ import annotations

import argparse

from aiolayer.harness.node import add_shape_args


def add_out(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bench/results", help="directory for the JSON, CSV and PNG files it writes")


def add_run_args(p: argparse.ArgumentParser, requests: int, requests_help: str, **shape) -> None:
    """--requests, the KV shape flags (defaults: KVShape's, or ``shape``'s) and --seed."""
    p.add_argument("--requests", type=int, default=requests, help=requests_help)
    add_shape_args(p, skip=("num_blocks", "layout"), **shape)
    p.add_argument("--seed", type=int, default=1234, help="seed of the KV bytes written (each request salts it)")


def add_decode_ranks(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decode-ranks", type=int, default=4, help="D rank (node) processes")


def ranks_problem(args) -> str:
    """The checks scale and soak share."""
    if args.requests < 1:
        return f"--requests must be >= 1, got {args.requests}"
    if args.decode_ranks < 1:
        return "--prefill-ranks and --decode-ranks must be >= 1"
    return ""
