"""Runtime: the embedding API. One per process: loop thread, backend, control server, sender, receiver.

Construct it (no I/O), ``start()`` it, ``register_kv_memory`` once, then P calls ``begin_step`` and
D calls ``receive``; ``stop()`` it. Every method returns at once and may be called from any thread
(docs/embedding.md says which thread each belongs to): work for the loop is handed over, and a refusal
raises at once or comes back as that transfer's failed result. ``stop`` is bounded by
``Timeouts.shutdown`` and leaves no task, socket or registered region. A node's or test's extra
switches (``hooks.install_hooks``) are not part of this API.

Other threads read the metrics from ``published_metrics``: a snapshot the loop rebuilds every
``METRICS_EVERY_S`` and as outcomes become visible (just before; P's once per pass of the loop for all
of that pass's outcomes), swapped in one assignment and never mutated, so a reader never walks a
dict the loop is changing.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
import uuid
from collections.abc import Sequence
from typing import Any, Awaitable, Callable

import msgspec

from ..backends import make_backend
from ..backends.base import TransferBackend
from ..config import NodeConfig, Timeouts
from ..errors import BridgeClosed, ConfigError, RuntimeStateError
from ..protocol import messages as m
from ..protocol.plan import HeadGeometry
from ..transport import url_host
from .api import Identity, Step
from .send.bridge import LayerBridge
from .control import routing
from .control.plane import ControlPeers, ControlServer
from .loop import LoopThread
from .send.metadata import LayoutCache
from .metrics import MetricsServer, render, snapshot
from .control.hooks import NO_HOOKS
from .integrity import VERIFIES
from .receive.entry import Received
from .receive.receiver import Receiver
from .receive.receiving import ReceiveApi
from .send.sender import Outcome, Sender, TransferSpec, check_geometry

log = logging.getLogger(__name__)
METRICS_EVERY_S = 0.05


class Runtime(ReceiveApi):
    def __init__(self, node: NodeConfig | None = None, timeouts: Timeouts | None = None,
                 backend: TransferBackend | None = None) -> None:
        self.node = node or NodeConfig()
        self.timeouts = timeouts or Timeouts()
        self.incarnation = uuid.uuid4().hex
        if backend is None:
            backend = make_backend(self.node.backend, transport=self.node.transport)
        self.backend = backend
        self._hooks = NO_HOOKS
        self._steps = itertools.count(1)
        self._inbox: list[Received] = []   # D: results wait_received took from the receiver for others
        self._inbox_lock = threading.Lock()
        self.loop_thread = LoopThread(name=f"aiolayer-{self.node.engine_id}")
        self.bridge = LayerBridge(capacity=self.node.bridge_capacity)
        self.receiver = Receiver(self.timeouts)
        self.server: ControlServer | None = None
        self.peers: ControlPeers | None = None
        self.layouts: LayoutCache | None = None
        self.sender: Sender | None = None
        self.layout_reply: m.LayoutReply | None = None
        self.identity = Identity()   # answered to TopologyRequest (routing); replaced whole, never changed
        self.control_endpoint = ""
        self.metrics_server: MetricsServer | None = None
        self.metrics_url = ""
        self.published_metrics: dict[str, Any] | None = None   # read whole from any thread; replaced, never changed
        self._outcome_listeners: tuple[Callable[[], None], ...] = ()
        self._started = False
        self._closed = False
        # start() and stop() one at a time: a stop racing an open bound the control port after its close
        self._lifecycle = threading.RLock()
        self._opener: int | None = None   # the thread inside start()'s open (a signal handler there defers)
        self._stop_asked = False
        self.loop_thread.on_exit(self._on_loop_exit)
        self.loop_thread.on_stop(self._close)  # runs even if the loop dies without stop()

    # --- lifecycle -------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._started

    def start(self) -> "Runtime":
        with self._lifecycle:
            if self._started or self._stop_asked:
                raise RuntimeStateError("runtime already started" if self._started else
                                        "runtime stopped before it started: make a new one")
            self._started, self._opener = True, threading.get_ident()
            try:
                self.loop_thread.start()
                self.loop_thread.call(self._open(), timeout=self.timeouts.runtime_open)
            except BaseException:
                self._opener = None
                self.stop()
                raise
            self._opener = None
            if self._stop_asked:   # by a signal handler on this thread while it opened
                self.stop()
                raise RuntimeStateError("runtime stopped while it started")
        return self

    async def _open(self) -> None:
        spawn = self.loop_thread.spawn
        self.bridge.attach(asyncio.get_running_loop())
        await self.backend.open(spawn)
        self.peers = ControlPeers(self.timeouts, spawn)
        self.layouts = LayoutCache(self.peers, self.timeouts, self.node.engine_id, spawn)
        self.sender = Sender(engine_id=self.node.engine_id, bridge=self.bridge, backend=self.backend,
                             peers=self.peers, layouts=self.layouts, timeouts=self.timeouts,
                             on_outcome=self._outcome, integrity_sample=self.node.integrity_sample)
        spawn(self.sender.run(spawn), name="sender")
        self.receiver.bind(spawn, functools.partial(routing.stop_sender, self), on_outcome=self._outcome)
        transport = self.node.transport
        advertised = url_host(transport.advertised())   # bound on bind_host, dialled by peers at this
        handler = functools.partial(routing.handle, self, self._hooks)   # hooks go in before start (install_hooks)
        self.server = ControlServer(transport.bind_host, self.node.control_port, handler,
                                    max_frame_bytes=self.node.max_frame_bytes)
        await self.server.start(spawn)
        self.control_endpoint = f"tcp://{advertised}:{self.server.port}"
        self.layouts.control, self.layouts.incarnation = self.control_endpoint, self.incarnation
        if self.node.metrics_port >= 0:
            self.metrics_server = MetricsServer(transport.bind_host, self.node.metrics_port, self._scrape,
                                                self.timeouts.control_call, health=self._health)
            await self.metrics_server.start()
            self.metrics_url = f"http://{advertised}:{self.metrics_server.port}/metrics"
        self.published_metrics = snapshot(self)
        spawn(self._publish_metrics(), name="metrics-publisher")

    def stop(self) -> None:
        """Bounded: closes sockets, unregisters memory and ends the loop thread. Called while another thread
        is in ``start()``, it waits for that open to end (``runtime_open``) and then stops what it opened."""
        self.loop_thread.not_on_loop("stop()")
        self._stop_asked = True
        if self._opener == threading.get_ident():
            return   # a signal handler inside start() on this thread: start() stops once its open ended
        if not self._lifecycle.acquire(timeout=self.timeouts.runtime_open + self.timeouts.cleanup):
            log.warning("stop(): start() did not end its open in time; stopping beside it")
            self._stop_now()
            return
        try:
            self._stop_now()
        finally:
            self._lifecycle.release()

    def _stop_now(self) -> None:
        self.bridge.close("runtime stopped")
        if self.loop_thread.alive:
            try:
                self.loop_thread.call(self._close(), timeout=self.timeouts.runtime_close)
            except Exception as exc:  # noqa: BLE001 - stop must go on to end the thread
                log.warning("runtime clean-up incomplete: %r", exc)
        self.loop_thread.stop(self.timeouts.shutdown)

    async def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        cleanup = self.timeouts.cleanup
        steps = []
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
        live = self.receiver.close()
        try:
            await asyncio.wait_for(self.backend.close(), self.timeouts.backend_close)
        except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001
            log.warning("backend close failed: %r; %d receives left without a result", exc, len(live))
        else:   # its memory unregistered: no write lands any more, so each live receive's result can go
            self.receiver.stopped(live)
        if self.metrics_server is not None:   # last: /health says "stopping" while the rest closes
            await self.metrics_server.close()

    def _health(self) -> tuple[bool, dict[str, Any]]:
        """What ``GET /health`` answers (on the loop): serving only while the control socket is bound and
        the runtime is not stopping."""
        body: dict[str, Any] = {"status": "ok", "engine_id": self.node.engine_id, "incarnation": self.incarnation,
                                "control": self.control_endpoint, "backend": self.backend.name}
        reason = ""
        if self._closed:
            reason = "stopping"
        elif self.server is None or not self.server.bound:
            reason = "control socket not bound"
        if reason:
            body.update(status="unavailable", reason=reason)
        return not reason, body

    def on_stop(self, closer: Callable[[], Awaitable[None]]) -> None:
        """Await ``closer()`` on the loop when the runtime stops, within ``Timeouts.cleanup``: closes what
        an ``announce`` callback opened there (an HTTP client). Runs however the loop ends."""
        async def bounded() -> None:
            try:
                await asyncio.wait_for(closer(), self.timeouts.cleanup)
            except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - stopping goes on regardless
                log.warning("on_stop clean-up %r failed: %r", getattr(closer, "__name__", closer), exc)
        self.loop_thread.on_stop(bounded)

    def on_outcome(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` on the loop soon after a transfer ends, once its result is visible to
        ``pop_received``/``pop_outcomes`` (e.g. to wake a thread that would otherwise poll). Any thread."""
        self._outcome_listeners = (*self._outcome_listeners, listener)

    def _on_loop_exit(self, error: BaseException | None) -> None:
        self.bridge.close(error or BridgeClosed("loop thread exited"))

    def __enter__(self) -> "Runtime":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def set_identity(self, identity: Identity) -> None:
        """Say who this runtime is in its engine (role, TP/DP rank and size, model fingerprint): what a
        ``TopologyRequest`` is answered with. Any thread, before ``start`` so that no peer ever learns
        the default; ``ConfigError`` for an impossible identity."""
        if not isinstance(identity, Identity):
            raise ConfigError(f"identity must be an aiolayer.Identity, got {type(identity).__name__}")
        identity.check()
        self.identity = identity

    # --- both sides: the local KV memory ----------------------------------------------------------

    def register_kv_memory(self, k_base: list[int], v_base: list[int], block_bytes: int, num_blocks: int,
                           *, kv_heads: int = 0, geometry: HeadGeometry | None = None,
                           host_memory: bool = False) -> None:
        """Register this process's paged KV caches: the target of peers' writes (D), or their source (P).

        Per layer, block ``b`` of K is at ``k_base + b * block_bytes``, likewise for V. Where one
        tensor holds both (each block K and V together, vLLM's CPU layout), pass 0 as V bases.

        ``kv_heads`` and ``geometry`` (tokens per block, bytes per head, NHD/HND) describe a block's
        local heads; with them, peers of another TP size can write or be written head slices
        (``TransferSpec.route``). Without them only whole blocks move. ``host_memory``: the bases are
        host addresses this process may read, so sampled integrity checks run here (never set it for
        device memory). Blocks until registered.
        """
        check_geometry(block_bytes, kv_heads, geometry)
        self.loop_thread.call(self._register_layout(k_base, v_base, block_bytes, num_blocks, kv_heads, geometry,
                                                    host_memory), timeout=self.timeouts.shutdown)

    async def _register_layout(self, k_base: Sequence[int], v_base: Sequence[int], block_bytes: int, num_blocks: int,
                               kv_heads: int = 0, geometry: HeadGeometry | None = None, host: bool = False) -> None:
        span = num_blocks * block_bytes
        for base in list(k_base) + list(v_base) if not self._hooks.refuse_writes else ():
            if base:   # a V base of 0: K and V share one tensor per layer
                self.backend.register(int(base), span)
        self._running_sender().set_local_layout(k_base, v_base, block_bytes, num_blocks, kv_heads, geometry, host)
        reply = m.LayoutReply(
            engine_id=self.node.engine_id, incarnation=self.incarnation, session=self.backend.session,
            block_bytes=block_bytes, num_blocks=num_blocks, digests=list(VERIFIES),
            layers=[m.LayerRegion(int(k), int(v)) for k, v in zip(k_base, v_base)])
        if geometry is not None:
            reply = msgspec.structs.replace(reply, kv_heads=kv_heads, block_size=geometry.block_size,
                                            head_bytes=geometry.head_bytes, kv_layout=geometry.layout,
                                            kv_interior=geometry.interior)
        self.layout_reply = reply

    def set_integrity_sample(self, share: float) -> None:
        """P: from now on check this share of layers end to end (``NodeConfig.integrity_sample``)."""
        if not 0.0 <= share <= 1.0:
            raise ConfigError(f"integrity_sample must be a share in 0..1, got {share}")
        self._running_sender().integrity_sample = share   # one float, read by the loop per transfer

    # --- P: send (the forward thread; never blocks) ---------------------------------------------

    def begin_step(self, specs: list[TransferSpec]) -> Step:
        """Hand one forward step's transfers over; then ``step.layer_ready(i)`` per layer, ``step.end()``.

        Raises at once (nothing queued) when the runtime cannot take them; a bad spec fails that
        transfer alone, with its outcome in ``pop_outcomes``."""
        sender = self._running_sender()
        step_id = next(self._steps)
        return sender.begin_step(step_id, specs)

    def cancel_send(self, transfer_id: str, reason: str) -> None:
        """Stop a send (its source blocks are needed back): it fails, never says DONE; never raises."""
        if self.sender is not None:
            self.sender.cancel(transfer_id, reason)

    def refuse_send(self, spec: TransferSpec, reason: str) -> None:
        """Fail a send without writing anything (the engine found it cannot be served correctly, e.g. a
        plan made for another tensor-parallel size): its outcome at once, FAILED with ``reason`` to D (so
        D learns now, not at its deadline), its source released. Forward thread; never blocks."""
        self._running_sender().refuse(spec, reason)

    def pop_outcomes(self) -> list[Outcome]:
        return [] if self.sender is None else self.sender.pop_outcomes()

    def pop_released(self) -> list[str]:
        """Transfer ids whose source blocks no write reads any more: the engine may reuse them."""
        return [] if self.sender is None else self.sender.pop_released()

    def wait_outcome(self, transfer_id: str, timeout: float) -> Outcome:
        """Block until the send's outcome is known (never from the forward thread)."""
        self.loop_thread.not_on_loop("wait_outcome")
        return self._running_sender().wait(transfer_id, timeout)

    def _running_sender(self) -> Sender:
        if self.sender is None:
            raise RuntimeStateError("runtime not started")
        return self.sender

    # --- metrics ---------------------------------------------------------------------------------

    async def _publish_metrics(self) -> None:
        """Rebuild the snapshot other threads read every ``METRICS_EVERY_S`` (levels, queues); counts
        are also republished as outcomes become visible, just before (``_republish_metrics``)."""
        while True:
            await asyncio.sleep(METRICS_EVERY_S)
            self._republish_metrics()

    def _republish_metrics(self) -> None:
        """On the loop: a new snapshot, swapped in whole (other threads only ever read the attribute)."""
        try:
            self.published_metrics = snapshot(self)
        except Exception:  # keep the last one; a stale figure beats none
            log.exception("metrics snapshot failed")

    def _outcome(self) -> None:
        """On the loop, just before results become visible (D: each; P: a pass's together): figures, then listeners."""
        self._republish_metrics()
        loop = asyncio.get_running_loop()
        for listener in self._outcome_listeners:   # soon: after the caller made the result visible
            loop.call_soon(listener)

    async def _scrape(self) -> bytes:
        return render(snapshot(self))

    def metrics_snapshot(self) -> dict[str, Any]:
        """Every figure of the metrics as plain data, taken on the loop (from any other thread)."""
        async def take() -> dict[str, Any]:
            return snapshot(self)
        taken: dict[str, Any] = self.loop_thread.call(take(), timeout=self.timeouts.control_call)
        return taken

    def debug_tables(self) -> dict[str, int]:
        """Sizes of the per-transfer and per-peer tables (``control_clients``, ``layout_*``, ``sender_*``,
        ``receiver_*``, ``backend_*``): a plain dict, for leak reports. Not part of the embedding API;
        read from any thread, the sizes are each a moment's (a report compares two snapshots)."""
        parts = (("control_", self.peers), ("layout_", self.layouts), ("sender_", self.sender),
                 ("receiver_", self.receiver), ("backend_", self.backend))
        return {prefix + name: size for prefix, part in parts if part is not None
                for name, size in part.table_sizes().items()}

    def metrics_text(self) -> str:
        """The Prometheus text exposition, as ``GET /metrics`` serves it."""
        text: bytes = self.loop_thread.call(self._scrape(), timeout=self.timeouts.control_call)
        return text.decode()

    # --- synchronous helpers for non-loop threads (tools, tests, the benchmark) ---------------

    def request(self, endpoint: str, msg: m.Message, timeout: float | None = None) -> m.Message:
        """Send one control request from a non-loop thread and wait for the reply (bounded)."""
        limit = self.timeouts.control_call if timeout is None else timeout

        async def call() -> m.Message:
            if self.peers is None:
                raise RuntimeStateError("runtime not started")
            client = await self.peers.get(endpoint)
            return await client.call(msg, timeout=limit)

        reply: m.Message = self.loop_thread.call(call(), timeout=limit + self.timeouts.cleanup)
        return reply
