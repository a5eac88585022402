"""Real engines for ``aiolayer bench vllm`` and for the end-to-end tests: a tiny offline model,
vLLM OpenAI servers with bounded start and stop, ``aiolayer proxy`` as a process, a completion client
that measures time to first token. Imported only when a real engine runs (it needs vLLM, httpx,
transformers)."""
