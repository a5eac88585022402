"""D: the decode engine. Allocates blocks for a request, registers them with aiolayer
(``rt.receive``) and hands the ``Registration`` back for P; once the transfer's result says ok, it
decodes from the received blocks. D never sees the prompt: only its length and P's first token.

Commands:
  ``receive`` {transfer_id, num_tokens}  -> the Registration (plain JSON) to give to P
  ``decode``  {transfer_id, first_token, max_tokens, zero_received} -> tokens and the transfer's result
``zero_received`` wipes the received blocks before decoding: the control run that shows the tokens
depend on the transferred KV.

Run by the driver (run.py) as ``python -m examples.hf_engine.decode``.
"""

from __future__ import annotations

import time

import msgspec

from aiolayer import DeadlineExceeded, Received, ReceiveSpec

from .engine import BlockPool, blocks_for, decode
from .worker import ready_line, serve, start_engine

RECEIVE_TIMEOUT_S = 30.0


class Decode:
    def __init__(self, model, paged, rt) -> None:
        self.model, self.paged, self.rt = model, paged, rt
        self.pool = BlockPool(paged.num_blocks)
        self.requests: dict[str, tuple[list[int], int]] = {}   # transfer id -> (blocks, prompt tokens)
        self.fenced: dict[str, list[int]] = {}                 # given up, result not out yet

    def receive(self, cmd: dict) -> dict:
        blocks = self.pool.take(blocks_for(cmd["num_tokens"], self.paged.block_size))
        # no token given: aiolayer mints the transfer's secret, and the Registration carries it to P
        spec = ReceiveSpec(transfer_id=cmd["transfer_id"], block_ids=blocks)   # D learns its writers itself
        try:
            reg = self.rt.receive(spec)   # registered before this returns what P needs
        except Exception:
            self.pool.give_back(blocks)
            raise
        self.requests[spec.transfer_id] = (blocks, cmd["num_tokens"])
        return {"registration": msgspec.to_builtins(reg)}

    def decode(self, cmd: dict) -> dict:
        transfer_id = cmd["transfer_id"]
        blocks, num_tokens = self.requests.pop(transfer_id)
        t0 = time.perf_counter()
        result = self._wait_received(transfer_id, blocks)
        waited = time.perf_counter() - t0
        try:
            if not result.ok:
                return {"received": msgspec.to_builtins(result), "tokens": []}
            if cmd.get("zero_received"):
                self.paged.zero(blocks)
            t1 = time.perf_counter()
            tokens = decode(self.model, self.paged, blocks, num_tokens, cmd["first_token"], cmd["max_tokens"])
            return {"received": msgspec.to_builtins(result), "tokens": tokens, "dst_blocks": blocks,
                    "wait_ms": 1e3 * waited, "decode_ms": 1e3 * (time.perf_counter() - t1)}
        finally:
            self.pool.give_back(blocks)   # the result was the release: no write of P lands any more

    def _wait_received(self, transfer_id: str, blocks: list[int]) -> Received:
        """This transfer's result (other transfers' results stay with the runtime until asked for)."""
        self._reclaim_fenced()
        try:
            return self.rt.wait_received(transfer_id, RECEIVE_TIMEOUT_S)
        except DeadlineExceeded:
            # P may still write into the blocks: they stay out of the pool until the result comes
            self.fenced[transfer_id] = blocks
            self.rt.abort_receive(transfer_id, "the example's decode timed out")
            raise

    def _reclaim_fenced(self) -> None:
        """Blocks of transfers given up earlier go back once their result is out (P is quiet)."""
        for transfer_id in list(self.fenced):
            try:
                self.rt.wait_received(transfer_id, 0)
            except DeadlineExceeded:
                continue   # not yet
            self.pool.give_back(self.fenced.pop(transfer_id))


def main() -> int:
    model, paged, rt = start_engine("hf-decode")
    d = Decode(model, paged, rt)
    return serve(rt, ready_line(rt, model), {"receive": d.receive, "decode": d.decode})


if __name__ == "__main__":
    raise SystemExit(main())
