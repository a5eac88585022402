"""How a P transfer ends (the sender's part that runs after its last layer or its failure): DONE or
FAILED to D, its outcome published, its source blocks released once no write can read them.

``TransferEnding`` is a base of ``Sender``: it reads the sender's state, declared here, and keeps no
state of its own. The order is the fencing argument (docs/fencing.md): FAILED goes to D only once our
writes are quiet; the source is released only once the backend saw every write end.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import operator
import time
from typing import Any

from ... import compat
from ...bounded import put_newest
from ...config import Timeouts
from ...errors import AiolayerError, ControlRejected, DeliveryFailed
from ...protocol import messages as m
from ...protocol.codes import NackCode
from ...protocol.state import Event, State
from .done_batch import DoneBatcher
from .checking import SourceCheck
from .fence import Request, guarded, until_writes_end
from .metadata import LayoutCache
from ..integrity import plan_check, sample_check
from ..control.plane import ControlPeers
from ..loop import Spawn
from .results import Results
from ..spec import LocalLayout, Outcome, TransferSpec

log = logging.getLogger("aiolayer.runtime.send.sender")   # the sender's own log, as before the split
_BY_LAYER = operator.attrgetter("layer")
_REFUSING_PEERS = 1024   # D endpoints remembered as refusing early checks


class TransferEnding:
    # the sender's state this part reads and counts into (``Sender.__init__`` sets every one)
    engine_id: str
    timeouts: Timeouts
    local: LocalLayout | None
    integrity_sample: float
    peers: ControlPeers
    integrity_checks: int
    early_checks: int
    early_refused: dict[str, float]   # D endpoint -> until when it is sent no early checks (monotonic)
    results: Results
    dones: DoneBatcher
    layouts: LayoutCache   # its ``incarnation``: this runtime's, which P's words carry
    outcome_counts: collections.Counter[str]
    bytes_sent: int
    fence_timeouts: int
    _live: dict[str, Request]
    _cancelled: collections.deque[str]
    _spawn: Spawn

    @guarded
    async def _finish(self, req: Request, reason: str, settled: float | None) -> None:
        """Success: DONE answered by D, then the outcome: ok only when D took the transfer as written
        (``done_verdict``), else failed with what D said. Failure: the outcome at once, then
        FAILED to D once our writes are quiet, so D may reuse its blocks when it reads it; never
        while one may still land (D's own deadline and fence take over then)."""
        spec = req.spec
        reason = reason or self._stopped(req)   # stopped after its last write settled: still no DONE
        if not reason:
            req.state.apply(Event.ALL_LAYERS_WRITTEN)
            check = await self._sampled_check(req) if self.integrity_sample else None
            reason = self._stopped(req)   # cancelled while the check read the source: no DONE either
            if not reason:
                await self._tell_done(req, check, settled)
                return
        self._publish(req, reason, settled)
        try:
            await asyncio.wait_for(req.quiet.wait(), self.timeouts.quarantine_wait)
        except asyncio.TimeoutError:
            log.error("transfer %s: writes still unresolved; D is not told (its deadline and fence "
                      "take over)", spec.transfer_id)
            return
        if req.aborted and not req.by_p:
            return   # D asked us to stop: it learns we are quiet from its Abort's reply
        failed = m.Failed(transfer_id=spec.transfer_id, sender=self.engine_id, reason=reason[:500],
                          token=spec.token, sender_incarnation=self.layouts.incarnation)
        try:
            await self.dones.tell(spec, failed)
        except DeliveryFailed:
            pass   # logged; D's own deadline and fence end the transfer there

    def _stopped(self, req: Request) -> str:
        """Why the transfer may not end in DONE: aborted, or cancelled by our engine (its bridge item
        may still be on the way: the id is in ``_cancelled`` from the moment ``cancel`` returned)."""
        if not req.aborted and req.spec.transfer_id in self._cancelled:
            req.abort("cancelled by P", by_p=True)
        return req.aborted

    async def _tell_done(self, req: Request, check: m.LayerCheck | None, settled: float | None) -> None:
        spec = req.spec
        msg = m.Done(transfer_id=spec.transfer_id, sender=self.engine_id, incarnation=spec.dst_incarnation,
                     layers=len(req.timings), bytes=req.bytes, token=spec.token, check=check,
                     sender_incarnation=self.layouts.incarnation)
        try:
            reply = await self.dones.tell(spec, msg)
        except DeliveryFailed as exc:
            self._publish(req, f"DONE not delivered: {exc}", settled)
            return
        self._publish(req, m.done_verdict(reply), settled)

    async def _sampled_check(self, req: Request) -> m.LayerCheck | None:
        """The DONE's integrity check of a sampled transfer (every write completed: the held source is
        what D must hold now); None, logged, when its digest did not end within ``done_delivery`` (the
        DONE goes unchecked, as when a digest breaks: ``checking.py``), so no thread holds the DONE."""
        early = req.check   # begun beside the last writes (``layers_submitted``), else now
        limit = self.timeouts.done_delivery
        try:
            async with compat.timeout(limit):
                check = await (early if early is not None else asyncio.to_thread(
                    sample_check, self.local, req.runs, req.spans, self.integrity_sample, req.digest))
        except TimeoutError:
            log.error("transfer %s: integrity digest did not end within done_delivery %gs; this transfer goes "
                      "unchecked", req.spec.transfer_id, limit)
            return None
        self.integrity_checks += check is not None
        return check

    def layers_submitted(self, req: Request, layers: list[int], last: bool) -> None:
        """Stream hook: ``layers`` of ``req`` were submitted, so their source is final: a sampled transfer
        digests them while the prefill goes on, and sends D what landed early (``checking.py``). With
        ``last`` every layer was: the check's last digest starts, beside the last writes; the DONE awaits
        the whole check (``req.check``)."""
        if req.checking is None:   # its first layers: sampled or not is decided now, once
            req.checking = self._source_check(req) or False
        if not isinstance(req.checking, SourceCheck):
            return
        if layers:
            req.checking.add(layers)
        if last and req.check is None:
            req.check = req.checking.finish()

    def _source_check(self, req: Request) -> SourceCheck | None:
        local, share = self.local, self.integrity_sample
        plan = plan_check(local, req.runs, req.spans, share, req.digest) if share else None
        if plan is None or local is None:
            return None
        return SourceCheck(local, plan, local.num_layers, lambda: {t.layer for t in req.timings},
                           functools.partial(self._early_part, req))

    def _early_part(self, req: Request, part: m.LayerCheck) -> None:
        if self.early_refused.get(req.spec.peer, 0.0) > time.monotonic():   # a D that cannot read them
            return
        if not req.aborted and not req.state.terminal:
            early = m.EarlyCheck(transfer_id=req.spec.transfer_id, sender=self.engine_id, token=req.spec.token,
                                 check=part)
            self._spawn(self._send_early(req.spec, early), name=f"early check {req.spec.transfer_id}")

    async def _send_early(self, spec: TransferSpec, early: m.EarlyCheck) -> None:
        """Best effort: D verifies at DONE what it did not match early, so a lost or refused early check
        (an older D answers ``Nack(decode)``) costs time, never a check."""
        try:
            client = await self.peers.get(spec.peer)
            await client.call(early, timeout=self.timeouts.control_call)
            self.early_checks += 1
        except AiolayerError as exc:
            if isinstance(exc, ControlRejected) and exc.code == NackCode.DECODE:
                # an older D: ask again only after a while (it may be upgraded)
                put_newest(self.early_refused, spec.peer, time.monotonic() + self.timeouts.peer_idle,
                           _REFUSING_PEERS)
            log.debug("transfer %s: early check not taken: %s", spec.transfer_id, exc)
        except Exception:   # never into the runtime's TaskGroup; the DONE still checks all
            log.exception("transfer %s: early check failed", spec.transfer_id)

    def _publish(self, req: Request, reason: str, settled: float | None) -> None:
        if req.state.terminal:
            return
        if reason:
            req.state.apply(Event.FAIL, reason)
        else:
            req.state.apply(Event.DONE_ACKED)
        now = time.perf_counter()
        self.outcome_counts["finished" if req.state.state is State.FINISHED else "failed"] += 1
        self.bytes_sent += req.bytes
        if reason:
            log.warning("transfer %s failed: %s", req.spec.transfer_id, req.state.reason)
        unsettled = [f for f in req.pending if not f.done() or f.cancelled()]   # cancelled: backend closed
        outcome = Outcome(transfer_id=req.spec.transfer_id, ok=req.state.state is State.FINISHED,
                          reason=req.state.reason, bytes=req.bytes, finished_s=now,
                          writes_settled_s=settled or now, source_released=not unsettled,
                          layers=sorted(req.timings, key=_BY_LAYER), layerwise=req.spec.layerwise)
        if not req.announced:
            self.results.publish(outcome)
        if unsettled:
            self._spawn(self._release_when_quiet(req, req.pending), name=f"fence {req.spec.transfer_id}")
        else:
            self._release(req)

    def _repeated(self, live: Request, what: str) -> None:
        """A start or refusal of an id whose transfer still runs: ignored (the source and its release are
        the live one's). Before the live one's outcome is out the repeat shares its ``wait`` slot and
        outcome; after it, ``begin_step`` made the repeat a slot of its own, which gets a failed outcome
        here (else its waiter would sleep to its timeout and the slot stay forever)."""
        tid = live.spec.transfer_id
        log.error("transfer %s: %s again while live; ignored", tid, what)
        self.outcome_counts["duplicate"] += 1
        if live.state.terminal:
            self.results.publish(Outcome(transfer_id=tid, ok=False, finished_s=time.perf_counter(),
                                         reason=f"{what} again while its earlier transfer still ran: ignored",
                                         source_released=False))

    def _announce_stop(self, reason: str) -> None:
        """The sender stops: each live transfer is stopped (no layer, and no DONE decided, after this) and
        its outcome, a failure, goes out now, the only one it gets (``wait`` and ``pop_outcomes`` agree).
        It stays live, not quiet, until its writes end: its id comes out of ``pop_released`` only then."""
        for req in list(self._live.values()):
            if req.state.terminal or req.announced:
                continue
            req.abort(reason, by_p=True)
            req.announced = True
            self.results.publish(Outcome(transfer_id=req.spec.transfer_id, ok=False, reason=reason, bytes=req.bytes,
                                         finished_s=time.perf_counter(), source_released=False,
                                         layers=sorted(req.timings, key=_BY_LAYER), layerwise=req.spec.layerwise))

    def _publish_safely(self, req: Request, reason: str) -> None:
        try:
            self._publish(req, reason, None)
        except Exception:  # at shutdown the fence task may not start: the source stays held
            log.exception("transfer %s: outcome published, source kept held", req.spec.transfer_id)

    def _fail_after_bug(self, req: Request, reason: str) -> None:
        """``guarded``'s last resort: the transfer fails visibly; its source is released only if
        no write of it can be pending (never on a guess)."""
        self._publish_safely(req, reason)
        self.results.resolve(Outcome(transfer_id=req.spec.transfer_id, ok=False, reason=reason,
                                     finished_s=time.perf_counter(), source_released=False))

    def _release(self, req: Request) -> None:
        tid = req.spec.transfer_id
        req.quiet.set()
        if self._live.get(tid) is req:
            del self._live[tid]
        self.results.release(tid)

    @guarded
    async def _release_when_quiet(self, req: Request, pending: list[asyncio.Future[Any]]) -> None:
        """Hold the source blocks (and the transfer live: abort answers ``settling``) until the
        backend saw every write that may still land end (``fence.until_writes_end``)."""
        def late(count: int) -> None:
            self.fence_timeouts += 1
            log.error("transfer %s: %d writes still unresolved after %gs; its source blocks stay held",
                      req.spec.transfer_id, count, self.timeouts.quarantine)

        if await until_writes_end(pending, self.timeouts.quarantine, late):
            self._release(req)
        else:   # the backend closed: nobody knows, keep them held
            log.error("transfer %s: backend closed with writes unresolved; source kept held", req.spec.transfer_id)

