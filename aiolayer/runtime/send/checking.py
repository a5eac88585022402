"""P's integrity check of one sampled transfer, digested while its layers are still being submitted.

A layer's source is final once the forward handed it over, so P does not wait for the last layer to
digest the sampled ones (``integrity.py``): after each ``CHUNKS``-th part of the layers was submitted, the
sampled layers among them are digested in a worker thread, and once such a digest is ready, the layers
whose writes already completed go to D in an ``EarlyCheck`` (``send_early``). D verifies them while P
still computes the rest, and at DONE reads only the layers no early check covered. ``final`` is the
whole check, for the DONE, once every layer was submitted and every digest ended.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Callable

from ...protocol import messages as m
from ..integrity import CheckPlan, check_of, digest_layers
from ..spec import LocalLayout

log = logging.getLogger(__name__)

CHUNKS = 4   # digests (and early checks) per transfer at most: a quarter of its layers each


class SourceCheck:
    """One transfer's check at P. ``landed()`` says which layers' writes completed; ``send_early(part)``
    sends D a part of the check (the sender's, best effort). Lives on the loop."""

    __slots__ = ("local", "plan", "sampled", "landed", "send_early", "every", "submitted", "waiting", "digests",
                 "sent", "running", "broken", "final")

    def __init__(self, local: LocalLayout, plan: CheckPlan, num_layers: int, landed: Callable[[], set[int]],
                 send_early: Callable[[m.LayerCheck], None]) -> None:
        self.local, self.plan, self.landed, self.send_early = local, plan, landed, send_early
        self.sampled = frozenset(plan.layers)
        self.every = max(1, -(-num_layers // CHUNKS))   # a digest after this many layers were submitted
        self.submitted = 0
        self.waiting: list[int] = []     # sampled layers submitted, not yet given to a digest
        self.digests: dict[int, tuple[int, int | None]] = {}
        self.sent: set[int] = set()      # layers D was sent early
        self.running = 0                 # digests in worker threads
        self.broken = False              # a digest raised: no check for this transfer
        self.final: asyncio.Future[m.LayerCheck | None] | None = None

    def add(self, layers: list[int]) -> None:
        """These layers were submitted (their source is final); a digest starts at each chunk's end."""
        self.waiting += [layer for layer in layers if layer in self.sampled]
        before, self.submitted = self.submitted, self.submitted + len(layers)
        if self.waiting and before // self.every != self.submitted // self.every:
            self._digest()

    def finish(self) -> asyncio.Future[m.LayerCheck | None]:
        """Every layer was submitted: the last digest starts; ``final`` resolves once every one ended."""
        self.final = asyncio.get_running_loop().create_future()
        if self.waiting:
            self._digest()
        self._resolve()
        return self.final

    def _digest(self) -> None:
        layers, self.waiting = self.waiting, []
        self.running += 1
        job = asyncio.get_running_loop().run_in_executor(None, digest_layers, self.local, self.plan, layers)
        job.add_done_callback(functools.partial(self._digested, layers))

    def _digested(self, layers: list[int], job: asyncio.Future[list[tuple[int, int | None]]]) -> None:
        self.running -= 1
        if job.cancelled() or job.exception() is not None:   # the executor shut down, or a bug
            if not job.cancelled():
                log.error("integrity digest raised; this transfer goes unchecked", exc_info=job.exception())
            self.broken = True
        else:
            self.digests.update(zip(layers, job.result()))
            self._early()
        self._resolve()

    def _early(self) -> None:
        """The digested layers that landed and D was not sent yet, unless the DONE carries them as soon."""
        landed = self.landed()
        part = [layer for layer in self.digests if layer in landed and layer not in self.sent]
        everything = self.final is not None and not self.running and len(self.sent) + len(part) == len(self.plan.layers)
        if part and not everything:
            self.sent.update(part)
            self.send_early(check_of(self.plan, {layer: self.digests[layer] for layer in part}))

    def _resolve(self) -> None:
        if self.final is None or self.final.done() or self.running:
            return
        self.final.set_result(None if self.broken else check_of(self.plan, self.digests))
