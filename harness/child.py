"""One child process as the bench and the tests run them: its first stdout line within a deadline, stderr
to a file, a bounded stop of its whole process group.

With ``new_session`` the child leads a process group of its own and a stop signals that whole group
(whatever it started dies with it); without, it stays in the caller's group, so that killing the
caller's group (a test's deadline, a terminal's Ctrl-C) takes the child along, and a stop signals
the child alone. Its stderr goes to a temporary file: a pipe nobody reads could fill up with an
engine's logs and stall the child.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import tempfile
import time

STOP_TIMEOUT_S = 10.0
KILL_TIMEOUT_S = 5.0
DRAIN_S = 2.0


class ChildStartError(RuntimeError):
    """The child printed no usable first line in time; the message carries its command and stderr."""


class ChildProcess:
    """``start()`` launches ``cmd``; ``read_line``/``read_json`` take its first stdout line within a deadline;
    ``stop()`` ends it (SIGCONT, the signal, a bounded wait, then SIGKILL)."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
                 name: str = "child process", stdin=subprocess.DEVNULL, new_session: bool = True) -> None:
        self.cmd, self.env, self.cwd, self.name, self._stdin = cmd, env, cwd, name, stdin
        self.new_session = new_session
        self.proc: subprocess.Popen | None = None
        self.first_line = b""
        self.rest_stdout = b""
        self.stop_s: float | None = None    # how long the stop took (signal -> exit)
        self.killed = False                 # the stop had to SIGKILL
        self._buf = b""
        self._stderr = None

    def start(self) -> "ChildProcess":
        self._stderr = tempfile.TemporaryFile(prefix="aiolayer-child-stderr-")
        self.proc = subprocess.Popen(self.cmd, stdin=self._stdin, stdout=subprocess.PIPE, stderr=self._stderr,
                                     env=self.env, cwd=self.cwd, start_new_session=self.new_session)
        return self

    # --- reading ------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    def stderr_text(self, limit: int = 8000) -> str:
        f = self._stderr
        if f is None or f.closed:
            return ""
        try:
            f.flush()
            f.seek(0)
            data = f.read()
        except (OSError, ValueError):
            return "<stderr unavailable>"
        return data.decode(errors="replace")[-limit:]

    def describe(self) -> str:
        return (f"cmd: {' '.join(self.cmd)}\nreturncode: {self.proc.poll()}\n"
                f"stdout so far: {self._buf!r}\nstderr:\n{self.stderr_text()}")

    def read_line(self, timeout: float) -> bytes:
        """The first stdout line within ``timeout`` seconds; ChildStartError (with stderr) otherwise."""
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ChildStartError(f"{self.name} printed no line within {timeout:g}s\n{self.describe()}")
                if not sel.select(left):
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:  # EOF: the child exited (or closed stdout) before its line
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.proc.wait(2)
                    raise ChildStartError(f"{self.name} closed stdout before its first line\n{self.describe()}")
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        self.first_line = line
        return line

    def read_json(self, timeout: float, require: str = "") -> dict:
        """The first line as a JSON object (holding key ``require`` if given)."""
        line = self.read_line(timeout)
        try:
            info = json.loads(line)
        except ValueError:
            raise ChildStartError(f"{self.name}'s first line is not JSON: {line!r}\n{self.describe()}") from None
        if not isinstance(info, dict) or (require and require not in info):
            raise ChildStartError(f"{self.name}'s JSON line has no {require!r}: {line!r}\n{self.describe()}")
        return info

    # --- stopping -----------------------------------------------------------------------------

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """Send ``sig`` to the group, wait at most ``timeout``, then SIGKILL it; returns the exit status."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            start = time.monotonic()
            with contextlib.suppress(ProcessLookupError):
                self._signal(signal.SIGCONT)  # a frozen child must be able to act on the signal
                self._signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.killed = True
                with contextlib.suppress(ProcessLookupError):
                    self._signal(signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(KILL_TIMEOUT_S)
            self.stop_s = time.monotonic() - start
        self._drain_stdout()
        return proc.returncode

    def end_input(self, timeout: float) -> int | None:
        """Close the child's stdin (a child that serves until EOF exits), wait at most ``timeout``, then
        SIGKILL what is left; returns the exit status."""
        if self.proc is None:
            return None
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        return self.stop(signal.SIGKILL, KILL_TIMEOUT_S)

    def _signal(self, sig: int) -> None:
        if self.new_session:
            os.killpg(self.proc.pid, sig)   # its own session: the group is the child and what it started
        else:
            self.proc.send_signal(sig)

    def _drain_stdout(self) -> None:
        out = self.proc.stdout
        if out is None or out.closed:
            return
        fd = out.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            deadline = time.monotonic() + DRAIN_S
            while time.monotonic() < deadline and sel.select(max(0.0, deadline - time.monotonic())):
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                self._buf += chunk
        out.close()
        self.rest_stdout = self._buf

    def close(self) -> None:
        """Stop, then drop the stderr file (its text is gone after this)."""
        try:
            self.stop()
        finally:
            if self._stderr is not None:
                with contextlib.suppress(Exception):
                    self._stderr.close()
