"""aiolayer's threads in a vLLM worker run on the cores the engine was given, not on the forward's core.

vLLM's CPU workers pin their OpenMP threads, the main thread included (``VLLM_CPU_OMP_THREADS_BIND``;
its default binds each worker too), and a thread inherits its creator's CPU mask. Started from the
pinned main thread, the runtime's loop thread, its executor threads and Mooncake's transport threads
would share that one core with the forward and with the worker's busy-waiting message queue: every
registration, layout answer and incoming write then waits for a slice of a saturated core (seen:
D's registrations, layout answers and Mooncake writes missing 10-30 s deadlines). vLLM's own NIXL
connector moves its KV threads off the compute cores for the same reason. The mask to use is the
engine core's (the worker's parent, which vLLM does not pin), so a ``taskset`` the user put on the
whole engine still holds.
"""

from __future__ import annotations

import contextlib
import logging
import os

log = logging.getLogger(__name__)


def engine_cpus() -> set[int] | None:
    """The CPUs of the engine this worker belongs to (None: unknown, or not Linux)."""
    try:
        return os.sched_getaffinity(os.getppid())
    except (AttributeError, OSError):   # no such call here, or the parent is gone
        return None


@contextlib.contextmanager
def unpinned():
    """Threads started inside run on the engine's CPUs; the calling thread's own mask is restored."""
    wanted = engine_cpus()
    try:
        mine = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        mine = None
    if not wanted or mine is None or wanted == mine:
        yield
        return
    os.sched_setaffinity(0, wanted)   # pid 0: this thread only
    log.debug("aiolayer threads on CPUs %s (the forward's thread is on %s)", sorted(wanted), sorted(mine))
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)
