"""Per-transfer state machines for the sender (P) and receiver (D), transitions as data.

Each machine is a table ``{state: {event: next_state}}``. ``Transfer.apply`` consults the table and
raises ``IllegalTransition`` for anything not in it; terminal states accept no further event except
the idempotent repeats their rows list. Events are ``Event`` members (str enums: a plain string of
the same value is the same key, so no caller outside this package needs a literal).
"""

from __future__ import annotations

import enum

import msgspec

from ..errors import AiolayerError, ControlRejected
from . import messages as m
from .codes import NackCode, WireEnum, tally_detail


class IllegalTransition(AiolayerError):
    def __init__(self, machine: str, state: str, event: str) -> None:
        super().__init__(f"{machine}: event {event!r} is not allowed in state {state!r}")
        self.state = state
        self.event = event


class State(str, enum.Enum):
    # sender
    AWAITING_LAYOUT = "awaiting_layout"
    STREAMING = "streaming"
    DELIVERING = "delivering"
    # receiver
    REGISTERED = "registered"
    ABORTING = "aborting"        # deadline or abort: P told to stop, blocks fenced until it is quiet
    # both
    FINISHED = "finished"
    FAILED = "failed"


class Event(WireEnum):
    # sender
    LAYOUT_READY = "layout_ready"
    ALL_LAYERS_WRITTEN = "all_layers_written"
    DONE_ACKED = "done_acked"
    FAIL = "fail"
    # receiver
    DONE = "done"                # P's DONE (every sender's, with several)
    FAILED = "failed"            # P's FAILED
    DEADLINE = "deadline"        # Timeouts.receive passed without either
    ABORT = "abort"              # the engine or a proxy gave the transfer up
    FENCED = "fenced"            # the fence ended: P quiet, or fence_grace passed


TERMINAL = frozenset({State.FINISHED, State.FAILED})
_E = Event   # short, for the tables

SENDER_TABLE: dict[State, dict[Event, State]] = {
    State.AWAITING_LAYOUT: {_E.LAYOUT_READY: State.STREAMING, _E.FAIL: State.FAILED},
    State.STREAMING: {_E.ALL_LAYERS_WRITTEN: State.DELIVERING, _E.FAIL: State.FAILED},
    State.DELIVERING: {_E.DONE_ACKED: State.FINISHED, _E.FAIL: State.FAILED},
    State.FINISHED: {},
    State.FAILED: {_E.FAIL: State.FAILED},
}

RECEIVER_TABLE: dict[State, dict[Event, State]] = {
    State.REGISTERED: {_E.DONE: State.FINISHED, _E.FAILED: State.FAILED, _E.DEADLINE: State.ABORTING,
                       _E.ABORT: State.ABORTING},
    # P sends DONE or FAILED only once its writes are quiet: either ends the fence like P's ack.
    State.ABORTING: {_E.FENCED: State.FAILED, _E.FAILED: State.FAILED, _E.DONE: State.FAILED,
                     _E.DEADLINE: State.ABORTING, _E.ABORT: State.ABORTING},
    State.FINISHED: {_E.DONE: State.FINISHED, _E.ABORT: State.FINISHED},   # an abort after the end is moot
    State.FAILED: {_E.FAILED: State.FAILED, _E.DEADLINE: State.FAILED, _E.DONE: State.FAILED,
                   _E.ABORT: State.FAILED, _E.FENCED: State.FAILED},
}


class Transfer:
    """One transfer's state, driven by ``apply(event)``; ``reason`` is set on failure."""

    __slots__ = ("machine", "table", "state", "reason")

    def __init__(self, machine: str, table: dict[State, dict[Event, State]], initial: State) -> None:
        self.machine = machine
        self.table = table
        self.state = initial
        self.reason = ""

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def apply(self, event: Event, reason: str = "") -> bool:
        """Move on ``event``; returns True when the state changed."""
        nxt = self.table[self.state].get(event)
        if nxt is None:
            raise IllegalTransition(self.machine, self.state.value, str(event))
        changed = nxt is not self.state
        if changed and nxt in (State.FAILED, State.ABORTING) and not self.reason:
            self.reason = reason or str(event)
        self.state = nxt
        return changed


class ReceiverTransfer(Transfer):
    """D's machine, and the P ranks it waits for: with ``senders`` > 1 (head slices) each one's
    DONE/FAILED is held until all spoke (the blocks stay fenced while any may still write), then
    one word stands for all: the first FAILED, else a DONE with every sender's bytes."""

    __slots__ = ("senders", "heard")

    def __init__(self, senders: int = 1) -> None:
        super().__init__("receiver", RECEIVER_TABLE, State.REGISTERED)
        self.senders = senders
        self.heard: dict[str, m.Done | m.Failed] = {}   # senders > 1: each one's word, by sender

    def gather(self, transfer_id: str, msg: m.Done | m.Failed) -> tuple[m.Done | m.Failed | None, bool]:
        """(the word to apply, or None while still waiting; whether ``msg`` repeated one held).
        A sender beyond the expected ones is refused (``NackCode.SENDER``)."""
        if msg.sender not in self.heard and len(self.heard) >= self.senders:
            raise ControlRejected(NackCode.SENDER, f"transfer {transfer_id} already heard its {self.senders} senders")
        if self.terminal:
            return msg, False   # late (after a deadline) or repeated: ``apply`` acks it as a duplicate
        if msg.sender in self.heard:
            return None, True
        self.heard[msg.sender] = msg
        if len(self.heard) < self.senders:
            return None, False
        failed = [word for word in self.heard.values() if isinstance(word, m.Failed)]
        if failed:
            return failed[0], False
        total = sum(word.bytes for word in self.heard.values() if isinstance(word, m.Done))   # all are, here
        return msgspec.structs.replace(msg, bytes=total), False

    def tally(self) -> str:
        return tally_detail(len(self.heard), self.senders)


class SenderTransfer(Transfer):
    """P's machine, and whether it was told to stop: by D (an Abort) or by P's engine (``by_p``:
    it preempted the request, so D still needs a FAILED). Stopping is no transition: the transfer
    fails when its writes are quiet, with the stop's reason."""

    __slots__ = ("stopped", "by_p")

    def __init__(self) -> None:
        super().__init__("sender", SENDER_TABLE, State.AWAITING_LAYOUT)
        self.stopped = ""    # why, once stopped
        self.by_p = False

    def stop(self, reason: str, by_p: bool = False) -> bool:
        """Record the first stop; returns True for it (a repeat changes nothing)."""
        if self.stopped:
            return False
        self.stopped = reason or ("cancelled by P" if by_p else "aborted by D")
        self.by_p = by_p
        return True


def sender_transfer() -> SenderTransfer:
    return SenderTransfer()


def receiver_transfer(senders: int = 1) -> ReceiverTransfer:
    return ReceiverTransfer(senders)
