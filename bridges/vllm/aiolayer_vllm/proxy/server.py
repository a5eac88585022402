"""``aiolayer proxy``: parse the backends, build the app, serve it with uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys

from aiolayer.cli import Command
from aiolayer.transport import url_host

from .flow import ProxyTimeouts
from .pool import Backend, Pool


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
WILDCARDS = ("0.0.0.0", "::", "")


def add_proxy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL,CONTROL[,tp=N]",
                   help="P servers: http://host:port of vLLM, tcp://host:port of its aiolayer control socket "
                        "(its control_port); tp=N for a P with N tensor-parallel ranks (rank r: that port + r)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL,CONTROL",
                   help="D servers, same form; D's tensor-parallel and data-parallel ranks register themselves")
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
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between health checks of each server")
    p.add_argument("--log-level", default="warning", choices=LOG_LEVELS, help="the proxy's and uvicorn's log level")


def public_url(host: str, port: int, given: str) -> str:
    """The URL D POSTs its registration to; a wildcard listen address is no address D can dial."""
    if given:
        return given.rstrip("/")
    if host in WILDCARDS:
        raise ValueError(f"--host {host or repr(host)} listens on every interface, which D cannot dial: "
                         "give --public-url http://ADDRESS:PORT (an address D can reach)")
    return f"http://{url_host(host)}:{port}"


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app

    logger = logging.getLogger("aiolayer_vllm")
    logger.setLevel(args.log_level.upper())
    if not logger.handlers and not logging.getLogger().handlers:   # uvicorn configures only its own loggers
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    try:
        pool = Pool([Backend.parse("prefill", s) for s in args.prefill],
                    [Backend.parse("decode", s) for s in args.decode], health_interval_s=args.health_interval)
        url = public_url(args.host, args.port, args.public_url)
    except ValueError as exc:
        print(f"aiolayer proxy: {exc}", file=sys.stderr)
        return 2
    timeouts = ProxyTimeouts(registration_s=args.registration_timeout, prefill_s=args.prefill_timeout,
                             request_s=args.request_timeout)
    app = create_app(pool, url, timeouts)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


COMMAND = Command("the D-first proxy in front of vLLM P and D servers", add_proxy_args, run_proxy)
