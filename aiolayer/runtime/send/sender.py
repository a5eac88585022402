"""P side: step plans and "layer L is written" items in; layer writes out; DONE or FAILED to D.

The forward thread calls ``begin_step``, ``layer_ready`` and ``end_step``; each only appends to the
bridge. On the loop, every request of a step gets one coroutine that awaits D's layout, then for
each layer awaits its device event and submits that layer's K and V runs. After the last layer it
waits for every write to settle and tells D: DONE (those of one loop pass to one D in one frame,
``done_batch``), or FAILED with the reason. A DONE's outcome is D's verdict on it: ok only when D
answered that it took the transfer as written (``messages.done_verdict``), so P and D agree.

Fencing: a transfer id appears in ``pop_released`` only once no write reading its source blocks
can still be in flight. Usually that is when its outcome is published; after a write timed out
(the data may still land, docs/mooncake.md) it is when the backend saw that write end. D may
ask P to stop a transfer (``abort``), and P's engine may ``cancel`` one (it preempted the request):
no layer is submitted after that. ``stopped`` (the reply to D's abort) and FAILED both tell D that
no write of the transfer can land any more, so both wait until that is true; while a timed-out
write is unresolved D's abort gets Nack ``settling``, and if that lasts past ``quarantine`` D is
told nothing: its own deadline and fence take over, and P keeps the source held, loudly.

One transfer's trouble stays its own: a bad spec, or any error in its coroutines (each ``guarded``),
ends that transfer with a failed outcome and never reaches the runtime's TaskGroup. The layers stream
in ``stream``; how a transfer ends (DONE or FAILED, outcome, release) is ``ending``, a base of ``Sender``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np

from ...backends.base import TransferBackend
from ...config import Timeouts
from ...errors import AiolayerError, ControlRejected, MetadataError, RuntimeStateError, TransferStopped
from ...protocol import messages as m
from ...protocol.codes import AckDetail, NackCode
from ...protocol.plan import BlockRuns, HeadGeometry, check_block_bounds, check_geometry, merge_runs
from ...protocol.state import Event
from ...stats import LatencyHistogram
from .bridge import LayerBridge, LayerPace
from ..control.plane import ControlPeers
from .done_batch import DoneBatcher
from .ending import TransferEnding
from ..api import Step
from .events import DeviceStep, device_recorder, record_event
from .fence import MAX_EARLY_ABORTS, EarlyAborts, Request, StepLayers, guarded
from ..integrity import pick_digest
from ..loop import Spawn, not_running
from .metadata import LayoutCache
from .results import Results
from ..spec import LayerTiming, LocalLayout, Outcome, RemoteLayout, TransferSpec, check_layout, check_spec
from .stream import LayerStreamer

__all__ = ["MAX_EARLY_ABORTS", "LayerTiming", "LocalLayout", "Outcome", "Sender", "TransferSpec", "check_geometry"]
log = logging.getLogger(__name__)
_NO_RUNS = merge_runs([], [])


class Sender(TransferEnding):
    def __init__(self, *, engine_id: str, bridge: LayerBridge, backend: TransferBackend, peers: ControlPeers,
                 layouts: LayoutCache, timeouts: Timeouts, on_outcome: Callable[[], None] | None = None,
                 integrity_sample: float = 0.0) -> None:
        self.engine_id = engine_id
        self.bridge = bridge
        self.backend = backend
        self.peers = peers
        self.layouts = layouts
        self.timeouts = timeouts
        self.local: LocalLayout | None = None
        self.integrity_sample = integrity_sample    # share of layers checked end to end (integrity.py)
        self.integrity_checks = 0
        self.early_checks = 0          # early checks D took (parts of a check sent before the DONE)
        self.early_refused: dict[str, float] = {}   # older Ds (Nack decode): sent none for a while
        self._steps: dict[int, StepLayers] = {}     # a begun step's layers, read by its transfers
        self.results = Results(on_outcome)
        r = self.results   # the same containers under the names the soak report reads (it sizes them)
        self._waiters, self._outcomes, self._released = r.waiters, r.outcomes, r.released
        self._live: dict[str, Request] = {}          # until its writes are quiet
        # ids ``cancel`` was called for (any thread; a bounded deque: appends and ``in`` are atomic)
        self._cancelled: collections.deque[str] = collections.deque(maxlen=MAX_EARLY_ABORTS)
        # abort before the step came, by (transfer id, token): refuse the step then; keyed by token
        # too, so a stranger's abort can neither stop the transfer nor shadow the real abort
        self._aborted_early = EarlyAborts()
        self._spawn: Spawn = not_running   # the runtime's, from ``run``
        self.active = 0
        self.fence_timeouts = 0
        # for metrics (read on the loop): outcomes, bytes written, deadlines hit, hand-off latency
        self.outcome_counts: collections.Counter[str] = collections.Counter()
        self.bytes_sent = 0
        self.deadlines: collections.Counter[str] = collections.Counter()
        self.handoff = LatencyHistogram()
        self.inbox_looks = 0   # the loop's looks into open steps' inboxes (its polling cost)
        self.stream = LayerStreamer(backend, timeouts, self.deadlines)
        self.stream.submitted = self.layers_submitted
        self.dones = DoneBatcher(peers, timeouts)   # the DONEs of one pass of the loop, one frame per D

    # --- forward-thread API (never blocks) -------------------------------------------------

    def set_local_layout(self, k_base: Sequence[int], v_base: Sequence[int], block_bytes: int, num_blocks: int,
                         heads: int = 0, geometry: HeadGeometry | None = None, host: bool = False) -> None:
        check_geometry(block_bytes, heads, geometry)
        self.local = LocalLayout(np.asarray(k_base, dtype=np.int64), np.asarray(v_base, dtype=np.int64),
                                 block_bytes, num_blocks, heads, geometry, host)

    def begin_step(self, step: int, specs: list[TransferSpec]) -> Step:
        """Hand a step's transfers to the loop; returns the ``Step`` the forward hands its layers to. A bad
        spec fails that transfer there, never here.

        The step is an inbox of its own that the loop polls while the step is open (the step's item
        wakes it, once): in host memory ``layer_ready`` is the inbox's ``append``, a C call, because right
        after the forward's KV write has evicted the caches each Python frame costs microseconds."""
        if self.local is None:
            raise RuntimeStateError("register the KV caches before the first step")
        specs = list(specs)
        record = device_recorder
        inbox = Step(self, step) if record is None else DeviceStep(self, step, record)
        added = self.results.expect(specs)   # before the put: the loop may publish an outcome at once
        try:
            self.bridge.put(("step", step, specs, time.perf_counter(), inbox))
        except RuntimeStateError:
            self.results.forget(added)
            raise
        return inbox

    def refuse(self, spec: TransferSpec, reason: str) -> None:
        """Fail a send on the loop without writing: outcome, FAILED to D, release (``_refuse``)."""
        added = self.results.expect([spec])
        try:
            self.bridge.put(("refuse", spec, str(reason)[:500]))
        except RuntimeStateError:
            self.results.forget(added)
            raise

    def layer_ready(self, step: int, layer: int) -> None:
        self.bridge.put(("layer", step, layer, record_event(), time.perf_counter()))

    def end_step(self, step: int) -> None:
        self.bridge.put(("end", step), wake=True)   # its last layer waits in the inbox: not a tick more

    def cancel(self, transfer_id: str, reason: str) -> None:
        """Stop a send from any thread (our engine preempted its request): no layer is submitted
        after this, its outcome is a failure, D gets FAILED once its writes are quiet (never DONE),
        and its id comes out of ``pop_released`` only then. Unknown or finished ids are ignored.

        The bridge item stops the transfer in order (after its step); the id also goes straight to
        a deque that the loop checks before any DONE, so no DONE is decided after this returned,
        even while the item waits in the bridge. Never raises."""
        if not isinstance(transfer_id, str) or self.bridge.closed:
            return   # the sender is gone: every unpublished outcome already failed (``_fail_unstarted``)
        self._cancelled.append(transfer_id)
        try:
            self.bridge.put(("cancel", transfer_id, str(reason)))
        except RuntimeStateError:
            log.error("transfer %s: cancel not queued (bridge full); it can still not end in DONE", transfer_id)

    # --- results (any thread) ----------------------------------------------------------------

    def pop_outcomes(self) -> list[Outcome]:
        """Outcomes published since the last call; popping one also forgets its ``wait`` slot."""
        return self.results.pop_outcomes()

    def pop_released(self) -> list[str]:
        """Transfer ids whose source blocks no write can still read: safe to reuse now."""
        return self.results.pop_released()

    def table_sizes(self) -> dict[str, int]:
        return {"waiters": len(self._waiters), "live": len(self._live), "aborted_early": len(self._aborted_early),
                "steps": len(self._steps), "outcomes_queued": len(self._outcomes),
                "released_queued": len(self._released), "fence_timeouts": self.fence_timeouts}

    def wait(self, transfer_id: str, timeout: float) -> Outcome:
        """Block until the transfer's outcome is known (never call this from the forward thread)."""
        return self.results.wait(transfer_id, timeout)

    # --- the loop side -----------------------------------------------------------------------

    async def run(self, spawn: Spawn) -> None:
        """Drain the bridge until it is closed; owned by the runtime's TaskGroup."""
        self._spawn = self.dones.spawn = spawn
        tick = self.bridge.poll_s
        pace, napped = LayerPace(self.bridge.poll_s), False
        try:
            while True:
                # while a step is open its layers come into its inbox without a wake-up: look every tick
                batch = await self.bridge.drain(poll=tick if self._steps else 0.0)
                if not batch and self.bridge.closed:
                    return
                for item in batch:
                    try:
                        self._dispatch(item)
                    except Exception:  # one bad item must not end the sender
                        log.exception("sender: bridge item %.200r dropped", item)
                now = time.perf_counter()
                found = self._take_inboxes(now)
                if found:
                    tick, napped = pace.after(now, found), True
                else:   # a nap that ended before its layer came: look again at the shortest tick, then back off
                    tick = self.bridge.poll_s if napped else self.bridge.next_tick(tick, bool(batch))
                    napped = False
                if not self._steps:
                    pace.reset()
        finally:
            self.bridge.close("sender stopped")
            self._fail_unstarted("sender stopped")

    def _take_inboxes(self, now: float) -> int:
        """Every open step's inbox looked into; how many layers they held."""
        self.inbox_looks += 1
        found = 0
        for feed in self._steps.values():
            found += feed.take_inbox(now, self.handoff.observe)
        return found

    def _dispatch(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if kind == "layer":
            _, step, layer, event, handed = item
            self.handoff.observe(time.perf_counter() - handed)
            feed = self._steps.get(step)
            if feed is not None:
                feed.add((layer, event, handed))
        elif kind == "step":
            _, step, specs, begun, inbox = item
            feed = self._steps[step] = StepLayers(inbox, begun, step)
            for spec in specs:
                self._start_request(spec, feed)
            self._unless_read(feed)   # every spec refused: nothing to look at
        elif kind == "end":
            feed = self._steps.pop(item[1], None)
            if feed is not None:   # every layer of the step was appended before its end was put
                feed.take_inbox(time.perf_counter(), self.handoff.observe)
        elif kind == "cancel":
            self._cancel(item[1], item[2])
            with contextlib.suppress(ValueError):   # pushed out of the bounded deque by later cancels
                self._cancelled.remove(item[1])     # its request is stopped now: the id may start again
        elif kind == "refuse":
            live = self._live.get(getattr(item[1], "transfer_id", None))   # type: ignore[arg-type]
            if live is not None:
                self._repeated(live, "refused")
            else:
                self._refuse(item[1], item[2])

    def _unless_read(self, feed: StepLayers, ended: int = 0) -> None:
        """A step nobody reads any more (``ended``: one just stopped) leaves: one never ended was ticked for good."""
        feed.readers -= ended
        if not feed.readers and feed.step is not None and self._steps.get(feed.step) is feed:
            del self._steps[feed.step]

    def _start_request(self, spec: TransferSpec, feed: StepLayers) -> None:
        """Start one transfer, reading its layers from ``feed``. Never raises: whatever is wrong with
        this spec fails this transfer only, with a visible outcome, and the step's others go on."""
        tid = getattr(spec, "transfer_id", None)
        if isinstance(tid, str) and tid in self._live:
            self._repeated(self._live[tid], "started")
            return
        try:
            check_spec(spec)
            check_block_bounds(spec.src_blocks, self._local().num_blocks, "source")
            runs = None if spec.late else _pair(spec)   # a late spec's destination comes from D (_bind)
        except Exception as exc:  # noqa: BLE001 - ValueError, OverflowError (ids >= 2**63), TypeError...
            self._refuse(spec, f"invalid transfer spec: {type(exc).__name__}: {exc}")
            return
        tid = spec.transfer_id   # the same, checked
        req = Request(spec, runs, feed)
        if self._aborted_early.take((tid, spec.token), time.monotonic()):
            self._spawn(self._finish(req, "aborted by D before it started", None), name=f"fail {tid}")
            return
        try:
            if not spec.late:   # a late spec's layout comes with D's registration (_bind)
                self.layouts.prefetch(spec.peer, (tid, spec.token, spec.writers))
        except Exception as exc:  # noqa: BLE001 - e.g. an endpoint the control plane cannot parse
            self._refuse(spec, f"layout prefetch failed: {type(exc).__name__}: {exc}")
            return
        self._live[tid] = req
        feed.readers += 1
        self.active += 1
        self._spawn(self._run_request(req), name=f"send {tid}")

    def _refuse(self, spec: object, reason: str) -> None:
        """A transfer that cannot start: its outcome at once; FAILED to D if the spec can address it."""
        tid = getattr(spec, "transfer_id", None)
        if not isinstance(spec, TransferSpec) or not isinstance(tid, str):
            log.error("sender: transfer %.100r refused: %s", tid, reason)
            self.outcome_counts["failed"] += 1
            self.results.publish(Outcome(transfer_id=str(tid)[:200], ok=False, reason=reason,
                                         finished_s=time.perf_counter()))
            return None
        req = Request(spec, _NO_RUNS)
        self._publish(req, reason, None)
        try:
            check_spec(spec)
        except ValueError:
            return None   # no endpoint or token to reach D with: its own deadline ends the transfer there
        self._spawn(self._finish(req, reason, None), name=f"fail {tid}")
        return None

    def _cancel(self, transfer_id: str, reason: str) -> None:
        req = self._live.get(transfer_id)
        if req is not None and not req.state.terminal:   # else unknown or ended: nothing to stop
            log.warning("transfer %s cancelled by the engine: %s", transfer_id, reason)
            req.abort(reason[:500], by_p=True)

    async def abort(self, transfer_id: str, reason: str, token: str) -> AckDetail:
        """D asks us to stop: submit nothing more, and return once no write can still land.

        Only with the transfer's token: a stranger cannot stop another's transfer. Writes still
        unresolved after ``layer_write``: Nack ``settling`` (D keeps its fence).
        """
        req = self._live.get(transfer_id)
        if req is None:   # not started yet, or already quiet: make sure it never starts
            now = time.monotonic()
            self._aborted_early.add((transfer_id, token), now + self.timeouts.receive, now)
            return AckDetail.STOPPED
        if not m.same_token(token, req.spec.token):
            log.warning("transfer %s: abort with a wrong token refused", transfer_id)
            raise ControlRejected(NackCode.AUTH, f"abort: no transfer {transfer_id} with this token")
        req.abort(reason)
        try:
            await asyncio.wait_for(req.quiet.wait(), self.timeouts.abort_settle)
        except asyncio.TimeoutError:
            raise ControlRejected(NackCode.SETTLING, f"writes of {transfer_id} are still in flight") from None
        return AckDetail.STOPPED

    @guarded
    async def _run_request(self, req: Request) -> None:
        reason = ""
        settled = None
        try:
            if req.spec.late:
                layout = await self._bind(req)
            else:
                layout = await self.layouts.get(req.spec.peer, (req.spec.transfer_id, req.spec.token,
                                                                req.spec.writers), req.spec.dst_incarnation)
            local = self._local()
            req.spans = check_layout(local, req.spec, req.runs, layout)
            req.digest = pick_digest(layout.digests)
            req.state.apply(Event.LAYOUT_READY)
            settled = await self.stream.stream(req, local, layout)
        except asyncio.CancelledError:
            self._publish_safely(req, "runtime stopped")
            raise
        except TransferStopped as exc:   # its text is the reason as published
            settled, reason = exc.settled_s, str(exc)
        except AiolayerError as exc:
            reason = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # a bug must still end in a visible outcome
            log.exception("sender bug on transfer %s", req.spec.transfer_id)
            reason = f"internal error {type(exc).__name__}: {exc}"
        finally:
            self.active -= 1
            self._unless_read(req.feed, ended=1)
        if reason and not req.aborted:
            self.layouts.invalidate(req.spec.peer)  # the peer may have restarted: fetch afresh next time
        await self._finish(req, reason, settled)

    async def _bind(self, req: Request) -> RemoteLayout:
        """A late transfer's destination and D's layout, asked of D while our forward runs: its layers
        queue in the step's feed and its source stays held meanwhile. Bounded by ``lookup_call``; a
        stop (D's abort, our engine's cancel) ends the wait at once, having written nothing."""
        spec = req.spec
        lookup = asyncio.ensure_future(self.layouts.bind(spec.peer, (spec.transfer_id, spec.token, spec.writers)))
        try:
            await asyncio.wait((lookup, req.stop_waiter()), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not lookup.done():
                lookup.cancel()
        if not lookup.done() or lookup.cancelled():
            raise TransferStopped(req.aborted or "stopped before D's registration came")
        reply, layout = lookup.result()
        try:
            bound = spec.bind(reply, reply.first_block)
            check_spec(bound)
            runs = _pair(bound)
        except Exception as exc:  # noqa: BLE001 - D's answer, from the network: this transfer fails
            raise MetadataError(f"D's registration of {spec.transfer_id} does not fit: "
                                f"{type(exc).__name__}: {exc}") from None
        req.spec, req.runs = bound, runs
        return layout

    def _local(self) -> LocalLayout:
        if self.local is None:
            raise RuntimeStateError("register the KV caches before the first step")
        return self.local

    def _fail_unstarted(self, reason: str) -> None:
        """The sender stops: every outcome not yet published fails, live ones too (``_announce_stop``)."""
        self._announce_stop(reason)
        self.results.fail_unpublished(reason, self._live)


def _pair(spec: TransferSpec) -> BlockRuns | None:
    """The spec's source and destination blocks as runs; None where they do not pair one to one,
    which only D's blocks of another size may do (``check_layout`` decides)."""
    paired = spec.src_blocks[spec.src_from:]
    return merge_runs(paired, spec.dst_blocks) if len(paired) == len(spec.dst_blocks) else None
