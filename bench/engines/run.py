"""``aiolayer bench vllm``: the time to first token of real requests on vLLM CPU engines, each
system through its own request flow, side by side in one run.

Rows (``--rows``): ``aggregated`` (one engine, the floor), ``aiolayer`` (layer-wise, the proxy's default
binding: P and D sent at once, P's destination bound late, where the engines can), ``aiolayer-d-first``
(layer-wise, D registers before P is sent the request: ``aiolayer proxy --binding d-first``) and
``aiolayer-bulk`` (the same connector sending after the last layer) through ``aiolayer proxy``,
``aiolayer-auto`` (the mode chosen per request from earlier sends' measurements; not in the default
``--rows``), and
vLLM's own connectors where they run here (``peers.py``). P and D sit on disjoint cores (P on
``--cores``' first, D on its second), every process of an engine on its core as on a host of
its own (``--pin``); the aggregated engine on the first.
Every answer is checked against the aggregated engine's under greedy sampling: a row's requests that
differ or fail are counted, never dropped. aiolayer's rows also check the bytes of every layer of every
transfer (P's digest against what landed at D, ``integrity_sample`` 1.0): an answer that drifts from the
aggregated one while every byte verified is numerics (bf16 is not batch-invariant on vLLM CPU), counted
as such and not a failure; a byte mismatch, or a drift in a row whose bytes were not all verified, is.
Each P/D row's concurrency-1 requests alternate with requests straight to its own P (no D, no transfer):
the host's compute speed drifts over seconds, so a row is also measured against its P at that moment.
Writes ``engines.json`` and ``engines.png`` under ``--out``. ``--link-gbit``: the same rows with P and D
on two network namespaces over a rate-limited link, swept over rates and prompt lengths (``link.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

from aiolayer.harness.client import acompletion, metric_value, scrape_metrics
from aiolayer.harness.node import mooncake_env
from aiolayer.harness.pd import ProxyProcess, connector
from aiolayer.harness.procs import free_port, free_ports
from aiolayer.harness.startup import running
from aiolayer.harness.tiny_model import TinySpec, long_prompt, tiny_model_dir

from ..provenance import write_result
from . import peers
from .options import engine
from .place import of_args
from .summary import bad_rows, print_table, summarize

REQUEST_TIMEOUT_S = 300.0   # a 2,000-token prefill takes seconds on one loaded core; a burst queues 8


def model_spec(args: argparse.Namespace) -> TinySpec:
    """A Llama sized so the KV matters and the compute does not drown it on one core: ``--kv-heads`` KV
    heads of 64 (as many query heads), bf16 by vLLM's default (at 2 heads 8 KiB per token over 16
    layers, ~16 MB for a 2,000-token prompt: ``kv_bytes_per_token``)."""
    longest = max([args.prompt_tokens, *prompt_lengths(args)])
    return TinySpec(num_layers=args.layers, hidden_size=128, intermediate_size=256, num_heads=args.kv_heads,
                    num_kv_heads=args.kv_heads, max_position_embeddings=max(4096, 2 * longest))


def kv_bytes_per_token(spec: TinySpec, dtype: str = "auto") -> int:
    """K and V of every layer, in bytes: bf16 (vLLM's default dtype on CPU) unless ``dtype`` is float32."""
    return spec.num_layers * spec.num_kv_heads * spec.head_dim * 2 * (4 if dtype == "float32" else 2)


def prompt_lengths(args: argparse.Namespace) -> list[int]:
    text = getattr(args, "prompt_lengths", "") or ""
    return [int(x) for x in text.split(",") if x.strip()]


def prompts(args: argparse.Namespace) -> dict[str, list[str]]:
    """Distinct prompts for each phase (a repeated prompt would hit the prefix cache of one row and
    not of another); one word is about one token of the tiny model's vocabulary."""
    words = args.prompt_tokens
    return {"warmup": [long_prompt(words, seed=900)],
            "serial": [long_prompt(words, seed=s) for s in range(args.prompts)],
            "burst": [long_prompt(words, seed=100 + s) for s in range(args.concurrency)],
            # P/D rows: a request straight to P after each concurrency-1 one (``_measure_paired``)
            "alone": [long_prompt(words, seed=10_000 + s) for s in range(args.prompts)],
            # its warm-up: a prompt of its own (the row's warm-up one would be a prefix-cache hit at P)
            "alone_warmup": [long_prompt(words, seed=9_999)]}


def via_url(url: str, model: Path, headers: dict[str, str] | None = None):
    """The completion call of a system that takes the request on one URL (an engine, a proxy)."""
    async def complete(text: str, max_tokens: int):
        return await acompletion(url, text, model=str(model), max_tokens=max_tokens, stream=True,
                                 timeout_s=REQUEST_TIMEOUT_S, headers=headers)
    return complete


@contextlib.contextmanager
def aggregated(model: Path, args: argparse.Namespace):
    p_core = args.cores.split(",")[0]
    with running(engine(model, "aggregated", p_core, args)) as (srv,):
        yield via_url(srv.base_url, model), {"engine": "one vLLM engine"}


def _proxy_debug() -> tuple[str, ...]:
    """AIOLAYER_LOG_LEVEL=DEBUG (the engines' per-transfer timeline) gives the proxy's timeline too."""
    return ("--log-level", "debug") if os.environ.get("AIOLAYER_LOG_LEVEL", "").upper() == "DEBUG" else ()


@contextlib.contextmanager
def aiolayer_pd(model: Path, args: argparse.Namespace, *, mode: str = "layerwise", binding: str = "auto"):
    from aiolayer_vllm.proxy.admit import MODE_HEADER   # the bridge: installed with vLLM (`make bench-vllm`)

    p_core, d_core = args.cores.split(",")[:2]
    where = of_args(args)
    extra: dict = {"transfer_mode": mode}
    p_ctl, d_ctl = free_port(), free_ports(2)   # D's next port free: the proxy's auto binding sees one DP rank
    env = mooncake_env()

    def config(role: str, engine_id: str, port: int, side, **more) -> dict:
        transport = {"transport": {"bind_host": side.address}} if where.two_hosts else {}
        return connector(role, engine_id, port, **transport, **extra, **more)

    sample = getattr(args, "integrity_sample", 1.0)   # P sends a digest of every layer it wrote (at 1.0)
    p = where.p.engine(model, "prefill", p_core, args, env=env,
                       kv_transfer_config=config("kv_producer", "p", p_ctl, where.p, integrity_sample=sample))
    d = where.d.engine(model, "decode", d_core, args, env=env,
                       kv_transfer_config=config("kv_consumer", "d", d_ctl, where.d))
    with running(p, d):
        backends = ([f"http://{where.p.address}:{p.port},tcp://{where.p.address}:{p_ctl}"],
                    [f"http://{where.d.address}:{d.port},tcp://{where.d.address}:{d_ctl}"])
        proxy_args: tuple[str, ...] = ("--request-timeout", str(REQUEST_TIMEOUT_S), *_proxy_debug(),
                                       "--binding", binding)
        if mode == "auto":   # auto's third way: D prefills a short prompt itself where that measured faster
            proxy_args += ("--local-prefill-max-tokens", str(LOCAL_PREFILL_MAX_TOKENS))
        place_proxy: dict = {}
        if where.two_hosts:   # beside P; D and P reach it over the hosts' link, this process over A's management one
            port = free_port()
            place_proxy = {"netns": where.p.netns, "reach": where.p.reach, "port": port}
            proxy_args += ("--host", "0.0.0.0", "--public-url", f"http://{where.p.address}:{port}")
        with ProxyProcess(*backends, extra_args=proxy_args, startup_timeout_s=60, **place_proxy) as proxy:
            flow = "D first" if binding == "d-first" else \
                "the proxy's default: P and D at once, P's destination bound late where both engines can"
            how = {"flow": f"{flow}, through aiolayer proxy (a process)", "connector": "AiolayerConnector",
                   "transfer_mode": mode, "transport": f"Mooncake TCP, {where.label}",
                   **({"local_prefill_max_tokens": LOCAL_PREFILL_MAX_TOKENS} if mode == "auto" else {}),
                   "byte_check": f"integrity_sample {sample:g} (1: every layer of every transfer, P's digest against "
                                 "what landed at D)"}
            # read (and popped) by the link sweep per cell: how P sent, and what D prefilled itself
            how["_p_modes"] = lambda: {**settled(p, SEND_MODES, 3.0), "local": local_prefills(proxy.url)}
            # requests that name their mode (the proxy's header): the link sweep's mode rows on one pair of engines
            how["_complete_as"] = lambda asked: via_url(proxy.url, model, {MODE_HEADER: asked} if asked else None)
            how["_p_alone"] = via_url(p.base_url, model)   # P answering by itself: no D, no transfer
            yield via_url(proxy.url, model), how
            how["bytes"] = byte_checks(d)
            proxy_metrics = scrape_metrics(proxy.url)   # how P learned D's blocks, per request
            how["bindings"] = {b: metric_value(proxy_metrics, "aiolayer_proxy_bindings_total", binding=b) or 0
                               for b in ("late", "d_first")}
            how["sends_by_mode"] = settled(p, SEND_MODES, 3.0)


INTEGRITY = {"verified": "vllm:aiolayer_integrity_verified_total",     # transfers D checked, bytes equal
             "mismatch": "vllm:aiolayer_integrity_mismatch_total",
             "receives_finished": "vllm:aiolayer_receives_finished_total",
             "receives_failed": "vllm:aiolayer_receives_failed_total"}


LOCAL_PREFILL_MAX_TOKENS = 512   # the auto row's proxy: --local-prefill-max-tokens


def local_prefills(proxy_url: str) -> float:
    """Requests the proxy had D prefill itself (no P, no transfer)."""
    return metric_value(scrape_metrics(proxy_url), "aiolayer_proxy_routes_total", route="local") or 0.0


SEND_MODES = {"layerwise": "vllm:aiolayer_sends_layerwise_total", "bulk": "vllm:aiolayer_sends_bulk_total"}


def byte_checks(d, settle_s: float = 10.0) -> dict[str, float]:
    """D's integrity counters once they stop moving."""
    return settled(d, INTEGRITY, settle_s)


def settled(server, names: dict[str, str], settle_s: float) -> dict[str, float]:
    """An engine's counters (key -> metric) once they stop moving (vLLM exports a worker's counters after
    a step, so the last transfer's can come a moment after its answer)."""
    deadline, last = time.monotonic() + settle_s, None
    while True:
        m = scrape_metrics(server)
        now = {k: metric_value(m, name) or 0.0 for k, name in names.items()}
        if now == last or time.monotonic() > deadline:
            return now
        last = now
        time.sleep(1.0)


def take_hooks(how: dict) -> dict:
    """A system's callables (keys from "_": ``_p_alone`` for every P/D row, ``_p_modes`` and
    ``_complete_as`` for the link sweep), taken out of ``how``, which goes into the JSON."""
    return {key: how.pop(key) for key in [k for k in how if k.startswith("_")]}


SYSTEMS = {
    "aggregated": aggregated,
    "aiolayer": lambda model, args: aiolayer_pd(model, args),
    "aiolayer-bulk": lambda model, args: aiolayer_pd(model, args, mode="bulk"),
    "aiolayer-auto": lambda model, args: aiolayer_pd(model, args, mode="auto"),
    "aiolayer-d-first": lambda model, args: aiolayer_pd(model, args, binding="d-first"),
    **peers.SYSTEMS,
}


async def _measure(complete, texts: list[str], concurrent: bool, max_tokens: int) -> list[dict]:
    async def one(text: str) -> dict:
        try:
            out = await complete(text, max_tokens)
            return {"ttft_ms": out.ttft_s * 1e3 if out.ttft_s else None, "total_ms": out.elapsed_s * 1e3,
                    "tokens": out.token_ids}
        except Exception as exc:   # noqa: BLE001 - counted in the row as a failure, with its reason
            return {"error": f"{type(exc).__name__}: {exc}"[:300]}

    if concurrent:
        return list(await asyncio.gather(*(one(t) for t in texts)))
    return [await one(t) for t in texts]


async def _measure_paired(complete, alone, texts: list[str], alone_texts: list[str],
                          max_tokens: int) -> tuple[list[dict], list[dict]]:
    """Each concurrency-1 request of the row followed by one of another prompt straight to its P (one
    token: P's prefill alone). This host's compute speed drifts by up to ~2x over seconds (one fixed
    bf16 loop: docs/results.md), far more than a transfer costs, so a row is also compared with its own
    P at the same moment (``over_p_alone_ms_median``), not only with rows measured minutes apart."""
    serial, solo = [], []
    for text, other in zip(texts, alone_texts):
        serial += await _measure(complete, [text], False, max_tokens)
        solo += await _measure(alone, [other], False, 1)
    return serial, solo


def _progress(name: str, phase: str, results: list[dict]) -> None:
    ttft = sorted(r["ttft_ms"] for r in results if r.get("ttft_ms") is not None)
    failed = sum(1 for r in results if "error" in r)
    p50 = f"TTFT p50 {statistics.median(ttft):.0f} ms" if ttft else "no TTFT"
    print(f"  {name}: {phase}: {p50}, {len(results) - failed}/{len(results)} answered", file=sys.stderr, flush=True)


def run_row(name: str, model: Path, args: argparse.Namespace, texts: dict[str, list[str]]) -> dict:
    t0 = time.monotonic()
    try:
        with SYSTEMS[name](model, args) as (complete, how):
            alone = take_hooks(how).get("_p_alone")   # the link sweep's others: a loopback row needs none
            print(f"  {name}: engines up in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
            asyncio.run(_measure(complete, texts["warmup"], False, args.max_tokens))
            solo: list[dict] = []
            if alone is None:
                serial = asyncio.run(_measure(complete, texts["serial"], False, args.max_tokens))
            else:
                asyncio.run(_measure(alone, texts["alone_warmup"], False, 1))
                serial, solo = asyncio.run(_measure_paired(complete, alone, texts["serial"], texts["alone"],
                                                           args.max_tokens))
                _progress(f"{name} (its P alone)", "concurrency 1", solo)
            _progress(name, "concurrency 1", serial)
            burst = asyncio.run(_measure(complete, texts["burst"], True, args.max_tokens))
            _progress(name, f"burst of {len(burst)}", burst)
    except Exception as exc:   # noqa: BLE001 - a row that cannot run is reported as such, the others still run
        return {"row": name, "ran": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    return {"row": name, "ran": True, "how": how, "serial": serial, "burst": burst, "p_alone": solo,
            "wall_s": round(time.monotonic() - t0, 1)}


def row_names(args: argparse.Namespace) -> list[str] | None:
    """``--rows`` in the order they run (the aggregated reference first); None (said why) if one is unknown."""
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        print(f"aiolayer bench vllm: unknown --rows {unknown}; choose from {', '.join(SYSTEMS)}", file=sys.stderr)
        return None
    if "aggregated" in names:   # the reference runs first: every other row is checked against it
        names.remove("aggregated")
        names.insert(0, "aggregated")
    return names


def run_engines(args: argparse.Namespace, together=None) -> int:
    """One run on loopback (``link.run_vllm`` sends ``--link-gbit`` runs to ``link.run_link``), its rows one
    after another, or all at once through ``together`` (``together.run_rows``, which ``link.run_vllm`` hands in)."""
    names = row_names(args)
    if names is None:
        return 2
    if args.prompt_lengths:
        print("aiolayer bench vllm: --prompt-lengths goes with --link-gbit", file=sys.stderr)
        return 2
    model = tiny_model_dir(model_spec(args))
    texts = prompts(args)
    if together is not None:
        rows = together(names, model, args, texts)
    else:
        rows = []
        for i, name in enumerate(names):
            print(f"[{i + 1}/{len(names)}] {name}", file=sys.stderr, flush=True)
            rows.append(run_row(name, model, args, texts))
    summary = summarize(rows)
    print_table(summary)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool)) and k != "out"}
    write_result(out / "engines.json", {"config": config, "summary": summary, "rows": rows}, indent=1)
    from .plot import plot_engines
    plot_engines(summary, out / "engines.png")
    print(f"wrote {out / 'engines.json'} and {out / 'engines.png'}")
    bad = bad_rows(summary)
    if bad:
        print(f"aiolayer bench vllm: rows with failed requests, byte mismatches or unexplained drift: {bad}",
              file=sys.stderr)
    return 1 if bad else 0
