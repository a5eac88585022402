"""D's record of one registered transfer (``Entry``) and the result a receive ends in (``Received``).

The receiver owns the entries and changes them on the loop only; a ``Received`` is a finished value,
handed to other threads whole.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import msgspec

from ...protocol.state import receiver_transfer
from ..integrity import EarlyChecks
from .writers import Writers

Release = Callable[[list[int]], None]   # frees a transfer's blocks once it is released


class Received(msgspec.Struct, kw_only=True):
    transfer_id: str
    ok: bool
    reason: str = ""
    finished_s: float = 0.0
    refused: bool = False         # this call's registration was refused: its blocks were never registered
                                  # (another receive under the id may be live: its blocks stay its own)
    registered_s: float = 0.0     # perf_counter when it was registered (0: never registered)


class Entry:
    __slots__ = ("transfer_id", "token", "block_ids", "first_block", "state", "writers",
                 "timer", "on_release", "fence", "forget", "registered_s", "cause", "early", "write_end")

    def __init__(self, transfer_id: str, token: str, block_ids: list[int], on_release: Release | None,
                 first_block: int, senders: int = 1) -> None:
        self.transfer_id = transfer_id
        self.token = token
        self.block_ids = block_ids
        self.first_block = first_block
        self.state = receiver_transfer(senders)   # with the P ranks it waits for (head slices)
        self.writers = Writers(senders)         # the P ranks that reached it: the fence asks these
        self.timer: asyncio.TimerHandle | None = None
        self.on_release = on_release
        self.fence: asyncio.Task[None] | None = None
        self.forget = False                     # forget the entry once settled: the engine owns the blocks
        self.registered_s = time.perf_counter()  # a finished receive's duration starts here
        self.cause = ""                         # why it failed, if it does (``receiver.FAILURE_CAUSES``)
        self.early = EarlyChecks()              # its writers' early integrity checks (integrity.py)
        self.write_end = 0.0                    # loop time: no write may be submitted after (its writers' window)
