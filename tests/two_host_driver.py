"""P on one "host" (run inside a network namespace by tests/test_issue13_two_hosts.py): transfers to
a D node on the other host and checks, per transfer, that D holds P's bytes.

Prints a JSON line ``{"ready": ...}`` once its runtime is up (the test may then cut or slow the link),
and at the end ``{"ok": n, "failed": [reasons], "verified": n, "ms": [...], "d_states": {state: n}}``:
``d_states`` counts D's final state of every transfer D registered, polled until each is terminal
(or ``--settle-s`` ran out: those count as "unsettled", a lost transfer).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

import numpy as np

from aiolayer import KVShape, NodeConfig, Runtime, Timeouts, TransferSpec
from aiolayer.kvcache import PagedKVCache
from aiolayer.protocol import messages as m
from aiolayer.transport import Transport

SHAPE = KVShape(num_layers=4, num_blocks=64, block_size=16, kv_heads=2, head_dim=64, dtype="float16")
TERMINAL = ("finished", "failed")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("d_control")
    p.add_argument("bind_host")
    p.add_argument("--transfers", type=int, default=4)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--per-transfer-s", type=float, default=30.0, help="wait for each outcome at most this")
    p.add_argument("--pause-s", type=float, default=0.0, help="between transfers")
    p.add_argument("--settle-s", type=float, default=0.0, help="then wait this long for D to end every transfer")
    return p.parse_args(argv)


def one_transfer(rt: Runtime, cache: PagedKVCache, args, n: int, out: dict) -> str | None:
    """Allocate at D, stream, verify; the transfer id if D may have registered it."""
    src = list(range(n % 8, n % 8 + args.blocks))
    tid = f"two-hosts-{n}"
    start = time.perf_counter()
    try:
        alloc = rt.request(args.d_control, m.AllocRequest(transfer_id=tid, num_blocks=args.blocks,
                                                          sender_control=rt.control_endpoint), timeout=5)
    except Exception as exc:  # noqa: BLE001 - reported: the test decides what it means
        out["failed"].append(f"alloc: {type(exc).__name__}: {exc}")
        return tid   # the request may still reach D once the link is back
    with rt.begin_step([TransferSpec.from_registration(alloc, src_blocks=src, peer=args.d_control)]) as step:
        for layer in range(SHAPE.num_layers):
            step.layer_ready(layer)
    outcome = rt.wait_outcome(tid, args.per_transfer_s)
    out["ms"].append(round((time.perf_counter() - start) * 1e3, 1))
    if not outcome.ok:
        out["failed"].append(outcome.reason)
        return tid
    out["ok"] += 1
    verify = rt.request(args.d_control, m.VerifyRequest(transfer_id=tid), timeout=5)
    out["verified"] += int((verify.crc_k, verify.crc_v) == cache.checksums(src))
    return tid


def d_states(rt: Runtime, d_control: str, tids: list[str], settle_s: float) -> dict:
    """D's final state per transfer, waiting up to ``settle_s`` for each to be terminal."""
    end = time.monotonic() + settle_s
    states: dict[str, str] = {}
    while True:
        for tid in tids:
            if states.get(tid) not in TERMINAL:
                try:
                    states[tid] = rt.request(d_control, m.StatusRequest(transfer_id=tid), timeout=2).state
                except Exception:  # noqa: BLE001 - the link may still be down: ask again
                    states[tid] = "unreachable"
        if all(s in TERMINAL or s == "unknown" for s in states.values()) or time.monotonic() > end:
            break
        time.sleep(0.5)
    return dict(collections.Counter(s if s in (*TERMINAL, "unknown") else "unsettled" for s in states.values()))


def main(argv: list[str]) -> int:
    args = parse(argv)
    node = NodeConfig(engine_id="p-two-hosts", transport=Transport(bind_host=args.bind_host))
    rt = Runtime(node, Timeouts(layer_write=5, done_delivery=5)).start()
    cache = PagedKVCache(SHAPE)
    cache.buffer[:] = np.random.default_rng(1).integers(0, 256, cache.buffer.size, dtype=np.uint8)
    rt.register_kv_memory(cache.k_base, cache.v_base, SHAPE.block_bytes, SHAPE.num_blocks)
    out = {"ok": 0, "failed": [], "verified": 0, "ms": [], "p_endpoint": rt.control_endpoint}
    print(json.dumps({"ready": rt.control_endpoint}), flush=True)
    try:
        tids = []
        for n in range(args.transfers):
            tids.append(one_transfer(rt, cache, args, n, out))
            time.sleep(args.pause_s)
        out["d_states"] = d_states(rt, args.d_control, [t for t in tids if t], args.settle_s)
    finally:
        rt.stop()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
