"""What the P and D processes share: the model, a started ``aiolayer.Runtime`` with the paged KV cache
registered, and a tiny command loop (one JSON object per line on stdin, one reply per line on stdout).

The command loop is the example's stand-in for whatever an engine already uses between its router
and its workers (HTTP, RPC, ZMQ): aiolayer does not care how D's ``Registration`` reaches P.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Callable

from aiolayer import NodeConfig, Runtime

from .engine import PagedKV, build_model, weights_crc

Handler = Callable[[dict], dict]


def start_engine(engine_id: str):
    """The model, its paged KV cache and a runtime that may read (P) or write (D) that cache."""
    model = build_model()
    paged = PagedKV(model.config)
    rt = Runtime(NodeConfig(engine_id=engine_id)).start()   # Mooncake; MC_* settings from the driver
    try:
        # once, after start(): from now on peers may address these blocks (D) or read them (P)
        rt.register_kv_memory(paged.k_base, paged.v_base, paged.block_bytes, paged.num_blocks)
    except BaseException:
        rt.stop()
        raise
    return model, paged, rt


def ready_line(rt: Runtime, model) -> dict:
    return {"ready": True, "control": rt.control_endpoint, "incarnation": rt.incarnation,
            "weights_crc": weights_crc(model), "pid": os.getpid()}


def serve(rt: Runtime, ready: dict, handlers: dict[str, Handler]) -> int:
    """Answer commands until ``quit`` or the end of stdin (the driver went away); always stops ``rt``."""
    # stdout carries only replies: anything a library prints goes to stderr
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    try:
        _reply(replies, ready)
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd.get("op")
            if op == "quit":
                break
            try:
                reply = handlers[op](cmd)
            except Exception as exc:  # noqa: BLE001 - one bad command is the driver's error, not ours
                traceback.print_exc()
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            _reply(replies, reply)
    finally:
        rt.stop()   # bounded; leaves no socket, task or registered memory behind
    return 0


def _reply(out, obj: dict) -> None:
    out.write(json.dumps(obj) + "\n")
