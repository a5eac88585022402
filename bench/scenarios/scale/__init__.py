"""``aiolayer bench scale``: many concurrent transfers between P and D tensor-parallel rank processes.

``model`` is the data every process shares (config, plan items, the global seeded KV), ``rank`` the
P rank child process, ``driver`` this process (D nodes, P ranks, the proxy's role, verification)."""

from __future__ import annotations


def add_args(p) -> None:
    from ..options import add_decode_ranks, add_out, add_run_args

    add_run_args(p, 1000, "transfers in all")
    p.add_argument("--prefill-ranks", type=int, default=2, help="P tensor-parallel rank processes")
    add_decode_ranks(p)
    p.add_argument("--kv-layout", default="HND", choices=["HND", "NHD"],
                   help="block layout; NHD splits each head slice into one write per token")
    p.add_argument("--scatter", action="store_true", help="D allocates non-contiguous blocks")
    p.add_argument("--against-whole-blocks", action="store_true",
                   help="when P and D TP differ, run the same requests again with D TP = P TP (whole blocks) "
                        "and report the head slices' loop CPU per GB over whole blocks'")
    p.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                   help="P ranks keep their start-up heap in the garbage collector's passes (by default they "
                        "freeze it once ready, as vLLM's engine core and GPU workers do after warm-up)")
    add_out(p)


def check(args) -> str:
    from ..options import ranks_problem
    from aiolayer.protocol.plan import map_ranks

    problem = ranks_problem(args)
    if problem:
        return problem
    if args.prefill_ranks < 1:
        return "--prefill-ranks and --decode-ranks must be >= 1"
    try:
        map_ranks(args.kv_heads, args.prefill_ranks, args.decode_ranks)
    except ValueError as exc:
        return f"--kv-heads {args.kv_heads} with {args.prefill_ranks} P and {args.decode_ranks} D ranks: {exc}"
    return ""


def run(args) -> int:
    from .driver import run_scale
    return run_scale(args)
