"""One tiny P/D pair (vLLM CPU engines with AiolayerConnector) and ``aiolayer proxy``, shared by every
module in this folder: an engine start is ~40 s of the suite's time on 2 cores, and these modules need
the same two engines (the harness checks, the proxy end to end, the stage timeline, the parked D).

The pair starts with the first test that asks for it and stops when the run leaves this folder. Tests
marked ``ends_pair`` (they kill P or stop D) run after all the others here, in file order.
"""

from __future__ import annotations

import contextlib

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from aiolayer.harness.pd import ProxyProcess, backend
from aiolayer.harness.procs import free_ports
from aiolayer.harness.servers import VllmServer, free_port, running
from aiolayer.harness.tiny_model import tiny_model_dir
from helpers_pair import pair_connector, pair_settings

HERE = __file__.rsplit("/", 1)[0]
_OPEN: list[contextlib.ExitStack] = []


def pytest_configure(config):
    config.addinivalue_line("markers", "ends_pair: kills or stops the shared P/D pair; runs last in its folder")


def pytest_collection_modifyitems(config, items):
    mine = [i for i in items if str(i.path).startswith(HERE + "/")]
    if not mine:
        return
    first = items.index(mine[0])
    ordered = [i for i in mine if not i.get_closest_marker("ends_pair")] + \
        [i for i in mine if i.get_closest_marker("ends_pair")]
    rest = [i for i in items if i not in set(mine)]
    items[:] = rest[:first] + ordered + rest[first:]


@pytest.hookimpl(trylast=True)   # after pytest's own teardown of the item's narrower fixtures
def pytest_runtest_teardown(item, nextitem):
    # leaving the folder: stop the pair now, not at the end of the session (idle engines hold ~2 GiB)
    if _OPEN and (nextitem is None or not str(nextitem.path).startswith(HERE + "/")):
        _OPEN.pop().close()


@pytest.fixture(scope="session")
def stack():
    """P and D at ``pair_settings()``, and a proxy that checks health every 0.5 s. P checks every layer of
    every transfer end to end (integrity_sample 1.0): D verifies vLLM's real cache layout against P's
    CRCs before it reports the KV, so every answer in this folder passed that check. P chooses each
    send's mode (``transfer_mode`` auto), so the folder's requests go both layer-wise and in bulk."""
    model = tiny_model_dir()
    p_ctl, d_ctl = free_port(), free_ports(2)   # D's next port free: the proxy's auto binding sees one DP rank
    p = VllmServer(model, name="prefill", **pair_settings(),
                   kv_transfer_config=pair_connector("kv_producer", "p", p_ctl, integrity_sample=1.0,
                                                                     transfer_mode="auto"))
    d = VllmServer(model, name="decode", kv_transfer_config=pair_connector("kv_consumer", "d", d_ctl),
                   **pair_settings())
    with contextlib.ExitStack() as resources:
        _OPEN.append(resources)
        resources.enter_context(running(p, d))
        proxy = ProxyProcess([backend(p, p_ctl)], [backend(d, d_ctl)], healthy=(200, 503), extra_args=(
            "--health-interval", "0.5", "--prefill-timeout", "20", "--registration-timeout", "20",
            "--request-timeout", "60")).start()
        resources.callback(proxy.stop)
        yield {"p": p, "d": d, "proxy": proxy, "p_ctl": f"tcp://127.0.0.1:{p_ctl}",
               "d_ctl": f"tcp://127.0.0.1:{d_ctl}", "d_ctl_port": d_ctl}
        if _OPEN and _OPEN[-1] is resources:
            _OPEN.pop()
