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


def _design_layout() -> set[str]:
    """The paths docs/design.md's layout tree names, from its indentation (two spaces a level)."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    paths, stack = set(), []
    for line in block.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        del stack[depth:]
        paths.add("/".join([*stack, name.rstrip("/")]))
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
    return paths


def test_the_design_layout_names_every_runtime_module_in_its_folder():
    runtime = ROOT / "aiolayer" / "runtime"
    modules = {str(path.relative_to(ROOT)) for path in runtime.rglob("*.py")
               if path.name != "__init__.py"}
    listed = _design_layout()
    assert modules - listed == set(), f"docs/design.md's layout misses {sorted(modules - listed)}"
    stale = {path for path in listed if path.startswith("aiolayer/runtime/") and path.endswith(".py")} - modules
    assert not stale, f"docs/design.md's layout names modules that are gone: {sorted(stale)}"


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


# ---------------------------------------------------------------- the documentation

README_MAX_LINES = 250   # the README is for users: what, quickstart, configuration, operations; the rest is in docs/
MARKDOWN_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def documentation() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md",
            ROOT / "harness" / "README.md", ROOT / "examples" / "README.md"]


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks, inline code removed (neither holds links or headings)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"`[^`]*`", lambda m: m.group(0).strip("`"), line) if line.startswith("#")
                         else re.sub(r"`[^`]*`", "", line))
    return lines


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the file's headings: lower case, punctuation dropped, spaces to hyphens,
    repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text(encoding="utf-8")):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move details to docs/"


def test_every_relative_link_in_the_documentation_points_at_something_that_exists():
    broken = []
    for doc in documentation():
        for line in _prose(doc.read_text(encoding="utf-8")):
            for target in MARKDOWN_LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto:
                    continue
                name, _, anchor = target.partition("#")
                dest = (doc.parent / name).resolve() if name else doc
                if not dest.exists():
                    broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)
