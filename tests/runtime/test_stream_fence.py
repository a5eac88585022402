"""P's fence around writes started with no task (``start_write``, Mooncake's): however the stream of a
transfer ends, a bug or a device event's ``query`` raising included, its source is not released and
D is not told FAILED while such a write may still land; and a write that outlives its deadline (and
the stream's wait for it) fails the transfer: never a DONE while it may still be in flight.

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
from aiolayer.runtime.send import sender as sender_module
from aiolayer.runtime.send.events import READY

from helpers_node import SMALL_SHAPE
from helpers_step import d_state
from test_regressions_sender import released_within

pytestmark = pytest.mark.timeout(60)
LAND_S = 1.0


class StartWriteMemory(MemoryBackend):
    """The memory backend with ``start_write``: the write starts now; its future settles as ``write``.
    ``overrun_s``: the backend keeps its writes' deadline that much too late (a stuck poller)."""

    overrun_s = 0.0

    def start_write(self, target: str, src, dst, lengths, timeout: float) -> asyncio.Future:
        return asyncio.ensure_future(self.write(target, src, dst, lengths, timeout + self.overrun_s))


class BrokenEvent:
    """A device event that is not ready when first asked, then raises (a lost device, a bug)."""

    def __init__(self) -> None:
        self.asked = 0

    def query(self) -> bool:
        self.asked += 1
        if self.asked > 1:
            raise RuntimeError("device event query failed")
        return False


def _state_within(p: Runtime, d_control: str, tid: str, want: str, limit: float) -> str:
    end = time.monotonic() + limit
    state = d_state(p, d_control, tid)
    while state != want and time.monotonic() < end:
        time.sleep(0.02)
        state = d_state(p, d_control, tid)
    return state


def _p(name: str, timeouts: Timeouts, backend: MemoryBackend) -> tuple[Runtime, PagedKVCache]:
    p = Runtime(NodeConfig(engine_id=name, backend="memory"), timeouts, backend=backend).start()
    cache = PagedKVCache(SMALL_SHAPE)
    cache.buffer[:] = np.random.default_rng(21).integers(1, 256, cache.buffer.size, dtype=np.uint8)
    p.register_kv_memory(cache.k_base, cache.v_base, SMALL_SHAPE.block_bytes, SMALL_SHAPE.num_blocks)
    return p, cache


def _step(p: Runtime, d_control: str, tid: str) -> float:
    rep = p.request(d_control, m.AllocRequest(transfer_id=tid, num_blocks=1), timeout=5)
    p.sender.begin_step(1, [TransferSpec.from_registration(rep, src_blocks=[3], peer=d_control)])
    began = time.perf_counter()
    for layer in range(SMALL_SHAPE.num_layers):
        p.sender.layer_ready(1, layer)
    p.sender.end_step(1)
    return began


def test_an_event_that_raises_keeps_the_source_until_the_started_write_landed(memory_decode_node, monkeypatch):
    d = memory_decode_node(SMALL_SHAPE, "d-sfence", Timeouts())
    p, cache = _p("p-sfence", Timeouts(), StartWriteMemory())
    try:
        # layer 0 is ready: it is written (started) before P waits for layer 1, whose event raises
        events = iter([READY, BrokenEvent()] + [READY] * (SMALL_SHAPE.num_layers - 2))
        monkeypatch.setattr(sender_module, "record_event", lambda: next(events))
        d.runtime.backend.faults.delay_s = LAND_S
        t0 = _step(p, d.control_endpoint, "sf")
        early = released_within(p, "sf", LAND_S / 2)
        assert early is None, f"source released {early - t0:.2f}s in, the write lands at {LAND_S}s"
        assert d_state(p, d.control_endpoint, "sf") == "registered", "D told FAILED before the write landed"
        outcome = p.sender.wait("sf", 5)
        assert not outcome.ok and "device event query failed" in outcome.reason, outcome.reason
        released = released_within(p, "sf", 5)
        assert released is not None and released - t0 >= LAND_S * 0.9, "source released before the write landed"
        assert _state_within(p, d.control_endpoint, "sf", "failed", 5) == "failed"   # told once quiet
        verify = p.request(d.control_endpoint, m.VerifyRequest(transfer_id="sf"), timeout=5)
        assert verify.crc_k[0] == checksums(cache.blocks, [3])[0][0]   # layer 0 did land at D
    finally:
        p.stop()


def test_a_started_write_past_its_deadline_fails_the_transfer_and_holds_the_source(memory_decode_node):
    """The backend settles its writes 1 s past their deadline: the stream stops waiting after
    ``layer_write`` + ``cleanup`` and fails the transfer (no DONE for bytes not known to have landed);
    the source stays held, and D hears FAILED, only once the writes ended."""
    d = memory_decode_node(SMALL_SHAPE, "d-overrun", Timeouts())
    backend = StartWriteMemory()
    backend.overrun_s = LAND_S
    p, _ = _p("p-overrun", Timeouts(layer_write=0.2, cleanup=0.2), backend)
    try:
        d.runtime.backend.faults.delay_s = LAND_S   # lands 1 s after its start: 0.8 s past its deadline
        t0 = _step(p, d.control_endpoint, "ov")
        outcome = p.sender.wait("ov", 5)
        assert not outcome.ok and "unresolved" in outcome.reason, outcome.reason
        assert not outcome.source_released and p.sender.deadlines["layer_write"] >= 1
        assert d_state(p, d.control_endpoint, "ov") == "registered"   # no DONE, and no FAILED yet
        released = released_within(p, "ov", 5)
        assert released is not None and released - t0 >= LAND_S * 0.9, "source released before the writes ended"
        assert _state_within(p, d.control_endpoint, "ov", "failed", 5) == "failed"
    finally:
        p.stop()
