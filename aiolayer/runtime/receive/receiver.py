"""D side: transfers registered before they are published, ended by DONE, FAILED, abort or deadline.

``register`` must run before the block ids leave D, so a DONE can never race the registration;
a DONE or FAILED that still arrives for an unknown transfer is kept for ``Timeouts.receive``
seconds and applied when the registration comes. DONE and FAILED are idempotent per
(transfer id, sender).

Writers: D records each P rank that reaches a transfer (fetches its layout, or reports) with its own
control endpoint (``writers``); no endpoint named by the deployment is believed.

Fencing: on a deadline or an abort the transfer goes to ``aborting``: D tells each writer to stop and
keeps the blocks until every writer acknowledged that none of its writes is in flight (or sent DONE/FAILED,
which P sends only then); with no writer the fence ends at once (no P rank can learn where to write any
more). P answers ``Nack(settling)`` while a write may still land: D asks again until ``fence_grace``. The
fence always ends, and only then is the failure published and may the blocks be released.

Settled transfers: the id, token and ending of each are kept for ``Timeouts.receive`` seconds (at most
``settled.MAX_SETTLED``), even once the entry is forgotten. A late or retried DONE/FAILED for one is
answered "already finished" or "already failed" (never kept as an early word a later registration would
take for its own): D's answer to a DONE is P's verdict on it (``messages.done_verdict``), also for a
retry whose first reply was lost. The id cannot be registered again meanwhile.

Authentication: each registration holds the transfer's token; DONE, FAILED, an abort request, a lookup
or a layout request must present it (``authorize``), else ``ControlRejected`` (``auth``, counted by the
control server); an early DONE whose token does not match gets no Nack: ``rejected["early_auth"]``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Callable

from ...config import Timeouts
from ...errors import ControlRejected
from ...protocol import messages as m
from ...protocol.checks import check_senders, check_token
from ...protocol.codes import AckDetail, NackCode
from ...protocol.state import Event, IllegalTransition, State
from ..integrity import EarlyChecks
from .early import EarlyWords
from .entry import Entry, Received, Release
from .lookups import WaitingLookups
from ..loop import Spawn, not_running
from .settled import SettledTable
from .writers import StopSender, ask_until_quiet

log = logging.getLogger(__name__)

# why a receive failed before its KV was accepted (``Receiver.failures``; docs/operations.md#metrics)
FAILURE_CAUSES = ("deadline", "aborted", "prefill_failed", "refused")


class Receiver:
    def __init__(self, timeouts: Timeouts) -> None:
        self.timeouts = timeouts
        self._entries: dict[str, Entry] = {}
        # entries not settled yet: counted, not walked, since the metrics snapshot reads it on every
        # outcome (walking thousands of entries there took ~40 % of a busy D's loop)
        self._unsettled = 0
        self._early = EarlyWords(timeouts.receive)      # DONE/FAILED for transfers not registered yet
        self._settled = SettledTable(timeouts.receive)   # their late words and their ids are refused
        self.lookups = WaitingLookups()                 # lookups held until their transfer is registered
        self._on_outcome: Callable[[], None] | None = None
        self._results: collections.deque[Received] = collections.deque()
        self._spawn: Spawn = not_running
        self._stop_sender: StopSender | None = None
        self.duplicates = 0
        self.deadlines_expired = 0
        self.fences_unconfirmed = 0   # fences that ended on the grace alone: a writer never said it stopped
        self.aborts = 0
        self.rejected: collections.Counter[str] = collections.Counter()   # dropped without a Nack, by reason
        self.outcome_counts: collections.Counter[str] = collections.Counter()
        self.bytes_received = 0
        self.integrity: collections.Counter[str] = collections.Counter()   # sampled DONEs: verified / mismatch
        self.failures: collections.Counter[str] = collections.Counter()    # failed receives by FAILURE_CAUSES

    def bind(self, spawn: Spawn, stop_sender: StopSender | None, on_outcome: Callable[[], None] | None = None) -> None:
        """Give the receiver its task owner, the way to tell a P to stop and whom to tell of an outcome."""
        self._spawn = spawn
        self._stop_sender = stop_sender
        self._on_outcome = on_outcome

    # --- on the loop ---------------------------------------------------------------------------

    def register(self, transfer_id: str, block_ids: list[int], *, token: str, on_release: Release | None = None,
                 first_block: int = 0, senders: int = 1, forget: bool = False) -> None:
        """Register before publishing the block ids; ``on_release(block_ids)`` frees them later.

        ``token`` is the transfer's secret: only a peer that presents it may end the transfer.
        ``senders`` > 1: that many P ranks (distinct engine ids) write disjoint head slices of the
        blocks; the transfer ends once every one of them said DONE or FAILED (or by its deadline).
        """
        check_token(transfer_id, token)
        check_senders(transfer_id, senders)
        if transfer_id in self._entries:
            raise ControlRejected(NackCode.DUPLICATE, f"transfer {transfer_id} is already registered")
        if self._settled.word(transfer_id) is not None:
            raise ControlRejected(NackCode.SETTLED,
                                  f"transfer {transfer_id} already settled; a new transfer needs a new id")
        entry = Entry(transfer_id, token, block_ids, on_release, first_block, senders)
        entry.forget = forget
        self._entries[transfer_id] = entry
        self._unsettled += 1   # every entry settles once (``_settle``) or goes with ``close``
        # D waits for P at most Timeouts.receive: then it fences and fails the transfer; P's writes end by
        # then too (the window each writer is granted: docs/fencing.md, rule 8)
        loop = asyncio.get_running_loop()
        entry.write_end = loop.time() + self.timeouts.receive
        entry.timer = loop.call_later(self.timeouts.receive, self._expire, transfer_id)
        self._apply_early(entry)
        self.lookups.registered(transfer_id)   # after the early words: a lookup then sees the transfer as it is

    def authorize(self, transfer_id: str, token: str, what: str) -> Entry:
        """The registered transfer, if ``token`` is its own; else refused (code ``auth``) and counted."""
        entry = self._entries.get(transfer_id)
        if entry is None or not m.same_token(token, entry.token):
            # counted in the metrics (Nack code auth); info, not warning: a stranger must not flood the log
            log.info("transfer %s: %s refused: no such transfer or wrong token", transfer_id, what)
            raise ControlRejected(NackCode.AUTH, f"{what}: no transfer {transfer_id} with this token")
        return entry

    def authorize_writer(self, transfer_id: str, token: str, what: str) -> Entry:
        """Like ``authorize``, and the transfer still takes writes (code ``ended`` once D gave it up)."""
        entry = self.authorize(transfer_id, token, what)
        if entry.state.state is not State.REGISTERED:
            raise ControlRejected(NackCode.ENDED,
                                  f"{what}: transfer {transfer_id} is already {entry.state.state.value}")
        return entry

    def admit_writer(self, msg: m.LayoutRequest) -> None:
        """A P rank asks for a transfer's layout: authorized by its token while the transfer takes
        writes, and recorded as one of its writers before it learns where to write. Refused: a rank
        beyond the registered writers (``sender``), or one whose plan names another number of writers
        than D registered (``writers``): P's and D's parallel layouts disagree, so the transfer fails
        here, loudly, instead of finishing with part of its KV never written."""
        tid = msg.transfer_id
        entry = self.authorize_writer(tid, msg.token, f"layout request from {msg.requester!r}")
        expected = entry.state.senders
        if msg.writers and msg.writers != expected:
            reason = (f"P rank {msg.requester!r} writes as one of {msg.writers} P ranks, but D registered the "
                      f"transfer for {expected}: P's and D's tensor-parallel layouts disagree (check the sizes "
                      "the proxy was given)")
            log.error("transfer %s: %s", tid, reason)
            self.abort(tid, reason)
            raise ControlRejected(NackCode.WRITERS, reason)
        entry.writers.admit(tid, msg.requester, (msg.control, msg.incarnation))

    def handle(self, msg: m.Done | m.Failed) -> m.Ack:
        """Apply a Done or Failed from P; always returns the reply to send."""
        tid = msg.transfer_id
        if tid not in self._entries:
            settled = self._settled.word(tid)
            if settled is None:
                self._early.keep(msg)
                return m.Ack(detail=AckDetail.KEPT)
            if not m.same_token(msg.token, settled[0]):
                log.info("transfer %s: late %s refused: wrong token", tid, type(msg).__name__)
                raise ControlRejected(NackCode.AUTH, f"{type(msg).__name__}: no transfer {tid} with this token")
            self.duplicates += 1   # a retry whose first delivery settled it, or a word after the deadline
            return _already(settled[1])
        entry = self.authorize(tid, msg.token, type(msg).__name__)
        entry.writers.admit(tid, msg.sender, word_of=msg.sender_incarnation)   # a stranger to its writers: refused
        entry.writers.mark_quiet(msg.sender)   # P says DONE/FAILED only once its writes are quiet
        if entry.state.senders > 1:
            word, repeated = entry.state.gather(tid, msg)
            self.duplicates += repeated
            if word is None:   # counted; while D gives the transfer up, that is no acceptance
                aborting = entry.state.state is State.ABORTING
                return m.Ack(detail=State.ABORTING.value if aborting else entry.state.tally())
            msg = word
        event = Event.DONE if isinstance(msg, m.Done) else Event.FAILED
        reason = f"P reported: {msg.reason}" if isinstance(msg, m.Failed) else ""
        if entry.state.state is State.ABORTING:
            reason = entry.state.reason  # P is quiet now; the failure is still why D gave up
        try:
            changed = entry.state.apply(event, reason)
        except IllegalTransition as exc:
            raise ControlRejected(NackCode.STATE, str(exc)) from None
        if not changed:
            self.duplicates += 1
            return _already(entry.state.state is State.FINISHED)
        if isinstance(msg, m.Done):
            self.bytes_received += msg.bytes
        else:
            entry.cause = entry.cause or "prefill_failed"
        self._settle(entry)
        return m.Ack(detail=entry.state.state.value)

    def abort(self, transfer_id: str, reason: str, token: str | None = None) -> str:
        """Give up a transfer: P is told to stop; the blocks stay fenced until it is quiet.

        A request from the network passes its ``token``; the engine itself (None) is trusted.
        """
        entry = self._entries.get(transfer_id)
        if entry is None:
            raise ControlRejected(NackCode.UNKNOWN_TRANSFER, f"no transfer {transfer_id}")
        if token is not None:
            self.authorize(transfer_id, token, "abort request")
        if entry.state.apply(Event.ABORT, reason):
            self.aborts += 1
            entry.cause = entry.cause or "aborted"
            self._start_fence(entry)
        return entry.state.state.value

    def to_verify(self, transfer_id: str, token: str) -> tuple[list[int], EarlyChecks] | None:
        """The blocks a DONE's integrity check may read and its early checks: registered, this token, still
        taking writes; None otherwise (the DONE then goes on unchecked, to be refused or kept as usual)."""
        entry = self._entries.get(transfer_id)
        if entry is None or entry.state.state is not State.REGISTERED or not m.same_token(token, entry.token):
            return None
        return entry.block_ids, entry.early

    def window(self, transfer_id: str, since: float | None = None) -> float:
        """Seconds from ``since`` (loop time; None: now) to the end of the writes of a transfer a writer was
        just granted (its ``LayoutReply.window``). P counts them from its request's send, which came first."""
        entry = self._entries[transfer_id]
        return max(0.0, entry.write_end - (asyncio.get_running_loop().time() if since is None else since))

    def early_check_of(self, msg: m.EarlyCheck) -> tuple[list[int], EarlyChecks]:
        """Where a writer's early check may read (``auth``, ``ended``, ``sender`` otherwise); admits no writer."""
        entry = self.authorize_writer(msg.transfer_id, msg.token, "early check")
        if not entry.writers.knows(msg.sender):
            raise ControlRejected(NackCode.SENDER, f"early check: {msg.sender!r} is no writer of {msg.transfer_id}")
        return entry.block_ids, entry.early

    async def wait_registered(self, transfer_id: str, token: str, limit: float) -> None:
        """Until ``transfer_id`` is registered (at most ``limit`` s); a settled id at once: ``ended``/``auth``."""
        if transfer_id in self._entries:
            return
        if (settled := self._settled.word(transfer_id)) is not None:
            code = NackCode.ENDED if m.same_token(token, settled[0]) else NackCode.AUTH
            raise ControlRejected(code, f"lookup: transfer {transfer_id} settled, or not with this token")
        if not await self.lookups.wait(transfer_id, limit):
            raise ControlRejected(NackCode.NOT_REGISTERED, f"transfer {transfer_id} not registered within {limit:g}s")

    def registration(self, transfer_id: str, token: str) -> tuple[list[int], int]:
        """(block ids, first block) of a registered transfer, for whoever dispatches P."""
        if transfer_id not in self._entries:
            raise ControlRejected(NackCode.NOT_REGISTERED, f"transfer {transfer_id} is not registered (yet)")
        entry = self.authorize(transfer_id, token, "lookup")
        if entry.state.terminal:
            raise ControlRejected(NackCode.ENDED, f"transfer {transfer_id} is already {entry.state.state.value}")
        return entry.block_ids, entry.first_block

    def state_of(self, transfer_id: str) -> tuple[str, str]:
        entry = self._entries.get(transfer_id)
        return ("unknown", "") if entry is None else (entry.state.state.value, entry.state.reason)

    def table_sizes(self) -> dict[str, int]:
        return {"entries": len(self._entries), "early": len(self._early), "lookups_waiting": self.lookups.count}

    def release(self, transfer_id: str) -> bool:
        """Forget a terminal transfer and free its blocks; refused while P may still write."""
        entry = self._entries.get(transfer_id)
        if entry is None:
            return False
        if not entry.state.terminal:
            raise ControlRejected(NackCode.BUSY, f"transfer {transfer_id} is still {entry.state.state.value}")
        del self._entries[transfer_id]
        self._remember_settled(entry)
        if entry.on_release is not None:
            entry.on_release(entry.block_ids)
        return True

    def refuse(self, transfer_id: str, reason: str) -> None:
        """A registration that was refused: its failure is reported like a result (``refused``)."""
        self.failures["refused"] += 1
        if self._on_outcome is not None:
            self._on_outcome()   # as for any result: counted before it is visible, the engine woken
        self._results.append(Received(transfer_id=transfer_id, ok=False, reason=reason,
                                      finished_s=time.perf_counter(), refused=True))

    def pop_results(self) -> list[Received]:
        return [self._results.popleft() for _ in range(len(self._results))]   # appended meanwhile: next time

    @property
    def pending(self) -> int:
        """Registered transfers not settled yet."""
        return self._unsettled

    def close(self) -> list[Entry]:
        """Stop every timer and fence; the transfers still live, for ``stopped`` once none can be written."""
        self.lookups.close()
        for entry in self._entries.values():
            for waiting in (entry.timer, entry.fence):
                if waiting is not None:
                    waiting.cancel()
        live = [entry for entry in self._entries.values() if not entry.state.terminal]
        self._entries.clear()
        self._unsettled = 0
        self._early.clear()
        self._settled.clear()
        return live

    def stopped(self, live: list[Entry]) -> None:
        """The runtime stopped with ``live`` unsettled and its memory unregistered (no write can land): each
        gets a failed result, the release an engine that restarts over its blocks waits for."""
        self._results.extend(Received(transfer_id=e.transfer_id, ok=False, reason="runtime stopped",
                                      finished_s=time.perf_counter(), registered_s=e.registered_s) for e in live)

    # --- internals -----------------------------------------------------------------------------

    def _apply_early(self, entry: Entry) -> None:
        """On registration: apply the early word with the right token; drop (and count) the others."""
        tid = entry.transfer_id
        for token, msg in self._early.take(tid):
            if m.same_token(token, entry.token):
                try:
                    self.handle(msg)
                except ControlRejected as exc:   # e.g. a second sender of a one-sender transfer
                    self.rejected[f"early_{exc.code}"] += 1
                    log.warning("transfer %s: early %s refused: %s", tid, type(msg).__name__, exc.reason)
            else:
                self.rejected["early_auth"] += 1
                log.warning("transfer %s: early %s with a wrong token dropped", tid, type(msg).__name__)

    def _settle(self, entry: Entry) -> None:
        """The entry's one move into a terminal state (FINISHED, FAILED): counted, reported once."""
        self._unsettled -= 1
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        if entry.fence is not None:
            entry.fence.cancel()
            entry.fence = None
        ok = entry.state.state is State.FINISHED
        self.outcome_counts["finished" if ok else "failed"] += 1
        if not ok:
            self.failures[entry.cause or "aborted"] += 1
            log.warning("transfer %s failed at D: %s", entry.transfer_id, entry.state.reason)
        if self._on_outcome is not None:
            self._on_outcome()   # before the result is visible: whoever reads it finds it counted
        self._results.append(Received(transfer_id=entry.transfer_id, ok=ok, reason=entry.state.reason,
                                      finished_s=time.perf_counter(), registered_s=entry.registered_s))
        self._remember_settled(entry)
        if entry.forget:   # an engine that owns its blocks (``Runtime.receive``) needs no entry after the result
            self._entries.pop(entry.transfer_id, None)

    def _remember_settled(self, entry: Entry) -> None:
        """From now on its late words are answered from the table, and its id cannot come back."""
        self._settled.remember(entry.transfer_id, entry.token, entry.state.state is State.FINISHED)

    def _expire(self, transfer_id: str) -> None:
        entry = self._entries.get(transfer_id)
        if entry is None or entry.state.state is not State.REGISTERED:
            return
        self.deadlines_expired += 1
        entry.cause = entry.cause or "deadline"
        log.warning("transfer %s: no DONE/FAILED within %gs; fencing its blocks", transfer_id, self.timeouts.receive)
        entry.state.apply(Event.DEADLINE, f"no DONE/FAILED within {self.timeouts.receive:g}s")
        self._start_fence(entry)

    def _start_fence(self, entry: Entry) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        # the task itself, so that settling the transfer cancels it rather than leaving it to sleep
        entry.fence = self._spawn(self._fence(entry), name=f"fence {entry.transfer_id}")

    async def _fence(self, entry: Entry) -> None:
        """Until P is quiet (its ack) or ``fence_grace``; then the transfer ends, whatever asking P did.
        Cancelled only when the transfer settled meanwhile (P's DONE/FAILED) or the runtime stops."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.timeouts.fence_grace
        cancelled = False
        try:
            try:
                quiet = await self._ask_until_quiet(entry, end)
            except Exception:   # P's state is unknown: the grace decides (CancelledError is no Exception)
                log.exception("transfer %s: asking P to stop failed; fencing for the whole grace", entry.transfer_id)
                quiet = False
            if not quiet:   # a writer cut off from our Abort still writes until its window ends (rule 8)
                await asyncio.sleep(max(0.0, max(end, entry.write_end + self.timeouts.fence_grace) - loop.time()))
                self.fences_unconfirmed += 1
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            if not cancelled:
                self._end_fence(entry)

    async def _ask_until_quiet(self, entry: Entry, end: float) -> bool:
        """True once every P rank that reached the transfer is quiet (at once if none did)."""
        if self._stop_sender is None:
            return not entry.writers.unquiet()
        return await ask_until_quiet(entry.writers, self._stop_sender, entry.transfer_id, entry.token,
                                     entry.state.reason, end, self.timeouts.abort_ask)

    def _end_fence(self, entry: Entry) -> None:
        entry.fence = None   # done: settling must not cancel the task that is ending
        if entry.state.state is State.ABORTING:
            entry.state.apply(Event.FENCED)
            self._settle(entry)


def _already(finished: bool) -> m.Ack:
    """The reply to a repeated or late word: how the transfer ended (P's verdict on a retried DONE)."""
    return m.Ack(detail=AckDetail.ALREADY_FINISHED if finished else AckDetail.ALREADY_FAILED)
