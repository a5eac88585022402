"""What the scheduler side hands the worker side each step (pickled across the process boundary)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .params import RecvParams, SendParams


@dataclass(frozen=True)
class RecvReq:
    """D: register this transfer (its request's ``RecvParams``, as read) before its block ids are published."""

    req_id: str
    params: RecvParams
    block_ids: list[int]
    first_block: int
    # block_ids holds every KV cache group's, group after group, with vLLM's null block where a sliding
    # window needs none: these are the blocks the transfer actually writes (None: all of block_ids)
    own_blocks: list[int] | None = None

    @property
    def transfer_id(self) -> str:
        return self.params.transfer_id

    @property
    def written(self) -> list[int]:
        return self.block_ids if self.own_blocks is None else self.own_blocks


@dataclass(frozen=True)
class SendReq:
    """P: this request's prefill completes in this step; stream its blocks to D (its ``SendParams``, as
    read) layer by layer."""

    req_id: str
    params: SendParams
    src_blocks: list[int]
    dst_blocks: list[int]           # paired with src_blocks (params.dst_blocks less those D needs none of)
    layerwise: bool = True
    refused: str = ""               # why nothing can be sent (D is told); "" = send
    src_from: int = 0               # D's first block is the request's block src_from (TransferSpec)

    @property
    def transfer_id(self) -> str:
        return self.params.transfer_id


@dataclass
class AiolayerMetadata(KVConnectorMetadata):
    recvs: list[RecvReq] = field(default_factory=list)
    sends: list[SendReq] = field(default_factory=list)
    aborts: list[tuple[str, str]] = field(default_factory=list)    # D: (req_id, transfer_id) to give up
    # P: (req_id, transfer_id) whose blocks vLLM freed while the send may still read them (preempted)
    cancels: list[tuple[str, str]] = field(default_factory=list)
