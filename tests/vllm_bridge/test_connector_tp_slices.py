"""The connector's worker side across tensor-parallel sizes, byte for byte: each P rank writes exactly
its KV heads into each D rank (vLLM's CPU layout, K and V in one plane per head), D's rank finishes
only once every P rank writing into it reported, P's request is free only once all its sends are.

Every rank is a real ``WorkerSide`` with its own runtime (the in-process memory backend: all ranks
live in this process), fed the metadata the scheduler side builds; the engines' own processes are
covered by tests/vllm_bridge/test_vllm_parallel.py."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from aiolayer import NodeConfig, Runtime
from aiolayer.protocol import messages as m
from aiolayer_vllm.config import from_extra_config
from aiolayer_vllm.metadata import AiolayerMetadata, RecvReq, SendReq
from aiolayer_vllm.params import DecodeRank, RecvParams, SendParams
from aiolayer_vllm.ranks import Topology, rank_transfer_id
from aiolayer_vllm.worker import WorkerSide

pytestmark = pytest.mark.timeout(60)
HEADS, BLOCK, HEAD_SIZE, BLOCKS = 4, 16, 8, 12
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
TOKEN = "k" * 32


def _global_kv(layer: int, heads: int = HEADS) -> torch.Tensor:
    """Every head's bytes of every block differ: [blocks, heads, BLOCK, 2*HEAD_SIZE] (vLLM CPU)."""
    g = torch.Generator().manual_seed(layer)
    return torch.rand(BLOCKS, heads, BLOCK, 2 * HEAD_SIZE, generator=g)


def _first_head(rank: int, tp: int, heads: int) -> int:
    return rank * (heads // tp) if tp <= heads else rank // (tp // heads)   # replicated when tp > heads


def _ranks(role: str, tp: int, fill: bool, heads: int = HEADS) -> list[WorkerSide]:
    workers = []
    for rank in range(tp):
        topo = Topology(tp_rank=rank, tp_size=tp, total_kv_heads=heads)
        config = from_extra_config({"backend": "memory", "timeouts": {"receive": 20.0, "fence_grace": 2.0}},
                                   f"{role}{tp}")
        w = WorkerSide(config, role == "p", role == "d", BLOCKS, topo, block_size=BLOCK, head_size=HEAD_SIZE)
        local, first = topo.local_heads(), _first_head(rank, tp, heads)
        caches = {name: (_global_kv(i, heads)[:, first:first + local].clone() if fill else
                         torch.zeros(BLOCKS, local, BLOCK, 2 * HEAD_SIZE)) for i, name in enumerate(LAYERS)}
        w.register_kv_caches(caches)
        w.caches = caches
        workers.append(w)
    return workers


def _recv(dst: list[int], p_controls: list[str]) -> RecvReq:
    return RecvReq("rq-d", RecvParams(transfer_id="tx", token=TOKEN, prefill_controls=p_controls), dst, 0)


def _send(src: list[int], dst: list[int], ds: list[WorkerSide], prefill_tp: int = 0) -> SendReq:
    ranks = [DecodeRank(decode_control=d.runtime.control_endpoint, dst_incarnation=d.runtime.incarnation) for d in ds]
    params = SendParams(transfer_id="tx", token=TOKEN, dst_blocks=dst, decode_ranks=ranks, prefill_tp=prefill_tp)
    return SendReq("rq-p", params, src, dst)


def _handoff(p_tp: int, d_tp: int, src: list[int], dst: list[int], heads: int):
    ps, ds = _ranks("p", p_tp, fill=True, heads=heads), _ranks("d", d_tp, fill=False, heads=heads)
    try:
        p_controls = [p.runtime.control_endpoint for p in ps]
        for d in ds:   # the scheduler's one RecvReq goes to every D rank
            d.bind(AiolayerMetadata(recvs=[_recv(dst, p_controls)]))
        if p_tp == 1:
            for d in ds:
                d.bind(AiolayerMetadata())
        send = _send(src, dst, ds)
        for p in ps:   # ... and the one SendReq to every P rank; each runs the forward
            p.bind(AiolayerMetadata(sends=[send]))
            for name in LAYERS:
                p.save_kv_layer(name)
            p.wait_for_save()
        _wait_all(ps, ds)
    except BaseException:
        for w in ps + ds:
            w.shutdown()
        raise
    return ps, ds


def _wait_all(ps: list[WorkerSide], ds: list[WorkerSide]) -> None:
    sent, recvd, failed = set(), set(), set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (len(sent) < len(ps) or len(recvd) < len(ds)):
        for i, p in enumerate(ps):
            if p.transfer_results({"rq-p"})[0]:
                sent.add(i)
        for i, d in enumerate(ds):
            _, got, bad = d.transfer_results(set())
            if got:
                recvd.add(i)
            if bad:
                failed.add(i)
        time.sleep(0.01)
    assert not failed and len(sent) == len(ps) and len(recvd) == len(ds), (sent, recvd, failed)


@pytest.mark.parametrize("heads", [4, 2])   # 2 KV heads: TP 4 replicates each on two ranks (GQA)
@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4), (1, 4), (4, 1), (4, 4)])
def test_each_d_rank_holds_exactly_its_heads_of_every_sent_block(p_tp, d_tp, heads):
    src, dst = [1, 2, 3, 7], [4, 5, 9, 10]          # runs that merge on both sides and one that breaks
    ps, ds = _handoff(p_tp, d_tp, src, dst, heads)
    try:
        for rank, d in enumerate(ds):
            local, first = d.topology.local_heads(), _first_head(rank, d_tp, heads)
            for i, name in enumerate(LAYERS):
                want = _global_kv(i, heads)[src][:, first:first + local]
                got = d.caches[name][dst]
                assert torch.equal(got, want), (p_tp, d_tp, rank, name)
                untouched = [b for b in range(BLOCKS) if b not in dst]
                assert not d.caches[name][untouched].any()   # nothing written outside the blocks
    finally:
        for w in ps + ds:
            w.shutdown()


def test_a_d_rank_waits_for_every_p_rank_that_writes_into_it():
    """P TP=2 -> D TP=1: only one P rank sends; D must not finish on its DONE alone."""
    ps, ds = _ranks("p", 2, fill=True), _ranks("d", 1, fill=False)
    try:
        ds[0].bind(AiolayerMetadata(recvs=[_recv([1], [p.runtime.control_endpoint for p in ps])]))
        send = _send([2], [1], ds)
        ps[0].bind(AiolayerMetadata(sends=[send]))
        for name in LAYERS:
            ps[0].save_kv_layer(name)
        ps[0].wait_for_save()
        deadline = time.monotonic() + 30
        while not ps[0].transfer_results({"rq-p"})[0]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.3)
        assert ds[0].transfer_results(set()) == (set(), set(), set())     # still waiting for rank 1
        ps[1].bind(AiolayerMetadata(sends=[send]))
        for name in LAYERS:
            ps[1].save_kv_layer(name)
        ps[1].wait_for_save()
        _wait_all(ps[1:], ds)
        assert rank_transfer_id("tx", 0, 1) == "tx"
    finally:
        for w in ps + ds:
            w.shutdown()


def test_each_rank_answers_the_topology_query_with_its_rank_role_and_model():
    ps = _ranks("p", 2, fill=False)
    try:
        with Runtime(NodeConfig(engine_id="asker", backend="memory")) as asker:
            replies = [asker.request(p.runtime.control_endpoint, m.TopologyRequest()) for p in ps]
    finally:
        for w in ps:
            w.shutdown()
    assert [(r.role, r.tp_rank, r.tp_size, r.dp_size) for r in replies] == [("producer", 0, 2, 1),
                                                                           ("producer", 1, 2, 1)]
    assert replies[0].model == replies[1].model and replies[0].model
    assert (replies[0].num_layers, replies[0].block_size, replies[0].kv_heads) == (len(LAYERS), BLOCK, HEADS // 2)


def test_a_p_of_another_tp_size_than_planned_writes_nothing_and_fails_d_at_once(caplog):
    """The plan was made for a P of one rank (D waits for one sender) but P has two: without the check D
    finishes on rank 0's DONE with the other half of the heads never written."""
    ps, ds = _ranks("p", 2, fill=True), _ranks("d", 1, fill=False)
    try:
        ds[0].bind(AiolayerMetadata(recvs=[_recv([1, 2], [ps[0].runtime.control_endpoint])]))
        send = _send([3, 4], [1, 2], ds, prefill_tp=1)
        started = time.monotonic()
        for p in ps:
            p.bind(AiolayerMetadata(sends=[send]))
            for name in LAYERS:
                p.save_kv_layer(name)
            p.wait_for_save()
        failed, sent = set(), [False, False]
        while not (failed and all(sent)):
            assert time.monotonic() - started < 10, (failed, sent)   # D's receive deadline is 20 s
            failed |= ds[0].transfer_results(set())[2]
            sent = [bool(p.transfer_results({"rq-p"})[0]) or done for p, done in zip(ps, sent)]
            time.sleep(0.01)
        assert failed == {"rq-d"}
        assert not any(ds[0].caches[name].any() for name in LAYERS)   # nothing was written
        said = [r.getMessage() for r in caplog.records if "aiolayer receive tx" in r.getMessage()]
        assert len(said) == 1 and "tensor-parallel size 2" in said[0] and "planned for tensor-parallel size 1" \
            in said[0], said
    finally:
        for w in ps + ds:
            w.shutdown()
