"""P -> D over the memory backend in one process: the calls the runtime's in-process tests share."""

from __future__ import annotations

import time

import numpy as np

from aiolayer import KVShape, Runtime, TransferSpec
from aiolayer.kvcache import PagedKVCache, checksums
from aiolayer.protocol import messages as m


def host_cache(rt: Runtime, shape: KVShape, seed: int | None, **register) -> PagedKVCache:
    """A paged cache in host memory registered with ``rt``; filled from ``seed`` (P), or zeros (D)."""
    cache = PagedKVCache(shape)
    if seed is not None:
        cache.buffer[:] = np.random.default_rng(seed).integers(0, 256, cache.buffer.size, dtype=np.uint8)
    rt.register_kv_memory(cache.k_base, cache.v_base, shape.block_bytes, shape.num_blocks, **register)
    return cache


def alloc(p, d, tid: str, n: int, contiguous: bool) -> m.AllocReply:
    reply = p.request(d.control_endpoint, m.AllocRequest(transfer_id=tid, num_blocks=n, contiguous=contiguous))
    assert isinstance(reply, m.AllocReply) and reply.transfer_id == tid and len(reply.block_ids) == n
    return reply


def spec(d, tid: str, src: list[int], rep: m.AllocReply) -> TransferSpec:
    return TransferSpec.from_registration(rep, src_blocks=src, peer=d.control_endpoint)


def run_step(p, step: int, specs: list[TransferSpec], layers: int) -> None:
    p.sender.begin_step(step, specs)
    for layer in range(layers):
        p.sender.layer_ready(step, layer)
    p.sender.end_step(step)


def verify(p, d, pc, tid: str, src: list[int]) -> m.VerifyReply:
    v = p.request(d.control_endpoint, m.VerifyRequest(transfer_id=tid), timeout=10)
    assert isinstance(v, m.VerifyReply)
    ck, cv = checksums(pc.blocks, src)
    assert v.crc_k == ck and v.crc_v == cv, f"{tid}: KV at D differs from P's source blocks"
    return v


def status(p, d, tid: str) -> m.StatusReply:
    return p.request(d.control_endpoint, m.StatusRequest(transfer_id=tid))


def status_when(p, d, tid: str, want: str, limit: float = 5.0) -> m.StatusReply:
    """P publishes a failure at once and tells D right after: poll D, bounded."""
    deadline = time.monotonic() + limit
    st = status(p, d, tid)
    while st.state != want and time.monotonic() < deadline:
        time.sleep(0.01)
        st = status(p, d, tid)
    return st


def status_via(d, tid: str) -> str:
    async def get():
        return d.runtime.receiver.state_of(tid)[0]
    return d.runtime.loop_thread.call(get(), timeout=2)
