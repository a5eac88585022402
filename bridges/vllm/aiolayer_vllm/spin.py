"""vLLM's shared-memory message queues spin for a second after every message: cap that spin.

A vLLM worker waits for its next step, and its engine core for the worker's reply, on a
``shm_broadcast.MessageQueue`` whose reader (``SpinCondition``) ``sched_yield``-spins for
``busy_loop_s`` = 1 s after each message before it sleeps on the writer's ZMQ notification (hard-coded,
no setting). A parked D steps every few ms, so its readers never stop spinning, and an idle P spins
for a second after each prefill. When engines share cores (vLLM's default binding on a small host gives
every core to each engine that has a KV connector), those spinners take slices of the cores the other
engine's forward runs on, and each OpenMP barrier of that forward waits for a slice: on 2 shared
cores a 2,000-token request took 45 s through the proxy against 0.19 s on one engine; with the spin
capped at 2 ms, 0.30 s (docs/results.md, ``make bench-vllm`` unpinned). Past the cap a reader sleeps until
the writer's notification, vLLM's own idle path; the wake-up costs ~0.1 ms (p50 112 us, p90 215 us
here, on a loaded box), paid only when two messages are more than the cap apart.

That sleep can miss its wake-up. The writer's notification socket (PUB, send limit 1) drops a
notification while the previous one is still in flight, and the reader's (SUB, conflated) keeps one: a
reader that took the stale one for an earlier message sleeps on, with the next message already there,
until vLLM's recheck, 5 s later (``SHM_READER_RECHECK_INTERVAL_MS``). Seen as ~5 s steps of P's DP
ranks (each engine core and its worker both asleep, each waiting for the other) and ~5 s requests at
random. Within ``BUSY_WINDOW_S`` of its last message a capped reader therefore sleeps at most
``LOST_WAKEUP_CAP_MS`` per look (vLLM's read loop looks again after every wait), so a lost wake-up
costs that much; an engine idle for longer sleeps as vLLM has it.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

BUSY_WINDOW_S = 1.0         # vLLM's own spin window: a reader this close to its last message is in a busy phase
LOST_WAKEUP_CAP_MS = 10     # the longest sleep per look then: what a lost notification costs


def cap_spin(seconds: float) -> bool:
    """Cap how long every shm message-queue reader of this process spins (True: capped; False: this
    vLLM has no such reader, nothing changed). Idempotent: a later call with a lower cap lowers it."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        return False
    if not callable(getattr(SpinCondition, "wait", None)):
        return False
    already = hasattr(SpinCondition, "_aiolayer_spin_cap")
    SpinCondition._aiolayer_spin_cap = seconds   # noqa: SLF001 - our own mark on vLLM's class
    if already:
        return True
    original = SpinCondition.wait

    def wait(self, timeout_ms: int | None = None, *args, **kwargs):
        cap = SpinCondition._aiolayer_spin_cap   # noqa: SLF001
        if getattr(self, "busy_loop_s", 0) > cap:   # the writers' is 0: only readers spin
            self.busy_loop_s = cap
        if time.monotonic() - getattr(self, "last_read", 0.0) < BUSY_WINDOW_S:
            timeout_ms = LOST_WAKEUP_CAP_MS if timeout_ms is None else min(timeout_ms, LOST_WAKEUP_CAP_MS)
        return original(self, timeout_ms, *args, **kwargs)

    SpinCondition.wait = wait
    log.info("aiolayer: vLLM's shm message-queue readers spin at most %g ms after a message", seconds * 1e3)
    return True
