"""The connector's worker asks Linux for the AMX tile state that vLLM CPU's AMX kernels use without asking.

Each case runs in a fresh process: the permission is per process and, once granted, cannot be taken
back, so only a process that never asked shows the change. The state is read with the kernel's own
``arch_prctl(ARCH_GET_XCOMP_PERM)``, not through torch.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

# arch_prctl(ARCH_GET_XCOMP_PERM) through libc's syscall(); bit 18 is XFEATURE_XTILEDATA (the AMX tiles)
_PROBE = r"""
import ctypes, json, platform
def permitted():
    if platform.machine() != "x86_64":
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_uint64(0)
    if libc.syscall(158, 0x1022, ctypes.byref(mask)) != 0:   # SYS_arch_prctl, ARCH_GET_XCOMP_PERM
        return None
    return bool(mask.value & (1 << 18))
import torch
from aiolayer_vllm.layout import request_amx_tiles
before = permitted()
granted = request_amx_tiles()
print(json.dumps({"amx": torch.cpu._is_amx_tile_supported(), "before": before, "granted": granted,
                  "after": permitted()}))
"""


def test_the_worker_gets_the_amx_tile_state_where_the_cpu_has_it():
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    if seen["amx"]:
        assert seen["before"] is False, seen   # a fresh process has not asked: the kernels would die
        assert seen["granted"] is True and seen["after"] is True, seen
    else:   # nothing to ask for: no change, and the caller is told so
        assert seen["granted"] is False and seen["after"] == seen["before"], seen
