"""The settings of the shared tiny P/D pair (tests/vllm_bridge/one_pair) and of the engines its modules add."""

from __future__ import annotations

from helpers_node import MC_ENV


def pair_connector(role: str, engine_id: str, port: int, policy: str = "fail", **extra) -> dict:
    """The pair's ``--kv-transfer-config``: deadlines short enough for the failure tests to end quickly."""
    return {"kv_connector": "AiolayerConnector", "kv_role": role, "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"engine_id": engine_id, "control_port": port,
                                          "timeouts": {"receive": 20.0, "fence_grace": 8.0}, **extra}}


def pair_settings(**env: str) -> dict:
    """The engines' settings, pinned against vLLM's defaults (the matrix, tests/vllm_bridge/test_vllm_matrix.py,
    covers those): float32, block size 32, 512 tokens, eager (no ~40 s torch.compile per start), prefix
    caching off; the kernel places the threads (vLLM's default binding pins every server to core 0, where
    their busy loops starve each other's sockets on 2 cores); logs at debug (the stage timeline reads them)."""
    return {"env": MC_ENV | {"AIOLAYER_LOG_LEVEL": "DEBUG"} | env, "prefix_caching": False, "omp_bind": "nobind",
            "dtype": "float32", "block_size": 32, "max_model_len": 512, "enforce_eager": True}
