"""What the scheduler side hands the worker side each step (pickled across the process boundary)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class RecvReq:
    """D: register this transfer before its block ids are published."""

    req_id: str
    transfer_id: str
    block_ids: list[int]
    first_block: int
    prefill_control: str
    notify_url: str = ""
    token: str = ""
    prefill_controls: tuple[str, ...] = ()   # P's TP ranks when it has several (then prefill_control is "")
    # block_ids holds every KV cache group's, group after group, with vLLM's null block where a sliding
    # window needs none: these are the blocks the transfer actually writes (None: all of block_ids)
    own_blocks: list[int] | None = None

    @property
    def written(self) -> list[int]:
        return self.block_ids if self.own_blocks is None else self.own_blocks

    @property
    def prefill_ranks(self) -> list[str]:
        return list(self.prefill_controls) or [self.prefill_control]


@dataclass(frozen=True)
class SendReq:
    """P: this request's prefill completes in this step; stream its blocks to D layer by layer."""

    req_id: str
    transfer_id: str
    src_blocks: list[int]
    decode_control: str
    dst_blocks: list[int]
    dst_incarnation: str
    layerwise: bool = True
    token: str = ""
    decode_ranks: tuple[tuple[str, str], ...] = ()   # (control, incarnation) per D TP rank when several
    prefill_tp: int = 0                              # P's TP size the plan assumed (0: not said)
    refused: str = ""                                # why nothing can be sent (D is told); "" = send
    src_from: int = 0                                # D's first block is the request's block src_from (TransferSpec)

    @property
    def d_ranks(self) -> list[tuple[str, str]]:
        return list(self.decode_ranks) or [(self.decode_control, self.dst_incarnation)]


@dataclass
class AiolayerMetadata(KVConnectorMetadata):
    recvs: list[RecvReq] = field(default_factory=list)
    sends: list[SendReq] = field(default_factory=list)
    aborts: list[tuple[str, str]] = field(default_factory=list)    # D: (req_id, transfer_id) to give up
    # P: (req_id, transfer_id) whose blocks vLLM freed while the send may still read them (preempted)
    cancels: list[tuple[str, str]] = field(default_factory=list)
