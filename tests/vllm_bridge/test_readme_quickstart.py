"""The README's vLLM quickstart for CPU hosts, run as written.

Each block is the fenced ``bash`` block right after its marker comment in README.md
(``<!-- quickstart:cpu-p -->``, ``cpu-d``, ``proxy``, ``curl``) and runs unchanged under ``bash -c``.
The blocks take their model, ports and cores from ``${VAR:-default}``, so the test sets only those in the
environment: the tiny offline model, free ports, and this process's first two CPUs. Everything else (the
vLLM CPU settings, the connector's configuration, the proxy's flags, the request) is the README's own:
the environment is cleared of the vLLM CPU variables the blocks must set themselves.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = ("cpu-p", "cpu-d", "proxy", "curl")
# what the blocks must set themselves: taken out of the environment they run in
SET_BY_THE_README = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_TARGET_DEVICE")
SHM_PREFIXES = ("psm_", "wnsm_", "vllm")   # vLLM's message queues and CPU shared-memory buffers


def quickstart_blocks() -> dict[str, str]:
    text = README.read_text(encoding="utf-8")
    blocks = {}
    for name in BLOCKS:
        found = re.findall(rf"<!-- quickstart:{name} -->\s*\n```bash\n(.*?)\n```", text, re.DOTALL)
        assert len(found) == 1, f"README.md needs exactly one ```bash block after <!-- quickstart:{name} -->"
        blocks[name] = found[0]
    return blocks


def test_the_quickstart_blocks_are_in_the_readme_and_parse():
    for name, block in quickstart_blocks().items():
        checked = subprocess.run(["bash", "-n", "-c", block], capture_output=True, text=True, timeout=10,
                                 check=False)
        assert checked.returncode == 0, f"{name}: {checked.stderr}"
        assert "MODEL=${MODEL:-" in block or name == "proxy", f"{name}: the model must be a ${{MODEL:-...}} default"


def _environment(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SET_BY_THE_README}
    # `python`, `vllm` and `aiolayer` resolve in the virtual environment running this test, as after the
    # README's install
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # the tiny model is a local folder: nothing may reach for the network
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.update(values)
    return env


def _server_class():
    from aiolayer.harness.servers import VllmServer

    @dataclasses.dataclass(eq=False)
    class ReadmeBlock(VllmServer):
        """A README block under ``bash -c``, supervised like a vLLM server: its own process group, ready
        when /health and /v1/models answer on ``port``, stopped group-wide with its /dev/shm segments."""

        script: str = ""
        script_env: Mapping[str, str] = dataclasses.field(default_factory=dict)

        def command(self) -> list[str]:
            return ["bash", "-c", self.script]

        def environment(self) -> dict[str, str]:
            return dict(self.script_env)

    return ReadmeBlock


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_the_readme_quickstart_serves_a_completion_with_kv_moved_from_p_to_d(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is installed by `make test`")
    from aiolayer.harness.procs import free_ports, shm_in_use
    from aiolayer.harness.servers import scrape_metrics, wait_started
    from aiolayer.harness.tiny_model import LLAMA_GQA, tiny_model_dir

    blocks = quickstart_blocks()
    cpus = sorted(os.sched_getaffinity(0))
    names = ("P_PORT", "D_PORT", "PROXY_PORT", "P_CONTROL", "D_CONTROL")
    base = free_ports(len(names))   # consecutive free ports below the ephemeral range
    ports = {name: str(base + i) for i, name in enumerate(names)}
    env = _environment(MODEL=str(tiny_model_dir(LLAMA_GQA)), P_CORES=str(cpus[0]),
                       D_CORES=str(cpus[1] if len(cpus) > 1 else cpus[0]), **ports)
    readme_block = _server_class()

    def block(name: str, port: str):
        return readme_block(env["MODEL"], name=f"readme-{name}", port=int(port), log_dir=tmp_path,
                            script=blocks[name], script_env=env, startup_timeout_s=240)

    started, segments = [], set()
    try:
        # P and D start together (as a user's two terminals would), the proxy once both serve
        started += [block("cpu-p", env["P_PORT"]).spawn(), block("cpu-d", env["D_PORT"]).spawn()]
        wait_started(*started)
        started.append(block("proxy", env["PROXY_PORT"]).start())
        for server in started:
            segments |= {n for n in shm_in_use(server.pids()) if n.startswith(SHM_PREFIXES)}
        d = started[1]
        # vLLM's IPC sockets go to each tree's own TMPDIR (removed at stop), not the host's
        assert all(any(p.is_socket() for p in s.tmp_dir.iterdir()) for s in started[:2])

        answer = subprocess.run(["bash", "-c", blocks["curl"]], env=env, capture_output=True, text=True,
                                timeout=120, check=False)
        assert answer.returncode == 0, answer.stderr
        body = json.loads(answer.stdout)   # an error would be {"error": ...} (the proxy's 4xx/5xx bodies)
        assert body.get("object") == "text_completion", body
        assert body["choices"][0]["text"].strip(), body
        assert body["usage"]["completion_tokens"] > 0, body

        def received() -> float:
            return sum(v for _, v in scrape_metrics(d).get("vllm:aiolayer_bytes_received_total", []))

        deadline = time.monotonic() + 20   # an engine's last step stats reach /metrics after D's answer
        while received() <= 0:
            assert time.monotonic() < deadline, "D's vllm:aiolayer_bytes_received_total stayed 0: no KV moved"
            time.sleep(0.5)
    finally:
        for server in reversed(started):
            segments |= {n for n in shm_in_use(server.pids()) if n.startswith(SHM_PREFIXES)}
            server.stop()
    left = sorted(name for name in segments if (Path("/dev/shm") / name).exists())
    assert not left, f"shared-memory segments left behind: {left}"
    assert not [s.tmp_dir for s in started if s.tmp_dir.exists()]
