"""``aiolayer bench vllm``: aggregated vs aiolayer vs vLLM's own connectors on real vLLM CPU engines,
started through ``aiolayer.harness`` (the end-to-end tests' servers, model and proxy). Imported only when
a real engine runs (it needs vLLM, httpx, transformers)."""
