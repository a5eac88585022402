"""Test-only switches on a D engine's received KV (environment variables, never configuration).

``AIOLAYER_DEBUG_ZERO_RECEIVED=1`` zeroes the KV that arrived before D uses it (the end-to-end tests'
negative control: the answer must change). ``AIOLAYER_DEBUG_CORRUPT_RECEIVED=1`` changes one value of
the last layer of every transfer's last block after the bytes landed and before D checks them (the
integrity check's fault: with ``integrity_sample`` 1.0 at P every such transfer must fail).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiolayer.protocol import messages as m


def zero_blocks(views: Mapping[str, tuple[Any, ...]], blocks: list[int]) -> None:
    import torch

    idx = torch.as_tensor(blocks, dtype=torch.int64)
    for planes in views.values():
        for plane in planes:
            plane.index_fill_(0, idx, 0)


def corrupter(views: Mapping[str, tuple[Any, ...]], layer_names, blocks_of):
    """D's inbound hook: change one value of the last layer in the transfer's last block when the first
    message that makes D read that layer arrives: an early check naming it, else the DONE (alone or
    batched); ``blocks_of(transfer id)`` gives D's blocks of a transfer (or None)."""
    last, last_index = views[layer_names[-1]], len(layer_names) - 1
    early: set[str] = set()   # transfers whose last layer an early check named (changed then)

    def change(transfer_id: str) -> None:
        blocks = blocks_of(transfer_id)
        if blocks:
            last[0][blocks[-1]].view(-1)[0] += 1.0

    def corrupt(msg: m.Message) -> None:
        if isinstance(msg, m.EarlyCheck) and last_index in msg.check.layers:
            early.add(msg.transfer_id)
            change(msg.transfer_id)
        dones = msg.items if isinstance(msg, m.DoneBatch) else [msg] if isinstance(msg, m.Done) else []
        for done in dones:
            if done.transfer_id in early:
                early.discard(done.transfer_id)
            else:
                change(done.transfer_id)

    return corrupt
