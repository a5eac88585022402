"""P and D with blocks of other sizes, through vLLM's real Scheduler in process (``vllm_sched``): D
registers its blocks at its own size, P sends its one KV cache group whole from its first block, and
the runtime writes every prompt token into D's slot for it (vLLM CPU's K and V slabs, flash's planes)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

import torch

from vllm_sched import LAYERS, engines_fixture, lookup, recv_params, send_params, steps_until

engines = pytest.fixture(engines_fixture, name="engines")
pytestmark = pytest.mark.timeout(120)
PROMPT = 150


def _token(engine, name: str, block: int, slot: int, kv: int) -> torch.Tensor:
    """One token's K or V in layer ``name`` (one KV head), as a view (writes go through)."""
    t = engine.kv[name]
    if engine.layout == "cpu":   # [B, 1, N, 2D]: vLLM CPU's vec kernels, per block K as [D][N] then V as [N][D]
        n = t.shape[2]
        slab = t[block, 0].reshape(2, n * 64)
        return slab[0].view(64, n)[:, slot] if kv == 0 else slab[1].view(n, 64)[slot]
    return t[kv, block, slot, 0]   # [2, B, N, 1, D]


def _value(layer: int, token: int, kv: int) -> float:
    return 1000.0 * (layer + 1) + 2 * token + kv


@pytest.mark.parametrize("layout", ["cpu", "split"])
@pytest.mark.parametrize("p_size,d_size", [(128, 32), (32, 64)])
def test_prompt_tokens_land_in_ds_slots_at_ds_block_size(engines, layout, p_size, d_size):
    from vllm.v1.request import RequestStatus

    d = engines("kv_consumer", f"d-bs{d_size}", block_size=d_size, layout=layout)
    p = engines("kv_producer", f"p-bs{p_size}", block_size=p_size, layout=layout)
    prompt = list(range(3, 3 + PROMPT))
    d.add("d-r", prompt, 3, recv_params(p, "tb"))
    d.step()
    reg = lookup(p, d, "tb")
    assert len(reg.block_ids) == -(-PROMPT // d_size)     # D's blocks at D's size
    p.add("p-r", prompt, 1, send_params(d, "tb", reg))

    def forward(name: str) -> None:                       # P's forward: each token's K and V
        blocks, layer = p.blocks_of("p-r"), LAYERS.index(name)
        for t in range(PROMPT):
            for kv in (0, 1):
                _token(p, name, blocks[t // p_size], t % p_size, kv)[:] = _value(layer, t, kv) + torch.arange(64)

    p.step(before_save=forward)
    steps_until(lambda: d.status("d-r") in (RequestStatus.RUNNING, None), d, p)
    assert d.status("d-r") == RequestStatus.RUNNING, "D's load failed"
    blocks = d.blocks_of("d-r")
    for name in LAYERS:
        layer = LAYERS.index(name)
        for t in range(PROMPT):
            for kv in (0, 1):
                got = _token(d, name, blocks[t // d_size], t % d_size, kv)
                assert torch.equal(got, _value(layer, t, kv) + torch.arange(64.0)), (name, t, kv)
