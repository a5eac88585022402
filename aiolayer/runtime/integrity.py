"""Sampled end-to-end KV integrity: CRCs of what P wrote, checked against what landed at D.

P samples a transfer with probability ``NodeConfig.integrity_sample``. Once every write of it completed
(its source blocks are held and unchanged until then), P computes per layer the CRC32 of its source
runs in write order, off the loop (a worker thread), and sends them with DONE (``Done.check``) with the
runs' offsets at D relative to each layer's base. Before D accepts that DONE it computes the same CRCs
over its own memory at those offsets, also off the loop; a mismatch turns the DONE into a failure
("integrity: ..."), so the engine recomputes or fails the request (vLLM's ``kv_load_failure_policy``)
instead of decoding from corrupt KV.

Verified: for a sampled transfer, every byte of every layer (K and V planes) that P wrote equals what D
holds when it accepts the DONE. Not verified: transfers not sampled; a side whose KV is not in host
memory (``register_kv_memory(host_memory=False)``, e.g. GPU memory: it neither samples nor checks);
transfers with more than ``MAX_CHECK_RUNS`` runs per layer; what happens to the bytes after D checked.
"""

from __future__ import annotations

import ctypes
import random
import zlib

import numpy as np

from ..protocol import messages as m
from ..protocol.plan import run_addresses
from .spec import LocalLayout


def crc_of_runs(bases, offsets, lengths) -> list[int]:
    """Per layer base: the CRC32 of the runs ``base + offset`` of ``length`` bytes, in order (host memory)."""
    out = []
    for base in bases:
        crc = 0
        for off, n in zip(offsets, lengths):
            crc = zlib.crc32((ctypes.c_char * int(n)).from_address(int(base) + int(off)), crc)
        out.append(crc)
    return out


def _split_planes(local: LocalLayout) -> bool | None:
    """True: K and V in separate tensors per layer; False: one plane; None: mixed (not sampled)."""
    split = local.v_base != 0
    if split.all():
        return True
    return False if not split.any() else None


def sample_check(local: LocalLayout | None, runs, spans, rate: float) -> m.LayerCheck | None:
    """P: a check for this transfer, when it is sampled and can be checked; None else. Runs in a
    worker thread (it reads every byte of the transfer's source)."""
    if local is None or not local.host or rate <= 0.0 or random.random() >= rate:
        return None
    split = _split_planes(local)
    rel = spans if spans is not None else run_addresses(runs, 0, 0, local.block_bytes)
    src, dst, lengths = (np.asarray(a, dtype=np.int64) for a in rel)
    if split is None or not 0 < len(lengths) <= m.MAX_CHECK_RUNS:
        return None
    return m.LayerCheck(offsets=dst.tolist(), lengths=lengths.tolist(),
                        crc_k=crc_of_runs(local.k_base, src.tolist(), lengths.tolist()),
                        crc_v=crc_of_runs(local.v_base, src.tolist(), lengths.tolist()) if split else [])


def verify_check(local: LocalLayout | None, block_ids: list[int], check: m.LayerCheck) -> str:
    """D: "" when what landed matches ``check``; else why not ("integrity: ..."). A check that names
    bytes outside the transfer's own blocks, or does not fit this layout, is a failure too."""
    if local is None or not local.host:
        return ""   # not host memory: unverifiable here (documented, not guessed)
    problem = _check_shape(local, block_ids, check)
    if problem:
        return f"integrity: malformed check: {problem}"
    got_k = crc_of_runs(local.k_base, check.offsets, check.lengths)
    got_v = crc_of_runs(local.v_base, check.offsets, check.lengths) if check.crc_v else []
    for plane, want, got in (("K", check.crc_k, got_k), ("V", check.crc_v, got_v)):
        for layer, (a, b) in enumerate(zip(want, got)):
            if a != b:
                return (f"integrity: layer {layer} {plane}: the bytes that landed differ from what P wrote "
                        f"(CRC32 {b:08x}, P's {a:08x})")
    return ""


def _check_shape(local: LocalLayout, block_ids: list[int], check: m.LayerCheck) -> str:
    layers = local.num_layers
    split = _split_planes(local)
    if len(check.crc_k) != layers or len(check.crc_v) != (layers if split else 0):
        return f"{len(check.crc_k)}/{len(check.crc_v)} CRCs for {layers} layers"
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
