"""bench/ and harness/ laid out like the core. Their modules import each other without a cycle (read from
the source with ``ast``, imports inside functions included: a deferred import hides a cycle, it does not
remove it), the harness never imports the bench (the tests use it without the benchmark), and the bench
and the tests start, freeze and clean up after their child processes through one harness. The runtime's
sides (send/ for P, receive/ for D, control/) import each other only as its layering allows. The vLLM bridge
takes from aiolayer only its public names and a short list of modules, the core never imports the bridge,
and type checkers see the public names ``aiolayer`` loads lazily."""

from __future__ import annotations

import ast
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
HARNESS = BENCH.parent / "harness"
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


@pytest.mark.parametrize("root, top", [(BENCH, "aiolayer.bench"), (HARNESS, "aiolayer.harness")],
                         ids=["bench", "harness"])
def test_no_import_cycle_in_the_bench_or_the_harness(root, top):
    assert _module_names(root), f"no {top} modules found"
    cycles = import_cycles(root, top)
    assert not cycles, f"import cycles among {top} modules: " + "; ".join(" -> ".join(c) for c in cycles)


def _absolute_imports(path: Path) -> list[str]:
    """The modules a file imports by absolute name (``import a.b``, ``from a.b import c``)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


def test_the_harness_never_imports_the_bench():
    found = [f"{path.name}: {name}" for path in sorted(HARNESS.rglob("*.py"))
             for name in _absolute_imports(path) if name.startswith("aiolayer.bench")]
    assert _module_names(HARNESS), "no harness modules found"
    assert not found, "the harness imports the bench:\n  " + "\n  ".join(found)


@pytest.mark.parametrize("root, top", [(BENCH.parent / "aiolayer", "aiolayer"),
                                       (BENCH.parent / "bridges" / "vllm" / "aiolayer_vllm", "aiolayer_vllm")],
                         ids=["core", "vllm-bridge"])
def test_no_import_cycle_in_the_core_or_the_bridge(root, top):
    cycles = import_cycles(root, top)
    assert not cycles, f"import cycles in {top}: " + "; ".join(" -> ".join(c) for c in cycles)


def test_bench_and_tests_share_one_child_process_helper():
    import helpers_node
    from aiolayer.harness import node
    from aiolayer.harness.child import ChildProcess

    assert issubclass(helpers_node.NodeProcess, ChildProcess)
    assert issubclass(node.NodeProcess, ChildProcess)
    assert helpers_node.MC_ENV.items() >= node.MOONCAKE_ENV.items()   # one Mooncake environment


def test_child_process_stop_thaws_a_frozen_child_in_its_own_group():
    """The union of the two drifted copies: the bench's SIGCONT before SIGTERM (a frozen child must be able
    to act on it), the tests' own process group, stop timing, stderr kept in a file."""
    from helpers_node import freeze

    from aiolayer.harness.child import ChildProcess

    child = ChildProcess([sys.executable, "-c", SLEEPER], name="sleeper").start()
    try:
        assert child.read_json(20, require="port") == {"port": 1}
        assert os.getpgid(child.pid) == child.pid
        freeze(child.pid, 10)   # frozen for real before stop() thaws it, not a signal still on its way
        assert child.stop(timeout=20) == 0   # a loaded box (a whole test run beside it) took over 5 s
        assert not child.killed and child.stop_s < 20
        assert "sleeper-stderr" in child.stderr_text()
    finally:
        child.close()


# A process whose second thread spins, and a child of it (same group) that spins too: a signal still on
# its way would find one of them running.
SPINNERS = ("import json, subprocess, sys, threading, time\n"
            "spin = 'import time\\nend = time.monotonic() + 60\\nwhile time.monotonic() < end: pass'\n"
            "kid = subprocess.Popen([sys.executable, '-c', spin])\n"
            "threading.Thread(target=exec, args=(spin,), daemon=True).start()\n"
            "print(json.dumps({'port': 1, 'kid': kid.pid}), flush=True)\n"
            "exec(spin)\n")


def test_freeze_group_returns_once_every_thread_of_the_group_is_stopped():
    from aiolayer.harness.child import ChildProcess
    from aiolayer.harness.procs import freeze_group

    child = ChildProcess([sys.executable, "-c", SPINNERS], name="spinners").start()
    try:
        kid = child.read_json(20, require="port")["kid"]
        assert os.getpgid(kid) == child.pid
        freeze_group(child.pid, 10)
        states = [_thread_states(pid) for pid in (child.pid, kid)]
        assert all(len(s) >= 1 for s in states) and len(states[0]) >= 2
        assert all(state in ("T", "t") for s in states for state in s), states
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.close()


def _thread_states(pid: int) -> list[str]:
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            states.append(f.read().rsplit(")", 1)[1].split()[0])
    return states


@pytest.mark.parametrize("keep", ["", "1"])
def test_harness_logs_are_removed_at_exit_unless_kept(keep, tmp_path):
    """Engine and proxy logs go to the temporary directory and would pile up there run after run."""
    made = ("from aiolayer.harness import scratch; d = scratch.log_dir('aiolayer-test-'); "
            "(d / 'e.log').write_text('x'); f = scratch.log_file(f'aiolayer-test-{d.name}.log'); f.write_text('x'); "
            "print(d, f)")
    env = {**os.environ, "TMPDIR": str(tmp_path), "AIOLAYER_KEEP_LOGS": keep}
    out = subprocess.run([sys.executable, "-c", made], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    paths = [Path(p) for p in out.stdout.split()]
    assert [p.parent for p in paths] == [tmp_path, tmp_path]
    assert [p.exists() for p in paths] == [bool(keep)] * 2


def test_a_server_trees_private_tmpdir_keeps_inductors_cache_where_torch_puts_it():
    """The harness computes torch's default without importing torch; a rule changed upstream shows here
    (every engine would otherwise compile from scratch under its private TMPDIR)."""
    torch_dirs = pytest.importorskip("torch._inductor.runtime.cache_dir_utils")
    from aiolayer.harness import scratch

    env = scratch.tree_env(Path("/nonexistent"))
    assert env["TORCHINDUCTOR_CACHE_DIR"] == os.environ.get("TORCHINDUCTOR_CACHE_DIR", torch_dirs.default_cache_dir())
    assert env["TMPDIR"] == "/nonexistent"


def test_a_server_that_cannot_be_spawned_leaves_no_open_log_or_tmpdir(tmp_path):
    """stop() never runs for a process that was never made: spawn itself lets go of what it made."""
    from aiolayer.harness.vllm_server import VllmServer

    class Missing(VllmServer):
        def command(self) -> list[str]:
            return [str(tmp_path / "no-such-server")]

    server = Missing(model=tmp_path, port=1, log_dir=tmp_path)
    with pytest.raises(FileNotFoundError):
        server.spawn()
    assert server.proc is None and server._log_file.closed
    assert server.tmp_dir is not None and not server.tmp_dir.exists()
    assert server.log_path.read_text().startswith("$ ")


def test_child_process_first_line_has_a_deadline_and_carries_stderr():
    from aiolayer.harness.child import ChildProcess, ChildStartError

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


# --- the runtime's layers ------------------------------------------------------------------------

RUNTIME_SIDES = ("send", "receive", "control")   # P's side, D's side, the control plane
# Each subpackage may import these of the others: P's side calls D over the control plane (DONEs,
# layout requests through ``ControlPeers``); D's side needs none (its fence asks P to stop through the
# ``StopSender`` the runtime binds); control/ sees both sides only through routing's Protocols.
RUNTIME_SIDE_MAY_IMPORT = {"send": {"control"}, "receive": set(), "control": set()}
# The shared top level imports no subpackage, except the facade that builds them all and the metrics
# that render every side's counters.
RUNTIME_FACADES = {"runtime.runtime", "runtime.metrics"}
MAX_MODULE_LINES = 400


def _runtime_part(module: str) -> str | None:
    """The subpackage of a runtime module ("send", ...), "" for the shared top level, None outside the runtime."""
    parts = module.split(".")
    if parts[0] != "runtime":
        return None
    return parts[1] if len(parts) > 2 and parts[1] in RUNTIME_SIDES else ""


def test_the_runtime_sides_import_each_other_only_as_the_layering_allows():
    modules = _module_names(CORE)
    assert {f"runtime.{side}" for side in RUNTIME_SIDES} <= set(modules), "the runtime's subpackages moved"
    refused = []
    for name, path in sorted(modules.items()):
        part = _runtime_part(name)
        if part is None or name in RUNTIME_FACADES:
            continue
        allowed = RUNTIME_SIDE_MAY_IMPORT[part] if part else set()
        for target in sorted(_imports(name, path, modules, "aiolayer")):
            other = _runtime_part(target)
            if other and other != part and other not in allowed:
                refused.append(f"{name} imports {target}")
    assert not refused, "the runtime's layers are crossed:\n  " + "\n  ".join(refused)


def test_runtime_modules_stay_small():
    big = {name: n for name, path in _module_names(CORE).items()
           if _runtime_part(name) is not None and (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, f"runtime modules over {MAX_MODULE_LINES} lines: {big}"


# --- what the vLLM bridge takes from aiolayer ----------------------------------------------------

CORE = BENCH.parent / "aiolayer"
BRIDGE = BENCH.parent / "bridges" / "vllm" / "aiolayer_vllm"
# Besides the names of ``aiolayer.__all__``, the bridge may import from these modules (a package
# covers its submodules); never from the runtime's internals (aiolayer.runtime.*, aiolayer.backends.*,
# node, kvcache, stats): what it needs of the runtime goes through ``aiolayer.__all__``.
BRIDGE_MAY_IMPORT = {
    "aiolayer.errors": "the exception tree, the same classes as aiolayer's exports",
    "aiolayer.config": "NodeConfig and Timeouts, and the defaults the bridge's settings fall back to",
    "aiolayer.transport": "Transport, and url_host for the proxy's own endpoints",
    "aiolayer.protocol": "the sans-I/O protocol: the proxy speaks the control messages (docs/protocol.md) "
                         "and the bridge plans its ranks' head slices (plan.map_ranks)",
    "aiolayer.faults": "the one sanctioned way to install the AIOLAYER_DEBUG_* test hooks",
    "aiolayer.cli": "Command, the contract of an ``aiolayer.commands`` entry point (``aiolayer proxy``)",
    "aiolayer.compat": "asyncio.timeout, with the backport on Python 3.10",
}


def _core_exports() -> set[str]:
    import aiolayer

    return set(aiolayer.__all__)


def _aiolayer_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every absolute import of aiolayer in ``path`` (name "" for ``import aiolayer.x``),
    inside functions and ``if TYPE_CHECKING:`` too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module \
                and node.module.split(".")[0] == "aiolayer":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name.split(".")[0] == "aiolayer"]
    return found


def test_the_core_never_imports_the_vllm_bridge():
    """The core is engine-agnostic: what a connector adds to it (its ``aiolayer`` subcommand, its config
    check in ``aiolayer doctor``) the connector registers through entry points; the core names none."""
    found = [f"{path.relative_to(CORE.parent)}: {name}" for path in sorted(CORE.rglob("*.py"))
             for name in _absolute_imports(path) if name.split(".")[0] == BRIDGE.name]
    assert not found, "the core imports the vLLM bridge:\n  " + "\n  ".join(found)


def _allowed_module(module: str) -> bool:
    return any(module == allowed or module.startswith(allowed + ".") for allowed in BRIDGE_MAY_IMPORT)


def test_the_vllm_bridge_imports_only_aiolayers_public_names_and_allowed_modules():
    exports, refused, used = _core_exports(), [], set()
    for path in sorted(BRIDGE.rglob("*.py")):
        for module, name in _aiolayer_imports(path):
            where = f"{path.relative_to(BRIDGE.parent)}: "
            if module == "aiolayer" and name in exports:
                continue
            # ``from aiolayer import compat`` imports the module aiolayer.compat
            target = f"aiolayer.{name}" if module == "aiolayer" else module
            if _allowed_module(target):
                used.update(m for m in BRIDGE_MAY_IMPORT if target == m or target.startswith(m + "."))
            else:
                refused.append(where + (f"from {module} import {name}" if name else f"import {module}"))
    assert not refused, ("the bridge reaches past aiolayer's public names (export what it needs, or allow "
                         "the module in BRIDGE_MAY_IMPORT with a reason):\n  " + "\n  ".join(refused))
    assert used == set(BRIDGE_MAY_IMPORT), f"allowed but no longer imported: {sorted(set(BRIDGE_MAY_IMPORT) - used)}"


def test_type_checkers_see_every_public_name_lazy_imports_load():
    """``aiolayer`` loads its names on first use (``__getattr__``); its ``if TYPE_CHECKING:`` block must
    name the same ones from the same modules, so that mypy and IDEs see what a user gets."""
    import importlib

    import aiolayer

    tree = ast.parse((CORE / "__init__.py").read_text())
    seen = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.level == 1, ast.dump(imp)
                for alias in imp.names:
                    assert alias.asname == alias.name, f"{alias.name}: re-exported as ``X as X``"
                    seen[alias.name] = f"aiolayer.{imp.module}"
    assert seen == aiolayer._EXPORTS
    assert set(aiolayer.__all__) == {*seen, "__version__"}
    for name, module in seen.items():
        assert getattr(aiolayer, name) is getattr(importlib.import_module(module), name), name
