"""P side: step plans and "layer L is written" items in; layer writes out; DONE or FAILED to D.

The forward thread calls ``begin_step``, ``layer_ready`` and ``end_step``; each only appends to the
bridge. On the loop, every request of a step gets one coroutine that awaits D's layout, then for
each layer awaits its device event and submits that layer's K and V runs. After the last layer it
waits for every write to settle and tells D: DONE, or FAILED with the reason. A request's outcome
is published only after all of its writes settled, so its source blocks are safe to reuse then.
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
from ..errors import AiolayerError, DeadlineExceeded, LayoutMismatch, RuntimeStateError
from ..protocol import messages as m
from ..protocol.plan import BlockRuns, check_block_bounds, merge_runs, run_addresses
from ..protocol.state import State, sender_transfer
from .bridge import LayerBridge
from .control import ControlPeers
from .events import record_event, wait_event
from .metadata import LayoutCache

log = logging.getLogger(__name__)


class TransferSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One request's transfer: our source blocks -> D's destination blocks."""

    transfer_id: str
    peer: str                     # D's control endpoint
    src_blocks: list[int]
    dst_blocks: list[int]
    dst_incarnation: str = ""     # D's incarnation the blocks were allocated on ("" = any)
    layerwise: bool = True        # False: hold every layer and write them all after the last one


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
    layers: list[LayerTiming] = []


class LocalLayout(msgspec.Struct, frozen=True):
    k_base: np.ndarray
    v_base: np.ndarray
    block_bytes: int
    num_blocks: int

    @property
    def num_layers(self) -> int:
        return int(self.k_base.shape[0])


class _Request:
    __slots__ = ("spec", "runs", "layers", "state", "timings", "bytes")

    def __init__(self, spec: TransferSpec, runs: BlockRuns) -> None:
        self.spec = spec
        self.runs = runs
        self.layers: asyncio.Queue = asyncio.Queue()
        self.state = sender_transfer()
        self.timings: list[LayerTiming] = []
        self.bytes = 0


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
        self._spawn = None
        self.active = 0

    # --- forward-thread API (never blocks) -------------------------------------------------

    def set_local_layout(self, k_base, v_base, block_bytes: int, num_blocks: int) -> None:
        self.local = LocalLayout(np.asarray(k_base, dtype=np.int64), np.asarray(v_base, dtype=np.int64),
                                 block_bytes, num_blocks)

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
        out = []
        while self._outcomes:
            out.append(self._outcomes.popleft())
        return out

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
            for req in self._steps.get(step, ()):
                req.layers.put_nowait((layer, event, handed))
        elif kind == "step":
            _, step, specs, _handed = item
            self._steps[step] = [self._start_request(spec) for spec in specs]
        elif kind == "end":
            self._steps.pop(item[1], None)

    def _start_request(self, spec: TransferSpec) -> _Request:
        runs = None
        try:
            check_block_bounds(spec.src_blocks, self.local.num_blocks, "source")
            runs = merge_runs(spec.src_blocks, spec.dst_blocks)
        except ValueError as exc:
            req = _Request(spec, merge_runs([], []))
            self._spawn(self._finish(req, str(exc), None), name=f"fail {spec.transfer_id}")
            return req
        req = _Request(spec, runs)
        self.layouts.prefetch(spec.peer)
        self.active += 1
        self._spawn(self._run_request(req), name=f"send {spec.transfer_id}")
        return req

    async def _run_request(self, req: _Request) -> None:
        reason = ""
        settled = None
        try:
            layout = await self.layouts.get(req.spec.peer, req.spec.dst_incarnation)
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
        await self._finish(req, reason, settled)

    def _check_layout(self, req: _Request, layout) -> None:
        local = self.local
        if layout.num_layers != local.num_layers or layout.block_bytes != local.block_bytes:
            raise LayoutMismatch(
                f"D has {layout.num_layers} layers of {layout.block_bytes}-byte blocks, "
                f"P has {local.num_layers} of {local.block_bytes}")
        check_block_bounds(req.spec.dst_blocks, layout.num_blocks, "destination")

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
                        layer, event, handed = await req.layers.get()
                    await wait_event(event, t.layer_event)
                except TimeoutError:
                    reason = f"layer_gap: no next layer within {t.layer_gap:g}s"
                    break
                except DeadlineExceeded as exc:
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
        return settled, reason or (errors[0] if errors else "")

    async def _write_layer(self, req: _Request, layout, layer: int, handed: float) -> str:
        """One layer's K and V runs; returns "" on success or the failure reason (never raises)."""
        local = self.local
        bb = local.block_bytes
        ks, kd, kl = run_addresses(req.runs, int(local.k_base[layer]), int(layout.k_base[layer]), bb)
        vs, vd, vl = run_addresses(req.runs, int(local.v_base[layer]), int(layout.v_base[layer]), bb)
        submitted = time.perf_counter()
        try:
            await self.backend.write(layout.session, np.concatenate((ks, vs)), np.concatenate((kd, vd)),
                                     np.concatenate((kl, vl)), self.timeouts.layer_write)
        except AiolayerError as exc:
            return f"layer {layer}: {type(exc).__name__}: {exc}"
        req.timings.append(LayerTiming(layer, handed, submitted, time.perf_counter()))
        req.bytes += int(kl.sum() + vl.sum())
        return ""

    async def _finish(self, req: _Request, reason: str, settled: float | None) -> None:
        """Tell D the outcome (bounded), then publish it locally."""
        spec = req.spec
        try:
            client = await self.peers.get(spec.peer)
            if not reason:
                req.state.apply("all_layers_written")
                msg = m.Done(transfer_id=spec.transfer_id, sender=self.engine_id,
                             incarnation=spec.dst_incarnation, layers=len(req.timings), bytes=req.bytes)
            else:
                msg = m.Failed(transfer_id=spec.transfer_id, sender=self.engine_id, reason=reason[:500])
            await client.call_with_retries(msg, self.timeouts.done_delivery)
        except AiolayerError as exc:
            reason = reason or f"DONE not delivered: {exc}"
            log.warning("transfer %s: could not tell D the outcome: %s", spec.transfer_id, exc)
        self._publish(req, reason, settled)

    def _publish(self, req: _Request, reason: str, settled: float | None) -> None:
        if req.state.terminal:
            return
        if reason:
            req.state.apply("fail", reason)
        else:
            req.state.apply("done_acked")
        now = time.perf_counter()
        outcome = Outcome(transfer_id=req.spec.transfer_id, ok=req.state.state is State.FINISHED,
                          reason=req.state.reason, bytes=req.bytes, finished_s=now,
                          writes_settled_s=settled or now, layers=sorted(req.timings, key=lambda x: x.layer))
        self._outcomes.append(outcome)
        waiter = self._waiters.get(req.spec.transfer_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(outcome)

    def _fail_unstarted(self, reason: str) -> None:
        for tid, fut in list(self._waiters.items()):
            if not fut.done():
                fut.set_result(Outcome(transfer_id=tid, ok=False, reason=reason, finished_s=time.perf_counter()))
