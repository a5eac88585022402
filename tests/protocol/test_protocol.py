"""The I/O-free protocol package: import hygiene, wire messages, block planning, state machines."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import typing

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aiolayer.protocol
from aiolayer.protocol import messages as m
from aiolayer.protocol.plan import BlockRuns, check_block_bounds, merge_runs, run_addresses
from aiolayer.protocol.state import (
    RECEIVER_TABLE, SENDER_TABLE, TERMINAL, IllegalTransition, State, Transfer, receiver_transfer,
    sender_transfer,
)

PROTOCOL_DIR = pathlib.Path(aiolayer.protocol.__file__).parent
FORBIDDEN_LOADED = {"asyncio", "zmq", "torch", "uvloop", "socket", "selectors", "ssl"}   # in sys.modules
FORBIDDEN = FORBIDDEN_LOADED | {"threading", "subprocess", "multiprocessing"}            # in the sources


# --- import hygiene -------------------------------------------------------------------------------

def test_protocol_import_loads_no_io_modules():
    code = (
        "import sys\n"
        "import aiolayer.protocol.messages, aiolayer.protocol.plan, aiolayer.protocol.state\n"
        f"bad = sorted(n for n in {sorted(FORBIDDEN_LOADED)!r} if n in sys.modules)\n"
        "bad += sorted(n for n in sys.modules if n.startswith(('zmq.', 'torch.', 'uvloop.', 'asyncio.')))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=PROTOCOL_DIR.parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"protocol import pulled in: {out.stdout.strip()}"


def _imported_modules(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "__import__":
            names.add("__import__")  # dynamic imports are not allowed here either
    return names


def test_protocol_sources_import_no_io_modules():
    files = sorted(PROTOCOL_DIR.glob("*.py"))
    assert {f.name for f in files} >= {"messages.py", "plan.py", "state.py"}
    for path in files:
        bad = _imported_modules(path) & (FORBIDDEN | {"__import__", "importlib"})
        assert not bad, f"{path.name} imports {sorted(bad)}"


# --- messages -------------------------------------------------------------------------------------

SAMPLES: list[m._Msg] = [
    m.LayoutRequest(requester="p0"),
    m.LayoutBatch(items=[m.LayoutRequest(requester="p0", transfer_id="t", token="k"),
                         m.LayoutRequest(transfer_id="u")]),
    m.LayoutReply(engine_id="d", incarnation="inc", session="127.0.0.1:1", block_bytes=4096,
                  num_blocks=8, layers=[m.LayerRegion(1 << 40, (1 << 40) + 4096), m.LayerRegion(0, 1)]),
    m.LayoutReplies(layout=m.LayoutReply(engine_id="d", incarnation="inc", session="127.0.0.1:1", block_bytes=4096,
                                         num_blocks=8, layers=[m.LayerRegion(0, 1)]),
                    items=[m.Ack(), None, m.Nack(code="auth", reason="no")]),
    m.LayoutReplies(layout=None, items=[m.Nack(code="ended", reason="gone")]),
    m.Done(transfer_id="t", sender="p", incarnation="inc", layers=4, bytes=1 << 33),
    m.EarlyCheck(transfer_id="t", sender="p", token="k" * 32,
                 check=m.LayerCheck(layers=[0, 2], offsets=[0], lengths=[64], crc_k=[1, 2], digest="xxh3_64")),
    m.DoneBatch(items=[m.Done(transfer_id="t", sender="p", bytes=1), m.Done(transfer_id="u", sender="p")]),
    m.Failed(transfer_id="t", sender="p", reason="boom"),
    m.Abort(transfer_id="t", reason="client gone"),
    m.AbortRequest(transfer_id="t", reason="client gone"),
    m.AllocRequest(transfer_id="t", num_blocks=3, contiguous=False, sender_control="tcp://127.0.0.1:5"),
    m.AllocReply(transfer_id="t", block_ids=[5, 1, 9], incarnation="inc", first_block=2),
    m.AllocReply(transfer_id="t", block_ids=[5], incarnation="inc",
                 layout=m.LayoutReply(engine_id="d", incarnation="inc", session="h:1", block_bytes=64, num_blocks=8,
                                      layers=[m.LayerRegion(0, 1)])),
    m.LookupRequest(transfer_id="t"),
    m.LookupRequest(transfer_id="t", token="k" * 32, wait=True, requester="p", control="tcp://127.0.0.1:5",
                    incarnation="inc", writers=2),
    m.VerifyRequest(transfer_id="t"),
    m.VerifyReply(transfer_id="t", state="finished", reason="", crc_k=[1, 2], crc_v=[3, 4]),
    m.ReleaseRequest(transfer_id="t"),
    m.StatusRequest(transfer_id="t"),
    m.StatusReply(transfer_id="t", state="failed", reason="why"),
    m.Ack(detail="ok"),
    m.Nack(code="decode", reason="bad"),
    m.Replies(items=[m.Ack(detail="finished"), None, m.Nack(code="auth", reason="no")]),
    m.TopologyRequest(requester="proxy"),
    m.TopologyReply(engine_id="p-dp0-tp1", incarnation="inc", control="tcp://127.0.0.1:5601", role="producer",
                    tp_rank=1, tp_size=2, dp_rank=0, dp_size=1, model="tiny/0123456789ab", num_layers=4,
                    block_bytes=4096, block_size=16, kv_heads=1, head_bytes=256, kv_layout="HND"),
]


def test_samples_cover_every_message_type():
    assert {type(s) for s in SAMPLES} == set(typing.get_args(m.Message))


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).__name__)
def test_round_trip(msg):
    payload = m.encode(msg)
    assert isinstance(payload, bytes)
    back = m.decode(payload)
    assert type(back) is type(msg)
    assert back == msg
    assert back.v == m.PROTOCOL_VERSION


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).__name__)
def test_other_version_is_refused(msg):
    other = msgspec.structs.replace(msg, v=m.PROTOCOL_VERSION + 1)
    with pytest.raises(m.DecodeFailure) as info:
        m.decode(m.encode(other))
    assert info.value.code == "version"
    assert str(m.PROTOCOL_VERSION + 1) in info.value.reason


@pytest.mark.parametrize("payload", [
    b"", b"\xff\xfe garbage", b"\xc1", msgspec.msgpack.encode(5), msgspec.msgpack.encode([1, 2]),
    msgspec.msgpack.encode({"type": "no-such-type"}), msgspec.msgpack.encode({"no": "tag"}),
    msgspec.msgpack.encode({"type": "done"}),                         # required fields missing
    msgspec.msgpack.encode({"type": "done", "transfer_id": 1, "sender": "p"}),   # wrong field type
    msgspec.msgpack.encode({"type": "ack", "v": "one"}),
    msgspec.msgpack.encode({"type": "ack", "v": 2**64 - 1, "detail": 3}),
], ids=repr)
def test_garbage_is_a_decode_failure(payload):
    with pytest.raises(m.DecodeFailure) as info:
        m.decode(payload)
    assert info.value.code == "decode"
    assert info.value.reason


def _check_decode(payload: bytes) -> None:
    try:
        msg = m.decode(payload)
    except m.DecodeFailure as exc:
        assert exc.code in ("decode", "version")
    else:
        assert isinstance(msg, typing.get_args(m.Message))
        assert msg.v == m.PROTOCOL_VERSION


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_decode_arbitrary_bytes(payload):
    _check_decode(payload)


_TAGS = [cls.__struct_config__.tag for cls in typing.get_args(m.Message)]
_FIELDS = sorted({f for cls in typing.get_args(m.Message) for f in cls.__struct_fields__})
_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(_TAGS), st.dictionaries(st.sampled_from(_FIELDS), _values, max_size=6),
       st.sampled_from([None, 0, 1, 2]))
def test_decode_structured_fuzz(tag, fields, version):
    """Almost-valid messages (right tag, random field values) decode or fail with DecodeFailure."""
    body = dict(fields, type=tag)
    if version is not None:
        body["v"] = version
    _check_decode(msgspec.msgpack.encode(body))


def test_request_id_frames():
    assert m.unpack_request_id(m.pack_request_id(42)) == 42
    assert m.unpack_request_id(m.pack_request_id(2**64 - 1)) == 2**64 - 1
    assert len(m.pack_request_id(1)) == 8
    for bad in (b"", b"1234567", b"123456789"):
        assert m.unpack_request_id(bad) is None


# --- plan -----------------------------------------------------------------------------------------

_ids = st.integers(min_value=0, max_value=2**31)


@st.composite
def _pairs(draw):
    n = draw(st.integers(min_value=0, max_value=60))
    # mix of runs and jumps so that both merging and breaking are exercised
    def side(dup: bool):
        out, cur = [], draw(_ids)
        for _ in range(n):
            step = draw(st.sampled_from([1, 1, 1, 0, 2, -1, "jump"] if dup else [1, 1, 1, 2, -3, "jump"]))
            cur = draw(_ids) if step == "jump" else max(0, cur + step)
            out.append(cur)
        return out
    return side(dup=True), side(dup=False)


def _expand(runs: BlockRuns) -> list[tuple[int, int]]:
    return [(int(s) + i, int(d) + i)
            for s, d, n in zip(runs.src_start, runs.dst_start, runs.length) for i in range(int(n))]


@settings(max_examples=300, deadline=None)
@given(_pairs())
def test_merge_runs_expands_back_to_the_input(pairs):
    src, dst = pairs
    runs = merge_runs(src, dst)
    assert _expand(runs) == list(zip(src, dst))
    assert runs.num_blocks == len(src)
    assert (runs.length >= 1).all()
    for arr in (runs.src_start, runs.dst_start, runs.length):
        assert arr.dtype == np.int64


@settings(max_examples=300, deadline=None)
@given(_pairs())
def test_merge_runs_are_maximal(pairs):
    runs = merge_runs(*pairs)
    for r in range(runs.num_runs - 1):
        n = runs.length[r]
        mergeable = (runs.src_start[r + 1] == runs.src_start[r] + n
                     and runs.dst_start[r + 1] == runs.dst_start[r] + n)
        assert not mergeable, f"runs {r} and {r + 1} should have been merged"


@settings(max_examples=100, deadline=None)
@given(_ids, _ids, st.integers(min_value=1, max_value=500))
def test_contiguous_input_is_one_run(src0, dst0, n):
    runs = merge_runs(range(src0, src0 + n), list(range(dst0, dst0 + n)))
    assert runs.num_runs == 1
    assert (int(runs.src_start[0]), int(runs.dst_start[0]), int(runs.length[0])) == (src0, dst0, n)


def test_merge_runs_examples():
    runs = merge_runs([3, 4, 5, 9, 9, 10], [0, 1, 7, 8, 9, 10])
    assert _expand(runs) == [(3, 0), (4, 1), (5, 7), (9, 8), (9, 9), (10, 10)]
    assert runs.src_start.tolist() == [3, 5, 9, 9]
    assert runs.dst_start.tolist() == [0, 7, 8, 9]
    assert runs.length.tolist() == [2, 1, 1, 2]
    empty = merge_runs([], [])
    assert empty.num_runs == 0 and empty.num_blocks == 0


@settings(max_examples=100, deadline=None)
@given(_pairs(), st.integers(min_value=0, max_value=2**44), st.integers(min_value=0, max_value=2**44),
       st.sampled_from([1, 64, 4096, 65536]))
def test_run_addresses(pairs, src_base, dst_base, block_bytes):
    runs = merge_runs(*pairs)
    sa, da, ln = run_addresses(runs, src_base, dst_base, block_bytes)
    assert sa.tolist() == [src_base + int(s) * block_bytes for s in runs.src_start]
    assert da.tolist() == [dst_base + int(d) * block_bytes for d in runs.dst_start]
    assert ln.tolist() == [int(n) * block_bytes for n in runs.length]
    assert int(ln.sum()) == len(pairs[0]) * block_bytes


@pytest.mark.parametrize("src,dst", [([1, 2], [1]), ([], [0]), ([0, 1, 2], [])])
def test_merge_runs_rejects_length_mismatch(src, dst):
    with pytest.raises(ValueError):
        merge_runs(src, dst)


@pytest.mark.parametrize("src,dst", [([-1], [0]), ([0], [-1]), ([0, 1, -5], [0, 1, 2])])
def test_merge_runs_rejects_negative_ids(src, dst):
    with pytest.raises(ValueError):
        merge_runs(src, dst)


def test_check_block_bounds():
    check_block_bounds([], 0, "source")
    check_block_bounds([0, 7], 8, "source")
    for bad in ([8], [-1], [0, 100]):
        with pytest.raises(ValueError, match="source"):
            check_block_bounds(bad, 8, "source")


# --- state machines ----------------------------------------------------------------------------

TABLES = {"sender": SENDER_TABLE, "receiver": RECEIVER_TABLE}


def _all_transitions() -> list:
    return list(_gen_transitions())


def _gen_transitions():
    for machine, table in TABLES.items():
        for state, row in table.items():
            for event, nxt in row.items():
                yield pytest.param(machine, state, event, nxt, id=f"{machine}-{state.value}-{event}")


def _all_illegal() -> list:
    return list(_gen_illegal())


def _gen_illegal():
    for machine, table in TABLES.items():
        events = {e for row in table.values() for e in row} | {"bogus"}
        for state, row in table.items():
            for event in sorted(events - set(row)):
                yield pytest.param(machine, state, event, id=f"{machine}-{state.value}-{event}")


@pytest.mark.parametrize("machine,state,event,nxt", _all_transitions())
def test_every_transition(machine, state, event, nxt):
    t = Transfer(machine, TABLES[machine], state)
    changed = t.apply(event, reason="why")
    assert t.state is nxt
    assert changed is (nxt is not state)
    assert t.terminal is (nxt in TERMINAL)
    if changed and nxt in (State.FAILED, State.ABORTING):
        assert t.reason == "why"
    elif not changed:
        assert t.reason == ""


@pytest.mark.parametrize("machine,state,event", _all_illegal())
def test_illegal_transitions_raise(machine, state, event):
    t = Transfer(machine, TABLES[machine], state)
    with pytest.raises(IllegalTransition) as info:
        t.apply(event)
    assert t.state is state
    assert info.value.state == state.value and info.value.event == event


def test_initial_states_and_happy_paths():
    s = sender_transfer()
    assert s.state is State.AWAITING_LAYOUT and not s.terminal
    assert [s.apply(e) for e in ("layout_ready", "all_layers_written", "done_acked")] == [True] * 3
    assert s.state is State.FINISHED and s.terminal and s.reason == ""
    with pytest.raises(IllegalTransition):
        s.apply("fail", "too late")       # a finished sender transfer cannot fail afterwards
    r = receiver_transfer()
    assert r.state is State.REGISTERED and not r.terminal
    assert r.apply("done") is True and r.state is State.FINISHED


def test_duplicate_done_on_finished_receiver_is_a_no_op():
    r = receiver_transfer()
    assert r.apply("done") is True
    for _ in range(3):
        assert r.apply("done") is False
        assert r.state is State.FINISHED and r.reason == ""
    with pytest.raises(IllegalTransition):
        r.apply("failed", "late failure")    # a finished transfer is not failed after the fact
    assert r.state is State.FINISHED


def test_receiver_failure_keeps_first_reason():
    r = receiver_transfer()
    assert r.apply("failed", "first reason") is True
    for event in ["deadline", "failed", "done", "abort", "fenced"]:
        assert r.apply(event, f"later {event}") is False
        assert r.state is State.FAILED and r.reason == "first reason"


@pytest.mark.parametrize("start", ["deadline", "abort"])
@pytest.mark.parametrize("end", ["fenced", "failed", "done"])
def test_receiver_deadline_or_abort_fences_before_failing(start, end):
    """Seed fragilities 8 and 11: a deadline or abort does not free anything at once: ABORTING until P is quiet."""
    r = receiver_transfer()
    assert r.apply(start, "why D gave up") is True
    assert r.state is State.ABORTING and not r.terminal
    for event in ["deadline", "abort"]:
        assert r.apply(event, "later") is False and r.state is State.ABORTING
    assert r.apply(end, "P's word") is True
    assert r.state is State.FAILED and r.reason == "why D gave up"


def test_sender_failure_keeps_first_reason_and_defaults_to_event():
    s = sender_transfer()
    s.apply("layout_ready")
    assert s.apply("fail", "layer 2 timed out") is True
    assert s.apply("fail", "something else") is False
    assert s.state is State.FAILED and s.reason == "layer 2 timed out"
    t = sender_transfer()
    t.apply("fail")
    assert t.reason == "fail"
