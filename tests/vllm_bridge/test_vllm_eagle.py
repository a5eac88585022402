"""Real vLLM engines speculating with an EAGLE draft model on P and D (the same ``--speculative-config``),
P -> D through ``aiolayer proxy``, at vLLM's defaults otherwise (torch.compile, prefix caching, chunked
prefill, block size 128) but float32 (bf16 would blur the logprob comparison).

The target is the 4-layer ``LLAMA_GQA``, the draft one Llama layer of its attention shape with random
weights (``tiny_draft``). vLLM gives the draft's attention its own KV cache layer (model.layers.4) and
defers the connector's ``wait_for_save`` until the drafter ran, so P moves the draft KV of the prompt as
a fifth runtime layer (``aiolayer_vllm.draft``):

- P -> D answers equal the aggregated engine's (the same speculative config, no transfer) under greedy
  sampling, and D drafted (``vllm:spec_decode_num_draft_tokens_total`` grew);
- every engine registered 5 layers, and the bytes moved are 5 layers of every prompt block, each
  checked at D against P's CRC32 (integrity sample 1);
- negative control: the same flow into a D that zeroes whatever KV it received
  (``AIOLAYER_DEBUG_ZERO_RECEIVED=1``) answers differently;
- a P without the drafter and a D with it differ in their fingerprints, which name the drafter
  (tests/vllm_bridge/test_connector_draft_layers.py), so the proxy refuses such a pair at start as it refuses
  any two fingerprints that differ (tests/proxy/test_proxy_topology.py): no fourth engine here.

Engines: P, D, and the aggregated engine (``kv_both``, zeroing what it receives), which answers the
baseline on its own (a request without aiolayer parameters moves nothing) and is the negative control's
D, on other prompts than its baseline ones (its prefix cache must not serve them).
"""

from __future__ import annotations

import json
import math
import re
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from aiolayer.harness.pd import ProxyProcess, connector
from aiolayer.harness.procs import free_ports
from aiolayer.harness.servers import VllmServer, completion, running, scrape_metrics
from aiolayer.harness.tiny_model import LLAMA_GQA, SAMPLE_PROMPTS, long_prompt, tiny_model_dir
from helpers_node import MC_ENV
from helpers_relay import bridge_logging_config

from aiolayer.harness.tiny_draft import eagle_config, tiny_draft_dir
from aiolayer_vllm.config import DEBUG_ZERO_RECEIVED_ENV

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
MAX_TOKENS = 24                   # several decode steps at D, each drafting 2 tokens
BLOCK = 128                       # vLLM CPU's default block size
LAYERS = LLAMA_GQA.num_layers + 1   # the target's and the draft's
PROMPTS = [SAMPLE_PROMPTS[0], long_prompt(300, seed=11)]          # 1 and 3 blocks
ZEROED_PROMPTS = [SAMPLE_PROMPTS[4], long_prompt(200, seed=12)]   # the negative control's: new to its D
TIMEOUTS = {"receive": 90.0, "fence_grace": 10.0, "layout_fetch": 30.0, "control_call": 5.0}
PROXY_ARGS = ("--registration-timeout", "90", "--prefill-timeout", "90")
LOGPROB_TOL = 1e-2                # D decodes over received KV, the aggregated engine over its own prefill
ZEROED_MIN_DIFF = 10 * LOGPROB_TOL


def _engine(name: str, control_port: int, role: str, env: dict | None = None, drafter: bool = True,
            **kw) -> VllmServer:
    spec = ("--speculative-config", json.dumps(eagle_config(tiny_draft_dir(LLAMA_GQA)))) if drafter else ()
    return VllmServer(tiny_model_dir(LLAMA_GQA), name=name, dtype="float32", omp_bind="nobind", extra_args=spec,
                      # integrity_sample 1: D checks every layer's bytes (the draft's too) against P's CRC32
                      kv_transfer_config=connector(role, name, control_port, timeouts=TIMEOUTS, integrity_sample=1.0),
                      env=MC_ENV | {"VLLM_LOGGING_CONFIG_PATH": bridge_logging_config()} | (env or {}),
                      startup_timeout_s=600, **kw)


def _backend(server: VllmServer, control_port: int) -> str:
    return f"{server.base_url},tcp://127.0.0.1:{control_port}"


def _total(server: VllmServer, name: str) -> float:
    return sum(v for _, v in scrape_metrics(server).get(name, []))


def _moved(p: VllmServer, d: VllmServer) -> tuple[float, float]:
    return _total(p, "vllm:aiolayer_bytes_sent_total"), _total(d, "vllm:aiolayer_bytes_received_total")


def _answer(target, prompt: str, model: str | None = None) -> tuple[list[int], list[float], int]:
    """Greedy tokens, the chosen tokens' logprobs, and the prompt's token count."""
    out = completion(target, prompt, max_tokens=MAX_TOKENS, model=model, timeout_s=240, logprobs=1)
    return out.token_ids, list(out.raw["choices"][0]["logprobs"]["token_logprobs"]), len(out.prompt_token_ids or ())


def _layout(server: VllmServer) -> tuple[int, int]:
    """(runtime layers, bytes of one block of one of them), from the layout the worker logged."""
    found = re.search(r"aiolayer \S+: (\d+) layers, \d+ blocks of (\d+) bytes", server.log_text())
    assert found, ("no layout logged", server.log_tail(3000))
    return int(found.group(1)), int(found.group(2))


def _settled(p, d, sent0: float, got0: float, wait_s: float = 10.0) -> tuple[float, float]:
    """(sent, received) bytes since the given totals, once both engines reported them."""
    deadline = time.monotonic() + wait_s
    while True:
        sent, got = (now - before for now, before in zip(_moved(p, d), (sent0, got0)))
        if (sent == got and sent > 0) or time.monotonic() > deadline:
            return sent, got
        time.sleep(0.2)


def _through_proxy(p, p_port, d, d_port, prompts) -> tuple[dict, dict]:
    """Each prompt through a proxy from P to D: prompt -> answer, and prompt -> (sent, received) bytes."""
    answers, moved = {}, {}
    with ProxyProcess([_backend(p, p_port)], [_backend(d, d_port)], extra_args=PROXY_ARGS) as proxy:
        for prompt in prompts:
            sent0, got0 = _moved(p, d)
            answers[prompt] = _answer(proxy.url, prompt, model=p.served_model)
            moved[prompt] = _settled(p, d, sent0, got0)
    return answers, moved


def _drafted(server: VllmServer) -> float:
    return _total(server, "vllm:spec_decode_num_draft_tokens_total")


@pytest.fixture(scope="module")
def eagle():
    p_port, d_port, a_port = free_ports(1), free_ports(1), free_ports(1)
    p, d = _engine("eagle-p", p_port, "kv_producer"), _engine("eagle-d", d_port, "kv_consumer")
    a = _engine("eagle-a", a_port, "kv_both", env={DEBUG_ZERO_RECEIVED_ENV: "1"})
    with running(p, d, a):
        baseline = {prompt: _answer(a, prompt) for prompt in PROMPTS}
        drafted = _drafted(d)
        answers, moved = _through_proxy(p, p_port, d, d_port, PROMPTS)
        drafted = _drafted(d) - drafted
        integrity = (_total(d, "vllm:aiolayer_integrity_verified_total"),
                     _total(d, "vllm:aiolayer_integrity_mismatch_total"))
        zeroed_baseline = {prompt: _answer(p, prompt) for prompt in ZEROED_PROMPTS}   # P on its own
        zeroed, _ = _through_proxy(p, p_port, a, a_port, ZEROED_PROMPTS)
        yield {"p": p, "d": d, "a": a, "d_port": d_port, "baseline": baseline, "answers": answers, "moved": moved,
               "drafted": drafted, "integrity": integrity, "zeroed_baseline": zeroed_baseline, "zeroed": zeroed}


def test_eagle_p_to_d_equals_the_aggregated_engine_and_d_drafts(eagle):
    verified, mismatched = eagle["integrity"]   # D checked the landed bytes of every layer against P's
    assert verified >= len(PROMPTS) and mismatched == 0, eagle["integrity"]
    for prompt, (tokens, logprobs, n) in eagle["answers"].items():
        want_tokens, want_logprobs, _ = eagle["baseline"][prompt]
        print(f"{n} tokens: largest logprob change vs aggregated "
              f"{max(abs(a - b) for a, b in zip(logprobs, want_logprobs)):.5f}")
        assert tokens == want_tokens, (n, tokens, want_tokens)
        assert all(math.isclose(a, b, abs_tol=LOGPROB_TOL) for a, b in zip(logprobs, want_logprobs)), \
            (n, logprobs, want_logprobs)
    print(f"D drafted {eagle['drafted']:.0f} tokens")
    assert eagle["drafted"] > 0, "D proposed no draft: the case did not test speculative decoding"


def test_the_draft_layer_moves_as_a_fifth_layer(eagle):
    for server in (eagle["p"], eagle["d"], eagle["a"]):
        assert _layout(server)[0] == LAYERS, server.log_tail(3000)
    _, block_bytes = _layout(eagle["d"])
    for prompt, (sent, got) in eagle["moved"].items():
        n = eagle["answers"][prompt][2]
        print(f"{n} tokens: sent {sent:.0f} bytes")
        assert sent == got == LAYERS * math.ceil(n / BLOCK) * block_bytes, (n, sent, got, block_bytes)


def test_eagle_zeroed_kv_at_d_changes_the_answer(eagle):
    """The negative control: D zeroing what it received must not match P's own answer."""
    for prompt, (tokens, logprobs, n) in eagle["zeroed"].items():
        want_tokens, want_logprobs, _ = eagle["zeroed_baseline"][prompt]
        change = max(abs(a - b) for a, b in zip(logprobs, want_logprobs))
        print(f"zeroed, {n} tokens: tokens {'differ' if tokens != want_tokens else 'equal'}, "
              f"largest logprob change {change:.4f}")
        assert tokens != want_tokens or change > ZEROED_MIN_DIFF, (n, tokens, want_tokens, logprobs)
