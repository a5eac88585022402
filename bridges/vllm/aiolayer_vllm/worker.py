"""The worker side (model-runner thread): hands steps and layers to aiolayer and reports results.

It owns the process's aiolayer ``Runtime`` (started with the KV caches). Every call here returns
at once: ``save_kv_layer`` appends to the bridge, ``wait_for_save`` does no network I/O, and D's
registrations run on the loop. Results come back from thread-safe queues in ``transfer_results``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re

from aiolayer import Runtime, TransferSpec
from aiolayer.errors import AiolayerError, ConfigError
from aiolayer.runtime.metrics import snapshot

from .config import BridgeConfig
from .metadata import AiolayerMetadata, RecvReq
from .stats import AiolayerStats, delta, totals

log = logging.getLogger(__name__)
_LAYER_NUMBER = re.compile(r"\.(\d+)\.")


def layer_order(names) -> list[str]:
    """Layer names in model order, by the layer number in each name (identity by name, not a counter)."""
    def key(name: str):
        found = _LAYER_NUMBER.search(name)
        return (int(found.group(1)) if found else 1 << 30, name)
    return sorted(names, key=key)


def kv_layout(kv_caches: dict, num_blocks: int) -> tuple[list[str], list[int], list[int], int, int, dict]:
    """(names, K bases, V bases, block bytes, num blocks, per-name planes) of vLLM's caches.

    Two layouts: [2, num_blocks, ...] (K and V tensors, e.g. flash attention on CUDA) and
    [num_blocks, ...] with each block holding its K and V together (the CPU backend's
    [num_blocks, kv_heads, block_size, 2 * head_size]): then the whole block is one plane and the
    V bases are 0. Each plane must be contiguous, so block ``b`` is one run of bytes.
    """
    names = layer_order(kv_caches)
    k_base, v_base, views, geometry = [], [], {}, set()
    for name in names:
        t = kv_caches[name]
        if t.dim() >= 2 and t.shape[0] == num_blocks:
            planes = (t,)
        elif t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == num_blocks:
            planes = (t[0], t[1])
        else:
            raise ConfigError(f"layer {name}: KV cache of shape {tuple(t.shape)} has no {num_blocks}-block "
                              "dimension first (or after a K/V dimension of 2)")
        if not all(p.is_contiguous() for p in planes):
            raise ConfigError(f"layer {name}: each KV plane must be contiguous")
        geometry.add((planes[0][0].numel() * planes[0].element_size(), len(planes)))
        k_base.append(planes[0].data_ptr())
        v_base.append(planes[1].data_ptr() if len(planes) == 2 else 0)
        views[name] = planes
    if len(geometry) != 1:
        raise ConfigError(f"layers differ in (block_bytes, planes): {sorted(geometry)}")
    block_bytes, _ = geometry.pop()
    return names, k_base, v_base, block_bytes, num_blocks, views


class WorkerSide:
    def __init__(self, config: BridgeConfig, is_producer: bool, is_consumer: bool, num_blocks: int) -> None:
        self.config = config
        self.num_blocks = num_blocks
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.runtime: Runtime | None = None
        self.layer_index: dict[str, int] = {}
        self._views: dict = {}
        self._step = 0
        self._active_step: int | None = None
        self._req_of: dict[str, str] = {}                 # transfer id -> vLLM request id
        self._recv_blocks: dict[str, list[int]] = {}      # D: transfer id -> destination blocks
        self._recv_failures: collections.deque = collections.deque()   # (req_id, reason) from the loop
        self._sending: set[str] = set()                   # P: request ids with a send not yet reported
        self._released: set[str] = set()                  # P: ... whose sends are quiet
        self._finished: set[str] = set()                  # P: ... that vLLM reported finished
        self._load_errors: set[int] = set()
        self._reported: dict[str, float] = {}             # the totals of the last stats report

    # --- set-up --------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        names, k_base, v_base, block_bytes, num_blocks, self._views = kv_layout(kv_caches, self.num_blocks)
        self.layer_index = {name: i for i, name in enumerate(names)}
        self.runtime = Runtime(self.config.node, self.config.timeouts, forget_settled=True).start()
        try:
            self.runtime.publish_layout(k_base, v_base, block_bytes, num_blocks)
        except BaseException:
            self.runtime.stop()
            raise
        log.info("aiolayer %s: %d layers, %d blocks of %d bytes, control %s", self.config.node.engine_id,
                 len(names), num_blocks, block_bytes, self.runtime.control_endpoint)

    # --- per step (model-runner thread) ----------------------------------------------------------

    def bind(self, meta: AiolayerMetadata) -> None:
        for recv in meta.recvs:
            self._req_of[recv.transfer_id] = recv.req_id
            self._recv_blocks[recv.transfer_id] = recv.block_ids
        if meta.recvs or meta.aborts:
            self.runtime.loop_thread.submit(self._apply_on_loop(meta.recvs, meta.aborts))
        if meta.sends:
            self._step += 1
            specs = []
            for send in meta.sends:
                self._req_of[send.transfer_id] = send.req_id
                self._sending.add(send.req_id)
                specs.append(TransferSpec(transfer_id=send.transfer_id, peer=send.decode_control,
                                          src_blocks=send.src_blocks, dst_blocks=send.dst_blocks,
                                          dst_incarnation=send.dst_incarnation, token=send.token,
                                          layerwise=send.layerwise))
            self.runtime.sender.begin_step(self._step, specs)
            self._active_step = self._step

    async def _apply_on_loop(self, recvs: list[RecvReq], aborts: list[tuple[str, str]]) -> None:
        """D: register before anything is published; a refused registration fails the request."""
        receiver = self.runtime.receiver
        for recv in recvs:
            try:
                receiver.register(recv.transfer_id, recv.block_ids, token=recv.token,
                                  sender_control=recv.prefill_control,
                                  first_block=recv.first_block)
            except AiolayerError as exc:
                self._recv_failures.append((recv.req_id, recv.transfer_id, str(exc)))
                continue
            if recv.notify_url:
                self.runtime.loop_thread.spawn(self._publish(recv), name=f"publish {recv.transfer_id}")
        for _req_id, tid in aborts:
            try:
                receiver.abort(tid, "request aborted at D")
            except AiolayerError:
                pass  # already ended: its result is on its way

    async def _publish(self, recv: RecvReq) -> None:
        """POST the registration to the proxy (bounded retries); if nobody takes it, give up the transfer."""
        import httpx

        rt, t = self.runtime, self.runtime.timeouts
        body = {"transfer_id": recv.transfer_id, "token": recv.token, "block_ids": recv.block_ids,
                "first_block": recv.first_block,
                "incarnation": rt.incarnation, "decode_control": rt.control_endpoint}
        error = ""
        async with httpx.AsyncClient(timeout=t.control_call) as client:
            for attempt in range(t.control_retries):
                try:
                    reply = await client.post(recv.notify_url, json=body)
                except httpx.HTTPError as exc:
                    error = f"{type(exc).__name__}: {exc}"
                else:
                    if reply.status_code < 300:
                        return
                    error = f"HTTP {reply.status_code}: {reply.text[:200]}"
                    if reply.status_code < 500:
                        break  # the proxy refused it (e.g. 404 unknown transfer): retrying will not help
                await asyncio.sleep(0.05 * (attempt + 1))
        log.warning("transfer %s: registration not published to %s: %s", recv.transfer_id, recv.notify_url, error)
        try:
            rt.receiver.abort(recv.transfer_id, f"registration not published: {error}")
        except AiolayerError:
            pass

    def save_kv_layer(self, layer_name: str) -> None:
        if self._active_step is not None:
            self.runtime.sender.layer_ready(self._active_step, self.layer_index[layer_name])

    def wait_for_save(self) -> None:
        if self._active_step is not None:
            self.runtime.sender.end_step(self._active_step)
            self._active_step = None

    # --- results --------------------------------------------------------------------------------

    def transfer_results(self, finished_req_ids) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) for this pass."""
        sending, recving, failed = set(), set(), set()
        if self.runtime is None:
            return sending, recving, failed
        for outcome in self.runtime.sender.pop_outcomes():
            if not outcome.ok:
                log.warning("aiolayer transfer %s failed: %s", outcome.transfer_id, outcome.reason)
        for tid in self.runtime.sender.pop_released():
            req_id = self._req_of.pop(tid, None)
            if req_id is not None:
                self._released.add(req_id)
        self._finished.update(r for r in finished_req_ids if r in self._sending)   # only ours: no leak
        sending = self._released & self._finished     # vLLM wants ids it told us are finished
        self._released -= sending
        self._finished -= sending
        self._sending -= sending
        for result in self.runtime.receiver.pop_results():
            self._record_received(result.transfer_id, result.ok, result.reason, recving, failed)
        while self._recv_failures:
            _req_id, tid, reason = self._recv_failures.popleft()
            self._record_received(tid, False, reason, recving, failed)
        return sending, recving, failed

    def _record_received(self, tid: str, ok: bool, reason: str, recving: set, failed: set) -> None:
        req_id = self._req_of.pop(tid, None)
        blocks = self._recv_blocks.pop(tid, [])
        if req_id is None:
            return
        recving.add(req_id)   # failed receives are reported as finished too (vLLM's contract)
        if not ok:
            failed.add(req_id)
            self._load_errors.update(blocks)
            log.warning("aiolayer receive %s (request %s) failed: %s", tid, req_id, reason)
        elif self.config.debug_zero_received:
            self._zero(blocks)

    def _zero(self, blocks: list[int]) -> None:
        import torch

        idx = torch.as_tensor(blocks, dtype=torch.int64)
        for planes in self._views.values():
            for plane in planes:
                plane.index_fill_(0, idx, 0)

    def stats(self) -> AiolayerStats | None:
        """What changed since the last report (None: nothing), read without waiting for the loop.

        vLLM asks after every step; the step that reports a transfer finished also carries its count.
        """
        if self.runtime is None:
            return None
        current = totals(snapshot(self.runtime))
        stats = AiolayerStats(data=delta(current, self._reported))
        self._reported = current
        return None if stats.is_empty() else stats

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.runtime is not None:
            self.runtime.stop()
            self.runtime = None
