"""Bounded tables keyed by peer or transfer: a dict kept in insertion order, the oldest entry first.

Peers and transfers come and go, so every table the runtime keeps per peer or per transfer forgets its
oldest entries past a capacity; a re-inserted key moves to the end, so "oldest" is "used longest ago".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from .errors import ControlRejected
from .protocol.codes import NackCode
from .protocol.messages import MAX_KEY_CHARS   # the longest id a message decodes with; a table keeps no longer

K = TypeVar("K")
V = TypeVar("V")


def refuse_long_keys(what: str, *keys: str) -> None:
    """Refuse (``decode``) a stranger's ``what`` whose id, sender or token is past ``MAX_KEY_CHARS``."""
    if max(map(len, keys)) > MAX_KEY_CHARS:
        raise ControlRejected(NackCode.DECODE, f"{what}: transfer id, sender or token longer than {MAX_KEY_CHARS}")


def put_newest(table: dict[K, V], key: K, value: V, capacity: int) -> int:
    """``table[key] = value`` as its newest entry; the oldest go beyond ``capacity``. Returns how many went."""
    table.pop(key, None)
    table[key] = value
    dropped = 0
    while len(table) > capacity:
        del table[next(iter(table))]
        dropped += 1
    return dropped


def drop_expired(table: dict[K, V], now: float, expiry_of: Callable[[V], float]) -> None:
    """Drop the oldest entries while their expiry has come; for tables kept in expiry order (one
    lifetime for every entry, or a repeat moved to the end), so the first one still due stops it."""
    while table:
        oldest = next(iter(table))
        if expiry_of(table[oldest]) > now:
            return
        del table[oldest]
