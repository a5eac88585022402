"""P writes only within the window D granted with its layout, so a one-way control partition cannot
land a write in blocks D freed (docs/fencing.md, rule 8).

The design without a window: D gave a transfer up, its Abort never reached P (control cut from D to P
only, while P still reached D's data and control ports), D freed the blocks once ``fence_grace``
passed, and P, whose forward went on, wrote its next layers into them. Here P's inbound control drops
every Abort; its forward hands a layer over after that old grace ended and the rest after D's window
ended. Real runtimes on the memory backend over real control sockets; D is a decode node whose blocks
are checksummed (``VerifyRequest``) when it fails the transfer and after P ended.
"""

from __future__ import annotations

import concurrent.futures
import math
import secrets
import time

import numpy as np
import pytest

from aiolayer import NodeConfig, Runtime, Timeouts, TransferSpec
from aiolayer.errors import FrameDropped, MetadataError
from aiolayer.kvcache import PagedKVCache, checksums
from aiolayer.protocol import messages as m
from aiolayer.runtime.control.hooks import install_hooks
from aiolayer.runtime.spec import RemoteLayout

from helpers_step import d_crcs as crcs, d_state
from test_regressions_sender import SHAPE, alloc, spec_for
from test_writer_fence import wait_state

pytestmark = pytest.mark.timeout(60)
D_LIMITS = Timeouts(receive=2.0, fence_grace=0.5)


def drop_aborts(msg: m.Message) -> None:
    if isinstance(msg, m.Abort):
        raise FrameDropped("the control path from D to P is cut")


@pytest.fixture
def cut_off_p():
    """A started P runtime that never hears D's Aborts, with a KV cache of random bytes."""
    rt = install_hooks(Runtime(NodeConfig(engine_id="p-cut", backend="memory")), inbound_filter=drop_aborts)
    rt.start()
    cache = PagedKVCache(SHAPE)
    cache.buffer[:] = np.random.default_rng(5).integers(1, 256, cache.buffer.size, dtype=np.uint8)
    rt.register_kv_memory(cache.k_base, cache.v_base, SHAPE.block_bytes, SHAPE.num_blocks)
    try:
        yield rt, cache
    finally:
        rt.stop()


def until(what, limit: float, why: str):
    end = time.monotonic() + limit
    while not (got := what()):
        assert time.monotonic() < end, why
        time.sleep(0.01)
    return got


def start_transfers(p, d, binding: str, src: list[int]) -> dict[str, str]:
    """The step's transfers (two for a batched layout request), layer 0 handed over; {id: token}."""
    tids = ["w0", "w1"] if binding == "batch" else ["w0"]
    if binding == "late":
        token = secrets.token_hex(16)
        p.sender.begin_step(0, [TransferSpec.late_bound(transfer_id="w0", peer=d.control_endpoint,
                                                        src_blocks=src, token=token)])
        alloc(p, d.control_endpoint, "w0", len(src), token=token)
        tokens = {"w0": token}
    else:
        replies = {tid: alloc(p, d.control_endpoint, tid, len(src)) for tid in tids}
        p.sender.begin_step(0, [spec_for(d.control_endpoint, tid, src, rep) for tid, rep in replies.items()])
        tokens = {tid: rep.token for tid, rep in replies.items()}
    p.sender.layer_ready(0, 0)
    return tokens


@pytest.mark.parametrize("binding", ["d-first", "batch", "late"])
def test_a_p_cut_off_from_ds_abort_writes_nothing_after_d_freed_the_blocks(cut_off_p, memory_decode_node, binding):
    p, cache = cut_off_p
    d = memory_decode_node(SHAPE, engine_id="d-window", timeouts=D_LIMITS)
    src = [2, 3]
    ck, cv = checksums(cache.blocks, src)
    registered = time.monotonic()
    tokens = start_transfers(p, d, binding, src)
    for tid in tokens:   # layer 0 landed: P bound the transfer and wrote it
        until(lambda: [c[0] for c in crcs(p, d.control_endpoint, tid)] == [ck[0], cv[0]], 5, "layer 0 never landed")
    for tid, token in tokens.items():
        p.request(d.control_endpoint, m.AbortRequest(transfer_id=tid, reason="client gone", token=token))
        assert d_state(p, d.control_endpoint, tid) == "aborting"
    time.sleep(D_LIMITS.fence_grace + 0.4)   # a fence on the grace alone would have freed the blocks by now
    p.sender.layer_ready(0, 1)                # P never heard the abort: its forward goes on
    at_fail = {}
    for tid in tokens:
        wait_state(p, d.control_endpoint, tid, "failed", 10)
        at_fail[tid] = crcs(p, d.control_endpoint, tid)
    failed_after = time.monotonic() - registered
    for layer in range(2, SHAPE.num_layers):
        p.sender.layer_ready(0, layer)
    p.sender.end_step(0)
    for tid in tokens:
        out = p.sender.wait(tid, 10)
        assert crcs(p, d.control_endpoint, tid) == at_fail[tid], f"{tid}: a write landed after D freed the blocks"
        assert not out.ok and "write_window" in out.reason, out
        assert [t.layer for t in out.layers] == [0, 1]        # the layer before the window ended, none after
    assert p.sender.deadlines["write_window"] == len(tokens)
    assert failed_after >= D_LIMITS.receive - 0.1            # D freed nothing before the window ended


def test_a_window_d_did_not_send_is_none_and_a_bad_one_is_refused():
    layout = RemoteLayout("tcp://d", "d", "inc", "s", 4096, 8, np.zeros(2, np.int64), np.zeros(2, np.int64))
    assert layout.granted(None, 100.0).write_by == math.inf                     # an older D: no end
    assert layout.granted(2.5, 100.0).write_by == 102.5                         # from when P asked
    for bad in (-1.0, math.nan):
        with pytest.raises(MetadataError, match="write window"):
            layout.granted(bad, 100.0)


def test_a_lookup_held_for_the_registration_counts_its_window_from_before_it_waited(memory_runtime,
                                                                                    memory_decode_node):
    """A late P asks before D registered; D counts the window from when the lookup came, so the wait
    does not shorten P's writes (P counts from its send, which came first)."""
    d = memory_decode_node(SHAPE, engine_id="d-held", timeouts=D_LIMITS)
    p = memory_runtime("p-held")
    token = secrets.token_hex(16)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        asked = time.monotonic()
        held = pool.submit(p.request, d.control_endpoint, m.LookupRequest(
            transfer_id="held", token=token, wait=True, requester="p-held", control=p.control_endpoint,
            incarnation=p.incarnation), timeout=5)
        time.sleep(0.6)
        before = time.monotonic()
        alloc(p, d.control_endpoint, "held", 1, token=token)   # D registers: its writes end `receive` later
        after = time.monotonic()
        reply = held.result(10)
    p_end = asked + reply.layout.window
    # the wait did not shorten P's window, and P's end is no later than D's
    assert before + D_LIMITS.receive - 0.3 < p_end <= after + D_LIMITS.receive
