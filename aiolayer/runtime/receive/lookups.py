"""D: lookups that wait for a transfer's registration (late binding), bounded in number and in time.

With late binding P asks D for a transfer's registration (``LookupRequest`` with ``wait``) as soon as
its forward starts, usually before D's scheduler registered the transfer. D holds the answer until the
registration comes (``Receiver.register`` wakes it) or ``Timeouts.lookup_wait`` passed. Waiting on
D's side, instead of P retrying with backoff, answers P within one loop pass of the registration and
costs D one future per waiting lookup, no traffic.

The table is keyed by transfer id only and holds at most ``capacity`` waiting lookups: beyond that a
lookup is refused at once (``busy``), never queued, so a stranger flooding the control port with
made-up ids can fill it (and make genuine lookups fail, as a flood of any request can), never grow it.
"""

from __future__ import annotations

import asyncio

from ...errors import ControlRejected
from ...protocol.codes import NackCode

MAX_WAITING_LOOKUPS = 4096


class WaitingLookups:
    def __init__(self, capacity: int = MAX_WAITING_LOOKUPS) -> None:
        self.capacity = capacity
        self._waiting: dict[str, list[asyncio.Future[None]]] = {}
        self.count = 0          # waiting now
        self.expired = 0        # lookups whose limit passed before the registration came
        self.refused = 0        # lookups refused because the table was full

    def registered(self, transfer_id: str) -> None:
        """``transfer_id`` was registered: its waiting lookups go on (each checks the token itself)."""
        for fut in self._waiting.pop(transfer_id, []):
            if not fut.done():
                fut.set_result(None)

    async def wait(self, transfer_id: str, limit: float) -> bool:
        """Until ``transfer_id`` is registered (True) or ``limit`` passed (False); ``busy`` when full."""
        if self.count >= self.capacity:
            self.refused += 1
            raise ControlRejected(NackCode.BUSY, f"{self.count} lookups wait for their registration already")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._waiting.setdefault(transfer_id, [])
        waiters.append(fut)
        self.count += 1
        try:
            await asyncio.wait_for(fut, limit)
            return True
        except asyncio.TimeoutError:
            self.expired += 1
            return False
        finally:
            self.count -= 1
            waiters = self._waiting.get(transfer_id, [])
            if fut in waiters:
                waiters.remove(fut)
                if not waiters:
                    del self._waiting[transfer_id]

    def close(self) -> None:
        """The receiver closes: every waiting lookup goes on now (and finds no registration)."""
        for transfer_id in list(self._waiting):
            self.registered(transfer_id)
