"""D's DONE/FAILED words that came before their transfer's registration, kept ``Timeouts.receive`` seconds.

P may finish before D registered (late binding, or D slow to publish): its word is kept and applied
when the registration comes. Keyed by (transfer id, token, sender): a stranger's early DONE cannot
take the place of the real one, and every sender of a head-sliced transfer is kept. Bounded: beyond
``MAX_EARLY`` words a new one is refused (``busy``), and each word is small (ids of at most
``MAX_ID_CHARS``, a FAILED's reason cut to ``MAX_REASON_CHARS``, no DONE with a check: a P writes only
once D registered, so it has none to send first), so a stranger cannot grow it: a frame may be 1 MiB,
and 4,096 of those kept for ``receive`` would be gigabytes.
"""

from __future__ import annotations

import time

import msgspec

from ...bounded import MAX_KEY_CHARS as MAX_ID_CHARS, drop_expired, refuse_long_keys
from ...errors import ControlRejected
from ...protocol import messages as m
from ...protocol.codes import NackCode

MAX_EARLY = 4096
MAX_REASON_CHARS = 1000
Word = m.Done | m.Failed


class EarlyWords:
    def __init__(self, lifetime_s: float, capacity: int = MAX_EARLY) -> None:
        self.lifetime_s, self.capacity = lifetime_s, capacity
        self._words: dict[tuple[str, str, str], tuple[Word, float]] = {}   # in expiry order

    def __len__(self) -> int:
        return len(self._words)

    def keep(self, msg: Word) -> None:
        """Keep ``msg`` until its transfer registers (the first word per sender wins); ``busy`` when full."""
        if isinstance(msg, m.Done) and msg.check is not None:   # also never applied unverified
            raise ControlRejected(NackCode.NOT_REGISTERED, f"DONE with a check for {msg.transfer_id[:MAX_ID_CHARS]}, "
                                  "which D has not registered: no P writes before that")
        refuse_long_keys(type(msg).__name__, msg.transfer_id, msg.sender, msg.token)
        if isinstance(msg, m.Failed) and len(msg.reason) > MAX_REASON_CHARS:
            msg = msgspec.structs.replace(msg, reason=msg.reason[:MAX_REASON_CHARS])
        now = time.monotonic()
        drop_expired(self._words, now, lambda word: word[1])
        if len(self._words) >= self.capacity:
            raise ControlRejected(NackCode.BUSY, f"{self.capacity} messages already wait for their registration")
        key = (msg.transfer_id, msg.token, msg.sender)
        if key not in self._words:
            self._words[key] = (msg, now + self.lifetime_s)

    def take(self, transfer_id: str) -> list[tuple[str, Word]]:
        """(token, word) of every word kept for ``transfer_id``, removed from the table."""
        if not self._words:
            return []
        return [(key[1], self._words.pop(key)[0]) for key in [k for k in self._words if k[0] == transfer_id]]

    def clear(self) -> None:
        self._words.clear()
