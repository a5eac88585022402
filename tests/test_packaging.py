"""Both distributions build wheels that carry every subpackage (an editable dev install hides a missing one)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def build_wheel(project: Path, out: Path) -> Path:
    # no build isolation: the venv's setuptools builds offline and in seconds
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(out), str(project)],
                   check=True, capture_output=True, text=True, timeout=300)
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
