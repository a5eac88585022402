"""A D that restarts at a session name its dead predecessor had (the same Mooncake port again) is
written under a name of its own: Mooncake caches a segment by name for good, so the old name would
send P's writes to the dead process's data port (failing), or into whatever process holds that port now
(reported as written). The new name is the port with one more leading zero: the real engine must take
it as the same port, or the restarted D would never be reached."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from helpers_node import SMALL_SHAPE, apply_mc_env, mooncake_p, stoppable_node

apply_mc_env()  # before any Mooncake engine exists in this process

from aiolayer.backends.mooncake_names import SegmentNames
from aiolayer.protocol import messages as m

pytestmark = pytest.mark.timeout(90)
SHAPE = SMALL_SHAPE


def test_each_new_incarnation_behind_a_session_gets_a_name_of_its_own():
    names = SegmentNames()
    assert names.target_for("127.0.0.1:16213", "d1") == "127.0.0.1:16213"
    assert names.target_for("127.0.0.1:16213", "d1") == "127.0.0.1:16213"     # the same process: unchanged
    assert names.target_for("127.0.0.1:16213", "d2") == "127.0.0.1:016213"    # restarted at the name
    assert names.target_for("127.0.0.1:16213", "d2") == "127.0.0.1:016213"
    assert names.target_for("127.0.0.1:16213", "d3") == "127.0.0.1:0016213"
    assert names.target_for("10.0.0.2:16213", "d9") == "10.0.0.2:16213"       # another host's name: its own
    assert names.target_for("decode-0", "a") == names.target_for("decode-0", "b") == "decode-0"   # no port
    assert len(names) == 3


def test_the_engine_writes_to_a_zero_padded_name_at_the_same_port():
    with stoppable_node(SHAPE) as node, mooncake_p("p-names", 5, SHAPE) as (rt, cache):
        rep = rt.request(node.control, m.AllocRequest(transfer_id="pad", num_blocks=2), timeout=5)
        layout = rt.request(node.control, m.LayoutRequest(transfer_id="pad", token=rep.token), timeout=5)
        host, _, port = layout.session.rpartition(":")
        src = np.array([cache.k_base[0] + i * SHAPE.block_bytes for i in range(2)], dtype=np.int64)
        dst = np.array([layout.layers[0].k_base + b * SHAPE.block_bytes for b in rep.block_ids], dtype=np.int64)
        lengths = np.full(2, SHAPE.block_bytes, dtype=np.int64)

        async def write() -> None:
            await rt.backend.write(f"{host}:00{port}", src, dst, lengths, 10.0)

        rt.loop_thread.call(write(), timeout=40)
        crc = rt.request(node.control, m.VerifyRequest(transfer_id="pad"), timeout=5).crc_k[0]
        assert crc == zlib.crc32(b"".join(cache.blocks[0][0][i].tobytes() for i in range(2)))
