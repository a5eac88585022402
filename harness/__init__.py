"""The test harness, installed as ``aiolayer.harness``: child processes with deadlines (``child``), decode
nodes (``node``), two hosts in network namespaces (``netns``), and real vLLM servers on a tiny offline model
with ``aiolayer proxy`` in front (``procs``, ``vllm_server``, ``startup``, ``tiny_model``, ``client``,
``pd``, ``servers``). The tests and ``aiolayer bench`` both drive it. It ships in the core wheel for
``aiolayer bench``, but its vLLM half needs the ``bench`` or ``test`` extras (and vLLM itself)."""
