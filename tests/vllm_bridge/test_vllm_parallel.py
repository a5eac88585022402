"""Real vLLM engines with tensor and data parallelism, through ``aiolayer proxy``: P with TP=2 feeding a
D with TP=1, P with TP=1 feeding a D with TP=2 (each rank writes exactly its KV heads into each D rank,
and D finishes a request only once every P rank that writes into it reported). P and D with two
data-parallel ranks each: tests/vllm_bridge/test_vllm_prefill_dp.py.

The proxy is given each engine as ``URL,CONTROL`` only: it learns P's and D's parallel sizes from their
ranks' control sockets. Every answer through the proxy must equal the aggregated engine's (the same
prompt on one engine, no transfer) under greedy sampling, and the bytes must have moved (the
connector's counters in vLLM's /metrics), so a D that silently recomputed the prompt cannot pass.

The model: a 4-layer Llama with 4 query heads on 2 KV heads, so TP=2 splits the KV heads (one per
rank). vLLM's defaults (block size 128, prefix caching, chunked prefill) but three: float32 (in
bfloat16 a TP=2 and a TP=1 engine disagree on their own, with no transfer at all: the split
reductions round differently, seen at the 7th token), eager (every rank would compile for ~40 s; the
matrix covers torch.compile), and each TP rank on a core of its own (``VLLM_CPU_OMP_THREADS_BIND=0|1``;
without it TP on CPU is 10-40x slower).
Both engines of a pair are ``kv_both``: one pair of processes serves both directions.
"""

from __future__ import annotations


import pytest

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from aiolayer.harness.pd import ProxyProcess, connector
from aiolayer.harness.procs import free_ports
from aiolayer.harness.servers import VllmServer, completion, running, scrape_metrics, unconfirmed_releases
from aiolayer.harness.tiny_model import LLAMA_GQA, SAMPLE_PROMPTS, long_prompt, tiny_model_dir
from helpers_node import MC_ENV

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]
MAX_TOKENS = 8
PROMPTS = [SAMPLE_PROMPTS[0], SAMPLE_PROMPTS[3], long_prompt(300, seed=5)]   # the last spans three blocks
# control_call 10 s and layout_fetch 30 s (2 s and 5 s by default): three TP ranks' OMP threads and D's
# engine core, spinning while a request is parked (docs/vllm.md), share the 2 cores with the proxy and D's
# aiolayer loops; then the proxy answered a registration POST only after 2 s three times in a row, and
# D's loops answered P's per-transfer layout fetch after 5 s (seen at loads of 10-22; the matrix's
# layout_fetch opt-out has the same cause).
TIMEOUTS = {"receive": 90.0, "fence_grace": 10.0, "control_call": 10.0, "layout_fetch": 30.0}


def _engine(name: str, control_port: int, *, tp: int = 1, dp: int = 1) -> VllmServer:
    args = [*(["--tensor-parallel-size", str(tp)] if tp > 1 else []),
            *(["--data-parallel-size", str(dp)] if dp > 1 else [])]
    ranks = tp * dp
    # every rank of a multi-rank engine on core 0: a parked D's ranks spin (docs/vllm.md), and pinned one per
    # core they left P's prefill, the proxy and D's own aiolayer threads seconds-long waits for a core
    return VllmServer(tiny_model_dir(LLAMA_GQA), name=name, enforce_eager=True, dtype="float32",
                      omp_bind="|".join("0" for _ in range(ranks)) if ranks > 1 else "nobind",
                      kv_transfer_config=connector("kv_both", name, control_port, timeouts=TIMEOUTS),
                      extra_args=args, env=MC_ENV, startup_timeout_s=400)


def _backend(server: VllmServer, control_port: int) -> str:
    """``URL,CONTROL`` only: the proxy learns each engine's TP and DP sizes from its ranks."""
    return f"{server.base_url},tcp://127.0.0.1:{control_port}"


def _moved(p: VllmServer, d: VllmServer) -> tuple[float, float]:
    def total(server, name):
        return sum(v for _, v in scrape_metrics(server).get(name, []))
    return total(p, "vllm:aiolayer_bytes_sent_total"), total(d, "vllm:aiolayer_bytes_received_total")


def _through_proxy(p: VllmServer, p_port: int, d: VllmServer, d_port: int) -> None:
    """Each prompt through a proxy from P to D equals D's and P's own aggregated answer; bytes moved."""
    sent0, got0 = _moved(p, d)
    with ProxyProcess([_backend(p, p_port)], [_backend(d, d_port)],
                      extra_args=("--registration-timeout", "90", "--prefill-timeout", "90")) as proxy:
        for prompt in PROMPTS:
            alone = completion(d, prompt, max_tokens=MAX_TOKENS, timeout_s=120).token_ids
            proxied = completion(proxy.url, prompt, max_tokens=MAX_TOKENS, model=p.served_model,
                                 timeout_s=180).token_ids
            assert proxied == alone, (prompt[:40], proxied, alone, proxy.log_text()[-1500:])
    sent1, got1 = _moved(p, d)
    assert sent1 > sent0 and got1 > got0, (sent0, sent1, got0, got1)
    assert unconfirmed_releases(p) == unconfirmed_releases(d) == 0   # every release on its writers' word


@pytest.fixture(scope="module")
def pair():
    """A TP=1 and a TP=2 engine, both able to send and receive."""
    one_port, two_port = free_ports(1), free_ports(2)
    one, two = _engine("tp1", one_port), _engine("tp2", two_port, tp=2)
    with running(one, two):
        # the two engines agree with each other on their own: the baseline both directions compare with
        for prompt in PROMPTS:
            a = completion(one, prompt, max_tokens=MAX_TOKENS, timeout_s=120).token_ids
            b = completion(two, prompt, max_tokens=MAX_TOKENS, timeout_s=120).token_ids
            assert a == b, ("TP=1 and TP=2 disagree without any transfer", prompt[:40], a, b)
        yield {"tp1": (one, one_port), "tp2": (two, two_port)}


def test_p_tp2_into_d_tp1_equals_the_aggregated_engine(pair):
    (p, p_port), (d, d_port) = pair["tp2"], pair["tp1"]
    _through_proxy(p, p_port, d, d_port)


def test_p_tp1_into_d_tp2_equals_the_aggregated_engine(pair):
    (p, p_port), (d, d_port) = pair["tp1"], pair["tp2"]
    _through_proxy(p, p_port, d, d_port)
