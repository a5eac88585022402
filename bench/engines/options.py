"""The options of ``aiolayer bench vllm`` (``run.py``) and the one engine recipe every row uses;
importable without vLLM, so ``aiolayer bench vllm --help`` shows them on any install."""

from __future__ import annotations

import argparse
from pathlib import Path

ROWS = ("aggregated", "aiolayer", "aiolayer-d-first", "aiolayer-bulk", "mooncake", "nixl")   # the default --rows
MORE_ROWS = ("aiolayer-auto",)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from {', '.join(ROWS + MORE_ROWS)}")
    p.add_argument("--layers", type=int, default=16, help="layers of the offline model built for the run")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads (of 64 dims; as many query heads) of the model")
    p.add_argument("--prompt-tokens", type=int, default=2000, help="tokens per prompt (about)")
    p.add_argument("--prompts", type=int, default=6,
                   help="measured requests at concurrency 1 per row (--link-gbit: per cell, up to 4x that below "
                        "1,024 tokens)")
    p.add_argument("--concurrency", type=int, default=8, help="requests of the concurrent burst per row")
    p.add_argument("--max-tokens", type=int, default=20, help="output tokens per request")
    p.add_argument("--cores", default="0,1", help="P's core, D's core (the aggregated engine: P's)")
    p.add_argument("--pin", choices=["process", "omp"], default="process",
                   help="how an engine keeps to its --cores core: process = every process and thread of the "
                        "engine (a CPU mask, as on a host of its own), omp = its OpenMP threads only "
                        "(VLLM_CPU_OMP_THREADS_BIND; its other processes and threads run on any core); "
                        "--cores auto,auto: vLLM's default binding, neither")
    p.add_argument("--together", action="store_true",
                   help="every row's engines up at once (P's and the aggregated engine on the first of --cores, "
                        "D's on the second; memory for all of them) and their concurrency-1 requests taken in "
                        "rounds, so that rows see the same moments of a host whose speed drifts (together.py)")
    p.add_argument("--together-pause", type=float, default=1.1,
                   help="--together: seconds between requests (vLLM's readers spin for 1 s after a message, on "
                        "the core the next engine computes on)")
    g = p.add_argument_group("across a rate-limited link (root: network namespaces; link.py)")
    g.add_argument("--link-gbit", default="",
                   help="P and D on two network namespaces joined by a veth pair shaped with tbf; one sweep over "
                        "these rates in Gbit/s (comma-separated, 0 = unshaped) x --prompt-lengths; writes "
                        "engines_link.json and engines_link.png. Default: one run on loopback")
    g.add_argument("--prompt-lengths", default="",
                   help="--link-gbit: prompt lengths in tokens (about), comma-separated; default --prompt-tokens")
    g.add_argument("--separate-engines", action="store_true",
                   help="--link-gbit: start engines per aiolayer row (default: aiolayer's mode rows share one pair, "
                        "each request naming its mode, their requests alternating)")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="every engine's --dtype (auto: vLLM's default, bf16 on CPU); float32 doubles the KV per "
                        "token for about the same prefill, so the link weighs more")
    p.add_argument("--integrity-sample", type=float, default=1.0,
                   help="aiolayer's rows: P's integrity_sample (1.0: D verifies every byte of every transfer before "
                        "DONE, so a drifting answer with all bytes verified counts as numerics; lower rates leave "
                        "transfers unverified, and the run then fails on any drift)")
    p.add_argument("--eager", action="store_true",
                   help="--enforce-eager on every engine (vLLM's default compiles: ~40 s more per start)")


def engine(model: Path, name: str, core: str, args: argparse.Namespace, **kw):
    """A vLLM server of the run: pinned to ``core``, vLLM's defaults otherwise (``--eager`` aside)."""
    from aiolayer.harness.vllm_server import VllmServer

    cpus = frozenset(int(c) for c in core.split("|")) if args.pin == "process" and core[:1].isdigit() else None
    dtype = None if getattr(args, "dtype", "auto") == "auto" else args.dtype
    return VllmServer(model, name=name, omp_bind=core, cpus=cpus, enforce_eager=args.eager, kv_cache_gib=2, dtype=dtype,
                      startup_timeout_s=400, **kw)
