"""aiolayer's vLLM bridge: the ``AiolayerConnector`` KV connector and its plugin registration."""

__version__ = "0.1.0"
CONNECTOR_NAME = "AiolayerConnector"
