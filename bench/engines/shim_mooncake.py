"""vLLM's ``MooncakeConnector`` on a CPU host (``kv_connector_module_path`` of the bench's mooncake row).

The class is vLLM's, unmodified. Its worker asks ``torch.accelerator.current_device_index()`` at start,
which raises on a host without an accelerator; here it answers 0 (the device index a CPU engine has).
On a host with AMX the process asks for its AMX tile state first, as AiolayerConnector's worker does:
vLLM CPU's AMX kernels do not, and D's first step (one token) dies with SIGILL without it (docs/vllm.md).
"""

import torch

if torch.accelerator.current_accelerator() is None:
    torch.accelerator.current_device_index = lambda: 0
if torch.cpu._is_amx_tile_supported():  # noqa: SLF001 - torch's own query, no public one
    torch.cpu._init_amx()  # noqa: SLF001

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import MooncakeConnector

__all__ = ["MooncakeConnector"]
