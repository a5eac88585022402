"""Per-transfer state machines for the sender (P) and receiver (D), transitions as data.

Each machine is a table ``{state: {event: next_state}}``. ``Transfer.apply`` consults the table and
raises ``IllegalTransition`` for anything not in it; terminal states accept no further event except
the idempotent repeats listed in ``IDEMPOTENT``.
"""

from __future__ import annotations

import enum

from ..errors import AiolayerError


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


TERMINAL = frozenset({State.FINISHED, State.FAILED})

SENDER_TABLE: dict[State, dict[str, State]] = {
    State.AWAITING_LAYOUT: {"layout_ready": State.STREAMING, "fail": State.FAILED},
    State.STREAMING: {"all_layers_written": State.DELIVERING, "fail": State.FAILED},
    State.DELIVERING: {"done_acked": State.FINISHED, "fail": State.FAILED},
    State.FINISHED: {},
    State.FAILED: {"fail": State.FAILED},
}

RECEIVER_TABLE: dict[State, dict[str, State]] = {
    State.REGISTERED: {"done": State.FINISHED, "failed": State.FAILED, "deadline": State.ABORTING,
                       "abort": State.ABORTING},
    # P sends DONE or FAILED only once its writes are quiet: either ends the fence like P's ack.
    State.ABORTING: {"fenced": State.FAILED, "failed": State.FAILED, "done": State.FAILED,
                     "deadline": State.ABORTING, "abort": State.ABORTING},
    State.FINISHED: {"done": State.FINISHED, "abort": State.FINISHED},   # an abort after the end is moot
    State.FAILED: {"failed": State.FAILED, "deadline": State.FAILED, "done": State.FAILED,
                   "abort": State.FAILED, "fenced": State.FAILED},
}


class Transfer:
    """One transfer's state, driven by ``apply(event)``; ``reason`` is set on failure."""

    __slots__ = ("machine", "table", "state", "reason")

    def __init__(self, machine: str, table: dict[State, dict[str, State]], initial: State) -> None:
        self.machine = machine
        self.table = table
        self.state = initial
        self.reason = ""

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def apply(self, event: str, reason: str = "") -> bool:
        """Move on ``event``; returns True when the state changed."""
        nxt = self.table[self.state].get(event)
        if nxt is None:
            raise IllegalTransition(self.machine, self.state.value, event)
        changed = nxt is not self.state
        if changed and nxt in (State.FAILED, State.ABORTING) and not self.reason:
            self.reason = reason or event
        self.state = nxt
        return changed


def sender_transfer() -> Transfer:
    return Transfer("sender", SENDER_TABLE, State.AWAITING_LAYOUT)


def receiver_transfer() -> Transfer:
    return Transfer("receiver", RECEIVER_TABLE, State.REGISTERED)
