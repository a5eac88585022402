"""The real data plane across two processes: Mooncake over TCP on 127.0.0.1.

D is an ``aiolayer node`` subprocess (one per module); P is an in-process ``Runtime`` with a
Mooncake backend and a ``PagedKVCache`` of the same shape filled with seeded random bytes (a fresh
one per test). A "forward" thread drives each step the way an engine would (``begin_step``,
``layer_ready`` per layer, ``end_step``); the bytes are then checked **at D** (``VerifyRequest``
returns D's per-layer CRC32s) against the source blocks at P.
"""

from __future__ import annotations

import threading
import time
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers_node import SMALL_SHAPE, apply_mc_env, spawn_node

apply_mc_env()  # before any engine exists in this process

from aiolayer import KVShape, NodeConfig, Runtime, Timeouts, TransferSpec
from aiolayer.errors import ControlRejected
from aiolayer.kvcache import PagedKVCache, checksums
from aiolayer.protocol import messages as m
from aiolayer.runtime.control.plane import open_sockets

SHAPE = SMALL_SHAPE
WAIT_S = 15.0
CALL_S = 10.0


# --- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def d_node():
    with spawn_node(shape=SHAPE) as node:
        yield node
        assert node.proc.poll() is None, f"D died during the module\n{node.stderr_text()}"
        assert node.stop() == 0, node.stderr_text()


class PSide:
    def __init__(self, rt: Runtime, cache: PagedKVCache, d_node) -> None:
        self.rt = rt
        self.cache = cache
        self.d = d_node
        self._step = 0

    @property
    def endpoint(self) -> str:
        return self.d.control

    def call(self, msg: m.Message) -> m.Message:
        return self.rt.request(self.endpoint, msg, timeout=CALL_S)

    def alloc(self, tid: str, n: int, contiguous: bool) -> m.AllocReply:
        reply = self.call(m.AllocRequest(transfer_id=tid, num_blocks=n, contiguous=contiguous))
        assert isinstance(reply, m.AllocReply), reply
        ids = reply.block_ids
        assert len(ids) == n and len(set(ids)) == n
        assert all(0 <= b < SHAPE.num_blocks for b in ids)
        if contiguous:
            assert ids == list(range(ids[0], ids[0] + n)), ids
        assert reply.incarnation == self.d.info["incarnation"]
        return reply

    def spec(self, tid: str, src: list[int], reply: m.AllocReply) -> TransferSpec:
        return TransferSpec.from_registration(reply, src_blocks=list(src), peer=self.endpoint)

    def next_step(self) -> int:
        self._step += 1
        return self._step

    def verify(self, tid: str) -> m.VerifyReply:
        reply = self.call(m.VerifyRequest(transfer_id=tid))
        assert isinstance(reply, m.VerifyReply), reply
        assert len(reply.crc_k) == len(reply.crc_v) == SHAPE.num_layers
        return reply

    def assert_landed(self, tid: str, src: list[int]) -> None:
        reply = self.verify(tid)
        assert reply.state == "finished", (reply.state, reply.reason)
        crc_k, crc_v = checksums(self.cache.blocks, src)
        bad = [(layer, kind) for layer in range(SHAPE.num_layers)
               for kind, mine, theirs in (("K", crc_k, reply.crc_k), ("V", crc_v, reply.crc_v))
               if mine[layer] != theirs[layer]]
        assert not bad, f"transfer {tid}: D's bytes differ from P's at (layer, kind) {bad}"

    def release(self, tid: str) -> None:
        reply = self.call(m.ReleaseRequest(transfer_id=tid))
        assert isinstance(reply, m.Ack), reply


@pytest.fixture
def p_side(d_node, request):
    rt = Runtime(NodeConfig(engine_id="p", backend="mooncake"), Timeouts(layer_write=8.0)).start()
    try:
        cache = PagedKVCache(SHAPE)
        seed = zlib.crc32(request.node.nodeid.encode())  # distinct data per test on the shared D
        cache.buffer[:] = np.random.default_rng(seed).integers(0, 256, cache.buffer.size, dtype=np.uint8)
        rt.register_kv_memory(cache.k_base, cache.v_base, SHAPE.block_bytes, SHAPE.num_blocks)
        yield PSide(rt, cache, d_node)
    finally:
        rt.stop()
    assert rt.backend.registered_regions == 0


# --- the forward thread -------------------------------------------------------------------------

def run_forward(rt: Runtime, steps: list[tuple[int, list[TransferSpec]]], *, interleave: bool = False,
                num_layers: int = SHAPE.num_layers) -> None:
    """Drive ``steps`` from a separate thread as an engine's forward pass would; fail on its errors."""
    errors: list[BaseException] = []
    sender = rt.sender

    def forward() -> None:
        try:
            if interleave:  # every step begun first, then their layers alternating
                for step, specs in steps:
                    sender.begin_step(step, specs)
                for layer in range(num_layers):
                    for step, _ in steps:
                        sender.layer_ready(step, layer)
                for step, _ in steps:
                    sender.end_step(step)
            else:
                for step, specs in steps:
                    sender.begin_step(step, specs)
                    for layer in range(num_layers):
                        sender.layer_ready(step, layer)
                    sender.end_step(step)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    thread = threading.Thread(target=forward, name="forward", daemon=True)
    thread.start()
    thread.join(5.0)
    assert not thread.is_alive(), "the forward thread blocked"
    assert not errors, errors


def wait_ok(rt: Runtime, spec: TransferSpec) -> None:
    out = rt.sender.wait(spec.transfer_id, WAIT_S)
    assert out.ok, (spec.transfer_id, out.reason)
    assert out.reason == ""
    n = len(spec.src_blocks)
    assert out.bytes == 2 * SHAPE.num_layers * n * SHAPE.block_bytes
    assert [t.layer for t in out.layers] == list(range(SHAPE.num_layers))


def blocks(rng: np.random.Generator, n: int, contiguous: bool, exclude: set[int] = frozenset()) -> list[int]:
    free = [b for b in range(SHAPE.num_blocks) if b not in exclude]
    if contiguous:
        for start in range(len(free) - n + 1):
            if free[start + n - 1] - free[start] == n - 1:
                return free[start:start + n]
        raise AssertionError("no contiguous source window")
    return [int(b) for b in rng.permutation(free)[:n]]


# --- tests --------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "scattered"])
def test_one_transfer_lands_byte_exact_at_d(p_side, contiguous):
    rng = np.random.default_rng(1)
    tid = f"one-{contiguous}"
    n = 12
    reply = p_side.alloc(tid, n, contiguous)
    src = blocks(rng, n, contiguous)
    spec = p_side.spec(tid, src, reply)

    before = p_side.verify(tid)
    assert before.state == "registered"
    assert (before.crc_k, before.crc_v) != checksums(p_side.cache.blocks, src), \
        "D already holds P's bytes: the check below would prove nothing"

    run_forward(p_side.rt, [(p_side.next_step(), [spec])])
    wait_ok(p_side.rt, spec)
    p_side.assert_landed(tid, src)
    status = p_side.call(m.StatusRequest(transfer_id=tid))
    assert status.state == "finished"
    assert p_side.rt.backend.quarantined == 0

    p_side.release(tid)
    with pytest.raises(ControlRejected) as exc:
        p_side.verify(tid)
    assert exc.value.code == "unknown_transfer"


@pytest.mark.timeout(60)
def test_checksum_comparison_can_fail(p_side):
    """Negative control: change P's source after the transfer; D's bytes no longer match, and only there."""
    rng = np.random.default_rng(2)
    tid = "negative"
    reply = p_side.alloc(tid, 8, contiguous=False)
    src = blocks(rng, 8, contiguous=False)
    spec = p_side.spec(tid, src, reply)
    run_forward(p_side.rt, [(p_side.next_step(), [spec])])
    wait_ok(p_side.rt, spec)
    p_side.assert_landed(tid, src)

    p_side.cache.blocks[2, 0, src[3], 100] ^= 0xFF   # one byte of layer 2's K at P
    p_side.cache.blocks[3, 1, src[0], 0] ^= 0x01     # one bit of layer 3's V at P
    reply_v = p_side.verify(tid)
    crc_k, crc_v = checksums(p_side.cache.blocks, src)
    diff_k = [layer for layer in range(SHAPE.num_layers) if crc_k[layer] != reply_v.crc_k[layer]]
    diff_v = [layer for layer in range(SHAPE.num_layers) if crc_v[layer] != reply_v.crc_v[layer]]
    assert diff_k == [2] and diff_v == [3], (diff_k, diff_v)
    with pytest.raises(AssertionError, match="differ"):
        p_side.assert_landed(tid, src)

    # the order of the blocks matters too: the same blocks reversed do not match
    p_side.cache.blocks[2, 0, src[3], 100] ^= 0xFF
    p_side.cache.blocks[3, 1, src[0], 0] ^= 0x01
    p_side.assert_landed(tid, src)
    assert checksums(p_side.cache.blocks, src[::-1]) != (reply_v.crc_k, reply_v.crc_v)
    p_side.release(tid)


@pytest.mark.timeout(60)
def test_three_requests_in_one_step(p_side):
    rng = np.random.default_rng(3)
    plan = [("multi-a", 5, True), ("multi-b", 9, False), ("multi-c", 1, True)]
    used: set[int] = set()
    specs, sources = [], {}
    for tid, n, contiguous in plan:
        reply = p_side.alloc(tid, n, contiguous)
        src = blocks(rng, n, contiguous, exclude=used)
        used.update(src)
        sources[tid] = src
        specs.append(p_side.spec(tid, src, reply))
    run_forward(p_side.rt, [(p_side.next_step(), specs)])
    for spec in specs:
        wait_ok(p_side.rt, spec)
    for tid, src in sources.items():
        p_side.assert_landed(tid, src)
        p_side.release(tid)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("interleave", [False, True], ids=["back-to-back", "interleaved"])
def test_two_steps_in_flight(p_side, interleave):
    rng = np.random.default_rng(4)
    steps, sources, all_specs = [], {}, []
    for s, plan in enumerate([[(7, False), (3, True)], [(6, True), (10, False)]]):
        specs = []
        for i, (n, contiguous) in enumerate(plan):
            tid = f"step{s}-{i}-{interleave}"
            reply = p_side.alloc(tid, n, contiguous)
            src = blocks(rng, n, contiguous)   # steps may read the same source blocks
            sources[tid] = src
            specs.append(p_side.spec(tid, src, reply))
        steps.append((p_side.next_step(), specs))
        all_specs += specs
    run_forward(p_side.rt, steps, interleave=interleave)
    for spec in all_specs:
        wait_ok(p_side.rt, spec)
    for tid, src in sources.items():
        p_side.assert_landed(tid, src)
        p_side.release(tid)


@pytest.mark.timeout(60)
def test_whole_cache_transfer(p_side):
    """Every D block in one request (the largest single transfer the shape allows)."""
    rng = np.random.default_rng(5)
    n = SHAPE.num_blocks
    reply = p_side.alloc("whole", n, contiguous=False)
    src = [int(b) for b in rng.permutation(n)]
    spec = p_side.spec("whole", src, reply)
    run_forward(p_side.rt, [(p_side.next_step(), [spec])])
    wait_ok(p_side.rt, spec)
    p_side.assert_landed("whole", src)
    p_side.release("whole")


@pytest.mark.timeout(60)
def test_layout_mismatch_fails_visibly_at_both_ends(d_node):
    """P with another block size must not write into D: FAILED at P and at D, D untouched."""
    other = KVShape(num_layers=SHAPE.num_layers, num_blocks=SHAPE.num_blocks, block_size=SHAPE.block_size * 2,
                    kv_heads=SHAPE.kv_heads, head_dim=SHAPE.head_dim)
    rt = Runtime(NodeConfig(engine_id="p-mismatch", backend="mooncake")).start()
    try:
        cache = PagedKVCache(other)
        cache.buffer[:] = 7
        rt.register_kv_memory(cache.k_base, cache.v_base, other.block_bytes, other.num_blocks)
        reply = rt.request(d_node.control, m.AllocRequest(transfer_id="mismatch", num_blocks=4), timeout=CALL_S)
        before = rt.request(d_node.control, m.VerifyRequest(transfer_id="mismatch"), timeout=CALL_S)
        spec = TransferSpec.from_registration(reply, src_blocks=[0, 1, 2, 3], peer=d_node.control)
        run_forward(rt, [(1, [spec])], num_layers=other.num_layers)
        out = rt.sender.wait("mismatch", WAIT_S)
        assert not out.ok and "LayoutMismatch" in out.reason, out
        assert out.bytes == 0
        _await_d_state(rt, d_node.control, "mismatch", "failed")   # P tells D just after its own outcome
        after = rt.request(d_node.control, m.VerifyRequest(transfer_id="mismatch"), timeout=CALL_S)
        assert after.state == "failed" and "LayoutMismatch" in after.reason, after
        assert (after.crc_k, after.crc_v) == (before.crc_k, before.crc_v), "D's blocks were written"
        assert isinstance(rt.request(d_node.control, m.ReleaseRequest(transfer_id="mismatch"),
                                     timeout=CALL_S), m.Ack)
    finally:
        rt.stop()
    assert rt.backend.registered_regions == 0


@pytest.mark.timeout(60)
def test_stale_incarnation_is_refused(p_side):
    reply = p_side.alloc("stale", 2, contiguous=True)
    spec = TransferSpec(transfer_id="stale", peer=p_side.endpoint, src_blocks=[0, 1],
                        dst_blocks=reply.block_ids, dst_incarnation="0" * 32, token=reply.token)
    before = p_side.verify("stale")
    run_forward(p_side.rt, [(p_side.next_step(), [spec])])
    out = p_side.rt.sender.wait("stale", WAIT_S)
    assert not out.ok and "StaleLayout" in out.reason, out
    _await_d_state(p_side.rt, p_side.endpoint, "stale", "failed")
    after = p_side.verify("stale")
    assert after.state == "failed"
    assert (after.crc_k, after.crc_v) == (before.crc_k, before.crc_v)
    p_side.release("stale")


@pytest.mark.timeout(60)
def test_p_shutdown_leaves_no_region_or_socket(p_side):
    rt = p_side.rt
    assert rt.backend.registered_regions == 2 * SHAPE.num_layers
    reply = p_side.alloc("shutdown", 4, contiguous=True)
    spec = p_side.spec("shutdown", [10, 11, 12, 13], reply)
    run_forward(rt, [(p_side.next_step(), [spec])])
    wait_ok(rt, spec)
    p_side.assert_landed("shutdown", [10, 11, 12, 13])
    p_side.release("shutdown")
    assert open_sockets() > 0   # the check below can fail: P holds its server and a client now

    rt.stop()
    assert rt.backend.registered_regions == 0
    assert open_sockets() == 0
    assert not rt.loop_thread.alive
    assert rt.backend.quarantined == 0
    # D is unaffected by P going away and still serves the next P
    assert p_side.d.proc.poll() is None, p_side.d.stderr_text()


@pytest.mark.timeout(60)
@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_random_block_patterns_land_byte_exact(p_side, data):
    """Any source/destination pattern (runs that merge, runs that do not, repeats across steps)."""
    n = data.draw(st.integers(1, SHAPE.num_blocks), label="n")
    contiguous = data.draw(st.booleans(), label="contiguous")
    src = data.draw(st.lists(st.integers(0, SHAPE.num_blocks - 1), min_size=n, max_size=n, unique=True),
                    label="src")
    tid = f"prop-{p_side.next_step()}"
    reply = p_side.alloc(tid, n, contiguous)
    spec = p_side.spec(tid, src, reply)
    run_forward(p_side.rt, [(p_side.next_step(), [spec])])
    wait_ok(p_side.rt, spec)
    p_side.assert_landed(tid, src)
    p_side.release(tid)


def _await_d_state(rt, endpoint: str, tid: str, want: str, limit: float = 5.0) -> None:
    deadline = time.monotonic() + limit
    while rt.request(endpoint, m.StatusRequest(transfer_id=tid), timeout=CALL_S).state != want:
        assert time.monotonic() < deadline, f"D never reached {want} for {tid}"
        time.sleep(0.01)
