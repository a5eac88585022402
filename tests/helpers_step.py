"""Shared by the runtime tests: a memory-backend P with a seeded KV cache, D's state and checksums
asked over its control port, one step of many one-block transfers to one D with every layer ready at once; and a device
event that completes at a set time (what a GPU's does; on CPU every event is ready at once)."""

from __future__ import annotations

import time

import numpy as np

from aiolayer import Timeouts, TransferSpec
from aiolayer.kvcache import PagedKVCache
from aiolayer.protocol import messages as m

from helpers_node import SMALL_SHAPE

CACHES: list[PagedKVCache] = []   # alive as long as the runtimes that registered them


def memory_p(memory_runtime, name: str, timeouts: Timeouts, seed: int):
    p = memory_runtime(name, timeouts)
    cache = PagedKVCache(SMALL_SHAPE)
    CACHES.append(cache)
    cache.buffer[:] = np.random.default_rng(seed).integers(1, 256, cache.buffer.size, dtype=np.uint8)
    p.register_kv_memory(cache.k_base, cache.v_base, SMALL_SHAPE.block_bytes, SMALL_SHAPE.num_blocks)
    return p


def one_step(p, d_control: str, count: int, drop: frozenset[str] = frozenset()) -> dict:
    """``count`` one-block transfers in one step, every layer ready at once; their outcomes by id.
    ``drop``: transfers whose DONE D drops (fault injection)."""
    specs = []
    for i in range(count):
        tid = f"t{i}"
        rep = p.request(d_control, m.AllocRequest(transfer_id=tid, num_blocks=1, drop_done=tid in drop), timeout=5)
        specs.append(TransferSpec.from_registration(rep, src_blocks=[i], peer=d_control))
    p.sender.begin_step(1, specs)
    for layer in range(SMALL_SHAPE.num_layers):
        p.sender.layer_ready(1, layer)
    p.sender.end_step(1)
    return {s.transfer_id: p.sender.wait(s.transfer_id, 10) for s in specs}


def d_state(p, d_control: str, tid: str) -> str:
    """D's state for ``tid``, asked over its control port by the runtime ``p``."""
    return p.request(d_control, m.StatusRequest(transfer_id=tid), timeout=5).state


def d_crcs(p, d_control: str, tid: str) -> tuple:
    """D's per-layer checksums of ``tid``'s blocks (K, V): they change when any write lands."""
    reply = p.request(d_control, m.VerifyRequest(transfer_id=tid), timeout=5)
    return reply.crc_k, reply.crc_v


class TimedEvent:
    """A device event that completes ``delay`` seconds after it was recorded; never, when None."""

    def __init__(self, delay: float | None) -> None:
        self.ready_at = None if delay is None else time.monotonic() + delay

    def query(self) -> bool:
        return self.ready_at is not None and time.monotonic() >= self.ready_at
