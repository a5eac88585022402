"""Start and stop a standalone ``aiolayer node`` process, reading the one JSON line it prints."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time

from aiolayer.backends.mooncake import ENGINE_ENV
from aiolayer.config import KVShape

BENCH_ENV = {**ENGINE_ENV, "MC_FORCE_TCP": "1"}


def shape_flags(shape: KVShape) -> list[str]:
    return ["--num-layers", str(shape.num_layers), "--num-blocks", str(shape.num_blocks),
            "--block-size", str(shape.block_size), "--kv-heads", str(shape.kv_heads),
            "--head-dim", str(shape.head_dim), "--dtype", shape.dtype, "--kv-layout", shape.layout]


class NodeProcess:
    """A decode node in a child process; ``info`` is its JSON line (control endpoint, session...)."""

    def __init__(self, shape: KVShape, backend: str = "mooncake", extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None, start_timeout: float = 30.0) -> None:
        self.cmd = [sys.executable, "-m", "aiolayer", "node", "--role", "decode", "--backend", backend,
                    *shape_flags(shape), *(extra_args or [])]
        self.env = {**os.environ, **BENCH_ENV, **(env or {})}
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}
        self._stderr = None

    def start(self) -> "NodeProcess":
        # stderr goes to a file: an unread pipe would fill up with the engine's logs and stall the node
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=self._stderr, env=self.env)
        try:
            self.info = json.loads(self._read_line())
        except BaseException:
            self.stop()
            raise
        return self

    def _read_line(self) -> str:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + self.start_timeout
        buf = b""
        try:
            while b"\n" not in buf:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    break
                if sel.select(min(left, 0.5)):
                    chunk = os.read(self.proc.stdout.fileno(), 65536)
                    if not chunk:
                        break
                    buf += chunk
        finally:
            sel.close()
        if b"\n" not in buf:
            self.stop()
            err = self.stderr_text()[-2000:]
            raise RuntimeError(f"decode node did not report its endpoint within {self.start_timeout:g}s "
                               f"(exit code {self.proc.returncode}); stderr:\n{err}")
        return buf.split(b"\n", 1)[0].decode()

    def stderr_text(self) -> str:
        if self._stderr is None or self._stderr.closed:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    @property
    def control(self) -> str:
        return self.info["control"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, bounded wait, then SIGKILL; returns the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGCONT)  # a frozen node must be able to act on SIGTERM
                proc.terminate()
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if proc.stdout is not None:
            proc.stdout.close()
        return proc.returncode

    def __enter__(self) -> "NodeProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
