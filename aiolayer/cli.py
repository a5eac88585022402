"""Command line: ``aiolayer node`` (a standalone D node), ``aiolayer doctor`` (checks a P and a D across
hosts) and the subcommands other packages register
(``bench``, the benchmark; ``proxy``, the vLLM bridge's P/D proxy) through ``aiolayer.commands``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading

from importlib.metadata import entry_points
from typing import Callable, NamedTuple

from . import __version__
from .config import KVShape, NodeConfig, Timeouts
from .doctor import add_doctor_args
from .errors import AiolayerError
from .transport import PROTOCOLS, Transport

# Every subcommand's --help shows each flag's default.
HELP_FORMAT = argparse.ArgumentDefaultsHelpFormatter
# Subcommands other packages add (the benchmark, the vLLM bridge's proxy): the core names none of them.
COMMAND_GROUP = "aiolayer.commands"
ELSEWHERE = {"proxy": "the P/D proxy comes with the vLLM bridge, aiolayer-vllm: from a checkout, "
                     "pip install . ./bridges/vllm (README: Install)"}


class Command(NamedTuple):
    """What an ``aiolayer.commands`` entry point names: ``aiolayer NAME`` adds and runs it."""

    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    # The words after ``aiolayer NAME``, rewritten before parsing (the bench: its default subcommand).
    argv: Callable[[list[str]], list[str]] | None = None


def command_plugins() -> dict[str, tuple[Command | None, BaseException | None]]:
    """Every registered subcommand, loaded; one that fails to load is kept with its error."""
    found: dict[str, tuple[Command | None, BaseException | None]] = {}
    for point in entry_points(group=COMMAND_GROUP):
        try:
            found[point.name] = (point.load(), None)
        except Exception as exc:  # noqa: BLE001 - reported when that command is run, others still work
            found[point.name] = (None, exc)
    return found


def add_command(sub, name: str, found: tuple[Command | None, BaseException | None], flags: bool = True):
    """The subcommand with its help line; with ``flags``, its flags too (adding them imports what the
    command needs: the benchmark's torch)."""
    command, error = found
    parser = sub.add_parser(name, help=command.help if command else f"(not available: {error})",
                            formatter_class=HELP_FORMAT)
    if command is not None and flags:
        command.add_args(parser)
    return found


def add_shape_args(p: argparse.ArgumentParser, num_blocks: int = 512) -> None:
    d = KVShape()
    g = p.add_argument_group("KV shape")
    g.add_argument("--num-layers", type=int, default=d.num_layers, help="layers of the KV cache")
    g.add_argument("--num-blocks", type=int, default=num_blocks, help="blocks per layer")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per block")
    g.add_argument("--kv-heads", type=int, default=d.kv_heads, help="KV heads per block")
    g.add_argument("--head-dim", type=int, default=d.head_dim, help="elements per head")
    g.add_argument("--dtype", default=d.dtype, choices=["float16", "bfloat16", "float32", "int8", "uint8"],
                   help="element type")
    g.add_argument("--kv-layout", default=d.layout, choices=["NHD", "HND"],
                   help="block layout: NHD [block, token, head, dim] or HND [block, head, token, dim]")


def shape_from_args(args: argparse.Namespace) -> KVShape:
    return KVShape(num_layers=args.num_layers, num_blocks=args.num_blocks, block_size=args.block_size,
                   kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
                   layout=getattr(args, "kv_layout", KVShape().layout))


def add_node_args(p: argparse.ArgumentParser) -> None:
    t = Transport()
    g = p.add_argument_group("transport (aiolayer.transport.Transport)")
    g.add_argument("--bind-host", "--host", dest="bind_host", default=t.bind_host,
                   help="address the control socket and /metrics bind (0.0.0.0: every interface; IPv6 such as "
                        "::1 only with --backend memory: Mooncake needs IPv4)")
    g.add_argument("--advertise-host", default=t.advertise_host,
                   help="address peers dial; empty: the bind host, or for a wildcard bind the routed interface's")
    g.add_argument("--protocol", default=t.protocol, choices=PROTOCOLS, help="Mooncake transport")
    g.add_argument("--device-name", default=t.device_name, help="RDMA NIC(s), comma-separated; empty: auto")
    g.add_argument("--metadata-server", default=t.metadata_server,
                   help="P2PHANDSHAKE (no server), or an http(s):// or etcd:// metadata server")
    p.add_argument("--port", type=int, default=0, help="control port (0 = pick a free one)")
    p.add_argument("--engine-id", default="",
                   help="this node's name to peers; empty: decode-PORT (decode-auto with --port 0)")
    p.add_argument("--backend", default="mooncake", choices=["mooncake", "memory"],
                   help="data plane: Mooncake's transfer engine, or in-process memory (tests)")
    p.add_argument("--receive-timeout", type=float, default=Timeouts().receive,
                   help="seconds D waits for a registered transfer's DONE/FAILED")
    p.add_argument("--fence-grace", type=float, default=Timeouts().fence_grace,
                   help="seconds D keeps an abandoned transfer's blocks when P does not confirm its writes "
                        "ended (keep it above how long a write may stay in flight: Mooncake's 30 s over TCP; "
                        "docs/fencing.md)")
    p.add_argument("--metrics-port", type=int, default=-1,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0 = a free port, -1 = off; "
                        "the JSON line names the URL)")
    p.add_argument("--refuse-writes", action="store_true",
                   help="fault injection: publish the KV layout but register no memory, so writes are refused")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="stop when the process that started this one exits (a harness killed with SIGKILL "
                        "leaves no node behind)")


def run_node(args: argparse.Namespace) -> int:
    from .node import DecodeNode

    if args.role != "decode":
        print("only --role decode is a standalone node; P runs inside its engine (see README)", file=sys.stderr)
        return 2
    transport = Transport(bind_host=args.bind_host, advertise_host=args.advertise_host, protocol=args.protocol,
                          device_name=args.device_name, metadata_server=args.metadata_server)
    node_cfg = NodeConfig(engine_id=args.engine_id or f"decode-{args.port or 'auto'}", transport=transport,
                          control_port=args.port, backend=args.backend, metrics_port=args.metrics_port)
    node = DecodeNode(shape_from_args(args), node_cfg,
                      Timeouts(receive=args.receive_timeout, fence_grace=args.fence_grace),
                      refuse_writes=args.refuse_writes)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    parent = os.getppid()
    node.start()
    try:
        print(json.dumps(node.info()), flush=True)
        while not stop.wait(0.5):
            if not node.runtime.loop_thread.alive:
                print("aiolayer node: loop thread died", file=sys.stderr)
                return 1
            if args.exit_with_parent and os.getppid() != parent:   # reparented: its starter is gone
                print(f"aiolayer node: parent {parent} exited; stopping", file=sys.stderr)
                return 1
    finally:
        node.stop()
    return 0


CORE_COMMANDS = ("node", "doctor")


def build_parser(plugins: bool = True, only: str | None = None) -> tuple[argparse.ArgumentParser, dict]:
    """The ``aiolayer`` parser with every subcommand, and the loaded commands by name; without ``plugins``
    the core's only. ``only``: of the other packages' subcommands, add the flags of that one alone (the
    one being run; "" none, as for ``aiolayer --help``), the others with their help line; None: all."""
    parser = argparse.ArgumentParser(prog="aiolayer", description=__doc__)
    parser.add_argument("--version", action="version", version=f"aiolayer {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    node = sub.add_parser("node", help="run a standalone decode node (prints one JSON line, stops on SIGTERM)",
                          formatter_class=HELP_FORMAT)
    node.add_argument("--role", choices=["decode", "prefill"], default="decode",
                      help="decode: a standalone D node (P runs inside its engine)")
    add_shape_args(node)
    add_node_args(node)
    doctor = sub.add_parser("doctor", help="check a P and a D (control endpoints or configs) for what is set up "
                            "wrong across hosts; one OK/FAIL line per check, exit 1 on any FAIL",
                            formatter_class=HELP_FORMAT)
    add_doctor_args(doctor)

    found = command_plugins() if plugins else {}
    commands = {name: add_command(sub, name, entry, flags=only is None or name == only)
                for name, entry in found.items()}
    for name, hint in ELSEWHERE.items():
        if plugins and name not in commands:
            commands[name] = add_command(sub, name, (None, ImportError(hint)))
    return parser, commands


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    words = [a for a in argv if not a.startswith("-")]
    name = words[0] if words else ""
    parser, commands = build_parser(plugins=name not in CORE_COMMANDS, only=name)
    command = commands.get(name, (None, None))[0]
    if command is not None and command.argv is not None:
        at = argv.index(name) + 1
        argv[at:] = command.argv(argv[at:])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        if args.command == "node":
            return run_node(args)
        if args.command == "doctor":
            from .doctor import run_doctor
            return run_doctor(args)
        command, error = commands[args.command]
        if error is not None:
            print(f"aiolayer {args.command} is not available: {error}", file=sys.stderr)
            return 2
        return command.run(args)
    except AiolayerError as exc:
        print(f"aiolayer: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
