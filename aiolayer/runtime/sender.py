"""P side: step plans and "layer L is written" items in; layer writes out; DONE or FAILED to D.

The forward thread calls ``begin_step``, ``layer_ready`` and ``end_step``; each only appends to the
bridge. On the loop, every request of a step gets one coroutine that awaits D's layout, then for
each layer awaits its device event and submits that layer's K and V runs. After the last layer it
waits for every write to settle and tells D: DONE, or FAILED with the reason.

Fencing: a transfer id appears in ``pop_released`` only once no write reading its source blocks
can still be in flight. Usually that is when its outcome is published; after a write timed out
(the data may still land, notes/mooncake.md) it is when the backend saw that write end. D may
ask P to stop a transfer (``abort``): no layer is submitted after that, and the reply waits for the
writes already in flight.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time

import msgspec
import numpy as np

from .. import compat
from ..config import Timeouts
from ..errors import (AiolayerError, ConfigError, ControlRejected, DeadlineExceeded, LayoutMismatch,
                      RuntimeStateError, TransferTimeout)
from ..protocol import messages as m
from ..protocol.plan import (BlockRuns, HeadGeometry, RankRoute, check_block_bounds, merge_runs, run_addresses,
                             slice_addresses)
from ..protocol.state import State, sender_transfer
from ..stats import LatencyHistogram
from .bridge import LayerBridge
from .control import ControlPeers
from .events import record_event, wait_event
from .metadata import LayoutCache

log = logging.getLogger(__name__)
MAX_EARLY_ABORTS = 4096   # aborts kept for transfers not started yet: a stranger cannot grow it further


class TransferSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One request's transfer: our source blocks -> D's destination blocks."""

    transfer_id: str
    peer: str                     # D's control endpoint
    src_blocks: list[int]
    dst_blocks: list[int]
    dst_incarnation: str          # D's incarnation the blocks were allocated on: never write to another
    token: str                    # the transfer's secret: D accepts our layout request and DONE only with it
    layerwise: bool = True        # False: hold every layer and write them all after the last one
    # Head slice: copy the route's heads of every block (P and D ranks of other TP sizes, see
    # protocol.plan.map_ranks); both sides must have published their head geometry. None: whole blocks.
    route: RankRoute | None = None

    def __post_init__(self) -> None:
        if not self.dst_incarnation:
            raise ConfigError(f"transfer {self.transfer_id}: dst_incarnation is required (D's AllocReply)")
        if not self.token:
            raise ConfigError(f"transfer {self.transfer_id}: token is required (minted with the transfer)")


class LayerTiming(msgspec.Struct, array_like=True):
    layer: int
    handed_s: float               # perf_counter when the forward thread handed it over
    submitted_s: float
    landed_s: float


class Outcome(msgspec.Struct, kw_only=True):
    transfer_id: str
    ok: bool
    reason: str = ""
    bytes: int = 0
    finished_s: float = 0.0       # perf_counter when DONE was acknowledged (or the failure decided)
    writes_settled_s: float = 0.0
    source_released: bool = True  # False: a timed-out write may still read the source (see pop_released)
    layers: list[LayerTiming] = []


class LocalLayout(msgspec.Struct, frozen=True):
    k_base: np.ndarray
    v_base: np.ndarray
    block_bytes: int
    num_blocks: int
    heads: int = 0                          # local KV heads per block (0: geometry not published)
    geometry: HeadGeometry | None = None    # what a head slice needs: tokens per block, head bytes, layout

    @property
    def num_layers(self) -> int:
        return int(self.k_base.shape[0])


def check_geometry(block_bytes: int, kv_heads: int, geometry: HeadGeometry | None, v_base) -> None:
    """A published head geometry must describe the blocks exactly; ``ConfigError`` otherwise."""
    if geometry is None:
        if kv_heads:
            raise ConfigError("kv_heads given without its geometry (block_size, head_bytes, layout)")
        return
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, (int, np.integer)) or kv_heads < 1:
        raise ConfigError(f"kv_heads must be a positive integer with a geometry, got {kv_heads!r}")
    if kv_heads * geometry.block_size * geometry.head_bytes != block_bytes:
        raise ConfigError(f"{kv_heads} heads x {geometry.block_size} tokens x {geometry.head_bytes} bytes "
                          f"is not the block size {block_bytes}")
    if any(int(v) == 0 for v in v_base):
        raise ConfigError("a head geometry needs K and V in separate tensors (no V base of 0)")


class _Request:
    __slots__ = ("spec", "runs", "spans", "layers", "state", "timings", "bytes", "aborted", "pending", "quiet")

    def __init__(self, spec: TransferSpec, runs: BlockRuns) -> None:
        self.spec = spec
        self.runs = runs
        self.spans: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None   # head slice, from layer bases
        self.layers: asyncio.Queue = asyncio.Queue()   # (layer, event, handed) items; None = abort
        self.state = sender_transfer()
        self.timings: list[LayerTiming] = []
        self.bytes = 0
        self.aborted = ""                              # D's reason, once D asked us to stop
        self.pending: list[asyncio.Future] = []        # timed-out writes that may still land
        self.quiet = asyncio.Event()                   # set once no write of ours can be in flight

    def abort(self, reason: str) -> None:
        if not self.aborted:
            self.aborted = reason or "aborted by D"
            self.layers.put_nowait(None)


class Sender:
    def __init__(self, *, engine_id: str, bridge: LayerBridge, backend, peers: ControlPeers,
                 layouts: LayoutCache, timeouts: Timeouts) -> None:
        self.engine_id = engine_id
        self.bridge = bridge
        self.backend = backend
        self.peers = peers
        self.layouts = layouts
        self.timeouts = timeouts
        self.local: LocalLayout | None = None
        self._steps: dict[int, list[_Request]] = {}
        self._waiters: dict[str, concurrent.futures.Future] = {}
        self._outcomes: collections.deque[Outcome] = collections.deque()
        self._released: collections.deque[str] = collections.deque()
        self._live: dict[str, _Request] = {}          # until its writes are quiet
        # abort before the step came, by (transfer id, token): refuse the step then; keyed by token
        # too, so a stranger's abort can neither stop the transfer nor shadow the real abort
        self._aborted_early: dict[tuple[str, str], float] = {}
        self._spawn = None
        self.active = 0
        self.fence_timeouts = 0
        # for metrics (read on the loop): outcomes, bytes written, deadlines hit, hand-off latency
        self.outcome_counts: collections.Counter[str] = collections.Counter()
        self.bytes_sent = 0
        self.deadlines: collections.Counter[str] = collections.Counter()
        self.handoff = LatencyHistogram()

    # --- forward-thread API (never blocks) -------------------------------------------------

    def set_local_layout(self, k_base, v_base, block_bytes: int, num_blocks: int, heads: int = 0,
                         geometry: HeadGeometry | None = None) -> None:
        check_geometry(block_bytes, heads, geometry, v_base)
        self.local = LocalLayout(np.asarray(k_base, dtype=np.int64), np.asarray(v_base, dtype=np.int64),
                                 block_bytes, num_blocks, heads, geometry)

    def begin_step(self, step: int, specs: list[TransferSpec]) -> None:
        if self.local is None:
            raise RuntimeStateError("register the KV caches before the first step")
        added = [spec.transfer_id for spec in specs if spec.transfer_id not in self._waiters]
        for tid in added:  # before the put: the loop may publish the outcome at once
            self._waiters[tid] = concurrent.futures.Future()
        try:
            self.bridge.put(("step", step, specs, time.perf_counter()))
        except RuntimeStateError:
            for tid in added:
                self._waiters.pop(tid, None)
            raise

    def layer_ready(self, step: int, layer: int) -> None:
        self.bridge.put(("layer", step, layer, record_event(), time.perf_counter()))

    def end_step(self, step: int) -> None:
        self.bridge.put(("end", step))

    # --- results (any thread) ----------------------------------------------------------------

    def pop_outcomes(self) -> list[Outcome]:
        """Outcomes published since the last call; popping one also forgets its ``wait`` slot."""
        outcomes = _drain(self._outcomes)
        for outcome in outcomes:
            self._waiters.pop(outcome.transfer_id, None)
        return outcomes

    def pop_released(self) -> list[str]:
        """Transfer ids whose source blocks no write can still read: safe to reuse now."""
        return _drain(self._released)

    def wait(self, transfer_id: str, timeout: float) -> Outcome:
        """Block until the transfer's outcome is known (never call this from the forward thread)."""
        fut = self._waiters.get(transfer_id)
        if fut is None:
            raise KeyError(transfer_id)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            raise DeadlineExceeded("wait", timeout, f"transfer {transfer_id}") from None
        finally:
            if fut.done():
                self._waiters.pop(transfer_id, None)

    # --- the loop side -----------------------------------------------------------------------

    async def run(self, spawn) -> None:
        """Drain the bridge until it is closed; owned by the runtime's TaskGroup."""
        self._spawn = spawn
        try:
            while True:
                batch = await self.bridge.drain()
                if not batch:
                    return
                for item in batch:
                    self._dispatch(item)
        finally:
            self.bridge.close("sender stopped")
            self._fail_unstarted("sender stopped")

    def _dispatch(self, item: tuple) -> None:
        kind = item[0]
        if kind == "layer":
            _, step, layer, event, handed = item
            self.handoff.observe(time.perf_counter() - handed)
            for req in self._steps.get(step, ()):
                req.layers.put_nowait((layer, event, handed))
        elif kind == "step":
            _, step, specs, _handed = item
            self._steps[step] = [self._start_request(spec) for spec in specs]
        elif kind == "end":
            self._steps.pop(item[1], None)

    def _start_request(self, spec: TransferSpec) -> _Request:
        try:
            check_block_bounds(spec.src_blocks, self.local.num_blocks, "source")
            req = _Request(spec, merge_runs(spec.src_blocks, spec.dst_blocks))
        except ValueError as exc:
            req = _Request(spec, merge_runs([], []))
            self._spawn(self._finish(req, str(exc), None), name=f"fail {spec.transfer_id}")
            return req
        if self._aborted_early.pop((spec.transfer_id, spec.token), None) is not None:
            self._spawn(self._finish(req, "aborted by D before it started", None), name=f"fail {spec.transfer_id}")
            return req
        self._live[spec.transfer_id] = req
        self.layouts.prefetch(spec.peer, (spec.transfer_id, spec.token))
        self.active += 1
        self._spawn(self._run_request(req), name=f"send {spec.transfer_id}")
        return req

    async def abort(self, transfer_id: str, reason: str, token: str) -> str:
        """D asks us to stop: submit nothing more, and return once no write is in flight.

        Only with the transfer's token: a stranger cannot stop another's transfer.
        """
        req = self._live.get(transfer_id)
        if req is None:
            now = time.monotonic()
            self._aborted_early = {k: e for k, e in self._aborted_early.items() if e > now}
            if len(self._aborted_early) >= MAX_EARLY_ABORTS:
                raise ControlRejected("busy", f"{MAX_EARLY_ABORTS} early aborts pending")
            self._aborted_early[(transfer_id, token)] = now + self.timeouts.receive  # unknown or already quiet
            return "stopped"
        if not m.same_token(token, req.spec.token):
            log.warning("transfer %s: abort with a wrong token refused", transfer_id)
            raise ControlRejected("auth", f"abort: no transfer {transfer_id} with this token")
        req.abort(reason)
        try:
            await asyncio.wait_for(req.quiet.wait(), self.timeouts.layer_write + self.timeouts.cleanup)
        except asyncio.TimeoutError:
            raise ControlRejected("settling", f"writes of {transfer_id} are still in flight") from None
        return "stopped"

    async def _run_request(self, req: _Request) -> None:
        reason = ""
        settled = None
        try:
            layout = await self.layouts.get(req.spec.peer, (req.spec.transfer_id, req.spec.token),
                                            req.spec.dst_incarnation)
            self._check_layout(req, layout)
            req.state.apply("layout_ready")
            settled, reason = await self._stream_layers(req, layout)
        except asyncio.CancelledError:
            self._publish(req, "runtime stopped", None)
            raise
        except AiolayerError as exc:
            reason = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - a bug must still end in a visible outcome
            log.exception("sender bug on transfer %s", req.spec.transfer_id)
            reason = f"internal error {type(exc).__name__}: {exc}"
        finally:
            self.active -= 1
        if reason and not req.aborted:
            self.layouts.invalidate(req.spec.peer)  # the peer may have restarted: fetch afresh next time
        await self._finish(req, reason, settled)

    def _check_layout(self, req: _Request, layout) -> None:
        local = self.local
        sliced = req.spec.route is not None   # then block sizes differ legitimately: the geometry must match
        if layout.num_layers != local.num_layers or (not sliced and layout.block_bytes != local.block_bytes):
            raise LayoutMismatch(
                f"D has {layout.num_layers} layers of {layout.block_bytes}-byte blocks, "
                f"P has {local.num_layers} of {local.block_bytes}")
        if bool((layout.v_base == 0).any()) != bool((local.v_base == 0).any()):
            raise LayoutMismatch("one side keeps K and V in separate tensors, the other in one")
        check_block_bounds(req.spec.dst_blocks, layout.num_blocks, "destination")
        if sliced:
            req.spans = self._route_spans(req, layout)

    def _route_spans(self, req: _Request, layout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The route's byte spans relative to each layer's bases: computed once per request."""
        local, route = self.local, req.spec.route
        geom = local.geometry
        if geom is None or not layout.kv_heads:
            side = "P" if geom is None else "D"
            raise LayoutMismatch(f"a head-slice route needs both sides' head geometry; {side} published none")
        theirs = (layout.block_size, layout.head_bytes, layout.kv_layout)
        if theirs != (geom.block_size, geom.head_bytes, geom.layout):
            raise LayoutMismatch(f"D's blocks are (tokens, head bytes, layout) {theirs}, P's "
                                 f"{(geom.block_size, geom.head_bytes, geom.layout)}")
        if layout.block_bytes != layout.kv_heads * geom.block_size * geom.head_bytes:
            raise LayoutMismatch(f"D's {layout.block_bytes}-byte blocks do not hold {layout.kv_heads} heads "
                                 f"of {geom.block_size} x {geom.head_bytes} bytes")
        try:
            return slice_addresses(req.runs, 0, 0, local.heads, layout.kv_heads, route, geom)
        except ValueError as exc:
            raise LayoutMismatch(f"route {route}: {exc}") from None

    async def _stream_layers(self, req: _Request, layout) -> tuple[float, str]:
        """Submit each layer as it arrives; returns (time all writes settled, failure reason)."""
        local, t = self.local, self.timeouts
        writes: list[asyncio.Task] = []
        held: list[tuple[int, float]] = []   # bulk: layers ready but not yet submitted
        reason = ""
        async with compat.TaskGroup() as group:
            for index in range(local.num_layers):
                try:
                    async with compat.timeout(t.layer_gap):
                        item = await req.layers.get()
                    if item is None:
                        reason = req.aborted
                        break
                    layer, event, handed = item
                    await wait_event(event, t.layer_event)
                except TimeoutError:
                    self.deadlines["layer_gap"] += 1
                    reason = f"layer_gap: no next layer within {t.layer_gap:g}s"
                    break
                except DeadlineExceeded as exc:
                    self.deadlines[exc.phase] += 1
                    reason = str(exc)
                    break
                if any(w.done() and w.result() for w in writes):
                    break  # a write failed already: submit no more layers
                held.append((layer, handed))
                if req.spec.layerwise or index == local.num_layers - 1:
                    for layer, handed in held:
                        writes.append(group.create_task(self._write_layer(req, layout, layer, handed)))
                    held.clear()
        settled = time.perf_counter()
        errors = [w.result() for w in writes if w.result()]
        return settled, req.aborted or reason or (errors[0] if errors else "")

    async def _write_layer(self, req: _Request, layout, layer: int, handed: float) -> str:
        """One layer's K and V runs; returns "" on success or the failure reason (never raises).

        A timed-out write leaves its settle futures in ``req.pending`` for the fence.
        """
        local = self.local
        bb = local.block_bytes
        planes = [(local.k_base, layout.k_base)]
        if local.v_base[layer]:   # 0: K and V share each block (one plane), as on vLLM's CPU backend
            planes.append((local.v_base, layout.v_base))
        if req.spans is not None:   # a head slice: spans precomputed per request, offset by this layer's bases
            rel_src, rel_dst, rel_len = req.spans
            src, dst, lengths = zip(*((rel_src + int(mine[layer]), rel_dst + int(theirs[layer]), rel_len)
                                      for mine, theirs in planes))
        else:
            src, dst, lengths = zip(*(run_addresses(req.runs, int(mine[layer]), int(theirs[layer]), bb)
                                      for mine, theirs in planes))
        lengths = np.concatenate(lengths)
        submitted = time.perf_counter()
        try:
            await self.backend.write(layout.session, np.concatenate(src), np.concatenate(dst), lengths,
                                     self.timeouts.layer_write)
        except TransferTimeout as exc:
            self.deadlines["layer_write"] += 1
            req.pending.extend(exc.pending)
            return f"layer {layer}: {type(exc).__name__}: {exc}"
        except AiolayerError as exc:
            return f"layer {layer}: {type(exc).__name__}: {exc}"
        req.timings.append(LayerTiming(layer, handed, submitted, time.perf_counter()))
        req.bytes += int(lengths.sum())
        return ""

    async def _finish(self, req: _Request, reason: str, settled: float | None) -> None:
        """Success: DONE acknowledged by D, then the outcome. Failure: the outcome at once, then
        FAILED to D once our writes are quiet, so D may reuse its blocks when it reads it."""
        spec = req.spec
        if reason:
            self._publish(req, reason, settled)
            try:
                await asyncio.wait_for(req.quiet.wait(), self.timeouts.quarantine + self.timeouts.cleanup)
            except asyncio.TimeoutError:
                pass  # still unresolved: D's own deadline and fence take over
            msg = m.Failed(transfer_id=spec.transfer_id, sender=self.engine_id, reason=reason[:500], token=spec.token)
            if req.quiet.is_set() and not req.aborted:
                await self._tell_d(spec, msg)
            return
        req.state.apply("all_layers_written")
        msg = m.Done(transfer_id=spec.transfer_id, sender=self.engine_id, incarnation=spec.dst_incarnation,
                     layers=len(req.timings), bytes=req.bytes, token=spec.token)
        error = await self._tell_d(spec, msg)
        self._publish(req, f"DONE not delivered: {error}" if error else "", settled)

    async def _tell_d(self, spec: TransferSpec, msg: m.Message) -> str:
        """Deliver DONE/FAILED with bounded retries; returns "" or what went wrong."""
        try:
            client = await self.peers.get(spec.peer)
            await client.call_with_retries(msg, self.timeouts.done_delivery)
        except AiolayerError as exc:
            log.warning("transfer %s: could not tell D %s: %s", spec.transfer_id, type(msg).__name__, exc)
            return f"{type(exc).__name__}: {exc}"
        return ""

    def _publish(self, req: _Request, reason: str, settled: float | None) -> None:
        if req.state.terminal:
            return
        if reason:
            req.state.apply("fail", reason)
        else:
            req.state.apply("done_acked")
        now = time.perf_counter()
        self.outcome_counts["finished" if req.state.state is State.FINISHED else "failed"] += 1
        self.bytes_sent += req.bytes
        if reason:
            log.warning("transfer %s failed: %s", req.spec.transfer_id, req.state.reason)
        pending = [f for f in req.pending if not f.done()]
        outcome = Outcome(transfer_id=req.spec.transfer_id, ok=req.state.state is State.FINISHED,
                          reason=req.state.reason, bytes=req.bytes, finished_s=now,
                          writes_settled_s=settled or now, source_released=not pending,
                          layers=sorted(req.timings, key=lambda x: x.layer))
        self._outcomes.append(outcome)
        waiter = self._waiters.get(req.spec.transfer_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(outcome)
        if pending:
            self._spawn(self._release_when_quiet(req, pending), name=f"fence {req.spec.transfer_id}")
        else:
            self._release(req)

    def _release(self, req: _Request) -> None:
        req.quiet.set()
        self._live.pop(req.spec.transfer_id, None)
        self._released.append(req.spec.transfer_id)

    async def _release_when_quiet(self, req: _Request, pending: list[asyncio.Future]) -> None:
        """Hold the source blocks until the backend saw every timed-out write end."""
        limit = self.timeouts.quarantine
        done, still = await asyncio.wait(pending, timeout=limit)
        if still:
            # Never hand back memory a write may still read: these blocks stay held, loudly, until the
            # backend sees those writes end (Mooncake drains refused writes to one peer at ~5 per second).
            self.fence_timeouts += 1
            log.error("transfer %s: %d writes still unresolved after %gs; its source blocks stay held",
                      req.spec.transfer_id, len(still), limit)
            req.quiet.set()
            self._live.pop(req.spec.transfer_id, None)
            await asyncio.wait(still)
            if any(f.cancelled() for f in still):   # the backend closed: nobody knows, keep them held
                return
        self._release(req)

    def _fail_unstarted(self, reason: str) -> None:
        for req in list(self._live.values()):
            req.quiet.set()
        for tid, fut in list(self._waiters.items()):
            if not fut.done():
                fut.set_result(Outcome(transfer_id=tid, ok=False, reason=reason, finished_s=time.perf_counter()))


def _drain(queue: collections.deque) -> list:
    out = []
    while queue:
        out.append(queue.popleft())
    return out
