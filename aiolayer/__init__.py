"""aiolayer: asyncio-native layer-wise KV-cache transfer from a prefill engine (P) to a decode engine (D).

The public embedding API (docs/embedding.md): ``Runtime`` (one per process; P calls ``begin_step``,
D calls ``receive``), the value types it takes and gives, the config types and the exception tree
(also in ``aiolayer.errors``). Everything a user needs is importable from here. Names are loaded
lazily so that ``aiolayer.protocol`` can be imported without asyncio, zmq or torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__

_EXPORTS = {
    **dict.fromkeys(("KVShape", "NodeConfig", "Timeouts"), "aiolayer.config"),
    "Transport": "aiolayer.transport",   # NodeConfig(transport=...): where it listens, how the KV travels
    "Runtime": "aiolayer.runtime.runtime",
    **dict.fromkeys(("TransferSpec", "Outcome", "LayerTiming"), "aiolayer.runtime.spec"),
    **dict.fromkeys(("ReceiveSpec", "Registration", "Step", "Identity"), "aiolayer.runtime.api"),
    "Received": "aiolayer.runtime.receive.entry",
    **dict.fromkeys(("HeadGeometry", "RankRoute", "map_ranks"), "aiolayer.protocol.plan"),
    "MIN_TOKEN_CHARS": "aiolayer.protocol.checks",
    "ControlPeers": "aiolayer.runtime.control.plane",   # control calls from a driver's own asyncio loop (a proxy)
    "DecodeNode": "aiolayer.node",
    **dict.fromkeys((
        "AiolayerError", "ConfigError", "DeadlineExceeded", "RuntimeStateError", "BridgeClosed", "BridgeFull",
        "ControlError", "ControlTimeout", "ControlRejected", "ProtocolError", "MetadataError", "LayoutMismatch",
        "StaleLayout", "TransferError", "BackendError", "TransferTimeout", "WriteRefused", "TransferFailed",
        "UnknownTransfer",
    ), "aiolayer.errors"),
}
__all__ = [*_EXPORTS, "__version__"]

# What type checkers and IDEs see (``X as X``: a re-export); at run time ``__getattr__`` loads each on first use.
if TYPE_CHECKING:
    from .config import KVShape as KVShape
    from .config import NodeConfig as NodeConfig
    from .config import Timeouts as Timeouts
    from .errors import AiolayerError as AiolayerError
    from .errors import BackendError as BackendError
    from .errors import BridgeClosed as BridgeClosed
    from .errors import BridgeFull as BridgeFull
    from .errors import ConfigError as ConfigError
    from .errors import ControlError as ControlError
    from .errors import ControlRejected as ControlRejected
    from .errors import ControlTimeout as ControlTimeout
    from .errors import DeadlineExceeded as DeadlineExceeded
    from .errors import LayoutMismatch as LayoutMismatch
    from .errors import MetadataError as MetadataError
    from .errors import ProtocolError as ProtocolError
    from .errors import RuntimeStateError as RuntimeStateError
    from .errors import StaleLayout as StaleLayout
    from .errors import TransferError as TransferError
    from .errors import TransferFailed as TransferFailed
    from .errors import TransferTimeout as TransferTimeout
    from .errors import UnknownTransfer as UnknownTransfer
    from .errors import WriteRefused as WriteRefused
    from .node import DecodeNode as DecodeNode
    from .protocol.checks import MIN_TOKEN_CHARS as MIN_TOKEN_CHARS
    from .protocol.plan import HeadGeometry as HeadGeometry
    from .protocol.plan import RankRoute as RankRoute
    from .protocol.plan import map_ranks as map_ranks
    from .runtime.api import Identity as Identity
    from .runtime.api import ReceiveSpec as ReceiveSpec
    from .runtime.api import Registration as Registration
    from .runtime.api import Step as Step
    from .runtime.control.plane import ControlPeers as ControlPeers
    from .runtime.receive.entry import Received as Received
    from .runtime.runtime import Runtime as Runtime
    from .runtime.spec import LayerTiming as LayerTiming
    from .runtime.spec import Outcome as Outcome
    from .runtime.spec import TransferSpec as TransferSpec
    from .transport import Transport as Transport


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aiolayer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
