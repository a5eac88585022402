"""Shared fixtures: memory-backend runtimes and decode nodes that are always stopped."""

from __future__ import annotations

import pytest

from aiolayer import DecodeNode, KVShape, NodeConfig, Runtime, Timeouts


# Modules whose tests each run a whole scenario (child processes, real Mooncake peers, network namespaces,
# a wheel build, a benchmark run): marked ``slow``, left out of ``make test-fast`` (``make test`` runs everything).
SCENARIO_MODULES = frozenset({
    "test_two_hosts.py", "test_soak.py", "test_packaging.py", "test_scale.py", "test_bench_cli.py",
    "test_examples.py", "test_faults.py", "test_node_cli.py", "test_mooncake_segment_open.py",
    "test_mooncake_grouped_writes.py", "test_head_slice_writes.py", "test_mooncake_two_process.py", "test_doctor.py",
})


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: starts real vLLM (CPU) servers; slow (tens of seconds)")
    config.addinivalue_line("markers", "slow: runs a whole scenario (processes, namespaces, wheels); not in test-fast")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SCENARIO_MODULES:
            item.add_marker(pytest.mark.slow)


from helpers_node import SMALL_SHAPE  # one shape for every small test


@pytest.fixture
def small_shape() -> KVShape:
    return SMALL_SHAPE


@pytest.fixture
def memory_runtime():
    """Factory: ``memory_runtime(engine_id="p", timeouts=None)`` -> a started Runtime, stopped at teardown."""
    made: list[Runtime] = []

    def make(engine_id: str = "p", timeouts: Timeouts | None = None) -> Runtime:
        rt = Runtime(NodeConfig(engine_id=engine_id, backend="memory"), timeouts)
        made.append(rt)
        return rt.start()

    yield make
    for rt in reversed(made):
        rt.stop()


@pytest.fixture
def memory_decode_node():
    """Factory: ``memory_decode_node(shape, engine_id="d", timeouts=None)`` -> a started DecodeNode."""
    made: list[DecodeNode] = []

    def make(shape: KVShape = SMALL_SHAPE, engine_id: str = "d", timeouts: Timeouts | None = None) -> DecodeNode:
        node = DecodeNode(shape, NodeConfig(engine_id=engine_id, backend="memory"), timeouts)
        made.append(node)
        return node.start()

    yield make
    for node in reversed(made):
        node.stop()
