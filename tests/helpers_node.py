"""Spawn a standalone ``aiolayer node`` as a subprocess, read its JSON line, always stop it.

Use ``spawn_node(...)`` as a context manager (or wrap it in a fixture in your test module):

    with spawn_node(shape=SMALL_SHAPE) as node:
        node.info["control"]      # "tcp://127.0.0.1:PORT"
        ...
    node.returncode               # set once the context has stopped the process

The process itself is ``aiolayer.harness.child.ChildProcess``, the bench's too: the node's stderr goes
to a temporary file (a pipe nobody reads could fill up and freeze the node); its text is attached to
every failure. Stopping is bounded: SIGTERM (or the signal asked for), ``wait`` with a deadline,
then SIGKILL of its process group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiolayer.harness.child import KILL_TIMEOUT_S, STOP_TIMEOUT_S, ChildProcess, ChildStartError  # noqa: F401
from aiolayer.harness.node import mooncake_env, shape_flags
from aiolayer.harness.procs import freeze  # noqa: F401 - the tests' way to stop a node
from aiolayer.config import KVShape

# Mooncake settings for every process that creates an engine (docs/mooncake.md).
MC_ENV = mooncake_env(transfer_timeout_s=5)

SMALL_SHAPE = KVShape(num_layers=4, num_blocks=64, block_size=16, kv_heads=2, head_dim=64)

READY_TIMEOUT_S = 20.0
REPO_ROOT = Path(__file__).resolve().parent.parent


def apply_mc_env() -> None:
    """Set the Mooncake variables in this process (before any engine is created)."""
    for key, value in MC_ENV.items():
        os.environ.setdefault(key, value)


def shape_args(shape: KVShape) -> list[str]:
    return shape_flags(shape, skip=("layout",))


def node_command(*extra: str, shape: KVShape | None = SMALL_SHAPE, backend: str = "mooncake",
                 role: str = "decode") -> list[str]:
    cmd = [sys.executable, "-m", "aiolayer", "node", "--role", role, "--backend", backend, "--exit-with-parent"]
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


class NodeProcess(ChildProcess):
    """One running ``aiolayer node`` (started at once, in a session of its own); ``info`` is its parsed
    JSON line. A node that prints no usable line fails the test, with its stderr attached."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        super().__init__(cmd, env=node_env(env), cwd=str(REPO_ROOT), name="aiolayer node")
        self.info: dict | None = None
        self.start()

    @property
    def control(self) -> str:
        assert self.info is not None, "node not ready"
        return self.info["control"]

    def read_line(self, timeout: float = READY_TIMEOUT_S) -> bytes:
        """The first stdout line, within ``timeout`` seconds; fails the test with stderr otherwise."""
        try:
            return super().read_line(timeout)
        except ChildStartError as exc:
            pytest.fail(str(exc))

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> dict:
        try:
            self.info = self.read_json(timeout, require="control")
        except ChildStartError as exc:
            pytest.fail(str(exc))
        return self.info

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int:
        """Send ``sig``, wait at most ``timeout``, then SIGKILL; returns the exit status."""
        return super().stop(sig, timeout)


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


@contextlib.contextmanager
def stoppable_node(shape: KVShape = SMALL_SHAPE):
    """A Mooncake D node a test may SIGSTOP: continued (SIGCONT) before it is stopped, whatever happened."""
    with spawn_node(shape=shape) as node:
        try:
            yield node
        finally:
            os.kill(node.pid, signal.SIGCONT)


@contextlib.contextmanager
def mooncake_p(engine_id: str, seed: int, shape: KVShape = SMALL_SHAPE, backend=None):
    """A started Mooncake P runtime with a seeded paged KV cache registered: yields (runtime, cache)."""
    import numpy as np

    from aiolayer import NodeConfig, Runtime, Timeouts
    from aiolayer.kvcache import PagedKVCache

    rt = Runtime(NodeConfig(engine_id=engine_id, backend="mooncake"), Timeouts(control_call=5.0), backend).start()
    try:
        cache = PagedKVCache(shape)
        cache.buffer[:] = np.random.default_rng(seed).integers(1, 256, cache.buffer.size, dtype=np.uint8)
        rt.register_kv_memory(cache.k_base, cache.v_base, shape.block_bytes, shape.num_blocks)
        yield rt, cache
    finally:
        rt.stop()


def run_node_cli(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run ``python -m aiolayer <args>`` to completion (for argument errors), bounded."""
    return subprocess.run([sys.executable, "-m", "aiolayer", *args], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout, env=node_env(),
                          cwd=str(REPO_ROOT))


def until_streaming(p, tid: str, limit: float = 5.0) -> None:
    """Wait until P's transfer has D's layout (it then waits for its layers)."""
    async def state() -> str:
        req = p.sender._live.get(tid)
        return req.state.state.value if req is not None else "gone"
    end = time.monotonic() + limit
    while p.loop_thread.call(state(), timeout=2) != "streaming":
        assert time.monotonic() < end, "P never got D's layout"
        time.sleep(0.02)
