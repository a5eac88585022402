"""vLLM's ``NixlConnector`` with NIXL's progress thread off (``kv_connector_module_path`` of the bench's
nixl row). The class is vLLM's, unmodified; only the agent's config changes: with the UCX progress
thread on, each idle engine spins a core, which on a 2-core host starves the other engine. On a host
with AMX the process asks for its AMX tile state first, as ``shim_mooncake`` says why.
"""

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

if torch.cpu._is_amx_tile_supported():  # noqa: SLF001 - torch's own query, no public one
    torch.cpu._init_amx()  # noqa: SLF001

_agent_config = base_worker.nixl_agent_config


def _without_progress_thread(*args, **kwargs):
    return _agent_config(*args, enable_prog_thread=False, **kwargs)


if _agent_config is not None:
    base_worker.nixl_agent_config = _without_progress_thread

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector  # noqa: E402

__all__ = ["NixlConnector"]
