"""The soak's default KV shape: the defaults of ``aiolayer bench soak``'s shape flags, importable (for its
--help) without what the soak itself imports."""

from __future__ import annotations

from typing import Any

# A small model: the soak is about many transfers and faults, not bytes (4 KiB blocks).
SOAK_SHAPE: dict[str, Any] = dict(num_layers=4, block_size=16, kv_heads=2, head_dim=64, dtype="float16")
