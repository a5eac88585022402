"""The engine harness under one import (``from aiolayer.harness.servers import VllmServer, completion``):
process supervision (``procs``), the vLLM server (``vllm_server``, started by ``startup``) and the client
(``client``), re-exported."""

from __future__ import annotations

from .client import (DEFAULT_REQUEST_TIMEOUT_S, KV_USAGE_GAUGE, Completion, Metrics, acompletion,  # noqa: F401
                     completion, completion_body, kv_cache_usage, metric_value, parse_metrics, scrape_metrics,
                     unconfirmed_releases, wait_for_metric)
from .procs import ServerError, die_with_parent, free_port  # noqa: F401
from .startup import running  # noqa: F401
from .vllm_server import (BASE_ENV, DEFAULT_STARTUP_TIMEOUT_S, DEFAULT_STOP_TIMEOUT_S, VllmServer,  # noqa: F401
                          wait_started)
