"""D side: transfers registered before they are published, ended by DONE, FAILED or a deadline.

``register`` must run before the block ids leave D, so a DONE can never race the registration;
a DONE or FAILED that still arrives for an unknown transfer is kept for ``Timeouts.receive``
seconds and applied when the registration comes. DONE and FAILED are idempotent per
(transfer id, sender). A transfer whose deadline passes is failed, and its blocks are released
only after ``fence_grace`` more seconds, when no write from P can still be under way.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

import msgspec

from ..config import Timeouts
from ..errors import ControlRejected
from ..protocol import messages as m
from ..protocol.state import State, receiver_transfer

log = logging.getLogger(__name__)


class Received(msgspec.Struct, kw_only=True):
    transfer_id: str
    ok: bool
    reason: str = ""
    finished_s: float = 0.0


class _Entry:
    __slots__ = ("transfer_id", "block_ids", "state", "sender", "timer", "registered_s", "on_release")

    def __init__(self, transfer_id: str, block_ids: list[int], on_release) -> None:
        self.transfer_id = transfer_id
        self.block_ids = block_ids
        self.state = receiver_transfer()
        self.sender = ""
        self.timer: asyncio.TimerHandle | None = None
        self.registered_s = time.perf_counter()
        self.on_release = on_release


class Receiver:
    def __init__(self, timeouts: Timeouts) -> None:
        self.timeouts = timeouts
        self._entries: dict[str, _Entry] = {}
        self._early: dict[str, tuple[m.Message, float]] = {}
        self._results: collections.deque[Received] = collections.deque()
        self.duplicates = 0
        self.deadlines_expired = 0

    # --- on the loop ---------------------------------------------------------------------------

    def register(self, transfer_id: str, block_ids: list[int], on_release=None,
                 deadline_s: float | None = None) -> None:
        """Register before publishing the block ids; ``on_release(block_ids)`` frees them later."""
        if transfer_id in self._entries:
            raise ControlRejected("duplicate", f"transfer {transfer_id} is already registered")
        entry = _Entry(transfer_id, block_ids, on_release)
        self._entries[transfer_id] = entry
        loop = asyncio.get_running_loop()
        limit = self.timeouts.receive if deadline_s is None else deadline_s
        entry.timer = loop.call_later(limit, self._expire, transfer_id)
        early = self._early.pop(transfer_id, None)
        if early is not None:
            self.handle(early[0])

    def handle(self, msg: m.Message) -> m.Message:
        """Apply a Done or Failed from P; always returns the reply to send."""
        tid = msg.transfer_id
        entry = self._entries.get(tid)
        if entry is None:
            self._keep_early(msg)
            return m.Ack(detail="kept until registration")
        if entry.sender and entry.sender != msg.sender:
            raise ControlRejected("sender", f"transfer {tid} belongs to another sender")
        event = "done" if isinstance(msg, m.Done) else "failed"
        reason = "" if event == "done" else f"P reported: {msg.reason}"
        if not entry.state.apply(event, reason):
            self.duplicates += 1
            return m.Ack(detail=f"already {entry.state.state.value}")
        entry.sender = msg.sender
        self._settle(entry)
        return m.Ack(detail=entry.state.state.value)

    def state_of(self, transfer_id: str) -> tuple[str, str]:
        entry = self._entries.get(transfer_id)
        if entry is None:
            return "unknown", ""
        return entry.state.state.value, entry.state.reason

    def release(self, transfer_id: str) -> bool:
        """Forget a terminal transfer and free its blocks; refused while P may still write."""
        entry = self._entries.get(transfer_id)
        if entry is None:
            return False
        if not entry.state.terminal:
            raise ControlRejected("busy", f"transfer {transfer_id} is still {entry.state.state.value}")
        if entry.state.state is State.FAILED and entry.timer is not None:
            raise ControlRejected("fenced", f"transfer {transfer_id} waits out its fence grace period")
        del self._entries[transfer_id]
        if entry.on_release is not None:
            entry.on_release(entry.block_ids)
        return True

    def pop_results(self) -> list[Received]:
        out = []
        while self._results:
            out.append(self._results.popleft())
        return out

    @property
    def pending(self) -> int:
        return sum(1 for e in self._entries.values() if not e.state.terminal)

    def close(self) -> None:
        for entry in self._entries.values():
            if entry.timer is not None:
                entry.timer.cancel()
        self._entries.clear()
        self._early.clear()

    # --- internals -----------------------------------------------------------------------------

    def _keep_early(self, msg: m.Message) -> None:
        now = time.monotonic()
        for tid, (_, expiry) in list(self._early.items()):
            if expiry < now:
                del self._early[tid]
        if msg.transfer_id not in self._early:  # first word wins, like on a registered transfer
            self._early[msg.transfer_id] = (msg, now + self.timeouts.receive)

    def _settle(self, entry: _Entry) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        ok = entry.state.state is State.FINISHED
        self._results.append(Received(transfer_id=entry.transfer_id, ok=ok, reason=entry.state.reason,
                                      finished_s=time.perf_counter()))

    def _expire(self, transfer_id: str) -> None:
        entry = self._entries.get(transfer_id)
        if entry is None or entry.state.terminal:
            return
        self.deadlines_expired += 1
        entry.state.apply("deadline", f"no DONE/FAILED within {self.timeouts.receive:g}s")
        self._results.append(Received(transfer_id=transfer_id, ok=False, reason=entry.state.reason,
                                      finished_s=time.perf_counter()))
        # P may still be writing: keep the blocks fenced for the grace period.
        loop = asyncio.get_running_loop()
        entry.timer = loop.call_later(self.timeouts.fence_grace, self._unfence, transfer_id)

    def _unfence(self, transfer_id: str) -> None:
        entry = self._entries.get(transfer_id)
        if entry is not None:
            entry.timer = None
