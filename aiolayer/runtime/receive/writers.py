"""D's view of who writes one transfer: the P ranks that reached it, and asking each to stop.

D believes no deployment's word about its writers. A P rank reaches a transfer by fetching its
layout (``LayoutRequest``, with the transfer's token, its engine id, its own control endpoint and
its runtime incarnation) before its first write, or by reporting DONE/FAILED; D records it then.
A layout request is granted only while the transfer takes writes, so once D gives a transfer up the
set is complete: no other P rank can learn where to write. The fence therefore asks exactly these
writers to stop, believes ``stopped`` only from the writer it asked, and ends at once when no P
rank ever reached the transfer (nothing can land).

The number of writers is bounded by the registration (``senders``: P ranks writing head slices); a
rank beyond it is refused before it learns the layout.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from ...errors import ControlRejected
from ...protocol.codes import NackCode

log = logging.getLogger(__name__)

# (P's control endpoint, transfer id, token, reason) -> True once that P confirmed it is quiet
StopSender = Callable[[str, str, str, str], Awaitable[bool]]
ASK_PAUSE_S = (0.05, 1.0)  # first and longest pause before asking a settling P again


class Writer:
    __slots__ = ("sender", "control", "incarnation", "quiet", "granted")

    def __init__(self, sender: str, control: str, incarnation: str, granted: bool) -> None:
        self.sender, self.control, self.incarnation = sender, control, incarnation
        self.quiet = False      # its DONE/FAILED came, or it answered our Abort ``stopped``
        self.granted = granted  # shown the layout: (control, incarnation) say which process that was


class Writers:
    """The P ranks that reached one transfer, at most ``expected`` of them."""

    __slots__ = ("expected", "_by_sender")

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self._by_sender: dict[str, Writer] = {}

    def __len__(self) -> int:
        return len(self._by_sender)

    def admit(self, transfer_id: str, sender: str, grant: tuple[str, str] | None = None,
              word_of: str = "") -> Writer:
        """Record ``sender`` as a writer (idempotent); ``ControlRejected`` (``sender``) for a rank beyond
        the expected ones, or for another process under a known writer's id. ``grant``: the (control,
        incarnation) of a rank about to be shown the layout; None for a DONE/FAILED, which grants nothing
        and speaks for the writer only from its own process (``word_of``: the incarnation it names)."""
        known = self._by_sender.get(sender)
        if known is not None:
            if grant is not None and known.granted and grant != (known.control, known.incarnation):
                # an empty control too: the fence could not ask the process it would admit
                raise ControlRejected(NackCode.SENDER, f"transfer {transfer_id}: writer {sender!r} is another "
                                      f"process ({known.control}, incarnation {known.incarnation})")
            if grant is not None and known.quiet:   # it said DONE/FAILED: a new start of the id is not this one
                raise ControlRejected(NackCode.ENDED, f"transfer {transfer_id}: writer {sender!r} already ended it")
            if word_of and known.granted and known.incarnation and word_of != known.incarnation:
                # its word would mark the writer quiet and settle the transfer while the writer still writes
                raise ControlRejected(NackCode.SENDER, f"transfer {transfer_id}: a word from process {word_of} "
                                      f"under writer {sender!r}, which is process {known.incarnation}")
            if grant is not None and not known.granted:   # known from its DONE/FAILED first: now reachable
                (known.control, known.incarnation), known.granted = grant, True
            return known
        if len(self._by_sender) >= self.expected:
            raise ControlRejected(NackCode.SENDER, f"transfer {transfer_id} already has its {self.expected} "
                                  f"writer(s) ({', '.join(sorted(self._by_sender))}); {sender!r} is not one")
        control, incarnation = grant or ("", "")
        writer = self._by_sender[sender] = Writer(sender, control, incarnation, grant is not None)
        return writer

    def knows(self, sender: str) -> bool:
        return sender in self._by_sender

    def mark_quiet(self, sender: str) -> None:
        """``sender`` said DONE or FAILED, which P sends only once none of its writes can land."""
        writer = self._by_sender.get(sender)
        if writer is not None:
            writer.quiet = True

    def unquiet(self) -> list[Writer]:
        return [w for w in self._by_sender.values() if not w.quiet]


async def ask_until_quiet(writers: Writers, stop: StopSender, transfer_id: str, token: str, reason: str,
                          end: float, ask_s: float) -> bool:
    """True once every writer is quiet (at once when none reached the transfer); each writer that is
    not is asked (backing off) until ``end``, by its own endpoint. False: some writer could not be
    asked or never confirmed: the caller keeps the blocks fenced for the whole grace."""
    asking = writers.unquiet()
    await asyncio.gather(*(_ask_writer(w, stop, transfer_id, token, reason, end, ask_s)
                           for w in asking if w.control))
    quiet = not writers.unquiet()
    if not quiet:
        log.warning("transfer %s: P rank(s) %s never confirmed they stopped; blocks fenced for the whole grace",
                    transfer_id, ", ".join(f"{w.sender} at {w.control or 'an unknown endpoint'}"
                                           for w in writers.unquiet()))
    return quiet


async def _ask_writer(writer: Writer, stop: StopSender, transfer_id: str, token: str, reason: str,
                      end: float, ask_s: float) -> None:
    loop = asyncio.get_running_loop()
    pause = ASK_PAUSE_S[0]
    while not writer.quiet and (left := end - loop.time()) > 0:
        try:
            confirmed = await asyncio.wait_for(stop(writer.control, transfer_id, token, reason), min(left, ask_s))
        except asyncio.TimeoutError:
            confirmed = False
        if confirmed:
            writer.quiet = True
            return
        await asyncio.sleep(max(0.0, min(pause, end - loop.time())))
        pause = min(2 * pause, ASK_PAUSE_S[1])
