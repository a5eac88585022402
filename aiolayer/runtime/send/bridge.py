"""LayerBridge: the forward thread hands items to the loop without ever blocking.

The producer appends to a deque (atomic under the GIL) and wakes the loop only when the consumer
side has gone idle. After each batch the consumer lingers for ``linger_s``, checking the deque
every ``poll_s`` (one loop timer tick) without being woken: during a forward pass, where layers
arrive every few milliseconds, the producer then pays one append and no syscall (a cross-thread
wake-up costs ~8 us on a VM). Each look that finds nothing doubles the next tick, up to
``max_poll_s``: a loop timer wake-up costs ~50 us of CPU on a 2-core VM, which a CPU engine's forward
pays when it shares its core, so ticks every 1 ms through a 300 ms prefill would take it ~15 ms.
An item put with ``wake=True`` (a step's end: its last layer is waiting) cuts a lingering or polling
consumer's nap short, so it is not left for up to a tick; one wake-up per step, not per layer.
While a step's layers come at a steady rhythm (a prefill: one every ~20 ms here), ``LayerPace`` lets
the consumer sleep through most of the gap to the next one instead of ticking through it: about 2.6
looks per layer instead of six, while a layer waits for its look about as long as without it. A CPU
prefill of a long prompt, a layer every ~140 ms, takes ~6 looks per layer instead of ~24.
If the consumer is dead the producer gets ``BridgeClosed`` at once;
if it falls behind by ``capacity`` items, ``BridgeFull``.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from ...errors import BridgeClosed, BridgeFull, RuntimeStateError


class LayerBridge:
    def __init__(self, capacity: int = 65536, drain_batch: int = 256, linger_s: float = 0.05,
                 poll_s: float = 0.001, max_poll_s: float = 0.004) -> None:
        self.capacity = capacity
        self.drain_batch = drain_batch
        self.linger_s = linger_s
        self.poll_s = poll_s
        self.max_poll_s = max(poll_s, max_poll_s)
        self._items: collections.deque[Any] = collections.deque()
        self._idle = False
        self._closed: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._nap: asyncio.Future[None] | None = None   # the consumer's current lingering or polling sleep (loop only)
        self.wakeups = 0          # how often the producer had to wake the loop (a syscall each)

    # --- producer side (any thread) ---------------------------------------------------------

    def put(self, item: Any, wake: bool = False) -> None:
        """Queue ``item``; with ``wake``, also end the consumer's nap (one cross-thread call)."""
        if self._closed is not None:
            raise BridgeClosed(f"layer bridge is closed: {self._closed}")
        items = self._items
        if len(items) >= self.capacity:
            raise BridgeFull(f"layer bridge holds {len(items)} items; the loop is not draining")
        items.append(item)
        # asleep, or (``wake``) napping for a tick; a busy consumer sees the item without help. Either
        # wake-up ends both ways of waiting: a stray one only makes the consumer look at an empty deque.
        if self._idle or wake:
            self._idle = False
            self._call_consumer()

    def _call_consumer(self) -> None:
        self.wakeups += 1
        loop = self._loop
        if loop is None or self._wakeup is None:   # idle is set only by drain, on an attached bridge
            raise RuntimeStateError("layer bridge is not attached to a loop")
        try:
            loop.call_soon_threadsafe(self._wake_all)
        except RuntimeError as exc:  # loop closed under us
            self.close(exc)
            raise BridgeClosed("layer bridge consumer loop is closed") from exc

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def close(self, reason: BaseException | str = "closed") -> None:
        """Refuse further items; thread-safe and idempotent (first reason wins)."""
        if self._closed is None:
            self._closed = reason if isinstance(reason, BaseException) else BridgeClosed(reason)
        if self._loop is not None and self._wakeup is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._wake_all)
            except RuntimeError:
                pass

    def _wake_all(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
        self._cut_nap()

    def __len__(self) -> int:
        return len(self._items)

    # --- consumer side (the loop) ------------------------------------------------------------

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._wakeup = asyncio.Event()

    def _cut_nap(self) -> None:
        nap = self._nap
        if nap is not None and not nap.done():
            nap.set_result(None)

    async def _sleep(self, loop: asyncio.AbstractEventLoop, seconds: float) -> None:
        """``asyncio.sleep`` that a ``wake=True`` put ends early (``_cut_nap``)."""
        self._nap = nap = loop.create_future()
        timer = loop.call_later(seconds, self._cut_nap)
        try:
            await nap
        finally:
            timer.cancel()
            self._nap = None

    def next_tick(self, tick: float, found: bool) -> float:
        """The poll tick after a look: back to ``poll_s`` if it found something, else twice as long."""
        return self.poll_s if found else min(2 * tick, self.max_poll_s)

    async def drain(self, poll: float = 0.0) -> list[Any]:
        """Wait until items are there, then return at most ``drain_batch`` of them in order.

        Returns an empty list once the bridge is closed and empty, and with ``poll`` (a tick in seconds:
        the caller has something else to look at, an open step's inbox) after that tick without items.
        """
        items, loop, wakeup = self._items, self._loop, self._wakeup
        if loop is None or wakeup is None:
            raise RuntimeStateError("layer bridge is not attached to a loop")
        if poll and not items and self._closed is None:
            await self._sleep(loop, poll)
            if not items:
                return []
        if not items and self.linger_s > 0 and self._closed is None:
            end, tick = loop.time() + self.linger_s, self.poll_s
            while not items and self._closed is None and loop.time() < end:
                await self._sleep(loop, tick)
                tick = self.next_tick(tick, False)
        while not items:
            if self._closed is not None:
                return []
            wakeup.clear()
            self._idle = True
            if items or self._closed is not None:  # re-check: a put may have raced the flag
                self._idle = False
                continue
            await wakeup.wait()
        self._idle = False
        batch: list[Any] = []
        popleft = items.popleft
        for _ in range(min(len(items), self.drain_batch)):
            batch.append(popleft())
        return batch


class LayerPace:
    """The rhythm of an open step's layers, as the loop's looks find them: after a look that found
    ``count`` layers, the consumer may nap ``share`` of the time one layer took since the previous
    finding look, at most ``max_nap_s``; a nap that ends before the next layer is followed by the
    bridge's ticks from the shortest (``poll_s``, then doubling), so a layer waits for its look about
    as long as without the pace. Where layers come faster the nap shrinks (several found at once split
    the time), so a pace learned from a slow step costs a fast one no more than one nap. ``max_nap_s``
    bounds that one nap; it is long enough for the slowest prefill that still hands layers over one by
    one (each look a loop wake-up the forward's core pays for): a nap ends before the next layer is
    due, whatever its length. The loop calls ``reset`` whenever no step is open: the next step's rhythm
    is learned afresh."""

    def __init__(self, poll_s: float, share: float = 0.9, max_nap_s: float = 0.25) -> None:
        self.poll_s, self.share, self.max_nap_s = poll_s, share, max_nap_s
        self._last: float | None = None   # when a look last found layers

    def reset(self) -> None:
        self._last = None

    def after(self, now: float, count: int) -> float:
        """The tick after a look at ``now`` that found ``count`` (> 0) layers."""
        last, self._last = self._last, now
        if last is None:
            return self.poll_s   # the first of a step: no rhythm yet
        return max(self.poll_s, min(self.share * (now - last) / count, self.max_nap_s))
