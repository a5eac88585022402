"""Reusable end-to-end harness: a tiny offline model and real vLLM OpenAI servers on 127.0.0.1.

Import from test files as ``from e2e.servers import VllmServer`` (tests/ is on sys.path through
pytest's rootdir-based "prepend" import mode, like ``helpers_node``).
"""
