"""Real vLLM P and D behind ``aiolayer proxy``, as the model-family modules check them: the bytes each
side reports moving, greedy answers with their logprobs, the layout the worker logged."""

from __future__ import annotations

import re
import time

from aiolayer.harness.pd import ProxyProcess
from aiolayer.harness.servers import VllmServer, completion, scrape_metrics


def backend(server: VllmServer, control_port: int) -> str:
    """The proxy's ``URL,CONTROL`` for a server on 127.0.0.1."""
    return f"{server.base_url},tcp://127.0.0.1:{control_port}"


def total(server: VllmServer, name: str) -> float:
    """A metric's samples summed over their labels (0 when there are none)."""
    return sum(v for _, v in scrape_metrics(server).get(name, []))


def moved(p: VllmServer, d: VllmServer) -> tuple[float, float]:
    """(bytes P sent, bytes D received) so far."""
    return total(p, "vllm:aiolayer_bytes_sent_total"), total(d, "vllm:aiolayer_bytes_received_total")


def answer(target, prompt: str, max_tokens: int, model: str | None = None) -> tuple[list[int], list[float], int]:
    """Greedy tokens, the chosen tokens' logprobs, and the prompt's token count."""
    out = completion(target, prompt, max_tokens=max_tokens, model=model, timeout_s=240, logprobs=1)
    return out.token_ids, list(out.raw["choices"][0]["logprobs"]["token_logprobs"]), len(out.prompt_token_ids or ())


def logged_layout(server: VllmServer) -> tuple[int, int]:
    """(runtime layers, bytes of one block of one of them), from the layout the worker logged."""
    found = re.search(r"aiolayer \S+: (\d+) layers, \d+ blocks of (\d+) bytes", server.log_text())
    assert found, ("no layout logged", server.log_tail(3000))
    return int(found.group(1)), int(found.group(2))


def settled(p: VllmServer, d: VllmServer, sent0: float, got0: float, wait_s: float = 10.0) -> tuple[float, float]:
    """(sent, received) bytes since the given totals, once both engines reported them (each reports
    its counters after a step, so the last one can come a moment after the answer)."""
    deadline = time.monotonic() + wait_s
    while True:
        sent, got = (now - before for now, before in zip(moved(p, d), (sent0, got0)))
        if (sent == got and sent > 0) or time.monotonic() > deadline:
            return sent, got
        time.sleep(0.2)


def through_proxy(p: VllmServer, p_port: int, d: VllmServer, d_port: int, prompts: list[str], max_tokens: int,
                  proxy_args: tuple[str, ...]) -> tuple[dict, dict]:
    """Each prompt through a proxy from P to D: prompt -> answer, and prompt -> (sent, received) bytes."""
    answers, bytes_moved = {}, {}
    with ProxyProcess([backend(p, p_port)], [backend(d, d_port)], extra_args=proxy_args) as proxy:
        for prompt in prompts:
            sent0, got0 = moved(p, d)
            answers[prompt] = answer(proxy.url, prompt, max_tokens, model=p.served_model)
            bytes_moved[prompt] = settled(p, d, sent0, got0)
    return answers, bytes_moved
