"""``AiolayerConnector``: vLLM's KVConnectorBase_V1, dispatching to a scheduler side and a worker side."""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorRole,
                                                                KVConnectorTransferResults, SupportsHMA)

from aiolayer.errors import ConfigError, RuntimeStateError

from . import ranks
from .config import check_extra_config, from_extra_config
from .draft import draft_facts, draft_start
from .identity import model_facts
from .kv_written import hook_kv_writes
from .layout import cpu_kernel, request_amx_tiles
from .metadata import AiolayerMetadata
from .modes import AiolayerWorkerMeta
from .scheduler import SchedulerSide
from .spin import cap_spin
from .stats import AiolayerPromMetrics, AiolayerStats
from .wake import LOCAL_EXECUTORS, engine_core_pid
from .worker import WorkerSide

log = logging.getLogger(__name__)


def _configure_logging() -> None:
    """aiolayer's and this bridge's log level in vLLM's processes (AIOLAYER_LOG_LEVEL, default WARNING);
    DEBUG shows the per-transfer timeline (``worker.stage``)."""
    level = os.environ.get("AIOLAYER_LOG_LEVEL", "")
    # the bridge's logger: as vLLM set it, unless asked
    for name in ("aiolayer", "aiolayer_vllm") if level else ("aiolayer",):
        logger = logging.getLogger(name)
        logger.setLevel((level or "WARNING").upper())
        if not logger.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter(
                "%(asctime)s aiolayer[%(process)d] %(levelname)s %(name)s: %(message)s"))
            logger.addHandler(handler)


# Group kinds whose blocks hold plain attention KV (a block id per block_size tokens, one layout for
# every layer): P's blocks of each group copy into D's. Others (SSM state, chunked-local attention,
# ring buffers...) keep state the bridge does not know how to move.
MOVABLE_GROUPS = ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec")


def kv_cache_groups(kv_cache_config) -> list[str]:
    """Each KV cache group's kind (with its sliding window) and layer count, in vLLM's group order;
    refuses (both roles, at start) a group of several whose kind the bridge cannot move."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    kinds = []
    for group in groups:
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if len(groups) > 1 and kind not in MOVABLE_GROUPS:
            raise ConfigError(f"aiolayer moves the KV cache groups {', '.join(MOVABLE_GROUPS)}; vLLM gave "
                              f"{len(groups)} groups, one of them {kind} (its layers {list(group.layer_names)[:3]}"
                              "...): not supported yet")
        window = getattr(spec, "sliding_window", None)
        kinds.append(f"{kind}{f'({window})' if window else ''}x{len(group.layer_names)}")
    return kinds


# kv_cache_dtype values whose blocks hold the values alone (vLLM stores fp8 as uint8, fp8_inc as
# float8_e4m3fn), with per-tensor scales that are the model's own: static in vLLM 0.32 (1.0, or the
# checkpoint's k_scale/v_scale), so the same at P and D, whose fingerprints name one model. Their bytes
# move as laid out. Others (per-token-head scales, DeepSeek's fp8/nvfp4 MLA entries, turboquant...)
# keep scales beside or inside the blocks in layouts the bridge has not been taught.
MOVABLE_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")


def check_cache_dtype(cache_dtype: str) -> None:
    """Refuses (both roles, at start) a KV cache dtype whose scales the bridge would not move."""
    if str(cache_dtype) not in MOVABLE_CACHE_DTYPES:
        raise ConfigError(f"aiolayer moves KV caches of kv_cache_dtype {', '.join(MOVABLE_CACHE_DTYPES)}; this "
                          f"engine runs {cache_dtype!r}, whose scales live beside or inside its blocks: "
                          "not supported yet")


def check_micro_batching(parallel_config) -> None:
    """Refuses (both roles, at start) a step split into micro-batches (vLLM's dual batch overlap,
    ``ubatch_size``): each writes part of every layer's KV, and P hands a layer over once per step."""
    if getattr(parallel_config, "use_ubatching", False):
        raise ConfigError("aiolayer hands each layer's KV over once per step, but with micro-batches (enable_dbo, "
                          f"ubatch_size {getattr(parallel_config, 'ubatch_size', '?')}) a step writes every layer in "
                          "parts: not supported yet")


def freeing_groups(groups: list[str]) -> tuple[int, ...]:
    """The groups whose blocks vLLM may free while their request still runs (all but full attention's:
    a sliding window frees the blocks it moved past)."""
    return tuple(i for i, kind in enumerate(groups) if not kind.startswith(("FullAttentionSpec", "MLAAttentionSpec")))


def group_facts(groups: list[str], block_size: int) -> dict[str, object]:
    """The groups' part of the fingerprint: P and D must agree on several groups, and where blocks pair
    block for block (several groups, or a sliding window's, whose blocks outside it are null: the
    scheduler's ``pair_groups``) on the block size too. One group of full attention may differ in it
    (the runtime copies tokens between blocks of other sizes)."""
    facts: dict[str, object] = {"kv_cache_groups": ";".join(groups)} if len(groups) > 1 else {}
    if len(groups) > 1 or any(g.startswith("SlidingWindowSpec") for g in groups):
        facts["block_size"] = block_size
    return facts


class AiolayerConnector(KVConnectorBase_V1, SupportsHMA):
    """Every KV cache group's blocks move (``SupportsHMA``: vLLM keeps its hybrid KV cache manager on),
    see ``scheduler`` (block ids per group) and ``layout`` (the groups' shared tensors)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _configure_logging()
        check_cache_dtype(vllm_config.cache_config.cache_dtype)
        check_micro_batching(vllm_config.parallel_config)
        groups = kv_cache_groups(kv_cache_config)
        ktc = self._kv_transfer_config
        engine_id = getattr(ktc, "engine_id", None) or "vllm"
        self.config = from_extra_config(ktc.kv_connector_extra_config, str(engine_id), ktc)
        if self.config.queue_spin_s is not None:   # this process's readers: the worker's or the engine core's
            cap_spin(self.config.queue_spin_s)
        producer, consumer = bool(ktc.is_kv_producer), bool(ktc.is_kv_consumer)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        executor = vllm_config.parallel_config.distributed_executor_backend
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self.config, vllm_config.cache_config.block_size, producer, consumer,
                                            parked_wait=consumer and executor in LOCAL_EXECUTORS,
                                            freeing_groups=freeing_groups(groups))
        else:
            request_amx_tiles()   # before this worker's first attention step
            self._worker = WorkerSide(self.config, producer, consumer, kv_cache_config.num_blocks,
                                      ranks.from_vllm(vllm_config), block_size=vllm_config.cache_config.block_size,
                                      head_size=vllm_config.model_config.get_head_size(),
                                      engine_core_pid=engine_core_pid(executor), cpu_kernel=cpu_kernel(vllm_config),
                                      model_facts=model_facts(vllm_config) | draft_facts(vllm_config) | group_facts(
                                          groups, vllm_config.cache_config.block_size),
                                      draft_start=draft_start(vllm_config))

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # vLLM asks this while it builds the engine config (API server, CUDA graph platforms): the
        # earliest the connector sees its settings there, so check them before any model loads
        check_extra_config(extra_config)
        return True  # per-layer hooks cannot run inside a captured CUDA graph

    # --- worker side ---------------------------------------------------------------------------

    @property
    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeStateError("aiolayer: a worker-side call on the scheduler's connector")
        return self._worker

    def register_kv_caches(self, kv_caches) -> None:
        worker = self._worker_side
        worker.register_kv_caches(kv_caches)
        # each layer handed over as soon as vLLM wrote its KV (``kv_written``); AIOLAYER_KV_WRITTEN_HOOK=0: after
        # its attention, as vLLM calls save_kv_layer (to compare the two)
        if worker.is_producer and os.environ.get("AIOLAYER_KV_WRITTEN_HOOK", "1") != "0":
            hooked = hook_kv_writes(self._vllm_config.compilation_config.static_forward_context, worker.layer_index,
                                    worker.save_kv_layer)
            log.info("aiolayer: %d of %d layers hand their KV over as it is written, the others after their "
                     "attention", len(hooked), len(worker.layer_index))

    def bind_connector_metadata(self, connector_metadata: AiolayerMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker_side.bind(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return None  # D's KV is pushed by P; nothing to start here

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # a request runs only after all of its KV arrived (async load)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        self._worker_side.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker_side.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _failed = self._worker_side.transfer_results(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # a failed receive goes by request only (failed_recving), never also as block ids
        # (get_block_ids_with_load_errors): with several KV cache groups, where block ids repeat from group
        # to group, vLLM's scheduler raises on those, and the engine core dies
        sending, recving, failed = self._worker_side.transfer_results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()

    # --- stats (worker side reports, vLLM aggregates and exports) -------------------------------

    def get_kv_connector_stats(self) -> AiolayerStats | None:
        return self._worker.stats() if self._worker is not None else None

    def build_connector_worker_meta(self) -> AiolayerWorkerMeta | None:
        return self._worker.worker_meta() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> AiolayerStats:
        return AiolayerStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> AiolayerPromMetrics:
        return AiolayerPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # --- scheduler side ------------------------------------------------------------------------

    @property
    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeStateError("aiolayer: a scheduler-side call on a worker's connector")
        return self._scheduler

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler_side.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> AiolayerMetadata:
        return self._scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side.request_finished(request)

    def request_finished_all_groups(self, request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side.request_finished(request)   # held or freed: every group's blocks alike
