"""A simulated prefill forward pass on its own thread: real torch work per layer, then the KV write.

Per layer it runs small matmuls until ``layer_ms`` has passed (calibrated by the clock, so the
compute time per layer is what was asked whatever the CPU), writes that layer's K and V into P's
paged cache with ``index_copy_`` (as an engine's reshape-and-cache does), then hands the layer to
aiolayer (``layer_ready``), timing that hand-off in nanoseconds. ``handoff="after"`` hands every
layer over only once the whole forward is done: the bulk (whole-request) transfer.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from aiolayer.kvcache import PagedKVCache


class RequestKV:
    """Seeded KV bytes of one request: [layers, 2, n_blocks, block_bytes], distinct per request."""

    def __init__(self, base: np.ndarray, request_index: int) -> None:
        words = base.view(np.uint64)
        salt = np.uint64((request_index + 1) * 0x9E3779B97F4A7C15 % (1 << 64))
        self.data = (words ^ salt).view(np.uint8).reshape(base.shape)


def seeded_kv(layers: int, n_blocks: int, block_bytes: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 1 << 63, size=layers * 2 * n_blocks * block_bytes // 8, dtype=np.uint64)
    return words.view(np.uint8).reshape(layers, 2, n_blocks, block_bytes)


class SimulatedForward:
    def __init__(self, cache: PagedKVCache, layer_ms: float, hidden: int = 512, rows: int = 64) -> None:
        self.cache = cache
        self.layer_s = layer_ms / 1000.0
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(rows, hidden, generator=gen)
        self.w = torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5
        self.blocks = torch.from_numpy(cache.blocks)   # [layers, 2, num_blocks, block_bytes] uint8

    def _compute_until(self, end: float) -> None:
        x = self.x
        while time.perf_counter() < end:
            x = torch.tanh(x @ self.w)
        self.x = x

    def run(self, sender, step: int, specs, kv: RequestKV, src_blocks: list[int], handoff: str = "per_layer"):
        """Run one prefill on a new thread; returns its timings (perf_counter seconds, ns costs)."""
        result: dict = {}
        error: list[BaseException] = []

        def forward() -> None:
            try:
                result.update(self._forward(sender, step, specs, kv, src_blocks, handoff))
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                error.append(exc)

        thread = threading.Thread(target=forward, name="forward", daemon=True)
        thread.start()
        thread.join(60 + 10 * self.layer_s * self.cache.shape.num_layers)
        if thread.is_alive():
            raise TimeoutError("simulated forward did not finish")
        if error:
            raise error[0]
        return result

    def _forward(self, sender, step, specs, kv: RequestKV, src_blocks, handoff: str) -> dict:
        idx = torch.as_tensor(src_blocks, dtype=torch.int64)
        data = torch.from_numpy(kv.data)
        layers = self.cache.shape.num_layers
        handoff_ns = []
        t0 = time.perf_counter()
        sender.begin_step(step, specs)
        for layer in range(layers):
            self._compute_until(t0 + (layer + 1) * self.layer_s)
            self.blocks[layer, 0].index_copy_(0, idx, data[layer, 0])
            self.blocks[layer, 1].index_copy_(0, idx, data[layer, 1])
            if handoff == "per_layer":
                a = time.perf_counter_ns()
                sender.layer_ready(step, layer)
                handoff_ns.append(time.perf_counter_ns() - a)
        t_end = time.perf_counter()   # the last layer is computed and written
        if handoff == "after":
            for layer in range(layers):
                a = time.perf_counter_ns()
                sender.layer_ready(step, layer)
                handoff_ns.append(time.perf_counter_ns() - a)
        sender.end_step(step)
        return {"t0": t0, "t_forward_end": t_end, "handoff_ns": handoff_ns}
