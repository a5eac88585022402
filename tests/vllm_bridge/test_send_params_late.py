"""P's late form of ``SendParams`` (late binding): read and refused at the boundary, paired by P's
scheduler, and turned by the worker into a late-bound ``TransferSpec``. No engine needed."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from types import SimpleNamespace

from aiolayer_vllm.metadata import SendReq
from aiolayer_vllm.params import InvalidParams, SendParams, read
from aiolayer_vllm.scheduler import SchedulerSide

TOKEN = "k" * 32
D0, D1 = "tcp://127.0.0.1:5600", "tcp://127.0.0.1:5601"


def late(**extra) -> dict:
    return {"aiolayer": {"transfer_id": "t1", "token": TOKEN, "late": True, "prefill_tp": 1,
                         "decode_ranks": [{"decode_control": D0}, {"decode_control": D1}], **extra}}


def test_the_late_form_is_read_as_send_params():
    params = read(late())
    assert isinstance(params, SendParams) and params.late and params.dst_blocks == []
    assert params == SendParams.late_for("t1", TOKEN, [D0, D1], 1)


@pytest.mark.parametrize("extra", [{"dst_blocks": [1]}, {"first_block": 2},
                                   {"decode_ranks": [{"decode_control": D0, "dst_incarnation": "inc"}]}])
def test_a_late_form_naming_a_destination_is_refused(extra):
    with pytest.raises(InvalidParams):
        read(late(**extra))


def test_d_first_still_needs_its_blocks_and_incarnations():
    with pytest.raises(InvalidParams):
        read({"aiolayer": {"transfer_id": "t1", "token": TOKEN, "decode_ranks": [{"decode_control": D0}]}})


def _scheduler(null: int = 0) -> SimpleNamespace:
    return SimpleNamespace(_null_block=lambda: null)


def test_p_sends_its_blocks_whole_and_leaves_the_destination_to_d():
    send = SendParams.late_for("t1", TOKEN, [D0], 1)
    src, dst, refused, src_from = SchedulerSide._pair(_scheduler(), ([4, 5, 6, 7],), 3, send)
    assert (src, dst, refused, src_from) == ([4, 5, 6], [], "", 0)
    _, _, refused, _ = SchedulerSide._pair(_scheduler(), ([4, 5], [8, 9]), 2, send)
    assert "late binding" in refused                     # several KV cache groups pair block for block: D-first


def test_the_worker_makes_one_late_bound_spec_per_d_rank():
    send = SendParams.late_for("t1", TOKEN, [D0, D1], 1)
    req = SendReq("r1", send, [4, 5, 6], [], src_from=0)
    specs = [req.transfer_spec(rank, layerwise=True, src_from=0, writers=1) for rank in (0, 1)]
    assert [s.peer for s in specs] == [D0, D1] and all(s.late and not s.dst_blocks for s in specs)
    assert len({s.transfer_id for s in specs}) == 2 and {s.token for s in specs} == {TOKEN}
