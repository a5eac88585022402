"""Everything the connector is configured with, decoded in one place from ``kv_connector_extra_config``.

Keys (all optional; an unknown key at any level, or a value of the wrong type, is refused with the key
named, while vLLM builds its engine config: ``plugin.py`` says where):
``engine_id``, ``control_port`` (0 = any; set it on P so that D and the proxy can reach it),
``backend`` ("mooncake" | "memory"), ``transport`` (a dict of ``aiolayer.transport.Transport``
fields: ``bind_host``, ``advertise_host``, ``protocol``, ``device_name``, ``metadata_server``; the
same keys as ``aiolayer node``'s flags), ``timeouts`` (a dict of ``aiolayer.Timeouts`` fields),
``transfer_mode`` (P: "layerwise", the default: each layer as the forward writes it; "bulk": every
layer after the last; "auto": chosen per request from what earlier sends measured, ``modes.py``),
``layerwise_min_tokens`` (with "layerwise": shorter prompts go in bulk), ``queue_spin_ms`` (how long
vLLM's shared-memory message-queue readers in this engine's worker and engine core spin after a message before they
sleep: 2 by default, vLLM's own is 1000; null leaves vLLM's; ``spin.py`` says why), ``integrity_sample``
(P: the probability that each layer of a transfer is sampled, its bytes verified end to end by D before
D reports the transfer; 0.01 by default, 0 = off; CPU engines only, where the KV is in host memory:
``aiolayer/runtime/integrity.py``).

vLLM's own ``kv_transfer_config`` fields stand in where aiolayer's keys are absent: ``engine_id`` for
``engine_id``, ``kv_port`` for ``control_port``, ``kv_ip`` (where the vLLM has it) for
``transport.bind_host`` (``vllm_fields``). A field left at vLLM's default counts as not given: vLLM
makes up a UUID engine id for every engine, and one default ``kv_port`` would have every engine on a
host want one port. Both given with different values: refused, naming both.

Test-only switches are not configuration: ``AIOLAYER_DEBUG_ZERO_RECEIVED=1`` and
``AIOLAYER_DEBUG_CORRUPT_RECEIVED=1`` in a D engine's environment (``debug.py``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import uuid
from typing import Any

import msgspec

from aiolayer.config import DEFAULT_INTEGRITY_SAMPLE, NodeConfig, Timeouts
from aiolayer.errors import ConfigError
from aiolayer.protocol.mode import MODES
from aiolayer.transport import Transport

DEBUG_ZERO_RECEIVED_ENV = "AIOLAYER_DEBUG_ZERO_RECEIVED"
DEBUG_CORRUPT_RECEIVED_ENV = "AIOLAYER_DEBUG_CORRUPT_RECEIVED"
DEFAULT_QUEUE_SPIN_MS = 2.0   # docs/vllm.md: a parked D's readers spin 1 s after each message otherwise


class ExtraConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``kv_connector_extra_config`` as the user writes it."""

    engine_id: str = ""
    control_port: int = 0
    backend: str = "mooncake"
    transport: Transport = msgspec.field(default_factory=Transport)
    timeouts: Timeouts = msgspec.field(default_factory=Timeouts)
    transfer_mode: str = "layerwise"
    layerwise_min_tokens: int = 0
    queue_spin_ms: float | None = DEFAULT_QUEUE_SPIN_MS
    integrity_sample: float = DEFAULT_INTEGRITY_SAMPLE


class BridgeConfig(msgspec.Struct, frozen=True, kw_only=True):
    node: NodeConfig
    timeouts: Timeouts
    transfer_mode: str = "layerwise"
    layerwise_min_tokens: int = 0
    queue_spin_s: float | None = DEFAULT_QUEUE_SPIN_MS / 1e3    # None: vLLM's own spin
    debug_zero_received: bool = False
    debug_corrupt_received: bool = False


# aiolayer's key (a path in the extra config) -> vLLM's KVTransferConfig field that stands in for it
VLLM_FIELDS = {("engine_id",): "engine_id", ("control_port",): "kv_port", ("transport", "bind_host"): "kv_ip"}


def check_extra_config(extra: dict[str, Any] | None, kv_transfer_config: Any = None) -> None:
    """Validate the whole extra config without building anything (no I/O): ``ConfigError`` naming the
    key. vLLM's engine-config phase calls it (``plugin.py``, and ``requires_piecewise_for_cudagraph``),
    so a bad key stops the start before any model loads."""
    from_extra_config(extra, "vllm", kv_transfer_config)


def doctor_check(extra: dict[str, Any] | None, outer: dict[str, Any] | None = None) -> tuple[str, str] | None:
    """``aiolayer doctor``'s check of a side's config (entry point ``aiolayer.config_checks``): None when
    valid, else (what is wrong, naming the key; how to fix it). ``outer``: the kv_transfer_config object
    holding ``extra``, whose vLLM fields are checked against it as vLLM's start would."""
    try:
        check_extra_config(extra, types.SimpleNamespace(**outer) if outer else None)
    except ConfigError as exc:
        keys = ", ".join(f.name for f in msgspec.structs.fields(ExtraConfig))
        return str(exc), (f"remove or correct that key; the top-level keys are {keys} "
                          "(transport and timeouts take their own: docs/vllm.md)")
    return None


def vllm_fields(extra: dict[str, Any], kv_transfer_config: Any) -> dict[str, Any]:
    """``extra`` with vLLM's own fields filled in where aiolayer's keys are absent (module docstring)."""
    section = extra.get("transport")
    out = {**extra, "transport": dict(section)} if isinstance(section, dict) else dict(extra)
    for path, name in VLLM_FIELDS.items():
        theirs = _given(kv_transfer_config, name)
        if theirs is None:
            continue
        where = out
        for key in path[:-1]:
            if not isinstance(where.get(key, {}), dict):
                break   # a malformed section: the strict decoding below names it
            where = where.setdefault(key, {})
        else:
            ours = where.get(path[-1])
            if ours is None or ours == "":   # absent, as from_extra_config reads an empty engine id
                where[path[-1]] = theirs
            elif ours != theirs:
                raise ConfigError(f"kv_connector_extra_config {'.'.join(path)}={ours!r} conflicts with "
                                  f"kv_transfer_config {name}={theirs!r}: give one of them, or the same value")
    return out


def _given(kv_transfer_config: Any, name: str) -> Any:
    """vLLM's field ``name`` if the user set it (not absent, not its default, not a made-up UUID)."""
    value = getattr(kv_transfer_config, name, None)
    if value is None or value == "":
        return None
    defaults = {f.name: f.default for f in dataclasses.fields(kv_transfer_config)} \
        if dataclasses.is_dataclass(kv_transfer_config) else {}
    if defaults.get(name, dataclasses.MISSING) == value:
        return None
    if name == "engine_id":
        # a data-parallel vLLM appends "_dp<rank>" to it in each engine; aiolayer adds its own rank suffix
        value = re.sub(r"_dp\d+$", "", str(value))
        return None if _generated(value) else value
    return value


def _generated(engine_id: str) -> bool:
    """vLLM's own engine id when none was given: ``str(uuid.uuid4())``."""
    try:
        made = uuid.UUID(engine_id)
    except ValueError:
        return False
    return str(made) == engine_id and made.version == 4


def from_extra_config(extra: dict[str, Any] | None, default_engine_id: str,
                      kv_transfer_config: Any = None) -> BridgeConfig:
    try:
        if kv_transfer_config is not None:
            extra = vllm_fields(dict(extra or {}), kv_transfer_config)
        # strict: "false" is not a bool and "5600" not a port (a lax coercion once turned on a debug switch)
        user = msgspec.convert(dict(extra or {}), ExtraConfig)
        if user.layerwise_min_tokens < 0:
            raise ConfigError(f"layerwise_min_tokens must be >= 0, got {user.layerwise_min_tokens}")
        if user.transfer_mode not in MODES:
            raise ConfigError(f"transfer_mode must be one of {', '.join(MODES)}, got {user.transfer_mode!r}")
        if user.layerwise_min_tokens and user.transfer_mode != "layerwise":
            raise ConfigError(f"layerwise_min_tokens applies to transfer_mode layerwise only, "
                              f"not {user.transfer_mode!r}: drop one of them")
        if user.queue_spin_ms is not None and not 0 <= user.queue_spin_ms <= 1000:
            raise ConfigError(f"queue_spin_ms must be null or 0-1000, got {user.queue_spin_ms}")
        node = NodeConfig(engine_id=user.engine_id or default_engine_id, control_port=user.control_port,
                          backend=user.backend, transport=user.transport, integrity_sample=user.integrity_sample)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid aiolayer kv_connector_extra_config: {exc}") from None
    except ConfigError as exc:
        raise ConfigError(f"invalid aiolayer kv_connector_extra_config: {exc}") from None
    spin = None if user.queue_spin_ms is None else user.queue_spin_ms / 1e3
    return BridgeConfig(node=node, timeouts=user.timeouts, transfer_mode=user.transfer_mode,
                        layerwise_min_tokens=user.layerwise_min_tokens,
                        queue_spin_s=spin, debug_zero_received=_switch(DEBUG_ZERO_RECEIVED_ENV),
                        debug_corrupt_received=_switch(DEBUG_CORRUPT_RECEIVED_ENV))


def _switch(name: str) -> bool:
    value = os.environ.get(name, "")
    if value not in ("", "0", "1"):
        raise ConfigError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"
