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

from aiolayer_vllm.draft import draft_facts, draft_layers, draft_start
from aiolayer_vllm.identity import fingerprint
from helpers_worker import BLOCK, HEAD_SIZE, HEADS, assert_landed, bind_transfer, worker_pair

pytestmark = pytest.mark.timeout(60)
TARGET_LAYERS = 2   # the drafter's layer is model.layers.2 (vLLM's start_layer_id = the target's count)
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(TARGET_LAYERS + 1)]


def test_the_drafter_layer_is_sent_as_the_step_ends_with_its_last_pass():
    """The drafter writes its layer once per draft token: P must send what the last pass left, not
    what the first handed over (which the later passes overwrite in place)."""
    with worker_pair(LAYERS, TARGET_LAYERS) as (p, d):
        src, dst = [1, 2], [3, 4]
        bind_transfer(p, d, src, dst)
        for name in LAYERS:            # the target's forward, then the drafter's first pass
            p.save_kv_layer(name)
        time.sleep(0.3)                # time for a send of what was handed over to land
        draft = p.caches[LAYERS[-1]]
        draft[src] = torch.rand(len(src), HEADS, BLOCK, 2 * HEAD_SIZE)   # the drafter's second pass
        p.save_kv_layer(LAYERS[-1])
        p.wait_for_save()
        assert_landed(p, d, src, dst)


@pytest.mark.parametrize("drafter", [LAYERS[-1], "draft_model.model.layers.0.self_attn.attn"])
def test_a_step_whose_drafter_did_not_run_still_sends_every_layer_as_it_ends(drafter):
    """vLLM skips the drafter in a step where a sequence is near the drafter's length limit: its layer is
    never handed over during the step. It goes as the step ends (its blocks are as final as they will be),
    instead of the whole send failing at its write deadline."""
    with worker_pair(LAYERS[:-1] + [drafter], TARGET_LAYERS) as (p, d):
        src, dst = [1, 2], [3, 4]
        bind_transfer(p, d, src, dst)
        for name in LAYERS[:-1]:       # the target's forward only
            p.save_kv_layer(name)
        p.wait_for_save()
        assert_landed(p, d, src, dst)


def test_a_separate_draft_models_layers_are_sent_after_its_last_pass():
    """vLLM's ``method: draft_model`` loads the drafter under ``draft_model.``, numbering its layers from 0:
    they were taken for target layers, so the step closed at the drafter's first pass (D got that pass's
    KV, which the later passes overwrite)."""
    names = LAYERS[:-1] + ["draft_model.model.layers.0.self_attn.attn"]
    with worker_pair(names, TARGET_LAYERS) as (p, d):
        assert p._draft == (2,) and list(p.layer_index) == names   # after the target's layers
        src, dst = [1, 2], [3, 4]
        bind_transfer(p, d, src, dst)
        for name in names:             # the target's forward, then the drafter's first pass
            p.save_kv_layer(name)
        time.sleep(0.3)
        p.caches[names[-1]][src] = torch.rand(len(src), HEADS, BLOCK, 2 * HEAD_SIZE)   # its second pass
        p.save_kv_layer(names[-1])
        p.wait_for_save()
        assert_landed(p, d, src, dst)


def test_draft_layers_are_those_numbered_from_the_target_count_on():
    names = ["model.layers.0.self_attn.attn", "model.layers.3.self_attn.attn", "model.layers.4.self_attn.attn"]
    assert draft_layers(names, 4) == (2,)
    assert draft_layers(names, None) == ()
    assert draft_layers(["model.layers.0.a", "draft_model.model.layers.0.a"], 1) == (1,)


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

