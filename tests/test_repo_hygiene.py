"""The repository stands alone: no tracked file names a path outside it (a clone has only the repo)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE = re.compile(r"\.\./shared|(?<![\w/.-])shared/notes|(?<![\w/.-])notes/[\w-]+\.md")


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
