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

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from aiolayer.harness.pd import connector
from aiolayer.harness.procs import free_ports
from aiolayer.harness.servers import VllmServer, running
from aiolayer.harness.tiny_model import LLAMA_GQA, SAMPLE_PROMPTS, long_prompt, tiny_model_dir
from helpers_node import MC_ENV
from helpers_engines import answer, logged_layout, through_proxy, total
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


def _drafted(server: VllmServer) -> float:
    return total(server, "vllm:spec_decode_num_draft_tokens_total")


@pytest.fixture(scope="module")
def eagle():
    p_port, d_port, a_port = free_ports(1), free_ports(1), free_ports(1)
    p, d = _engine("eagle-p", p_port, "kv_producer"), _engine("eagle-d", d_port, "kv_consumer")
    a = _engine("eagle-a", a_port, "kv_both", env={DEBUG_ZERO_RECEIVED_ENV: "1"})
    with running(p, d, a):
        baseline = {prompt: answer(a, prompt, MAX_TOKENS) for prompt in PROMPTS}
        drafted = _drafted(d)
        answers, moved = through_proxy(p, p_port, d, d_port, PROMPTS, MAX_TOKENS, PROXY_ARGS)
        drafted = _drafted(d) - drafted
        integrity = (total(d, "vllm:aiolayer_integrity_verified_total"),
                     total(d, "vllm:aiolayer_integrity_mismatch_total"))
        zeroed_baseline = {prompt: answer(p, prompt, MAX_TOKENS) for prompt in ZEROED_PROMPTS}   # P on its own
        zeroed, _ = through_proxy(p, p_port, a, a_port, ZEROED_PROMPTS, MAX_TOKENS, PROXY_ARGS)
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
        assert logged_layout(server)[0] == LAYERS, server.log_tail(3000)
    _, block_bytes = logged_layout(eagle["d"])
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
