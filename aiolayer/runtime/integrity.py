"""Sampled end-to-end KV integrity: digests of what P wrote, checked against what landed at D.

P samples each layer of a transfer with probability ``NodeConfig.integrity_sample`` (per layer, so that
a sampled request pays for a layer or two, not for its whole KV). Once every write of the transfer
completed (its source blocks are held and unchanged until then), P computes for each sampled layer a
digest of its source runs in write order, off the loop (a worker thread), and sends them with DONE
(``Done.check``) with the runs' offsets at D relative to a layer's base. Before D accepts that DONE it
computes the same digests over its own memory at those offsets, also off the loop; a mismatch turns the DONE into a
failure ("integrity: ..."), so the engine recomputes or fails the request (vLLM's ``kv_load_failure_policy``)
instead of decoding from corrupt KV.

The digest is XXH3-64 where D's layout lists it (``LayoutReply.digests``), else CRC32, which every
version verifies. Both sides pay it after the last write, on the critical path, so its speed counts:
on a 2-core EPYC VM zlib's CRC32 took 3.95 ms per 16 MB, XXH3-64 0.30 ms. A random change (a flipped
bit, a stale or misplaced block) escapes CRC32 with odds 2^-32 and XXH3-64 with 2^-64; neither is meant
against a forger (the token is).

Verified: for a sampled layer, every byte (K and V planes) that P wrote equals what D holds when it
accepts the DONE. Not verified: layers not sampled; a side whose KV is not in host
memory (``register_kv_memory(host_memory=False)``, e.g. GPU memory: it neither samples nor checks);
transfers with more than ``MAX_CHECK_RUNS`` runs per layer; what happens to the bytes after D checked.
"""

from __future__ import annotations

import ctypes
import random
import zlib
from collections.abc import Iterable

import numpy as np
import xxhash

from ..protocol import messages as m
from ..protocol.plan import BlockRuns, Spans, run_addresses
from .spec import LocalLayout


# What this side verifies besides crc32, for its LayoutReply.
VERIFIES = [d for d in m.CHECK_DIGESTS if d != "crc32"]


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


def sample_check(local: LocalLayout | None, runs: BlockRuns | None, spans: Spans | None,
                 rate: float, digest: str = "crc32") -> m.LayerCheck | None:
    """P: a check for this transfer, when it is sampled and can be checked; None else. Runs in a
    worker thread (it reads every byte of the transfer's source)."""
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
    src, lengths_ = src.tolist(), lengths.tolist()
    return m.LayerCheck(layers=layers, offsets=dst.tolist(), lengths=lengths_, digest=digest,
                        crc_k=digest_of_runs(digest, local.k_base[layers], src, lengths_),
                        crc_v=digest_of_runs(digest, local.v_base[layers], src, lengths_) if split else [])


def verify_check(local: LocalLayout | None, block_ids: list[int], check: m.LayerCheck) -> str:
    """D: "" when what landed matches ``check``; else why not ("integrity: ..."). A check that names
    bytes outside the transfer's own blocks, or does not fit this layout, is a failure too."""
    if local is None or not local.host:
        return ""   # not host memory: unverifiable here (documented, not guessed)
    problem = _check_shape(local, block_ids, check)
    if problem:
        return f"integrity: malformed check: {problem}"
    digest, offsets, lengths = check.digest, check.offsets, check.lengths
    got_k = digest_of_runs(digest, local.k_base[check.layers], offsets, lengths)
    got_v = digest_of_runs(digest, local.v_base[check.layers], offsets, lengths) if check.crc_v else []
    for plane, want, got in (("K", check.crc_k, got_k), ("V", check.crc_v, got_v)):
        for layer, a, b in zip(check.layers, want, got):
            if a != b:
                return (f"integrity: layer {layer} {plane}: the bytes that landed differ from what P wrote "
                        f"({digest.upper()} {b:08x}, P's {a:08x})")
    return ""


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
