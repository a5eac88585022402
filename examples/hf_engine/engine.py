"""The model side of the example engine, with no aiolayer in it: a tiny Llama (random weights from a
fixed seed, built offline), a paged KV cache of plain torch tensors, a prefill that writes each
layer's K and V into that cache as soon as the layer has run (and says so through ``on_layer``), and
a decode that continues from the paged cache alone.

The paged cache is what an engine registers with aiolayer: per layer one K and one V tensor
[num_blocks, block_size, kv_heads, head_dim], contiguous, so block ``b`` of layer ``l`` starts at
``k[l].data_ptr() + b * block_bytes``. The same layout on P and D lets aiolayer move whole blocks.
"""

from __future__ import annotations

import zlib
from typing import Callable

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

SEED = 0
BLOCK_SIZE = 16
NUM_BLOCKS = 64


def build_model() -> LlamaForCausalLM:
    """The same weights in every process: fixed seed, CPU, float32 (no download, no file)."""
    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        # Llama's default 0.02 gives near-flat logits at this size: then greedy tokens would hardly
        # depend on the prompt's KV, and a lost transfer could go unnoticed
        initializer_range=0.5, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=3)
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config).to(torch.float32).eval()


def weights_crc(model: torch.nn.Module) -> int:
    """A fingerprint of the weights: P, D and the local run must hold the same model."""
    crc = 0
    for name, tensor in sorted(model.state_dict().items()):
        crc = zlib.crc32(tensor.contiguous().numpy().tobytes(), zlib.crc32(name.encode(), crc))
    return crc


class PagedKV:
    """Per layer one K and one V tensor [num_blocks, block_size, kv_heads, head_dim] (vLLM's NHD)."""

    def __init__(self, config: LlamaConfig, num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE) -> None:
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.k = [torch.zeros(shape, dtype=torch.float32) for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=torch.float32) for _ in range(config.num_hidden_layers)]

    # what aiolayer needs to address a block: base addresses and the stride between blocks
    @property
    def k_base(self) -> list[int]:
        return [t.data_ptr() for t in self.k]

    @property
    def v_base(self) -> list[int]:
        return [t.data_ptr() for t in self.v]

    @property
    def block_bytes(self) -> int:
        return self.k[0][0].numel() * self.k[0].element_size()

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, block_ids: list[int]) -> None:
        """Scatter one layer's [tokens, kv_heads, head_dim] K and V into ``block_ids``, in order."""
        slots = _slots(len(keys), block_ids, self.block_size)
        self.k[layer].view(-1, *keys.shape[1:])[slots] = keys
        self.v[layer].view(-1, *values.shape[1:])[slots] = values

    def read(self, layer: int, block_ids: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather ``num_tokens`` of one layer back as [1, kv_heads, tokens, head_dim] (transformers' order)."""
        slots = _slots(num_tokens, block_ids, self.block_size)
        k = self.k[layer].view(-1, *self.k[layer].shape[2:])[slots]
        v = self.v[layer].view(-1, *self.v[layer].shape[2:])[slots]
        return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)

    def zero(self, block_ids: list[int]) -> None:
        for tensor in self.k + self.v:
            tensor[block_ids] = 0


def _slots(num_tokens: int, block_ids: list[int], block_size: int) -> torch.Tensor:
    """Flat slot of each token: token t lives in block ``block_ids[t // block_size]`` at ``t % block_size``."""
    t = torch.arange(num_tokens)
    return torch.tensor(block_ids, dtype=torch.long)[t // block_size] * block_size + t % block_size


def blocks_for(num_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-num_tokens // block_size)


class BlockPool:
    """The engine's block allocator (a free list); aiolayer never allocates, it only moves blocks."""

    def __init__(self, num_blocks: int, from_top: bool = False) -> None:
        # P hands out blocks from the top, D from the bottom: source and destination ids differ
        self._free = list(range(num_blocks)) if from_top else list(range(num_blocks - 1, -1, -1))

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"{n} blocks asked, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def give_back(self, block_ids: list[int]) -> None:
        self._free.extend(reversed(block_ids))


@torch.no_grad()
def prefill(model: LlamaForCausalLM, prompt: list[int], paged: PagedKV, block_ids: list[int],
            on_layer: Callable[[int], None]) -> int:
    """Run the prompt; after decoder layer ``i`` wrote its K/V into the DynamicCache, copy them into
    ``block_ids`` of the paged cache and call ``on_layer(i)``. Returns the first generated token."""
    cache = DynamicCache(config=model.config)

    def hook_for(layer: int):
        def after_layer(_module, _args, _output) -> None:
            entry = cache.layers[layer]   # [1, kv_heads, tokens, head_dim], written by this layer's attention
            paged.write(layer, entry.keys[0].transpose(0, 1), entry.values[0].transpose(0, 1), block_ids)
            on_layer(layer)
        return after_layer

    hooks = [layer.register_forward_hook(hook_for(i)) for i, layer in enumerate(model.model.layers)]
    try:
        logits = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits
    finally:
        for hook in hooks:
            hook.remove()
    return int(logits[0, -1].argmax())


@torch.no_grad()
def decode(model: LlamaForCausalLM, paged: PagedKV, block_ids: list[int], num_tokens: int, first_token: int,
           max_tokens: int) -> list[int]:
    """Greedy decode from the paged cache only: the prompt itself is never seen here."""
    cache = DynamicCache(config=model.config)
    for layer in range(model.config.num_hidden_layers):
        cache.update(*paged.read(layer, block_ids, num_tokens), layer)
    return _greedy(model, cache, first_token, max_tokens)


@torch.no_grad()
def local_greedy(model: LlamaForCausalLM, prompt: list[int], max_tokens: int) -> list[int]:
    """The reference: prefill and decode in one process, one DynamicCache, no paging, no transfer."""
    cache = DynamicCache(config=model.config)
    logits = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits
    return _greedy(model, cache, int(logits[0, -1].argmax()), max_tokens)


def _greedy(model: LlamaForCausalLM, cache: DynamicCache, first_token: int, max_tokens: int) -> list[int]:
    tokens = [first_token]
    while len(tokens) < max_tokens:   # no EOS stop: a fixed length is easier to compare
        logits = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True).logits
        tokens.append(int(logits[0, -1].argmax()))
    return tokens
