"""A small engine that is not vLLM embedding aiolayer: prefill on P (a Hugging Face transformers model
whose forward hooks hand each layer's KV to aiolayer), decode on D from the received paged KV.
Run it with ``python -m examples.hf_engine``; examples/README.md walks through it.
"""
