"""The `threaded` baseline: a faithful model of the thread-and-blocking-socket connector aiolayer replaces.

What it keeps from that design (docs/seed-fragilities.md), because users run it today:
- ``layer_ready`` (its ``save_kv_layer``) runs on the forward thread; on the first layer of a request
  to a peer whose layout is not cached it asks D for the layout on a blocking ZMQ REQ socket
  (cached by peer, never invalidated), then puts the layer on a ``queue.Queue``;
- one sender thread takes layers off the queue in order, synchronises the device (a no-op on CPU),
  and moves each layer's K and V with one blocking ``batch_transfer_sync_write`` (which spins a core);
- after a request's last layer the sender thread sends DONE on a blocking REQ socket and waits.
What it does not copy, to be a fair baseline and not a crippled one: the per-layer deep copy of
request metadata, a ZMQ context per socket, missing timeouts. Contiguous blocks are merged into runs
exactly as aiolayer merges them. It has its own Mooncake engine, in the same P process as aiolayer's,
and talks to the same ``aiolayer node`` D process (the node's ROUTER accepts plain REQ peers).
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
import time

import numpy as np
import zmq

from aiolayer import LayerTiming, Outcome
from aiolayer.protocol import messages as m
from aiolayer.protocol.plan import merge_runs, run_addresses
from aiolayer.harness.node import MOONCAKE_ENV


# A blocking receive with no timeout was seed fragility 3/4; the bench must not hang on a broken run,
# and a healthy reply comes in well under a millisecond, so this bound never shapes a measurement.
_RECV_TIMEOUT_MS = 30_000


class DirectEngine:
    """A Mooncake TransferEngine of P's own, used without aiolayer (threaded and raw_mooncake modes)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        for key, value in MOONCAKE_ENV.items():
            os.environ.setdefault(key, value)
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"Mooncake initialize returned {rc}")
        self._regions: list[int] = []

    def register(self, addr: int, length: int) -> None:
        if self.engine.register_memory(addr, length) != 0:
            raise RuntimeError(f"Mooncake register_memory({addr:#x}, {length}) failed")
        self._regions.append(addr)

    def close(self) -> None:
        for addr in self._regions:
            self.engine.unregister_memory(addr)
        self._regions.clear()
        self.engine = None


class ReqClient:
    """A blocking ZMQ REQ client of an aiolayer control server: frames [request id, payload]."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, _RECV_TIMEOUT_MS)
        self.sock.connect(endpoint)
        self._rid = 0

    def call(self, msg: m.Message) -> m.Message:
        self._rid += 1
        self.sock.send_multipart([m.pack_request_id(self._rid), m.encode(msg)])
        try:
            frames = self.sock.recv_multipart()
        except zmq.Again:
            raise TimeoutError(f"no reply to {type(msg).__name__} within {_RECV_TIMEOUT_MS} ms") from None
        reply = m.decode(frames[-1])
        if isinstance(reply, m.Nack):
            raise RuntimeError(f"{type(msg).__name__} refused: {reply.code}: {reply.reason}")
        return reply

    def close(self) -> None:
        self.sock.close(0)


class _Req:
    __slots__ = ("spec", "runs", "timings", "bytes", "sent", "future", "error")

    def __init__(self, spec, future: concurrent.futures.Future) -> None:
        self.spec = spec
        self.runs = merge_runs(spec.src_blocks, spec.dst_blocks)
        self.timings: list[LayerTiming] = []
        self.bytes = 0
        self.sent = 0
        self.future = future
        self.error = ""


class ThreadedStep:
    """One forward step's requests, as aiolayer's ``Step``: ``layer_ready(layer)`` per layer, ``end()``."""

    __slots__ = ("_connector", "_reqs")

    def __init__(self, connector: "ThreadedConnector", reqs: list[_Req]) -> None:
        self._connector = connector
        self._reqs = reqs

    def layer_ready(self, layer: int) -> None:
        self._connector._layer_ready(self._reqs, layer)  # noqa: SLF001 - the step is the connector's

    def end(self) -> None:
        self._reqs = []

    def __enter__(self) -> "ThreadedStep":
        return self

    def __exit__(self, *exc) -> None:
        self.end()


class ThreadedConnector:
    """Duck-types aiolayer's public API for the simulated forward: ``begin_step(specs)`` returning a
    step (``layer_ready(layer)``, ``end()``), and ``wait_outcome(tid, timeout)``."""

    def __init__(self, engine: DirectEngine, engine_id: str, k_base, v_base, block_bytes: int) -> None:
        self.engine = engine.engine
        self.engine_id = engine_id
        self.k_base = np.asarray(k_base, dtype=np.int64)
        self.v_base = np.asarray(v_base, dtype=np.int64)
        self.block_bytes = block_bytes
        self.num_layers = len(self.k_base)
        self.ctx = zmq.Context()
        self._layouts: dict[str, m.LayoutReply] = {}      # by peer, never invalidated (as in the seed)
        self._fwd_clients: dict[str, ReqClient] = {}      # REQ sockets of the forward thread
        self._snd_clients: dict[str, ReqClient] = {}      # REQ sockets of the sender thread
        self._futures: dict[str, concurrent.futures.Future] = {}
        self._queue: queue.Queue = queue.Queue()          # unbounded, as in the seed
        self.thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self.thread.start()

    # --- forward thread --------------------------------------------------------------------------

    def begin_step(self, specs) -> ThreadedStep:
        reqs = []
        for spec in specs:
            fut = concurrent.futures.Future()
            self._futures[spec.transfer_id] = fut
            reqs.append(_Req(spec, fut))
        return ThreadedStep(self, reqs)

    def _layer_ready(self, reqs: list[_Req], layer: int) -> None:
        for req in reqs:
            peer = req.spec.peer
            if peer not in self._layouts:  # a cache miss queries D here, on the forward path
                client = self._fwd_clients.get(peer) or self._fwd_clients.setdefault(peer, ReqClient(self.ctx, peer))
                self._layouts[peer] = client.call(m.LayoutRequest(requester=self.engine_id,
                                                                  transfer_id=req.spec.transfer_id,
                                                                  token=req.spec.token))
            self._queue.put((req, layer, time.perf_counter()))

    # --- results ---------------------------------------------------------------------------------

    def wait_outcome(self, transfer_id: str, timeout: float) -> Outcome:
        fut = self._futures.pop(transfer_id)
        return fut.result(timeout)

    def sender_cpu_s(self) -> float:
        return time.clock_gettime(time.pthread_getcpuclockid(self.thread.ident))

    def close(self) -> None:
        self._queue.put(None)
        self.thread.join(10)
        for client in [*self._fwd_clients.values(), *self._snd_clients.values()]:
            client.close()
        self.ctx.term()

    # --- the sender thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            req, layer, handed = item
            try:
                self._send_layer(req, layer, handed)
            except Exception as exc:  # noqa: BLE001 - the bench must see the failure, not a dead thread
                req.error = req.error or f"{type(exc).__name__}: {exc}"
            req.sent += 1
            if req.sent == self.num_layers:
                self._finish(req)

    def _send_layer(self, req: _Req, layer: int, handed: float) -> None:
        if req.error:
            return
        _device_sync()
        layout = self._layouts[req.spec.peer]
        bb = self.block_bytes
        ks, kd, kl = run_addresses(req.runs, int(self.k_base[layer]), layout.layers[layer].k_base, bb)
        vs, vd, vl = run_addresses(req.runs, int(self.v_base[layer]), layout.layers[layer].v_base, bb)
        submitted = time.perf_counter()
        rc = self.engine.batch_transfer_sync_write(
            layout.session, [*ks.tolist(), *vs.tolist()], [*kd.tolist(), *vd.tolist()], [*kl.tolist(), *vl.tolist()])
        if rc != 0:
            raise RuntimeError(f"batch_transfer_sync_write of layer {layer} returned {rc}")
        req.timings.append(LayerTiming(layer, handed, submitted, time.perf_counter()))
        req.bytes += int(kl.sum() + vl.sum())

    def _finish(self, req: _Req) -> None:
        spec = req.spec
        client = (self._snd_clients.get(spec.peer)
                  or self._snd_clients.setdefault(spec.peer, ReqClient(self.ctx, spec.peer)))
        if req.error:  # the seed skipped this message (fragility 5); sent here so the bench can clean up
            msg = m.Failed(transfer_id=spec.transfer_id, sender=self.engine_id, reason=req.error[:500],
                           token=spec.token)
        else:
            msg = m.Done(transfer_id=spec.transfer_id, sender=self.engine_id, incarnation=spec.dst_incarnation,
                         layers=len(req.timings), bytes=req.bytes, token=spec.token)
        try:
            client.call(msg)
        except Exception as exc:  # noqa: BLE001
            req.error = req.error or f"DONE not delivered: {exc}"
        req.future.set_result(Outcome(transfer_id=spec.transfer_id, ok=not req.error, reason=req.error,
                                      bytes=req.bytes, finished_s=time.perf_counter(),
                                      layers=sorted(req.timings, key=lambda t: t.layer)))


def _device_sync() -> None:
    """The seed synchronised the whole device before every batch (fragility 15); on CPU it is free."""
    import torch

    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        acc.synchronize()
