"""Both distributions build wheels that carry every subpackage (an editable dev install hides a missing one)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# folders the core's pyproject maps into its package (``package-dir``): the benchmark and the test harness
MAPPED = {"aiolayer.bench": ROOT / "bench", "aiolayer.harness": ROOT / "harness"}


def build_wheel(project: Path, out: Path) -> Path:
    # no build isolation: the venv's setuptools builds offline and in seconds; setuptools builds in
    # the tree, and a build/ left from an earlier run could carry removed modules into the wheel
    shutil.rmtree(project / "build", ignore_errors=True)
    try:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "-w", str(out), str(project)],
                       check=True, capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(project / "build", ignore_errors=True)
    (wheel,) = out.glob("*.whl")
    return wheel


def packages_under(root: Path, top: str) -> set[str]:
    found = {str(init.parent.relative_to(root)).replace("/", ".") for init in (root / top).rglob("__init__.py")
             if "__pycache__" not in init.parts}
    for name, folder in (MAPPED if top == "aiolayer" else {}).items():
        found |= {".".join([name, *init.parent.relative_to(folder).parts]) for init in folder.rglob("__init__.py")
                  if "__pycache__" not in init.parts}
    return found


@pytest.mark.parametrize("project, top", [(ROOT / "bridges" / "vllm", "aiolayer_vllm"), (ROOT, "aiolayer")])
def test_wheel_carries_every_subpackage(tmp_path, project, top):
    """Every subpackage (bench/ and harness/ under aiolayer), the PEP 561 marker (the packages are typed)
    and the license; nothing else at the top (no tests)."""
    wheel = build_wheel(project, tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    tops = {name.split("/")[0] for name in names if ".dist-info/" not in name}
    assert tops == {top}, f"{wheel.name} carries {sorted(tops - {top})} beside {top}"
    in_wheel = {str(Path(name).parent).replace("/", ".") for name in names if name.endswith("__init__.py")}
    missing = packages_under(project, top) - in_wheel
    assert not missing, f"{wheel.name} lacks {sorted(missing)}"
    assert f"{top}/py.typed" in names, f"{wheel.name} does not say it is typed (py.typed)"
    assert any(n.endswith((".dist-info/licenses/LICENSE", ".dist-info/LICENSE")) for n in names), \
        f"{wheel.name} carries no LICENSE"


def test_subcommands_come_from_entry_points_and_the_core_imports_no_bridge():
    from aiolayer import cli, doctor_checks

    plugins = cli.command_plugins()
    assert {"bench", "proxy"} <= set(plugins), plugins
    assert all(error is None for _, error in plugins.values()), plugins
    checkers = doctor_checks.config_checkers()   # the doctor's config check is the bridge's, registered
    assert callable(checkers.get("vllm")), checkers
    assert checkers["vllm"]({"transport": {"advertise_hots": "x"}}, None)[0].count("advertise_hots") == 1
    conflict = checkers["vllm"]({"control_port": 5700}, {"kv_port": 5600})   # vLLM would refuse to start
    assert conflict is not None and "conflicts with kv_transfer_config kv_port=5600" in conflict[0], conflict
    source = (ROOT / "aiolayer" / "cli.py").read_text()
    assert "aiolayer_vllm" not in source and "aiolayer_bench" not in source


@pytest.mark.timeout(900)
def test_built_wheels_install_and_run_in_a_fresh_venv(tmp_path):
    """The wheels a user installs, not the editable dev install: both distributions, non-editable,
    into a venv of their own (dependencies from PyPI), run from outside the checkout."""
    wheels = tmp_path / "wheels"
    core = build_wheel(ROOT, wheels / "core")
    bridge = build_wheel(ROOT / "bridges" / "vllm", wheels / "bridge")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py, cli = venv / "bin" / "python", venv / "bin" / "aiolayer"
    done = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           f"aiolayer[mooncake] @ {core.as_uri()}", str(bridge)],
                          capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stderr[-3000:]

    def run(*argv: str) -> str:
        out = subprocess.run(list(argv), cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"{argv}: {out.stderr[-2000:]}"
        return out.stdout

    assert "proxy" in run(str(cli), "--help") and "bench" in run(str(cli), "--help")
    assert "--prefill" in run(str(cli), "proxy", "--help")
    where = run(str(py), "-c", "import aiolayer, aiolayer_vllm.proxy; print(aiolayer.__file__)")
    assert str(venv) in where and str(ROOT) not in where, where          # the wheel's, not the checkout's
    assert run(str(py), "-c", "import importlib.util as u; print(u.find_spec('torch') is None)").strip() == "True"
    _node_starts_and_stops(cli, tmp_path)


def _node_starts_and_stops(cli: Path, cwd: Path) -> None:
    """``aiolayer node`` on the real Mooncake backend, from the wheel: one JSON line, exit 0 on SIGTERM."""
    import json
    import select
    import signal

    proc = subprocess.Popen([str(cli), "node", "--role", "decode", "--num-layers", "2", "--num-blocks", "8"],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "aiolayer node printed nothing within 60 s"
        info = json.loads(proc.stdout.readline())
        assert info["control"].startswith("tcp://") and info["backend"] == "mooncake", info
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
