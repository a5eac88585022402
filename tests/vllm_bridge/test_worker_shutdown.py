"""The worker side's shutdown, as vLLM's worker calls it: never raises into vLLM's own clean-up."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from helpers_worker import worker_side

pytestmark = pytest.mark.timeout(60)
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def test_a_stop_past_its_deadline_does_not_escape_the_worker_shutdown():
    """vLLM's worker shutdown calls the connector's with no guard: an error from the runtime's stop
    skipped the rest of vLLM's clean-up and left the runtime set."""
    from aiolayer import DeadlineExceeded

    p = worker_side("p", LAYERS)
    runtime, stop = p.runtime, p.runtime.stop

    def overrun() -> None:
        stop()
        raise DeadlineExceeded("loop stop", 5.0, "tasks did not finish after cancellation")

    runtime.stop = overrun
    p.shutdown()
    assert p.runtime is None and not runtime.loop_thread.alive
