"""aiolayer: asyncio-native layer-wise KV-cache transfer from a prefill engine (P) to a decode engine (D).

The public embedding API: ``Runtime`` (one per process), its ``sender`` (P) and ``receiver`` (D),
``TransferSpec``, the config types and the exception tree in ``aiolayer.errors``. Names are loaded
lazily so that ``aiolayer.protocol`` can be imported without asyncio, zmq or torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "KVShape": "aiolayer.config", "NodeConfig": "aiolayer.config", "Timeouts": "aiolayer.config",
    "Runtime": "aiolayer.runtime.runtime", "TransferSpec": "aiolayer.runtime.sender",
    "Outcome": "aiolayer.runtime.sender", "DecodeNode": "aiolayer.node",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aiolayer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
