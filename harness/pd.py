"""P/D plumbing for the engine benchmark and the end-to-end tests: connector configs, ``aiolayer
proxy`` as a process, and the D-first flow played directly (what the proxy does, without it).

    p = VllmServer(model, kv_transfer_config=connector("kv_producer", "p", p_port), env=MC_ENV)
    d = VllmServer(model, kv_transfer_config=connector("kv_consumer", "d", d_port), env=MC_ENV)
    with running(p, d), ProxyProcess([backend(p, p_port)], [backend(d, d_port)]) as proxy, \\
            DirectFlow(p, p_port, d, d_port) as direct:
        completion(proxy.url, "the king", model=p.served_model)   # through the proxy
        direct.run("the king").decode                             # D first, P with D's blocks
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import httpx

from . import scratch
from .servers import Completion, VllmServer, completion, die_with_parent, free_port


def connector(role: str, engine_id: str, control_port: int, **extra: Any) -> dict:
    """A ``--kv-transfer-config`` for AiolayerConnector.

    ``kv_load_failure_policy`` is "fail" (vLLM's default recomputes): a transfer that fails must
    show up as an error, not be hidden by a local prefill that happens to give the same tokens.
    """
    return {"kv_connector": "AiolayerConnector", "kv_role": role, "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": {"engine_id": engine_id, "control_port": control_port, **extra}}


def control(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


def backend(server: VllmServer, control_port: int) -> str:
    """A proxy backend argument: ``URL,CONTROL``."""
    return f"{server.base_url},{control(control_port)}"


class ProxyProcess:
    """``python -m aiolayer proxy`` on a free port; ``start()`` returns once /health answers."""

    def __init__(self, prefill: list[str], decode: list[str], *, extra_args: tuple[str, ...] = (),
                 startup_timeout_s: float = 30.0, healthy: tuple[int, ...] = (200,),
                 netns: str | None = None, reach: str = "127.0.0.1", port: int | None = None) -> None:
        # netns: run inside that network namespace (then give the port, and the address ``reach`` to
        # call it at from here; --host/--public-url go in extra_args)
        self.port = port or free_port()
        self.url = f"http://{reach}:{self.port}"
        self.cmd = [*(["ip", "netns", "exec", netns] if netns else []),
                    sys.executable, "-m", "aiolayer", "proxy", "--port", str(self.port), "--prefill", *prefill,
                    "--decode", *decode, *extra_args]
        self.startup_timeout_s = startup_timeout_s
        self.healthy = healthy      # /health codes that count as started (503: no backend up yet)
        self.proc: subprocess.Popen | None = None
        self.log = None

    def start(self) -> ProxyProcess:
        path = scratch.log_file(f"aiolayer-proxy-{self.port}.log")
        self.log = open(path, "w+b")
        # its own group (stop() signals it whole), and it dies with the test process if that is killed
        # (the death signal follows the forking thread: only the main thread's lives as long as the process)
        preexec = die_with_parent if threading.current_thread() is threading.main_thread() else None
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=preexec)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1, trust_env=False).status_code in self.healthy:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                text = self.log_text()
                self.stop()
                raise RuntimeError(f"proxy not healthy within {self.startup_timeout_s} s:\n{text}")
            time.sleep(0.2)

    def log_text(self) -> str:
        if self.log is None or self.log.closed:
            return ""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5, trust_env=False).text

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if self.log is not None and not self.log.closed:
            self.log.close()

    def __enter__(self) -> ProxyProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclasses.dataclass
class Handoff:
    decode: Completion      # D's answer: the request's tokens
    prefill: Completion     # P's one-token answer
    registration: Any       # D's AllocReply: block_ids, first_block (> 0 after a prefix-cache hit at D)


class DirectFlow:
    """The D-first flow without the proxy: D parks and registers, a LookupRequest on D's control socket
    returns its blocks, then P prefills with ``max_tokens`` 1 and pushes the KV into them."""

    def __init__(self, p: VllmServer, p_port: int, d: VllmServer, d_port: int, *, timeout_s: float = 60.0) -> None:
        self.p, self.d = p, d
        self.p_ctl, self.d_ctl = control(p_port), control(d_port)
        self.timeout_s = timeout_s
        self.client = None

    def __enter__(self) -> DirectFlow:
        from aiolayer import NodeConfig, Runtime

        self.client = Runtime(NodeConfig(engine_id=f"direct-{uuid.uuid4().hex[:6]}", backend="memory")).start()
        return self

    def __exit__(self, *exc) -> None:
        self.client.stop()

    def _lookup(self, tid: str, token: str, deadline: float):
        from aiolayer.protocol import messages as m

        while True:
            try:
                return self.client.request(self.d_ctl, m.LookupRequest(transfer_id=tid, token=token), timeout=2.0)
            except Exception:  # noqa: BLE001 - D registers once its scheduler parked the request
                if time.monotonic() > deadline:
                    raise TimeoutError(f"D never registered transfer {tid}") from None
                time.sleep(0.02)

    def run(self, prompt, *, max_tokens: int = 12, stream: bool = False, path: str = "/v1/completions") -> Handoff:
        tid, token = uuid.uuid4().hex, secrets.token_hex(16)
        deadline = time.monotonic() + self.timeout_s
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            d_future = pool.submit(completion, self.d, prompt, max_tokens=max_tokens, stream=stream, path=path,
                                   timeout_s=self.timeout_s, kv_transfer_params={"aiolayer": {
                                       "transfer_id": tid, "token": token, "prefill_controls": [self.p_ctl]}})
            try:
                reg = self._lookup(tid, token, deadline)
            except TimeoutError:
                d_future.result(timeout=self.timeout_s)   # D's own error, if it has one, says more
                raise
            p_out = completion(self.p, prompt, max_tokens=1, path=path, timeout_s=self.timeout_s,
                               kv_transfer_params={"aiolayer": {
                                   "transfer_id": tid, "token": token, "dst_blocks": reg.block_ids,
                                   "decode_ranks": [{"decode_control": self.d_ctl, "dst_incarnation": reg.incarnation}],
                                   "first_block": reg.first_block}})
            return Handoff(d_future.result(timeout=max(1.0, deadline - time.monotonic())), p_out, reg)
