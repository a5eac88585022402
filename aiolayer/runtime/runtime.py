"""Runtime: the embedding API. One per process: loop thread, backend, control server, sender, receiver.

Construct it (no I/O), ``start()`` it, use ``sender`` on P and ``receiver`` on D, ``stop()`` it.
``stop`` is bounded by ``Timeouts.shutdown`` and leaves no task, socket or registered region.
Extra control messages (a node's allocation and verification) go to ``extra_handler``;
``inbound_filter`` sees every message first (a node's fault injection drops some there).

Other threads read the metrics from ``published_metrics``: a snapshot the loop rebuilds every
``METRICS_EVERY_S`` and at each transfer outcome (before the outcome is visible), swapped in one assignment and never mutated,
so a reader never walks a dict the loop is changing.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Awaitable, Callable

from ..backends import make_backend
from ..config import NodeConfig, Timeouts
from ..errors import BridgeClosed, ControlError, ControlRejected, DeadlineExceeded, RuntimeStateError
from ..protocol import messages as m
from ..protocol.plan import HeadGeometry
from .bridge import LayerBridge
from .control import ControlPeers, ControlServer
from .loop import LoopThread
from .metadata import LayoutCache
from .metrics import MetricsServer, render, snapshot
from .receiver import Receiver
from .sender import Sender, check_geometry

log = logging.getLogger(__name__)
METRICS_EVERY_S = 0.05

ExtraHandler = Callable[[m.Message], Awaitable[m.Message]]
InboundFilter = Callable[[m.Message], None]   # raises FrameDropped or ControlRejected to stop a message


class Runtime:
    def __init__(self, node: NodeConfig | None = None, timeouts: Timeouts | None = None,
                 backend=None, extra_handler: ExtraHandler | None = None, forget_settled: bool = False,
                 inbound_filter: InboundFilter | None = None) -> None:
        self.node = node or NodeConfig()
        self.timeouts = timeouts or Timeouts()
        self.incarnation = uuid.uuid4().hex
        self.backend = backend if backend is not None else make_backend(self.node.backend)
        self.extra_handler = extra_handler
        self.inbound_filter = inbound_filter
        self.loop_thread = LoopThread(name=f"aiolayer-{self.node.engine_id}")
        self.bridge = LayerBridge(capacity=self.node.bridge_capacity)
        self.receiver = Receiver(self.timeouts, forget_settled=forget_settled)
        self.server: ControlServer | None = None
        self.peers: ControlPeers | None = None
        self.layouts: LayoutCache | None = None
        self.sender: Sender | None = None
        self.layout_reply: m.LayoutReply | None = None
        self.control_endpoint = ""
        self.metrics_server: MetricsServer | None = None
        self.metrics_url = ""
        self.published_metrics: dict | None = None   # read whole from any thread; replaced, never changed
        self._started = False
        self._closed = False
        self.loop_thread.on_exit(self._on_loop_exit)
        self.loop_thread.on_stop(self._close)  # runs even if the loop dies without stop()

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> "Runtime":
        if self._started:
            raise RuntimeStateError("runtime already started")
        self._started = True
        self.loop_thread.start()
        try:
            self.loop_thread.call(self._open(), timeout=self.timeouts.shutdown + self.timeouts.layout_fetch)
        except BaseException:
            self.stop()
            raise
        return self

    async def _open(self) -> None:
        spawn = self.loop_thread.spawn
        self.bridge.attach(asyncio.get_running_loop())
        await self.backend.open(spawn)
        self.peers = ControlPeers(self.timeouts, spawn)
        self.layouts = LayoutCache(self.peers, self.timeouts, self.node.engine_id, spawn)
        self.sender = Sender(engine_id=self.node.engine_id, bridge=self.bridge, backend=self.backend,
                             peers=self.peers, layouts=self.layouts, timeouts=self.timeouts,
                             on_outcome=self._republish_metrics)
        spawn(self.sender.run(spawn), name="sender")
        self.receiver.bind(spawn, self._stop_sender, on_outcome=self._republish_metrics)
        self.server = ControlServer(self.node.control_host, self.node.control_port, self._handle,
                                    max_frame_bytes=self.node.max_frame_bytes)
        self.control_endpoint = await self.server.start(spawn)
        if self.node.metrics_port >= 0:
            self.metrics_server = MetricsServer(self.node.control_host, self.node.metrics_port, self._scrape,
                                                self.timeouts.control_call)
            self.metrics_url = await self.metrics_server.start()
        self.published_metrics = snapshot(self)
        spawn(self._publish_metrics(), name="metrics-publisher")

    def stop(self) -> None:
        """Bounded: closes sockets, unregisters memory and ends the loop thread."""
        self.bridge.close("runtime stopped")
        if self.loop_thread.alive:
            try:
                self.loop_thread.call(self._close(), timeout=self.timeouts.shutdown + self.timeouts.backend_close)
            except Exception as exc:  # noqa: BLE001 - stop must go on to end the thread
                log.warning("runtime clean-up incomplete: %r", exc)
        self.loop_thread.stop(self.timeouts.shutdown)

    async def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        cleanup = self.timeouts.cleanup
        steps = []
        if self.metrics_server is not None:
            steps.append(self.metrics_server.close())
        if self.server is not None:
            steps.append(self.server.close())
        if self.peers is not None:
            steps.append(self.peers.close())
        for step in steps:
            try:
                await asyncio.wait_for(step, cleanup)
            except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - log and continue closing
                log.warning("clean-up step failed: %r", exc)
        if self.layouts is not None:
            self.layouts.close()
        self.receiver.close()
        try:
            await asyncio.wait_for(self.backend.close(), self.timeouts.backend_close)
        except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001
            log.warning("backend close failed: %r", exc)

    def _on_loop_exit(self, error: BaseException | None) -> None:
        self.bridge.close(error or BridgeClosed("loop thread exited"))

    def __enter__(self) -> "Runtime":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- D side: publish the local KV layout -------------------------------------------------

    def publish_layout(self, k_base: list[int], v_base: list[int], block_bytes: int, num_blocks: int,
                       register: bool = True, *, kv_heads: int = 0, geometry: HeadGeometry | None = None) -> None:
        """Make this process's KV caches the target of peers' writes (D), or their source (P).

        Per layer, block ``b`` of K is at ``k_base + b * block_bytes``, likewise for V. Where one
        tensor holds both (each block K and V together, vLLM's CPU layout), pass 0 as V bases.

        ``kv_heads`` and ``geometry`` (tokens per block, bytes per head, NHD/HND) describe a block's
        local heads; with them, peers of another TP size can write or be written head slices
        (``TransferSpec.route``). Without them only whole blocks move.

        ``register=False`` publishes without registering the memory with the backend, so every
        write to it is refused: a fault-injection switch for tests and ``bench --scenario faults``.
        """
        check_geometry(block_bytes, kv_heads, geometry, v_base)
        self.loop_thread.call(self._register_layout(k_base, v_base, block_bytes, num_blocks, register,
                                                    kv_heads, geometry),
                              timeout=self.timeouts.shutdown)

    async def _register_layout(self, k_base, v_base, block_bytes: int, num_blocks: int, register: bool,
                               kv_heads: int = 0, geometry: HeadGeometry | None = None) -> None:
        span = num_blocks * block_bytes
        for base in list(k_base) + list(v_base) if register else ():
            if base:   # a V base of 0: K and V share one tensor per layer
                self.backend.register(int(base), span)
        self.sender.set_local_layout(k_base, v_base, block_bytes, num_blocks, kv_heads, geometry)
        geo = {} if geometry is None else dict(kv_heads=kv_heads, block_size=geometry.block_size,
                                               head_bytes=geometry.head_bytes, kv_layout=geometry.layout)
        self.layout_reply = m.LayoutReply(
            engine_id=self.node.engine_id, incarnation=self.incarnation, session=self.backend.session,
            block_bytes=block_bytes, num_blocks=num_blocks,
            layers=[m.LayerRegion(int(k), int(v)) for k, v in zip(k_base, v_base)], **geo)

    # --- control-plane routing -----------------------------------------------------------------

    async def _stop_sender(self, endpoint: str, transfer_id: str, token: str, reason: str) -> bool:
        """D's fence: ask P to stop writing ``transfer_id``; True once P says none is in flight."""
        try:
            client = await self.peers.get(endpoint)
            reply = await client.call(m.Abort(transfer_id=transfer_id, reason=reason, token=token),
                                      timeout=self.timeouts.layer_write + self.timeouts.control_call)
        except (ControlError, DeadlineExceeded) as exc:   # e.g. Nack(settling): the fence asks again
            log.info("transfer %s: P at %s did not confirm it stopped: %s", transfer_id, endpoint, exc)
            return False
        return isinstance(reply, m.Ack) and reply.detail == "stopped"

    async def _handle(self, msg: m.Message) -> m.Message:
        if self.inbound_filter is not None:
            self.inbound_filter(msg)
        if isinstance(msg, (m.Done, m.Failed)):
            return self.receiver.handle(msg)
        if isinstance(msg, m.Abort):
            return m.Ack(detail=await self.sender.abort(msg.transfer_id, msg.reason, msg.token))
        if isinstance(msg, m.AbortRequest):
            return m.Ack(detail=self.receiver.abort(msg.transfer_id, msg.reason, msg.token))
        if isinstance(msg, m.LookupRequest):
            block_ids, first = self.receiver.registration(msg.transfer_id, msg.token)
            return m.AllocReply(transfer_id=msg.transfer_id, block_ids=block_ids, incarnation=self.incarnation,
                                first_block=first, token=msg.token)
        if isinstance(msg, m.LayoutRequest):
            # the layout names our memory: only for a peer holding the token of a transfer that still
            # takes writes (P fetches it for every transfer before its first write)
            self.receiver.authorize_writer(msg.transfer_id, msg.token, f"layout request from {msg.requester!r}")
            if self.layout_reply is None:
                raise ControlRejected("not_ready", "no KV layout registered yet")
            return self.layout_reply
        if self.extra_handler is not None:
            return await self.extra_handler(msg)
        raise ControlRejected("unknown", f"{type(msg).__name__} is not served here")

    # --- metrics ---------------------------------------------------------------------------------

    async def _publish_metrics(self) -> None:
        """Rebuild the snapshot other threads read every ``METRICS_EVERY_S`` (levels, queues); counts
        are also republished at each outcome, before the outcome is visible (``_republish_metrics``)."""
        while True:
            await asyncio.sleep(METRICS_EVERY_S)
            self._republish_metrics()

    def _republish_metrics(self) -> None:
        """On the loop: a new snapshot, swapped in whole (other threads only ever read the attribute)."""
        try:
            self.published_metrics = snapshot(self)
        except Exception:  # noqa: BLE001 - keep the last one; a stale figure beats none
            log.exception("metrics snapshot failed")

    async def _scrape(self) -> bytes:
        return render(snapshot(self))

    def metrics_snapshot(self) -> dict:
        """Every figure of the metrics as plain data, taken on the loop (from any other thread)."""
        async def take() -> dict:
            return snapshot(self)
        return self.loop_thread.call(take(), timeout=self.timeouts.control_call)

    def metrics_text(self) -> str:
        """The Prometheus text exposition, as ``GET /metrics`` serves it."""
        return self.loop_thread.call(self._scrape(), timeout=self.timeouts.control_call).decode()

    # --- synchronous helpers for non-loop threads (tools, tests, the benchmark) ---------------

    def request(self, endpoint: str, msg: m.Message, timeout: float | None = None) -> m.Message:
        """Send one control request from a non-loop thread and wait for the reply (bounded)."""
        limit = self.timeouts.control_call if timeout is None else timeout

        async def call() -> m.Message:
            client = await self.peers.get(endpoint)
            return await client.call(msg, timeout=limit)

        return self.loop_thread.call(call(), timeout=limit + self.timeouts.cleanup)
