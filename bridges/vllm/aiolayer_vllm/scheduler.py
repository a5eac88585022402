"""The scheduler side (EngineCore busy loop): decides what each step's metadata asks the workers.

Nothing here blocks or does I/O. D: a request carrying aiolayer parameters is parked
(``(n, True)``) and, once its blocks are allocated, listed for registration. P: a request is listed
for sending in the step where its prefill completes (with chunked prefill, earlier chunks' KV is
final by then, so every block goes out layer by layer in that step), and its blocks are held until
the worker reports the sends finished.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from aiolayer.protocol.plan import use_layerwise

from .config import BridgeConfig
from .metadata import AiolayerMetadata, RecvReq, SendReq
from .params import InvalidParams, RecvParams, SendParams, parse

log = logging.getLogger(__name__)


class SchedulerSide:
    def __init__(self, config: BridgeConfig, block_size: int, is_producer: bool, is_consumer: bool) -> None:
        self.config = config
        self.block_size = block_size
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.kv_cache_manager = None
        self._parked: dict[str, tuple[RecvParams, int]] = {}       # D: req_id -> (params, computed)
        self._receiving: dict[str, str] = {}                       # D: req_id -> transfer_id
        self._to_send: dict[str, tuple[Any, SendParams]] = {}      # P: req_id -> (request, params)
        self._sent: dict[str, str] = {}                            # P: req_id -> transfer_id
        self._meta = AiolayerMetadata()

    # --- D -------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.is_consumer or request.request_id in self._receiving:
            return 0, False
        try:
            recv = parse(request.kv_transfer_params, RecvParams)
        except InvalidParams as exc:
            log.error("request %s: %s; it will be prefilled locally", request.request_id, exc)
            return 0, False
        if recv is None:
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        if count <= 0:
            return 0, False
        self._parked[request.request_id] = (recv, num_computed_tokens)
        return count, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self.is_consumer:
            parked = self._parked.pop(request.request_id, None)
            if parked is not None and num_external_tokens > 0:
                recv, computed = parked
                all_blocks = self.kv_cache_manager.get_block_ids(request.request_id)[0]
                first = computed // self.block_size
                self._receiving[request.request_id] = recv.transfer_id
                self._meta.recvs.append(RecvReq(request.request_id, recv.transfer_id, list(all_blocks[first:]),
                                                first, recv.prefill_control, recv.notify_url, token=recv.token))
        if self.is_producer:
            try:
                send = parse(request.kv_transfer_params, SendParams)
            except InvalidParams as exc:
                log.error("request %s: %s; its KV will not be sent", request.request_id, exc)
                return
            if send is not None and request.request_id not in self._sent:
                self._to_send[request.request_id] = (request, send)

    # --- P -------------------------------------------------------------------------------------

    def _sends_completing_in(self, scheduler_output) -> list[SendReq]:
        out = []
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id, (request, send) in list(self._to_send.items()):
            n = scheduled.get(req_id, 0)
            if n == 0 or request.num_computed_tokens + n < request.num_prompt_tokens:
                continue  # not scheduled, or an earlier chunk: the whole KV is final only at the last one
            del self._to_send[req_id]
            blocks = self.kv_cache_manager.get_block_ids(req_id)[0]
            needed = math.ceil(request.num_prompt_tokens / self.block_size)
            src = list(blocks[send.first_block:needed])
            self._sent[req_id] = send.transfer_id
            out.append(SendReq(req_id, send.transfer_id, src, send.decode_control, send.dst_blocks,
                               send.dst_incarnation,
                               layerwise=use_layerwise(request.num_prompt_tokens, self.config.layerwise_min_tokens),
                               token=send.token))
        return out

    # --- both ------------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output) -> AiolayerMetadata:
        meta, self._meta = self._meta, AiolayerMetadata()
        if self.is_producer:
            meta.sends.extend(self._sends_completing_in(scheduler_output))
        return meta

    def update_connector_output(self, connector_output) -> None:
        for req_id in connector_output.finished_recving or ():
            self._receiving.pop(req_id, None)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._parked.pop(req_id, None)
        self._to_send.pop(req_id, None)
        tid = self._receiving.get(req_id)
        if tid is not None:
            # D gave up while KV was arriving: vLLM holds the blocks until finished_recving, which the
            # worker reports only once P confirmed it stopped writing (the fence).
            self._meta.aborts.append((req_id, tid))
            return False, None
        tid = self._sent.pop(req_id, None)
        if tid is not None:
            return True, {"aiolayer": {"transfer_id": tid}}   # blocks freed on finished_sending
        return False, None
