"""Where a result file came from: when (UTC), which commit of which tree, which host and CPU, which command.

Every JSON the benchmark writes carries it (``write_result``), so a figure quoted in the docs, which
names its date, commit, host and command, can be traced to the file it came from.
"""

from __future__ import annotations

import datetime
import json
import platform
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from aiolayer import __version__

GIT_TIMEOUT_S = 10.0


def provenance() -> dict[str, Any]:
    return {"utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": _commit(), "host": socket.gethostname(), "cpu": _cpu_model(),
            "command": shlex.join(sys.argv), "aiolayer": __version__, "python": platform.python_version()}


def write_result(path: Path, result: dict[str, Any], indent: int = 2) -> Path:
    """``result`` as JSON at ``path``, its provenance first."""
    path.write_text(json.dumps({"provenance": provenance(), **result}, indent=indent) + "\n")
    return path


def _commit() -> str:
    """``git describe`` of the tree this code runs from ("-dirty" with uncommitted changes)."""
    tree = Path(__file__).resolve().parents[1]
    try:
        done = subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty", "--abbrev=12"],
                              capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({type(exc).__name__})"
    return done.stdout.strip() if done.returncode == 0 else "unknown (not run from a git checkout)"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
