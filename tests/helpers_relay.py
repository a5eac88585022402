"""Test plumbing around real vLLM servers that the harness (``aiolayer.harness``) does not need: an HTTP hop that pins a
request to one data-parallel rank and can run a callback as it passes, a live count of the bytes a server's
workers receive (to act the moment a peer's KV starts arriving), a way to stop a whole server (SIGSTOP)
that cannot outlive the test, and a logging config that shows the bridge's INFO lines.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import http.server
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from aiolayer.harness.procs import free_port, freeze_group
from aiolayer.harness.servers import VllmServer


@functools.cache
def bridge_logging_config() -> str:
    """A VLLM_LOGGING_CONFIG_PATH file: vLLM's own logger as usual, plus the bridge's INFO lines (the
    layout each worker registered, ``worker.register_kv_caches``), which vLLM's default config drops."""
    handler = {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stdout"}
    config = {"version": 1, "disable_existing_loggers": False,
              "formatters": {"plain": {"format": "%(levelname)s %(asctime)s [%(name)s] %(message)s"}},
              "handlers": {"plain": handler},
              "loggers": {name: {"handlers": ["plain"], "level": "INFO", "propagate": False}
                          for name in ("vllm", "aiolayer_vllm")}}
    with tempfile.NamedTemporaryFile("w", prefix="aiolayer-vllm-logging-", suffix=".json", delete=False) as f:
        json.dump(config, f)
    atexit.register(Path(f.name).unlink, missing_ok=True)   # engines read it at start only
    return f.name


class Relay:
    """An HTTP hop in front of a vLLM server: every request goes on with vLLM's ``X-data-parallel-rank``
    header (the rank that runs it), and ``armed``, when set, runs once in a thread of its own as the next
    POST starts. ``answered`` keeps (forwarded, answered) monotonic times per POST."""

    def __init__(self, target: str, rank: int) -> None:
        relay = self
        self.armed = None
        self.answered: list[tuple[float, float]] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._forward("GET", b"")

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                armed, relay.armed = relay.armed, None
                if armed is not None:
                    threading.Thread(target=armed, daemon=True).start()
                t0 = time.monotonic()
                self._forward("POST", body)
                relay.answered.append((t0, time.monotonic()))

            def _forward(self, method: str, body: bytes) -> None:
                headers = {"content-type": "application/json", "X-data-parallel-rank": str(rank)}
                try:
                    r = httpx.request(method, target + self.path, content=body or None, headers=headers,
                                      timeout=60, trust_env=False)
                    status, content = r.status_code, r.content
                except httpx.HTTPError as exc:
                    status, content = 502, f'{{"error": {{"message": "relay: {type(exc).__name__}"}}}}'.encode()
                with contextlib.suppress(OSError):   # the caller gave up (a health probe's 1 s deadline)
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(content)))
                    self.end_headers()
                    self.wfile.write(content)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Relay:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def worker_ports(server: VllmServer, but: set[int]) -> set[int]:
    """The ports the server's workers listen on, but ``but`` (e.g. aiolayer's control ports: Mooncake's remain)."""
    ports = set()
    for pid, name in server.processes().items():
        if name.startswith("VLLM::Worker"):
            ports |= {c.laddr.port for c in psutil.Process(pid).net_connections("tcp")
                      if c.status == psutil.CONN_LISTEN}
    return ports - but


def bytes_received(ports: set[int]) -> int:
    """The bytes received so far by the established TCP connections on ``ports`` (the kernel's
    ``tcp_info.bytes_received``, through ``ss``): a live count of the KV arriving at a D, where Mooncake's
    TCP transport keeps its connections open between writes."""
    where = " or ".join(f"sport = :{port}" for port in sorted(ports))
    out = subprocess.run(["ss", "-tinH", "state", "established", f"( {where} )"], capture_output=True,
                         text=True, timeout=5, check=True).stdout
    return sum(int(word.partition(":")[2]) for word in out.split() if word.startswith("bytes_received:"))


# Run by Freezer's watchdog: once the test process is gone, let the stopped server go on, so that it acts on
# the SIGTERM its parent's death sent it (a stopped process only queues it), and exit.
_WATCHDOG = """
import os, signal, sys, time
parent, group = int(sys.argv[1]), int(sys.argv[2])
while os.getppid() == parent:
    time.sleep(0.5)
try:
    os.killpg(group, signal.SIGCONT)
except ProcessLookupError:
    pass
"""


class Freezer:
    """``stop()`` sends SIGSTOP to a server's process group (API server, engine core, worker: its own session)
    and returns once every thread of it is stopped, ``resume()`` SIGCONT. Should the test process die in
    between, a watchdog process resumes the server."""

    def __init__(self, server: VllmServer) -> None:
        self.group = server.proc.pid
        self.watchdog = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(self.group)],
                                         stdin=subprocess.DEVNULL, start_new_session=True)   # outlives a group kill

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.group, sig)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):   # the server died meanwhile: the test sees that
            freeze_group(self.group)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def __enter__(self) -> Freezer:
        return self

    def __exit__(self, *exc) -> None:
        self.resume()
        self.watchdog.kill()
        self.watchdog.wait(timeout=5)
