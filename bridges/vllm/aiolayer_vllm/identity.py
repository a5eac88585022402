"""What a worker's runtime answers a topology query with (``aiolayer.Identity``): its role, its ranks,
and a fingerprint of everything that must match between P and D for a transfer to be correct.

The proxy learns each engine's parallel layout from these answers and refuses P and D whose
fingerprints differ. The fingerprint is ``<model name>/<12 hex digits>``: the name (the last part of
the model's path or Hugging Face id, so that the same model under two paths on two hosts still
matches) for people, and a hash of the name, dtypes, layers, total KV heads, head size, block size,
MLA flag and (several of them) the KV cache groups, which any byte-for-byte copy between the two engines
depends on; a hybrid KV cache's group count and a speculative drafter with KV layers of its own (EAGLE,
MTP: its layers move too, ``draft``) are named in the readable part too.
"""

from __future__ import annotations

import hashlib

from aiolayer import Identity

from .ranks import Topology


def model_facts(vllm_config) -> dict[str, str]:
    """What the engine's configuration says of its model (the worker adds its KV geometry)."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    archs = getattr(model.hf_config, "architectures", None) or ()
    return {"model": str(model.model).rstrip("/").rsplit("/", 1)[-1], "dtype": str(model.dtype),
            "kv_cache_dtype": str(cache.cache_dtype), "architectures": ",".join(archs)}


def fingerprint(facts: dict[str, object]) -> str:
    text = ";".join(f"{key}={facts[key]}" for key in sorted(facts))
    name = str(facts.get("model") or "model")
    groups = str(facts.get("kv_cache_groups") or "")
    if groups:   # named, so that a P and a D differing only there see why the proxy refuses them
        name += f" (hybrid KV cache: {groups.count(';') + 1} groups)"
    if facts.get("draft"):   # the same: a drafter's KV layers are moved too (``draft``)
        name += f" (+ {facts['draft']} draft)"
    return f"{name}/{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def role_of(is_producer: bool, is_consumer: bool) -> str:
    return "both" if is_producer and is_consumer else "producer" if is_producer else \
        "consumer" if is_consumer else ""


def identity(topo: Topology, is_producer: bool, is_consumer: bool, facts: dict[str, object]) -> Identity:
    # the block size is in the facts exactly where blocks pair block for block with D's (several KV cache
    # groups, a sliding window: ``connector.group_facts``), which the scheduler does with D's blocks in
    # hand: such a P cannot start before D registered (``scheduler._pair`` refuses a late request)
    return Identity(role=role_of(is_producer, is_consumer), tp_rank=topo.tp_rank, tp_size=topo.tp_size,
                    dp_rank=topo.dp_rank, dp_size=topo.dp_size, model=fingerprint(facts),
                    late_binding="block_size" not in facts)
