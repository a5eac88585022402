"""D's registration POSTed to ``aiolayer proxy`` (a real process, real HTTP): what the route accepts.

The body is ``aiolayer_vllm.params.DecodeRegistration`` (the runtime's ``Registration`` as one field,
with D's rank): one that does not fit it is a 400 naming what is wrong; one for a transfer the proxy is
not running a 404; one without the transfer's token a 403; one that disagrees with D's other ranks a
409. The decode engine here (``helpers_proxy.FakeEngine``) registers nothing itself: the test POSTs
each registration as D's ranks would, and P is called once both ranks registered.
"""

from __future__ import annotations

import concurrent.futures

import pytest

pytest.importorskip("fastapi")

import httpx

from aiolayer.harness.pd import ProxyProcess
from helpers_proxy import proxied_pair, registration, wait_for

pytestmark = pytest.mark.timeout(90)
TOKEN = "w" * 32


@pytest.fixture(scope="module")
def stack():
    with proxied_pair("--health-interval", "0.2", "--registration-timeout", "20") as stack:
        yield stack


def _register(proxy: ProxyProcess, body) -> httpx.Response:
    return httpx.post(proxy.url + "/internal/aiolayer/registered", json=body, timeout=5, trust_env=False)


def _refused(r: httpx.Response, status: int, kind: str, says: str = "") -> None:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["type"] == kind and says in error["message"], error


def test_a_registration_that_does_not_fit_the_contract_is_a_400_naming_the_fault(stack):
    proxy = stack["proxy"]
    good = registration("t-unknown", TOKEN, "inc", "tcp://127.0.0.1:1")
    for body, says in [
        ({k: v for k, v in good.items() if k != "rank"}, "missing required field `rank`"),
        ({k: v for k, v in good.items() if k != "registration"}, "missing required field `registration`"),
        ({**good, "registration": {k: v for k, v in good["registration"].items() if k != "incarnation"}},
         "missing required field `incarnation`"),
        ({**good, "extra": 1}, "unknown field `extra`"),
        ({**good, "block_ids": [1]}, "unknown field `block_ids`"),   # the flat shape: not the contract
        ({**good, "rank": "0"}, "Expected `int`, got `str` - at `$.rank`"),
        ({**good, "rank": True}, "Expected `int`, got `bool`"),
        ({**good, "registration": {**good["registration"], "block_ids": ["3"]}}, "at `$.registration.block_ids[0]`"),
        ({**good, "registration": {**good["registration"], "decode_control": "http://d:1"}}, "tcp://host:port"),
        ({**good, "rank": 1}, "rank 1 of 1"),
        ([good], "Expected `object`, got `array`"),
    ]:
        _refused(_register(proxy, body), 400, "invalid_registration", says)
    _refused(_register(proxy, good), 404, "unknown_transfer", "t-unknown")   # it fits: the transfer is unknown


def test_only_the_transfers_d_may_register_and_its_ranks_must_agree(stack):
    proxy, d = stack["proxy"], stack["d"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, proxy.url + "/v1/completions", timeout=60, trust_env=False,
                             json={"prompt": "x", "fake": {"register": False}})
        sent = wait_for(lambda: next((b for b in d.requests if b.get("fake") == {"register": False}), None), 20,
                        "the proxy asked D")
        params = sent["kv_transfer_params"]["aiolayer"]
        tid, token = params["transfer_id"], params["token"]

        def rank(r: int, **kw) -> dict:
            return registration(tid, kw.pop("token", token), f"inc{r}", f"{d.control}", rank=r, ranks=2, **kw)

        _refused(_register(proxy, rank(0, token="x" * 32)), 403, "auth", tid)
        assert _register(proxy, rank(0)).status_code == 202
        _refused(_register(proxy, rank(1, blocks=(9,))), 409, "invalid_registration", "other ranks, blocks")
        assert not answer.done()                    # P waits for every rank
        assert _register(proxy, rank(1)).status_code == 202
        reply = answer.result(timeout=60)
    assert reply.status_code == 200, reply.text
    to_p = stack["p"].requests[-1]["kv_transfer_params"]["aiolayer"]
    assert to_p["transfer_id"] == tid and to_p["dst_blocks"] == [3, 4]
    assert [r["dst_incarnation"] for r in to_p["decode_ranks"]] == ["inc0", "inc1"]
