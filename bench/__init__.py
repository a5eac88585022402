"""The benchmark, installed as ``aiolayer.bench`` (``aiolayer bench``): ``perf/`` measures the transfer
modes side by side, ``scenarios/`` runs faults, scale and soak, ``engines/`` compares real vLLM engines. The child
processes, nodes and vLLM servers they start are ``aiolayer.harness``'s, shared with the tests."""
