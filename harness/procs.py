"""Process supervision for the end-to-end tests: free ports, log tails, a child that dies with its parent,
liveness by (pid, start time), signals to a group or a pid, a stop that waits until it took hold, and
/dev/shm segments left by a killed tree.
Nothing here knows vLLM; ``vllm_server`` builds on it.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import time
from pathlib import Path

try:
    import psutil
except ImportError:  # pragma: no cover - psutil ships with vllm's dependencies
    psutil = None


class ServerError(RuntimeError):
    """A server failed to start, died, or could not be stopped; the message ends with its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port for a server started later (see ``free_ports``: never one the kernel may hand out meanwhile)."""
    return free_ports(1, host)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int, host: str = "127.0.0.1") -> int:
    """A base port with ``count`` free ports from it on (the connector's per-rank rule: base + rank).

    Taken below the kernel's ephemeral range: a server restarted on its port (a test restarting an engine)
    must find it free, and a port inside that range can meanwhile be any outgoing connection's local port."""
    def free(port: int) -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
        return True

    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(max(1024, low - 12000), low - count)
        if all(free(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports")


def log_tail(path: Path | None, max_bytes: int = 12000) -> str:
    if path is None or not path.exists():
        return "<no log>"
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - max_bytes))
        data = f.read().decode("utf-8", "replace")
    # Route listings are long and useless in a failure report.
    lines = [ln for ln in data.splitlines() if "Route: " not in ln]
    return "\n".join(lines)


def die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG = 1


def pid_alive(pid: int, create_time: float | None = None) -> bool:
    """Alive and not a zombie (and, given ``create_time``, still the same process)."""
    if psutil is not None:
        try:
            p = psutil.Process(pid)
            if create_time is not None and abs(p.create_time() - create_time) > 0.05:
                return False
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


_SHM_DIR = Path("/dev/shm")
# multiprocessing.shared_memory segments (vLLM's message queues, ~400 MB of tmpfs per server). Named
# semaphores (sem.*, 32 bytes) are left alone: their owner cannot be told apart reliably.
_SHM_PREFIXES = ("psm_", "wnsm_")


def shm_in_use(pids: set[int] | None = None) -> set[str]:
    """Names under /dev/shm that the given live processes (default: all) map or hold open."""
    used: set[str] = set()
    for pid in (pids if pids is not None else [p for p in os.listdir("/proc") if p.isdigit()]):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if "/dev/shm/" in line:
                        used.add(line.rsplit("/dev/shm/", 1)[1].split()[0])
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("/dev/shm/"):
                        used.add(target[len("/dev/shm/"):].split()[0])
    return used


def remove_orphan_shm(ours: set[str]) -> list[str]:
    """Unlink those of ``ours`` (shm our now-dead processes used) that no live process uses."""
    ours = {n for n in ours if n.startswith(_SHM_PREFIXES) and "/" not in n and (_SHM_DIR / n).exists()}
    if not ours:
        return []
    removed = []
    for name in sorted(ours - shm_in_use()):
        with contextlib.suppress(OSError):
            (_SHM_DIR / name).unlink()
            removed.append(name)
    return removed


def process_titles(pids: set[int]) -> dict[int, str]:
    """pid -> process title (vLLM's ``VLLM::EngineCore``) or the first words of its command line."""
    out: dict[int, str] = {}
    for pid in sorted(pids) if psutil is not None else ():
        with contextlib.suppress(psutil.Error):
            cmd = psutil.Process(pid).cmdline()
            out[pid] = cmd[0] if cmd and cmd[0].startswith("VLLM::") else " ".join(cmd[:4])
    return out


def rss_of(pids: set[int]) -> dict[int, int]:
    """pid -> resident set size of each of ``pids`` still alive."""
    out: dict[int, int] = {}
    for pid in sorted(pids) if psutil is not None else ():
        with contextlib.suppress(psutil.Error):
            out[pid] = psutil.Process(pid).memory_info().rss
    return out


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def signal_pid(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def freeze(pid: int, limit: float = 5.0) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped: the signal stops the other threads
    only once one of them runs, so a write or a handshake could otherwise still be answered after it."""
    os.kill(pid, signal.SIGSTOP)
    _until_stopped([pid], limit, f"process {pid}")


def freeze_group(pgid: int, limit: float = 5.0) -> None:
    """``freeze`` for every process of a group (a server and all it started)."""
    os.killpg(pgid, signal.SIGSTOP)
    _until_stopped(_group_members(pgid), limit, f"process group {pgid}")


def _until_stopped(pids: list[int], limit: float, what: str) -> None:
    end = time.monotonic() + limit
    while not all(_all_threads_stopped(pid) for pid in pids):
        if time.monotonic() > end:
            raise ServerError(f"{what} not stopped {limit:g} s after SIGSTOP")
        time.sleep(0.005)


def _stat_fields(path: str) -> list[str] | None:
    """/proc's stat fields after the command's closing parenthesis (state first); None once it is gone."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _all_threads_stopped(pid: int) -> bool:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:   # gone: nothing left to run
        return True
    for task in tasks:
        fields = _stat_fields(f"/proc/{pid}/task/{task}/stat")
        if fields is not None and fields[0] not in ("T", "t"):   # None: the thread ended meanwhile
            return False
    return True


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(f"/proc/{entry}/stat")
            if fields is not None and int(fields[2]) == pgid:   # state, ppid, pgrp
                members.append(int(entry))
    return members
