"""A real vLLM ``Scheduler`` with ``AiolayerConnector``, and its worker-side twin, in one process.

``Engine`` plays one vLLM engine without a model: the real Scheduler (scheduler-side connector),
a real worker-side connector with torch KV tensors and a real aiolayer Runtime (memory backend),
and ``step()`` = schedule -> bind metadata -> per-layer save hooks -> wait_for_save -> transfer
results -> ``update_from_output``, as vLLM's model runner does, minus the model.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile

import torch

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
BLOCK_SIZE = 32
NUM_BLOCKS = 64
_MODEL_DIR: list[str] = []


def model_dir() -> str:
    """A config-only Llama (no weights needed: nothing runs the model here)."""
    if not _MODEL_DIR:
        from transformers import LlamaConfig

        path = tempfile.mkdtemp(prefix="aiolayer-llama-cfg-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=len(LAYERS),
                    num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                    max_position_embeddings=4096).save_pretrained(path)
        _MODEL_DIR.append(path)
    return _MODEL_DIR[0]


def vllm_config(role: str, extra: dict, policy: str = "fail", max_batched: int = 1024, block_size: int = BLOCK_SIZE):
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    model = ModelConfig(model=model_dir(), dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=4096)
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched, max_model_len=4096,
                            enable_chunked_prefill=True, is_encoder_decoder=False)
    cache = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, cache_dtype="auto",
                        enable_prefix_caching=False)
    ktc = KVTransferConfig(kv_connector="AiolayerConnector", kv_role=role, kv_connector_extra_config=extra,
                           kv_load_failure_policy=policy)
    return VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache, kv_transfer_config=ktc,
                      device_config=DeviceConfig("cpu"))


class Engine:
    def __init__(self, role: str, extra: dict, policy: str = "fail", max_batched: int = 1024,
                 layout: str = "cpu", num_blocks: int = NUM_BLOCKS, asynchronous: bool = False,
                 window: int = 0, block_size: int = BLOCK_SIZE) -> None:
        from aiolayer_vllm.connector import AiolayerConnector
        from aiolayer_vllm.plugin import register
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
        from vllm.v1.structured_output import StructuredOutputManager

        register()
        self.config = vllm_config(role, extra, policy, max_batched, block_size)
        full = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float32)
        # window: vLLM's hybrid KV cache manager, layer 0 full attention and layer 1 a sliding window of
        # that many tokens, in two KV cache groups overlaid on one tensor (as vLLM allocates them)
        groups = [KVCacheGroupSpec(LAYERS, full)] if not window else [
            KVCacheGroupSpec(LAYERS[:1], full),
            KVCacheGroupSpec(LAYERS[1:], SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=64,
                                                           dtype=torch.float32, sliding_window=window))]
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        self.config.cache_config.num_gpu_blocks = num_blocks
        # asynchronous: vLLM's AsyncScheduler (async scheduling, vLLM's default where supported): the
        # next step may be scheduled before this one's output is in; see ``run`` and ``land``
        cls = AsyncScheduler if asynchronous else Scheduler
        self.scheduler = cls(vllm_config=self.config, kv_cache_config=kv_cache_config, log_stats=True,
                                   structured_output_manager=StructuredOutputManager(self.config),
                                   block_size=block_size)
        self.worker = AiolayerConnector(self.config, KVConnectorRole.WORKER, kv_cache_config)
        # "cpu": vLLM's CPU backend, [num_blocks, kv_heads, block_size, 2 * head_size] (K and V in
        # each block); "split": [2, num_blocks, block_size, kv_heads, head_size] (flash on CUDA)
        shape = (num_blocks, 1, block_size, 128) if layout == "cpu" else (2, num_blocks, block_size, 1, 64)
        self.layout = layout
        shared = torch.zeros(shape)
        self.kv = {name: shared if window else torch.zeros(shape) for name in LAYERS}
        self.worker.register_kv_caches(self.kv)
        self.outputs = []
        self.reports = []          # per step: (transfer results, connector stats), as vLLM collects them

    @property
    def runtime(self):
        return self.worker._worker.runtime

    def add(self, req_id: str, prompt: list[int], max_tokens: int, params: dict | None, **sampling):
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
        sp.update_from_generation_config({}, 2)
        req = Request(request_id=req_id, prompt_token_ids=prompt, sampling_params=sp, pooling_params=None)
        req.kv_transfer_params = params
        self.scheduler.add_request(req)
        return req

    def status(self, req_id: str):
        """The request's vLLM status; None once the scheduler forgot it."""
        req = self.scheduler.requests.get(req_id)
        return None if req is None else req.status

    def finished(self, req_id: str) -> list:
        """The request's outputs that carry a finish reason (vLLM's own record of how it ended)."""
        return [o for outs in self.outputs for eo in outs.values() for o in eo.outputs
                if o.request_id == req_id and o.finish_reason is not None]

    def step(self, before_save=None) -> object:
        out, mro = self.run(before_save)
        self.land(out, mro)
        return out

    def land(self, out, mro) -> None:
        """Hand a step's output to the scheduler (with async scheduling, after the next ``run``)."""
        self.outputs.append(self.scheduler.update_from_output(out, mro))

    def run(self, before_save=None) -> tuple:
        """Schedule one step and run it on the worker side; returns (scheduler output, model output)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        if out.total_num_scheduled_tokens:
            for name in LAYERS:
                if before_save is not None:
                    before_save(name)
                self.worker.save_kv_layer(name, self.kv[name], None)
        self.worker.wait_for_save()
        res = self.worker.get_transfer_results(out.finished_req_ids)
        errors = self.worker.get_block_ids_with_load_errors()
        stats = self.worker.get_kv_connector_stats()   # after the results, as vLLM's model runner asks
        worker_meta = self.worker.build_connector_worker_meta()
        self.reports.append((res, stats))
        self.worker.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        kv_out = KVConnectorOutput(finished_sending=res.finished_sending or None,
                                   finished_recving=res.finished_recving or None,
                                   failed_recving=res.failed_recving, invalid_block_ids=errors,
                                   kv_connector_stats=stats, kv_connector_worker_meta=worker_meta)
        # a partial prefill (an early chunk) samples nothing, as in the real model runner
        sampled = [[] if self._partial(r) else [7] for r in req_ids]
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled, kv_connector_output=kv_out)
        return out, mro

    def _partial(self, req_id: str) -> bool:
        req = self.scheduler.requests.get(req_id)
        return req is not None and req.num_computed_tokens < req.num_prompt_tokens

    def kv_blocks(self, name: str) -> torch.Tensor:
        """Layer ``name``'s cache as a view with blocks first (writes go through)."""
        t = self.kv[name]
        return t if self.layout == "cpu" else t.transpose(0, 1)

    def blocks_of(self, req_id: str, group: int = 0) -> list[int]:
        mgr = self.scheduler.kv_cache_manager.coordinator.single_type_managers[group]
        return [b.block_id for b in mgr.req_to_blocks.get(req_id, [])]

    def close(self) -> None:
        self.worker.shutdown()


# --- flows shared by the tests (a proxy's part, played by the test) ---------------------------------

# short deadlines: a flow that waits for one fails its test in seconds, not minutes
FAST = {"control_call": 0.5, "layer_write": 1.0, "done_delivery": 1.0, "receive": 20.0, "fence_grace": 1.0}


def engines_fixture():
    """Fixture body: ``engines(role, engine_id, extra=..., **kw)`` -> an Engine (memory backend,
    ``FAST`` deadlines), every one closed at teardown."""
    made: list[Engine] = []

    def make(role: str, engine_id: str, **kw) -> Engine:
        extra = {"backend": "memory", "engine_id": engine_id, "timeouts": FAST, **kw.pop("extra", {})}
        eng = Engine(role, extra, **kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


def tok(tid: str) -> str:
    """The token a proxy would mint for ``tid`` (any secret of 16+ characters)."""
    return f"{tid}-token-0123456789abcdef"


def recv_params(p: Engine, tid: str) -> dict:
    """What the proxy gives D: the transfer, its token, and P's control endpoint."""
    return {"aiolayer": {"transfer_id": tid, "token": tok(tid), "prefill_controls": [p.runtime.control_endpoint]}}


def lookup(p: Engine, d: Engine, tid: str, limit: float = 5.0):
    """D's registration of ``tid`` (as P would ask for it), once D's loop has made it."""
    import time

    from aiolayer.protocol import messages as m

    deadline = time.monotonic() + limit
    while True:
        try:
            return p.runtime.request(d.runtime.control_endpoint, m.LookupRequest(transfer_id=tid, token=tok(tid)))
        except Exception:  # noqa: BLE001 - not registered yet: D registers on its loop
            assert time.monotonic() < deadline, "D never published the registration"
            time.sleep(0.01)


def send_params(d: Engine, tid: str, reg) -> dict:
    """What the proxy gives P: D's registration of the transfer."""
    return {"aiolayer": {"transfer_id": tid, "token": tok(tid), "dst_blocks": reg.block_ids,
                         "decode_ranks": [{"decode_control": d.runtime.control_endpoint,
                                           "dst_incarnation": reg.incarnation}],
                         "first_block": reg.first_block}}


def steps_until(cond, *engines: Engine, limit: float = 10.0) -> float:
    """Step every engine until ``cond()`` holds; returns the seconds it took."""
    import time

    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit, "condition never held"
        for engine in engines:
            engine.step()
        time.sleep(0.005)
    return time.monotonic() - t0


def layer_pattern(engine: Engine, req_id: str):
    """A ``before_save`` hook: the forward writes layer i + 1 into ``req_id``'s blocks."""
    def write(name: str) -> None:
        blocks = engine.blocks_of(req_id)
        if blocks:
            engine.kv_blocks(name)[blocks] = float(LAYERS.index(name) + 1)
    return write
