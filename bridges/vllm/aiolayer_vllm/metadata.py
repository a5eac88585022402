"""What the scheduler side hands the worker side each step (pickled across the process boundary)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiolayer import TransferSpec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .params import RecvParams, SendParams
from .ranks import rank_transfer_id


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

    def transfer_spec(self, d_rank: int, **extra: Any) -> TransferSpec:
        """P's spec for one D rank of this request: the one place its ``SendParams`` become the core's."""
        params = self.params
        target = params.decode_ranks[d_rank]
        tid = rank_transfer_id(params.transfer_id, d_rank, len(params.decode_ranks))
        if params.late:   # D's blocks, first block and incarnation: asked of D by the runtime (late binding)
            extra.pop("src_from", None)
            return TransferSpec.late_bound(transfer_id=tid, peer=target.decode_control, src_blocks=self.src_blocks,
                                           token=params.token, **extra)
        return TransferSpec(transfer_id=tid, peer=target.decode_control, src_blocks=self.src_blocks,
                            dst_blocks=self.dst_blocks, dst_incarnation=target.dst_incarnation, token=params.token,
                            **extra)


@dataclass
class AiolayerMetadata(KVConnectorMetadata):
    recvs: list[RecvReq] = field(default_factory=list)
    sends: list[SendReq] = field(default_factory=list)
    aborts: list[tuple[str, str]] = field(default_factory=list)    # D: (req_id, transfer_id) to give up
    # P: (req_id, transfer_id) whose blocks vLLM freed while the send may still read them (preempted)
    cancels: list[tuple[str, str]] = field(default_factory=list)
