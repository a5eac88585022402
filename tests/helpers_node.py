"""Spawn a standalone ``aiolayer node`` as a subprocess, read its JSON line, always stop it.

Use ``spawn_node(...)`` as a context manager (or wrap it in a fixture in your test module):

    with spawn_node(shape=SMALL_SHAPE) as node:
        node.info["control"]      # "tcp://127.0.0.1:PORT"
        ...
    node.returncode               # set once the context has stopped the process

The node's stderr goes to a temporary file (a pipe nobody reads could fill up and freeze the node);
its text is attached to every failure. Stopping is bounded: SIGTERM (or the signal asked for),
``wait`` with a deadline, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from aiolayer.config import KVShape

# Mooncake settings for every process that creates an engine (docs/mooncake.md).
MC_ENV = {
    "MC_FORCE_TCP": "1",
    "MC_TRANSFER_TIMEOUT": "5",
    "MC_LOG_LEVEL": "WARNING",
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
}

SMALL_SHAPE = KVShape(num_layers=4, num_blocks=64, block_size=16, kv_heads=2, head_dim=64)

READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
KILL_TIMEOUT_S = 5.0
REPO_ROOT = Path(__file__).resolve().parent.parent


def apply_mc_env() -> None:
    """Set the Mooncake variables in this process (before any engine is created)."""
    for key, value in MC_ENV.items():
        os.environ.setdefault(key, value)


def shape_args(shape: KVShape) -> list[str]:
    return ["--num-layers", str(shape.num_layers), "--num-blocks", str(shape.num_blocks),
            "--block-size", str(shape.block_size), "--kv-heads", str(shape.kv_heads),
            "--head-dim", str(shape.head_dim), "--dtype", shape.dtype]


def node_command(*extra: str, shape: KVShape | None = SMALL_SHAPE, backend: str = "mooncake",
                 role: str = "decode") -> list[str]:
    cmd = [sys.executable, "-m", "aiolayer", "node", "--role", role, "--backend", backend]
    if shape is not None:
        cmd += shape_args(shape)
    return cmd + list(extra)


def node_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(MC_ENV)
    env["PYTHONUNBUFFERED"] = "1"
    # the repository must be importable whatever the cwd of the test run
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    if extra:
        env.update(extra)
    return env


class NodeProcess:
    """One running ``aiolayer node``; ``info`` is its parsed JSON line."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.cmd = cmd
        self._stderr_file = tempfile.TemporaryFile(prefix="aiolayer-node-stderr-")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=self._stderr_file, env=node_env(env), cwd=str(REPO_ROOT),
                                     start_new_session=True)
        self.info: dict | None = None
        self.first_line = b""
        self.rest_stdout = b""
        self._buf = b""
        self.stop_s: float | None = None    # how long the stop took (signal -> exit)
        self.killed = False

    # --- reading ------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    @property
    def control(self) -> str:
        assert self.info is not None, "node not ready"
        return self.info["control"]

    def stderr_text(self, limit: int = 8000) -> str:
        f = self._stderr_file
        try:
            f.flush()
            f.seek(0)
            data = f.read()
        except (OSError, ValueError):
            return "<stderr unavailable>"
        text = data.decode(errors="replace")
        return text[-limit:]

    def _describe(self) -> str:
        return (f"cmd: {' '.join(self.cmd)}\nreturncode: {self.proc.poll()}\n"
                f"stdout so far: {self._buf!r}\nstderr:\n{self.stderr_text()}")

    def read_line(self, timeout: float = READY_TIMEOUT_S) -> bytes:
        """The first stdout line, within ``timeout`` seconds; fails the test with stderr otherwise."""
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    pytest.fail(f"aiolayer node printed no line within {timeout:g}s\n{self._describe()}")
                if not sel.select(left):
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:  # EOF: the node exited (or closed stdout) before its line
                    try:
                        self.proc.wait(2)
                    except subprocess.TimeoutExpired:
                        pass
                    pytest.fail(f"aiolayer node closed stdout before its JSON line\n{self._describe()}")
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        self.first_line = line
        return line

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> dict:
        line = self.read_line(timeout)
        try:
            info = json.loads(line)
        except ValueError:
            pytest.fail(f"aiolayer node's first line is not JSON: {line!r}\n{self._describe()}")
        if not isinstance(info, dict) or "control" not in info:
            pytest.fail(f"aiolayer node's JSON line has no 'control': {line!r}\n{self._describe()}")
        self.info = info
        return info

    # --- stopping -----------------------------------------------------------------------------

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int:
        """Send ``sig``, wait at most ``timeout``, then SIGKILL; returns the exit status."""
        proc = self.proc
        if proc.poll() is None:
            start = time.monotonic()
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.killed = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group is the node
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(KILL_TIMEOUT_S)
            self.stop_s = time.monotonic() - start
        self._drain_stdout()
        return proc.returncode

    def _drain_stdout(self) -> None:
        out = self.proc.stdout
        if out is None or out.closed:
            return
        fd = out.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and sel.select(max(0.0, deadline - time.monotonic())):
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                self._buf += chunk
        out.close()
        self.rest_stdout = self._buf

    def close(self) -> None:
        try:
            self.stop()
        finally:
            with contextlib.suppress(Exception):
                self._stderr_file.close()


@contextlib.contextmanager
def spawn_node(*extra: str, shape: KVShape | None = SMALL_SHAPE, backend: str = "mooncake",
               env: dict[str, str] | None = None, ready_timeout: float = READY_TIMEOUT_S,
               wait: bool = True):
    """Start ``aiolayer node --role decode``; yield a ``NodeProcess`` (ready unless ``wait=False``)."""
    node = NodeProcess(node_command(*extra, shape=shape, backend=backend), env)
    try:
        if wait:
            node.wait_ready(ready_timeout)
        yield node
    finally:
        node.close()


def run_node_cli(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run ``python -m aiolayer <args>`` to completion (for argument errors), bounded."""
    return subprocess.run([sys.executable, "-m", "aiolayer", *args], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout, env=node_env(),
                          cwd=str(REPO_ROOT))
