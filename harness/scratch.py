"""The temporary files of the processes the harness starts, removed again.

Each vLLM server's process tree gets a private ``TMPDIR``: vLLM puts its ZMQ IPC sockets and
torch.distributed's rendezvous file there (a set per engine, left behind by an engine that is
killed), and it is removed once the tree is gone. Inductor's compile cache stays where it was (it
follows ``TMPDIR`` otherwise, and every engine would compile from scratch). Logs the harness made a
place for are removed when this process exits, unless ``AIOLAYER_KEEP_LOGS=1``: their tails are in
every failure's message, and the debug timeline is read from them.
"""

from __future__ import annotations

import atexit
import getpass
import os
import re
import shutil
import tempfile
from pathlib import Path

KEEP_LOGS_ENV = "AIOLAYER_KEEP_LOGS"
_LOGS: list[Path] = []


def private_tmp() -> Path:
    """A fresh directory to be a process tree's ``TMPDIR`` (``tree_env``); ``remove`` it after the tree."""
    return Path(tempfile.mkdtemp(prefix="aiolayer-tmp-"))


def tree_env(tmp: Path) -> dict[str, str]:
    """The environment that gives a process tree ``tmp`` as its temporary directory."""
    return {"TMPDIR": str(tmp), "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            or _inductor_cache_default()}


def _inductor_cache_default() -> str:
    """torch._inductor's default cache directory as this process would compute it (without importing torch)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def log_dir(prefix: str) -> Path:
    """A fresh directory for logs, removed at this process's exit (unless ``AIOLAYER_KEEP_LOGS``)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    _LOGS.append(path)
    return path


def log_file(name: str) -> Path:
    """A log file's path in the temporary directory, removed at this process's exit (as ``log_dir``)."""
    path = Path(tempfile.gettempdir()) / name
    _LOGS.append(path)
    return path


def remove(path: Path | None) -> None:
    if path is None:
        return
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@atexit.register
def _remove_logs() -> None:
    if os.environ.get(KEEP_LOGS_ENV, "") not in ("", "0"):
        return
    for path in _LOGS:
        remove(path)
