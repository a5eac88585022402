"""Everything the connector is configured with, read in one place from ``kv_connector_extra_config``.

Keys (all optional): ``engine_id``, ``control_host`` (default 127.0.0.1), ``control_port`` (0 = any;
set it on P so that D and the proxy can reach it), ``backend`` ("mooncake" | "memory"), ``timeouts``
(a dict of ``aiolayer.Timeouts`` fields), ``layerwise_min_tokens`` (shorter prompts go in bulk),
``debug_zero_received`` (test-only negative control: zero the KV that arrived before D uses it).
"""

from __future__ import annotations

from typing import Any

import msgspec

from aiolayer.config import NodeConfig, Timeouts
from aiolayer.errors import ConfigError

_KNOWN = {"engine_id", "control_host", "control_port", "backend", "timeouts", "layerwise_min_tokens",
          "debug_zero_received"}


class BridgeConfig(msgspec.Struct, frozen=True, kw_only=True):
    node: NodeConfig
    timeouts: Timeouts
    layerwise_min_tokens: int = 0
    debug_zero_received: bool = False


def from_extra_config(extra: dict[str, Any] | None, default_engine_id: str) -> BridgeConfig:
    extra = dict(extra or {})
    unknown = set(extra) - _KNOWN
    if unknown:
        raise ConfigError(f"unknown kv_connector_extra_config keys for aiolayer: {sorted(unknown)}")
    try:
        timeouts = msgspec.convert(extra.get("timeouts") or {}, Timeouts)
        node = NodeConfig(engine_id=str(extra.get("engine_id") or default_engine_id),
                          control_host=str(extra.get("control_host", "127.0.0.1")),
                          control_port=int(extra.get("control_port", 0)),
                          backend=str(extra.get("backend", "mooncake")))
    except (msgspec.ValidationError, TypeError, ValueError) as exc:
        raise ConfigError(f"invalid aiolayer kv_connector_extra_config: {exc}") from exc
    return BridgeConfig(node=node, timeouts=timeouts,
                        layerwise_min_tokens=int(extra.get("layerwise_min_tokens", 0)),
                        debug_zero_received=bool(extra.get("debug_zero_received", False)))
