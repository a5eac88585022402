"""A prefill engine with two data-parallel ranks (one ``--data-parallel-size 2`` server), through ``aiolayer proxy``.

Each worker of P runs its own aiolayer runtime (DP rank d binds CONTROL + d); the proxy names P's CONTROL
(rank 0's) to D, and vLLM's own load balancer picks the rank that prefills and, on D1, the rank that
decodes (the D rank holding the request registers it; the P rank that runs it writes there, and D fences
against that writer). Three engines, started once: P (DP=2), D1 (DP=2) and D2 (DP=1; only for the stall
case).

- Tokens through the proxy equal the aggregated engine's (D1 alone, no transfer) under greedy sampling, for
  prompts of one to a dozen blocks sent at once, and KV left from both P ranks and reached both D1 ranks
  (per-engine ``vllm:aiolayer_bytes_sent_total`` / ``_received_total``): every rank's runtime moved KV.
- A transfer stalled on one P rank: D2 is stopped (SIGSTOP, the whole server) once the first MiB of a long
  prompt's KV from P's rank 1 reached it (the request pinned to that rank with vLLM's
  ``X-data-parallel-rank`` header by a relay between the proxy and P). Meanwhile requests keep
  flowing to D1 through both P ranks, and a decode stream pinned to each rank gives that rank's step times
  (vLLM's inter-token latency, per engine) before and during the stall: neither rank may stall beyond a
  bound relative to its normal steps, well under P's write deadline. The stalled request ends in an error
  to its client within the proxy's deadline, P's rank 1 counts the send failed, and once D2 resumes, D2 and
  P hold no KV and D2 serves again.

vLLM's defaults (block size 128, prefix caching, chunked prefill with a 2,048-token budget) but float32
(token equality with an engine of another shape) and eager (each DP rank would compile for ~40 s).
A Mixture-of-Experts P, whose DP ranks would step in lockstep, does not run on vLLM CPU 0.32
(docs/vllm.md): these ranks are independent engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time

import httpx
import pytest

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from aiolayer.harness.pd import ProxyProcess, connector
from aiolayer.harness.procs import free_port, free_ports
from aiolayer.harness.servers import (VllmServer, acompletion, completion, kv_cache_usage, metric_value, running,
                         scrape_metrics, unconfirmed_releases)
from aiolayer.harness.tiny_model import LLAMA_GQA, SAMPLE_PROMPTS, long_prompt, tiny_model_dir
from helpers_node import MC_ENV
from helpers_relay import Freezer, Relay, bytes_received, worker_ports

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
MAX_TOKENS = 8
RANKS = ("0", "1")
# P: a short write deadline, so that a rank waiting on a stalled write would show a step of that length, and
# short waits after it: for P to stop waiting on the timed-out write (to a stopped D it stays pending in
# Mooncake until D resumes: docs/mooncake.md), then to tell D.
P_TIMEOUTS = {"layer_write": 4.0, "quarantine": 8.0, "control_call": 5.0, "done_delivery": 5.0, "layout_fetch": 20.0}
D1_TIMEOUTS = {"receive": 90.0, "control_call": 5.0}
D2_TIMEOUTS = {"receive": 15.0, "fence_grace": 8.0, "control_call": 5.0}
STALLED_REQUEST_S = 10.0       # proxy B's deadline for D's answer: when the stalled request's client hears
STALLED_PROMPT = long_prompt(7000, seed=77)   # 4 chunks: P sends its KV in the last one, layer by layer
HEALTHY = [long_prompt(120 + 90 * i, seed=60 + i) for i in range(6)]
ITL = "vllm:inter_token_latency_seconds"      # per engine, from the engine core's own timestamp of each step


def _engine(name: str, port: int, role: str, timeouts: dict, bind: str, dp: int = 1) -> VllmServer:
    return VllmServer(tiny_model_dir(LLAMA_GQA), name=name, dtype="float32", enforce_eager=True, omp_bind=bind,
                      kv_transfer_config=connector(role, name, port, timeouts=timeouts),
                      extra_args=["--data-parallel-size", str(dp)] if dp > 1 else [], env=MC_ENV,
                      startup_timeout_s=400)


def _proxy(p_url: str, p_port: int, d: VllmServer, d_port: int, request_s: float = 120.0) -> ProxyProcess:
    return ProxyProcess([f"{p_url},tcp://127.0.0.1:{p_port}"], [f"{d.base_url},tcp://127.0.0.1:{d_port}"],
                        healthy=(200, 503), extra_args=(
                            "--health-interval", "1", "--registration-timeout", "60", "--prefill-timeout", "60",
                            "--request-timeout", str(request_s)))


@pytest.fixture(scope="module")
def cluster():
    p_port, d1_port, d2_port = free_ports(2), free_ports(2), free_port()
    # P's ranks on core 0, the D engines on core 1 (one OpenMP thread each). Measured here: with P's ranks on a
    # core each ('0|1') and both busy, P's API server answered /health after 3-14 s and held streamed tokens
    # back 5-19 s (the ranks' own steps stayed short), so the proxies took P for dead; on one core, 10 ms.
    p = _engine("p-dp2", p_port, "kv_producer", P_TIMEOUTS, "0|0", dp=2)
    d1 = _engine("d1", d1_port, "kv_consumer", D1_TIMEOUTS, "1|1", dp=2)
    d2 = _engine("d2", d2_port, "kv_consumer", D2_TIMEOUTS, "1")
    t0 = time.monotonic()
    with running(p, d1, d2), Relay(p.base_url, rank=1) as relay, \
            _proxy(p.base_url, p_port, d1, d1_port) as proxy_a, \
            _proxy(relay.url, p_port, d2, d2_port, request_s=STALLED_REQUEST_S) as proxy_b, Freezer(d2) as freezer:
        print(f"\nstarted in {time.monotonic() - t0:.0f} s: P (DP=2) {p.startup_s:.0f} s, "
              f"D1 (DP=2) {d1.startup_s:.0f} s, D2 {d2.startup_s:.0f} s")
        yield {"p": p, "d1": d1, "d2": d2, "a": proxy_a, "b": proxy_b, "relay": relay, "freezer": freezer,
               "d2_data": worker_ports(d2, but={d2_port})}


def _per_rank(server: VllmServer, name: str) -> dict[str, float]:
    m = scrape_metrics(server)
    return {r: metric_value(m, name, engine=r) or 0.0 for r in RANKS}


def _sample(server: VllmServer, name: str, engine: str) -> float:
    """One engine's sample of ``name``, found by a regex: a full parse of P's /metrics holds the test's GIL
    for tens of ms, which the relay's threads (proxy B's 1 s health probes of P) share."""
    text = httpx.get(server.url("/metrics"), timeout=10, trust_env=False).text
    found = re.search(rf'^{re.escape(name)}{{[^}}]*engine="{engine}"[^}}]*}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _until(predicate, seconds: float) -> None:
    end = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < end, f"not within {seconds} s"
        time.sleep(0.1)


def _alone(d: VllmServer, prompts: list[str]) -> list[list[int]]:
    return [completion(d, x, max_tokens=MAX_TOKENS, timeout_s=120).token_ids for x in prompts]


async def _through(proxy: ProxyProcess, model: str, prompts: list[str]) -> list[list[int]]:
    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        outs = await asyncio.gather(*(acompletion(proxy.url, x, max_tokens=MAX_TOKENS, model=model, client=client,
                                                  stream=bool(i % 2), timeout_s=120) for i, x in enumerate(prompts)))
    return [o.token_ids for o in outs]


def test_prefill_with_two_dp_ranks_equals_the_aggregated_engine_and_both_ranks_send(cluster):
    p, d1, proxy = cluster["p"], cluster["d1"], cluster["a"]
    # 1 block, 1 block, 3, 6 and 12 blocks of 128 tokens, each twice (the second hits P's and D's caches)
    prompts = [SAMPLE_PROMPTS[0], SAMPLE_PROMPTS[3], *(long_prompt(n, seed=40 + n) for n in (300, 700, 1500))]
    alone = _alone(d1, prompts)
    sent0 = _per_rank(p, "vllm:aiolayer_bytes_sent_total")
    received0 = _per_rank(d1, "vllm:aiolayer_bytes_received_total")
    t0 = time.monotonic()
    proxied = asyncio.run(_through(proxy, p.served_model, prompts * 2))
    took = time.monotonic() - t0
    assert proxied == alone * 2, proxy.log_text()[-2000:]
    sent: dict[str, float] = {}
    received: dict[str, float] = {}

    def every_rank_moved() -> bool:   # an engine's last step stats reach /metrics after D's answer
        sent.update(_per_rank(p, "vllm:aiolayer_bytes_sent_total"))
        received.update(_per_rank(d1, "vllm:aiolayer_bytes_received_total"))
        return all(sent[r] > sent0[r] and received[r] > received0[r] for r in RANKS)

    with contextlib.suppress(AssertionError):
        _until(every_rank_moved, 10)
    print(f"\n{len(prompts) * 2} requests P -> D1 in {took:.1f} s; bytes sent per P rank "
          f"{ {r: sent[r] - sent0[r] for r in RANKS} }, received per D1 rank "
          f"{ {r: received[r] - received0[r] for r in RANKS} }, prompt tokens per P rank "
          f"{_per_rank(p, 'vllm:prompt_tokens_total')}")
    assert every_rank_moved(), ("both P ranks should have written KV into D1, both D1 ranks received",
                                sent0, sent, received0, received)
    assert _per_rank(p, "vllm:aiolayer_sends_failed_total") == {r: 0.0 for r in RANKS}
    assert unconfirmed_releases(p) == unconfirmed_releases(d1) == 0


# ------------------------------------------------------------------ a transfer stalled on one P rank

async def _probe(p: VllmServer, rank: str, stop: asyncio.Event) -> None:
    """Decode on one P rank (vLLM's ``X-data-parallel-rank``) until ``stop``: one token per step of that
    rank, which vLLM's inter-token latency times. Leaving the stream aborts the request."""
    body = {"model": p.served_model, "prompt": SAMPLE_PROMPTS[1], "max_tokens": 8000, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        async with client.stream("POST", p.url("/v1/completions"), json=body,
                                 headers={"X-data-parallel-rank": rank}) as r:
            assert r.status_code == 200
            async for _ in r.aiter_lines():
                if stop.is_set():
                    return


async def _healthy(c: dict, expected: dict[str, list[int]], stop: asyncio.Event, took: list[tuple]) -> None:
    """Requests through proxy A (P -> D1), two at a time, until ``stop``; each must equal the aggregated
    answer. Each one's (start, seconds) go into ``took``."""
    async def one(x: str, client: httpx.AsyncClient) -> None:
        t0 = time.monotonic()
        out = await acompletion(c["a"].url, x, max_tokens=MAX_TOKENS, model=c["p"].served_model, client=client,
                                timeout_s=120)
        took.append((t0, time.monotonic() - t0))
        assert out.token_ids == expected[x], c["a"].log_text()[-2000:]

    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        while not stop.is_set():
            await asyncio.gather(*(one(HEALTHY[(len(took) + i) % len(HEALTHY)], client) for i in range(2)))


def _itl(p: VllmServer) -> dict[str, dict[float, float]]:
    """Per P rank: the inter-token latency histogram, bucket bound -> cumulative count."""
    out: dict[str, dict[float, float]] = {r: {} for r in RANKS}
    for labels, value in scrape_metrics(p).get(ITL + "_bucket", []):
        if labels.get("engine") in out:
            out[labels["engine"]][float(labels["le"])] = value
    return out


def _longest(steps: dict[float, float]) -> float:
    """The bound of the bucket that the window's longest step fell in (0: no step)."""
    total = steps.get(float("inf"), 0.0)
    return next((le for le, n in steps.items() if n == total), 0.0) if total else 0.0


def _summary(steps: dict[float, float]) -> str:
    return f"{steps.get(float('inf'), 0):.0f} steps, the longest <= {_longest(steps):g} s"


def _latencies(took: list[tuple], since: float | None = None) -> str:
    """How the requests P -> D1 of a window went; with ``since``, when the slow ones (> 2 s) started after it."""
    slow = "" if since is None else ", over 2 s: " + (
        ", ".join(f"{d:.1f} s from +{t - since:.1f} s" for t, d in sorted(took) if d > 2) or "none")
    return f"{len(took)} requests P -> D1, the slowest {max((d for _, d in took), default=0):.1f} s{slow}"


async def _window(c: dict, expected: dict, until) -> tuple[dict[str, dict[float, float]], list[tuple], float]:
    """Probes on both P ranks and requests P -> D1 until ``until()`` (polled): (each rank's steps as an
    inter-token latency histogram, the requests' (start, seconds), the window's seconds)."""
    stop = asyncio.Event()
    t0 = time.monotonic()
    before = await asyncio.to_thread(_itl, c["p"])
    tasks = [asyncio.ensure_future(_probe(c["p"], r, stop)) for r in RANKS]
    took: list[tuple] = []
    healthy = asyncio.ensure_future(_healthy(c, expected, stop, took))
    try:
        while not await asyncio.to_thread(until):
            if healthy.done() or any(t.done() for t in tasks):
                break                                   # one failed: its exception is raised below
            await asyncio.sleep(0.25)
    finally:
        stop.set()
    after = await asyncio.to_thread(_itl, c["p"])
    await asyncio.gather(*tasks, healthy)
    steps = {r: {le: n - before[r].get(le, 0.0) for le, n in sorted(after[r].items())} for r in RANKS}
    return steps, took, time.monotonic() - t0


def _stop_d2_when_p_writes(c: dict, frozen: dict) -> None:
    """Run by the relay as P's rank 1 is handed the request: stop D2 whole once P's KV is arriving.

    P sends a request's KV in the step of its last chunk, layer by layer as the forward computes them, each
    layer's write submitted as the layer is done (7 MiB here): stopping D2 once its first MiB arrived leaves
    the rest of the layers to be written into a stopped process."""
    ports = c["d2_data"]
    start, deadline = bytes_received(ports), time.monotonic() + 60
    while time.monotonic() < deadline:
        if bytes_received(ports) - start > 2**20:
            c["freezer"].stop()
            frozen["at"] = time.monotonic()
            return
        time.sleep(0.001)


def _send(c: dict, prompt: str, result: dict) -> None:
    """One request through proxy B (P's rank 1 -> D2); its status, tokens and seconds into ``result``."""
    t0 = time.monotonic()
    try:
        out = completion(c["b"].url, prompt, max_tokens=MAX_TOKENS, model=c["p"].served_model, timeout_s=120)
        result["status"], result["tokens"] = 200, out.token_ids
    except httpx.HTTPStatusError as exc:
        result["status"], result["body"] = exc.response.status_code, exc.response.text[:200]
    except Exception as exc:  # noqa: BLE001 - reported by the assertion on it
        result["status"] = repr(exc)
    result["took"] = time.monotonic() - t0


def _b_healthy(c: dict) -> bool:
    """Proxy B sees P (through the relay) and D2 healthy: its 1 s health probes miss a busy P at times."""
    return httpx.get(c["b"].url + "/health", timeout=5, trust_env=False).status_code == 200


def _send_when_healthy(c: dict, prompt: str, seconds: float = 30) -> dict:
    """``_send``, again while proxy B answers 503 (no healthy backend), for up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        result: dict = {}
        _send(c, prompt, result)
        if result["status"] != 503 or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


def _prefill_alone(p: VllmServer, prompt: str, rank: str) -> float:
    """Seconds P's rank takes to prefill ``prompt`` with no transfer (one token, as the proxy asks)."""
    t0 = time.monotonic()
    r = httpx.post(p.url("/v1/completions"), headers={"X-data-parallel-rank": rank}, timeout=120, trust_env=False,
                   json={"model": p.served_model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0})
    assert r.status_code == 200, r.text[:300]
    return time.monotonic() - t0


def _stall(c: dict) -> tuple[dict, dict, threading.Thread, float]:
    """The stalled request: D2 registers, P's rank 1 prefills, D2 is stopped as the KV arrives. Returns
    (when D2 stopped, the client's outcome once it has one, the client's thread, P's prefill seconds)."""
    frozen: dict[str, float] = {}
    stalled: dict = {}
    relay = c["relay"]
    relay.armed = lambda: _stop_d2_when_p_writes(c, frozen)
    answered = len(relay.answered)
    sender = threading.Thread(target=_send, args=(c, STALLED_PROMPT, stalled), daemon=True)
    sender.start()
    with contextlib.suppress(AssertionError):   # P answers as its last chunk's step ends; its writes go on
        _until(lambda: len(relay.answered) > answered and "at" in frozen, 60)
    assert "at" in frozen, ("P's rank 1 never wrote into D2", c["b"].log_text()[-2000:])
    assert len(relay.answered) > answered, "P's rank 1 never answered the stalled request's prefill"
    frozen["into"] = frozen["at"] - relay.answered[-1][0]
    return frozen, stalled, sender, relay.answered[-1][1] - relay.answered[-1][0]


def _report(p: VllmServer, windows: dict, frozen: dict, prefill: tuple[float, float], stalled: dict) -> None:
    print()
    for name, (steps, took, seconds) in windows.items():
        since = frozen["at"] if name == "during the stall, from P's answer" else None
        print(f"{name} ({seconds:.1f} s, {_latencies(took, since)}), P's steps (vLLM's inter-token latency):")
        for r in RANKS:
            print(f"  P rank {r}: {_summary(steps[r])}")
    why = [line for line in p.log_text().splitlines() if "WARNING aiolayer" in line][-2:]
    print(f"the stalled request's prefill on P rank 1: {prefill[0]:.2f} s (alone, no transfer: {prefill[1]:.2f} s); "
          f"D2 stopped {frozen['into']:.2f} s into it; P rank 1 counted the send failed "
          f"{frozen.get('failed', float('nan')) - frozen['at']:.1f} s after:\n  " + "\n  ".join(why))
    print(f"the stalled request's client: {stalled}")


def test_a_transfer_stalled_on_one_p_rank_stalls_neither_rank_and_fails_visibly(cluster):
    c = cluster
    p, d1, d2 = c["p"], c["d1"], c["d2"]
    expected = dict(zip(HEALTHY, _alone(d1, HEALTHY)))
    normal_prefill = _prefill_alone(p, long_prompt(7000, seed=78), "1")
    failed0 = _per_rank(p, "vllm:aiolayer_sends_failed_total")
    end = time.monotonic() + 6   # normal steps: the same probes and traffic, nothing stalled
    before = asyncio.run(_window(c, expected, lambda: time.monotonic() > end))

    # P's rank 1 -> D2 once, so that P's Mooncake has D2's segment open (the first write into a D opens it with
    # a handshake; a D stopped during that one is another case, docs/mooncake.md), then the stalled request
    warm = _send_when_healthy(c, SAMPLE_PROMPTS[2])
    assert warm["status"] == 200 and warm["tokens"] == _alone(d1, [SAMPLE_PROMPTS[2]])[0], warm
    _until(lambda: (metric_value(scrape_metrics(p), "vllm:num_requests_running") or 0) == 0, 20)  # probes gone
    _until(lambda: _b_healthy(c), 30)
    frozen, stalled, sender, stalled_prefill = _stall(c)
    finished0 = _per_rank(p, "vllm:aiolayer_sends_finished_total")

    def rank1_gave_up() -> bool:
        # P's rank 1 counts the send failed once its writes are quiet or it stopped waiting for them
        if "failed" not in frozen and _sample(p, "vllm:aiolayer_sends_failed_total", "1") > failed0["1"]:
            frozen["failed"] = time.monotonic()
        return ("failed" in frozen and not sender.is_alive()) or time.monotonic() > frozen["at"] + 60

    during = asyncio.run(_window(c, expected, rank1_gave_up))
    sender.join(timeout=STALLED_REQUEST_S + 30)
    failed = _per_rank(p, "vllm:aiolayer_sends_failed_total")
    finished = _per_rank(p, "vllm:aiolayer_sends_finished_total")
    _report(p, {"before": before, "during the stall, from P's answer": during}, frozen,
            (stalled_prefill, normal_prefill), stalled)
    assert failed["1"] == failed0["1"] + 1 and failed["0"] == failed0["0"], (failed0, failed)
    assert all(finished[r] > finished0[r] for r in RANKS), ("both P ranks should have served D1", finished0, finished)
    # a rank that waited on D2 would show P's layer_write (4 s) or a control deadline in one step
    assert stalled_prefill < 3 * normal_prefill + 1.0, (stalled_prefill, normal_prefill)
    for r in RANKS:
        bound = min(max(3 * _longest(before[0][r]), 1.0), 2.5)
        assert during[0][r][float("inf")] > 10 and _longest(during[0][r]) <= bound, \
            f"P rank {r} stalled: {_summary(during[0][r])} (before: {_summary(before[0][r])})"
    assert not sender.is_alive(), "the stalled request's client still waits"
    assert stalled["status"] in (502, 504) and stalled["took"] < 2 * STALLED_REQUEST_S, stalled

    # D2 resumes: its receive deadline passed, it fences the transfer and frees the request's KV, P holds no
    # source blocks of it, and D2 serves again
    c["freezer"].resume()
    t0 = time.monotonic()
    _until(lambda: (kv_cache_usage(d2) or 0) == 0 and (kv_cache_usage(p) or 0) == 0, D2_TIMEOUTS["fence_grace"] + 30)
    print(f"after D2 resumed: D2 and P hold no KV after {time.monotonic() - t0:.1f} s")
    again = _send_when_healthy(c, SAMPLE_PROMPTS[5])   # 503 until proxy B's health check sees D2 again
    assert again["status"] == 200 and again["tokens"] == _alone(d1, [SAMPLE_PROMPTS[5]])[0], again
    assert "aiolayer_proxy_pending_transfers 0" in c["b"].metrics()
    # every release on the writer's word: P's rank 1 saw its timed-out writes end before it reported, D2's
    # fence heard P's rank 1 say it stopped (not the grace alone), so nothing could land in freed blocks
    assert {s.name: unconfirmed_releases(s) for s in (p, d1, d2)} == {s.name: 0.0 for s in (p, d1, d2)}
