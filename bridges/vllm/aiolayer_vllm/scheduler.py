"""The scheduler side (EngineCore busy loop): decides what each step's metadata asks the workers.

Nothing here does I/O or blocks, except D's parked wait (``wake``: at most a few ms, in a step that runs
nothing while only our receives are pending, cut short when one ends), and nothing raises for one
request's parameters: a request whose
``kv_transfer_params`` do not fit the contract is logged once and prefilled locally (D) or not sent
(P). D: a request carrying aiolayer parameters is parked (``(n, True)``) and, once its blocks are
allocated, listed for registration. P: a request is listed for sending in the step where its prefill
completes (with chunked prefill, earlier chunks' KV is final by then, so every block goes out layer
by layer in that step), and its blocks are held until the worker reports the sends finished.

Every KV cache group's blocks go (``SupportsHMA``): D registers its groups' block ids one group after
the other, P pairs them with its own group by group, and a block D's sliding-window group has already
replaced with vLLM's null block (outside the window at D's first decode step) is not moved.
With one KV cache group P sends its blocks from the request's first and D's ``first_block`` as
``src_from``: D's blocks may then hold another number of tokens than P's (the runtime maps tokens).

Each request uses its parameters once: vLLM asks ``get_num_new_matched_tokens`` again whenever a
waiting request has no computed token (after a preemption, or after the load of a 1-token prompt,
whose last token vLLM recomputes); that request is then computed locally, as vLLM expects. And each
transfer id serves one request: vLLM's ``n > 1`` children share one ``kv_transfer_params``; only the
first uses it, the others are prefilled locally (D) or not sent (P).
"""

from __future__ import annotations

import collections
import logging
import math
from typing import TYPE_CHECKING, Any

from aiolayer.errors import RuntimeStateError

from .config import BridgeConfig
from .metadata import AiolayerMetadata, RecvReq, SendReq
from .modes import ModePolicy
from .params import InvalidParams, RecvParams, SendParams, read
from .wake import open_waiter, park_wait_s

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

log = logging.getLogger(__name__)
MAX_CLAIMS = 1 << 16      # transfer ids remembered after their request, to refuse a late duplicate


def pair_groups(groups: list[list[int]], dst_blocks: list[int], null: int) -> tuple[list[int], list[int], str]:
    """P: (source, destination, refusal) for one request: D registered its blocks group after group,
    each group as long as ours; a pair where D holds the null block is one D does not need (outside its
    sliding window), so it is not moved. A refusal ("" = none) says why nothing can be moved."""
    size = sum(len(ids) for ids in groups)
    if len(dst_blocks) != size:
        return [], [], (f"D registered {len(dst_blocks)} blocks, P holds {size} in {len(groups)} KV cache "
                        f"group(s) of {[len(ids) for ids in groups]}: P and D do not agree on the KV cache groups")
    src, dst, at = [], [], 0
    for group, ids in enumerate(groups):
        for s, d in zip(ids, dst_blocks[at:at + len(ids)]):
            if d == null:
                continue
            if s == null:
                return [], [], (f"KV cache group {group}: D needs a block P already freed (outside its sliding "
                                "window): P and D do not agree on the KV cache groups")
            src.append(s)
            dst.append(d)
        at += len(ids)
    return src, dst, ""


class SchedulerSide:
    def __init__(self, config: BridgeConfig, block_size: int, is_producer: bool, is_consumer: bool,
                 parked_wait: bool = False, freeing_groups: tuple[int, ...] = ()) -> None:
        self.config = config
        self.block_size = block_size
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.kv_cache_manager: KVCacheManager | None = None   # vLLM's, bound before the first step
        self._params: dict[str, RecvParams | SendParams | None] = {}   # req_id -> its verdict, read once
        self._claims: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()
        self._parked: dict[str, tuple[RecvParams, int]] = {}       # D: req_id -> (params, computed)
        self._receiving: dict[str, str] = {}                       # D: req_id -> transfer_id
        self._consumed: set[str] = set()                           # D: requests that used their params
        self._to_send: dict[str, tuple[Any, SendParams]] = {}      # P: req_id -> (request, params)
        self._sent: dict[str, str] = {}                            # P: req_id -> transfer_id
        self._cancelled: set[str] = set()                          # P: ... whose send was cancelled
        # P: the KV cache groups whose blocks vLLM frees while the request runs (a sliding window's, as
        # it decodes), and per sent request the blocks of theirs its send reads (``_freed_under``)
        self._freeing_groups = freeing_groups
        self._read_by_send: dict[str, frozenset[int]] = {}
        self._meta = AiolayerMetadata()
        self._modes = ModePolicy(config.transfer_mode, config.layerwise_min_tokens)   # P: each send's mode
        self._waiter = open_waiter(park_wait_s(), config.node.engine_id) if parked_wait else None   # D: ``wake``

    def _read(self, request) -> RecvParams | SendParams | None:
        """The request's parameters if this engine may act on them; decided (and logged) once."""
        req_id = request.request_id
        if req_id in self._params:
            return self._params[req_id]
        verdict = None
        try:
            verdict = read(request.kv_transfer_params)
        except InvalidParams as exc:
            log.error("request %s: %s; %s", req_id, exc,
                      "it is prefilled locally" if self.is_consumer else "its KV is not sent")
        if isinstance(verdict, RecvParams) and not self.is_consumer:
            log.error("request %s: D's aiolayer parameters on an engine that is not a KV consumer; ignored", req_id)
            verdict = None
        elif isinstance(verdict, SendParams) and not self.is_producer:
            log.error("request %s: P's aiolayer parameters on an engine that is not a KV producer; "
                      "it is prefilled locally", req_id)
            verdict = None
        if verdict is not None and not self._claim(verdict, req_id):
            verdict = None
        if verdict is not None or (isinstance(request.kv_transfer_params, dict)
                                   and "aiolayer" in request.kv_transfer_params):
            self._params[req_id] = verdict     # only requests that name aiolayer are remembered
        return verdict

    def _claim(self, params: RecvParams | SendParams, req_id: str) -> bool:
        """One request per transfer id (and side): a second one (n > 1, a retried request) is refused."""
        key = (type(params).__name__, params.transfer_id)
        owner = self._claims.get(key)
        if owner is not None and owner != req_id:
            log.error("request %s: transfer %s is already used by request %s (n > 1 or a duplicate); %s", req_id,
                      params.transfer_id, owner, "it is prefilled locally" if isinstance(params, RecvParams)
                      else "its KV is not sent")
            return False
        self._claims[key] = req_id
        while len(self._claims) > MAX_CLAIMS:
            self._claims.popitem(last=False)
        return True

    # --- D -------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        if not self.is_consumer or req_id in self._receiving or req_id in self._consumed:
            return 0, False      # used once already: what vLLM asks for now is computed locally
        recv = self._read(request)
        if not isinstance(recv, RecvParams):
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        if count <= 0:
            return 0, False
        self._parked[req_id] = (recv, num_computed_tokens)
        return count, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        if self.is_consumer:
            parked = self._parked.pop(req_id, None)
            if parked is not None:
                self._consumed.add(req_id)    # from its first allocation on, the parameters are spent
            if parked is not None and num_external_tokens == 0:   # vLLM took none of the KV we offered
                log.warning("request %s: vLLM reads no transferred KV for it (prompt_logprobs, for one): D "
                            "prefills it itself and never registers transfer %s; P's send of it fails at its "
                            "deadline", req_id, parked[0].transfer_id)
            if parked is not None and num_external_tokens > 0:
                recv, computed = parked
                first = computed // self.block_size
                groups = [ids[first:] for ids in self._block_ids(req_id)]
                flat = [b for ids in groups for b in ids]
                self._receiving[req_id] = recv.transfer_id
                self._meta.recvs.append(RecvReq(req_id, recv, flat, first,
                                                own_blocks=[b for b in flat if b != self._null_block()]))
        if self.is_producer and req_id not in self._sent:
            send = self._read(request)
            if isinstance(send, SendParams):
                self._to_send[req_id] = (request, send)

    def _block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per KV cache group (vLLM's group order)."""
        if self.kv_cache_manager is None:
            raise RuntimeStateError("aiolayer: vLLM has not bound its KV cache manager")
        return tuple(self.kv_cache_manager.get_block_ids(req_id))

    def _null_block(self) -> int:
        """vLLM's placeholder for a block a sliding window no longer needs (id 0: the block pool's first)."""
        pool = getattr(self.kv_cache_manager, "block_pool", None)
        return int(getattr(getattr(pool, "null_block", None), "block_id", 0))

    # --- P -------------------------------------------------------------------------------------

    def _sends_completing_in(self, scheduler_output) -> list[SendReq]:
        out = []
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id, (request, send) in list(self._to_send.items()):
            n = scheduled.get(req_id, 0)
            if n == 0 or request.num_computed_tokens + n < request.num_prompt_tokens:
                continue  # not scheduled, or an earlier chunk: the whole KV is final only at the last one
            del self._to_send[req_id]
            needed = math.ceil(request.num_prompt_tokens / self.block_size)
            groups = self._block_ids(req_id)
            if len(send.dst_blocks) > request.num_prompt_tokens * len(groups):   # a D block holds >= 1 token
                paired: tuple[list[int], list[int], str, int] = ([], [], (
                    f"D registered {len(send.dst_blocks)} blocks for a {request.num_prompt_tokens}-token prompt "
                    f"in {len(groups)} KV cache group(s): more than it can hold"), 0)
            else:
                paired = self._pair(groups, needed, send)
            src, dst, refused, src_from = paired
            self._sent[req_id] = send.transfer_id
            freeable = {b for g in self._freeing_groups for b in groups[g][:needed]}.intersection(src)
            if freeable and not refused:
                self._read_by_send[req_id] = frozenset(freeable)
            layerwise = self._modes.layerwise(req_id, step_tokens=scheduler_output.total_num_scheduled_tokens,
                                              prompt_tokens=request.num_prompt_tokens,
                                              dest=send.decode_ranks[0].decode_control,
                                              requested=send.transfer_mode)
            out.append(SendReq(req_id, send, src, dst, refused=refused, src_from=src_from, layerwise=layerwise))
        return out

    def _pair(self, groups: tuple[list[int], ...], needed: int,
              send: SendParams) -> tuple[list[int], list[int], str, int]:
        """P: (source, destination, refusal, src_from) of one request. One KV cache group without a
        null block goes whole from its first block, so that D's blocks may hold another number of
        tokens than ours (the runtime maps tokens, ``TransferSpec.src_from``); several groups pair
        block for block (``pair_groups``: one block size on both sides)."""
        null = self._null_block()
        if send.late:   # D's blocks come from D (the runtime binds them): ours go whole from the first
            if len(groups) == 1 and null not in groups[0][:needed]:
                return list(groups[0][:needed]), [], "", 0
            return [], [], "late binding needs one KV cache group without a sliding window; use D-first", 0
        if len(groups) == 1 and null not in send.dst_blocks and null not in groups[0][:needed]:
            # first_block counts D's blocks: whether they fit ours is the runtime's check (check_layout)
            # D's list itself, not a copy: the metadata pickles it once (it is in ``params`` too)
            return list(groups[0][:needed]), send.dst_blocks, "", send.first_block
        return (*pair_groups([ids[send.first_block:needed] for ids in groups], send.dst_blocks, null), 0)

    def _cancels_for(self, scheduler_output) -> list[tuple[str, str]]:
        """P: sends whose request vLLM preempted, and so freed its blocks at once (vLLM's
        ``_preempt_request``, from ``schedule`` or ``reset_prefix_cache``): their writes may read
        blocks that now hold another request's KV, so they must fail (FAILED to D, never DONE)."""
        out = []
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
        for req_id, why in [*((r, "preempted") for r in preempted), *self._freed_under(scheduler_output)]:
            tid = self._sent.get(req_id)
            self._read_by_send.pop(req_id, None)
            if tid is not None and req_id not in self._cancelled:
                self._cancelled.add(req_id)
                log.warning("request %s %s while its KV may still be sending: transfer %s fails", req_id, why, tid)
                out.append((req_id, tid))
        return out

    def _freed_under(self, scheduler_output) -> list[tuple[str, str]]:
        """P: sent requests that went on running (``max_tokens`` > 1 at P) and whose sliding window moved
        past a block their send reads: vLLM freed it in this step's allocation, for any request to take,
        so the send must fail as a preempted one does (a send that ended already ignores the cancel)."""
        scheduled = scheduler_output.num_scheduled_tokens
        out = []
        for req_id, sources in self._read_by_send.items():
            if req_id in scheduled:
                groups = self._block_ids(req_id)
                held = {b for g in self._freeing_groups for b in groups[g]}
                if not sources <= held:
                    out.append((req_id, "decoded past a sliding-window block its send reads"))
        return out

    # --- both ------------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output) -> AiolayerMetadata:
        meta, self._meta = self._meta, AiolayerMetadata()
        if self._waiter is not None and self._only_parked(scheduler_output, meta):
            self._waiter.wait()
        if self.is_producer:
            meta.cancels.extend(self._cancels_for(scheduler_output))
            meta.sends.extend(self._sends_completing_in(scheduler_output))
        return meta

    def _only_parked(self, scheduler_output, meta: AiolayerMetadata) -> bool:
        """D: this step runs nothing and only waits for our receives: worth a wait (capped, woken by the
        receiver) instead of vLLM's next empty step 1 ms later. Anything else in it, no wait."""
        return bool(self._receiving) and not self._to_send and not meta.recvs and not meta.aborts \
            and not meta.sends and not meta.cancels and scheduler_output.total_num_scheduled_tokens == 0 \
            and not scheduler_output.finished_req_ids and not getattr(scheduler_output, "preempted_req_ids", None)

    def close(self) -> None:
        if self._waiter is not None:
            self._waiter.close()
            self._waiter = None

    def update_connector_output(self, connector_output) -> None:
        for req_id in connector_output.finished_recving or ():
            self._receiving.pop(req_id, None)
        self._modes.observe(getattr(connector_output, "kv_connector_worker_meta", None))

    def request_finished(self, request) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._parked.pop(req_id, None)
        self._to_send.pop(req_id, None)
        self._params.pop(req_id, None)
        self._consumed.discard(req_id)
        self._cancelled.discard(req_id)
        tid = self._receiving.get(req_id)
        if tid is not None:
            # D gave up while KV was arriving: vLLM holds the blocks until finished_recving, which the
            # worker reports only once P confirmed it stopped writing (the fence).
            self._meta.aborts.append((req_id, tid))
            return False, None
        self._read_by_send.pop(req_id, None)
        tid = self._sent.pop(req_id, None)
        if tid is not None:
            return True, {"aiolayer": {"transfer_id": tid}}   # blocks freed on finished_sending
        return False, None
