"""``aiolayer proxy``: parse the backends, build the app, serve it with uvicorn."""

from __future__ import annotations

import argparse

from aiolayer.cli import Command

from .flow import ProxyTimeouts
from .pool import Backend, Pool


def add_proxy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL,CONTROL",
                   help="P servers: http://host:port of vLLM, tcp://host:port of its aiolayer control socket")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL,CONTROL", help="D servers, same form")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--public-url", default="", help="how D reaches this proxy (default http://HOST:PORT)")
    p.add_argument("--registration-timeout", type=float, default=ProxyTimeouts.registration_s)
    p.add_argument("--prefill-timeout", type=float, default=ProxyTimeouts.prefill_s)
    p.add_argument("--request-timeout", type=float, default=ProxyTimeouts.request_s)
    p.add_argument("--health-interval", type=float, default=2.0)


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app

    try:
        pool = Pool([Backend.parse("prefill", s) for s in args.prefill],
                    [Backend.parse("decode", s) for s in args.decode], health_interval_s=args.health_interval)
    except ValueError as exc:
        print(f"aiolayer proxy: {exc}")
        return 2
    timeouts = ProxyTimeouts(registration_s=args.registration_timeout, prefill_s=args.prefill_timeout,
                             request_s=args.request_timeout)
    app = create_app(pool, args.public_url or f"http://{args.host}:{args.port}", timeouts)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0


COMMAND = Command("the D-first proxy in front of vLLM P and D servers", add_proxy_args, run_proxy)
