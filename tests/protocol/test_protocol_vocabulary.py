"""The protocol's vocabulary is typed, in ``aiolayer/protocol/`` only, and the wire is unchanged.

Nack codes, Ack details that are signals and state-machine events are str enums there; everywhere
else in the core and the bridges a literal in their place is a bug (a typo is a silent new code).
"""

from __future__ import annotations

import ast
import pathlib

import msgspec
import pytest

from aiolayer.config import COMPOSED, MAX_DEADLINE_S, MIN_FRAME_BYTES, NodeConfig, Timeouts
from aiolayer.errors import ConfigError
from aiolayer.protocol import messages as m
from aiolayer.protocol.codes import AckDetail, NackCode
from aiolayer.protocol.state import Event, receiver_transfer, sender_transfer

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCANNED = [ROOT / "aiolayer", ROOT / "bridges", ROOT / "bench", ROOT / "examples"]
PROTOCOL = ROOT / "aiolayer" / "protocol"


def _is_str(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _name(func: ast.AST) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _literal_vocabulary(tree: ast.AST):
    """(line, what) of every literal standing where a NackCode, an AckDetail signal or an Event belongs."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _name(node.func)
            first = node.args[0] if node.args else None
            code = next((k.value for k in node.keywords if k.arg == "code"), None)
            if name in ("ControlRejected", "DecodeFailure") and (_is_str(first) or _is_str(code)):
                yield node.lineno, f"{name}(<str literal>)"
            elif name == "Nack" and (_is_str(code) or _is_str(first)):
                yield node.lineno, "Nack(code=<str literal>)"
            elif name == "apply" and isinstance(node.func, ast.Attribute) and _is_str(first):
                yield node.lineno, ".apply(<str literal>)"
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) \
                and node.left.attr in ("code", "detail"):
            for right in node.comparators:
                items = right.elts if isinstance(right, (ast.Tuple, ast.List, ast.Set)) else [right]
                if any(_is_str(item) for item in items):
                    yield node.lineno, f".{node.left.attr} compared with a str literal"


def test_no_string_nack_code_or_event_outside_protocol():
    found = []
    for top in SCANNED:
        for path in sorted(top.rglob("*.py")):
            if PROTOCOL in path.parents:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            found += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in _literal_vocabulary(tree)]
    assert not found, "use protocol.codes.NackCode / AckDetail / protocol.state.Event:\n" + "\n".join(found)


def test_the_scan_sees_each_pattern():
    """The scan above is only worth something if it flags what it looks for."""
    src = ('raise ControlRejected("auth", "x")\nm.Nack(code="busy", reason="r")\nt.apply("abort")\n'
           'exc.code == "settling"\nreply.detail in ("stopped",)\nControlRejected(NackCode.AUTH, "x")\n')
    assert [line for line, _ in _literal_vocabulary(ast.parse(src))] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("code", list(NackCode))
def test_typed_nack_codes_encode_as_their_plain_strings(code):
    typed = m.encode(m.Nack(code=code, reason="why"))
    assert typed == m.encode(m.Nack(code=code.value, reason="why"))
    back = m.decode(typed)
    assert back.code == code and f"{back.code}" == code.value and str(code) == code.value


def test_ack_details_and_events_are_their_strings():
    assert m.encode(m.Ack(detail=AckDetail.STOPPED)) == m.encode(m.Ack(detail="stopped"))
    assert m.confirms_stop(m.decode(m.encode(m.Ack(detail="stopped"))))   # an old peer's reply
    assert not m.confirms_stop(m.Ack(detail="aborting")) and not m.confirms_stop(m.Nack(code="settling", reason=""))
    for event in Event:
        assert str(event) == event.value and f"{event}" == event.value
    t = sender_transfer()
    t.apply(Event.FAIL)
    assert t.reason == "fail" and type(t.reason) is str   # the default reason is the event's plain string


def test_a_code_this_side_does_not_know_still_decodes():
    """Versioning: Nack.code stays a str on the wire: a newer peer's code is a refusal, not a decode error."""
    payload = msgspec.msgpack.encode({"type": "nack", "v": m.PROTOCOL_VERSION, "code": "from_the_future",
                                      "reason": "r"})
    reply = m.decode(payload)
    assert isinstance(reply, m.Nack) and reply.code == "from_the_future"


def test_several_senders_are_counted_by_the_receiver_machine():
    r = receiver_transfer(senders=2)
    word, repeated = r.gather("t", m.Done(transfer_id="t", sender="p0", bytes=3))
    assert word is None and not repeated and r.tally() == "1 of 2 senders reported"
    assert r.gather("t", m.Done(transfer_id="t", sender="p0", bytes=3)) == (None, True)
    word, repeated = r.gather("t", m.Done(transfer_id="t", sender="p1", bytes=4))
    assert isinstance(word, m.Done) and word.bytes == 7 and not repeated


def test_composed_deadlines_are_the_sums_they_name():
    t = Timeouts(layer_write=1.5, control_call=0.25, cleanup=0.5, quarantine=7.0)
    for name, parts in COMPOSED.items():
        assert getattr(t, name) == sum(getattr(t, part) for part in parts), name
    assert t.quarantine_wait == 7.5 and t.abort_call == 1.75 and t.abort_ask == 2.25 and t.abort_settle == 2.0
    for endless in (float("inf"), 1e10, float("nan")):   # every wait ends, and its clock sums do not overflow
        with pytest.raises(ConfigError, match="quarantine must be > 0 and at most 86400 s"):
            Timeouts(quarantine=endless)
    assert Timeouts(receive=MAX_DEADLINE_S).receive == MAX_DEADLINE_S


def test_a_node_config_that_would_refuse_every_frame_or_step_is_refused():
    """``max_frame_bytes`` 0 started a node that dropped every frame (the doctor saw "no answer"), and a
    ``bridge_capacity`` of 0 one whose forward could hand over nothing."""
    for bad in (dict(max_frame_bytes=0), dict(max_frame_bytes=-5), dict(max_frame_bytes=MIN_FRAME_BYTES - 1),
                dict(bridge_capacity=0)):
        with pytest.raises(ConfigError, match="max_frame_bytes must be >= 65536 and bridge_capacity >= 1"):
            NodeConfig(backend="memory", **bad)
    assert NodeConfig(backend="memory", max_frame_bytes=MIN_FRAME_BYTES, bridge_capacity=1).bridge_capacity == 1



def test_sizes_no_host_holds_and_names_no_peer_takes_are_refused_at_the_config():
    """A KV cache of petabytes reached numpy (a traceback) or, just under RAM, the OOM killer; an engine id
    past the wire's 1,024 characters started and then broke every peer's decode of its frames; any number
    of delivery retries was taken, each a wait."""
    from aiolayer.config import MAX_DIMENSION, MAX_KV_BYTES, KVShape

    for bad in (dict(num_blocks=10**9), dict(head_dim=2**63), dict(num_layers=MAX_DIMENSION + 1)):
        with pytest.raises(ConfigError, match="must be 1 to 16,777,216"):
            KVShape(**bad)
    with pytest.raises(ConfigError, match="bytes .* is over"):
        KVShape(num_layers=80, num_blocks=1 << 20, block_size=16, kv_heads=8, head_dim=128)
    assert KVShape(num_layers=1, num_blocks=MAX_KV_BYTES // (2 * 16 * 8 * 128 * 2)).total_bytes == MAX_KV_BYTES
    for name in ("x" * 1025, "", "tab\there"):
        with pytest.raises(ConfigError, match="engine_id must be 1 to 1024 printable"):
            NodeConfig(engine_id=name, backend="memory")
    assert NodeConfig(engine_id="x" * 1024, backend="memory").engine_id == "x" * 1024
    with pytest.raises(ConfigError, match="control_retries must be 1 to 100"):
        Timeouts(control_retries=101)
