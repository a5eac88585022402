"""P's and D's connector worker sides (``aiolayer_vllm.worker.WorkerSide``) with real runtimes on the
in-process memory backend, paged caches of random (P) or zero (D) bytes, and one transfer between them:
what the bridge tests that need no vLLM engine share."""

from __future__ import annotations

import contextlib
import time

import torch

from aiolayer_vllm.config import from_extra_config
from aiolayer_vllm.metadata import AiolayerMetadata, RecvReq, SendReq
from aiolayer_vllm.params import DecodeRank, RecvParams, SendParams
from aiolayer_vllm.ranks import Topology
from aiolayer_vllm.worker import WorkerSide

HEADS, BLOCK, HEAD_SIZE, BLOCKS = 2, 16, 8, 8
TOKEN = "k" * 32


def worker_side(role: str, layers: list[str], draft_start: int | None = None) -> WorkerSide:
    """``role`` "p" or "d", its caches in ``.caches`` (layer name -> tensor), its runtime started."""
    config = from_extra_config({"backend": "memory", "timeouts": {"receive": 20.0, "fence_grace": 2.0}}, role)
    w = WorkerSide(config, role == "p", role == "d", BLOCKS, Topology(total_kv_heads=HEADS), block_size=BLOCK,
                   head_size=HEAD_SIZE, draft_start=draft_start)
    w.caches = {name: (torch.rand(BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE) if role == "p" else
                       torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE)) for name in layers}
    w.register_kv_caches(w.caches)
    return w


def bind_transfer(p: WorkerSide, d: WorkerSide, src: list[int], dst: list[int]) -> None:
    """D registers a transfer "tx" into ``dst``; P's step sends ``src`` there (its layers still to hand over)."""
    d.bind(AiolayerMetadata(recvs=[RecvReq("rq-d", RecvParams(transfer_id="tx", token=TOKEN), dst, 0)]))
    d.bind(AiolayerMetadata())
    rank = DecodeRank(decode_control=d.runtime.control_endpoint, dst_incarnation=d.runtime.incarnation)
    params = SendParams(transfer_id="tx", token=TOKEN, dst_blocks=dst, decode_ranks=[rank])
    p.bind(AiolayerMetadata(sends=[SendReq("rq-p", params, src, dst)]))


def wait_received(p: WorkerSide, d: WorkerSide, within_s: float = 30.0) -> None:
    """P reported its send finished and D its receive, none failed."""
    deadline = time.monotonic() + within_s
    sent = got = False
    while not (sent and got):
        assert time.monotonic() < deadline, (sent, got)
        sent = sent or bool(p.transfer_results({"rq-p"})[0])
        _, recv, failed = d.transfer_results(set())
        assert not failed
        got = got or bool(recv)
        time.sleep(0.01)


@contextlib.contextmanager
def worker_pair(layers: list[str], draft_start: int | None = None):
    """P's and D's worker sides, shut down on the way out."""
    p, d = worker_side("p", layers, draft_start), worker_side("d", layers, draft_start)
    try:
        yield p, d
    finally:
        p.shutdown()
        d.shutdown()


def assert_landed(p: WorkerSide, d: WorkerSide, src: list[int], dst: list[int]) -> None:
    """Once the transfer ended: every layer of D's ``dst`` blocks holds P's ``src`` blocks' bytes."""
    wait_received(p, d)
    for name, cache in p.caches.items():
        assert torch.equal(d.caches[name][dst], cache[src]), name
