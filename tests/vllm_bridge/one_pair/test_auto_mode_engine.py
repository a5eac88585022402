"""``transfer_mode: auto`` in a real vLLM engine: the folder's P chooses each send's mode (conftest.py), and
its workers' measurements must reach its scheduler through vLLM's own engine loop (worker metadata), or
every send would stay layer-wise. The choice itself: tests/protocol/test_transfer_mode.py."""

from __future__ import annotations

import ast
import re

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from aiolayer.harness.servers import completion, metric_value, scrape_metrics
from aiolayer.harness.tiny_model import long_prompt

pytestmark = [pytest.mark.timeout(300), pytest.mark.vllm]
CHOSEN = re.compile(r"request \S+: (layerwise|bulk) \(")
ESTIMATES = re.compile(r"transfer mode estimates: (\{.*\})")


def test_p_measures_both_modes_and_chooses_from_the_measurements(stack):
    p, proxy = stack["p"], stack["proxy"]
    for i in range(4):   # one step size (~400 tokens), one request at a time: each send's figures are back first
        out = completion(proxy.url, long_prompt(400, seed=300 + i), max_tokens=2, model=p.served_model, timeout_s=120)
        assert len(out.token_ids) == 2, out
    log = p.log_text()
    assert {"layerwise", "bulk"} <= set(CHOSEN.findall(log)), log[-3000:]
    estimates = ast.literal_eval(ESTIMATES.findall(log)[-1])
    assert min(estimates["rate_bytes_s"].values()) > 0 and estimates["bytes_per_token"] > 0, estimates
    assert {key.split("@")[0] for key in estimates["s_per_step_token"]} == {"layerwise", "bulk"}, estimates
    assert "aiolayer transfer mode for steps of up to 512 tokens:" in log, log[-3000:]
    metrics = scrape_metrics(p)   # each finished send counted by how it went, in vLLM's own /metrics
    assert all(metric_value(metrics, f"vllm:aiolayer_sends_{mode}_total") for mode in ("layerwise", "bulk"))
