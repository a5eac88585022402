"""bench/ laid out like the core. Its modules import each other without a cycle (read from
the source with ``ast``, imports inside functions included: a deferred import hides a cycle, it does not
remove it), and the bench and the tests start their child processes through one helper."""

from __future__ import annotations

import ast
import os
import signal
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
# Like ``aiolayer node``, it handles SIGTERM (a default-fatal signal would kill it even while stopped).
SLEEPER = ("import json, signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
           "print('sleeper-stderr', file=sys.stderr, flush=True); print(json.dumps({'port': 1}), flush=True); "
           "time.sleep(60)")


def _module_names(root: Path) -> dict[str, Path]:
    """Dotted name (relative to ``root``, the package itself "") -> file."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path], top: str) -> set[str]:
    """The bench modules ``name`` imports; absolute imports of ``top`` (the installed name) count too."""
    is_pkg = path.name == "__init__.py"
    package = name.split(".") if is_pkg else name.split(".")[:-1]
    package = [p for p in package if p]
    found: set[str] = set()

    def add(dotted: str, names: list[str]) -> None:
        for alias in names:   # ``from pkg import mod`` imports the module pkg.mod
            sub = f"{dotted}.{alias}" if dotted else alias
            if sub in modules:
                found.add(sub)
                continue
            if dotted in modules:
                found.add(dotted)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                dotted = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and (node.module == top or node.module.startswith(top + ".")):
                dotted = node.module[len(top) + 1:]
            else:
                continue
            add(dotted, [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            found.update(a.name[len(top) + 1:] for a in node.names
                         if a.name.startswith(top + ".") and a.name[len(top) + 1:] in modules)
    found.discard(name)
    return found


def import_cycles(root: Path, top: str) -> list[list[str]]:
    modules = _module_names(root)
    graph = {name: _imports(name, path, modules, top) for name, path in modules.items()}
    cycles, state = [], {}   # state: 1 on the current path, 2 done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    return cycles


def test_no_import_cycle_in_bench():
    assert _module_names(BENCH), "no bench modules found"
    cycles = import_cycles(BENCH, "aiolayer.bench")
    assert not cycles, "import cycles among bench modules: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("root, top", [(BENCH.parent / "aiolayer", "aiolayer"),
                                       (BENCH.parent / "bridges" / "vllm" / "aiolayer_vllm", "aiolayer_vllm")],
                         ids=["core", "vllm-bridge"])
def test_no_import_cycle_in_the_core_or_the_bridge(root, top):
    cycles = import_cycles(root, top)
    assert not cycles, f"import cycles in {top}: " + "; ".join(" -> ".join(c) for c in cycles)


def test_bench_and_tests_share_one_child_process_helper():
    import helpers_node
    from aiolayer.bench import node
    from aiolayer.bench.child import ChildProcess

    assert issubclass(helpers_node.NodeProcess, ChildProcess)
    assert issubclass(node.NodeProcess, ChildProcess)
    assert helpers_node.MC_ENV.items() >= node.MOONCAKE_ENV.items()   # one Mooncake environment


def test_child_process_stop_thaws_a_frozen_child_in_its_own_group():
    """The union of the two drifted copies: the bench's SIGCONT before SIGTERM (a frozen child must be able
    to act on it), the tests' own process group, stop timing, stderr kept in a file."""
    from aiolayer.bench.child import ChildProcess

    child = ChildProcess([sys.executable, "-c", SLEEPER], name="sleeper").start()
    try:
        assert child.read_json(20, require="port") == {"port": 1}
        assert os.getpgid(child.pid) == child.pid
        os.kill(child.pid, signal.SIGSTOP)
        assert child.stop(timeout=5) == 0
        assert not child.killed and child.stop_s < 5
        assert "sleeper-stderr" in child.stderr_text()
    finally:
        child.close()


def test_child_process_first_line_has_a_deadline_and_carries_stderr():
    from aiolayer.bench.child import ChildProcess, ChildStartError

    silent = "import sys, time; print('no line from me', file=sys.stderr, flush=True); time.sleep(60)"
    child = ChildProcess([sys.executable, "-c", silent], name="silent").start()
    try:
        with pytest.raises(ChildStartError, match="no line from me"):
            child.read_json(1.0)
    finally:
        child.close()
    assert child.returncode is not None
    bad = ChildProcess([sys.executable, "-c", "print('not json')"], name="bad").start()
    try:
        with pytest.raises(ChildStartError, match="not JSON"):
            bad.read_json(20)
    finally:
        bad.close()
