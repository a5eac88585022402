"""vLLM's own P/D connectors as rows of ``aiolayer bench vllm``, each class unmodified and driven
through its own request flow (vLLM's example proxies, played by the bench itself: one HTTP hop less
than aiolayer's row, which goes through ``aiolayer proxy``).

- ``mooncake``: ``MooncakeConnector`` over Mooncake TCP. As shipped it cannot start on a CPU host
  (``torch.accelerator.current_device_index()``: "Cannot access accelerator device when none is
  available"); ``shim_mooncake`` answers 0 there and re-exports the class. P and D get the
  request at the same time; D pulls through P's bootstrap server. On a host with AMX the shim also asks
  for the process's AMX tile state, which vLLM's AMX kernel leaves unasked (docs/vllm.md).
- ``nixl``: ``NixlConnector`` with a DRAM buffer (``kv_buffer_device: cpu``). Its UCX progress thread
  spins a core per idle engine (TTFT in seconds on 2 cores), so ``shim_nixl`` creates the agent
  with ``enable_prog_thread=False``. P first (``max_tokens`` 1); its ``kv_transfer_params`` go to D.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import uuid
from pathlib import Path

import httpx

from aiolayer.harness.client import acompletion
from aiolayer.harness.node import mooncake_env
from aiolayer.harness.procs import free_port
from aiolayer.harness.startup import running

from .place import of_args

ROWS = ("mooncake", "nixl")
SHIMS = "aiolayer.bench.engines.shim"
TIMEOUT_S = 300.0


def _alone(p):
    """P answering by itself (no kv_transfer_params: no D, no transfer), as ``run._measure_paired`` calls it."""
    async def complete(text: str, max_tokens: int):
        return await acompletion(p, text, max_tokens=max_tokens, stream=True, timeout_s=TIMEOUT_S)
    return complete


def _engines(model: Path, args: argparse.Namespace, cfg: dict, envs: tuple[dict, dict]):
    p_core, d_core = args.cores.split(",")[:2]
    where = of_args(args)
    p = where.p.engine(model, "prefill", p_core, args, env=envs[0],
                       kv_transfer_config={**cfg, "kv_role": "kv_producer"})
    d = where.d.engine(model, "decode", d_core, args, env=envs[1],
                       kv_transfer_config={**cfg, "kv_role": "kv_consumer"})
    return p, d


@contextlib.contextmanager
def mooncake(model: Path, args: argparse.Namespace):
    where = of_args(args)
    boot_p, boot_d = free_port(), free_port()
    base = {**mooncake_env(), "VLLM_HOST_IP": "127.0.0.1", "MC_FORCE_TCP": "1"}   # two hosts: each its address
    cfg = {"kv_connector": "MooncakeConnector", "kv_connector_module_path": f"{SHIMS}_mooncake",
           "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
    p, d = _engines(model, args, cfg, ({**base, "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot_p)},
                                       {**base, "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot_d)}))
    with running(p, d):
        bootstrap = f"http://{where.p.address}:{boot_p}"   # D's way to P (the bootstrap binds every address)
        engine_id = httpx.get(f"http://{where.p.reach}:{boot_p}/query", timeout=10,
                              trust_env=False).json()["0"]["engine_id"]

        async def complete(text: str, max_tokens: int):
            tid = uuid.uuid4().hex
            to_p = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
            to_d = {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": tid,
                    "remote_bootstrap_addr": bootstrap, "remote_engine_id": engine_id}
            _, out = await asyncio.gather(
                acompletion(p, text, max_tokens=1, kv_transfer_params=to_p, timeout_s=TIMEOUT_S),
                acompletion(d, text, max_tokens=max_tokens, kv_transfer_params=to_d, stream=True,
                            timeout_s=TIMEOUT_S))
            return out

        yield complete, {"flow": "P and D at once (vLLM's example proxy), by the bench",
                         "connector": "MooncakeConnector, unmodified class, CPU shim",
                         "transport": f"Mooncake TCP, {where.label}", "_p_alone": _alone(p)}


def _nixl_env(side) -> dict:
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": side.address, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    if side.dev:   # two hosts share this machine's memory: UCX would pick shared memory, not the link
        env |= {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": side.dev}
    return env


@contextlib.contextmanager
def nixl(model: Path, args: argparse.Namespace):
    where = of_args(args)
    cfg = {"kv_connector": "NixlConnector", "kv_connector_module_path": f"{SHIMS}_nixl",
           "kv_buffer_device": "cpu"}
    p, d = _engines(model, args, cfg, (_nixl_env(where.p), _nixl_env(where.d)))
    with running(p, d):
        async def complete(text: str, max_tokens: int):
            first = await acompletion(p, text, max_tokens=1, timeout_s=TIMEOUT_S,
                                      kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
            if not first.kv_transfer_params:
                raise RuntimeError("P answered without kv_transfer_params")
            out = await acompletion(d, text, max_tokens=max_tokens, stream=True, timeout_s=TIMEOUT_S,
                                    kv_transfer_params=first.kv_transfer_params)
            # the user waits for P's answer too: the first token comes that much after the request
            return dataclasses.replace(out, ttft_s=first.elapsed_s + (out.ttft_s or 0.0),
                                       elapsed_s=first.elapsed_s + out.elapsed_s)

        yield complete, {"flow": "P first, then D with P's kv_transfer_params (vLLM's example proxy), by the bench",
                         "connector": "NixlConnector, unmodified class, UCX progress thread off",
                         "transport": "UCX (NIXL 1.5), DRAM buffers"
                                      + (f", UCX_TLS=tcp,self on {where.label}" if where.two_hosts else ""),
                         "_p_alone": _alone(p)}


SYSTEMS = {"mooncake": mooncake, "nixl": nixl}
