"""A speculative draft model's own KV cache layers (EAGLE, MTP): which of the worker's layers they are,
and what of them goes into the fingerprint.

vLLM gives a drafter with its own attention (``SpeculativeConfig.uses_draft_kv_cache``) KV cache layers
beside the target's, named after them (EAGLE's ``start_layer_id`` and DeepSeek's MTP layers: numbers
from the target's layer count on), and defers the connector's ``wait_for_save`` until the drafter ran
(``gpu_model_runner``). P running the same drafter therefore has the draft KV of the prompt when the
step ends: it moves as further runtime layers, after the target's (``layout.layer_order``).

The drafter runs several passes per step (one per draft token), each writing its layers again, the
later ones at positions past the prompt; so a draft layer is handed to the runtime once, when the
step ends (``wait_for_save``), not at each pass: its bytes are then final while P reads them.
P and D must both run the drafter (the layer count is in the fingerprint; the readable part names it).
"""

from __future__ import annotations

from collections.abc import Sequence

from .layout import is_draft_model, layer_number


def draft_facts(vllm_config) -> dict[str, str]:
    """The drafter's part of the fingerprint: its method and model, where it has KV layers of its own
    (ngram and other model-free proposers have none: P and D may then differ in them)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or not spec.uses_draft_kv_cache():
        return {}
    draft = getattr(spec, "draft_model_config", None)
    name = str(getattr(draft, "model", "") or "").rstrip("/").rsplit("/", 1)[-1]
    return {"draft": f"{spec.method} {name}".strip()}


def draft_start(vllm_config) -> int | None:
    """The layer number the drafter's layers start at (the target's layer count); None: no drafter KV."""
    if not draft_facts(vllm_config):
        return None
    return int(vllm_config.model_config.get_total_num_hidden_layers())


def draft_layers(names: Sequence[str], start: int | None) -> tuple[int, ...]:
    """The runtime layer indices (positions in ``names``) that hold the drafter's KV: numbered from the
    target's layer count on (EAGLE, MTP), or a separate draft model's, whose own numbers start at 0 under
    vLLM's ``draft_model.`` prefix (``method: draft_model``)."""
    if start is None:
        return ()
    return tuple(i for i, name in enumerate(names) if is_draft_model(name) or layer_number(name) >= start)
