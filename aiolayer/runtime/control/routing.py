"""A runtime's control-plane routing: each inbound message to the side that serves it (``handle``, the
control server's handler; a ``TopologyRequest`` is answered from the runtime's identity), and D's
fence asking P to stop writing (``stop_sender``, the receiver's ``StopSender``). Runs on the runtime's
loop; no state of its own. It sees the ``Runtime`` only through ``Host`` and each side only through
``SenderPort`` / ``ReceiverPort`` (public members), so control/ imports neither side; the node's or
test's ``Hooks`` come as an argument (fixed once the runtime started).
"""

from __future__ import annotations

import asyncio
import functools
import collections
import logging
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable, Protocol, TypeVar

import msgspec

from ...errors import ControlError, ControlRejected, DeadlineExceeded, FrameDropped, RuntimeStateError
from ... import compat, version
from ...protocol import messages as m
from ...protocol.codes import AckDetail, NackCode
from ..integrity import MAX_EARLY_CHECKS, EarlyChecks, early_result, plan_verify, read_check, verify_early
from .hooks import Hooks
from .plane import release_slot

if TYPE_CHECKING:
    from ...backends.base import TransferBackend
    from ...config import NodeConfig, Timeouts
    from ..api import Identity
    from ..spec import LocalLayout
    from .plane import ControlPeers

log = logging.getLogger("aiolayer.runtime.runtime")   # the runtime's own log, as before the split
_Item = TypeVar("_Item", bound=m.Message)


class SenderPort(Protocol):
    """What routing asks of P's side (``send.sender.Sender``)."""

    @property
    def local(self) -> LocalLayout | None: ...

    async def abort(self, transfer_id: str, reason: str, token: str) -> AckDetail: ...


class ReceiverPort(Protocol):
    """What routing asks of D's side (``receive.receiver.Receiver``)."""

    @property
    def integrity(self) -> collections.Counter[str]: ...

    def handle(self, msg: m.Done | m.Failed) -> m.Ack: ...

    def abort(self, transfer_id: str, reason: str, token: str | None = None) -> str: ...

    def admit_writer(self, msg: m.LayoutRequest) -> None: ...

    def window(self, transfer_id: str, since: float | None = None) -> float: ...

    def to_verify(self, transfer_id: str, token: str) -> tuple[list[int], EarlyChecks] | None: ...

    def early_check_of(self, msg: m.EarlyCheck) -> tuple[list[int], EarlyChecks]: ...

    def registration(self, transfer_id: str, token: str) -> tuple[list[int], int]: ...

    async def wait_registered(self, transfer_id: str, token: str, limit: float) -> None: ...


class Host(Protocol):
    """What routing reads of its runtime (``Runtime``'s public members); the optional parts exist once it started."""

    @property
    def node(self) -> NodeConfig: ...
    @property
    def backend(self) -> TransferBackend: ...
    @property
    def timeouts(self) -> Timeouts: ...
    @property
    def incarnation(self) -> str: ...
    @property
    def control_endpoint(self) -> str: ...
    @property
    def identity(self) -> Identity: ...
    @property
    def receiver(self) -> ReceiverPort: ...
    @property
    def sender(self) -> SenderPort | None: ...
    @property
    def peers(self) -> ControlPeers | None: ...
    @property
    def layout_reply(self) -> m.LayoutReply | None: ...


def _sender(rt: Host) -> SenderPort:
    if rt.sender is None:
        raise RuntimeStateError("runtime not started: no sender yet")
    return rt.sender


def _batched_item(hooks: Hooks, msg: _Item, answer: Callable[[_Item], m.Ack]) -> m.Ack | m.Nack | None:
    """One item of a batch frame (``DoneBatch``, ``LayoutBatch``), answered as if it came alone:
    ``answer(msg)``, or its own Nack; None when a fault-injection hook dropped it."""
    try:
        m.check_version(msg)
        if hooks.inbound_filter is not None:
            hooks.inbound_filter(msg)
        return answer(msg)
    except (ControlRejected, m.DecodeFailure) as exc:
        return m.Nack(code=exc.code, reason=exc.reason)
    except FrameDropped:
        return None
    except Exception as exc:  # this item's sender is told, the batch's others go on
        log.exception("control handler failed on a batched %s", type(msg).__name__)
        return m.Nack(code=NackCode.INTERNAL, reason=f"{type(exc).__name__}: {exc}"[:300])


def _check_batch(items: Sequence[object], limit: int, what: str) -> None:
    if len(items) > limit:
        raise ControlRejected(NackCode.SIZE, f"{len(items)} {what} in one batch; at most {limit}")


def _grant_layout(rt: Host, msg: m.LayoutRequest) -> m.Ack:
    """The layout names our memory: only for a peer holding the token of a transfer that still takes
    writes (P asks for it for every transfer before its first write), recorded as its writer."""
    rt.receiver.admit_writer(msg)
    _published_layout(rt)
    return m.Ack()


def _granted_layout(rt: Host, transfer_id: str, since: float | None = None) -> m.LayoutReply:
    """The layout as one granted transfer's answer: with the seconds left for its writes (its window),
    counted from ``since`` (the loop time the request came: a lookup held for the registration), else now."""
    return msgspec.structs.replace(_published_layout(rt), window=rt.receiver.window(transfer_id, since))


async def _lookup(rt: Host, msg: m.LookupRequest) -> m.AllocReply:
    """A transfer's registration; a waiting lookup is held until D registered it (``lookup_wait``). A
    writer's lookup (late binding) is a layout grant too: the P rank is admitted as a writer, by the
    same rules, before the reply tells it where to write."""
    came = asyncio.get_running_loop().time()   # P counts its window from its send, before this
    if msg.wait:
        release_slot()   # a wait of up to lookup_wait, bounded by the waiting lookups' own table
        await rt.receiver.wait_registered(msg.transfer_id, msg.token, rt.timeouts.lookup_wait)
    block_ids, first = rt.receiver.registration(msg.transfer_id, msg.token)
    layout = None
    if msg.requester:
        _grant_layout(rt, m.LayoutRequest(requester=msg.requester, transfer_id=msg.transfer_id, token=msg.token,
                                          control=msg.control, incarnation=msg.incarnation, writers=msg.writers))
        layout = _granted_layout(rt, msg.transfer_id, came)
    return m.AllocReply(transfer_id=msg.transfer_id, block_ids=block_ids, incarnation=rt.incarnation,
                        first_block=first, token=msg.token, layout=layout)


def _published_layout(rt: Host) -> m.LayoutReply:
    if rt.layout_reply is None:
        raise ControlRejected(NackCode.NOT_READY, "no KV layout registered yet")
    return rt.layout_reply


def _topology(rt: Host) -> m.TopologyReply:
    """Who this runtime is (its embedder's ``Identity``) and its layout's summary, never its addresses."""
    ident, layout, transport = rt.identity, rt.layout_reply, rt.node.transport
    reply = m.TopologyReply(engine_id=rt.node.engine_id, incarnation=rt.incarnation, control=rt.control_endpoint,
                            role=ident.role, tp_rank=ident.tp_rank, tp_size=ident.tp_size, dp_rank=ident.dp_rank,
                            dp_size=ident.dp_size, model=ident.model, late_binding=ident.late_binding,
                            version=version.__version__,
                            session=rt.backend.session, protocol=transport.protocol,
                            device_name=transport.device_name,
                            force_tcp=os.environ.get("MC_FORCE_TCP", "") not in ("", "0"))
    if layout is None:
        return reply
    return msgspec.structs.replace(
        reply, num_layers=len(layout.layers), block_bytes=layout.block_bytes, block_size=layout.block_size,
        kv_heads=layout.kv_heads, head_bytes=layout.head_bytes, kv_layout=layout.kv_layout,
        kv_interior=layout.kv_interior)


async def stop_sender(rt: Host, endpoint: str, transfer_id: str, token: str, reason: str) -> bool:
    """D's fence: ask P to stop writing ``transfer_id``; True once P says none is in flight."""
    if rt.peers is None:
        raise RuntimeStateError("runtime not started: no control peers yet")
    try:
        client = await rt.peers.get(endpoint)
        reply = await client.call(m.Abort(transfer_id=transfer_id, reason=reason, token=token),
                                  timeout=rt.timeouts.abort_call)
    except (ControlError, DeadlineExceeded) as exc:   # e.g. Nack(settling): the fence asks again
        log.info("transfer %s: P at %s did not confirm it stopped: %s", transfer_id, endpoint, exc)
        return False
    return m.confirms_stop(reply)


async def _verified(rt: Host, done: m.Done | m.Failed) -> m.Done | m.Failed:
    """A DONE carrying an integrity check, once D compared what landed (in a worker thread): as sent,
    or a FAILED from the same sender saying what differs, or that the comparison did not end within
    ``done_delivery`` (past it P gave up delivering this DONE, so no answer would reach it; the KV is
    not vouched for, so the transfer fails, visibly). A retry of a DONE whose check still runs gets
    that check's verdict: a check slower than P's call is not read again per attempt. A DONE D would
    refuse or keep anyway (unknown, wrong token, already given up) goes on unchecked."""
    if not isinstance(done, m.Done) or done.check is None or _elsewhere(rt, done):
        return done
    target = rt.receiver.to_verify(done.transfer_id, done.token)
    if target is None:
        return done
    running = target[1].running_done_check(done.sender, done.check)
    problem = await _joined(rt, running) if running is not None else await _checked(rt, done, done.check, *target)
    if not problem:
        return done
    return m.Failed(transfer_id=done.transfer_id, sender=done.sender, reason=problem, token=done.token,
                    sender_incarnation=done.sender_incarnation)


def _elsewhere(rt: Host, done: m.Done) -> bool:
    """A DONE for writes P made to another process of this D (the incarnation its layout named)."""
    return bool(done.incarnation) and done.incarnation != rt.incarnation


def _taken(rt: Host, word: m.Done | m.Failed) -> m.Ack:
    """D applies P's word; a DONE for another process of this D vouches for nothing here (rule 2's check
    at D): refused, and the transfer waits for its own writer, or its deadline."""
    if isinstance(word, m.Done) and _elsewhere(rt, word):
        raise ControlRejected(NackCode.SENDER, f"DONE for {word.transfer_id} is for D's incarnation "
                              f"{word.incarnation}; this D is {rt.incarnation}: the writes went to another process")
    return rt.receiver.handle(word)


async def _checked(rt: Host, done: m.Done, check: m.LayerCheck, blocks: list[int],
                   early_checks: EarlyChecks) -> str:
    """What differs between ``done``'s ``check`` and what landed ("" if nothing); its retries
    meanwhile get the same answer. Counted once, and logged once, here."""
    verdict_of_retries = early_checks.begin_done_check(done.sender, check)
    try:
        problem, verdict = await _bounded_compare(rt, done.transfer_id, done.sender, check, blocks, early_checks)
        verdict_of_retries.set_result(problem)
    finally:
        early_checks.end_done_check(done.sender, verdict_of_retries)
    rt.receiver.integrity[verdict] += 1
    if problem:
        log.error("transfer %s from %s: %s", done.transfer_id, done.sender, problem)
    return problem


async def _bounded_compare(rt: Host, transfer_id: str, sender: str, check: m.LayerCheck, blocks: list[int],
                           early_checks: EarlyChecks) -> tuple[str, str]:
    """``_compare`` within ``done_delivery``: its problem and the verdict counted for it."""
    limit = rt.timeouts.done_delivery
    try:
        async with compat.timeout(limit):
            problem = await _compare(rt, transfer_id, sender, check, blocks, early_checks)
    except TimeoutError:
        return f"integrity: D's check of what landed did not end within done_delivery {limit:g}s", "unfinished"
    return problem, "mismatch" if problem else "verified"


async def _joined(rt: Host, running: asyncio.Future[str]) -> str:
    """A retried DONE's verdict: that of its first attempt's check, which ends within ``done_delivery``
    (or is cancelled with its handler, the runtime stopping)."""
    await asyncio.wait({running}, timeout=rt.timeouts.done_delivery)
    if running.done() and not running.cancelled():
        return running.result()
    return "integrity: the check of this DONE's first attempt ended without a verdict"


async def _compare(rt: Host, transfer_id: str, sender: str, check: m.LayerCheck, blocks: list[int],
                   early_checks: EarlyChecks) -> str:
    """What differs between a DONE's check and what landed ("" if nothing): the layers its sender's
    early checks did not match are read now."""
    began = time.perf_counter()
    local, early = _sender(rt).local, await early_checks.of(sender)
    problem, rest = plan_verify(local, blocks, check, early)
    if rest is not None and local is not None:   # else malformed, or every layer matched early: no thread hop
        problem = await asyncio.to_thread(read_check, local, rest)
    log.debug("transfer %s: DONE's check: %d of %d layers read at DONE, %.2f ms", transfer_id,
              0 if rest is None else len(rest.layers), len(check.layers), (time.perf_counter() - began) * 1e3)
    return problem


async def _early_check(rt: Host, msg: m.EarlyCheck) -> m.Ack:
    """A writer's early check: the layers that landed intact are remembered for its DONE (integrity.py).
    Answered once verified; past ``MAX_EARLY_CHECKS`` of one writer, ``Nack(busy)``; and so when it did
    not end within ``control_call`` (P's call gave up then; the DONE waits for it within its own bound)."""
    blocks, early_checks = rt.receiver.early_check_of(msg)
    local = _sender(rt).local
    verifying = early_checks.start(msg.sender, lambda: verify_early(local, blocks, msg.check))
    if verifying is None:
        raise ControlRejected(NackCode.BUSY, f"early check: {MAX_EARLY_CHECKS} from {msg.sender!r} already")
    try:
        async with compat.timeout(rt.timeouts.control_call):
            matched = await early_result(verifying)
    except TimeoutError:
        raise ControlRejected(NackCode.BUSY, f"early check: still reading after {rt.timeouts.control_call:g}s") \
            from None
    rt.receiver.integrity["verified_early"] += 1
    detail = f"{0 if matched is None else len(matched.layers)} of {len(msg.check.layers)} layers intact"
    log.debug("transfer %s: early check from %s: %s", msg.transfer_id, msg.sender, detail)
    return m.Ack(detail=detail)


async def handle(rt: Host, hooks: Hooks, msg: m.Message) -> m.Message:
    if hooks.inbound_filter is not None:
        hooks.inbound_filter(msg)
    if isinstance(msg, (m.Done, m.Failed)):
        return _taken(rt, await _verified(rt, msg))
    if isinstance(msg, m.DoneBatch):
        _check_batch(msg.items, m.MAX_DONE_BATCH, "DONEs")
        items: Sequence[m.Done | m.Failed] = msg.items
        if any(getattr(done, "check", None) is not None for done in items):   # else answered in this pass
            items = await asyncio.gather(*(_verified(rt, done) for done in msg.items))
        return m.Replies(items=[_batched_item(hooks, done, functools.partial(_taken, rt)) for done in items])
    if isinstance(msg, m.EarlyCheck):
        return await _early_check(rt, msg)
    if isinstance(msg, m.Abort):
        return m.Ack(detail=await _sender(rt).abort(msg.transfer_id, msg.reason, msg.token))
    if isinstance(msg, m.AbortRequest):
        return m.Ack(detail=rt.receiver.abort(msg.transfer_id, msg.reason, msg.token))
    if isinstance(msg, m.LookupRequest):
        return await _lookup(rt, msg)
    if isinstance(msg, m.LayoutRequest):
        _grant_layout(rt, msg)
        return _granted_layout(rt, msg.transfer_id)
    if isinstance(msg, m.LayoutBatch):
        _check_batch(msg.items, m.MAX_LAYOUT_BATCH, "layout requests")
        answers = [_batched_item(hooks, req, lambda r: _grant_layout(rt, r)) for req in msg.items]
        windows = [rt.receiver.window(req.transfer_id) if isinstance(answer, m.Ack) else 0.0
                   for req, answer in zip(msg.items, answers)]
        granted = any(isinstance(a, m.Ack) for a in answers)
        return m.LayoutReplies(layout=rt.layout_reply if granted else None, items=answers, windows=windows)
    if isinstance(msg, m.TopologyRequest):
        return _topology(rt)
    if hooks.extra_handler is not None:
        return await hooks.extra_handler(msg)
    raise ControlRejected(NackCode.UNKNOWN, f"{type(msg).__name__} is not served here")
