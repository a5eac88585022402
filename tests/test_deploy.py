"""The container files in deploy/ say what the README says: the compose services run the README's
quickstart blocks as written, the CPU image runs the README's CPU install steps, and the CUDA image
builds and installs the two wheels the way docs/operations.md gives (the way tests/test_packaging.py
builds and installs them in a fresh venv). No docker here: the files are read, not run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
DEPLOY = ROOT / "deploy"


def readme_block(marker: str) -> str:
    found = re.findall(rf"<!-- {marker} -->\s*\n```bash\n(.*?)\n```", README, re.DOTALL)
    assert len(found) == 1, f"README.md needs exactly one ```bash block after <!-- {marker} -->"
    return found[0]


def commands(script: str) -> list[list[str]]:
    """Shell lines as token lists, comments dropped, ``a && b`` as two commands, ``sudo`` dropped."""
    out: list[list[str]] = []
    for line in script.replace("\\\n", " ").splitlines():
        current: list[str] = []
        for token in shlex.split(line, comments=True):
            if token == "&&":
                out.append(current)
                current = []
            elif not (token == "sudo" and not current):
                current.append(token)
        if current:
            out.append(current)
    return out


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, its argument) per instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"^\s*#.*\n", "", dockerfile.read_text(encoding="utf-8"), flags=re.MULTILINE)
    text = text.replace("\\\n", " ")
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
            for line in text.splitlines() if line.strip()]


def run_commands(dockerfile: Path) -> list[list[str]]:
    return [cmd for kind, arg in instructions(dockerfile) if kind == "RUN" for cmd in commands(arg)]


def in_order(wanted: list[list[str]], have: list[list[str]]) -> list[list[str]]:
    """The commands of ``wanted`` not found in ``have`` in that order ([] when all are)."""
    rest = iter(have)
    return [cmd for cmd in wanted if not any(cmd == got for got in rest)]


def test_compose_services_run_the_readme_quickstart_blocks_as_written():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text(encoding="utf-8"))
    services = compose["services"]
    assert set(services) == {"prefill", "decode", "proxy"}
    for service, marker in (("prefill", "quickstart:cpu-p"), ("decode", "quickstart:cpu-d"),
                            ("proxy", "quickstart:proxy")):
        spec = services[service]
        assert spec["command"][:2] == ["bash", "-c"], service
        script = spec["command"][2].rstrip("\n")
        # compose replaces a lone `$` itself: every `$` of the block is written `$$`
        assert not re.search(r"(?<!\$)\$(?:\$\$)*(?!\$)", script), f"{service}: a `$` compose would interpolate"
        assert script.replace("$$", "$") == readme_block(marker), service
        assert spec["network_mode"] == "host", f"{service}: the blocks' 127.0.0.1 addresses are the host's"
        assert spec["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile.cpu"}, service
    assert set(services["proxy"]["depends_on"]) == {"prefill", "decode"}


def test_cpu_image_runs_the_readme_cpu_install_steps():
    steps = commands(readme_block("install:cpu"))
    activate = [".", ".venv/bin/activate"]
    assert activate in steps, "the README's install activates its venv"
    wanted = [cmd for cmd in steps if cmd != activate]
    dockerfile = DEPLOY / "Dockerfile.cpu"
    assert not in_order(wanted, run_commands(dockerfile)), in_order(wanted, run_commands(dockerfile))
    # `. .venv/bin/activate` in an image: the venv's bin first on PATH, set right after the venv is made
    kinds = instructions(dockerfile)
    venv = next(i for i, (kind, arg) in enumerate(kinds) if kind == "RUN" and "-m venv .venv" in arg)
    workdir = next(arg for kind, arg in kinds if kind == "WORKDIR")
    assert kinds[venv + 1] == ("ENV", f"PATH={workdir}/.venv/bin:$PATH")
    copy = next(i for i, (kind, arg) in enumerate(kinds) if kind == "COPY")
    assert copy < venv, "the checkout is in the image before the install (`pip install .`)"


def test_cuda_image_builds_and_installs_the_two_wheels_as_documented():
    """docs/operations.md: `pip wheel --no-deps -w dist . ./bridges/vllm`, then both wheels plus the CUDA
    host's Mooncake build (and vLLM's CUDA wheel through the bridge's `vllm` extra). tests/test_packaging.py
    builds these wheels the same way (--no-deps, -w) and installs them into a fresh venv."""
    ops = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    assert "`pip wheel --no-deps -w dist . ./bridges/vllm`" in ops
    run = run_commands(DEPLOY / "Dockerfile")
    assert ["pip", "wheel", "--no-deps", "-w", "/wheels", ".", "./bridges/vllm"] in run
    install = next(cmd for cmd in run if cmd[:2] == ["pip", "install"])
    assert install[2:] == ["/wheels/aiolayer-*.whl", "$(echo /wheels/aiolayer_vllm-*.whl)[vllm]",
                           "mooncake-transfer-engine"]
    assert ["python", "-c", "import vllm, aiolayer_vllm"] in run
    assert ["apt-get", "install", "-y", "python3", "python3-venv", "libibverbs1"] in run   # Mooncake's library
    froms = [arg for kind, arg in instructions(DEPLOY / "Dockerfile") if kind == "FROM"]
    assert froms[-1].startswith("nvidia/cuda:"), froms
    packaging = (ROOT / "tests" / "test_packaging.py").read_text(encoding="utf-8")
    assert '"wheel", "-q", "--no-deps"' in packaging and '"-w"' in packaging   # the same wheel build there
