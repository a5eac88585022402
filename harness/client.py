"""The client side of the end-to-end tests: greedy completions (plain, streamed, chat; sync and asyncio)
with a deadline, and /metrics read through ``prometheus_client``'s own text parser."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .vllm_server import VllmServer

DEFAULT_REQUEST_TIMEOUT_S = 60.0
KV_USAGE_GAUGE = "vllm:kv_cache_usage_perc"   # vllm/v1/metrics/loggers.py (0.32), 0..1 fraction


@dataclasses.dataclass
class Completion:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int] | None
    finish_reason: str | None
    kv_transfer_params: dict[str, Any] | None   # always None when streamed (vLLM 0.32 sends none)
    elapsed_s: float
    ttft_s: float | None                         # streaming only: time to the first token chunk
    raw: dict[str, Any] | list[dict[str, Any]]   # the response body, or the list of stream chunks


def completion_body(model: str, prompt: str | list[int] | list[dict], *, max_tokens: int = 8, ignore_eos: bool = True,
                    kv_transfer_params: Mapping[str, Any] | None = None, stream: bool = False,
                    **extra: Any) -> dict[str, Any]:
    """A greedy /v1/completions body (temperature 0, fixed length by default, token ids returned).

    A ``prompt`` that is a list of messages (dicts) makes a /v1/chat/completions body instead.
    """
    body: dict[str, Any] = {
        "model": model, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": ignore_eos, "return_token_ids": True, "stream": stream,
    }
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        body["messages"] = prompt
    else:
        body["prompt"] = prompt
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return body


def _target(server: VllmServer | str, model: str | None) -> tuple[str, str]:
    base = server.base_url if isinstance(server, VllmServer) else server.rstrip("/")
    model = model or (server.served_model if isinstance(server, VllmServer) else None)
    if model is None:
        raise ValueError("model is required when server is a URL")
    return base, model


def _from_body(d: dict[str, Any], elapsed_s: float) -> Completion:
    ch = d["choices"][0]
    text = ch["text"] if "text" in ch else (ch.get("message") or {}).get("content") or ""   # chat: a message
    prompt_ids = ch.get("prompt_token_ids") or d.get("prompt_token_ids")                  # chat: top level
    return Completion(text, list(ch.get("token_ids") or []), prompt_ids,
                      ch.get("finish_reason"), d.get("kv_transfer_params"), elapsed_s, None, d)


class StreamError(Exception):
    """An SSE error event ended a stream whose status line was 200 (``error``: its JSON object)."""

    def __init__(self, error: dict) -> None:
        super().__init__(f"stream ended with an error event: {error}")
        self.error = error
        self.status = error.get("code") if isinstance(error.get("code"), int) else 500


class _StreamAccumulator:
    def __init__(self, t0: float) -> None:
        self.t0, self.chunks, self.text, self.ids = t0, [], [], []
        self.prompt_ids: list[int] | None = None
        self.finish: str | None = None
        self.ttft: float | None = None

    def feed(self, line: str) -> bool:
        """Take one SSE line; False once the stream says [DONE]."""
        if not line.startswith("data:"):
            return True
        payload = line[5:].strip()
        if payload == "[DONE]":
            return False
        d = json.loads(payload)
        if isinstance(d.get("error"), dict) and not d.get("choices"):   # the server ended the stream with an error
            raise StreamError(d["error"])
        self.chunks.append(d)
        if d.get("prompt_token_ids") is not None:   # chat streams carry them at the top level
            self.prompt_ids = d["prompt_token_ids"]
        for ch in d.get("choices") or []:
            if ch.get("prompt_token_ids") is not None:
                self.prompt_ids = ch["prompt_token_ids"]
            if ch.get("token_ids"):
                if self.ttft is None:
                    self.ttft = time.monotonic() - self.t0
                self.ids.extend(ch["token_ids"])
            self.text.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
            self.finish = ch.get("finish_reason") or self.finish
        return True

    def result(self) -> Completion:
        return Completion("".join(self.text), self.ids, self.prompt_ids, self.finish, None,
                          time.monotonic() - self.t0, self.ttft, self.chunks)


def completion(server: VllmServer | str, prompt: str | list[int] | list[dict], *, max_tokens: int = 8,
               kv_transfer_params: Mapping[str, Any] | None = None, stream: bool = False,
               timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, ignore_eos: bool = True, model: str | None = None,
               path: str = "/v1/completions", **extra: Any) -> Completion:
    """Run one greedy completion with a deadline of ``timeout_s`` for the whole exchange.

    ``server`` is a VllmServer or a base URL (e.g. a proxy's; then ``model`` is required). Raises
    httpx.HTTPStatusError (body in the message) for a status >= 400, httpx transport errors, and
    TimeoutError past the deadline. Extra keyword arguments go into the request body.
    """
    base, model = _target(server, model)
    body = completion_body(model, prompt, max_tokens=max_tokens, ignore_eos=ignore_eos,
                           kv_transfer_params=kv_transfer_params, stream=stream, **extra)
    deadline = time.monotonic() + timeout_s
    t0 = time.monotonic()
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=min(5.0, timeout_s)), trust_env=False) as client:
        if not stream:
            r = client.post(base + path, json=body)
            _raise_for_status(r)
            return _from_body(r.json(), time.monotonic() - t0)
        acc = _StreamAccumulator(t0)
        with client.stream("POST", base + path, json=body) as r:
            if r.status_code >= 400:
                r.read()
                _raise_for_status(r)
            for line in r.iter_lines():   # each read is bounded by timeout_s, the total by the deadline
                if time.monotonic() > deadline:
                    raise TimeoutError(f"stream from {base} passed its {timeout_s} s deadline")
                if not acc.feed(line):
                    break
        return acc.result()


async def acompletion(server: VllmServer | str, prompt: str | list[int] | list[dict], *, max_tokens: int = 8,
                      kv_transfer_params: Mapping[str, Any] | None = None, stream: bool = False,
                      timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, ignore_eos: bool = True,
                      model: str | None = None, path: str = "/v1/completions",
                      client: httpx.AsyncClient | None = None, headers: Mapping[str, str] | None = None,
                      **extra: Any) -> Completion:
    """``completion`` for asyncio tests (many requests at once); the deadline is a hard asyncio one.
    ``headers``: sent with the request (a proxy's own, such as the transfer mode it should ask P for)."""
    import asyncio

    base, model = _target(server, model)
    body = completion_body(model, prompt, max_tokens=max_tokens, ignore_eos=ignore_eos,
                           kv_transfer_params=kv_transfer_params, stream=stream, **extra)
    own = client is None
    client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=min(5.0, timeout_s)),
                                         trust_env=False)

    async def run() -> Completion:
        t0 = time.monotonic()
        if not stream:
            r = await client.post(base + path, json=body, headers=headers)
            _raise_for_status(r)
            return _from_body(r.json(), time.monotonic() - t0)
        acc = _StreamAccumulator(t0)
        async with client.stream("POST", base + path, json=body, headers=headers) as r:
            if r.status_code >= 400:
                await r.aread()
                _raise_for_status(r)
            async for line in r.aiter_lines():
                if not acc.feed(line):
                    break
        return acc.result()

    try:
        return await asyncio.wait_for(run(), timeout_s)
    finally:
        if own:
            await client.aclose()


def _raise_for_status(r: httpx.Response) -> None:
    if r.status_code >= 400:
        raise httpx.HTTPStatusError(f"HTTP {r.status_code} from {r.request.url}: {r.text[:2000]}",
                                    request=r.request, response=r)


# -------------------------------------------------------------------- metrics

Metrics = dict[str, list[tuple[dict[str, str], float]]]


def parse_metrics(text: str) -> Metrics:
    """Prometheus text -> sample name (``*_total``, ``*_bucket``... as exposed) -> [(labels, value), ...]."""
    out: Metrics = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def scrape_metrics(server: VllmServer | str, timeout_s: float = 10.0) -> Metrics:
    """GET /metrics and parse the Prometheus text: name -> [(labels, value), ...]."""
    base = server.base_url if isinstance(server, VllmServer) else server.rstrip("/")
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        r = client.get(base + "/metrics")
        _raise_for_status(r)
    return parse_metrics(r.text)


def metric_value(metrics: Mapping[str, list[tuple[dict[str, str], float]]], name: str,
                 **labels: str) -> float | None:
    """The sum of ``name``'s samples whose labels include ``labels`` (None if there are none)."""
    vals = [v for lab, v in metrics.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
    return sum(vals) if vals else None


def kv_cache_usage(server: VllmServer | str) -> float | None:
    """vllm:kv_cache_usage_perc (a 0..1 fraction of KV blocks in use) of the server's engine."""
    return metric_value(scrape_metrics(server), KV_USAGE_GAUGE)


UNCONFIRMED_RELEASES = ("vllm:aiolayer_fences_unconfirmed_total",)


def unconfirmed_releases(server: VllmServer | str) -> float:
    """How often the server's aiolayer freed KV not on its writers' word, all ranks: a D fence that ended
    on ``fence_grace`` with a writer that never confirmed it stopped. (P's ``fence_timeouts`` is no
    release: P keeps holding a source whose writes are unresolved.) Zero: no write can have landed in
    blocks released by aiolayer."""
    metrics = scrape_metrics(server)
    return sum(metric_value(metrics, name) or 0.0 for name in UNCONFIRMED_RELEASES)


def wait_for_metric(server: VllmServer | str, name: str, predicate, timeout_s: float = 10.0,
                    interval_s: float = 0.2, **labels: str) -> float | None:
    """Poll /metrics until ``predicate(value)`` holds for ``name`` (summed over matching labels).

    Returns the value; raises TimeoutError with the last value seen. The gauges are refreshed by
    the engine's stats loop, so a freshly finished request may take a moment to show.
    """
    deadline = time.monotonic() + timeout_s
    value = None
    while True:
        value = metric_value(scrape_metrics(server), name, **labels)
        if value is not None and predicate(value):
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{name}{labels or ''} = {value} did not satisfy the predicate in {timeout_s} s")
        time.sleep(interval_s)
