"""P: the prefill engine. Runs a prompt, writes each layer's KV into its paged cache and hands the
layer to aiolayer right away (``step.layer_ready``), so layer i travels to D while layer i+1 computes.

Command ``prefill`` {prompt, registration}: ``registration`` is D's
``aiolayer.Registration`` (plain JSON); the reply carries the first generated token, which D needs to
start decoding, and the transfer's outcome.

Run by the driver (run.py) as ``python -m examples.hf_engine.prefill``.
"""

from __future__ import annotations

import time

import msgspec

from aiolayer import Registration, TransferSpec

from .engine import BlockPool, blocks_for, prefill
from .worker import ready_line, serve, start_engine

OUTCOME_TIMEOUT_S = 30.0


class Prefill:
    def __init__(self, model, paged, rt) -> None:
        self.model, self.paged, self.rt = model, paged, rt
        self.pool = BlockPool(paged.num_blocks, from_top=True)
        self.held: dict[str, list[int]] = {}   # transfer id -> source blocks aiolayer may still read

    def prefill(self, cmd: dict) -> dict:
        self._reclaim()
        prompt = cmd["prompt"]
        reg = msgspec.convert(cmd["registration"], Registration)
        src = self.pool.take(blocks_for(len(prompt), self.paged.block_size))
        self.held[reg.transfer_id] = src
        spec = TransferSpec.from_registration(reg, src_blocks=src)   # our blocks -> D's blocks, layer by layer

        try:
            step = self.rt.begin_step([spec])   # refused: nothing was queued, the blocks are ours again
        except Exception:
            self.pool.give_back(self.held.pop(reg.transfer_id))
            raise
        t0 = time.perf_counter()
        with step:                              # step.end() on exit, after the last layer
            first_token = prefill(self.model, prompt, self.paged, src, on_layer=step.layer_ready)
        forward_end = time.perf_counter()

        outcome = self.rt.wait_outcome(reg.transfer_id, OUTCOME_TIMEOUT_S)   # off the forward path in a real engine
        self._reclaim()
        return {"first_token": first_token, "ok": outcome.ok, "reason": outcome.reason, "bytes": outcome.bytes,
                "src_blocks": src, "forward_ms": 1e3 * (forward_end - t0),
                # how long the transfer (D's ack of DONE) outlasted our forward: the part not hidden behind it
                "exposed_ms": 1e3 * max(0.0, outcome.finished_s - forward_end)}

    def _reclaim(self) -> None:
        """Source blocks go back to the pool only once no write of aiolayer can still read them."""
        for transfer_id in self.rt.pop_released():
            self.pool.give_back(self.held.pop(transfer_id, []))


def main() -> int:
    model, paged, rt = start_engine("hf-prefill")
    p = Prefill(model, paged, rt)
    return serve(rt, ready_line(rt, model), {"prefill": p.prefill})


if __name__ == "__main__":
    raise SystemExit(main())
