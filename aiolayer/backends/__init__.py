"""Transfer backends: the data plane behind one small interface (``base.TransferBackend``)."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .base import TransferBackend


def make_backend(name: str, **options: Any) -> TransferBackend:
    """Build a backend by name; constructing does no I/O (``open`` does)."""
    if name == "mooncake":
        from .mooncake import MooncakeBackend
        return MooncakeBackend(**options)
    if name == "memory":
        from .memory import MemoryBackend
        options.pop("transport", None)   # in-process: no network to configure
        return MemoryBackend(**options)
    raise ConfigError(f"unknown backend {name!r}")
