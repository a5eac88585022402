"""The ``vllm.general_plugins`` entry point: registers ``AiolayerConnector`` in every vLLM process, and
has the connector's settings checked where vLLM first resolves the connector from its config.

vLLM loads general plugins in the front end, the engine core and every worker; registering twice
in one process raises ValueError in vLLM, so each step is guarded.

Why the check hooks the factory: vLLM builds the connector only after the model has loaded (~40 s
into a start), and no connector method it calls earlier sees ``kv_connector_extra_config`` on every
platform (``requires_piecewise_for_cudagraph`` runs only where CUDA graphs exist). vLLM does resolve
the connector class from the transfer config while it builds the engine config, in the API server
before any engine process starts (``VllmConfig.__post_init__`` asks whether the connector supports
the hybrid allocator), so a misspelt key stops ``vllm serve`` there, with the key named.
"""

from __future__ import annotations

from . import CONNECTOR_NAME

_CHECKS = "_aiolayer_checks_config"   # marks the wrapped resolver: wrap once per process


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:  # noqa: SLF001 - the factory has no public query
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "aiolayer_vllm.connector", CONNECTOR_NAME)
    check_config_on_resolve(KVConnectorFactory)


def check_config_on_resolve(factory) -> None:
    """Wrap ``factory.get_connector_class`` so that resolving AiolayerConnector from a transfer config
    validates its ``kv_connector_extra_config`` (``ConfigError`` naming the key)."""
    resolve = getattr(factory, "get_connector_class", None)
    if resolve is None or getattr(resolve, _CHECKS, False):
        return   # a vLLM without it: the connector's constructor still refuses a bad config

    def get_connector_class(cls, kv_transfer_config):
        connector_cls = resolve(kv_transfer_config)
        if getattr(kv_transfer_config, "kv_connector", None) == CONNECTOR_NAME:
            from .config import check_extra_config

            check_extra_config(kv_transfer_config.kv_connector_extra_config, kv_transfer_config)
        return connector_cls

    setattr(get_connector_class, _CHECKS, True)
    factory.get_connector_class = classmethod(get_connector_class)
