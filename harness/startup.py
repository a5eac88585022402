"""Starting several vLLM servers at once, bounded: ``running``, a context manager that stops them all on
exit (``vllm_server.wait_started``, the one loop that waits for servers to serve, spawns them)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from .procs import ServerError
from .vllm_server import VllmServer, wait_started


# Servers started at once by ``running``: two tiny engines started together took 39 s on a 2-core box
# against 68 s one after the other (each start is mostly single-threaded imports and loading).
START_AT_ONCE = max(1, min(2, os.cpu_count() or 1))


@contextlib.contextmanager
def running(*servers: VllmServer) -> Iterator[tuple[VllmServer, ...]]:
    """Start several servers, at most ``START_AT_ONCE`` starting at a time (the next spawned as soon as one
    serves, not batch by batch: a slow multi-rank engine does not hold a quick one back); stop all on exit."""
    started: list[VllmServer] = []
    try:
        wait_started(spawn=servers, at_once=START_AT_ONCE, started=started)
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
