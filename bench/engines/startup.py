"""Starting several vLLM servers at once, bounded: ``running``, a context manager that stops them all on
exit (``vllm_server.wait_started`` waits for servers already spawned)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import httpx

from .procs import ServerError
from .vllm_server import VllmServer


# Servers started at once by ``running``: two tiny engines started together took 39 s on a 2-core box
# against 68 s one after the other (each start is mostly single-threaded imports and loading).
START_AT_ONCE = max(1, min(2, os.cpu_count() or 1))


def _start_rolling(servers: tuple[VllmServer, ...], started: list[VllmServer]) -> None:
    """Spawn ``servers`` in order into ``started`` (the caller stops them), each bounded by its start-up
    timeout; one that dies or is late raises ServerError and every server still starting is stopped."""
    queue, starting = list(servers), []
    try:
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while queue or starting:
                while queue and len(starting) < START_AT_ONCE:
                    server = queue.pop(0).spawn()   # on this thread: PDEATHSIG follows the spawning thread
                    started.append(server)
                    starting.append(server)
                starting = [s for s in starting if not s.serving_yet(client)]
                if starting:
                    time.sleep(0.25)
    except BaseException:
        for s in starting:   # mid-start-up vLLM may sit out SIGTERM (observed: 20 s)
            s.stop(timeout_s=min(5.0, s.stop_timeout_s))
        raise


@contextlib.contextmanager
def running(*servers: VllmServer) -> Iterator[tuple[VllmServer, ...]]:
    """Start several servers, at most ``START_AT_ONCE`` starting at a time (the next spawned as soon as one
    serves, not batch by batch: a slow multi-rank engine does not hold a quick one back); stop all on exit."""
    started: list[VllmServer] = []
    try:
        _start_rolling(servers, started)
        yield tuple(started)
    finally:
        errors = []
        for s in reversed(started):
            try:
                s.stop()
            except ServerError as e:
                errors.append(e)
        if errors:
            raise errors[0]
