"""The transfer benchmark: ``run`` (options, the run), ``measure`` (one set-up, every mode), ``harness``
(P, D and each mode's request), ``forward`` (the simulated prefill), ``threaded`` (the baseline design),
``raw``/``tcp_sink`` (the physical limits), ``sweep``, ``report``, ``plots``, ``cpus``."""
