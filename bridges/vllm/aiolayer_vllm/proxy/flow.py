"""One proxied request, D first (D registers and POSTs its blocks, then P prefills and pushes the KV),
late-bound (P and D at once: P's transfers ask D for its blocks themselves, docs/proxy.md), or local (a
short prompt D prefills itself, no P and no transfer: ``route.RouteChooser``).

Each step has its own deadline (``ProxyTimeouts``). A backend's 4xx (the request's own fault) goes to
the client unchanged; every other failure ends in an OpenAI-shaped JSON error that says which backend
did what (refused the connection, timed out, answered an error) and, where D already holds blocks, an
``AbortRequest`` to D so it frees them only once P is quiet. Closing an HTTP call to vLLM aborts that
request inside vLLM, so cancelling the exchange (client gone, deadline) drops the request on both
engines. The exchange leases its P until P's prefill answered and its D until ``close``, which its
owner runs in a ``finally``. P's call runs in its own task: D's tokens are relayed as soon as D has
them, and P failing meanwhile still aborts D and ends the client's answer with P's error. Each
exchange keeps a timeline of its stages (``stamps``: the stage histograms of ``/metrics``, and one
debug line when it closes).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from dataclasses import dataclass

import httpx
import msgspec

from aiolayer import compat
from aiolayer.errors import AiolayerError, ControlRejected
from aiolayer.protocol import messages as m
from aiolayer.protocol.codes import NackCode

from ..params import KEY, DecodeRegistration, RecvParams, RequestedMode, SendParams
from ..ranks import rank_transfer_id
from .failures import ExchangeError, answered_error, call_failed
from .pool import Backend, Lease
from .topology import Learned

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProxyTimeouts:
    registration_s: float = 30.0   # D queued the request, allocated and POSTed its registration
    prefill_s: float = 120.0       # P's prefill request (one token)
    request_s: float = 600.0       # D's whole generation
    abort_s: float = 2.0           # telling D to give a transfer up


# how P learns D's blocks: from the proxy after D registered (d-first), from D itself (late), or late
# wherever both engines' ranks said they can (auto: ``binds_late``)
BINDINGS = ("auto", "d-first", "late")


def binds_late(binding: str, prefill: Learned | None, decode: Learned | None) -> bool:
    """Whether one exchange goes late. Late binding addresses D's ranks by endpoint, and only D's first
    data-parallel rank has one we know (vLLM picks the rank): D-first for a D not seen to be alone
    (``Learned.one_dp_rank``: a dense model's DP rank 0 says dp 1 of 1). ``auto`` also needs both
    engines learned and P able to send before D's blocks are known (``Learned.late_binding``: a hybrid
    or sliding-window KV cache pairs its blocks with D's, so its P refuses a late request)."""
    if binding == "late":
        return decode is None or decode.one_dp_rank
    return binding == "auto" and prefill is not None and decode is not None and decode.one_dp_rank \
        and prefill.late_binding


class Exchange:
    """Drives one request through D then P; its owner runs ``close`` in a ``finally``."""

    def __init__(self, state, path: str, body: dict, prefill: Backend | None, decode: Backend,
                 headers: dict[str, str] | None = None, transfer_mode: RequestedMode = "",
                 text_bytes: int | None = None) -> None:
        self.state, self.path, self.body = state, path, body
        self.local = prefill is None    # D prefills it: no P, no transfer
        self.text_bytes = text_bytes    # the prompt text's size, for the bytes per token of P's answer
        self.transfer_mode = transfer_mode   # "" = P's own
        self.headers = dict(headers or {})
        self.prefill, self.decode = prefill, decode
        # P's TP ranks as learned now: D's and P's plans must agree
        self.p_controls = prefill.controls if prefill is not None else []
        self.d_controls = decode.controls
        self.late = prefill is not None and binds_late(state.binding, prefill.topology, decode.topology)
        self.p_lease = Lease(prefill) if prefill is not None else None
        self.d_lease = Lease(decode)
        self.transfer_id = uuid.uuid4().hex
        self.request_id = self.headers.get("x-request-id") or self.transfer_id   # what its log lines name
        self.token = secrets.token_hex(16)   # only this transfer's D and P learn it
        self.stream = body.get("stream") is True
        self.registered: asyncio.Future = asyncio.get_running_loop().create_future()
        self.d_ranks: dict[int, DecodeRegistration] = {}   # D's tensor-parallel rank -> its registration
        self.d_task: asyncio.Task | None = None
        self.p_task: asyncio.Task | None = None
        self.started = time.perf_counter()
        self.stamps: dict[str, float] = {}
        self.d_response: httpx.Response | None = None
        self.aborted_d = False
        self.relaying = False       # D's status line went to the client: errors now go in the stream
        self.outcome = ""           # "ok" once the client has D's end marker
        self._closing: asyncio.Task | None = None

    def d_body(self) -> dict:
        if self.local:
            return self.body
        params = RecvParams(transfer_id=self.transfer_id, token=self.token, prefill_controls=self.p_controls,
                            notify_url="" if self.late else self.state.notify_url)   # "": P asks D itself
        return {**self.body, "kv_transfer_params": {KEY: msgspec.to_builtins(params)}}

    def add_registration(self, reg: DecodeRegistration) -> str:
        """One of D's ranks registered (validated whole); P goes once every rank did. A conflict with
        the ranks registered before, or ""."""
        first = next(iter(self.d_ranks.values()), reg)
        if (reg.ranks, reg.registration.block_ids, reg.registration.first_block) != \
                (first.ranks, first.registration.block_ids, first.registration.first_block):
            return f"rank {reg.rank} registered other ranks, blocks or first block than rank {first.rank}"
        known = self.d_ranks.get(reg.rank)
        if known is not None and known != reg:
            return f"rank {reg.rank} registered twice, differently"
        self.d_ranks[reg.rank] = reg
        if len(self.d_ranks) == reg.ranks and not self.registered.done():
            self.registered.set_result([self.d_ranks[r] for r in range(reg.ranks)])
        return ""

    def p_body(self, regs: list[DecodeRegistration] | None) -> dict:
        # min_tokens: vLLM refuses one above max_tokens, and P makes only the one token
        body = {k: v for k, v in self.body.items()
                if k not in ("stream", "stream_options", "max_completion_tokens", "min_tokens")}
        body["max_tokens"] = 1
        # prefill_tp: the P ranks D was told of; P checks its own TP size against it
        if regs is None:   # late: D's ranks by endpoint; each P transfer asks its D rank for the blocks
            params = SendParams.late_for(self.transfer_id, self.token, self.d_controls, len(self.p_controls),
                                         self.transfer_mode)
        else:
            params = SendParams.for_registrations(regs, prefill_tp=len(self.p_controls),
                                                  transfer_mode=self.transfer_mode)
        wire = msgspec.to_builtins(params)
        if not self.transfer_mode:   # named only where asked for: a P of an older release refuses unknown fields
            del wire["transfer_mode"]
        body["kv_transfer_params"] = {KEY: wire}
        return body

    async def open_decode(self) -> httpx.Response:
        client, t = self.state.client, self.state.timeouts
        req = client.build_request("POST", self.decode.url + self.path, json=self.d_body(), headers=self.headers,
                                   timeout=httpx.Timeout(t.request_s, connect=5.0))
        return await client.send(req, stream=self.stream)

    async def run_until_decode(self) -> httpx.Response:
        """D first, its registration, then P's prefill (late: both at once); returns D's response
        (streaming or whole)."""
        t = self.state.timeouts
        self.d_task = self.state.spawn(self.open_decode(), f"decode {self.transfer_id}")
        if self.local:
            self.stamp("dispatched")
            return await self._until_decode_answered()
        self.state.metrics.bindings.labels("late" if self.late else "d_first").inc()
        if self.late:   # no registration to wait for: P's transfers ask D for it while P prefills
            self.stamp("dispatched")
            self.p_task = self.state.spawn(self._prefill(None), f"prefill {self.transfer_id}")
            return await self._until_decode_answered()
        loop = asyncio.get_running_loop()
        end = loop.time() + t.registration_s
        waiting = {self.registered, self.d_task}
        while not self.registered.done():
            done, _ = await asyncio.wait(waiting, timeout=max(0.0, end - loop.time()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise ExchangeError(504, "registration_timeout", f"D ({self.decode.url}) did not register "
                                    f"the transfer within {t.registration_s:g}s")
            if self.d_task in done and not self.registered.done():
                # a streaming D answers its headers at once; anything else before the registration is an error
                if self.d_task.exception() is not None or self.d_task.result().status_code != 200 or not self.stream:
                    raise await self._decode_error()
                waiting = {self.registered}
        self.stamp("registered")
        # P runs in its own task: D's answer is relayed as soon as D has one, not after P's whole reply
        self.p_task = self.state.spawn(self._prefill(self.registered.result()), f"prefill {self.transfer_id}")
        return await self._until_decode_answered()

    async def _until_decode_answered(self) -> httpx.Response:
        """D's response once it answered; P failing first raises P's error (D was told to abort)."""
        t = self.state.timeouts
        assert self.d_task is not None
        try:
            async with compat.timeout(t.request_s):
                while not self.d_task.done():
                    p = self.p_task
                    await asyncio.wait({self.d_task, p} if p is not None and not p.done() else {self.d_task},
                                       return_when=asyncio.FIRST_COMPLETED)
                    self.raise_if_prefill_failed()
                await self.prefill_failure_first()
                self.d_response = self.d_task.result()
        except (TimeoutError, httpx.HTTPError) as exc:
            raise call_failed(exc, "D", self.decode.url, t.request_s) from None
        self.stamp("d_answered")
        return self.d_response

    async def prefill_failure_first(self) -> None:
        """Once P failed and we told D to abort, what D answers next (a failed request: D frees a
        transfer no P rank reached at once) is that abort's echo: the client gets P's error, the cause."""
        if self.aborted_d and self.p_task is not None:
            await asyncio.wait({self.p_task}, timeout=self.state.timeouts.abort_s)
            self.raise_if_prefill_failed()

    def raise_if_prefill_failed(self) -> None:
        """P's failure (an ``ExchangeError``; D was told to abort already), once P's call ended with one."""
        p = self.p_task
        if p is not None and p.done() and not p.cancelled():
            error = p.exception()
            if error is not None:
                raise error

    async def decoded_chunks(self, d_resp: httpx.Response):
        """D's body as it comes; P failing meanwhile ends it with P's ``ExchangeError``."""
        chunks = d_resp.aiter_bytes()
        while True:
            nxt = asyncio.ensure_future(anext(chunks))
            try:
                while not nxt.done():
                    p = self.p_task
                    await asyncio.wait({nxt, p} if p is not None and not p.done() else {nxt},
                                       return_when=asyncio.FIRST_COMPLETED)
                    self.raise_if_prefill_failed()
            except BaseException:
                nxt.cancel()
                await asyncio.gather(nxt, return_exceptions=True)
                raise
            await self.prefill_failure_first()
            try:
                chunk = nxt.result()
            except StopAsyncIteration:
                return
            if "first_chunk" not in self.stamps:
                self.stamp("first_chunk")
            yield chunk

    def stamp(self, stage: str) -> None:
        """The request's timeline (ms since the proxy took it), logged at debug when the exchange closes."""
        self.stamps[stage] = round((time.perf_counter() - self.started) * 1e3, 1)
        self.state.metrics.stage(stage, self.stamps[stage] / 1e3)

    async def _prefill(self, regs: list[DecodeRegistration] | None) -> None:
        client, t = self.state.client, self.state.timeouts
        assert self.prefill is not None and self.p_lease is not None   # a local exchange never prefills on P
        try:
            reply = await client.post(self.prefill.url + self.path, json=self.p_body(regs), headers=self.headers,
                                      timeout=t.prefill_s)
        except Exception as exc:  # noqa: BLE001 - any failure of the call to P is P's failure
            if not isinstance(exc, (httpx.HTTPError, asyncio.TimeoutError)):
                # e.g. httpcore/anyio raising AttributeError when P dies mid-connect
                log.warning("transfer %s: the HTTP client failed unexpectedly calling P: %r", self.transfer_id, exc)
            await self.abort_decode(f"prefill failed: {type(exc).__name__}")
            raise call_failed(exc, "P", self.prefill.url, t.prefill_s) from None
        finally:
            self.p_lease.release()   # P's part of the request ends with its answer
            self.stamp("p_answered")
        if reply.status_code != 200:
            await self.abort_decode(f"prefill answered HTTP {reply.status_code}")
            raise answered_error("P", self.prefill.url, reply.status_code, reply.content,
                                 reply.headers.get("content-type", "application/json"))
        self.state.router.learn_usage(self.path, self.text_bytes, reply.content)
        sent = self.stamps["dispatched" if regs is None else "registered"]
        self.state.metrics.prefill.observe((self.stamps["p_answered"] - sent) / 1e3)

    async def _decode_error(self) -> ExchangeError:
        """D answered before it registered the transfer: its own error (a 4xx goes to the client as is)."""
        assert self.d_task is not None
        try:
            resp = self.d_task.result()
        except Exception as exc:  # noqa: BLE001 - reported to the client
            return call_failed(exc, "D", self.decode.url, self.state.timeouts.request_s)
        content = await resp.aread()
        if resp.status_code == 200:   # a whole answer with no transfer: D is not running the connector
            text = content[:300].decode(errors="replace")
            return ExchangeError(502, "decode_error", f"D ({self.decode.url}) answered without registering the "
                                 f"transfer (is its kv connector aiolayer's?): {text}")
        return answered_error("D", self.decode.url, resp.status_code, content,
                              resp.headers.get("content-type", "application/json"), " before registering the transfer")

    async def abort_decode(self, reason: str) -> None:
        """Tell each of D's ranks to give the transfer up (bounded, at once); D keeps the blocks until P is
        quiet. Late binding: P's transfers too, which may wait for a registration D will never make."""
        if self.aborted_d or not (self.late or self.registered.done()):
            return
        self.aborted_d = True
        if self.late:   # D may not have registered yet (unknown_transfer): closing D's call then ends it
            n = len(self.d_controls)
            ranks = [(c, rank_transfer_id(self.transfer_id, r, n)) for r, c in enumerate(self.d_controls)]
            for control in self.p_controls:   # not awaited: P answers once its writes are quiet
                for _, tid in ranks:
                    self.state.spawn(self._stop_prefill(control, tid, reason), f"abort-p {tid}")
        else:
            regs = [reg.registration for reg in self.registered.result()]
            ranks = [(reg.decode_control, reg.transfer_id) for reg in regs]
        await asyncio.gather(*(self._abort_rank(control, tid, reason) for control, tid in ranks))

    async def _stop_prefill(self, control: str, tid: str, reason: str) -> None:
        """P's ``Abort`` for one of its transfers: stopped at once if it waits for D, refused when it
        starts if it has not yet (P's early aborts); ``stopped`` for one P never ran or finished."""
        try:
            client = await self.state.peers.get(control)
            await client.call(m.Abort(transfer_id=tid, reason=reason, token=self.token),
                              timeout=self.state.timeouts.abort_s)
        except AiolayerError as exc:
            log.debug("transfer %s: P at %s did not confirm it stopped: %s", tid, control, exc)

    async def _abort_rank(self, control: str, tid: str, reason: str) -> None:
        try:
            client = await self.state.peers.get(control)
            await client.call(m.AbortRequest(transfer_id=tid, reason=reason, token=self.token),
                              timeout=self.state.timeouts.abort_s)
        except AiolayerError as exc:
            if isinstance(exc, ControlRejected) and exc.code == NackCode.UNKNOWN_TRANSFER:   # D ended it
                log.debug("transfer %s: D no longer knows it: %s", tid, exc)
            else:
                log.warning("transfer %s: D was not told to abort: %s", tid, exc)

    async def close(self) -> None:
        """Drop everything this exchange holds: its table entry, its leases, D's call (vLLM aborts it).

        Idempotent; closing D's call runs as an owned task, so it completes even if the caller is cancelled.
        """
        self.state.pending.pop(self.transfer_id, None)
        if self.p_lease is not None:
            self.p_lease.release()
        if self.stamps and log.isEnabledFor(logging.DEBUG):
            # perf_counter of the start too: the engines' timeline lines (aiolayer_vllm.worker.stage) use that clock
            log.debug("transfer %s timeline (ms since %.6f): %s", self.transfer_id, self.started,
                      ", ".join(f"{k} {v:g}" for k, v in self.stamps.items()))
        try:
            if self._closing is None:
                self._closing = self.state.spawn(self._close_decode(), f"close {self.transfer_id}")
            await asyncio.shield(self._closing)
        finally:
            self.d_lease.release()

    async def _close_decode(self) -> None:
        p = self.p_task
        if p is not None and not p.done():
            if self.outcome == "ok":
                # the client has its answer; P's reply only ends P's request normally (its prefix cache
                # keeps the prompt): never cut it. Bounded by prefill_s, owned by the proxy's tasks.
                p.add_done_callback(_retrieve)
            else:   # the exchange failed or the client left: closing P's call aborts the request in P
                p.cancel()
                await asyncio.gather(p, return_exceptions=True)
        response = self.d_response
        if self.d_task is not None:
            self.d_task.cancel()   # no-op once it answered
            await asyncio.gather(self.d_task, return_exceptions=True)
            if response is None and not self.d_task.cancelled() and self.d_task.exception() is None:
                response = self.d_task.result()   # D answered but the exchange ended before taking it
        if response is not None:
            try:
                await response.aclose()
            except Exception as exc:  # noqa: BLE001 - the connection is dropped either way
                log.debug("transfer %s: closing D's response: %r", self.transfer_id, exc)


def _retrieve(task: asyncio.Task) -> None:
    """Mark a finished task's exception as seen (its failure was handled where it happened)."""
    if not task.cancelled():
        task.exception()
