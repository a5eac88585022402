"""The raw-Mooncake baseline of ``aiolayer bench scale``: the same P rank pushes the exact spans
aiolayer wrote (same source, destination and length, same D nodes) with Mooncake alone.

The spans come from the same planning functions the runtime uses (``merge_runs`` of the request's
blocks, ``slice_addresses`` of its route, plus each layer's K and V bases), computed before the
clock starts. They are pushed the fastest way the Python API offers for many small writes:
``batch_transfer_async_write`` with up to ``CHUNK`` spans per batch (layer-major, the D ranks
interleaved) and at most ``WINDOW`` batches in flight, each waited with ``get_batch_transfer_status``
oldest first (it spins a core while it waits: that is part of raw's price here). Not yet shown to
be Mooncake's fastest way here: one scratch run on a loaded 2-core host pushed 20,000 8 KiB writes
faster as one ``transfer_submit_write`` each with a tight ``transfer_check_status`` loop (0.041 GB/s
against 0.018; ``batch_transfer_sync_write`` 0.013), so compare both before trusting a ratio. It runs after D verified
aiolayer's bytes and before D releases the blocks, so it rewrites identical bytes into blocks that
are still allocated.
"""

from __future__ import annotations

import collections
import time

import msgspec
import numpy as np

from aiolayer.protocol.plan import HeadGeometry, merge_runs, slice_addresses

from .model import PlanItem, ScaleConfig, request_blocks

CHUNK = 1024      # spans per Mooncake batch
WINDOW = 16       # batches in flight (CHUNK * WINDOW stays far below Mooncake's per-peer queue)
BATCH_METHOD = (f"batch_transfer_async_write, <= {CHUNK} spans per batch, <= {WINDOW} batches in flight, "
          "get_batch_transfer_status oldest first")
_INVALID_IDS = (0, -1, (1 << 64) - 1)
_SINGLE_WAIT_S = 0.0002


class RawLayout(msgspec.Struct, frozen=True):
    """What P needs of one D rank's layout to address its blocks (from D's LayoutReply)."""

    d_rank: int
    session: str
    k_base: list[int]
    v_base: list[int]
    kv_heads: int


def raw_batches(cfg: ScaleConfig, items: list[PlanItem], layouts: dict[int, RawLayout], k_base, v_base,
                p_heads: int) -> list[tuple[str, list[int], list[int], list[int]]]:
    """(target, srcs, dsts, lengths) batches of every span aiolayer writes for ``items``, in push order."""
    geom = HeadGeometry(cfg.block_size, cfg.head_bytes, cfg.layout)
    rel: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = collections.defaultdict(list)
    for it in items:
        runs = merge_runs(request_blocks(cfg, it.request), it.block_ids)
        d = layouts[it.route.d_rank]
        rel[d.d_rank].append(slice_addresses(runs, 0, 0, p_heads, d.kv_heads, it.route, geom))
    spans = {d: tuple(np.concatenate(parts) for parts in zip(*lists)) for d, lists in rel.items()}
    out = []
    for layer in range(cfg.num_layers):
        per_d = []
        for d, (src, dst, length) in spans.items():
            lay = layouts[d]
            s = np.concatenate([src + int(k_base[layer]), src + int(v_base[layer])]).tolist()
            t = np.concatenate([dst + lay.k_base[layer], dst + lay.v_base[layer]]).tolist()
            n = np.concatenate([length, length]).tolist()
            per_d.append([(lay.session, s[i:i + CHUNK], t[i:i + CHUNK], n[i:i + CHUNK])
                          for i in range(0, len(n), CHUNK)])
        for i in range(max(map(len, per_d), default=0)):   # the D ranks interleaved, as aiolayer's items are
            out.extend(chunks[i] for chunks in per_d if i < len(chunks))
    return out


def push_batch(engine, batches) -> dict:
    """Push every batch, ``WINDOW`` in flight; timings, bytes, writes, failed batches, process CPU."""
    inflight: collections.deque[int] = collections.deque()
    failed = 0
    c0, t0 = time.process_time(), time.perf_counter()
    for target, srcs, dsts, lens in batches:
        if len(inflight) >= WINDOW:
            failed += engine.get_batch_transfer_status([inflight.popleft()]) != 0
        bid = engine.batch_transfer_async_write(target, srcs, dsts, lens)
        if bid == 0:
            failed += 1
        else:
            inflight.append(bid)
    while inflight:
        failed += engine.get_batch_transfer_status([inflight.popleft()]) != 0
    return _timed(batches, t0, c0, failed, len(batches))


def push_single(engine, batches) -> dict:
    """Every span its own ``transfer_submit_write``, ``CHUNK * WINDOW`` in flight, polled oldest first."""
    submit, check = engine.transfer_submit_write, engine.transfer_check_status
    inflight: collections.deque[int] = collections.deque()
    failed, window = 0, CHUNK * WINDOW
    c0, t0 = time.process_time(), time.perf_counter()

    def drain(keep: int) -> int:
        bad = 0
        while len(inflight) > keep:
            status = check(inflight[0])
            if status == 0:
                time.sleep(_SINGLE_WAIT_S)
                continue
            inflight.popleft()
            bad += status != 1
        return bad

    for target, srcs, dsts, lens in batches:
        for s, d, n in zip(srcs, dsts, lens):
            if len(inflight) >= window:
                failed += drain(window - CHUNK)
            bid = submit(target, s, d, n)
            if bid in _INVALID_IDS:
                failed += 1
            else:
                inflight.append(bid)
    failed += drain(0)
    return _timed(batches, t0, c0, failed, sum(len(b[3]) for b in batches))


def _timed(batches, t0: float, c0: float, failed: int, submissions: int) -> dict:
    t1 = time.perf_counter()
    return {"t_begin": t0, "t_end": t1, "bytes": sum(sum(b[3]) for b in batches),
            "writes": sum(len(b[3]) for b in batches), "batches": submissions, "failed_batches": failed,
            "cpu_s": round(time.process_time() - c0, 3)}


SINGLE_METHOD = (f"transfer_submit_write per span, <= {CHUNK * WINDOW} in flight, transfer_check_status "
                 "oldest first")
METHODS = {"batch": (push_batch, BATCH_METHOD), "single": (push_single, SINGLE_METHOD)}
