"""Opening a Mooncake segment to a stopped peer must not stall writes to other peers on the loop.

Mooncake's Python engine holds one lock across ``openSegment`` (the handshake with a new peer, which
waits up to 60 s on a peer that is stopped) in ``transfer_submit_write``, and every submit takes that
lock, whichever peer it writes to. P here is an in-process Mooncake ``Runtime``; A and B are
``aiolayer node`` subprocesses (D). A's segment is open; B is stopped before P's first write to it, so
that write's handshake hangs in its thread while P writes to A.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time

import numpy as np
import pytest

from helpers_node import SMALL_SHAPE, apply_mc_env, freeze, mooncake_p, spawn_node, stoppable_node, until_streaming
from helpers_step import d_crcs, d_state

apply_mc_env()  # before any Mooncake engine exists in this process

from aiolayer import NodeConfig, Runtime, Timeouts, TransferSpec
from aiolayer.backends.mooncake import MooncakeBackend
from aiolayer.errors import DeadlineExceeded, FrameDropped, TransferTimeout
from aiolayer.kvcache import PagedKVCache
from aiolayer.kvcache import checksums
from aiolayer.protocol import messages as m
from aiolayer.runtime.control.hooks import install_hooks

SHAPE = SMALL_SHAPE
DEADLINE_S = 1.0      # the deadline of the writes that must fail in time
WINDOW_S = 3.0        # how long B stays stopped once P started writing to it
MAX_GAP_S = 0.5       # the loop's longest pause allowed meanwhile
SLACK_S = 0.5         # a write ends this close to its deadline


class Peer:
    """A D node's transfer of ``n`` blocks: its session and the write of P's blocks 0.. into them
    (layer 0's K), one run per block."""

    def __init__(self, p, node, tid: str, cache, n: int = 1) -> None:
        rep = p.request(node.control, m.AllocRequest(transfer_id=tid, num_blocks=n), timeout=5)
        layout = p.request(node.control, m.LayoutRequest(transfer_id=tid, token=rep.token), timeout=5)
        self.p, self.node, self.tid, self.session = p, node, tid, layout.session
        self.src = list(range(n))
        dst = [layout.layers[0].k_base + b * SHAPE.block_bytes for b in rep.block_ids]
        self.run = (np.array([cache.k_base[0] + b * SHAPE.block_bytes for b in self.src], dtype=np.int64),
                    np.array(dst, dtype=np.int64), np.full(n, SHAPE.block_bytes, dtype=np.int64))

    def landed(self, cache) -> bool:
        v = self.p.request(self.node.control, m.VerifyRequest(transfer_id=self.tid), timeout=5)
        return v.crc_k[0] == checksums(cache.blocks, self.src)[0][0]


async def timed_write(backend, peer: Peer, timeout: float, t0: float) -> tuple[float, BaseException | None]:
    """When (since ``t0``) the write ended, and what it raised."""
    try:
        await backend.write(peer.session, *peer.run, timeout)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return time.monotonic() - t0, exc
    return time.monotonic() - t0, None


async def heartbeat(beats: list[float]) -> None:
    """The loop's pulse: a time stamp every 10 ms while it runs."""
    while True:
        beats.append(time.monotonic())
        await asyncio.sleep(0.01)


def longest_gap(beats: list[float], now: float) -> tuple[float, float]:
    """The loop's longest pause, the one still going on at ``now`` included, and when it began
    (seconds after the first beat)."""
    stamps = list(beats) + [now]
    gap, began = max((b - a, a) for a, b in itertools.pairwise(stamps))
    return gap, began - stamps[0]


def while_b_stopped(p, b, scenario, window: float) -> tuple[tuple[float, float], object]:
    """Stop B, run ``scenario`` on P's loop, resume B after ``window`` s: the loop's longest pause
    meanwhile (``longest_gap``) and what the scenario returned."""
    beats: list[float] = []
    freeze(b.pid)
    pulse = p.loop_thread.submit(heartbeat(beats))
    try:
        pending = p.loop_thread.submit(scenario)
        time.sleep(window)
        stalled = longest_gap(beats, time.monotonic()) if beats else (window, 0.0)
    finally:
        os.kill(b.pid, signal.SIGCONT)
        pulse.cancel()
    return stalled, pending.result(timeout=20)


async def settle(backend, *excs: BaseException | None) -> None:
    """Every run the failed writes handed over has ended (B runs again)."""
    late = [f for exc in excs if exc is not None for f in exc.pending]
    await asyncio.wait_for(asyncio.gather(*map(asyncio.shield, late)), 15)


@pytest.mark.timeout(80)
def test_opening_a_stopped_peer_does_not_stall_writes_to_an_open_one():
    with stoppable_node(SHAPE) as a, stoppable_node(SHAPE) as b, mooncake_p("p-open", 5) as (p, cache):
        backend = p.backend
        to_a, to_b = Peer(p, a, "to-a", cache), Peer(p, b, "to-b", cache)
        p.loop_thread.call(backend.write(to_a.session, *to_a.run, 5.0), timeout=10)   # A's segment is open

        async def scenario() -> dict:
            t0 = time.monotonic()
            b_done = asyncio.ensure_future(timed_write(backend, to_b, DEADLINE_S, t0))
            await asyncio.sleep(0.2)   # B's handshake is under way in its thread
            a_done = await timed_write(backend, to_a, DEADLINE_S, time.monotonic())
            return {"a": a_done, "b": await b_done}

        (stalled, began), out = while_b_stopped(p, b, scenario(), WINDOW_S)
        (took_a, exc_a), (took_b, exc_b) = out["a"], out["b"]
        seen = (f"loop's longest pause {stalled:.2f} s (from {began:.2f} s); write to A ended after "
                f"{took_a:.2f} s ({exc_a!r}), to B after {took_b:.2f} s ({exc_b!r})")
        print(seen)
        assert stalled < MAX_GAP_S, seen
        assert exc_a is None or isinstance(exc_a, TransferTimeout), seen
        assert took_a < DEADLINE_S + SLACK_S, seen
        assert isinstance(exc_b, TransferTimeout) and exc_b.pending, seen
        assert DEADLINE_S - 0.05 <= took_b < DEADLINE_S + SLACK_S, seen

        # Once B runs again, every late submit lands and settles; both peers then take writes.
        async def after() -> None:
            await settle(backend, exc_a, exc_b)
            await backend.write(to_a.session, *to_a.run, 5.0)
            await backend.write(to_b.session, *to_b.run, 5.0)
        p.loop_thread.call(after(), timeout=25)
        assert backend.quarantined == 0
        assert to_a.landed(cache) and to_b.landed(cache)


@pytest.mark.timeout(80)
def test_a_write_made_while_a_segment_opens_lands_once_the_opening_ends():
    """The write to A outlives B's opening (its deadline is longer than B's stop): it is made while
    the handshake hangs, more runs than A's room (the rest wait for the poller), and lands whole."""
    backend = MooncakeBackend(max_runs_per_target=2)
    with stoppable_node(SHAPE) as a, stoppable_node(SHAPE) as b, \
            mooncake_p("p-open-lands", 6, backend=backend) as (p, cache):
        to_a, to_b = Peer(p, a, "to-a", cache, n=6), Peer(p, b, "to-b", cache)
        first = [x[:1] for x in to_a.run]
        p.loop_thread.call(backend.write(to_a.session, *first, 5.0), timeout=10)   # A's segment is open
        assert not to_a.landed(cache)   # only its first block so far: the check below can fail

        async def scenario() -> dict:
            t0 = time.monotonic()
            b_done = asyncio.ensure_future(timed_write(backend, to_b, DEADLINE_S, t0))
            await asyncio.sleep(0.2)
            declined = backend.start_write(to_a.session, *to_a.run, 5.0) is None
            a_done = await timed_write(backend, to_a, 5.0, t0)
            return {"a": a_done, "b": await b_done, "declined": declined}

        (stalled, began), out = while_b_stopped(p, b, scenario(), 1.5)
        (took_a, exc_a), (took_b, exc_b) = out["a"], out["b"]
        seen = (f"loop's longest pause {stalled:.2f} s (from {began:.2f} s); write to A ended after "
                f"{took_a:.2f} s ({exc_a!r}), to B after {took_b:.2f} s ({exc_b!r})")
        print(seen)
        assert stalled < MAX_GAP_S, seen
        assert out["declined"], "start_write submitted on the loop while a segment was being opened"
        assert isinstance(exc_b, TransferTimeout) and took_b < DEADLINE_S + SLACK_S, seen
        assert exc_a is None and 1.4 < took_a < 5.0, seen   # made once B's handshake ended
        assert to_a.landed(cache)
        p.loop_thread.call(settle(backend, exc_b), timeout=20)
        assert backend.quarantined == 0
        # nothing in flight, no segment opening: the loop submits again
        assert p.loop_thread.call(_start(backend, to_a), timeout=5) is not None


async def _start(backend, peer: Peer):
    settled = backend.start_write(peer.session, *peer.run, 5.0)
    if settled is not None:
        await settled
    return settled


def _spec(p, node, tid: str, n: int) -> TransferSpec:
    rep = p.request(node.control, m.AllocRequest(transfer_id=tid, num_blocks=n), timeout=5)
    return TransferSpec(transfer_id=tid, peer=node.control, src_blocks=list(range(n)), dst_blocks=rep.block_ids,
                        dst_incarnation=rep.incarnation, token=rep.token)


def _streaming_to_b(p, a, b, seed: int) -> tuple[PagedKVCache, TransferSpec]:
    """P's seeded KV cache registered, A's segment open, and P's step 1 waiting for its layers to B (its
    first write will open B's segment); returns the cache (P reads it: keep it alive) and a transfer to A."""
    cache = PagedKVCache(SHAPE)
    cache.buffer[:] = np.random.default_rng(seed).integers(1, 256, cache.buffer.size, dtype=np.uint8)
    p.register_kv_memory(cache.k_base, cache.v_base, SHAPE.block_bytes, SHAPE.num_blocks)
    _step(p, 0, _spec(p, a, "warm-a", 4))   # A's segment is open
    assert p.sender.wait("warm-a", 10).ok
    spec_a = _spec(p, a, "to-a", 4)
    p.sender.begin_step(1, [_spec(p, b, "to-b", 4)])
    until_streaming(p, "to-b")
    return cache, spec_a


def _step(p, step: int, spec: TransferSpec) -> float:
    p.sender.begin_step(step, [spec])
    return _step_layers(p, step)


def _outcome(p, tid: str, timeout: float, since: float):
    """The transfer's outcome and when (since ``since``, perf_counter) P decided it; None if none came."""
    try:
        out = p.sender.wait(tid, timeout)
    except DeadlineExceeded:
        return None, time.perf_counter() - since
    return out, out.finished_s - since


def _step_layers(p, step: int) -> float:
    """Every layer of ``step`` ready, the step ended: when (perf_counter)."""
    for layer in range(SHAPE.num_layers):
        p.sender.layer_ready(step, layer)
    p.sender.end_step(step)
    return time.perf_counter()


@pytest.mark.timeout(80)
def test_a_transfer_to_an_open_peer_ends_at_its_deadline_while_another_peer_is_opened():
    """Through P's sender and layer stream: a transfer to B (stopped before its handshake) and one to A
    (open) started meanwhile both end at ``layer_write`` with the source held, not when Mooncake
    gives up on B 60 s later; both sources come free once B runs again."""
    timeouts = Timeouts(layer_write=DEADLINE_S, control_call=1.0, done_delivery=2.0, quarantine=30.0)
    with stoppable_node(SHAPE) as a, stoppable_node(SHAPE) as b:
        p = Runtime(NodeConfig(engine_id="p-open-stream", backend="mooncake"), timeouts).start()
        try:
            cache, spec_a = _streaming_to_b(p, a, b, 7)
            freeze(b.pid)
            try:
                t_b = _step_layers(p, 1)
                time.sleep(0.2)   # B's handshake is under way in its thread
                t_a = _step(p, 2, spec_a)
                out_a, took_a = _outcome(p, "to-a", WINDOW_S, t_a)
                out_b, took_b = _outcome(p, "to-b", 1.0, t_b)
            finally:
                os.kill(b.pid, signal.SIGCONT)
            seen = f"to A: {out_a} after {took_a:.2f} s; to B: {out_b} after {took_b:.2f} s"
            print(seen)
            assert out_a is not None and took_a < DEADLINE_S + SLACK_S, seen
            assert out_a.ok or "TransferTimeout" in out_a.reason, seen
            assert out_b is not None and not out_b.ok and "TransferTimeout" in out_b.reason, seen
            assert took_b < DEADLINE_S + SLACK_S and not out_b.source_released, seen
            released = set()
            end = time.monotonic() + 20
            while len(released) < 2 - out_a.source_released and time.monotonic() < end:
                released |= set(p.sender.pop_released()) & {"to-a", "to-b"}
                time.sleep(0.05)
            assert "to-b" in released and (out_a.source_released or "to-a" in released), released
            assert p.backend.quarantined == 0
        finally:
            p.stop()



def _drop_aborts(msg: m.Message) -> None:
    if isinstance(msg, m.Abort):
        raise FrameDropped("the control path from D to P is cut")


@pytest.mark.timeout(80)
def test_a_write_held_while_a_segment_opens_is_never_submitted_after_ds_window():
    """A backend may hold a write back until its deadline (here: submits wait while B's segment opens),
    so P's check before the write is not enough: with ``layer_write`` (10 s) longer than D's window
    (A's ``--receive-timeout``), the write to A went out once B ran again, after A had freed the
    blocks on its time-only fence (P never hears A's Abort). The write's deadline ends with the window."""
    p = install_hooks(Runtime(NodeConfig(engine_id="p-window-held", backend="mooncake")), inbound_filter=_drop_aborts)
    with spawn_node("--receive-timeout", "2", "--fence-grace", "0.5", shape=SHAPE) as a, \
            stoppable_node(SHAPE) as b:
        p.start()
        try:
            cache, spec_a = _streaming_to_b(p, a, b, 9)
            freeze(b.pid)
            try:
                _step_layers(p, 1)
                time.sleep(0.2)   # B's handshake is under way: writes to A wait for it
                _step(p, 2, spec_a)
                end = time.monotonic() + 10
                while (state := d_state(p, a.control, "to-a")) != "failed":   # A's deadline, then its fence
                    assert time.monotonic() < end, f"to-a still {state!r} at A"
                    time.sleep(0.05)
                at_fail = d_crcs(p, a.control, "to-a")
                time.sleep(1.0)   # A freed the blocks (fence_grace after the window) before B runs again
            finally:
                os.kill(b.pid, signal.SIGCONT)
            out_a = p.sender.wait("to-a", 15)
            assert p.sender.wait("to-b", 15).ok
            assert d_crcs(p, a.control, "to-a") == at_fail, "a write to A landed after A freed the blocks"
            assert not out_a.ok and "TransferTimeout" in out_a.reason, out_a
        finally:
            p.stop()


@pytest.mark.timeout(80)
def test_a_new_segments_first_write_that_gave_up_behind_another_opening_is_never_submitted():
    """B's handshake hangs (B stopped) holding Mooncake's lock; the first write to C, another new peer,
    waits behind it and gives up at its deadline. Once B answers, C's write must not go out after all:
    by then D may have handed those blocks on (its fence trusts P's deadline)."""
    with stoppable_node(SHAPE) as b, stoppable_node(SHAPE) as c, mooncake_p("p-behind", 6) as (p, cache):
        backend = p.backend
        to_b, to_c = Peer(p, b, "to-b", cache), Peer(p, c, "to-c", cache)
        before = d_crcs(p, c.control, "to-c")

        async def scenario() -> dict:
            t0 = time.monotonic()
            b_done = asyncio.ensure_future(timed_write(backend, to_b, DEADLINE_S, t0))
            await asyncio.sleep(0.2)   # B's handshake holds the lock in its thread
            return {"c": await timed_write(backend, to_c, DEADLINE_S, time.monotonic()), "b": await b_done}

        _, out = while_b_stopped(p, b, scenario(), WINDOW_S)
        (took_c, exc_c), (_, exc_b) = out["c"], out["b"]
        assert isinstance(exc_c, TransferTimeout) and took_c < DEADLINE_S + SLACK_S, out
        p.loop_thread.call(settle(backend, exc_b, exc_c), timeout=25)   # B answered: every opening ended
        time.sleep(0.5)
        assert d_crcs(p, c.control, "to-c") == before, "the write that gave up landed after its deadline"
        p.loop_thread.call(backend.write(to_c.session, *to_c.run, 5.0), timeout=10)   # C is reached afresh
        assert to_c.landed(cache) and backend.quarantined == 0
