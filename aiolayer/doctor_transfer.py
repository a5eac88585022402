"""``aiolayer doctor``'s I/O: asks each side who it is (``probe``), and tries the data path with one small
transfer from a temporary runtime on this host into D's node, verified byte for byte (``check_transfer``).

Every call is bounded by the doctor's ``--timeout`` (``Timeouts.control_call``) and the transfer by the
runtime's own deadlines; each runtime started here is stopped before the function returns.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import threading
import time

from .config import KVShape, NodeConfig, Timeouts
from .doctor_checks import FAIL, PASS, SKIP, Check, Side
from .errors import AiolayerError, ControlRejected, ControlTimeout, DeadlineExceeded, ProtocolError
from .protocol import messages as m
from .protocol.codes import NackCode
from .transport import Transport

ENGINE_ID = "aiolayer-doctor"
OLD_PEER = (NackCode.DECODE, NackCode.UNKNOWN)   # a peer older than the topology query answers so


def probe(sides: list[Side], timeout: float) -> None:
    """Ask each side for its topology; fills ``topology``/``rtt_ms``, or ``error``/``protocol_error``."""
    from .runtime.runtime import Runtime

    rt = Runtime(NodeConfig(engine_id=ENGINE_ID, backend="memory"), Timeouts(control_call=timeout)).start()
    try:
        for side in sides:
            _ask(rt, side, timeout)
    finally:
        rt.stop()


def _ask(rt, side: Side, timeout: float) -> None:
    started = time.perf_counter()
    try:
        reply = rt.request(side.endpoint, m.TopologyRequest(requester=ENGINE_ID), timeout=timeout)
    except ProtocolError as exc:
        side.protocol_error = str(exc)
        return
    except ControlRejected as exc:
        if exc.code == NackCode.VERSION:
            side.protocol_error = str(exc)
        elif exc.code in OLD_PEER:
            side.protocol_error = f"it does not know the topology query (an aiolayer older than 0.1.0): {exc}"
        else:
            side.error = f"refused: {exc}"
        return
    except (ControlTimeout, DeadlineExceeded):
        side.error = why_silent(side.endpoint, timeout)
        return
    except AiolayerError as exc:
        side.error = f"{type(exc).__name__}: {exc}"
        return
    side.rtt_ms = (time.perf_counter() - started) * 1e3
    if isinstance(reply, m.TopologyReply):
        side.topology = reply
    else:
        side.error = f"answered the topology query with {type(reply).__name__}"


def why_silent(endpoint: str, timeout: float) -> str:
    """Why ``endpoint`` gave no answer, told apart by a plain TCP connect: the ZMQ call only times out
    (it retries a name it cannot resolve, and a refused connection, until its deadline)."""
    rest = endpoint.split("://", 1)[-1]
    host, _, port = rest.rpartition(":")
    host = host.strip("[]")
    found: list = []
    lookup = threading.Thread(target=_resolve, args=(host, port, found), daemon=True)
    lookup.start()
    lookup.join(timeout)   # a daemon thread: a resolver that hangs does not hold the doctor's exit
    if not found:
        return f"no answer within {timeout:g} s, and the name {host!r} did not resolve within it either"
    if isinstance(found[0], OSError):
        return f"cannot resolve the host name {host!r} ({found[0].strerror or found[0]}): a typo?"
    family, kind, proto, _, address = found[0]
    with socket.socket(family, kind, proto) as probe_socket:
        probe_socket.settimeout(timeout)
        try:
            probe_socket.connect(address)
        except ConnectionRefusedError:
            return f"nothing listens at {rest} (connection refused): a wrong port, or the engine is not running"
        except OSError as exc:
            return (f"no answer within {timeout:g} s; a TCP connect got none either ({exc.strerror or exc}): "
                    "the host is down, or a firewall drops the packets")
    return (f"no answer within {timeout:g} s, although a TCP connect to {rest} succeeded: not an aiolayer "
            "control socket (or a proxy accepts on its behalf), or its process is frozen")


def _resolve(host: str, port: str, found: list) -> None:
    try:
        found.append(socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0])
    except (OSError, ValueError) as exc:   # gaierror is an OSError; ValueError: a port that is not a number
        found.append(exc if isinstance(exc, OSError) else OSError(str(exc)))


def source_address(host: str) -> str:
    """This host's address that routes to ``host`` (a UDP "connect" sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            address: str = s.getsockname()[0]
            return address
    except OSError:
        return "127.0.0.1"


def _shape(topology: m.TopologyReply, blocks: int) -> KVShape:
    """A local cache whose blocks are D's size (bytes only: the test writes whole blocks)."""
    shape = KVShape(num_layers=topology.num_layers, num_blocks=blocks, block_size=max(1, topology.block_size),
                    kv_heads=max(1, topology.kv_heads), head_dim=max(1, topology.head_bytes), dtype="uint8")
    if shape.block_bytes != topology.block_bytes:
        shape = KVShape(num_layers=topology.num_layers, num_blocks=blocks, block_size=1, kv_heads=1,
                        head_dim=topology.block_bytes, dtype="uint8")
    return shape


def check_transfer(p: Side, d: Side, args: argparse.Namespace) -> Check:
    """One transfer of ``args.blocks`` blocks per layer into D's node; its bandwidth and latency."""
    import numpy as np

    from .kvcache import PagedKVCache
    from .runtime.runtime import Runtime

    mine = p.topology or d.topology   # doctor runs on P's host: P's Mooncake settings apply here
    if mine.force_tcp:
        os.environ.setdefault("MC_FORCE_TCP", "1")   # before the engine exists, as P's engine has it
    transport = Transport(bind_host=args.bind_host or source_address(d.host), protocol=mine.protocol or "tcp",
                          device_name=mine.device_name if p.topology is not None else "")
    shape = _shape(d.topology, args.blocks)
    try:
        rt = Runtime(NodeConfig(engine_id=ENGINE_ID, backend="mooncake", transport=transport),
                     Timeouts(control_call=args.timeout)).start()
    except AiolayerError as exc:
        return Check("data path", FAIL, f"cannot start a Mooncake runtime here: {exc}",
                     "run the doctor on P's host, with the Mooncake transfer engine installed (README: Install)")
    try:
        cache = PagedKVCache(shape)
        cache.buffer[:] = np.random.default_rng().integers(0, 256, cache.buffer.size, dtype=np.uint8)
        rt.register_kv_memory(cache.k_base, cache.v_base, shape.block_bytes, shape.num_blocks)
        return _transfer(rt, cache, d, args.timeout)
    except AiolayerError as exc:
        return Check("data path", FAIL, f"{type(exc).__name__}: {exc}", _path_fix(d))
    finally:
        rt.stop()


def _path_fix(d: Side) -> str:
    session = d.topology.session if d.topology is not None else "?"
    return (f"this host must reach D's Mooncake session {session} (its handshake port, and the ports Mooncake "
            "opens for data) with the same transport on both: open the firewall between them, check "
            "MC_FORCE_TCP / protocol / device_name (docs/operations.md#transport-across-hosts)")


def _transfer(rt, cache, d: Side, timeout: float) -> Check:
    from .runtime.spec import TransferSpec

    shape: KVShape = cache.shape
    tid = f"doctor-{secrets.token_hex(4)}"
    try:
        alloc = rt.request(d.endpoint, m.AllocRequest(transfer_id=tid, num_blocks=shape.num_blocks), timeout=timeout)
    except ControlRejected as exc:
        if exc.code == NackCode.UNKNOWN:
            return Check("data path", SKIP, "D is an engine, not an `aiolayer node`: run `aiolayer node` with "
                         "the same transport flags on D's host and point --d-control at it")
        return Check("data path", FAIL, f"D refused the test allocation: {exc}",
                     "give D free blocks, or a smaller --blocks")
    started = time.perf_counter()
    src = list(range(shape.num_blocks))
    with rt.begin_step([TransferSpec.from_registration(alloc, src_blocks=src, peer=d.endpoint)]) as step:
        for layer in range(shape.num_layers):
            step.layer_ready(layer)
    t = rt.timeouts
    try:
        outcome = rt.wait_outcome(tid, t.layout_fetch + shape.num_layers * t.layer_write + t.done_delivery)
    except DeadlineExceeded:
        return Check("data path", FAIL, "the test transfer did not end in time", _path_fix(d))
    elapsed = time.perf_counter() - started
    if not outcome.ok:
        return Check("data path", FAIL, f"the test transfer failed: {outcome.reason}", _path_fix(d))
    verify = rt.request(d.endpoint, m.VerifyRequest(transfer_id=tid), timeout=timeout)
    rt.request(d.endpoint, m.ReleaseRequest(transfer_id=tid), timeout=timeout)
    if not isinstance(verify, m.VerifyReply) or (verify.crc_k, verify.crc_v) != cache.checksums(src):
        return Check("data path", FAIL, "the test transfer ended but D holds other bytes than were sent",
                     "report it: the data path corrupts KV (docs/operations.md#failure-semantics)")
    size = 2 * shape.num_layers * shape.num_blocks * shape.block_bytes
    return Check("data path", PASS, f"{size / 1024:.0f} KiB in {elapsed * 1e3:.1f} ms "
                 f"({size / elapsed / 1e6:.0f} MB/s), control round trip {d.rtt_ms:.1f} ms, verified byte for byte")
