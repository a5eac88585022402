"""The control plane's vocabulary: Nack codes and the Ack details a peer acts on.

Both are ``str`` enums, so a member is its wire string (msgspec encodes it as that string, and it
compares and hashes equal to it): the wire format is the one plain strings gave. The message fields
stay ``str`` (``Nack.code``, ``Ack.detail``), so a reply carrying a code this side does not know
still decodes; compare it with these members, never with a literal.
"""

from __future__ import annotations

import enum
import re


class WireEnum(str, enum.Enum):
    """A str enum whose ``str()`` and ``format()`` are the wire value on every Python (3.10's
    mixed-in enums format as ``Class.MEMBER``), so log lines and counter labels read the same."""

    __str__ = str.__str__
    __format__ = str.__format__   # type: ignore[assignment]  # mypy binds the unbound method's self


class NackCode(WireEnum):
    """Why a request was refused (``Nack.code``, ``ControlRejected.code``). See docs/protocol.md."""

    # any request: the frame or message itself
    FRAME = "frame"                        # not [request_id (8 bytes), payload]
    SIZE = "size"                          # payload larger than the node's max_frame_bytes
    DECODE = "decode"                      # not a valid message
    VERSION = "version"                    # another protocol version
    UNKNOWN = "unknown"                    # a valid message this node does not serve
    INTERNAL = "internal"                  # the handler failed (a bug): the transfer's state is unchanged
    # about a transfer
    AUTH = "auth"                          # no such transfer with this token
    SETTLING = "settling"                  # P: a write of it may still land; ask again
    SETTLED = "settled"                    # D: the id ended recently; a new transfer needs a new id
    ENDED = "ended"                        # D gave the transfer up: write nothing more
    DUPLICATE = "duplicate"                # D: the id is already registered
    BUSY = "busy"                          # a bounded table is full, or the transfer is not terminal yet
    SENDER = "sender"                      # D: a writer or DONE/FAILED from a sender the transfer does not expect
    WRITERS = "writers"                    # D: P's plan names another number of writers than D registered
    STATE = "state"                        # D: the word is not allowed in the transfer's state
    UNKNOWN_TRANSFER = "unknown_transfer"  # D: no such transfer (abort, release)
    NOT_REGISTERED = "not_registered"      # D: lookup before the registration
    NOT_READY = "not_ready"                # D: no KV layout registered yet
    # decode node (``aiolayer node``) management
    BAD_REQUEST = "bad_request"            # an AllocRequest with invalid fields
    NO_SPACE = "no_space"                  # not enough free blocks
    TOKEN = "token"                        # an AllocRequest's token is unusable


class AckDetail(WireEnum):
    """``Ack.detail`` values with a fixed meaning. ``STOPPED`` is a machine signal: P's reply to an
    ``Abort`` meaning none of its writes for the transfer can still land. D's reply to a DONE is
    P's verdict (``messages.done_verdict``): only ``FINISHED``, ``ALREADY_FINISHED`` and a tally
    (``tally_detail``) say that D took the transfer, or this sender's part of it, as written;
    anything else (``failed``, ``aborting``, ``KEPT``, ``ALREADY_FAILED``, an older D's
    ``ALREADY_SETTLED``) fails the transfer at P too."""

    STOPPED = "stopped"
    FINISHED = "finished"                  # D: the DONE finished the transfer (D's state after it)
    FAILED = "failed"                      # D: the transfer failed (D had given it up, or a sender's FAILED)
    KEPT = "kept until registration"       # D: an early DONE/FAILED, applied when the registration comes
    ALREADY_FINISHED = "already finished"  # D: a repeated or late word for a transfer that finished
    ALREADY_FAILED = "already failed"      # D: a repeated or late word for a transfer that failed
    ALREADY_SETTLED = "already settled"    # an older D: a late word for a settled transfer, finished or not
    RELEASED = "released"                  # decode node: the blocks are free again


_TALLY = re.compile(r"(\d+) of (\d+) senders reported")


def tally_detail(heard: int, senders: int) -> str:
    """D's reply to the word of one of several senders while it waits for the others: that word
    is counted (and the transfer still takes writes)."""
    return f"{heard} of {senders} senders reported"


def is_tally(detail: str) -> bool:
    return _TALLY.fullmatch(detail) is not None
