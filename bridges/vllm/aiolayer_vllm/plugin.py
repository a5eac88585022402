"""The ``vllm.general_plugins`` entry point: registers ``AiolayerConnector`` in every vLLM process.

vLLM loads general plugins in the front end, the engine core and every worker; registering twice
in one process raises ValueError in vLLM, so the call is guarded.
"""

from __future__ import annotations

from . import CONNECTOR_NAME


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:  # noqa: SLF001 - the factory has no public query
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, "aiolayer_vllm.connector", CONNECTOR_NAME)
