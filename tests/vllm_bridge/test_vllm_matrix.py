"""The real-vLLM matrix: P->D hand-offs under vLLM's own defaults and the features around them.

Two engine configurations, each a P and a D (vLLM CPU with AiolayerConnector), ``aiolayer proxy``
in front, and every case run directly (the D-first flow played by the test) and through the proxy:

- ``llama-gqa``: vLLM's defaults (bfloat16, block size 128, prefix caching, chunked prefill,
  torch.compile) but a 512-token step budget, a 4-layer Llama with 4 heads on 2 KV heads, and a D
  with blocks of 32 tokens (P's blocks bigger than D's: P writes each of its blocks into four of D's;
  of 128 where vLLM's bf16 kernel keeps blocks in a layout not copied token by token: ``BF16_BLOCKS_MAP``);
- ``qwen2-bias``: float32, block size 32 at P and 64 at D (D's blocks bigger), a 128-token budget,
  eager, a 4-layer Qwen2 (q/k/v bias, 8 heads on 2 KV heads), a D with a 20-block KV cache, so that D
  must preempt, and ngram speculative decoding on both (D speculates over the KV P wrote).

Cases: requests sharing a prefix of several blocks, so that D (and P) hit their prefix caches; prompts
several times the step's token budget (chunked prefill); prompts of 1, 2, bs-1, bs, bs+1, 2bs tokens;
more concurrent requests than D's cache holds (preemption at D); 20 concurrent mixed
chat/completions, streaming and not, through the proxy. Each request's tokens must equal the
aggregated engine's (the same engine without a transfer) under greedy sampling, and each case must
end well inside the connector's ``receive`` deadline: a request that waited for it fails the case.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import tempfile
import time

import httpx
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from aiolayer.harness.pd import DirectFlow, ProxyProcess, backend, connector
from aiolayer.harness.servers import (VllmServer, acompletion, completion, free_port, metric_value, parse_metrics,
                         running, scrape_metrics)
from aiolayer.harness.tiny_model import (LLAMA_GQA, QWEN2_BIAS, SAMPLE_PROMPTS, TinySpec, long_prompt,
                            tiny_model_dir, tokenizer_dir, vocabulary)
from helpers_node import MC_ENV

from aiolayer.config import Timeouts
from aiolayer_vllm.layout import TOKEN_MINOR_K_KERNELS
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

# Blocks of other sizes copy token by token only under a CPU kernel whose layout the connector publishes
# (layout.TOKEN_MINOR_K_KERNELS); under another (bf16 on a host with AMX runs "amx", docs/vllm.md) they
# are refused, so llama-gqa's D keeps P's (vLLM's default) block size; qwen2-bias (float32) covers the mapping.
BF16_BLOCKS_MAP = _get_attn_isa(torch.bfloat16, 32, LLAMA_GQA.head_dim) in TOKEN_MINOR_K_KERNELS
LLAMA_D_BLOCK = 32 if BF16_BLOCKS_MAP else 128

# Fixture set-up (two engines, one with torch.compile) counts against the first test of each group.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

RECEIVE_S = Timeouts().receive            # D's wait for P's KV (the connector's default, 120 s)
REQUEST_LIMIT_S = 0.375 * RECEIVE_S      # 45 s: a request that waited for the deadline fails its client first
CASE_LIMIT_S = 0.75 * RECEIVE_S          # 90 s: each case's wall time, all its requests together
MAX_TOKENS = 12
TIMES: dict[str, float] = {}             # case -> wall time, written next to the logs at the end


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    spec: TinySpec
    block_size: int                 # what P runs with (128 is vLLM CPU's default)
    d_block_size: int               # what D runs with: another size than P's, so the cases cover the mapping
    budget: int                     # max_num_batched_tokens in effect (2048 is vLLM CPU's default)
    both: dict                      # VllmServer settings for P and D (opt-outs only, each with a reason)
    d_only: dict = dataclasses.field(default_factory=dict)
    p_only: dict = dataclasses.field(default_factory=dict)
    preempts: bool = False          # D's cache is small enough for the preemption case
    speculates: bool = False        # ngram speculative decoding at P and D (SPECULATIVE)
    # float32: a batch's tokens equal the aggregated engine's one by one. bf16 on vLLM CPU is not
    # batch-invariant (its amx kernel drifted a few tokens in): P then checks every layer's bytes at D,
    # and a batch's answer may drift only where every transfer's bytes verified (numerics, not a transfer)
    batch_exact: bool = True


# Both: the kernel places the threads. vLLM's default OMP binding pins every server's worker to
# core 0, and two busy engines on one core starve each other's sockets for seconds on a 2-core box.
NOBIND = {"omp_bind": "nobind", "env": MC_ENV}
# ngram drafts need no model of their own and no draft KV: what P writes is all D needs. A random-weight
# model rarely repeats a 2-gram, so a draft follows any earlier occurrence of the last token (min 1).
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
CONFIGS = {
    # vLLM's defaults, torch.compile included (~40 s more per engine start), but for the step's token
    # budget (2048 by default): CPU attention over prompts several times 2048 tokens takes over 30 s
    # per request on 2 busy cores; several times 512 takes a few seconds.
    "llama-gqa": EngineConfig(LLAMA_GQA, block_size=128, d_block_size=LLAMA_D_BLOCK, budget=512, batch_exact=False,
                              both={**NOBIND, "max_num_batched_tokens": 512}, d_only={"block_size": LLAMA_D_BLOCK}),
    "qwen2-bias": EngineConfig(
        QWEN2_BIAS, block_size=32, d_block_size=64, budget=128, preempts=True, speculates=True,
        both={**NOBIND, "dtype": "float32",
              "enforce_eager": True,          # the other configuration covers compile; this saves ~80 s
              "max_model_len": 512,           # vLLM refuses a KV cache smaller than one max-length request
              "max_num_batched_tokens": 128,  # chunked prefill with prompts of a few hundred tokens
              "extra_args": ("--speculative-config", json.dumps(SPECULATIVE))},
        p_only={"block_size": 32},
        # 19 usable blocks of 64 tokens (one is vLLM's null block): six 350-token requests need 36.
        d_only={"block_size": 64, "num_gpu_blocks": 20}),
}


@dataclasses.dataclass
class Cluster:
    name: str
    config: EngineConfig
    p: VllmServer
    d: VllmServer
    proxy: ProxyProcess
    direct: DirectFlow

    @property
    def bs(self) -> int:
        """P's block size (the prompts' sizes are in P's blocks)."""
        return self.config.block_size

    @property
    def d_bs(self) -> int:
        """D's block size: its registrations count D's blocks."""
        return self.config.d_block_size

    def send(self, route: str, prompt, *, max_tokens: int = MAX_TOKENS, stream: bool = False):
        """(D's completion, D's registration or None) for one disaggregated request."""
        if route == "direct":
            h = self.direct.run(prompt, max_tokens=max_tokens, stream=stream)
            return h.decode, h.registration
        return completion(self.proxy.url, prompt, max_tokens=max_tokens, stream=stream, model=self.p.served_model,
                          timeout_s=REQUEST_LIMIT_S), None

    @contextlib.contextmanager
    def case(self, name: str):
        """Bound the case's wall time and check that no transfer failed meanwhile.

        A transfer that passes its deadline (D's receive, P's layer write or gap) fails: the failure
        counters catch it. Deadline expiries alone are recorded, not asserted: under load a 2 s control
        call can time out and succeed on its retry, which is neither a failure nor a long wait.
        """
        before = self._faults()
        expiries = self._expiries()
        t0 = time.monotonic()
        yield
        took = time.monotonic() - t0
        TIMES[f"{self.name}:{name}"] = {"wall_s": round(took, 2), "deadline_expiries": self._expiries() - expiries}
        assert took < CASE_LIMIT_S, f"{name} took {took:.1f} s (limit {CASE_LIMIT_S:.0f} s): a request waited"
        assert self._faults() == before, (before, self._faults())

    def _faults(self) -> dict:
        out = {}
        for role, server in (("p", self.p), ("d", self.d)):
            m = scrape_metrics(server)
            for name in ("sends_failed", "receives_failed"):
                out[f"{role}:{name}"] = metric_value(m, f"vllm:aiolayer_{name}_total") or 0.0
        return out

    def _expiries(self) -> float:
        return sum(metric_value(scrape_metrics(s), "vllm:aiolayer_deadline_expiries_total") or 0.0
                   for s in (self.p, self.d))


def _start(name: str, tmp_path_factory) -> tuple:
    cfg = CONFIGS[name]
    model = tiny_model_dir(cfg.spec)
    logs = tmp_path_factory.mktemp(f"matrix-{name}")
    p_port, d_port = free_port(), free_port()
    # tokenizer: transformers would give the Qwen2 model its own tokenizer class, not the one saved.
    common = {"log_dir": logs, "startup_timeout_s": 480.0, "tokenizer": tokenizer_dir(model), **cfg.both}
    # Opt-out, measured in CI: with four engines on 2 cores, 17 requests parked at D make its engine core
    # spin and starve its aiolayer loop (docs/vllm.md, "A parked D's CPU"), and P's per-transfer layout
    # fetch passed the 5 s default once. A longer fetch deadline keeps the case about tokens; the receive
    # deadline is unchanged.
    # P at info: it logs how many layers hand their KV over as vLLM writes it (aiolayer_vllm.kv_written)
    p_common = {**common, "env": {**common.get("env", {}), "AIOLAYER_LOG_LEVEL": "INFO"}}
    checks = {} if cfg.batch_exact else {"integrity_sample": 1.0}
    p = VllmServer(model, name=f"{name}-p", kv_transfer_config=connector(
        "kv_producer", "p", p_port, timeouts={"layout_fetch": 30.0}, **checks), **p_common, **cfg.p_only)
    d = VllmServer(model, name=f"{name}-d", kv_transfer_config=connector("kv_consumer", "d", d_port),
                   **common, **cfg.d_only)
    return p, d, p_port, d_port, logs


@pytest.fixture(scope="module", params=list(CONFIGS))
def pd(request, tmp_path_factory):
    name = request.param
    p, d, p_port, d_port, logs = _start(name, tmp_path_factory)
    with running(p, d):
        # Deadlines below the connector's receive deadline: a stuck request is an error, not a wait.
        proxy = ProxyProcess([backend(p, p_port)], [backend(d, d_port)], extra_args=(
            "--health-interval", "1", "--registration-timeout", "30", "--prefill-timeout", "40",
            "--request-timeout", str(REQUEST_LIMIT_S)))
        with proxy, DirectFlow(p, p_port, d, d_port, timeout_s=REQUEST_LIMIT_S) as direct:
            print(f"\n{name}: P started in {p.startup_s:.0f} s, D in {d.startup_s:.0f} s; logs in {logs}")
            yield Cluster(name, CONFIGS[name], p, d, proxy, direct)
    path = os.path.join(tempfile.gettempdir(), "aiolayer-matrix-times.json")
    with open(path, "w") as f:
        json.dump(TIMES, f, indent=1)


def tokens(n: int, seed: int) -> list[int]:
    """A prompt of exactly ``n`` token ids: BOS, then in-vocabulary words."""
    index = {w: i for i, w in enumerate(vocabulary())}
    return [index["<s>"], *(index[w] for w in long_prompt(n - 1, seed=seed).split())] if n > 1 else [index["king"]]


def words(n: int, seed: int) -> list[int]:
    return tokens(n + 1, seed)[1:]


def aggregated(server: VllmServer, prompt, max_tokens: int = MAX_TOKENS, **kw) -> list[int]:
    """The same engine without a transfer: the baseline a disaggregated request must reproduce."""
    return completion(server, prompt, max_tokens=max_tokens, timeout_s=REQUEST_LIMIT_S, **kw).token_ids


def _hits(server: VllmServer) -> float:
    return metric_value(scrape_metrics(server), "vllm:prefix_cache_hits_total") or 0.0


def _hits_since(server: VllmServer, before: float, want: float, within_s: float = 10.0) -> float:
    """Prefix-cache hits counted since ``before``, once they reach ``want`` or ``within_s`` passed.

    vLLM's frontend records a step's stats after it queued the step's outputs, and the proxy relays
    D's answer without waiting for P's: a scrape right after the answer can precede P's last record.
    """
    end = time.monotonic() + within_s
    while (got := _hits(server) - before) < want and time.monotonic() < end:
        time.sleep(0.1)
    return got


ROUTES = ["direct", "proxy"]


def test_p_hands_each_layer_over_as_vllm_writes_its_kv(pd):
    """vLLM's KV update op, wrapped on every layer (compiled and eager): each layer's write to D starts
    before the layer's attention runs; the other tests check that every answer still equals the
    aggregated engine's."""
    layers = pd.config.spec.num_layers
    assert f"{layers} of {layers} layers hand their KV over as it is written" in pd.p.log_text(), \
        pd.p.log_text()[-3000:]


@pytest.mark.parametrize("route", ROUTES)
def test_shared_prefixes_hit_the_prefix_cache_on_d_and_p(pd, route):
    bs, seed = pd.bs, 100 if route == "direct" else 200
    with pd.case(f"prefix-{route}"):
        # P warm, D cold then warm: three requests sharing 3 full blocks, one after the other.
        prefix = tokens(3 * bs + 5, seed)
        prompts = [prefix + words(7 + i, seed + 1 + i) for i in range(3)]
        baselines = [aggregated(pd.p, x) for x in prompts]          # P computes (and caches) them
        d0, p0 = _hits(pd.d), _hits(pd.p)
        for i, (x, base) in enumerate(zip(prompts, baselines)):
            out, reg = pd.send(route, x, stream=bool(i % 2))
            assert out.token_ids == base, (i, out.token_ids, base)
            if reg is not None:
                # D's cached blocks stay: those of its blocks the shared prefix fills
                assert reg.first_block == (0 if i == 0 else len(prefix) // pd.d_bs), (i, reg.first_block)
                assert len(reg.block_ids) == -(-len(x) // pd.d_bs) - reg.first_block
        d_hits = 2 * (len(prefix) // pd.d_bs) * pd.d_bs          # D's full blocks of the prefix, twice
        assert _hits_since(pd.d, d0, d_hits) >= d_hits, "D did not find the shared prefix in its cache"
        assert _hits_since(pd.p, p0, 3 * 3 * bs) >= 3 * 3 * bs, "P did not find the prompts in its cache"
        # D warm, P cold: D computed the prefix itself (its baseline), P never saw it.
        prefix = tokens(3 * bs + 9, seed + 50)
        prompts = [prefix + words(5 + i, seed + 51 + i) for i in range(3)]
        baselines = [aggregated(pd.d, x) for x in prompts]
        d0 = _hits(pd.d)
        for i, (x, base) in enumerate(zip(prompts[1:], baselines[1:])):
            out, reg = pd.send(route, x, stream=bool(i % 2))
            assert out.token_ids == base, (i, out.token_ids, base)
            if reg is not None:
                assert reg.first_block == len(prefix) // pd.d_bs, reg.first_block
        d_hits = 2 * (len(prefix) // pd.d_bs) * pd.d_bs
        assert _hits_since(pd.d, d0, d_hits) >= d_hits


@pytest.mark.parametrize("route", ROUTES)
def test_prompts_several_times_the_token_budget_are_chunked(pd, route):
    n = int(2.6 * pd.config.budget)                                  # 3 chunks at least, at P and at D
    seed = 300 if route == "direct" else 400
    with pd.case(f"chunked-{route}"):
        for i, x in enumerate([tokens(n, seed), tokens(n + pd.bs // 2 + 3, seed + 1)]):
            assert len(x) > 2 * pd.config.budget
            out, reg = pd.send(route, x, stream=bool(i % 2))
            assert out.token_ids == aggregated(pd.p, x), i
            if reg is not None:
                assert len(reg.block_ids) == -(-len(x) // pd.d_bs) - reg.first_block


@pytest.mark.parametrize("route", ROUTES)
def test_one_token_prompt(pd, route):
    """vLLM recomputes the last prompt token, so after the load a 1-token request is back at 0 computed."""
    x = tokens(1, 0)
    with pd.case(f"one-token-{route}"):
        out, _ = pd.send(route, x)
        assert out.token_ids == aggregated(pd.p, x)


@pytest.mark.parametrize("route", ROUTES)
def test_prompts_at_block_boundaries(pd, route):
    bs, seed = pd.bs, 500 if route == "direct" else 600
    with pd.case(f"boundaries-{route}"):
        for i, n in enumerate((2, bs - 1, bs, bs + 1, 2 * bs)):
            x = tokens(n, seed + i)
            out, reg = pd.send(route, x, stream=bool(i % 2))
            assert out.token_ids == aggregated(pd.p, x), (n, out.token_ids)
            if reg is not None:
                assert len(reg.block_ids) == -(-n // pd.d_bs) - reg.first_block, (n, reg)


PREEMPTING = [name for name, cfg in CONFIGS.items() if cfg.preempts]


@pytest.mark.parametrize("pd", PREEMPTING, indirect=True)
@pytest.mark.parametrize("route", ROUTES)
def test_more_requests_than_ds_cache_holds_preempt_at_d(pd, route):
    """Six 150-token prompts decoding 200 tokens each need 36 blocks of 64 tokens of D's 19: D must
    preempt. (With 100 tokens, a request could end before the last one arrived, and D then held them all.)"""
    seed = 700 if route == "direct" else 800
    prompts = [tokens(150, seed + i) for i in range(6)]
    baselines = [aggregated(pd.p, x, max_tokens=200) for x in prompts]
    preempted = metric_value(scrape_metrics(pd.d), "vllm:num_preemptions_total") or 0.0
    with pd.case(f"preemption-{route}"):
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda ix: pd.send(route, ix[1], max_tokens=200, stream=bool(ix[0] % 2))[0],
                                 enumerate(prompts)))
    for i, (out, base) in enumerate(zip(outs, baselines)):
        assert out.token_ids == base, i
    assert (metric_value(scrape_metrics(pd.d), "vllm:num_preemptions_total") or 0.0) > preempted, \
        "D never preempted: the case did not test what it says"


SPECULATING = [name for name, cfg in CONFIGS.items() if cfg.speculates]


def _spec_counts(server: VllmServer) -> tuple[float, float]:
    m = scrape_metrics(server)
    return (metric_value(m, "vllm:spec_decode_num_draft_tokens_total") or 0.0,
            metric_value(m, "vllm:spec_decode_num_accepted_tokens_total") or 0.0)


@pytest.mark.parametrize("pd", SPECULATING, indirect=True)
@pytest.mark.parametrize("route", ROUTES)
def test_ngram_speculation_at_d_decodes_over_the_kv_p_wrote(pd, route):
    """D drafts from n-grams of the prompt P prefilled and verifies the drafts over P's KV: the tokens
    equal the aggregated engine's (which speculates the same way), and D did propose drafts."""
    seed = 1000 if route == "direct" else 1100
    prompts = [(lambda x: x + x[1:40])(tokens(120, seed + i)) for i in range(3)]   # each repeats its start
    baselines = [aggregated(pd.p, x, max_tokens=32) for x in prompts]
    drafted, accepted = _spec_counts(pd.d)
    with pd.case(f"ngram-{route}"):
        for i, (x, base) in enumerate(zip(prompts, baselines)):
            out, _ = pd.send(route, x, max_tokens=32, stream=bool(i % 2))
            assert out.token_ids == base, (i, out.token_ids, base)
    now = _spec_counts(pd.d)
    TIMES[f"{pd.name}:ngram-{route}:drafted,accepted"] = [now[0] - drafted, now[1] - accepted]
    assert now[0] > drafted, "D proposed no draft: the case did not test speculative decoding"


def test_twenty_concurrent_mixed_chat_and_completions_through_the_proxy(pd):
    shared = " ".join(long_prompt(2 * pd.bs, seed=900).split()[: 2 * pd.bs])
    texts = [*SAMPLE_PROMPTS, *(long_prompt(20 + 11 * i, seed=910 + i) for i in range(4)),
             *(f"{shared} {long_prompt(3 + i, seed=920 + i)}" for i in range(4))]
    jobs = []
    for i in range(20):
        text = texts[i % len(texts)]
        chat = i % 4 >= 2
        jobs.append((text if not chat else [{"role": "user", "content": text}],
                     "/v1/chat/completions" if chat else "/v1/completions", bool(i % 2)))
    baseline = {i: aggregated(pd.p, prompt, path=path) for i, (prompt, path, _) in enumerate(jobs)}
    ok_before, verified_before = _proxy_ok(pd.proxy), _verified(pd.d)

    async def burst():
        async with httpx.AsyncClient(timeout=REQUEST_LIMIT_S, trust_env=False) as client:
            return await asyncio.gather(*(
                acompletion(pd.proxy.url, prompt, max_tokens=MAX_TOKENS, stream=stream, path=path,
                            model=pd.p.served_model, client=client, timeout_s=REQUEST_LIMIT_S)
                for prompt, path, stream in jobs))

    with pd.case("concurrent-mixed-proxy"):
        outs = asyncio.run(burst())
    drifted = [(i, jobs[i][1:], out.token_ids, baseline[i]) for i, out in enumerate(outs)
               if out.token_ids != baseline[i]]
    TIMES[f"{pd.name}:concurrent-mixed-proxy:drifted"] = len(drifted)
    if pd.config.batch_exact or drifted and _verified_since(pd.d, verified_before, len(jobs)) < len(jobs):
        assert not drifted, drifted
    assert _proxy_ok(pd.proxy) - ok_before == len(jobs)
    assert "aiolayer_proxy_pending_transfers 0" in pd.proxy.metrics()


def _verified(d: VllmServer) -> float:
    """D's transfers whose every checked byte equalled P's (a mismatch fails the transfer: the case's
    failure counters catch it)."""
    return metric_value(scrape_metrics(d), "vllm:aiolayer_integrity_verified_total") or 0.0


def _verified_since(d: VllmServer, before: float, want: float, within_s: float = 10.0) -> float:
    """Transfers D verified since ``before``, once ``want`` or ``within_s`` passed (D's worker reports
    its counters with a later step, as ``_hits_since`` says of vLLM's)."""
    end = time.monotonic() + within_s
    while (got := _verified(d) - before) < want and time.monotonic() < end:
        time.sleep(0.1)
    return got


def _proxy_ok(proxy: ProxyProcess) -> int:
    return int(metric_value(parse_metrics(proxy.metrics()), "aiolayer_proxy_requests_total", outcome="ok") or 0)
