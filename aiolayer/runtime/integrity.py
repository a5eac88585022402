"""Sampled end-to-end KV integrity: digests of what P wrote, checked against what landed at D.

P samples each layer of a transfer with probability ``NodeConfig.integrity_sample`` (per layer, so that
a sampled request pays for a layer or two, not for its whole KV). As the layers of the transfer are
submitted (a layer's source is final then, and held until every write ended), P computes for each
sampled layer a digest of its source runs in write order, off the loop (a worker thread), and sends them
with DONE (``Done.check``) with the runs' offsets at D relative to a layer's base. Before D accepts that DONE
it computes the same digests over its own memory at those offsets, also off the loop; a mismatch turns
the DONE into a failure ("integrity: ..."), so the engine recomputes or fails the request (vLLM's
``kv_load_failure_policy``) instead of decoding from corrupt KV.

The digest is XXH3-64 where D's layout lists it (``LayoutReply.digests``), else CRC32, which every
version verifies. What neither side reads before the last write is on the critical path, so its speed counts:
on a 2-core EPYC VM zlib's CRC32 took 3.95 ms per 16 MB, XXH3-64 0.30 ms. A random change (a flipped
bit, a stale or misplaced block) escapes CRC32 with odds 2^-32 and XXH3-64 with 2^-64; neither is meant
against a forger (the token is).

Verified: for a sampled layer, every byte (K and V planes) that P wrote equals what D holds when it
accepts the DONE (a layer matched early: when D read it, after its write completed). Not verified:
layers not sampled; a side whose KV is not in host memory (``register_kv_memory(host_memory=False)``,
e.g. GPU memory: it neither samples nor checks); transfers with more than ``MAX_CHECK_RUNS`` runs per
layer; what happens to the bytes after D checked.

Early checks: D's check of a large transfer would sit between P's last write and D's acceptance. So P
digests the sampled layers while the prefill goes on, a part of the layers at a time
(``send.checking``), and sends D those whose writes it saw complete (``EarlyCheck``); D verifies them at
once and keeps the layers that matched (``EarlyChecks``), and at DONE, which still carries every sampled
layer, verifies only the others. A layer matched early was read after its write completed and before
the DONE; only a writer of the transfer can change it in between (the fence keeps every other one
out), and that writer's DONE says its writes are over.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import random
import zlib
from collections.abc import Callable, Iterable

import msgspec
import numpy as np
import xxhash

from ..protocol import messages as m
from ..protocol.plan import BlockRuns, Spans, run_addresses
from .spec import LocalLayout


log = logging.getLogger(__name__)

# What this side verifies besides crc32, for its LayoutReply.
VERIFIES = [d for d in m.CHECK_DIGESTS if d != "crc32"]
Match = tuple[int, int, int | None]   # a sampled layer found intact: (layer, K's digest, V's or None)
MAX_EARLY_CHECKS = 16   # early checks D verifies per writer of a transfer (P sends at most ``send.checking.CHUNKS``)


def pick_digest(offered: Iterable[str]) -> str:
    """P: the last (fastest) of ``CHECK_DIGESTS`` that D's layout offers; crc32, which every D verifies,
    where it offers none (an older D)."""
    offered = set(offered)
    return next((d for d in reversed(m.CHECK_DIGESTS) if d in offered), "crc32")


def digest_of_runs(digest: str, bases: Iterable[int], offsets: Iterable[int], lengths: Iterable[int]) -> list[int]:
    """Per layer base: the digest of the runs ``base + offset`` of ``length`` bytes, in order (host memory)."""
    runs = list(zip(offsets, lengths))
    out = []
    for base in bases:
        views = [(ctypes.c_char * int(n)).from_address(int(base) + int(off)) for off, n in runs]
        if digest == "crc32":
            crc = 0
            for view in views:
                crc = zlib.crc32(view, crc)
            out.append(crc)
        else:
            state = xxhash.xxh3_64()
            for view in views:
                state.update(view)
            out.append(state.intdigest())
    return out


def _split_planes(local: LocalLayout) -> bool | None:
    """True: K and V in separate tensors per layer; False: one plane; None: mixed (not sampled)."""
    split = local.v_base != 0
    if split.all():
        return True
    return False if not split.any() else None


class CheckPlan(msgspec.Struct, frozen=True):
    """P: what one transfer's check reads: the sampled layers, and its runs at P (``src``) and at D
    (``dst``), relative to a layer's base."""

    layers: list[int]
    src: list[int]
    dst: list[int]
    lengths: list[int]
    split: bool      # K and V in separate planes
    digest: str


def plan_check(local: LocalLayout | None, runs: BlockRuns | None, spans: Spans | None,
               rate: float, digest: str = "crc32") -> CheckPlan | None:
    """P: the plan of this transfer's check, when it is sampled and can be checked; None else."""
    if local is None or not local.host or rate <= 0.0:
        return None
    layers = [layer for layer in range(local.num_layers) if random.random() < rate]
    split = _split_planes(local)
    rel = spans if spans is not None or runs is None else run_addresses(runs, 0, 0, local.block_bytes)
    if rel is None:   # check_layout gives spans wherever the blocks do not pair
        return None
    src, dst, lengths = (np.asarray(a, dtype=np.int64) for a in rel)
    if not layers or split is None or not 0 < len(lengths) <= m.MAX_CHECK_RUNS:
        return None
    return CheckPlan(layers=layers, src=src.tolist(), dst=dst.tolist(), lengths=lengths.tolist(), split=split,
                     digest=digest)


def digest_layers(local: LocalLayout, plan: CheckPlan, layers: list[int]) -> list[tuple[int, int | None]]:
    """P, in a worker thread (it reads every byte of those layers' source): per layer, K's and V's digest."""
    k = digest_of_runs(plan.digest, local.k_base[layers], plan.src, plan.lengths)
    v = digest_of_runs(plan.digest, local.v_base[layers], plan.src, plan.lengths) if plan.split else []
    return [(k[i], v[i] if plan.split else None) for i in range(len(layers))]


def check_of(plan: CheckPlan, digests: dict[int, tuple[int, int | None]]) -> m.LayerCheck:
    """The ``LayerCheck`` of the digested layers, ascending."""
    layers = sorted(digests)
    return m.LayerCheck(layers=layers, offsets=plan.dst, lengths=plan.lengths, digest=plan.digest,
                        crc_k=[digests[layer][0] for layer in layers],
                        crc_v=[digests[layer][1] or 0 for layer in layers] if plan.split else [])


def sample_check(local: LocalLayout | None, runs: BlockRuns | None, spans: Spans | None,
                 rate: float, digest: str = "crc32") -> m.LayerCheck | None:
    """P: the whole check of this transfer at once, when it is sampled and can be checked; None else.
    Runs in a worker thread."""
    plan = plan_check(local, runs, spans, rate, digest)
    if plan is None or local is None:
        return None
    return check_of(plan, dict(zip(plan.layers, digest_layers(local, plan, plan.layers))))


def verify_check(local: LocalLayout | None, block_ids: list[int], check: m.LayerCheck,
                 early: EarlyMatch | None = None) -> str:
    """D: "" when what landed matches ``check``; else why not ("integrity: ..."). A check that names
    bytes outside the transfer's own blocks, or does not fit this layout, is a failure too. The layers
    ``early`` found intact are not read again."""
    problem, rest = plan_verify(local, block_ids, check, early)
    if problem or rest is None or local is None:
        return problem
    return read_check(local, rest)


def plan_verify(local: LocalLayout | None, block_ids: list[int], check: m.LayerCheck,
                early: EarlyMatch | None = None) -> tuple[str, m.LayerCheck | None]:
    """D, on the loop (no byte read): why ``check`` fails as it stands ("" if it does not), and the part
    of it still to read (None: nothing; not host memory, or every layer matched early)."""
    if local is None or not local.host:
        return "", None   # not host memory: unverifiable here (documented, not guessed)
    problem = _check_shape(local, block_ids, check)
    if problem:
        return f"integrity: malformed check: {problem}", None
    return "", check if early is None else early.unmatched(check)


def read_check(local: LocalLayout, rest: m.LayerCheck) -> str:
    """D, in a worker thread: "" when the layers of ``rest`` (a check ``plan_verify`` let through) landed
    as P wrote them; else which differs."""
    got_k, got_v = _digests_at_d(local, rest)
    for plane, want, got in (("K", rest.crc_k, got_k), ("V", rest.crc_v, got_v)):
        for layer, a, b in zip(rest.layers, want, got):
            if a != b:
                return (f"integrity: layer {layer} {plane}: the bytes that landed differ from what P wrote "
                        f"({rest.digest.upper()} {b:08x}, P's {a:08x})")
    return ""


def _digests_at_d(local: LocalLayout, check: m.LayerCheck) -> tuple[list[int], list[int]]:
    digest, offsets, lengths = check.digest, check.offsets, check.lengths
    got_k = digest_of_runs(digest, local.k_base[check.layers], offsets, lengths)
    got_v = digest_of_runs(digest, local.v_base[check.layers], offsets, lengths) if check.crc_v else []
    return got_k, got_v


def _runs_of(check: m.LayerCheck) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    return check.digest, tuple(check.offsets), tuple(check.lengths)


def _match(check: m.LayerCheck, i: int) -> Match:
    return check.layers[i], check.crc_k[i], check.crc_v[i] if check.crc_v else None


def _part(check: m.LayerCheck, keep: list[int]) -> m.LayerCheck:
    return msgspec.structs.replace(check, layers=[check.layers[i] for i in keep], crc_k=[check.crc_k[i] for i in keep],
                                   crc_v=[check.crc_v[i] for i in keep] if check.crc_v else [])


class EarlyMatch(msgspec.Struct, frozen=True):
    """D: what an early check found landed intact: the runs it read and the layers that matched there."""

    runs: tuple[str, tuple[int, ...], tuple[int, ...]]
    layers: frozenset[Match]

    def unmatched(self, check: m.LayerCheck) -> m.LayerCheck | None:
        """``check`` less its layers matched early (the same digests over the same runs); None: none left."""
        if _runs_of(check) != self.runs:
            return check
        keep = [i for i in range(len(check.layers)) if _match(check, i) not in self.layers]
        return None if not keep else check if len(keep) == len(check.layers) else _part(check, keep)


def verify_early(local: LocalLayout | None, block_ids: list[int], check: m.LayerCheck) -> EarlyMatch | None:
    """D, in a worker thread: the layers of an early check that landed intact; None where nothing can be
    matched (not host memory, or a check that does not fit: the DONE's own check decides then)."""
    if local is None or not local.host or _check_shape(local, block_ids, check):
        return None
    got_k, got_v = _digests_at_d(local, check)
    intact = [i for i in range(len(check.layers))
              if got_k[i] == check.crc_k[i] and (not check.crc_v or got_v[i] == check.crc_v[i])]
    return EarlyMatch(_runs_of(check), frozenset(_match(check, i) for i in intact))


class EarlyChecks:
    """D: one transfer's early checks, per writer, each running in a worker thread or done; and the
    check of each writer's DONE while it runs, which a retry of that DONE joins instead of reading again."""

    __slots__ = ("_by_sender", "_at_done")

    def __init__(self) -> None:
        self._by_sender: dict[str, list[asyncio.Future[EarlyMatch | None]]] = {}
        self._at_done: dict[str, tuple[m.LayerCheck, asyncio.Future[str]]] = {}

    def running_done_check(self, sender: str, check: m.LayerCheck) -> asyncio.Future[str] | None:
        """The problem ("" if none) that the check of ``sender``'s DONE with this ``check`` will
        report, while that check runs; None when none runs."""
        running = self._at_done.get(sender)
        return running[1] if running is not None and running[0] == check else None

    def begin_done_check(self, sender: str, check: m.LayerCheck) -> asyncio.Future[str]:
        """The future its retries join: the caller sets its result, or cancels it, and ends it."""
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._at_done[sender] = (check, future)
        return future

    def end_done_check(self, sender: str, future: asyncio.Future[str]) -> None:
        if self._at_done.get(sender, (None, None))[1] is future:
            del self._at_done[sender]
        if not future.done():
            future.cancel()

    def start(self, sender: str, verify: Callable[[], EarlyMatch | None]) -> asyncio.Future[EarlyMatch | None] | None:
        """``verify`` started for ``sender`` (in a worker thread); None once that writer sent ``MAX_EARLY_CHECKS``."""
        futures = self._by_sender.setdefault(sender, [])
        if len(futures) >= MAX_EARLY_CHECKS:
            return None
        future = asyncio.get_running_loop().run_in_executor(None, verify)
        future.add_done_callback(_log_broken)   # once here: the reply and the DONE both read it
        futures.append(future)
        return future

    async def of(self, sender: str) -> EarlyMatch | None:
        """What ``sender``'s early checks matched, once each ended: the layers over the same runs."""
        found: EarlyMatch | None = None
        for future in list(self._by_sender.get(sender, ())):
            got = await early_result(future)
            if got is not None and (found is None or got.runs == found.runs):
                found = got if found is None else EarlyMatch(found.runs, found.layers | got.layers)
        return found


async def early_result(future: asyncio.Future[EarlyMatch | None]) -> EarlyMatch | None:
    """An early check's result once it ended; None when it broke (the DONE then reads those layers)."""
    await asyncio.wait({future})   # a DONE whose handler is cancelled leaves it running
    if future.cancelled() or future.exception() is not None:   # a bug (logged as it ended): the DONE reads it all
        return None
    return future.result()


def _log_broken(future: asyncio.Future[EarlyMatch | None]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("early integrity check raised", exc_info=future.exception())


def _check_shape(local: LocalLayout, block_ids: list[int], check: m.LayerCheck) -> str:
    layers, n = check.layers, len(check.layers)
    if check.digest not in m.CHECK_DIGESTS:
        return f"digest {check.digest[:40]!r} is none of {', '.join(m.CHECK_DIGESTS)}"
    if not layers or not all(0 <= a < b for a, b in zip(layers, layers[1:] + [local.num_layers])):
        return f"layers {layers[:8]} are not ascending layers of {local.num_layers}"
    if len(check.crc_k) != n or len(check.crc_v) != (n if _split_planes(local) else 0):
        return f"{len(check.crc_k)}/{len(check.crc_v)} CRCs for {n} layers"
    if len(check.offsets) != len(check.lengths) or not 0 < len(check.offsets) <= m.MAX_CHECK_RUNS:
        return f"{len(check.offsets)} offsets and {len(check.lengths)} lengths"
    mine, bb = set(block_ids), local.block_bytes
    for off, n in zip(check.offsets, check.lengths):
        if n <= 0 or off < 0 or n > len(mine) * bb:
            return f"run ({off}, {n})"
        first, last = off // bb, (off + n - 1) // bb
        if not all(b in mine for b in range(first, last + 1)):
            return f"run ({off}, {n}) outside the transfer's blocks"
    return ""
