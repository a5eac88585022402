"""P's fence around writes started with no task (``start_write``, Mooncake's): however the stream of a
transfer ends, a bug or a device event's ``query`` raising included, its source is not released and
D is not told FAILED while such a write may still land.

The memory backend has no ``start_write``; ``StartWriteMemory`` gives it one (the future of its
``write``), and D's ``faults.delay_s`` makes every write land that long after it started.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from aiolayer import NodeConfig, Runtime, Timeouts, TransferSpec
from aiolayer.backends.memory import MemoryBackend
from aiolayer.kvcache import PagedKVCache, checksums
from aiolayer.protocol import messages as m
from aiolayer.runtime import sender as sender_module
from aiolayer.runtime.events import READY

from helpers_node import SMALL_SHAPE
from helpers_step import d_state

pytestmark = pytest.mark.timeout(60)
LAND_S = 1.0


class StartWriteMemory(MemoryBackend):
    """The memory backend with ``start_write``: the write starts now; its future settles as ``write``."""

    def start_write(self, target: str, src, dst, lengths, timeout: float) -> asyncio.Future:
        return asyncio.ensure_future(self.write(target, src, dst, lengths, timeout))


class BrokenEvent:
    """A device event that is not ready when first asked, then raises (a lost device, a bug)."""

    def __init__(self) -> None:
        self.asked = 0

    def query(self) -> bool:
        self.asked += 1
        if self.asked > 1:
            raise RuntimeError("device event query failed")
        return False


def _released_at(p: Runtime, tid: str, limit: float) -> float | None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if tid in p.sender.pop_released():
            return time.perf_counter()
        time.sleep(0.01)
    return None


def _state_within(p: Runtime, d_control: str, tid: str, want: str, limit: float) -> str:
    end = time.monotonic() + limit
    state = d_state(p, d_control, tid)
    while state != want and time.monotonic() < end:
        time.sleep(0.02)
        state = d_state(p, d_control, tid)
    return state


def test_an_event_that_raises_keeps_the_source_until_the_started_write_landed(memory_decode_node, monkeypatch):
    d = memory_decode_node(SMALL_SHAPE, "d-sfence", Timeouts())
    p = Runtime(NodeConfig(engine_id="p-sfence", backend="memory"), Timeouts(), backend=StartWriteMemory())
    p.start()
    try:
        cache = PagedKVCache(SMALL_SHAPE)
        cache.buffer[:] = np.random.default_rng(21).integers(1, 256, cache.buffer.size, dtype=np.uint8)
        p.register_kv_memory(cache.k_base, cache.v_base, SMALL_SHAPE.block_bytes, SMALL_SHAPE.num_blocks)
        rep = p.request(d.control_endpoint, m.AllocRequest(transfer_id="sf", num_blocks=1), timeout=5)
        spec = TransferSpec.from_registration(rep, src_blocks=[3], peer=d.control_endpoint)
        # layer 0 is ready: it is written (started) before P waits for layer 1, whose event raises
        events = iter([READY, BrokenEvent()] + [READY] * (SMALL_SHAPE.num_layers - 2))
        monkeypatch.setattr(sender_module, "record_event", lambda: next(events))
        d.runtime.backend.faults.delay_s = LAND_S
        t0 = time.perf_counter()
        p.sender.begin_step(1, [spec])
        for layer in range(SMALL_SHAPE.num_layers):
            p.sender.layer_ready(1, layer)
        p.sender.end_step(1)

        early = _released_at(p, "sf", LAND_S / 2)
        assert early is None, f"source released {early - t0:.2f}s in, the write lands at {LAND_S}s"
        assert d_state(p, d.control_endpoint, "sf") == "registered", "D told FAILED before the write landed"
        outcome = p.sender.wait("sf", 5)
        assert not outcome.ok and "device event query failed" in outcome.reason, outcome.reason
        released = _released_at(p, "sf", 5)
        assert released is not None and released - t0 >= LAND_S * 0.9, "source released before the write landed"
        assert _state_within(p, d.control_endpoint, "sf", "failed", 5) == "failed"   # told once quiet
        verify = p.request(d.control_endpoint, m.VerifyRequest(transfer_id="sf"), timeout=5)
        assert verify.crc_k[0] == checksums(cache.blocks, [3])[0][0]   # layer 0 did land at D
    finally:
        p.stop()
