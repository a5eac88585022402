"""Sampled end-to-end KV integrity: D verifies what landed against P's digests before it accepts DONE,
the layers that landed before P's last write already as they land (early checks).

P and D are real runtimes (memory backend) with host-memory paged caches; a fault hook on D flips
bytes of one layer in the transfer's blocks after they landed and before D reads them (at the early
check naming the layer, else at the DONE), as a faulty NIC, DMA engine or a stray writer would.
"""

from __future__ import annotations

import logging
import random
import threading
import time

import msgspec
import numpy as np
import pytest

from aiolayer import KVShape, NodeConfig, ReceiveSpec, Runtime, Timeouts, TransferSpec
from aiolayer.errors import ControlRejected
from aiolayer.kvcache import PagedKVCache
from aiolayer.protocol import messages as m
from aiolayer.protocol.codes import NackCode
from aiolayer.runtime.control.hooks import install_hooks
from aiolayer.runtime.integrity import (MAX_EARLY_CHECKS, EarlyMatch, digest_of_runs, pick_digest, plan_verify,
                                        read_check, sample_check, verify_check, verify_early)
from helpers_memory import host_cache

pytestmark = pytest.mark.timeout(60)
SHAPE = KVShape(num_layers=4, num_blocks=32, block_size=4, kv_heads=2, head_dim=8, dtype="float16")
TIMEOUTS = Timeouts(receive=20, fence_grace=2.0)


class Corrupter:
    """D's inbound hook: flip one byte of layer ``layer`` (K or V) of a transfer's blocks when the first
    message that makes D read that layer arrives (an early check naming it, else the DONE): after the
    layer landed, before D reads it."""

    def __init__(self) -> None:
        self.cache: PagedKVCache | None = None
        self.blocks: dict[str, list[int]] = {}
        self.target: tuple[int, int] | None = None   # (layer, plane) to corrupt, or None
        self.flipped_at = ""                         # the type of the message that came with the flip
        self.digests: list[str] = []                 # each checked DONE's digest
        self.early: list[m.EarlyCheck] = []
        self.refuse_early = False                    # answer early checks as a D from before them does

    def __call__(self, msg) -> None:
        if isinstance(msg, m.EarlyCheck):
            self.early.append(msg)
            if self.refuse_early:
                raise ControlRejected(NackCode.DECODE, "unknown message type 'early_check'")
        if isinstance(msg, m.Done) and msg.check is not None:
            self.digests.append(msg.check.digest)
        check = getattr(msg, "check", None)
        if self.target is not None and check is not None and self.target[0] in check.layers:
            layer, plane = self.target
            self.target, self.flipped_at = None, type(msg).__name__   # once: a second flip would undo it
            self.cache.blocks[layer, plane, self.blocks[msg.transfer_id][-1], 5] ^= 0xFF


@pytest.fixture
def pair(request):
    made, corrupter = [], Corrupter()
    timeouts = getattr(request, "param", TIMEOUTS)

    def start(engine_id: str, seed: int | None, sample: float, **hooks) -> tuple[Runtime, PagedKVCache]:
        rt = install_hooks(Runtime(NodeConfig(engine_id=engine_id, backend="memory", integrity_sample=sample),
                                   timeouts), **hooks).start()
        made.append(rt)
        return rt, host_cache(rt, SHAPE, seed, host_memory=True)

    try:
        p, _ = start("p-int", 3, 1.0)
        d, corrupter.cache = start("d-int", None, 0.0, inbound_filter=corrupter)
        yield p, d, corrupter
    finally:
        for rt in made:
            rt.stop()


@pytest.fixture
def never_ends():
    """A worker's job that never ends (a stuck read, a full thread pool), released as the test ends."""
    stuck = threading.Event()

    def job(*_):
        stuck.wait(30)
        raise RuntimeError("released by the test")

    yield job
    stuck.set()


def _transfer(p: Runtime, d: Runtime, corrupter: Corrupter, tid: str, src: list[int], dst: list[int]):
    reg = d.receive(ReceiveSpec(transfer_id=tid, block_ids=dst))
    corrupter.blocks[tid] = dst
    with p.begin_step([TransferSpec.from_registration(reg, src_blocks=src)]) as step:
        for layer in range(SHAPE.num_layers):
            step.layer_ready(layer)
    return p.wait_outcome(tid, 10), d.wait_received(tid, 10)


def test_every_sampled_transfer_that_landed_intact_is_verified(pair):
    p, d, corrupter = pair
    for i in range(5):
        _, received = _transfer(p, d, corrupter, f"ok{i}", [i, i + 8], [2 * i, 2 * i + 1])
        assert received.ok, received.reason
    assert d.metrics_snapshot()["integrity"].get("verified") == 5
    assert p.metrics_snapshot()["integrity"]["sampled"] == 5
    assert corrupter.digests == ["xxh3_64"] * 5   # D's layout offered it, so P took the fast one


def test_p_checks_with_crc32_for_a_d_that_offers_no_other_digest(pair):
    p, d, corrupter = pair
    d.layout_reply = msgspec.structs.replace(d.layout_reply, digests=[])   # as an older D answers
    for i in range(3):
        layer = i % SHAPE.num_layers
        corrupter.target = (layer, 0) if i else None
        _, received = _transfer(p, d, corrupter, f"old{i}", [i], [i + 4])
        assert received.ok is (i == 0), received.reason
        if i:
            assert f"integrity: layer {layer} K" in received.reason and "CRC32" in received.reason
    assert corrupter.digests == ["crc32"] * 3


def test_each_digest_tells_a_single_flipped_bit_anywhere_in_the_runs():
    rng = np.random.default_rng(11)
    data = rng.integers(0, 256, 3 * 4096, dtype=np.uint8)
    base, offsets, lengths = data.ctypes.data, [0, 4096, 9000], [4096, 4000, 3000]
    assert pick_digest([]) == "crc32" and pick_digest(["xxh3_64"]) == "xxh3_64"
    for digest in m.CHECK_DIGESTS:
        clean = digest_of_runs(digest, [base], offsets, lengths)
        assert digest_of_runs(digest, [base], offsets[::-1], lengths[::-1]) != clean   # run order counts
        for at in rng.choice([o + k for o, n in zip(offsets, lengths) for k in range(n)], 50, replace=False):
            bit = np.uint8(1 << int(rng.integers(8)))
            data[at] ^= bit
            assert digest_of_runs(digest, [base], offsets, lengths) != clean, (digest, at)
            data[at] ^= bit
        assert digest_of_runs(digest, [base], offsets, lengths) == clean


def test_bytes_flipped_after_they_landed_are_detected_every_time(pair):
    p, d, corrupter = pair
    rng = random.Random(5)
    for i in range(12):
        layer, plane = rng.randrange(SHAPE.num_layers), rng.randrange(2)
        corrupter.target = (layer, plane)
        _, received = _transfer(p, d, corrupter, f"bad{i}", [i + 1], [i + 2])
        assert not received.ok, f"corruption of layer {layer} went unnoticed"
        assert f"integrity: layer {layer} {'KV'[plane]}" in received.reason, received.reason
    assert d.metrics_snapshot()["integrity"].get("mismatch") == 12


def test_a_check_naming_bytes_outside_the_transfer_fails_it(pair):
    p, d, corrupter = pair
    local = d.sender.local
    every = list(range(SHAPE.num_layers))
    check = m.LayerCheck(layers=every, offsets=[0], lengths=[SHAPE.block_bytes], crc_k=[0] * SHAPE.num_layers,
                         crc_v=[0] * SHAPE.num_layers)
    assert "outside the transfer's blocks" in verify_check(local, [3], check)
    assert "malformed" in verify_check(local, [0], m.LayerCheck(layers=[0], offsets=[0], lengths=[1], crc_k=[0]))
    huge = m.LayerCheck(layers=every, offsets=[0], lengths=[1 << 60], crc_k=[0] * SHAPE.num_layers,
                        crc_v=[0] * SHAPE.num_layers)
    assert "malformed" in verify_check(local, [0], huge)
    unknown = m.LayerCheck(layers=[0], offsets=[0], lengths=[1], crc_k=[0], crc_v=[0], digest="md4")
    assert "digest 'md4' is none of crc32, xxh3_64" in verify_check(local, [0], unknown)
    for layers in ([1, 0], [0, 0], [SHAPE.num_layers], [-1]):
        bad = m.LayerCheck(layers=layers, offsets=[0], lengths=[1], crc_k=[0] * len(layers), crc_v=[0] * len(layers))
        assert "not ascending layers" in verify_check(local, [0], bad), layers


def test_no_check_where_kv_is_not_host_memory_or_the_rate_is_zero(pair):
    p, _, _ = pair
    local = p.sender.local
    runs = ([0], [0], [SHAPE.block_bytes])
    assert sample_check(local, None, tuple(np.asarray(a) for a in runs), 1.0) is not None
    assert sample_check(local, None, tuple(np.asarray(a) for a in runs), 0.0) is None
    device = type(local)(local.k_base, local.v_base, local.block_bytes, local.num_blocks, host=False)
    assert sample_check(device, None, tuple(np.asarray(a) for a in runs), 1.0) is None
    assert verify_check(device, [0], m.LayerCheck(layers=[0], offsets=[0], lengths=[1], crc_k=[1])) == ""


def test_layers_are_sampled_one_by_one_at_the_given_share(pair):
    p, _, _ = pair
    runs = tuple(np.asarray(a) for a in ([0], [0], [SHAPE.block_bytes]))
    random.seed(7)
    sampled = [sample_check(p.sender.local, None, runs, 0.25) for _ in range(400)]
    layers = sum(len(c.layers) for c in sampled if c is not None)
    assert 0.18 < layers / (400 * SHAPE.num_layers) < 0.32   # per layer, not per transfer
    assert any(c is not None and len(c.layers) == 1 for c in sampled)


def test_p_digests_the_source_as_soon_as_every_layer_was_submitted(pair):
    """P digests a transfer's layers as they are submitted (their source is final then), so the DONE's whole
    check exists once the last was, beside the last writes, not after them; a transfer stopped before
    that has none; every check still verifies."""
    p, d, corrupter = pair
    began: list[tuple[str, bool]] = []
    real = p.sender.stream.submitted

    def record(req, layers, last) -> None:
        if last:
            began.append((req.spec.transfer_id, req.check is None))
        real(req, layers, last)
        assert req.check is not None or not last   # the worker thread's digest, which DONE awaits

    p.sender.stream.submitted = record
    for i in range(3):
        _, received = _transfer(p, d, corrupter, f"early{i}", [i], [i + 4])
        assert received.ok, received.reason
    assert began == [(f"early{i}", True) for i in range(3)]
    reg = d.receive(ReceiveSpec(transfer_id="stopped", block_ids=[12]))
    step = p.begin_step([TransferSpec.from_registration(reg, src_blocks=[12])])
    step.layer_ready(0)
    p.cancel_send("stopped", "preempted")   # its other layers never come: it fails, with no digest
    step.end()
    assert not p.wait_outcome("stopped", 10).ok
    assert [tid for tid, _ in began] == [f"early{i}" for i in range(3)]
    assert d.metrics_snapshot()["integrity"].get("verified") == 3


def _transfer_last_late(p: Runtime, d: Runtime, corrupter: Corrupter, tid: str, src: list[int], dst: list[int]):
    """As ``_transfer``, but the last layer's write lands 0.5 s after the others did, as over a slow link."""
    reg = d.receive(ReceiveSpec(transfer_id=tid, block_ids=dst))
    corrupter.blocks[tid] = dst
    landed = d.backend.bytes_written + 2 * len(dst) * SHAPE.block_bytes * (SHAPE.num_layers - 1)
    try:
        with p.begin_step([TransferSpec.from_registration(reg, src_blocks=src)]) as step:
            for layer in range(SHAPE.num_layers - 1):
                step.layer_ready(layer)
            end = time.monotonic() + 5
            while d.backend.bytes_written < landed and time.monotonic() < end:
                time.sleep(0.01)
            assert d.backend.bytes_written == landed, "the first layers did not land"
            d.backend.faults.delay_s = 0.5
            step.layer_ready(SHAPE.num_layers - 1)
        return p.wait_outcome(tid, 10), d.wait_received(tid, 10)
    finally:
        d.backend.faults.delay_s = 0.0


def _integrity(rt: Runtime) -> dict[str, int]:
    return {k: v for k, v in rt.metrics_snapshot()["integrity"].items() if v}


def test_layers_landed_before_the_last_write_are_verified_before_the_done(pair, caplog):
    p, d, corrupter = pair
    last = SHAPE.num_layers - 1
    with caplog.at_level(logging.DEBUG, logger="aiolayer.runtime.runtime"):
        for i in range(2):
            outcome, received = _transfer_last_late(p, d, corrupter, f"soon{i}", [i, i + 8], [2 * i, 2 * i + 1])
            assert outcome.ok and received.ok, received.reason
            sent = [layer for e in corrupter.early if e.transfer_id == f"soon{i}" for layer in e.check.layers]
            assert sorted(sent) == list(range(last)), sent   # each once, and never the one still in flight
    at_done = [r.getMessage() for r in caplog.records if "DONE's check" in r.getMessage()]
    assert len(at_done) == 2 and all(f"1 of {SHAPE.num_layers} layers read at DONE" in line for line in at_done)
    early = len(corrupter.early)
    assert _integrity(d) == {"verified_early": early, "verified": 2}
    assert _integrity(p) == {"sampled": 2, "sent_early": early}


def test_p_stops_sending_early_checks_to_a_d_that_cannot_read_them(pair):
    """An older D answers an early check ``Nack(decode)``: P sends that D none for a while (one refusal
    per transfer otherwise), and the DONE still checks every sampled layer."""
    p, d, corrupter = pair
    corrupter.refuse_early = True
    for i in range(3):
        outcome, received = _transfer_last_late(p, d, corrupter, f"older{i}", [i], [i + 4])
        assert outcome.ok and received.ok, received.reason
    refused = {e.transfer_id for e in corrupter.early}
    assert refused == {"older0"}, refused   # its first early checks, none after the refusal
    assert _integrity(d) == {"verified": 3} and _integrity(p) == {"sampled": 3}
    assert p.sender.early_refused.keys() == {d.control_endpoint}


def test_an_early_check_that_breaks_is_logged_once_and_the_done_reads_every_layer(pair, caplog, monkeypatch):
    p, d, corrupter = pair

    def broken(*_):
        raise RuntimeError("a bug in the early check")

    monkeypatch.setattr("aiolayer.runtime.control.routing.verify_early", broken)
    with caplog.at_level(logging.DEBUG):
        outcome, received = _transfer_last_late(p, d, corrupter, "broken", [1], [6])
    assert outcome.ok and received.ok, received.reason
    raised = [r for r in caplog.records if r.getMessage() == "early integrity check raised"]
    assert corrupter.early and len(raised) == len(corrupter.early)   # once each, not by reply and DONE
    assert any(f"{SHAPE.num_layers} of {SHAPE.num_layers} layers read at DONE" in r.getMessage()
               for r in caplog.records)


def test_a_layer_that_differs_at_the_early_check_is_read_again_at_the_done(pair):
    p, d, corrupter = pair
    corrupter.target = (1, 1)   # flipped as the early check naming it arrives: that check sees it
    _, received = _transfer_last_late(p, d, corrupter, "flipped", [3], [5])
    assert corrupter.flipped_at == "EarlyCheck"
    assert not received.ok and "integrity: layer 1 V" in received.reason, received.reason
    assert _integrity(d) == {"verified_early": len(corrupter.early), "mismatch": 1}


def test_an_early_check_is_answered_only_to_a_writer_with_the_token_and_changes_nothing(pair):
    p, d, _ = pair
    token = "t" * 32
    d.receive(ReceiveSpec(transfer_id="probe", block_ids=[7], token=token))
    check = m.LayerCheck(layers=[0], offsets=[0], lengths=[SHAPE.block_bytes], crc_k=[1], crc_v=[2],
                         digest="xxh3_64")

    def early(sender: str, tok: str = token) -> str:
        try:
            reply = p.request(d.control_endpoint, m.EarlyCheck(transfer_id="probe", sender=sender, token=tok,
                                                               check=check), timeout=5)
        except ControlRejected as exc:
            return f"nack {exc.code}"
        return reply.detail

    assert early("p-int", "x" * 32) == "nack auth"
    assert early("p-int") == "nack sender"   # it never fetched the layout: no writer of the transfer
    p.request(d.control_endpoint, m.LayoutRequest(requester="p-int", transfer_id="probe", token=token,
                                                  control=p.control_endpoint, incarnation=p.incarnation), timeout=5)
    for _ in range(MAX_EARLY_CHECKS):
        assert early("p-int") == "0 of 1 layers intact"   # D holds zeros there, not these digests
    assert early("p-int") == "nack busy"   # a writer cannot make D read without end
    assert early("stranger") == "nack sender"
    assert d.receiver.state_of("probe")[0] == "registered"
    d.abort_receive("probe", "given up")
    assert early("p-int") in ("nack ended", "nack auth")
    assert _integrity(d) == {"verified_early": MAX_EARLY_CHECKS}


def test_a_layer_counts_as_matched_early_only_for_the_same_runs_and_digests(pair):
    _, d, _ = pair
    local, every = d.sender.local, list(range(SHAPE.num_layers))
    bb = SHAPE.block_bytes
    zeros_k = digest_of_runs("xxh3_64", local.k_base[every], [0], [bb])
    zeros_v = digest_of_runs("xxh3_64", local.v_base[every], [0], [bb])
    done = m.LayerCheck(layers=every, offsets=[0], lengths=[bb], crc_k=zeros_k, crc_v=zeros_v, digest="xxh3_64")
    part = msgspec.structs.replace(done, layers=[0, 2], crc_k=zeros_k[::2], crc_v=zeros_v[::2])
    matched = verify_early(local, [0], part)
    assert matched is not None and len(matched.layers) == 2
    assert matched.unmatched(done).layers == [1, 3]
    other_bytes = msgspec.structs.replace(done, crc_k=[zeros_k[0] ^ 1] + zeros_k[1:])
    assert matched.unmatched(other_bytes).layers == [0, 1, 3]   # P says other bytes for layer 0: read again
    assert matched.unmatched(msgspec.structs.replace(done, lengths=[bb // 2])).layers == every
    assert verify_check(local, [0], other_bytes, matched).startswith("integrity: layer 0 K")
    assert EarlyMatch(matched.runs, frozenset()).unmatched(done) is done
    assert verify_early(local, [3], part) is None   # outside the transfer's blocks: nothing matched
    # a DONE's check one CRC short over the runs matched early: refused as malformed before D works
    # out what is left to read (which would index past its CRCs), nothing read
    short = msgspec.structs.replace(done, crc_k=zeros_k[:-1])
    assert plan_verify(local, [0], short, matched) == ("integrity: malformed check: 3/4 CRCs for 4 layers", None)
    assert plan_verify(local, [0], done, matched) == ("", matched.unmatched(done))


@pytest.mark.parametrize("pair", [Timeouts(receive=20, fence_grace=2.0, control_call=0.5, done_delivery=1.5)],
                         indirect=True)
def test_a_check_that_does_not_end_fails_the_transfer_at_its_deadline(pair, never_ends, monkeypatch):
    """D's reads of what landed never end (a stuck worker, a full thread pool): each early check is
    answered ``Nack(busy)`` after ``control_call`` and the DONE's check fails the transfer after
    ``done_delivery``, long before D's ``receive`` deadline would have."""
    p, d, corrupter = pair
    monkeypatch.setattr("aiolayer.runtime.control.routing.verify_early", never_ends)
    monkeypatch.setattr("aiolayer.runtime.control.routing.read_check", never_ends)
    began = time.monotonic()
    outcome, received = _transfer_last_late(p, d, corrupter, "stuck", [2], [4])
    assert time.monotonic() - began < 8, "ended by D's receive deadline (20 s), not by the check's own"
    assert not received.ok and "did not end within done_delivery 1.5s" in received.reason, received.reason
    assert not outcome.ok
    assert corrupter.early and p.sender.early_checks == 0   # each sent, none answered as verified
    assert _integrity(d).get("unfinished", 0) >= 1 and "verified" not in _integrity(d)


@pytest.mark.parametrize("pair", [Timeouts(receive=20, fence_grace=2.0, control_call=0.5, done_delivery=5.0)],
                         indirect=True)
@pytest.mark.parametrize("check_s", [1.2, 2.5])
def test_a_retried_done_joins_the_check_still_running_instead_of_reading_again(pair, monkeypatch, check_s):
    """D's read at DONE takes longer than P's call (1.2 s against 0.5): P retries the DONE, and each
    retry waits for the first attempt's verdict. Reading again per attempt would add a read of the
    same bytes per retry on a D already too slow, and the last attempt would time out too. A read
    longer than all of P's attempts of ``control_call`` (2.5 s against 3 x 0.5) but within
    ``done_delivery`` still ends in one verdict at P and D: P's last attempt waits out the deadline."""
    p, d, corrupter = pair
    reads = []

    def slow_read(*args):
        reads.append(time.monotonic())
        time.sleep(check_s)
        return read_check(*args)

    monkeypatch.setattr("aiolayer.runtime.control.routing.read_check", slow_read)
    outcome, received = _transfer_last_late(p, d, corrupter, "slow-check", [2, 6], [4, 5])
    assert outcome.ok and received.ok, (outcome.reason, received.reason)
    assert len(corrupter.digests) >= 2, "P did not retry the DONE: the check was not slower than its call"
    assert len(reads) == 1, f"{len(reads)} reads at DONE for one DONE and its retries"
    assert _integrity(d).get("verified") == 1


@pytest.mark.parametrize("pair", [Timeouts(receive=20, fence_grace=2.0, done_delivery=1.5)], indirect=True)
def test_a_source_digest_that_does_not_end_holds_the_done_only_until_its_deadline(pair, never_ends, monkeypatch,
                                                                                  caplog):
    """P's digest of the source never ends (a stuck worker, a full thread pool): the DONE goes without its
    check after ``done_delivery``, logged, as when a digest breaks; the transfer is not held until D's
    ``receive`` deadline, nor its source."""
    p, d, corrupter = pair
    monkeypatch.setattr("aiolayer.runtime.send.checking.digest_layers", never_ends)
    began = time.monotonic()
    outcome, received = _transfer(p, d, corrupter, "undigested", [1, 9], [3, 4])
    assert outcome.ok and received.ok, (outcome.reason, received.reason)
    assert 1.4 < time.monotonic() - began < 8
    assert corrupter.digests == [] and _integrity(p) == {} and _integrity(d) == {}   # no check went, none counted
    assert any("integrity digest did not end within done_delivery 1.5s" in r.getMessage() for r in caplog.records)
