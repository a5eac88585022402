"""P: a layer's KV handed over as soon as vLLM wrote it into the cache, before the layer's attention runs.

vLLM calls a connector's ``save_kv_layer`` after a layer's attention. Most of its attention backends
(``forward_includes_kv_cache_update`` False: CPU, FlashAttention, FlashInfer, Triton...) write the layer's
KV in an op of their own before that (``unified_kv_cache_update`` calling the backend's
``do_kv_cache_update``), and the attention only reads it: the layer's write to D may start there. The
layer's attention, and after the last layer the rest of the forward and the sampling, then run beside
its transfer instead of before it. vLLM keeps that op out of compiled graphs and CUDA graphs
(it is one of its splitting ops), so the hook runs every step.

Where a layer's backend writes the KV inside its attention, another layer's cache is shared, or a
fusion pass replaced the op, nothing is wrapped (or the wrapper is not called): ``save_kv_layer``
stays that layer's signal. The worker hands each layer over once per step, whichever comes first.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping
from typing import Any

_WRAPPED = "_aiolayer_kv_written"   # set on an impl whose update is wrapped: never wrapped twice


def _writes_kv_apart(layer: Any) -> bool:
    """Whether vLLM writes this attention layer's KV in the separate update op this module wraps."""
    backend, impl = getattr(layer, "attn_backend", None), getattr(layer, "impl", None)
    return backend is not None and getattr(backend, "forward_includes_kv_cache_update", True) is False \
        and getattr(layer, "kv_sharing_target_layer_name", None) is None \
        and callable(getattr(impl, "do_kv_cache_update", None)) and not getattr(impl, _WRAPPED, False)


def hook_kv_writes(forward_context: Mapping[str, Any], names: Iterable[str],
                   written: Callable[[str], None]) -> list[str]:
    """Wrap the KV update of each of ``names`` (vLLM's attention layers, from its static forward
    context) so that ``written(name)`` runs right after it; the names wrapped."""
    layers: dict[str, Any] = {name: forward_context.get(name) for name in names}
    owners = collections.Counter(id(getattr(layer, "impl", None)) for layer in layers.values())
    hooked = []
    for name, layer in layers.items():
        if not _writes_kv_apart(layer) or owners[id(layer.impl)] > 1:   # one impl, one layer name to report
            continue
        impl = layer.impl
        update = impl.do_kv_cache_update

        def wrapped(*args: Any, _update=update, _name=name, **kwargs: Any) -> Any:
            result = _update(*args, **kwargs)
            written(_name)
            return result

        impl.do_kv_cache_update = wrapped
        setattr(impl, _WRAPPED, True)
        hooked.append(name)
    return hooked
