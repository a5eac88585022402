"""Stopping a Mooncake runtime destroys its transfer engine there and then, not later in the collector.

Destroying an engine holds the GIL (~1 s, it joins its threads). An engine left in a reference cycle is
destroyed by whichever thread next runs the cyclic garbage collector, e.g. another runtime's loop
thread, which then stalls the whole process (docs/mooncake.md).
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import numpy as np
import pytest

from helpers_node import SMALL_SHAPE, apply_mc_env, mooncake_p, spawn_node

apply_mc_env()  # before any Mooncake engine exists in this process

from aiolayer import NodeConfig, Runtime
from aiolayer.protocol import messages as m

SHAPE = SMALL_SHAPE


@contextlib.contextmanager
def collector_off():
    """No cyclic collection meanwhile: only reference counting can destroy the engine."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@pytest.mark.timeout(60)
def test_stop_destroys_an_idle_engine():
    with collector_off():
        rt = Runtime(NodeConfig(engine_id="p-close-idle", backend="mooncake")).start()
        try:
            engine = weakref.ref(rt.backend._engine)
        finally:
            rt.stop()
        assert engine() is None, "the stopped runtime's engine is left to the garbage collector"


@pytest.mark.slow   # a D node process
@pytest.mark.timeout(60)
def test_stop_destroys_an_engine_that_wrote_to_a_peer():
    with spawn_node(shape=SHAPE) as node, collector_off():
        with mooncake_p("p-close-wrote", 3) as (p, cache):
            engine = weakref.ref(p.backend._engine)
            rep = p.request(node.control, m.AllocRequest(transfer_id="t", num_blocks=1), timeout=5)
            layout = p.request(node.control, m.LayoutRequest(transfer_id="t", token=rep.token), timeout=5)
            src = cache.k_base[0]
            dst = layout.layers[0].k_base + rep.block_ids[0] * SHAPE.block_bytes
            run = [np.array([x], dtype=np.int64) for x in (src, dst, SHAPE.block_bytes)]
            p.loop_thread.call(p.backend.write(layout.session, *run, 5.0), timeout=10)
        assert engine() is None, "the stopped runtime's engine is left to the garbage collector"
