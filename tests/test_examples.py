"""The example engine (examples/hf_engine): a transformers model prefilled on P, decoded on D from the
KV that aiolayer moved between two processes over Mooncake TCP, gives the tokens of a local run.

D never sees a prompt (only its length and P's first token), so its tokens can only match if the
KV arrived; the same requests with the received blocks zeroed must then give other tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # the examples are not installed: import them from the checkout
    sys.path.append(str(ROOT))

MAX_TOKENS = 12


@pytest.mark.timeout(300)
def test_example_engine_decodes_the_same_tokens_as_a_local_run():
    # imported here: torch and transformers load for this test only, not for the whole collection
    from examples.hf_engine.engine import BLOCK_SIZE, blocks_for, build_model, local_greedy, weights_crc
    from examples.hf_engine.run import Cluster, sample_prompts

    prompts = sample_prompts()
    lengths = [len(p) for p in prompts]
    assert any(n > BLOCK_SIZE and n % BLOCK_SIZE for n in lengths), lengths   # several blocks, last one partial
    assert any(n < BLOCK_SIZE for n in lengths) and BLOCK_SIZE in lengths, lengths
    model = build_model()
    local = [local_greedy(model, p, MAX_TOKENS) for p in prompts]
    assert len({tuple(t) for t in local}) == len(prompts), "the prompts must lead to different outputs"

    cluster = Cluster()
    with cluster:
        for info in (cluster.p_info, cluster.d_info):
            assert info["weights_crc"] == weights_crc(model)
        sent = [cluster.generate(p, MAX_TOKENS) for p in prompts]
        zeroed = [cluster.generate(p, MAX_TOKENS, zero_received=True) for p in prompts]

    for prompt, want, row, control in zip(prompts, local, sent, zeroed):
        p, d = row["p"], row["d"]
        assert p["ok"] and p["reason"] == "", p
        assert d["received"]["ok"] and d["received"]["reason"] == "", d["received"]
        assert d["received"]["transfer_id"] == row["transfer_id"]
        num_blocks = blocks_for(len(prompt))
        assert len(p["src_blocks"]) == len(d["dst_blocks"]) == num_blocks
        block_bytes = BLOCK_SIZE * model.config.num_key_value_heads * model.config.head_dim * 4
        assert p["bytes"] == 2 * model.config.num_hidden_layers * num_blocks * block_bytes, p
        assert row["tokens"] == want, (len(prompt), row["tokens"], want)
        # the control: same request, received blocks wiped at D before decoding
        assert control["d"]["received"]["ok"], control["d"]["received"]
        assert control["tokens"][0] == want[0]             # P's first token, passed along
        assert control["tokens"] != want, f"prompt of {len(prompt)} tokens: D's output does not depend on the KV"

    assert cluster.exit_codes == [0, 0], [c.stderr_text() for c in cluster.children]
    assert all(c.proc.poll() is not None for c in cluster.children)
