"""P's DONEs to one D, batched: those decided in one pass of the loop go to D as ONE ``DoneBatch``.

Transfers whose last writes settle in the same pass (a step's requests finishing together) cost one
frame, one reply and one control call for all of them instead of one each, on P's loop and on D's.
D applies each item as if it came alone and answers ``Replies`` in order, so what a DONE means does
not change: a transfer's outcome is published only once D acked ITS item.
An item D left unanswered (a fault-injection hook dropped it), and every item when D does not know
the batch (an older node answers ``Nack`` ``decode``: from then on that D gets them one by one) or
finds it too big (``size``), is sent again alone, within the same deadline. A batch whose reply was
lost is sent again whole (``call_with_retries``): D answers what it applied the first time
"already finished", which P takes as its DONE taken (``messages.done_verdict``).
The first DONE of a pass to a D waits one pass for others to join; alone, it goes as a plain
``Done`` from its own transfer's coroutine (no task, as before); with others, one task sends the
batch, so that no answer depends on one transfer's coroutine (cancelled, it hands the rest on).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Coroutine

from ...config import Timeouts
from ...errors import ControlError, ControlRejected, ControlTimeout, DeliveryFailed, ProtocolError, map_errors
from ...protocol import messages as m
from ...protocol.codes import NackCode
from ..control.plane import ControlPeers
from ..loop import Spawn, fail_futures, not_running, settle_future, spawn_or_fail
from ..spec import TransferSpec

log = logging.getLogger(__name__)
_Item = tuple[m.Done, asyncio.Future[m.Message]]


class DoneBatcher:
    def __init__(self, peers: ControlPeers, timeouts: Timeouts) -> None:
        self.peers = peers
        self.timeouts = timeouts
        self.spawn: Spawn = not_running                 # the runtime's, set when the sender runs
        self._queued: dict[str, list[_Item]] = {}       # D's endpoint -> DONEs of this pass
        self._singles: set[str] = set()                 # Ds that answered a batch Nack(decode): one by one
        self.batches = 0                                # frames that carried more than one DONE
        self.batched = 0                                # DONEs those frames carried

    async def tell(self, spec: TransferSpec, msg: m.Done | m.Failed) -> m.Message:
        """Deliver a transfer's DONE (batched) or FAILED to its D with bounded retries: D's reply;
        ``DeliveryFailed`` (logged) when D did not take it (D's own deadline and fence take over)."""
        try:
            with map_errors(DeliveryFailed):   # a bad endpoint too
                if isinstance(msg, m.Done):
                    return await self.deliver(spec.peer, msg)
                client = await self.peers.get(spec.peer)
                return await client.call_with_retries(msg, self.timeouts.done_delivery)
        except DeliveryFailed as exc:
            log.warning("transfer %s: could not tell D %s: %s", spec.transfer_id, type(msg).__name__, exc.cause)
            raise

    async def deliver(self, endpoint: str, done: m.Done) -> m.Message:
        """D's reply to this DONE; raises as ``ControlClient.call_with_retries`` would (a Nack:
        ``ControlRejected``), within ``Timeouts.done_delivery``."""
        answer: asyncio.Future[m.Message] = asyncio.get_running_loop().create_future()
        queue = self._queued.setdefault(endpoint, [])
        queue.append((done, answer))
        if len(queue) > 1:
            return await answer   # the first DONE of this pass to this D sends them all
        try:
            await asyncio.sleep(0)    # one pass: the DONEs decided in it join the queue
        except asyncio.CancelledError:
            self._start([it for it in self._queued.pop(endpoint, []) if it[1] is not answer], endpoint)
            raise
        items = self._queued.pop(endpoint, [])
        if len(items) > 1:   # a task: the others' answers must not depend on this transfer's coroutine
            self._start(items, endpoint)
            return await answer
        try:                 # alone: sent from this coroutine, no task
            await self._send(endpoint, items)
        finally:
            if answer.done() and not answer.cancelled():
                answer.exception()   # retrieved here, also when this coroutine is cancelled
        return answer.result()

    def _start(self, items: list[_Item], endpoint: str) -> None:
        if not items:
            return
        spawn_or_fail(self.spawn, self._send(endpoint, items), f"done-batch {endpoint}", items,
                      lambda exc: ControlError(f"DONE not sent: {type(exc).__name__}: {exc}"))

    async def _send(self, endpoint: str, items: list[_Item]) -> None:
        """Never raises (but cancellation): every item's future gets its answer or its error."""
        deadline = asyncio.get_running_loop().time() + self.timeouts.done_delivery
        try:
            live = [item for item in items if not item[1].done()]   # done: its waiter was cancelled
            if len(live) == 1 or endpoint in self._singles:
                await asyncio.gather(*(self._alone(endpoint, item, deadline) for item in live))
            elif live:
                await self._batch(endpoint, live, deadline)
        except asyncio.CancelledError:
            fail_futures(items, ControlError("DONE not delivered: the runtime stopped"))
            raise
        except Exception as exc:  # noqa: BLE001 - becomes each item's failure, logged by its sender
            fail_futures(items, exc)

    async def _batch(self, endpoint: str, live: list[_Item], deadline: float) -> None:
        client = await self.peers.get(endpoint)
        batch = m.DoneBatch(items=[done for done, _ in live])
        try:
            reply = await client.call_with_retries(batch, self._left(deadline))
        except ControlRejected as exc:
            if exc.code not in (NackCode.DECODE, NackCode.UNKNOWN, NackCode.SIZE):
                raise
            if exc.code != NackCode.SIZE:   # too big for D's max_frame_bytes: this batch only
                log.warning("D at %s does not take batched DONEs (%s): they go one by one to it", endpoint, exc.code)
                self._singles.add(endpoint)
            reply = m.Replies(items=[None] * len(live))
        else:
            if not isinstance(reply, m.Replies) or len(reply.items) != len(live):
                raise ProtocolError(f"D at {endpoint} answered {len(live)} batched DONEs with {type(reply).__name__}")
            self.batches += 1
            self.batched += len(live)
        again: list[Coroutine[Any, Any, None]] = []
        for item, answer in zip(live, reply.items):
            if answer is None:
                again.append(self._alone(endpoint, item, deadline))
            elif isinstance(answer, m.Nack):
                settle_future(item[1], exc=ControlRejected(answer.code, answer.reason))
            else:
                settle_future(item[1], result=answer)
        if again:
            await asyncio.gather(*again)

    async def _alone(self, endpoint: str, item: _Item, deadline: float) -> None:
        done, answer = item
        try:
            client = await self.peers.get(endpoint)
            settle_future(answer, result=await client.call_with_retries(done, self._left(deadline)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the item's own error, as a plain call would raise it
            settle_future(answer, exc=exc)

    def _left(self, deadline: float) -> float:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise ControlTimeout("done_delivery", self.timeouts.done_delivery, "DONE not answered in time")
        return left
