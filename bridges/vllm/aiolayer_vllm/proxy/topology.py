"""What the proxy learns of each backend from its engine's control sockets, instead of taking its word.

A backend's CONTROL is its engine's first rank (TP 0 of DP 0). The proxy asks it a
``TopologyRequest``, then every other rank at the connector's port rule (``aiolayer_vllm.ranks``:
CONTROL's port + dp x TP + tp), and accepts the backend only if every rank answers: with the same
sizes, role and model fingerprint, as the rank the rule puts there, in a role its flag needs
(``--prefill``: producer or both; ``--decode``: consumer or both), and with the TP size it was
declared with (``,tp=N``), if any. At start (``learn_pool``) every backend must pass within the
start-up wait and all must share one model fingerprint, else the proxy does not start; at each
health check (``recheck``) a backend that fails, or of whose ranks some restarted and others did not,
is out of rotation with the reason until it passes again.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace

from aiolayer import ControlPeers
from aiolayer.errors import ControlError, ControlRejected, ControlTimeout, ProtocolError
from aiolayer.protocol import messages as m
from aiolayer.protocol.codes import NackCode

log = logging.getLogger(__name__)
ROLES = {"prefill": ("producer", "both"), "decode": ("consumer", "both")}
MAX_RANKS = 1024
RETRY_S = 0.2   # start-up: between two tries at a backend whose ranks do not all answer yet


class TopologyProblem(Exception):
    """Why a backend cannot be trusted. ``answered``: its ranks answered, wrongly (asking again at once
    will not help); else some did not answer (yet)."""

    def __init__(self, message: str, answered: bool) -> None:
        super().__init__(message)
        self.answered = answered


@dataclass(frozen=True)
class Learned:
    """One backend's engine as its ranks described it."""

    tp: int
    dp: int
    role: str
    model: str
    engine_id: str
    incarnations: tuple[str, ...]   # per rank, in the port rule's order
    num_layers: int
    block_size: int
    late_binding: bool = False   # its ranks can send with D's blocks bound late (the proxy's ``auto`` binding)
    one_dp_rank: bool = False    # nothing listens where a second data-parallel rank would (``_alone``)

    def summary(self) -> dict:
        return {"tp": self.tp, "dp": self.dp, "role": self.role, "model": self.model, "engine_id": self.engine_id,
                "num_layers": self.num_layers, "block_size": self.block_size, "late_binding": self.late_binding,
                "one_dp_rank": self.one_dp_rank}


def rank_endpoint(control: str, index: int) -> str:
    """The control endpoint of the engine's rank ``index`` (dp x TP + tp) when rank 0 listens at ``control``."""
    host, _, port = control.rpartition(":")
    return f"{host}:{int(port) + index}"


async def ask(peers: ControlPeers, endpoint: str, timeout: float) -> m.TopologyReply:
    """One rank's answer to a ``TopologyRequest``, or a ``TopologyProblem`` saying why there is none."""
    try:
        client = await peers.get(endpoint)
        reply = await client.call(m.TopologyRequest(requester="aiolayer-proxy"), timeout=timeout)
    except ControlTimeout:
        raise TopologyProblem(f"{endpoint} did not answer the topology query within {timeout:g}s", False) from None
    except ControlRejected as exc:
        if exc.code in (NackCode.DECODE, NackCode.UNKNOWN):
            raise TopologyProblem(f"{endpoint} does not serve the topology query (Nack {exc.code}: its aiolayer "
                                  "is older than this proxy's; upgrade its connector)", True) from None
        raise TopologyProblem(f"{endpoint} refused the topology query: Nack {exc.code}: {exc.reason}", True) from None
    except ProtocolError as exc:
        raise TopologyProblem(f"{endpoint} is not an aiolayer control socket of this version: {exc}", True) from None
    except ControlError as exc:
        raise TopologyProblem(f"{endpoint} cannot be reached: {exc}", False) from None
    if not isinstance(reply, m.TopologyReply):
        raise TopologyProblem(f"{endpoint} answered the topology query with {type(reply).__name__}", True)
    return reply


def _check_first(role: str, control: str, declared_tp: int, first: m.TopologyReply) -> None:
    if first.role not in ROLES[role]:
        said = f"role {first.role!r}" if first.role else "no role"
        raise TopologyProblem(f"{control} ({first.engine_id}) says {said}: --{role} needs an engine whose "
                              f"kv_role makes it a {' or '.join(ROLES[role])}", True)
    if (first.dp_rank, first.tp_rank) != (0, 0):
        raise TopologyProblem(f"{control} ({first.engine_id}) is rank dp {first.dp_rank} tp {first.tp_rank} of its "
                              "engine: give the control port of its first rank", True)
    ranks, port = first.tp_size * first.dp_size, int(control.rpartition(":")[2])
    if not (first.tp_size >= 1 and first.dp_size >= 1 and ranks <= MAX_RANKS and port + ranks - 1 <= 65535):
        raise TopologyProblem(f"{control} says tp {first.tp_size} x dp {first.dp_size}: no engine this proxy "
                              f"can reach by the port rule (at most {MAX_RANKS} ranks, ports up to 65535)", True)
    if declared_tp and declared_tp != first.tp_size:
        raise TopologyProblem(f"declared tp={declared_tp}, learned tp={first.tp_size} from {control} "
                              f"({first.engine_id}): drop ,tp= or fix it", True)


def _check_rank(index: int, endpoint: str, first: m.TopologyReply, reply: m.TopologyReply) -> None:
    where = divmod(index, first.tp_size)
    diff = [] if (reply.dp_rank, reply.tp_rank) == where else \
        [f"it is rank (dp, tp) {(reply.dp_rank, reply.tp_rank)}, the port rule expects {where}"]
    for field in ("tp_size", "dp_size", "role", "model", "num_layers", "block_size", "late_binding"):
        got, want = getattr(reply, field), getattr(first, field)
        if got != want:
            diff.append(f"{field} {got!r} where rank 0 says {want!r}")
    if diff:
        raise TopologyProblem(f"{endpoint} ({reply.engine_id}) disagrees with rank 0: {'; '.join(diff)}", True)


async def learn(role: str, control: str, declared_tp: int, peers: ControlPeers, timeout: float) -> Learned:
    """Ask rank 0, then every other rank; ``TopologyProblem`` when any is missing or disagrees."""
    first = await ask(peers, control, timeout)
    _check_first(role, control, declared_tp, first)
    endpoints = [rank_endpoint(control, i) for i in range(first.tp_size * first.dp_size)]
    rest = await asyncio.gather(*(ask(peers, ep, timeout) for ep in endpoints[1:]), return_exceptions=True)
    for outcome in rest:
        if isinstance(outcome, BaseException) and not isinstance(outcome, TopologyProblem):
            raise outcome
    missing = [str(r) for r in rest if isinstance(r, TopologyProblem)]
    if missing:
        raise TopologyProblem("; ".join(missing), all(r.answered for r in rest if isinstance(r, TopologyProblem)))
    replies = [first, *(r for r in rest if not isinstance(r, BaseException))]   # each: every error raised above
    unready = [ep for ep, r in zip(endpoints, replies) if not r.num_layers]
    if unready and len(unready) < len(replies):   # an engine mid-start: its ranks register one by one
        raise TopologyProblem(f"{', '.join(unready)} registered no KV memory yet (its other ranks did)", False)
    for index, (endpoint, reply) in enumerate(zip(endpoints, replies)):
        _check_rank(index, endpoint, first, reply)
    return Learned(tp=first.tp_size, dp=first.dp_size, role=first.role, model=first.model, engine_id=first.engine_id,
                   incarnations=tuple(r.incarnation for r in replies), num_layers=first.num_layers,
                   block_size=first.block_size, late_binding=first.late_binding,
                   one_dp_rank=first.dp_size == 1 and await _alone(rank_endpoint(control, first.tp_size), timeout))


async def _alone(endpoint: str, timeout: float) -> bool:
    """Whether nothing listens at ``endpoint``, where the port rule puts a second data-parallel rank.
    vLLM runs each DP rank of a dense model as an engine of its own, whose rank 0 says dp 1 of 1
    (``ranks.from_vllm``): only the next port tells. A refused connection says alone; anything else
    (a listener, no answer in time) does not, and the ``auto`` binding then goes D first."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), min(timeout, 1.0))
    except OSError as exc:   # refused: nothing there; unreachable, or no answer in time (TimeoutError): not known
        return isinstance(exc, ConnectionRefusedError)
    writer.close()
    return False


async def learn_pool(pool, peers: ControlPeers, wait_s: float, call_s: float) -> list[str]:
    """At start: learn every backend (each may take up to ``wait_s`` to answer), then check that all run
    one model. Sets what each learned and the pool's fingerprint; returns the problems, each naming its backend."""
    loop = asyncio.get_running_loop()
    end = loop.time() + wait_s

    async def one(backend) -> str:
        while True:
            try:
                backend.adopt(await learn(backend.role, backend.control, backend.declared_tp, peers,
                                          max(0.05, min(call_s, end - loop.time()))))
                return ""
            except TopologyProblem as exc:
                if exc.answered:
                    return f"{backend.name}: {exc}"
                if loop.time() + RETRY_S >= end:
                    return f"{backend.name}: {exc} (still, after the {wait_s:g}s start-up wait: --control-wait-s)"
            await asyncio.sleep(RETRY_S)

    problems = [p for p in await asyncio.gather(*(one(b) for b in pool.all)) if p]
    if problems:
        return problems
    models = {b.topology.model for b in pool.all}
    if len(models) > 1:
        listed = "; ".join(f"{b.name}: {b.topology.model!r}" for b in pool.all)
        return ["model fingerprints differ (P and D must run one model, dtype, KV geometry and KV cache "
                f"groups): {listed}"]
    pool.model = models.pop()
    return []


async def recheck(backend, peers: ControlPeers, timeout: float, model: str) -> str:
    """A health check's look: "" while the backend still passes (adopting its engine after a full
    restart), else why it must be out of rotation."""
    try:
        now = await learn(backend.role, backend.control, backend.declared_tp, peers, timeout)
    except TopologyProblem as exc:
        return str(exc)
    if now.model != model:
        return f"model fingerprint {now.model!r}, but its peers run {model!r}"
    before = backend.topology
    if before is not None and now.incarnations != before.incarnations:
        kept = [i for i, inc in enumerate(now.incarnations) if inc in before.incarnations]
        if kept:   # a rank from before next to new ones: not one engine's consistent restart
            return (f"ranks {kept} kept their incarnation while ranks "
                    f"{[i for i in range(len(now.incarnations)) if i not in kept]} restarted: out until all did")
        log.warning("%s restarted (every rank is new): tp %d, dp %d", backend.name, now.tp, now.dp)
    elif before is not None and now.one_dp_rank and not before.one_dp_rank:
        # one refused connection where a second data-parallel engine listened (restarting, say) does not
        # make the engine alone: bound late to such a D, a request vLLM gives that rank is never registered
        now = replace(now, one_dp_rank=False)
    backend.adopt(now)
    return ""
