"""The embedding API: every Runtime method callable from any thread, D's side as symmetric
as P's, refusals visible, torch optional, and the vLLM bridge built on nothing else."""

from __future__ import annotations

import ast
import asyncio
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import aiolayer
from aiolayer import (ConfigError, DeadlineExceeded, KVShape, NodeConfig, ReceiveSpec, Registration, Runtime,
                      RuntimeStateError, Step, Timeouts, TransferSpec, UnknownTransfer)
from aiolayer.kvcache import PagedKVCache, checksums
from helpers_memory import host_cache

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]
SHAPE = KVShape(num_layers=3, num_blocks=16, block_size=4, kv_heads=2, head_dim=8, dtype="float16")
TOKEN = "t" * 32
TIMEOUTS = Timeouts(receive=20, fence_grace=1.0)   # no sender named: an abort waits out the grace


@pytest.fixture
def pair():
    """A started P and D (memory backend), each with a registered paged KV cache; P's is random."""
    made = []

    def start(engine_id: str, seed: int | None) -> tuple[Runtime, PagedKVCache]:
        rt = Runtime(NodeConfig(engine_id=engine_id, backend="memory"), TIMEOUTS).start()
        made.append(rt)
        return rt, host_cache(rt, SHAPE, seed)

    try:
        yield start("p12", 7), start("d12", None)
    finally:
        for rt in made:
            rt.stop()


def in_thread(fn, *args):
    """Run ``fn`` on a plain thread (not the loop, not the test's) and return its result."""
    out: list = []
    worker = threading.Thread(target=lambda: out.append(fn(*args)))
    worker.start()
    worker.join(10)
    assert not worker.is_alive() and out, "the call did not return at once"
    return out[0]


def received(rt: Runtime, transfer_id: str, timeout: float = 10.0):
    return rt.wait_received(transfer_id, timeout)


def test_receive_and_step_from_plain_threads_move_the_kv(pair):
    (p, p_cache), (d, d_cache) = pair
    reg = in_thread(d.receive, ReceiveSpec(transfer_id="r1", block_ids=[9, 3, 4], token=TOKEN,
                                           sender_control=p.control_endpoint))
    assert isinstance(reg, Registration) and reg.decode_control == d.control_endpoint
    assert reg.incarnation == d.incarnation and reg.block_ids == [9, 3, 4]
    spec = TransferSpec.from_registration(reg, src_blocks=[1, 2, 3])

    def forward() -> Step:
        with p.begin_step([spec]) as step:
            for layer in range(SHAPE.num_layers):
                step.layer_ready(layer)
        return step

    in_thread(forward)
    outcome = p.wait_outcome("r1", 10)
    assert outcome.ok, outcome.reason
    result = received(d, "r1")
    assert result.ok and not result.refused, result.reason
    assert checksums(d_cache.blocks, [9, 3, 4]) == checksums(p_cache.blocks, [1, 2, 3])


def test_a_refused_registration_is_a_failed_result_not_a_lost_error(pair):
    _, (d, _) = pair
    d.receive(ReceiveSpec(transfer_id="dup", block_ids=[1], token=TOKEN))
    d.receive(ReceiveSpec(transfer_id="dup", block_ids=[2], token=TOKEN))   # the id is live: refused
    refused = received(d, "dup")
    assert not refused.ok and refused.refused and "already registered" in refused.reason
    assert d.published_metrics["receive_failures"] == {"refused": 1}   # counted before it was visible
    d.abort_receive("dup", "test over")                                    # the first one ends too
    first = received(d, "dup", timeout=TIMEOUTS.fence_grace + 5)
    assert not first.ok and not first.refused
    # both failed before any KV landed, each counted by its cause
    assert d.metrics_snapshot()["receive_failures"] == {"refused": 1, "aborted": 1}


def test_a_bad_receive_spec_raises_at_once_and_changes_nothing(pair):
    _, (d, _) = pair
    for bad in (dict(token="short"), dict(block_ids=[-1]), dict(senders=0), dict(transfer_id=""),
                dict(first_block=-1)):
        fields = dict(transfer_id="bad", block_ids=[1], token=TOKEN) | bad
        with pytest.raises(ConfigError):
            d.receive(ReceiveSpec(**fields))
    d.receive(ReceiveSpec(transfer_id="bad", block_ids=[1], token=TOKEN))   # the id was never taken
    d.abort_receive("bad", "test over")
    assert received(d, "bad", timeout=TIMEOUTS.fence_grace + 5).refused is False


@pytest.mark.timeout(30)
def test_a_wait_with_a_timeout_no_clock_can_end_is_refused_at_once(pair):
    """NaN made ``wait_received`` poll forever (no time is >= NaN); 1e20 overflowed the clock."""
    (p, _), (d, _) = pair
    for timeout in (float("nan"), -1.0, 1e20):
        for wait in (d.wait_received, p.wait_outcome):
            with pytest.raises(ConfigError, match="timeout must be 0 to 86400 seconds"):
                wait("never", timeout)


def test_a_receive_live_when_the_runtime_stops_gets_a_failed_result():
    """D stopped with a receive registered: no result was ever published, so an engine that frees blocks
    on results (one restarting the runtime over the same cache) never got them back, and a thread in
    ``wait_received`` waited out its timeout. Once the memory is unregistered no write can land: each
    live receive gets its failed result, the waiter at once."""
    d = Runtime(NodeConfig(engine_id="d-stops", backend="memory")).start()
    try:
        host_cache(d, KVShape(num_layers=2, num_blocks=8, block_size=4, kv_heads=1, head_dim=8), None)
        d.receive(ReceiveSpec(transfer_id="live", block_ids=[0, 1], token=TOKEN))
        waited: list = []
        waiter = threading.Thread(target=lambda: waited.append(d.wait_received("live", 20)))
        waiter.start()
        time.sleep(0.2)
    finally:
        d.stop()
    started = time.monotonic()
    waiter.join(10)
    assert waited and time.monotonic() - started < 5, "the waiter waited out its timeout"
    (result,) = waited
    assert not result.ok and result.reason == "runtime stopped" and not result.refused, result


def test_an_announce_that_fails_gives_the_transfer_up(pair):
    _, (d, _) = pair

    async def proxy_down(reg: Registration) -> None:
        raise ConnectionError(f"nobody took {reg.transfer_id}")

    d.receive(ReceiveSpec(transfer_id="ann", block_ids=[1], token=TOKEN), announce=proxy_down)
    result = received(d, "ann", timeout=TIMEOUTS.fence_grace + 5)
    assert not result.ok and "registration not announced" in result.reason and "nobody took ann" in result.reason


def test_calls_before_start_and_after_stop_are_refused():
    rt = Runtime(NodeConfig(engine_id="idle", backend="memory"))
    with pytest.raises(RuntimeStateError):
        rt.begin_step([])
    with pytest.raises(RuntimeStateError):
        rt.receive(ReceiveSpec(transfer_id="x", block_ids=[0], token=TOKEN))
    assert rt.pop_outcomes() == [] and rt.pop_received() == []
    rt.start()
    rt.stop()
    with pytest.raises(RuntimeStateError):
        rt.receive(ReceiveSpec(transfer_id="x", block_ids=[0], token=TOKEN))


def test_every_public_name_resolves():
    for name in aiolayer.__all__:
        assert getattr(aiolayer, name) is not None, name


def test_the_core_runs_without_torch():
    """torch is an optional extra: a whole transfer runs with torch unimportable."""
    script = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None          # import torch -> ImportError
        import numpy as np
        from aiolayer import KVShape, NodeConfig, ReceiveSpec, Runtime, TransferSpec
        from aiolayer.kvcache import PagedKVCache
        shape = KVShape(num_layers=2, num_blocks=4, block_size=4, kv_heads=1, head_dim=8)
        rts = []
        for name in ("p", "d"):
            rt = Runtime(NodeConfig(engine_id=name, backend="memory")).start()
            cache = PagedKVCache(shape)
            rt.register_kv_memory(cache.k_base, cache.v_base, shape.block_bytes, shape.num_blocks)
            rts.append(rt)
        p, d = rts
        reg = d.receive(ReceiveSpec(transfer_id="nt", block_ids=[1], token="{TOKEN}"))
        with p.begin_step([TransferSpec.from_registration(reg, src_blocks=[0])]) as step:
            for layer in range(2):
                step.layer_ready(layer)
        outcome = p.wait_outcome("nt", 10)
        for rt in rts:
            rt.stop()
        assert outcome.ok, outcome.reason
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def _bridge_files():
    return sorted((ROOT / "bridges" / "vllm" / "aiolayer_vllm").rglob("*.py"))


def test_the_vllm_bridge_uses_only_the_public_api():
    offences = []
    for path in _bridge_files():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("aiolayer.runtime"):
                offences.append(f"{path.name}:{node.lineno} imports {node.module}")
            elif isinstance(node, ast.Import):
                offences += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names
                             if a.name.startswith("aiolayer.runtime")]
            elif isinstance(node, ast.Attribute) and node.attr in ("loop_thread", "sender", "receiver", "bridge"):
                offences.append(f"{path.name}:{node.lineno} reaches into the runtime: .{node.attr}")
    assert _bridge_files() and not offences, "\n".join(offences)


def test_on_stop_closes_what_announce_opened_on_the_loop():
    rt = Runtime(NodeConfig(engine_id="closer", backend="memory"), TIMEOUTS).start()
    opened, closed = [], []

    async def announce(reg: Registration) -> None:
        opened.append(threading.current_thread().name)

    async def close() -> None:
        closed.append(threading.current_thread().name)

    async def hang() -> None:
        await asyncio.sleep(3600)

    rt.on_stop(hang)          # bounded by Timeouts.cleanup: cannot hold the stop
    rt.on_stop(close)
    rt.receive(ReceiveSpec(transfer_id="c", block_ids=[0], token=TOKEN), announce=announce)
    deadline = time.monotonic() + 5
    while not opened and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    rt.stop()
    assert time.monotonic() - started < TIMEOUTS.cleanup + TIMEOUTS.shutdown
    assert opened and closed == opened            # both on the runtime's loop thread


def test_d_waits_for_one_result_and_keeps_the_others_and_mints_a_token(pair):
    (p, _), (d, _) = pair
    regs = [d.receive(ReceiveSpec(transfer_id=f"w{i}", block_ids=[i], sender_control=p.control_endpoint))
            for i in range(3)]
    assert all(len(reg.token) >= 16 for reg in regs) and len({reg.token for reg in regs}) == 3   # minted
    for reg in regs:
        with p.begin_step([TransferSpec.from_registration(reg, src_blocks=[reg.block_ids[0] + 5])]) as step:
            for layer in range(SHAPE.num_layers):
                step.layer_ready(layer)
    assert d.wait_received("w2", 10).ok
    with pytest.raises(DeadlineExceeded):
        d.wait_received("never", 0.05)
    deadline = time.monotonic() + 10
    rest: list = []
    while len(rest) < 2 and time.monotonic() < deadline:
        rest += d.pop_received()
        time.sleep(0.01)
    assert sorted(r.transfer_id for r in rest) == ["w0", "w1"] and all(r.ok for r in rest)
    with pytest.raises(UnknownTransfer):
        p.wait_outcome("never-started", 1)
