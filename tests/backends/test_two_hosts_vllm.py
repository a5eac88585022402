"""Real vLLM P and D on two "hosts" (network namespaces joined by one veth pair), with ``aiolayer proxy``
beside P: requests through the proxy give the tokens P gives on its own (the aggregated engine).

Each namespace also has a management link to the test (the way a client reaches the proxy and a test
reaches /health); neither has a route to the other's, so P, D and the proxy meet only on their own
link, and a 127.0.0.1 leaked into any advertised address dials the wrong namespace and fails.
"""

from __future__ import annotations

import pytest

from aiolayer.harness import netns

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from aiolayer.harness.pd import ProxyProcess
from aiolayer.harness.servers import VllmServer, completion, running
from aiolayer.harness.tiny_model import SAMPLE_PROMPTS, long_prompt, tiny_model_dir
from helpers_node import MC_ENV

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm,
              pytest.mark.skipif(bool(netns.available()), reason=netns.available() or "available")]
HTTP_PORT, CONTROL_PORT, PROXY_PORT = 8100, 5600, 8000   # each namespace has its own port space
MAX_TOKENS = 8


def _engine(hosts: netns.Hosts, host: netns.Host, role: str, model, core: str) -> VllmServer:
    config = {"kv_connector": "AiolayerConnector", "kv_role": role, "kv_load_failure_policy": "fail",
              "kv_connector_extra_config": {
                  "engine_id": f"{role}-{host.ns}", "control_port": CONTROL_PORT,
                  "transport": {"bind_host": host.address},            # the cross-host address, not loopback
                  "timeouts": {"receive": 60.0, "fence_grace": 10.0}}}
    # vLLM's defaults but two: eager (torch.compile would add ~40 s per engine; the matrix covers it), and
    # each engine's threads on a core of its own, as on two machines (vLLM's default binds both to core 0,
    # where D's engine, spinning while a request is parked, starves P's worker: docs/vllm.md, "A parked D's CPU")
    return VllmServer(model, name=f"{role}-ns", netns=host.ns, host=host.mgmt, bind_host="0.0.0.0",
                      port=HTTP_PORT, kv_transfer_config=config, enforce_eager=True, omp_bind=core,
                      env=MC_ENV | {"VLLM_HOST_IP": host.address})


def test_vllm_pair_and_proxy_across_two_hosts_equal_the_aggregated_engine():
    model = tiny_model_dir()
    with netns.two_hosts(management=True) as hosts:
        a, b = hosts.a, hosts.b
        p, d = _engine(hosts, a, "kv_producer", model, "0"), _engine(hosts, b, "kv_consumer", model, "1")
        with running(p, d):
            proxy = ProxyProcess(
                [f"http://{a.address}:{HTTP_PORT},tcp://{a.address}:{CONTROL_PORT}"],
                [f"http://{b.address}:{HTTP_PORT},tcp://{b.address}:{CONTROL_PORT}"],
                netns=a.ns, reach=a.mgmt, port=PROXY_PORT, startup_timeout_s=60,
                extra_args=("--host", "0.0.0.0", "--public-url", f"http://{a.address}:{PROXY_PORT}",
                            "--registration-timeout", "60", "--prefill-timeout", "60")).start()
            try:
                prompts = [*SAMPLE_PROMPTS[:2], long_prompt(150, seed=3)]   # one spans two 128-token blocks
                for prompt in prompts:
                    alone = completion(p, prompt, max_tokens=MAX_TOKENS).token_ids
                    proxied = completion(proxy.url, prompt, max_tokens=MAX_TOKENS, model=p.served_model,
                                         timeout_s=120).token_ids
                    assert proxied == alone, (prompt[:40], proxied, alone)
            finally:
                proxy.stop()
