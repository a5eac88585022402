"""asyncio names that arrived in Python 3.11, with the backport on 3.10."""

import sys

if sys.version_info >= (3, 11):
    from asyncio import TaskGroup, timeout
else:  # pragma: no cover - exercised only on 3.10
    from taskgroup import TaskGroup, timeout

__all__ = ["TaskGroup", "timeout"]
