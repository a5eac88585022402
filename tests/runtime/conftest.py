"""Fixtures of the runtime's tests: a started loop thread, a P/D pair over the memory backend."""

from __future__ import annotations

import numpy as np
import pytest

from aiolayer.kvcache import PagedKVCache
from aiolayer.runtime.loop import LoopThread


@pytest.fixture
def loop_thread():
    lt = LoopThread(name="aiolayer-test-loop")
    lt.start()
    yield lt
    lt.stop(timeout=5)
    assert not lt.alive


@pytest.fixture
def pd(memory_runtime, memory_decode_node, small_shape):
    """A started D node, a started P runtime and P's filled KV cache (published as P's layout)."""
    d = memory_decode_node(small_shape, engine_id="d")
    p = memory_runtime("p")
    pc = PagedKVCache(small_shape)
    pc.buffer[:] = np.random.default_rng(0).integers(0, 256, pc.buffer.size, dtype=np.uint8)
    p.register_kv_memory(pc.k_base, pc.v_base, small_shape.block_bytes, small_shape.num_blocks)
    return p, d, pc
