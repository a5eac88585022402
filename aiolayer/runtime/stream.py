"""P's layer streaming: one started transfer's layers, as the forward hands them over, into backend writes.

Split off ``sender`` so that the sender keeps the transfer's life (start, abort, DONE/FAILED, the
fence) and this module the data path. Errors here are typed (``errors.TransferStopped`` and its
``LayerWriteFailed``); the backend's own are mapped once, at the write (``errors.map_errors``).
The sender turns them into the outcome's reason where it publishes it.

The writes of one transfer run in a TaskGroup and never raise there: a failed layer comes back as
its ``LayerWriteFailed`` value, so its siblings already submitted run to their end (each may still
land: cancelling it would not stop the bytes, only our knowledge of them).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from .. import compat
from ..config import Timeouts
from ..errors import AiolayerError, DeadlineExceeded, LayerWriteFailed, TransferStopped, TransferTimeout, map_errors
from .events import wait_event
from .fence import Request
from .spec import LayerTiming, LocalLayout, layer_runs

log = logging.getLogger(__name__)


class LayerStreamer:
    def __init__(self, backend, timeouts: Timeouts, deadlines: collections.Counter[str]) -> None:
        self.backend = backend
        self.timeouts = timeouts
        self.deadlines = deadlines   # the sender's counter of deadlines hit, by phase (metrics)

    async def stream(self, req: Request, local: LocalLayout, layout) -> float:
        """Submit each layer as it arrives; returns when every write settled (perf_counter).

        Raises ``TransferStopped`` (``settled_s`` set) when the transfer stopped (abort, cancel), a
        layer came late, or a write failed: the first of those, in that order."""
        t = self.timeouts
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
                except DeadlineExceeded as exc:   # first: it is a TimeoutError too (wait_event's layer_event)
                    self.deadlines[exc.phase] += 1
                    reason = str(exc)
                    break
                except TimeoutError:
                    self.deadlines["layer_gap"] += 1
                    reason = f"layer_gap: no next layer within {t.layer_gap:g}s"
                    break
                if req.aborted or any(w.done() and w.result() for w in writes):
                    break  # stopped, or a write failed already: submit no more layers
                held.append((layer, handed))
                if req.spec.layerwise or index == local.num_layers - 1:
                    for layer, handed in held:
                        writes.append(group.create_task(self._written(req, local, layout, layer, handed)))
                    held.clear()
        settled = time.perf_counter()
        if req.aborted or reason:
            raise TransferStopped(req.aborted or reason, settled)
        failed = [w.result() for w in writes if w.result()]
        if failed:
            failed[0].settled_s = settled
            raise failed[0]
        return settled

    async def _written(self, req: Request, local: LocalLayout, layout, layer: int,
                       handed: float) -> LayerWriteFailed | None:
        """``write`` for the TaskGroup: its failure as a value, so that it cancels no sibling."""
        try:
            await self.write(req, local, layout, layer, handed)
        except LayerWriteFailed as exc:
            return exc
        return None

    async def write(self, req: Request, local: LocalLayout, layout, layer: int, handed: float) -> None:
        """One layer's K and V runs; ``LayerWriteFailed`` on any error (a backend bug too: the
        transfer fails, its siblings go on). Runs that may still land go to ``req.pending`` (the fence)."""
        try:
            with map_errors(lambda exc: LayerWriteFailed(layer, exc)):
                src, dst, lengths = layer_runs(local, req.runs, req.spans, layout, layer)
                submitted = time.perf_counter()
                await self.backend.write(layout.session, src, dst, lengths, self.timeouts.layer_write)
        except LayerWriteFailed as exc:
            req.pending.extend(exc.pending)
            if isinstance(exc.cause, TransferTimeout):
                self.deadlines["layer_write"] += 1
            elif not isinstance(exc.cause, AiolayerError):
                log.error("transfer %s: layer %d write raised", req.spec.transfer_id, layer, exc_info=exc.cause)
            raise
        req.timings.append(LayerTiming(layer, handed, submitted, time.perf_counter()))
        req.bytes += int(lengths.sum())
