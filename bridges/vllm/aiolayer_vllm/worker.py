"""The worker side (model-runner thread): hands steps and layers to aiolayer and reports results.

It owns the process's aiolayer ``Runtime`` (started with the KV caches) and uses only its public,
thread-safe API. Every call here returns at once: ``save_kv_layer`` hands a layer to the step,
``wait_for_save`` does no network I/O, and D's registrations are handed to the runtime's loop
(``Runtime.receive``). Results come back from thread-safe queues in ``transfer_results``.
Nothing here raises for one request (vLLM would take the engine down): a request that cannot be
served fails alone, logged (D: failed_recving; P: not sent, its blocks handed back when finished).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import re

from aiolayer import ReceiveSpec, Registration, Runtime, Step, TransferSpec
from aiolayer.errors import ConfigError

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
        self._active_step: Step | None = None
        self._req_of: dict[str, str] = {}                 # P: transfer id -> vLLM request id
        self._recv_of: dict[str, tuple[str, list[int]]] = {}   # D: transfer id -> (request id, its blocks)
        # D: (transfer id, reason, (request id, blocks) or None = look up the transfer id), any thread
        self._recv_failures: collections.deque = collections.deque()
        self._sending: set[str] = set()                   # P: request ids with a send not yet reported
        self._released: set[str] = set()                  # P: ... whose sends are quiet
        self._finished: set[str] = set()                  # P: ... that vLLM reported finished
        self._load_errors: set[int] = set()
        self._reported: dict[str, float] = {}             # the totals of the last stats report
        self._http = None   # D: one HTTP client for every registration POST, made and closed on the loop

    # --- set-up --------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        names, k_base, v_base, block_bytes, num_blocks, self._views = kv_layout(kv_caches, self.num_blocks)
        self.layer_index = {name: i for i, name in enumerate(names)}
        self.runtime = Runtime(self.config.node, self.config.timeouts).start()
        self.runtime.on_stop(self._close_http)
        try:
            self.runtime.register_kv_memory(k_base, v_base, block_bytes, num_blocks)
        except BaseException:
            self.runtime.stop()
            raise
        log.info("aiolayer %s: %d layers, %d blocks of %d bytes, control %s", self.config.node.engine_id,
                 len(names), num_blocks, block_bytes, self.runtime.control_endpoint)

    # --- per step (model-runner thread) ----------------------------------------------------------

    def bind(self, meta: AiolayerMetadata) -> None:
        for req_id, tid in meta.cancels:
            self._cancel(req_id, tid)
        for recv in meta.recvs:
            if self._track_recv(recv):
                self._receive(recv)
        for _req_id, tid in meta.aborts:
            try:
                self.runtime.abort_receive(tid, "request aborted at D")
            except Exception:  # noqa: BLE001 - the runtime is gone: the transfer ends with it
                log.exception("transfer %s: abort not handed over", tid)
        if meta.sends:
            self._begin_sends(meta.sends)

    def _receive(self, recv: RecvReq) -> None:
        """D: register before anything is published; a refused registration fails the request alone."""
        spec = ReceiveSpec(transfer_id=recv.transfer_id, block_ids=recv.block_ids, token=recv.token,
                           sender_control=recv.prefill_control, first_block=recv.first_block)
        announce = functools.partial(self._publish, url=recv.notify_url) if recv.notify_url else None
        try:
            self.runtime.receive(spec, announce)
        except Exception as exc:  # noqa: BLE001 - a bad spec or a stopped runtime: this request fails
            log.error("transfer %s: not registered: %s", recv.transfer_id, exc)
            self._recv_failures.append((recv.transfer_id, f"not registered: {type(exc).__name__}: {exc}", None))

    def _track_recv(self, recv: RecvReq) -> bool:
        """D: map the transfer to its request; a second request for a live transfer id fails alone."""
        other = self._recv_of.get(recv.transfer_id)
        if other is not None:
            reason = f"transfer {recv.transfer_id} is already received by request {other[0]}"
            self._recv_failures.append((recv.transfer_id, reason, (recv.req_id, recv.block_ids)))
            return False
        self._recv_of[recv.transfer_id] = (recv.req_id, recv.block_ids)
        return True

    def _begin_sends(self, sends) -> None:
        """P: one step's sends; one that cannot start is logged and its blocks handed back."""
        specs = []
        for send in sends:
            self._sending.add(send.req_id)
            try:
                if send.transfer_id in self._req_of:
                    raise ValueError(f"transfer {send.transfer_id} is already sent by request "
                                     f"{self._req_of[send.transfer_id]}")
                specs.append(TransferSpec(transfer_id=send.transfer_id, peer=send.decode_control,
                                          src_blocks=send.src_blocks, dst_blocks=send.dst_blocks,
                                          dst_incarnation=send.dst_incarnation, token=send.token,
                                          layerwise=send.layerwise))
            except Exception as exc:  # noqa: BLE001 - one request's bad spec must not stop the step
                log.error("request %s: transfer %s not sent: %s", send.req_id, send.transfer_id, exc)
                self._released.add(send.req_id)   # nothing reads its blocks
                continue
            self._req_of[send.transfer_id] = send.req_id
        if not specs:
            return
        try:
            self._active_step = self.runtime.begin_step(specs)
        except Exception as exc:  # noqa: BLE001 - refused before anything was queued: no write started
            log.error("aiolayer: %d transfers not sent: %s", len(specs), exc)
            for spec in specs:
                self._released.add(self._req_of.pop(spec.transfer_id))

    def _cancel(self, req_id: str, tid: str) -> None:
        """P: vLLM freed the blocks of ``req_id`` (preempted): its send must fail, never say DONE."""
        if self._req_of.get(tid) != req_id:
            return   # never started, or already quiet
        try:
            self.runtime.cancel_send(tid, "preempted at P: vLLM freed its blocks")
        except Exception:  # noqa: BLE001 - logged; the send then ends by its own deadlines
            log.exception("transfer %s: cancel failed", tid)

    async def _publish(self, reg: Registration, url: str) -> None:
        """POST the registration to the proxy (bounded retries); raising gives the transfer up."""
        import httpx

        t = self.runtime.timeouts
        body = {"transfer_id": reg.transfer_id, "token": reg.token, "block_ids": reg.block_ids,
                "first_block": reg.first_block, "incarnation": reg.incarnation,
                "decode_control": reg.decode_control}
        error = ""
        if self._http is None:   # made once: a client's TLS set-up alone costs ~20 ms per request
            self._http = httpx.AsyncClient(timeout=t.control_call)
        for attempt in range(t.control_retries):
            try:
                reply = await self._http.post(url, json=body)
            except Exception as exc:  # noqa: BLE001 - httpx raises more than HTTPError (InvalidURL)
                error = f"{type(exc).__name__}: {exc}"
            else:
                if reply.status_code < 300:
                    return
                error = f"HTTP {reply.status_code}: {reply.text[:200]}"
                if reply.status_code < 500:
                    break  # the proxy refused it (e.g. 404 unknown transfer): retrying will not help
            await asyncio.sleep(0.05 * (attempt + 1))
        raise ConnectionError(f"registration not published to {url}: {error}")

    async def _close_http(self) -> None:
        client, self._http = self._http, None
        if client is not None:
            await client.aclose()

    def save_kv_layer(self, layer_name: str) -> None:
        layer = self.layer_index.get(layer_name)
        if self._active_step is None or layer is None:
            return   # no send this step, or a layer whose KV we do not transfer
        try:
            self._active_step.layer_ready(layer)
        except Exception:  # noqa: BLE001 - the runtime is gone: its sends fail by their own deadlines
            log.exception("aiolayer: layer %s not handed over", layer_name)
            self._active_step = None

    def wait_for_save(self) -> None:
        step, self._active_step = self._active_step, None
        if step is not None:
            try:
                step.end()
            except Exception:  # noqa: BLE001 - as in save_kv_layer
                log.exception("aiolayer: step %d not closed", step.id)

    # --- results --------------------------------------------------------------------------------

    def transfer_results(self, finished_req_ids) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) for this pass."""
        sending, recving, failed = set(), set(), set()
        if self.runtime is None:
            return sending, recving, failed
        for outcome in self.runtime.pop_outcomes():
            if not outcome.ok:
                log.warning("aiolayer transfer %s failed: %s", outcome.transfer_id, outcome.reason)
        for tid in self.runtime.pop_released():
            req_id = self._req_of.pop(tid, None)
            if req_id is not None:
                self._released.add(req_id)
        self._finished.update(r for r in finished_req_ids if r in self._sending)   # only ours: no leak
        sending = self._released & self._finished     # vLLM wants ids it told us are finished
        self._released -= sending
        self._finished -= sending
        self._sending -= sending
        for result in self.runtime.pop_received():
            self._record_received(self._recv_of.pop(result.transfer_id, None), result.transfer_id, result.ok,
                                  result.reason, recving, failed)
        while self._recv_failures:
            tid, reason, owner = self._recv_failures.popleft()
            owner = owner if owner is not None else self._recv_of.pop(tid, None)
            self._record_received(owner, tid, False, reason, recving, failed)
        return sending, recving, failed

    def _record_received(self, owner: tuple[str, list[int]] | None, tid: str, ok: bool, reason: str,
                         recving: set, failed: set) -> None:
        if owner is None:
            return
        req_id, blocks = owner
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

        vLLM asks after every step. The figures are the snapshot the loop last published (read whole:
        walking the loop's own dicts from this thread can raise); a count the loop has not published
        yet comes with a later report.
        """
        runtime = self.runtime
        snap = None if runtime is None else runtime.published_metrics
        if snap is None:
            return None
        current = totals(snap)
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
