"""Fault injection for tests, benchmarks and an engine's test-only switches: the runtime's hooks.

Not part of the embedding API (``aiolayer.__all__``): a production embedder never needs it. It is
the one sanctioned way for code outside the core (the vLLM bridge's ``AIOLAYER_DEBUG_*`` switches,
the benchmark's fault scenarios) to give a runtime that is not started yet an inbound filter.
"""

from __future__ import annotations

from .runtime.control.hooks import Hooks, install_hooks

__all__ = ["Hooks", "install_hooks"]
