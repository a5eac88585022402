"""Both distributions build wheels that carry every subpackage (an editable dev install hides a missing one)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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
    return {str(init.parent.relative_to(root)).replace("/", ".") for init in (root / top).rglob("__init__.py")
            if "__pycache__" not in init.parts}


@pytest.mark.parametrize("project, top", [(ROOT / "bridges" / "vllm", "aiolayer_vllm"), (ROOT, "aiolayer")])
def test_wheel_carries_every_subpackage(tmp_path, project, top):
    wheel = build_wheel(project, tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = {str(Path(name).parent).replace("/", ".") for name in zf.namelist() if name.endswith("__init__.py")}
    missing = packages_under(project, top) - in_wheel
    assert not missing, f"{wheel.name} lacks {sorted(missing)}"


def test_subcommands_come_from_entry_points_and_the_core_imports_no_bridge():
    from aiolayer import cli

    plugins = cli.command_plugins()
    assert {"bench", "proxy"} <= set(plugins), plugins
    assert all(error is None for _, error in plugins.values()), plugins
    source = (ROOT / "aiolayer" / "cli.py").read_text()
    assert "aiolayer_vllm" not in source and "aiolayer_bench" not in source
