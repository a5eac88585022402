"""Real vLLM engines serving a hybrid-attention model (a tiny Llama with Gemma-2/3-style layers: a
128-token sliding window on 4 of 6 layers, full attention on the other 2) at vLLM's defaults: the hybrid
KV cache manager on (one full-attention KV cache group, two sliding-window groups, overlaid on the same
tensors), prefix caching and chunked prefill as vLLM sets them, block size 128. float32 (bf16 would blur
the logprob comparison), eager (no ~40 s compile per start).

- P -> D through ``aiolayer proxy`` answers equal the aggregated engine's (the same prompt on one engine,
  no transfer) under greedy sampling, and neither P nor D turned the hybrid manager off.
- Bytes: a sliding-window group sends only the blocks D's group holds (its window at D's first decode
  step), so a long prompt moves far less than full attention would (every block of every layer); the
  exact count follows from vLLM's window rule and is asserted.
- Negative control: the same flow into a D that zeroes whatever KV it received
  (``AIOLAYER_DEBUG_ZERO_RECEIVED=1``) answers differently.

Three engines, started once: P, D, and the aggregated engine, which answers the baseline on its own (a
request without aiolayer parameters moves nothing) and is the zeroing D of the negative control.

A hybrid SSM model (Mamba2 mixers beside attention, as Granite-4.0-H lays them) is refused at start: vLLM
CPU serves it on its own (docs/vllm.md), but its per-request SSM state is not a paged KV cache aiolayer
moves yet, and serving it with the attention KV alone would answer wrongly.
"""

from __future__ import annotations

import math
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from aiolayer.harness.pd import connector
from aiolayer.harness.procs import free_ports
from aiolayer.harness.servers import ServerError, VllmServer, running
from aiolayer.harness.tiny_model import GRANITE_HYBRID, LLAMA_SLIDING, SAMPLE_PROMPTS, long_prompt, tiny_model_dir
from helpers_node import MC_ENV
from helpers_engines import answer, logged_layout, through_proxy, total
from helpers_relay import bridge_logging_config

from aiolayer_vllm.config import DEBUG_ZERO_RECEIVED_ENV

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
MAX_TOKENS = 8
BLOCK = 128                       # vLLM CPU's default block size
WINDOW = LLAMA_SLIDING.sliding_window
LONG = long_prompt(1500, seed=3)  # 1501 tokens: 12 blocks, 2 of them inside the window at D
# 2601 tokens: two chunks at P (vLLM's 2048-token step budget), whose sliding-window groups free the
# blocks outside the window before the last chunk: P still holds every block D's window needs
CHUNKED = long_prompt(2600, seed=5)
PROMPTS = [SAMPLE_PROMPTS[0], LONG, CHUNKED]
TIMEOUTS = {"receive": 90.0, "fence_grace": 10.0, "layout_fetch": 30.0, "control_call": 5.0}
PROXY_ARGS = ("--registration-timeout", "90", "--prefill-timeout", "90")
LOGPROB_TOL = 1e-2                # D decodes over received KV, the aggregated engine over its own prefill
ZEROED_MIN_DIFF = 10 * LOGPROB_TOL
HMA_OFF = "Turning off hybrid kv cache manager"


def test_a_hybrid_ssm_model_is_refused_at_start_naming_its_state_group():
    """First in the file: it runs before the module's three engines start. Eager (no torch.compile) only
    to spare ~40 s of compile: the refusal comes from the KV cache groups vLLM hands the connector."""
    port = free_ports(1)
    srv = VllmServer(tiny_model_dir(GRANITE_HYBRID), name="ssm-p", enforce_eager=True, omp_bind="nobind", env=MC_ENV,
                     kv_transfer_config=connector("kv_producer", "ssm-p", port), startup_timeout_s=500)
    t0 = time.monotonic()
    try:
        with pytest.raises(ServerError):
            srv.start()
        log = srv.log_text()
    finally:
        srv.stop()
    print(f"refused {time.monotonic() - t0:.0f} s into the start")
    assert "vLLM gave 2 groups, one of them MambaSpec" in log and "not supported yet" in log, log[-3000:]
    assert "model.layers.0.mixer" in log, log[-3000:]          # the SSM layers are named
    assert HMA_OFF not in log                                   # vLLM kept its hybrid manager on for it


def _engine(name: str, control_port: int, role: str, env: dict | None = None, **kw) -> VllmServer:
    return VllmServer(tiny_model_dir(LLAMA_SLIDING), name=name, enforce_eager=True, dtype="float32", **kw,
                      omp_bind="nobind",
                      # integrity_sample 1: D checks every layer's bytes against P's CRC32 (host memory)
                      kv_transfer_config=connector(role, name, control_port, timeouts=TIMEOUTS, integrity_sample=1.0),
                      env=MC_ENV | {"VLLM_LOGGING_CONFIG_PATH": bridge_logging_config()} | (env or {}),
                      startup_timeout_s=500)


@pytest.fixture(scope="module")
def hybrid():
    p_port, d_port, a_port = free_ports(1), free_ports(1), free_ports(1)
    p, d = _engine("hyb-p", p_port, "kv_producer"), _engine("hyb-d", d_port, "kv_consumer")
    # no prefix caching on the aggregated engine alone: as the negative control's D it must neither take
    # the prompts' KV from its own baseline runs nor keep the zeroed KV for later ones
    a = _engine("hyb-a", a_port, "kv_both", env={DEBUG_ZERO_RECEIVED_ENV: "1"}, prefix_caching=False)
    with running(p, d, a):
        baseline = {prompt: answer(a, prompt, MAX_TOKENS) for prompt in PROMPTS}
        answers, moved = through_proxy(p, p_port, d, d_port, PROMPTS, MAX_TOKENS, PROXY_ARGS)
        integrity = (total(d, "vllm:aiolayer_integrity_verified_total"),
                     total(d, "vllm:aiolayer_integrity_mismatch_total"))
        zeroed, _ = through_proxy(p, p_port, a, a_port, PROMPTS, MAX_TOKENS, PROXY_ARGS)
        yield {"p": p, "d": d, "a": a, "baseline": baseline, "answers": answers, "moved": moved, "zeroed": zeroed,
               "integrity": integrity}


def test_hybrid_manager_stays_on_and_groups_share_tensors(hybrid):
    for server in (hybrid["p"], hybrid["d"], hybrid["a"]):
        log = server.log_text()
        assert HMA_OFF not in log, (server.name, log[log.index(HMA_OFF) - 200:][:600])
        # 6 model layers in 3 groups of 2 overlaid on 2 tensors: the runtime moves 2 "layers"
        assert logged_layout(server)[0] == 2, server.log_tail(3000)


def test_hybrid_p_to_d_equals_the_aggregated_engine(hybrid):
    verified, mismatched = hybrid["integrity"]   # D checked the landed bytes of every layer against P's
    assert verified >= len(PROMPTS) and mismatched == 0, hybrid["integrity"]
    for prompt, (tokens, logprobs, n) in hybrid["answers"].items():
        want_tokens, want_logprobs, _ = hybrid["baseline"][prompt]
        print(f"{n} tokens: largest logprob change vs aggregated "
              f"{max(abs(a - b) for a, b in zip(logprobs, want_logprobs)):.5f}")
        assert tokens == want_tokens, (n, tokens, want_tokens)
        assert all(math.isclose(a, b, abs_tol=LOGPROB_TOL) for a, b in zip(logprobs, want_logprobs)), \
            (n, logprobs, want_logprobs)


def _expected_blocks(n: int) -> tuple[int, int]:
    """(blocks moved per tensor, blocks a full-attention model would move per layer) for an n-token
    prompt: D's sliding-window groups hold the blocks of tokens from n - WINDOW + 1 on (vLLM's
    ``get_num_skipped_tokens`` at n computed tokens), its full-attention group all of them."""
    blocks = math.ceil(n / BLOCK)
    in_window = blocks - max(0, n - WINDOW + 1) // BLOCK
    return blocks + 2 * in_window, blocks


def test_sliding_window_groups_send_only_what_d_holds(hybrid):
    tensors, block_bytes = logged_layout(hybrid["d"])
    for prompt, (sent, got) in hybrid["moved"].items():
        n = hybrid["answers"][prompt][2]
        moved, blocks = _expected_blocks(n)
        full = LLAMA_SLIDING.num_layers * blocks * block_bytes   # every block of every layer
        print(f"{n} tokens: sent {sent:.0f} bytes, full attention would send {full} ({sent / full:.2f})")
        assert sent == got == tensors * moved * block_bytes, (n, sent, got, tensors, moved, block_bytes)
        if n > WINDOW + BLOCK:
            assert sent < full, (n, sent, full)
    assert hybrid["answers"][LONG][2] == 1501 and _expected_blocks(1501) == (12 + 2 * 2, 12)   # not 3 * 12
    assert hybrid["answers"][CHUNKED][2] == 2601 and _expected_blocks(2601) == (21 + 2 * 2, 21)


def test_hybrid_zeroed_kv_at_d_changes_the_answer(hybrid):
    """The negative control: D zeroing what it received must not match the aggregated answer."""
    for prompt, (tokens, logprobs, n) in hybrid["zeroed"].items():
        want_tokens, want_logprobs, _ = hybrid["baseline"][prompt]
        change = max(abs(a - b) for a, b in zip(logprobs, want_logprobs))
        print(f"zeroed, {n} tokens: tokens {'differ' if tokens != want_tokens else 'equal'}, "
              f"largest logprob change {change:.4f}")
        assert tokens != want_tokens or change > ZEROED_MIN_DIFF, (n, tokens, want_tokens, logprobs)
