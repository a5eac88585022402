"""A speculative drafter's own KV cache layers (EAGLE, MTP) at the connector: moved as further layers
once the drafter ran all its passes, and named in the fingerprint so that P and D must both run it.

P and D are real ``WorkerSide`` objects with their own runtimes (the in-process memory backend); the
engines' own processes are covered by tests/vllm_bridge/test_vllm_eagle.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from aiolayer_vllm.config import from_extra_config
from aiolayer_vllm.draft import draft_facts, draft_layers, draft_start
from aiolayer_vllm.identity import fingerprint
from aiolayer_vllm.metadata import AiolayerMetadata, RecvReq, SendReq
from aiolayer_vllm.params import DecodeRank, RecvParams, SendParams
from aiolayer_vllm.ranks import Topology
from aiolayer_vllm.worker import WorkerSide

pytestmark = pytest.mark.timeout(60)
HEADS, BLOCK, HEAD_SIZE, BLOCKS = 2, 16, 8, 8
TARGET_LAYERS = 2   # the drafter's layer is model.layers.2 (vLLM's start_layer_id = the target's count)
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(TARGET_LAYERS + 1)]
TOKEN = "k" * 32


def _worker(role: str) -> WorkerSide:
    config = from_extra_config({"backend": "memory", "timeouts": {"receive": 20.0, "fence_grace": 2.0}}, role)
    w = WorkerSide(config, role == "p", role == "d", BLOCKS, Topology(total_kv_heads=HEADS), block_size=BLOCK,
                   head_size=HEAD_SIZE, draft_start=TARGET_LAYERS)
    w.caches = {name: (torch.rand(BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE) if role == "p" else
                       torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE)) for name in LAYERS}
    w.register_kv_caches(w.caches)
    return w


def _received(p: WorkerSide, d: WorkerSide) -> None:
    deadline = time.monotonic() + 30
    sent = got = False
    while not (sent and got):
        assert time.monotonic() < deadline, (sent, got)
        sent = sent or bool(p.transfer_results({"rq-p"})[0])
        _, recv, failed = d.transfer_results(set())
        assert not failed
        got = got or bool(recv)
        time.sleep(0.01)


def test_the_drafter_layer_is_sent_as_the_step_ends_with_its_last_pass():
    """The drafter writes its layer once per draft token: P must send what the last pass left, not
    what the first handed over (which the later passes overwrite in place)."""
    p, d = _worker("p"), _worker("d")
    try:
        src, dst = [1, 2], [3, 4]
        d.bind(AiolayerMetadata(recvs=[RecvReq("rq-d", RecvParams(transfer_id="tx", token=TOKEN), dst, 0)]))
        d.bind(AiolayerMetadata())
        rank = DecodeRank(decode_control=d.runtime.control_endpoint, dst_incarnation=d.runtime.incarnation)
        params = SendParams(transfer_id="tx", token=TOKEN, dst_blocks=dst, decode_ranks=[rank])
        p.bind(AiolayerMetadata(sends=[SendReq("rq-p", params, src, dst)]))
        for name in LAYERS:            # the target's forward, then the drafter's first pass
            p.save_kv_layer(name)
        time.sleep(0.3)                # time for a send of what was handed over to land
        draft = p.caches[LAYERS[-1]]
        draft[src] = torch.rand(len(src), HEADS, BLOCK, 2 * HEAD_SIZE)   # the drafter's second pass
        p.save_kv_layer(LAYERS[-1])
        p.wait_for_save()
        _received(p, d)
        for name in LAYERS:
            assert torch.equal(d.caches[name][dst], p.caches[name][src]), name
    finally:
        p.shutdown()
        d.shutdown()


def test_draft_layers_are_those_numbered_from_the_target_count_on():
    names = ["model.layers.0.self_attn.attn", "model.layers.3.self_attn.attn", "model.layers.4.self_attn.attn"]
    assert draft_layers(names, 4) == (2,)
    assert draft_layers(names, None) == ()


def _config(method: str | None, draft_kv: bool) -> SimpleNamespace:
    spec = None if method is None else SimpleNamespace(
        method=method, uses_draft_kv_cache=lambda: draft_kv,
        draft_model_config=SimpleNamespace(model=f"/models/tiny-{method}/") if draft_kv else None)
    model = SimpleNamespace(get_total_num_hidden_layers=lambda: 4)
    return SimpleNamespace(speculative_config=spec, model_config=model)


def test_a_drafter_with_kv_layers_is_named_in_the_fingerprint():
    facts = {"model": "tiny", "layers": 4}
    with_drafter = facts | {"layers": 5} | draft_facts(_config("eagle", True))
    assert fingerprint(with_drafter).startswith("tiny (+ eagle tiny-eagle draft)/")
    assert fingerprint(with_drafter) != fingerprint(facts)
    assert draft_start(_config("eagle", True)) == 4


@pytest.mark.parametrize("method", [None, "ngram"])
def test_no_drafter_kv_leaves_the_fingerprint_alone(method):
    """ngram drafts from the prompt (no KV of its own): P and D may differ in it."""
    assert draft_facts(_config(method, False)) == {}
    assert draft_start(_config(method, False)) is None
