"""The end-to-end harness (a tiny offline model, real vLLM OpenAI servers on 127.0.0.1, the proxy as a
process, a completion client) lives in ``aiolayer.bench.engines``, because ``aiolayer bench vllm``
drives the same servers. ``e2e.<module>`` stays its name in tests: each is the bench's module
itself (one object, so a fixture and the bench share its state), not a copy.

Import from test files as ``from e2e.servers import VllmServer`` (tests/ is on sys.path through
``pythonpath`` in pyproject.toml, like ``helpers_node``).
"""

import importlib
import sys

for _name in ("procs", "vllm_server", "tiny_model", "client", "pd", "servers"):
    globals()[_name] = sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"aiolayer.bench.engines.{_name}")
