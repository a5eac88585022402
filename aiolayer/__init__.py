"""aiolayer: asyncio-native layer-wise KV-cache transfer from a prefill engine (P) to a decode engine (D).

The public embedding API (docs/embedding.md): ``Runtime`` (one per process; P calls ``begin_step``,
D calls ``receive``), the value types it takes and gives, the config types and the exception tree
(also in ``aiolayer.errors``). Everything a user needs is importable from here. Names are loaded
lazily so that ``aiolayer.protocol`` can be imported without asyncio, zmq or torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    **dict.fromkeys(("KVShape", "NodeConfig", "Timeouts"), "aiolayer.config"),
    "Runtime": "aiolayer.runtime.runtime",
    **dict.fromkeys(("TransferSpec", "Outcome", "LayerTiming"), "aiolayer.runtime.spec"),
    **dict.fromkeys(("ReceiveSpec", "Registration", "Step", "Identity"), "aiolayer.runtime.api"),
    "Received": "aiolayer.runtime.receiver",
    **dict.fromkeys(("HeadGeometry", "RankRoute", "map_ranks"), "aiolayer.protocol.plan"),
    "MIN_TOKEN_CHARS": "aiolayer.protocol.checks",
    "ControlPeers": "aiolayer.runtime.control",   # control calls from a driver's own asyncio loop (a proxy)
    "DecodeNode": "aiolayer.node",
    **dict.fromkeys((
        "AiolayerError", "ConfigError", "DeadlineExceeded", "RuntimeStateError", "BridgeClosed", "BridgeFull",
        "ControlError", "ControlTimeout", "ControlRejected", "ProtocolError", "MetadataError", "LayoutMismatch",
        "StaleLayout", "TransferError", "BackendError", "TransferTimeout", "WriteRefused", "TransferFailed",
        "UnknownTransfer",
    ), "aiolayer.errors"),
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aiolayer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
