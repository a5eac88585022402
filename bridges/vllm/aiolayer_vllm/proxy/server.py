"""``aiolayer proxy``: parse the backends, learn their engines' topology, build the app, serve it with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from urllib.parse import urlsplit

from aiolayer import ControlPeers, Timeouts
from aiolayer.config import MAX_DEADLINE_S
from aiolayer.cli import Command
from aiolayer.transport import url_host

from . import logs
from ..params import check_url
from .flow import BINDINGS, ProxyTimeouts
from .pool import Backend, Pool
from .topology import learn_pool
from .tracing import Tracing, TracingUnavailable


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
WILDCARDS = ("0.0.0.0", "::", "")


def add_proxy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL,CONTROL[,tp=N]",
                   help="P servers: http://host:port of vLLM, tcp://host:port of its aiolayer control socket "
                        "(its control_port: the first rank's). The proxy asks every rank for its topology; "
                        "tp=N is only checked against what P says (a mismatch is refused at start)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL,CONTROL[,tp=N]",
                   help="D servers, same form (D's control_port must be fixed: the proxy asks it too)")
    p.add_argument("--control-wait-s", type=float, default=60.0,
                   help="seconds at start for every backend's control sockets to answer the topology query; "
                        "the proxy exits if one does not, or answers wrongly")
    p.add_argument("--control-timeout", type=float, default=Pool.control_timeout_s,
                   help="seconds for one rank to answer a topology query (at start and at each health check)")
    p.add_argument("--host", default="127.0.0.1", help="address the proxy listens on")
    p.add_argument("--port", type=int, default=8000, help="port the proxy listens on")
    p.add_argument("--public-url", default="",
                   help="how D reaches this proxy to register a transfer; empty: http://HOST:PORT "
                        "(required when HOST is a wildcard such as 0.0.0.0)")
    p.add_argument("--registration-timeout", type=float, default=ProxyTimeouts.registration_s,
                   help="seconds for D to queue the request, allocate its blocks and register the transfer")
    p.add_argument("--prefill-timeout", type=float, default=ProxyTimeouts.prefill_s,
                   help="seconds for P's prefill call (one token)")
    p.add_argument("--request-timeout", type=float, default=ProxyTimeouts.request_s,
                   help="seconds for D's whole generation")
    p.add_argument("--binding", choices=BINDINGS, default="auto",
                   help="late: P and D at once, each P transfer asks D for its blocks (a waiting lookup), so P's "
                        "prefill never waits for D's registration (D of one data-parallel rank only; others go "
                        "D-first); d-first: D registers (POSTs its blocks to the proxy), then P is sent the request; "
                        "auto: late where both engines' ranks said they can (P's KV cache is one group without a "
                        "sliding window, D has one data-parallel rank), else d-first")
    p.add_argument("--d-first", dest="binding", action="store_const", const="d-first",
                   help="the same as --binding d-first")
    p.add_argument("--local-prefill-max-tokens", type=int, default=0,
                   help="let D prefill a streamed prompt of up to this many tokens itself, with no P and no "
                        "transfer, where the first tokens the proxy measured each way say that is faster "
                        "(0, the default: never; docs/proxy.md)")
    p.add_argument("--health-interval", type=float, default=2.0,
                   help="seconds between health checks of each server (HTTP /health and its ranks' topology)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                   help="the proxy's log level (info: its start-up line and one line per failed request; "
                        "uvicorn's own lines and access log show at debug)")
    p.add_argument("--log-format", default="text", choices=logs.FORMATS,
                   help="text lines, or one JSON object per line (time, level, logger, message, and for a "
                        "request's lines request_id, stage, status, error_type)")
    p.add_argument("--otlp-traces-endpoint", default="",
                   help="send OpenTelemetry spans there (vLLM's flag and protocol variable: "
                        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL grpc or http/protobuf); needs aiolayer-vllm[otel]")


def public_url(host: str, port: int, given: str) -> str:
    """The URL D POSTs its registration to; a wildcard listen address is no address D can dial."""
    if given:
        check_url(given, "--public-url")
        if urlsplit(given).hostname in WILDCARDS:
            raise ValueError(f"--public-url {given} names every interface, which D cannot dial: give an address "
                             "D can reach")
        return given.rstrip("/")
    if host in WILDCARDS:
        raise ValueError(f"--host {host or repr(host)} listens on every interface, which D cannot dial: "
                         "give --public-url http://ADDRESS:PORT (an address D can reach)")
    return f"http://{url_host(host)}:{port}"


SECONDS_FLAGS = ("control_wait_s", "control_timeout", "registration_timeout", "prefill_timeout", "request_timeout",
                 "health_interval")


def check_args(args: argparse.Namespace) -> None:
    """Refuse (ValueError) what would only fail later: a port out of range (the OS would bind it modulo
    65536), a deadline or interval that is not a positive number of seconds (0 spins the health loop)."""
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    for name in SECONDS_FLAGS:
        value = getattr(args, name)
        if not 0 < value <= MAX_DEADLINE_S:   # NaN fails too
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be > 0 and at most {MAX_DEADLINE_S:g} seconds, got {value}")
    if args.local_prefill_max_tokens < 0:
        raise ValueError("--local-prefill-max-tokens must be >= 0")


def check_distinct(pool: Pool) -> None:
    """Refuse a backend listed twice in one role, and a URL and a control socket that do not pair up the same
    way everywhere (a typo in one port: prefills would go to one engine and its KV be asked of another).
    One engine may be both P and D (``kv_both``) under the same URL,CONTROL."""
    paired: dict[str, str] = {}
    for role in (pool.prefill, pool.decode):
        urls = [b.url for b in role]
        if len(set(urls)) < len(urls):
            raise ValueError(f"--{role[0].role} lists a server twice: {sorted({u for u in urls if urls.count(u) > 1})}")
        for b in role:
            for key, value in ((b.url, b.control), (b.control, b.url)):
                if paired.setdefault(key, value) != value:
                    raise ValueError(f"{key} is given with both {paired[key]} and {value}: each server has one "
                                     "URL and one control socket")


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app

    try:
        pool = Pool([Backend.parse("prefill", s) for s in args.prefill],
                    [Backend.parse("decode", s) for s in args.decode], health_interval_s=args.health_interval,
                    control_timeout_s=args.control_timeout)
        url = public_url(args.host, args.port, args.public_url)
        check_args(args)
        check_distinct(pool)
    except ValueError as exc:
        print(f"aiolayer proxy: {exc}", file=sys.stderr)
        return 2
    logs.configure(args.log_level, args.log_format)   # after the checks: a refused start changed no logger
    logger = logging.getLogger("aiolayer_vllm.proxy")
    problems = asyncio.run(_learn(pool, args.control_wait_s))
    if problems:
        print("aiolayer proxy: refused to start:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    timeouts = ProxyTimeouts(registration_s=args.registration_timeout, prefill_s=args.prefill_timeout,
                             request_s=args.request_timeout)
    try:
        tracing = Tracing(args.otlp_traces_endpoint)
    except TracingUnavailable as exc:
        print(f"aiolayer proxy: {exc}", file=sys.stderr)
        return 2
    app = create_app(pool, url, timeouts, tracing, args.binding, args.local_prefill_max_tokens)
    logger.info("aiolayer proxy listening on http://%s:%d (D registers at %s), model %s; %s", url_host(args.host),
                args.port, url, pool.model, "; ".join(_described(b) for b in pool.all))
    # log_config=None: uvicorn keeps the handler set above (its own config would replace it)
    uvicorn.run(app, host=args.host, port=args.port, log_config=None, log_level=logs.uvicorn_level(args.log_level),
                access_log=args.log_level == "debug", timeout_graceful_shutdown=5)
    return 0


def _described(b: Backend) -> str:
    learned = b.topology   # every backend's: learn_pool found no problem
    engine = f"engine {learned.engine_id}, tp {learned.tp}, dp {learned.dp}" if learned else "not learned"
    return f"{b.role} {b.url} (control {b.control}, {engine})"


async def _learn(pool: Pool, wait_s: float) -> list[str]:
    """Every backend's topology, within ``wait_s`` (its own loop and sockets, closed before serving)."""
    peers = ControlPeers(Timeouts(), asyncio.get_running_loop().create_task)
    try:
        return await learn_pool(pool, peers, wait_s, pool.control_timeout_s)
    finally:
        await peers.close()


COMMAND = Command("the P/D proxy in front of vLLM P and D servers", add_proxy_args, run_proxy)
