"""What every module of the soak (bench/scenarios/soak/driver.py) shares: its shape, sizes, pacing and
deadline bounds."""

from __future__ import annotations

import os

from aiolayer.config import KVShape, Timeouts

from ..faults import FAULT_TIMEOUTS
from .shape import SOAK_SHAPE

BLOCKS = 4                 # per transfer
D_BLOCKS = 1024            # per decode node
P_BLOCKS = 1024            # P's paged cache: source blocks of transfers in flight or fenced
WINDOW = 64                # transfers in flight at P at most
STEP = 8                   # transfers begun per step
LAYER_S = 0.001            # simulated compute per layer
ALLOC_WORKERS = 8          # allocations in flight ahead of the forward
READY_AHEAD = 2 * STEP     # allocated, not yet begun: short, D's receive deadline runs from allocation
D_CHECKS = 32              # D verifications/releases in flight
FAULT_AT_LAYER = 1
KILL_VERIFY_S = 0.25       # before a SIGKILL: at most this long for D to verify what P acknowledged there
FREEZE_S = (0.5, 3.0)
KINDS = ("kill", "freeze", "refuse", "drop_done")
RSS_LIMIT = 0.05
PROGRESS_S = 5.0
STALL_S = 90.0             # no P outcome at all for this long, with transfers in flight: give up

T = FAULT_TIMEOUTS
# P: layout fetch, then each layer's write, then DONE/FAILED delivery; doubled and padded for a busy box
P_BOUND_S = 2 * (T.layout_fetch + T.layer_write + T.done_delivery) + 5.0
# D, from P's outcome: receive deadline, then the fence without P's answer, a freeze, padding
D_BOUND_S = T.receive + T.fence_grace + FREEZE_S[1] + 5.0
DRIVER_TIMEOUTS = Timeouts(control_call=1.0)
CALL_S = 1.0


def rss_mb(pid: int | str = "self") -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, IndexError, ValueError):
        return 0.0


def soak_shape(args) -> KVShape:
    """The command line's shape (its flags default to ``SOAK_SHAPE``), ``BLOCKS`` blocks per transfer."""
    return KVShape(num_blocks=BLOCKS, **{name: getattr(args, name, small) for name, small in SOAK_SHAPE.items()})


def with_blocks(shape: KVShape, num_blocks: int) -> KVShape:
    """``shape`` with a pool of ``num_blocks`` (a D node's, P's cache)."""
    return KVShape(**{**{f: getattr(shape, f) for f in shape.__struct_fields__}, "num_blocks": num_blocks})
