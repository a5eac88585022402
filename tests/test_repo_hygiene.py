"""The repository stands alone: no tracked file names a path outside it, and none speaks of an issue
tracker or a work log (a clone has only the repo: its files speak of the product)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE = re.compile(r"\.\./shared|(?<![\w/.-])shared/notes|(?<![\w/.-])notes/[\w-]+\.md")
# a tracker's or a work log's numbering: the word issue, session or finding and a number (any case)
TRACKER = r"session [0-9]|issue ?[0-9]+|finding [0-9]"


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=30).stdout
    return [ROOT / name for name in out.splitlines() if (ROOT / name).is_file()]


def test_no_file_names_a_path_outside_the_repo():
    offenders = []
    for path in tracked_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line) and path.name != "test_repo_hygiene.py":
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not offenders, "files point outside the repo:\n" + "\n".join(offenders)


def test_the_design_docs_exist():
    for name in ("design.md", "fencing.md", "mooncake.md", "vllm.md", "seed-fragilities.md"):
        assert (ROOT / "docs" / name).is_file(), f"docs/{name} is missing"


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_no_file_or_file_name_carries_a_tracker_number():
    try:
        top = _git("rev-parse", "--show-toplevel")
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != ROOT:
        pytest.skip("not a git checkout of the repository")
    names = _git("ls-files", "-co", "--exclude-standard").stdout.splitlines()
    bad_names = [name for name in names if re.search(TRACKER, name, re.IGNORECASE)]
    found = _git("grep", "-n", "-I", "-i", "-E", "--untracked", TRACKER)
    assert found.returncode in (0, 1), found.stderr        # 1: no line matched
    lines = [line[:160] for line in found.stdout.splitlines()]
    assert not bad_names and not lines, "tracker numbers in the repository:\n" + "\n".join(bad_names + lines)
