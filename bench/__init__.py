"""The benchmark, installed as ``aiolayer.bench`` (``aiolayer bench``): ``perf/`` measures the transfer
modes side by side, ``scenarios/`` runs faults, scale and soak; ``child``/``node`` start the child
processes both use (and the tests, through tests/helpers_node.py)."""
