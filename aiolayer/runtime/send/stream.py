"""P's layer streaming: one started transfer's layers, as the forward hands them over, into backend writes.

Split off ``sender`` so that the sender keeps the transfer's life (start, abort, DONE/FAILED, the
fence) and this module the data path. Errors here are typed (``errors.TransferStopped`` and its
``LayerWriteFailed``); the backend's own are mapped once, at the write.
The sender turns them into the outcome's reason where it publishes it.

No write is submitted once D's window for the transfer ended (``RemoteLayout.write_by``): D may free
the blocks after it without P's word. A write's deadline is cut to that end too, because a backend may
hold runs back until their deadline (a target's cap on runs in flight, a segment being opened): held
past the window, they would still go out after it.

The writes of one transfer run in a TaskGroup and never raise there: a failed layer is recorded as
its ``LayerWriteFailed`` value, so its siblings already submitted run to their end (each may still
land: cancelling it would not stop the bytes, only our knowledge of them).

This runs once per (transfer, layer), thousands of times a second with head slices: every layer's
addresses are computed in one numpy pass per transfer (``LayerPlan``), a layer already queued is
taken without setting up a timeout, and a failure is seen through a list, not by walking the writes.
With a backend that has ``start_write`` (Mooncake), the layers that are ready together (queued
before the loop came to them, or held for bulk) go as ONE write started with no task; a failure
of it is reported as its first layer's. It is in ``req.pending`` (the sender's fence) from its
start, so that however the stream ends, its source is not reused while it may still land.
Each task, coroutine and future alive per write was also what the garbage collector walked: with
every layer its own task, it took half the loop's CPU.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import operator
import time
from typing import Any, Callable

import numpy as np

from ... import compat
from ...backends.base import StartWrite, TransferBackend
from ...config import Timeouts
from ...errors import AiolayerError, BackendError, DeadlineExceeded, LayerWriteFailed, TransferStopped, TransferTimeout
from ...protocol.plan import BlockRuns, Spans, run_addresses
from .events import wait_event
from .fence import LayerItem, Request
from ..spec import LayerTiming, LocalLayout, RemoteLayout, layer_runs

log = logging.getLogger(__name__)

# Above this many addresses (layers x runs) per transfer, each layer's are computed when it is
# written instead (a long NHD prompt has one run per token and head slice: megabytes per transfer).
_PLAN_MAX = 1 << 15
_Rows = tuple[np.ndarray, np.ndarray, np.ndarray, int]   # (src, dst, lengths, bytes)
_Held = list[tuple[int, float]]                          # layers ready to write: (layer, when handed over)


class LayerPlan:
    """Every layer's (src, dst, lengths) as ``layer_runs`` gives them, computed once per transfer."""

    __slots__ = ("_args", "_rows")

    def __init__(self, local: LocalLayout, runs: BlockRuns | None, spans: Spans | None, layout: RemoteLayout) -> None:
        self._args = (local, runs, spans, layout)
        self._rows: _Rows | None = None
        split = local.v_base != 0   # per layer: K and V in separate tensors (else one plane)
        if not (split.all() or not split.any()):
            return   # mixed: layer_runs decides per layer
        rel = spans if spans is not None or runs is None else run_addresses(runs, 0, 0, local.block_bytes)
        if rel is None:   # check_layout gives spans wherever the blocks do not pair
            return
        planes = [(local.k_base, layout.k_base)] + ([(local.v_base, layout.v_base)] if split.all() else [])
        if local.num_layers * len(planes) * len(rel[2]) > _PLAN_MAX:
            return

        def col(bases: np.ndarray) -> np.ndarray:   # as a column
            return np.asarray(bases, dtype=np.int64)[:, None]

        src = np.concatenate([rel[0][None, :] + col(mine) for mine, _ in planes], axis=1)
        dst = np.concatenate([rel[1][None, :] + col(theirs) for _, theirs in planes], axis=1)
        lengths = np.broadcast_to(np.concatenate([rel[2]] * len(planes)), src.shape)
        self._rows = (src, dst, lengths, int(lengths[0].sum()) if lengths.size else 0)

    def rows(self, layers: list[int]) -> _Rows:
        """Those layers' runs, layer after layer, as one (src, dst, lengths, bytes)."""
        if len(layers) == 1:
            return self.layer(layers[0])
        if self._rows is None:
            parts = [self.layer(layer) for layer in layers]
            return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                    np.concatenate([p[2] for p in parts]), sum(p[3] for p in parts))
        src, dst, lengths, nbytes = self._rows
        first = layers[0]
        in_order = layers == list(range(first, first + len(layers)))
        pick = slice(first, first + len(layers)) if in_order else np.asarray(layers)
        return src[pick].ravel(), dst[pick].ravel(), lengths[pick].ravel(), nbytes * len(layers)

    def layer(self, layer: int) -> _Rows:
        if self._rows is None:
            src, dst, lengths = layer_runs(*self._args, layer)
            return src, dst, lengths, int(lengths.sum())
        src, dst, lengths, nbytes = self._rows
        return src[layer], dst[layer], lengths[layer], nbytes


def _nothing(req: Request, layers: list[int], last: bool) -> None:
    return None


class LayerStreamer:
    def __init__(self, backend: TransferBackend, timeouts: Timeouts, deadlines: collections.Counter[str]) -> None:
        self.backend = backend
        self.timeouts = timeouts
        self.deadlines = deadlines   # the sender's counter of deadlines hit, by phase (metrics)
        # A backend with ``start_write`` (Mooncake) takes the layers ready together as ONE write,
        # started with no task; any other, each layer as its own write in its own task.
        self._start: StartWrite | None = getattr(backend, "start_write", None)
        # A backend that names a peer process by more than its session (Mooncake: ``target_for``)
        self._target_for: Callable[[str, str], str] = getattr(backend, "target_for", lambda session, _: session)
        # called as a transfer's layers are submitted (their source is final from then on), and once more,
        # with no layers and ``last``, once all were
        self.submitted: Callable[[Request, list[int], bool], None] = _nothing

    async def stream(self, req: Request, local: LocalLayout, layout: RemoteLayout) -> float:
        """Submit each layer as it arrives; returns when every write settled (perf_counter).

        Raises ``TransferStopped`` (``settled_s`` set) when the transfer stopped (abort, cancel), a
        layer came late, a write failed, or one is still unresolved past its deadline: the first of
        those, in that order (of writes: the first submitted). Whatever ends it (a bug, a device
        event's ``query`` raising too), it returns or raises only once every write started with no
        task settled or outlived its deadline (``_settle``); such a write is in ``req.pending``, which
        the sender's fence waits for before the source may be reused or D told FAILED."""
        sink = _Sink(req, LayerPlan(local, req.runs, req.spans, layout), layout,
                     self._target_for(layout.session, layout.incarnation))
        cancelled, unresolved = False, ""
        try:
            reason = await self._layers(req, local.num_layers, sink)
        except asyncio.CancelledError:
            cancelled = True   # the runtime stops: no wait here, the fence holds what is in flight
            raise
        finally:
            if not cancelled:
                unresolved = await self._settle(sink)
        settled = time.perf_counter()
        if req.aborted or reason:
            raise TransferStopped(req.aborted or reason, settled)
        if sink.failed:
            first = min(sink.failed, key=lambda f: f[0])[1]
            first.settled_s = settled
            raise first
        if unresolved:
            raise TransferStopped(unresolved, settled)
        return settled

    async def _layers(self, req: Request, left: int, sink: "_Sink") -> str:
        """Every layer into writes as it arrives; the reason the transfer stopped early, "" if not.

        An error that is no stop (a bug, a device event's ``query`` raising) is raised only once
        the TaskGroup ended: the writes already submitted run to their end, not cancelled (that
        would not stop the bytes, only our knowledge of them)."""
        error: Exception | None = None
        async with compat.TaskGroup() as group:
            try:
                reason = await self._feed(req, left, sink, group)
            except Exception as exc:  # noqa: BLE001 - raised below, once the writes ended
                error = exc
        if error is not None:
            raise error
        return reason

    async def _feed(self, req: Request, left: int, sink: "_Sink", group: compat.TaskGroup) -> str:
        held: _Held = []   # layers ready but not yet submitted
        seen = bytearray(left)   # each layer once: a repeat or a stray number would end in DONE over a hole
        reason = ""
        layerwise = req.spec.layerwise
        each = layerwise and self._start is None   # no start_write: every layer its own write (task)
        while left:
            try:
                # every layer handed over already, taken at once: a step's every transfer reads
                # every layer, and a coroutine or a full loop turn per layer showed in the profile
                items = req.take_layers(left)
                if not items:
                    item = await self._next_layer(req, sink)
                    if item is None:
                        reason = req.aborted
                        break
                    if sink.failed:
                        break   # a write failed while we waited: submit no more layers
                    items = [item]
                for entry, event, handed in items:
                    layer, reason = _checked_layer(entry, seen)
                    if reason:
                        break
                    if not event.query():
                        if held and layerwise:   # what is ready goes before we wait
                            self._submit(group, sink, held)
                        await wait_event(event, self.timeouts.layer_event)
                        if req.aborted or sink.failed:
                            break
                    held.append((layer, handed))
                    left -= 1
                    if each:
                        self._submit(group, sink, held)
                if reason or req.aborted or sink.failed:
                    break  # a bad layer, stopped, or a write failed already: submit no more layers
                # with start_write, the layers ready together go as one write once no more is ready
                if held and (not left or (layerwise and not req.layer_ready)):
                    self._submit(group, sink, held)
            except DeadlineExceeded as exc:   # first: it is a TimeoutError too (wait_event's layer_event)
                self.deadlines[exc.phase] += 1
                reason = str(exc)
                break
            except TimeoutError:
                self.deadlines["layer_gap"] += 1
                reason = f"layer_gap: no next layer within {self.timeouts.layer_gap:g}s"
                break
        if not left and not reason and not sink.failed:
            self.submitted(req, [], True)
        return reason

    async def _settle(self, sink: "_Sink") -> str:
        """Wait for the writes started with no task, each of which the backend settles by its own
        deadline (``layer_write`` from its start): at most ``layer_write`` + ``cleanup`` from now.
        Those still in flight after that stay in ``req.pending`` and fail the transfer (the reason,
        "" when none): a write that did not settle is no write that landed."""
        req, t = sink.req, self.timeouts
        if sink.count:
            try:
                async with compat.timeout(t.layer_write + t.cleanup):
                    await sink.wait()
            except TimeoutError:
                self.deadlines["layer_write"] += 1
                log.error("transfer %s: %d writes unresolved past their deadline; the fence holds its source",
                          req.spec.transfer_id, sink.count)
                return f"layer_write: {sink.count} writes unresolved {t.layer_write + t.cleanup:g}s after the last"
        if sink.started:   # those that landed leave the fence's list: a done future holds nothing back
            req.pending[:] = [f for f in req.pending if not f.done() or f.cancelled()]
        return ""

    def _submit(self, group: compat.TaskGroup, sink: "_Sink", held: _Held) -> None:
        """The held layers into writes (one, with ``start_write``; else one task per layer); clears ``held``.
        ``DeadlineExceeded`` (``write_window``), submitting nothing, once D's window for them ended."""
        if time.monotonic() > sink.layout.write_by:
            raise _window_ended(sink.req, sink.layout, len(held))
        batches = [list(held)] if self._start is not None else [[h] for h in held]
        self.submitted(sink.req, [layer for layer, _ in held], False)
        held.clear()
        for layers in batches:
            order = sink.order
            sink.order += 1
            if not self._started(sink, layers, order):
                group.create_task(self._written(sink, layers, order))

    def _started(self, sink: "_Sink", layers: _Held, order: int) -> bool:
        """Start the write with no task (``start_write``): thousands of transfers x layers in flight
        would each hold a task, coroutines and frames. False: not started (no such method, or it
        needs ``write``, e.g. to open the target first)."""
        if self._start is None:
            return False
        try:
            src, dst, lengths, nbytes = sink.plan.rows([layer for layer, _ in layers])
            submitted = time.perf_counter()
            settled = self._start(sink.target, src, dst, lengths, self._write_timeout(sink))
        except Exception as cause:  # noqa: BLE001 - mapped, not swallowed
            sink.failed.append((order, self._failed(sink.req, layers[0][0], cause)))
            return True
        if settled is None:
            return False
        sink.add(settled, _Landed(self, sink, layers, submitted, nbytes, order))
        return True

    async def _next_layer(self, req: Request, sink: "_Sink") -> LayerItem | None:
        """The next layer to be handed over (call with none ready: ``take_layers`` took those), None
        once stopped; ``layer_gap`` bounds the wait, and D's window for the writes (``DeadlineExceeded``)."""
        if req.aborted:
            return None
        gap, window_left = self.timeouts.layer_gap, sink.layout.write_by - time.monotonic()
        try:
            async with compat.timeout(max(0.0, min(gap, window_left))):
                await req.next_arrival()
        except TimeoutError:
            if window_left < gap:
                raise _window_ended(req, sink.layout, 0) from None
            raise
        return None if req.aborted else req.take_layer()

    async def _written(self, sink: "_Sink", layers: _Held, order: int) -> None:
        """``write`` for the TaskGroup: its failure recorded as a value, so that it cancels no sibling."""
        try:
            await self.write(sink, layers)
        except LayerWriteFailed as exc:
            sink.failed.append((order, exc))

    async def write(self, sink: "_Sink", layers: _Held) -> None:
        """The layers' K and V runs as one backend write; ``LayerWriteFailed`` (of the first layer) on
        any error (a backend bug too: the transfer fails, its siblings go on). Runs that may still
        land go to ``req.pending`` (the fence)."""
        try:
            src, dst, lengths, nbytes = sink.plan.rows([layer for layer, _ in layers])
            submitted = time.perf_counter()
            await self.backend.write(sink.target, src, dst, lengths, self._write_timeout(sink))
        except Exception as cause:  # mapped, not swallowed; cancellation passes through
            raise self._failed(sink.req, layers[0][0], cause) from cause
        sink.landed(layers, submitted, nbytes)

    def _write_timeout(self, sink: "_Sink") -> float:
        """``layer_write``, or less: what is left of D's window (the backend submits nothing after it)."""
        return min(self.timeouts.layer_write, max(0.0, sink.layout.write_by - time.monotonic()))

    def _failed(self, req: Request, layer: int, cause: BaseException) -> LayerWriteFailed:
        """A layer's write failed: its runs that may still land go to the fence; counted, logged if a bug."""
        exc = LayerWriteFailed(layer, cause)
        exc.__cause__ = cause
        req.pending.extend(exc.pending)
        if isinstance(cause, TransferTimeout):
            self.deadlines["layer_write"] += 1
        elif not isinstance(cause, AiolayerError):
            log.error("transfer %s: layer %d write raised", req.spec.transfer_id, layer, exc_info=cause)
        return exc


def _checked_layer(entry: object, seen: bytearray) -> tuple[int, str]:
    """The layer number the forward handed over, marked seen; or why it is none the transfer can take."""
    try:
        layer = operator.index(entry)   # type: ignore[arg-type]  # an int, a numpy integer
    except TypeError:
        return -1, f"layer {entry!r:.100} handed over: not a layer number"
    if not 0 <= layer < len(seen):
        return -1, f"layer {layer} handed over: the model has layers 0 to {len(seen) - 1}"
    if seen[layer]:
        return -1, f"layer {layer} handed over twice"
    seen[layer] = 1
    return layer, ""


def _window_ended(req: Request, layout: RemoteLayout, held: int) -> DeadlineExceeded:
    return DeadlineExceeded("write_window", layout.window, f"D at {layout.endpoint} takes no writes of "
                            f"{req.spec.transfer_id} after it ({held} layer(s) ready, not written)")


class _Sink:
    """One transfer's writes: their failures, in (submission order, failure) pairs as they end, and
    the futures of those started with no task (``wait`` returns once every one settled). Each such
    future is in ``req.pending`` from its start: the sender's fence never releases the source, nor
    tells D FAILED, while one may still land, however the stream ended."""

    __slots__ = ("req", "plan", "layout", "target", "failed", "order", "count", "started", "waiter")

    def __init__(self, req: Request, plan: LayerPlan, layout: RemoteLayout, target: str) -> None:
        self.req, self.plan, self.layout, self.target = req, plan, layout, target
        self.failed: list[tuple[int, LayerWriteFailed]] = []
        self.order = 0   # writes submitted so far
        self.count = 0   # task-less writes not settled yet
        self.started = 0   # task-less writes started
        self.waiter: asyncio.Future[None] | None = None

    def landed(self, layers: _Held, submitted: float, nbytes: int) -> None:
        now = time.perf_counter()
        self.req.timings.extend(LayerTiming(layer, handed, submitted, now) for layer, handed in layers)
        self.req.bytes += nbytes

    def add(self, settled: asyncio.Future[Any], landed: "_Landed") -> None:
        self.count += 1
        self.started += 1
        self.req.pending.append(settled)
        settled.add_done_callback(landed)

    def one_done(self) -> None:
        self.count -= 1
        if not self.count and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def wait(self) -> None:
        if self.count:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter


class _Landed:
    """A task-less write's ending (its future's done callback), as ``LayerStreamer.write`` ends one."""

    __slots__ = ("streamer", "sink", "layers", "submitted", "nbytes", "order")

    def __init__(self, streamer: LayerStreamer, sink: _Sink, layers: _Held, submitted: float, nbytes: int,
                 order: int) -> None:
        self.streamer, self.sink, self.layers = streamer, sink, layers
        self.submitted, self.nbytes, self.order = submitted, nbytes, order

    def __call__(self, settled: asyncio.Future[Any]) -> None:
        sink = self.sink
        try:
            cause = BackendError("the write's future was cancelled") if settled.cancelled() else settled.exception()
            if cause is not None:
                failed = self.streamer._failed(sink.req, self.layers[0][0], cause)   # noqa: SLF001 - its own callback
                sink.failed.append((self.order, failed))
            else:
                sink.landed(self.layers, self.submitted, self.nbytes)
        finally:
            sink.one_done()
