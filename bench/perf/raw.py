"""The physical limits: the same bytes with no runtime and no compute.

- ``raw_mooncake``: Mooncake called directly. Two ways, both measured on every request, the faster
  is the ceiling: ``batch_sync`` is Mooncake's batch write (one ``batch_transfer_sync_write`` of
  every run; its waiter spins a core), ``submit_poll`` submits every run (``transfer_submit_write``)
  and polls ``transfer_check_status`` with a 1 ms sleep. On a 2-core host the spinning waiter takes
  the core the TCP transport needs, so the second is usually faster; ``--raw-under-compute`` also
  measures it while a thread does the forward's torch work, to show what one busy core costs, and
  one layer at a time: paced by a timer and polled every 0.1 ms (``per_layer_paced``), and handed
  over by the simulated forward itself and polled every 1 ms, aiolayer's poller's tick (``per_layer_1ms``).
- ``raw_tcp``: plain sockets on 127.0.0.1 into a child process (1 and 4 streams, the faster counts).
- ``memcpy``: one numpy copy within P's process.
Each returns (seconds, verified-by-CRC32, per-variant seconds).
"""

from __future__ import annotations

import json
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import torch

from aiolayer.harness.child import ChildProcess

from .cpus import pin_this_thread
from .tcp_sink import HEADER, recv_exact

_POLL_S = 0.001
_FINE_POLL_S = 0.0001


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals: the time at least one write was in flight."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def chunk_crcs(buf: np.ndarray, chunk: int) -> list[int]:
    flat = buf.reshape(-1)
    return [zlib.crc32(flat[i:i + chunk]) for i in range(0, flat.size, chunk)]


# --- raw_mooncake ----------------------------------------------------------------------------------

def mooncake_batch_sync(engine, session: str, src: list[int], dst: list[int], lens: list[int]) -> None:
    rc = engine.batch_transfer_sync_write(session, src, dst, lens)
    if rc != 0:
        raise RuntimeError(f"batch_transfer_sync_write returned {rc}")


def mooncake_submit_poll(engine, session: str, src: list[int], dst: list[int], lens: list[int]) -> None:
    pending = [engine.transfer_submit_write(session, s, d, n) for s, d, n in zip(src, dst, lens)]
    deadline = time.monotonic() + 60
    while pending:
        left = []
        for bid in pending:
            status = engine.transfer_check_status(bid)
            if status < 0:
                raise RuntimeError(f"transfer_check_status returned {status}")
            if status == 0:
                left.append(bid)
        pending = left
        if pending:
            if time.monotonic() > deadline:
                raise TimeoutError("raw Mooncake writes did not settle within 60 s")
            time.sleep(_POLL_S)


MOONCAKE_VARIANTS = {"batch_sync": mooncake_batch_sync, "submit_poll": mooncake_submit_poll}


def mooncake_paced(engine, session: str, runs: tuple[list, list, list], layers: int, period_s: float) -> float:
    """Each layer's runs submitted at its turn, ``period_s`` apart, as a forward would hand them over
    (the compute load runs beside it), polled every 0.1 ms. Returns the time at least one write was
    in flight: the ceiling for moving these bytes one layer at a time at this pace."""
    t0 = time.perf_counter()

    def due(now: float, submitted: int) -> int:
        return min(layers, int((now - t0) / period_s) + 1) - submitted

    return _push_layers(engine, session, runs, layers, due, _FINE_POLL_S, 60 + layers * period_s)


class LayerFeed:
    """A connector for the simulated forward with no runtime: its step queues each layer handed over."""

    def __init__(self) -> None:
        self.ready: queue.SimpleQueue[int] = queue.SimpleQueue()

    def begin_step(self, _specs) -> "LayerFeed":
        return self

    def layer_ready(self, layer: int) -> None:
        self.ready.put(layer)

    def end(self) -> None:
        pass

    def due(self, _now: float, _submitted: int) -> int:
        """The layers handed over since the last look."""
        count = 0
        while True:
            try:
                self.ready.get_nowait()
            except queue.Empty:
                return count
            count += 1


def mooncake_forward_paced(engine, session: str, runs: tuple[list, list, list], layers: int, forward,
                           kv, src_blocks: list[int], poll_s: float) -> float:
    """The simulated forward itself (its compute and its KV writes, on its own CPU) hands each layer
    over and this thread submits that layer's runs at once, polling every ``poll_s``: what a runtime
    with that polling cadence could at best do beside that forward. Returns the time at least one
    write was in flight."""
    feed = LayerFeed()
    run = forward.start(feed, [], kv, src_blocks)
    busy = _push_layers(engine, session, runs, layers, feed.due, poll_s, forward.time_limit_s)
    run.result(forward.time_limit_s)
    return busy


def _push_layers(engine, session: str, runs: tuple[list, list, list], layers: int, due, poll_s: float,
                 limit_s: float) -> float:
    """Submit whole layers as ``due(now, submitted)`` says, polling every ``poll_s`` (a thread may
    sleep 0.1 ms; uvloop's timers tick in whole ms); returns the union of the layers' in-flight spans."""
    src, dst, lens = runs
    per = len(src) // layers
    check = engine.transfer_check_status
    inflight: dict[int, list] = {}            # layer -> [pending ids, submitted_s]
    spans, nxt = [], 0
    deadline = time.perf_counter() + limit_s
    while nxt < layers or inflight:
        now = time.perf_counter()
        for _ in range(due(now, nxt) if nxt < layers else 0):
            lo = nxt * per
            inflight[nxt] = [[engine.transfer_submit_write(session, s, d, n) for s, d, n in
                              zip(src[lo:lo + per], dst[lo:lo + per], lens[lo:lo + per])], now]
            nxt += 1
        for layer, (ids, started) in list(inflight.items()):
            ids[:] = [bid for bid in ids if _pending(check(bid))]
            if not ids:
                spans.append((started, time.perf_counter()))
                del inflight[layer]
        if now > deadline:
            raise TimeoutError("paced raw Mooncake writes did not settle")
        time.sleep(poll_s)
    return busy_seconds(spans)


def _pending(status: int) -> bool:
    """True while the write is in flight; a failed one raises."""
    if status < 0:
        raise RuntimeError(f"transfer_check_status returned {status}")
    return status == 0


class ComputeLoad:
    """The forward's torch work on a thread of its own, for the under-compute variant."""

    def __init__(self, cpus: set[int] | None = None) -> None:
        self.cpus = cpus
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._burn, name="compute-load", daemon=True)

    def _burn(self) -> None:
        pin_this_thread(self.cpus)
        gen = torch.Generator().manual_seed(0)
        x, w = torch.randn(64, 512, generator=gen), torch.randn(512, 512, generator=gen) / 512 ** 0.5
        while not self._stop.is_set():
            x = torch.tanh(x @ w)

    def __enter__(self) -> "ComputeLoad":
        self._thread.start()
        time.sleep(0.005)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def timed(fn, *args) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds of the calling thread, what ``fn`` returned)."""
    c0, t0 = time.thread_time(), time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - t0, time.thread_time() - c0, result


# --- raw_tcp ---------------------------------------------------------------------------------------

SINK_START_TIMEOUT_S = 30.0   # the sink imports numpy and binds a port: seconds at most


class TcpSinkProcess:
    """The child process of ``tcp_sink`` and P's persistent streams to it."""

    def __init__(self, max_streams: int = 4) -> None:
        self.child = ChildProcess([sys.executable, "-m", "aiolayer.bench.perf.tcp_sink"], name="tcp sink",
                                  stdin=subprocess.PIPE, new_session=False).start()
        try:
            port = self.child.read_json(SINK_START_TIMEOUT_S, require="port")["port"]
        except BaseException:
            self.close()
            raise
        self.socks = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(max_streams)]
        for s in self.socks:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._rid = 0

    def prepare(self, total: int) -> None:
        """Size (and fault in) the sink's buffer before any timed request."""
        self.socks[0].sendall(HEADER.pack(0, 0, 0, total, total, 1))
        if recv_exact(self.socks[0], 1) != b"R":
            raise RuntimeError("tcp sink did not get ready")

    def push(self, buf: np.ndarray, chunk: int, streams: int) -> tuple[float, list[int]]:
        """Send ``buf`` over ``streams`` connections; returns (seconds to the sink's ack, its CRCs)."""
        self._rid += 1
        flat = memoryview(buf.reshape(-1))
        total = len(flat)
        bounds = np.linspace(0, total, streams + 1).astype(np.int64) // 4096 * 4096
        bounds[-1] = total
        replies: dict[int, tuple[float, list[int] | None]] = {}

        def stream(i: int) -> None:
            sock, lo, hi = self.socks[i], int(bounds[i]), int(bounds[i + 1])
            sock.sendall(HEADER.pack(self._rid, lo, hi - lo, total, chunk, streams))
            sock.sendall(flat[lo:hi])
            tag = recv_exact(sock, 1)
            at = time.perf_counter()
            crcs = None
            if tag == b"A":
                (size,) = struct.unpack("!I", recv_exact(sock, 4))
                crcs = json.loads(recv_exact(sock, size))
            replies[i] = (at, crcs)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        if len(replies) != streams:
            raise RuntimeError("raw_tcp: a stream did not complete")
        done = [v for v in replies.values() if v[1] is not None]
        if len(done) != 1:
            raise RuntimeError("raw_tcp: the sink did not complete the request exactly once")
        return done[0][0] - t0, done[0][1]

    def close(self) -> None:
        for s in getattr(self, "socks", []):
            s.close()
        self.child.end_input(5.0)   # the sink serves until its stdin closes
        self.child.close()


# --- memcpy ----------------------------------------------------------------------------------------

def memcpy(dst: np.ndarray, src: np.ndarray) -> None:
    np.copyto(dst, src)
