"""In-process P -> D transfers over the memory backend: data integrity, outcomes, clean-up."""

from __future__ import annotations

import threading
import time

import pytest

from aiolayer.backends import memory
from aiolayer.errors import DeadlineExceeded, MetadataError, RuntimeStateError
from aiolayer.kvcache import PagedKVCache
from aiolayer.protocol import messages as m
from helpers_memory import alloc, run_step, spec, status, verify
from aiolayer.runtime.control.plane import open_sockets

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "scattered"])
@pytest.mark.parametrize("src_kind", ["contiguous", "scattered"])
def test_transfer_lands_intact(pd, small_shape, contiguous, src_kind):
    p, d, pc = pd
    n = 10
    src = list(range(3, 3 + n)) if src_kind == "contiguous" else [40, 2, 3, 4, 17, 63, 0, 1, 30, 31]
    rep = alloc(p, d, "t1", n, contiguous)
    if contiguous:
        assert rep.block_ids == list(range(rep.block_ids[0], rep.block_ids[0] + n))
    assert rep.incarnation == d.runtime.incarnation
    run_step(p, 0, [spec(d, "t1", src, rep)], small_shape.num_layers)
    out = p.sender.wait("t1", 10)
    assert out.ok, out.reason
    assert out.reason == ""
    assert out.bytes == 2 * small_shape.num_layers * n * small_shape.block_bytes
    assert [t.layer for t in out.layers] == list(range(small_shape.num_layers))
    for t in out.layers:
        assert t.handed_s <= t.submitted_s <= t.landed_s <= out.finished_s
    v = verify(p, d, pc, "t1", src)
    assert v.state == "finished" and v.reason == ""
    assert status(p, d, "t1").state == "finished"
    assert isinstance(p.request(d.control_endpoint, m.ReleaseRequest(transfer_id="t1")), m.Ack)
    assert d.allocator.free == small_shape.num_blocks
    assert [o.transfer_id for o in p.sender.pop_outcomes()] == ["t1"]


def test_debug_tables_show_a_transfer_while_it_lives_and_nothing_once_it_ended(pd, small_shape):
    """``Runtime.debug_tables``: the plain sizes a leak report compares, read without private attributes."""
    p, d, _ = pd
    rep = alloc(p, d, "dbg", 4, True)
    assert d.runtime.debug_tables()["receiver_entries"] == 1
    run_step(p, 0, [spec(d, "dbg", [1, 2, 3, 4], rep)], small_shape.num_layers)
    assert p.sender.wait("dbg", 10).ok
    p.pop_outcomes()
    p.pop_released()
    tables = p.debug_tables()
    assert all(isinstance(v, int) for v in tables.values()), tables
    assert tables["control_clients"] == 1, tables                  # one client to the one D
    assert tables["sender_live"] == tables["sender_waiters"] == tables["sender_steps"] == 0, tables
    assert tables["sender_outcomes_queued"] == tables["sender_released_queued"] == 0, tables
    assert tables["layout_entries"] == 0 and tables["backend_late"] == 0, tables
    assert isinstance(p.request(d.control_endpoint, m.ReleaseRequest(transfer_id="dbg")), m.Ack)
    assert d.runtime.debug_tables()["receiver_entries"] == 0


def test_untouched_blocks_at_d_stay_zero(pd, small_shape):
    p, d, pc = pd
    rep = alloc(p, d, "t", 4, True)
    run_step(p, 0, [spec(d, "t", [5, 6, 7, 8], rep)], small_shape.num_layers)
    assert p.sender.wait("t", 10).ok
    others = sorted(set(range(small_shape.num_blocks)) - set(rep.block_ids))
    assert not d.cache.blocks[:, :, others].any()      # writes landed only where they were aimed


def test_many_requests_in_one_step(pd, small_shape):
    p, d, pc = pd
    srcs = {"a": [0, 1, 2, 3], "b": [10, 12, 14], "c": [63], "d": list(range(20, 36))}
    reps = {tid: alloc(p, d, tid, len(src), contiguous=(tid != "b")) for tid, src in srcs.items()}
    run_step(p, 7, [spec(d, tid, src, reps[tid]) for tid, src in srcs.items()], small_shape.num_layers)
    for tid, src in srcs.items():
        out = p.sender.wait(tid, 10)
        assert out.ok, (tid, out.reason)
        assert out.bytes == 2 * small_shape.num_layers * len(src) * small_shape.block_bytes
        verify(p, d, pc, tid, src)
    assert p.sender.active == 0


def test_consecutive_steps(pd, small_shape):
    p, d, pc = pd
    for step in range(5):
        tid = f"s{step}"
        src = list(range(step * 8, step * 8 + 8))[::-1]   # reversed: no two blocks merge
        rep = alloc(p, d, tid, 8, contiguous=False)
        run_step(p, step, [spec(d, tid, src, rep)], small_shape.num_layers)
        assert p.sender.wait(tid, 10).ok
        verify(p, d, pc, tid, src)
        p.request(d.control_endpoint, m.ReleaseRequest(transfer_id=tid))
    assert d.allocator.free == small_shape.num_blocks


def test_forward_thread_calls_return_at_once(pd, small_shape):
    """begin_step / layer_ready / end_step only enqueue: bounded and fast on the calling thread."""
    p, d, pc = pd
    rep = alloc(p, d, "fast", 16, True)
    d.runtime.backend.faults.delay_s = 0.2                # slow writes must not slow the forward
    worst = 0.0
    t0 = time.perf_counter()
    p.sender.begin_step(0, [spec(d, "fast", list(range(16)), rep)])
    for layer in range(small_shape.num_layers):
        t = time.perf_counter()
        p.sender.layer_ready(0, layer)
        worst = max(worst, time.perf_counter() - t)
    p.sender.end_step(0)
    assert time.perf_counter() - t0 < 0.1 and worst < 0.05
    out = p.sender.wait("fast", 10)
    assert out.ok
    verify(p, d, pc, "fast", list(range(16)))


# --- clean-up --------------------------------------------------------------------------------------------

def test_stop_leaves_no_region_socket_or_thread(small_shape):
    from aiolayer import DecodeNode, NodeConfig, Runtime

    d = DecodeNode(small_shape, NodeConfig(engine_id="d-clean", backend="memory")).start()
    p = Runtime(NodeConfig(engine_id="p-clean", backend="memory")).start()
    try:
        pc = PagedKVCache(small_shape)
        p.register_kv_memory(pc.k_base, pc.v_base, small_shape.block_bytes, small_shape.num_blocks)
        assert p.backend.registered_regions == 2 * small_shape.num_layers
        assert d.runtime.backend.registered_regions == 2 * small_shape.num_layers
        rep = alloc(p, d, "c", 4, False)
        run_step(p, 0, [spec(d, "c", [1, 2, 3, 4], rep)], small_shape.num_layers)
        assert p.sender.wait("c", 10).ok
        assert open_sockets() >= 3                      # D's server, P's server, P's client to D
    finally:
        t0 = time.monotonic()
        p.stop()
        d.stop()
        assert time.monotonic() - t0 < 2 * p.timeouts.shutdown
    assert p.backend.registered_regions == 0
    assert d.runtime.backend.registered_regions == 0
    assert open_sockets() == 0
    assert p.backend.session not in memory._registry and d.runtime.backend.session not in memory._registry
    assert not p.loop_thread.alive and not d.runtime.loop_thread.alive
    assert not [t for t in threading.enumerate() if t.name in ("aiolayer-p-clean", "aiolayer-d-clean")]
    p.stop()                                            # stopping twice is harmless
    with pytest.raises(RuntimeStateError):
        p.start()


# --- layer identity, device events, collectives (seed fragilities 14, 15, 18) ------------------------

def test_layers_are_identified_by_index_not_by_arrival_order(pd, small_shape):
    """Extra hooks (MTP) shifted a counter-based layer id in the seed (fragility 14); the caller names the layer."""
    p, d, pc = pd
    rep = alloc(p, d, "shuffled", 3, False)
    p.sender.begin_step(7, [spec(d, "shuffled", [4, 5, 6], rep)])
    for layer in reversed(range(small_shape.num_layers)):
        p.sender.layer_ready(7, layer)
    p.sender.end_step(7)
    assert p.sender.wait("shuffled", 10).ok
    verify(p, d, pc, "shuffled", [4, 5, 6])     # every layer's K/V landed in that layer's tensors


def test_events_are_polled_never_a_device_wide_synchronize():
    import ast
    import asyncio
    import pathlib

    import aiolayer
    from aiolayer.runtime.send.events import wait_event

    root = pathlib.Path(aiolayer.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                assert node.attr != "synchronize", f"{path.name} calls synchronize()"

    class PendingEvent:
        def __init__(self, ready_after: int) -> None:
            self.queries, self.ready_after = 0, ready_after

        def query(self) -> bool:
            self.queries += 1
            return self.queries > self.ready_after

    event = PendingEvent(ready_after=5)
    asyncio.run(wait_event(event, timeout=2))
    assert event.queries == 6
    with pytest.raises(DeadlineExceeded):
        asyncio.run(wait_event(PendingEvent(ready_after=10 ** 9), timeout=0.05))


def test_no_collective_on_the_connector_path():
    import ast
    import pathlib

    import aiolayer

    for path in pathlib.Path(aiolayer.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("torch.distributed") for n in names), f"{path.name} imports {names}"


def test_source_released_only_after_every_write_settled(memory_runtime, memory_decode_node, small_shape):
    """The seed freed P's blocks with sends still queued (fragility 9); here release waits for the last write."""
    d = memory_decode_node(small_shape, engine_id="d-slow")
    p = memory_runtime("p-fence")
    pc = PagedKVCache(small_shape)
    p.register_kv_memory(pc.k_base, pc.v_base, small_shape.block_bytes, small_shape.num_blocks)
    d.runtime.backend.faults.delay_s = 0.05      # every write takes a while to land
    rep = alloc(p, d, "held", 2, True)
    run_step(p, 1, [spec(d, "held", [0, 1], rep)], small_shape.num_layers)
    released_at = None
    deadline = time.monotonic() + 10
    while released_at is None and time.monotonic() < deadline:
        if "held" in p.sender.pop_released():
            released_at = time.perf_counter()
        time.sleep(0.002)
    assert released_at is not None
    out = p.sender.wait("held", 1)
    assert out.ok and out.source_released and len(out.layers) == small_shape.num_layers
    assert max(t.landed_s for t in out.layers) <= released_at   # no write was still reading the source
    assert status(p, d, "held").state == "finished"


def test_layout_fetch_refused_for_a_stale_token_does_not_fail_the_valid_transfers(pd):
    """D restarted on the same port: transfers allocated on the old one share a fetch with new ones."""
    import asyncio

    p, d, pc = pd
    valid = [alloc(p, d, f"new-{i}", 1, True) for i in range(2)]
    stale = ("gone-with-the-old-incarnation", "s" * 32)

    async def fetch_all():
        waiters = [p.layouts.get(d.control_endpoint, stale)]
        waiters += [p.layouts.get(d.control_endpoint, (r.transfer_id, r.token)) for r in valid]
        return await asyncio.gather(*waiters, return_exceptions=True)

    results = p.loop_thread.call(fetch_all(), timeout=10)
    assert isinstance(results[0], MetadataError) and "auth" in str(results[0]), results[0]
    assert all(getattr(r, "engine_id", None) == "d" for r in results[1:]), results
    assert p.layouts.fetches[d.control_endpoint] <= 1 + len(valid)
