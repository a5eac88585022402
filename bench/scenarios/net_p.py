"""P for the network fault rows, run inside namespace A (``python -m aiolayer.bench.scenarios.net_p``).

It transfers to a D node on the other "host" one transfer at a time and checks each verified one
against P's bytes. Prints ``{"ready": endpoint}`` once its runtime is up (the driver may then cut or
slow the link) and at the end one JSON line: per transfer its wall-clock start and end (the driver
compares them with the time of the fault), outcome and reason, and ``d_states``, D's final state of
every transfer, polled until each is terminal or ``--settle-s`` ran out (then "unsettled": lost).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import numpy as np

from aiolayer import KVShape, NodeConfig, Runtime, Timeouts, TransferSpec
from aiolayer.errors import AiolayerError, DeadlineExceeded
from aiolayer.kvcache import PagedKVCache
from aiolayer.protocol import messages as m
from aiolayer.transport import Transport

SHAPE = KVShape(num_layers=4, num_blocks=64, block_size=16, kv_heads=2, head_dim=64, dtype="float16")
TERMINAL = ("finished", "failed")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="net_p")
    p.add_argument("d_control", help="D's control endpoint")
    p.add_argument("bind_host", help="this host's address")
    p.add_argument("--transfers", type=int, default=4)
    p.add_argument("--blocks", type=int, default=8, help="blocks per transfer (4 KiB of K and of V per layer)")
    p.add_argument("--control-s", type=float, default=5.0, help="deadline of each control call")
    p.add_argument("--layer-write", type=float, default=5.0, help="Timeouts.layer_write")
    p.add_argument("--done-delivery", type=float, default=5.0, help="Timeouts.done_delivery")
    p.add_argument("--per-transfer-s", type=float, default=30.0, help="wait for each outcome at most this")
    p.add_argument("--pause-s", type=float, default=0.0, help="between transfers")
    p.add_argument("--verify-s", type=float, default=30.0, help="ask D to verify a finished transfer until this")
    p.add_argument("--settle-s", type=float, default=0.0, help="then wait this long for D to end every transfer")
    p.add_argument("--status-at", default="", help="ask this D for the final states (default: d_control)")
    p.add_argument("--hold-at", type=int, default=-1,
                   help="in this transfer, after layer 0, print {\"held\": tid} and wait for --resume-file")
    p.add_argument("--resume-file", default="", help="the file whose creation resumes a held transfer")
    return p.parse_args(argv)


def one_transfer(rt: Runtime, cache: PagedKVCache, args, n: int) -> dict:
    """Allocate at D, stream, verify: the transfer's record."""
    src = list(range(n % 8, n % 8 + args.blocks))
    rec = {"tid": f"net-{n}", "start": time.time(), "ok": False, "verified": False, "lost": False, "reason": ""}
    try:
        alloc = rt.request(args.d_control, m.AllocRequest(transfer_id=rec["tid"], num_blocks=args.blocks,
                                                          sender_control=rt.control_endpoint), timeout=args.control_s)
    except AiolayerError as exc:
        rec.update(end=time.time(), reason=f"alloc: {type(exc).__name__}: {exc}")
        return rec
    with rt.begin_step([TransferSpec.from_registration(alloc, src_blocks=src, peer=args.d_control)]) as step:
        for layer in range(SHAPE.num_layers):
            if layer == 1 and n == args.hold_at:
                hold(rec["tid"], args.resume_file)
            step.layer_ready(layer)
    try:
        outcome = rt.wait_outcome(rec["tid"], args.per_transfer_s)
    except DeadlineExceeded:
        rec.update(end=time.time(), lost=True, reason=f"no outcome within {args.per_transfer_s:g} s")
        return rec
    rec.update(end=time.time(), ok=outcome.ok, reason=outcome.reason)
    if outcome.ok:
        verify_and_release(rt, cache, args, rec, src)
    return rec


def hold(tid: str, resume_file: str, limit_s: float = 60.0) -> None:
    """Stop mid-transfer until the driver has cut the link, so the cut lands on a transfer in flight
    (a cut timed by the clock may land between transfers, where a retried verify rides it out)."""
    print(json.dumps({"held": tid}), flush=True)
    end = time.monotonic() + limit_s
    while not os.path.exists(resume_file):
        if time.monotonic() > end:
            raise SystemExit(f"net_p: {resume_file} not created within {limit_s:g} s")
        time.sleep(0.02)


def verify_and_release(rt: Runtime, cache: PagedKVCache, args, rec: dict, src: list[int]) -> None:
    """Compare D's checksums with P's bytes. D keeps a finished transfer until it is released, so a
    verify cut off by the fault itself (the link went down right after the outcome) is asked again,
    until ``--verify-s``: an unreachable D is not a mismatch, and must not be counted as one."""
    end = time.monotonic() + args.verify_s
    while True:
        try:
            verify = rt.request(args.d_control, m.VerifyRequest(transfer_id=rec["tid"]), timeout=args.control_s)
            rec["verified"] = (verify.crc_k, verify.crc_v) == cache.checksums(src)
            rt.request(args.d_control, m.ReleaseRequest(transfer_id=rec["tid"]), timeout=args.control_s)
            return
        except AiolayerError as exc:
            rec["reason"] = f"verify: {type(exc).__name__}: {exc}"
            if time.monotonic() > end:
                return
            time.sleep(0.5)


def d_states(rt: Runtime, control: str, tids: list[str], settle_s: float) -> dict:
    """D's final state per transfer, waiting up to ``settle_s`` for each to be terminal."""
    end = time.monotonic() + settle_s
    states: dict[str, str] = {}
    while True:
        for tid in tids:
            if states.get(tid) not in TERMINAL:
                try:
                    states[tid] = rt.request(control, m.StatusRequest(transfer_id=tid), timeout=2).state
                except AiolayerError:   # the link may still be down: ask again
                    states[tid] = "unreachable"
        if all(s in TERMINAL or s == "unknown" for s in states.values()) or time.monotonic() > end:
            break
        time.sleep(0.5)
    return dict(collections.Counter(s if s in (*TERMINAL, "unknown") else "unsettled" for s in states.values()))


def main(argv: list[str]) -> int:
    args = parse(argv)
    timeouts = Timeouts(layer_write=args.layer_write, done_delivery=args.done_delivery)
    rt = Runtime(NodeConfig(engine_id="p-net-faults", transport=Transport(bind_host=args.bind_host)), timeouts).start()
    cache = PagedKVCache(SHAPE)
    cache.buffer[:] = np.random.default_rng(1).integers(0, 256, cache.buffer.size, dtype=np.uint8)
    rt.register_kv_memory(cache.k_base, cache.v_base, SHAPE.block_bytes, SHAPE.num_blocks)
    out = {"transfers": [], "p_endpoint": rt.control_endpoint}
    print(json.dumps({"ready": rt.control_endpoint}), flush=True)
    try:
        for n in range(args.transfers):
            out["transfers"].append(one_transfer(rt, cache, args, n))
            time.sleep(args.pause_s)
        out["d_states"] = d_states(rt, args.status_at or args.d_control,
                                   [r["tid"] for r in out["transfers"]], args.settle_s)
    finally:
        rt.stop()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
