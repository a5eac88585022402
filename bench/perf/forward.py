"""A simulated prefill forward pass on its own thread: real torch work per layer, then the KV write.

Per layer it runs small matmuls for ``layer_ms`` (calibrated by the clock, so the compute time per
layer is what was asked whatever the CPU), writes that layer's K and V into P's paged cache with
``index_copy_`` (as an engine's reshape-and-cache does), then hands the layer over
(``step.layer_ready``), timing that hand-off in nanoseconds: on even layers the hand-off, on odd ones an
empty statement at the same point (the floor: what any Python there costs on this host, right after the
KV write evicted the caches), with that layer's hand-off made untimed after it; each timing is the first
Python after its layer's write, so neither warms the other. ``handoff="after"`` hands every layer
over only once the whole forward is done: the bulk (whole-request) transfer. The connector is
duck-typed on aiolayer's public API (``begin_step(specs)`` returning a step with ``layer_ready(layer)``
and ``end()``): aiolayer's ``Runtime`` or the threaded baseline.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
import zlib

import numpy as np
import torch

from aiolayer.kvcache import PagedKVCache

from .cpus import pin_this_thread


class RequestKV:
    """Seeded KV bytes of one request: [layers, 2, n_blocks, block_bytes], distinct per request.

    The buffer is reused from request to request: a fresh multi-GiB array would pay its page faults
    (about 0.5 GB/s here) on every request of a long sweep.
    """

    def __init__(self, base: np.ndarray, request_index: int, out: np.ndarray | None = None) -> None:
        words = base.view(np.uint64)
        salt = np.uint64((request_index + 1) * 0x9E3779B97F4A7C15 % (1 << 64))
        buf = np.empty(words.size, dtype=np.uint64) if out is None else out.reshape(-1).view(np.uint64)
        np.bitwise_xor(words.reshape(-1), salt, out=buf)
        self.data = buf.view(np.uint8).reshape(base.shape)


def seeded_kv(layers: int, n_blocks: int, block_bytes: int, seed: int, pool_bytes: int = 16 << 20) -> np.ndarray:
    """Seeded random KV: a random pool XOR a random word per pool-sized chunk, so every block differs.

    numpy's integer generator makes ~0.3 GB/s here: a 2 GiB sweep point would wait 7 s for its bytes.
    """
    rng = np.random.default_rng(seed)
    words = layers * 2 * n_blocks * block_bytes // 8
    pool = rng.integers(0, 1 << 63, size=min(words, pool_bytes // 8), dtype=np.uint64)
    out = np.empty(words, dtype=np.uint64)
    salts = rng.integers(0, 1 << 63, size=-(-words // pool.size), dtype=np.uint64)
    for i, start in enumerate(range(0, words, pool.size)):
        end = min(words, start + pool.size)
        np.bitwise_xor(pool[:end - start], salts[i], out=out[start:end])
    return out.view(np.uint8).reshape(layers, 2, n_blocks, block_bytes)


def expected_crcs(kv: "RequestKV") -> tuple[list[int], list[int]]:
    """Per layer CRC32 of K and V as D computes them over the request's blocks, in order."""
    data = kv.data
    return ([zlib.crc32(data[layer, 0]) for layer in range(data.shape[0])],
            [zlib.crc32(data[layer, 1]) for layer in range(data.shape[0])])


class SimulatedForward:
    def __init__(self, cache: PagedKVCache, layer_ms: float, hidden: int = 512, rows: int = 64,
                 cpus: set[int] | None = None) -> None:
        self.cache = cache
        self.cpus = cpus              # the "device" CPUs this forward owns (bench/perf/cpus.py); None: any
        self.layer_s = layer_ms / 1000.0
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(rows, hidden, generator=gen)
        self.w = torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5
        blocks = torch.from_numpy(cache.blocks)   # [layers, 2, num_blocks, block_bytes] uint8
        # index_copy_ on uint8 rows moves a byte at a time (~1.2 GB/s here, slower than the transfer);
        # 8-byte words write the same bytes at memcpy-like speed, as a real reshape-and-cache would.
        self.word = 8 if cache.shape.block_bytes % 8 == 0 else 1
        self.blocks = blocks.view(torch.int64) if self.word == 8 else blocks
        # One long-lived thread, as an engine's: a new thread pays ~7 ms of torch set-up on its first op.
        # A daemon: a forward stuck in a broken connector must not keep the process from exiting.
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._worker, name="forward", daemon=True)
        self._thread.start()
        self._submit(self._compute_until, time.perf_counter() + 0.01).result(10)

    def _worker(self) -> None:
        pin_this_thread(self.cpus)
        while (job := self._jobs.get()) is not None:
            fut, fn, args = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                    fut.set_exception(exc)

    def _submit(self, fn, *args) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fut, fn, args))
        return fut

    def _compute_until(self, end: float) -> None:
        x = self.x
        while time.perf_counter() < end:
            x = torch.tanh(x @ self.w)
        self.x = x

    def start(self, connector, specs, kv: RequestKV, src_blocks: list[int],
              handoff: str = "per_layer") -> concurrent.futures.Future:
        """Start one prefill on the forward thread; the future holds its timings (``run``)."""
        return self._submit(self._forward, connector, specs, kv, src_blocks, handoff)

    @property
    def time_limit_s(self) -> float:
        """How long a prefill may take before it counts as stuck."""
        return 60 + 10 * self.layer_s * self.cache.shape.num_layers

    def run(self, connector, specs, kv: RequestKV, src_blocks: list[int], handoff: str = "per_layer"):
        """Run one prefill on the forward thread; returns its timings (perf_counter seconds, ns costs)."""
        fut = self.start(connector, specs, kv, src_blocks, handoff)
        try:
            return fut.result(self.time_limit_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError("simulated forward did not finish") from None

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(10)

    def _forward(self, connector, specs, kv: RequestKV, src_blocks, handoff: str) -> dict:
        idx = torch.as_tensor(src_blocks, dtype=torch.int64)
        data = torch.from_numpy(kv.data)
        if self.word == 8:
            data = data.view(torch.int64)
        layers = self.cache.shape.num_layers
        handoff_ns, floor_ns, phases = [], [], []
        cpu0 = time.thread_time()
        t0 = time.perf_counter()
        step = connector.begin_step(specs)
        for layer in range(layers):
            start = time.perf_counter()
            self._compute_until(start + self.layer_s)
            computed = time.perf_counter()
            self.blocks[layer, 0].index_copy_(0, idx, data[layer, 0])
            self.blocks[layer, 1].index_copy_(0, idx, data[layer, 1])
            written = time.perf_counter()
            phases.append((start - t0, computed - t0, written - t0))
            if handoff == "per_layer" and layer % 2:
                a = time.perf_counter_ns()
                floor_ns.append(time.perf_counter_ns() - a)
                step.layer_ready(layer)
            elif handoff == "per_layer":
                a = time.perf_counter_ns()
                step.layer_ready(layer)
                handoff_ns.append(time.perf_counter_ns() - a)
        t_end = time.perf_counter()   # the last layer is computed and written
        cpu_s = time.thread_time() - cpu0
        if handoff == "after":
            for layer in range(layers):
                a = time.perf_counter_ns()
                step.layer_ready(layer)
                handoff_ns.append(time.perf_counter_ns() - a)
        step.end()
        return {"t0": t0, "t_forward_end": t_end, "forward_cpu_s": cpu_s, "handoff_ns": handoff_ns,
                "floor_ns": floor_ns, "phases": phases}
