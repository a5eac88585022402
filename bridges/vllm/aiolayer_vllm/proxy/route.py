"""Whether D prefills a short request itself (no transfer) or P prefills it and sends the KV: chosen per
request from the time to first token the proxy measured each way at the prompt's size.

For a short prompt the transfer's fixed cost (P's extra hop, the control round trips, D's wait for the
KV) can exceed the prefill it saves D. ``--local-prefill-max-tokens`` caps what D may be given to prefill
(0, the default: never), since every token D prefills delays the decodes it is running; under that cap
the proxy keeps moving estimates of the first token's time per route and size class (prompts of up to
2^k tokens share one) and sends each request the way predicted faster. A route not yet measured at a
size is tried first (remote, then local); every 16th request of a size takes the route predicted to
lose (every 128th when it is predicted to lose by more than 20%), so the estimates follow D's load and
the link. A request that names its transfer mode always goes to P. The prompt's size is its token ids'
count, or for text its UTF-8 bytes over the bytes per token P's answers reported (``usage``). A request
under the cap goes to D alone also while no P is healthy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import msgspec

Route = Literal["remote", "local"]
REMEASURE_EVERY = 16          # a size's n-th request takes the route predicted to lose
REMEASURE_FAR_EVERY = 128     # ... when it is predicted to lose by more than FAR
FAR = 1.2
NEW_WEIGHT = 0.5              # the newest sample's weight in an estimate
START_BYTES_PER_TOKEN = 4.0   # English text, until P's answers told us


def prompt_text_bytes(body: dict) -> int | None:
    """The UTF-8 size of a request's prompt text (completions' ``prompt``, chat's messages), or None for
    a prompt given otherwise."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt.encode())
    messages = body.get("messages")
    if prompt is None and isinstance(messages, list):
        size = 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            parts = [content] if isinstance(content, str) else content if isinstance(content, list) else []
            for part in parts:
                text = part if isinstance(part, str) else part.get("text") if isinstance(part, dict) else None
                if not isinstance(text, str):
                    return None   # an image or other part: its tokens are not its text
                size += len(text.encode())
        return size
    return None


def prompt_token_ids(body: dict) -> int | None:
    """The count of a completions prompt given as token ids, or None."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return len(prompt)
    return None


def size_class(tokens: int) -> int:
    """Prompts of up to 2^k tokens share class k."""
    return max(0, math.ceil(math.log2(max(1, tokens))))


@dataclass
class RouteChooser:
    """The per-request choice and the estimates it is made from (the proxy's event loop only)."""

    local_max_tokens: int = 0                       # 0: every request goes to P
    bytes_per_token: dict[str, float] = field(default_factory=dict)   # per OpenAI path, from P's usage
    ttft_s: dict[tuple[Route, int], float] = field(default_factory=dict)
    seen: dict[int, int] = field(default_factory=dict)

    def prompt_size(self, path: str, body: dict) -> tuple[int | None, int | None]:
        """A prompt's (tokens, UTF-8 text bytes), each None where unknown: tokens are the ids' count or the
        text over this path's bytes per token. Nothing is measured while the option is off."""
        if self.local_max_tokens <= 0:
            return None, None
        ids = prompt_token_ids(body)
        if ids is not None:
            return ids, None
        size = prompt_text_bytes(body)
        if size is None:
            return None, None
        return math.ceil(size / self.bytes_per_token.get(path, START_BYTES_PER_TOKEN)), size

    def may_go_local(self, tokens: int | None, named_mode: bool) -> bool:
        """D may prefill this request itself: the option is on, it names no mode and is under the cap."""
        return self.local_max_tokens > 0 and not named_mode and tokens is not None and tokens <= self.local_max_tokens

    def choose(self, tokens: int | None, named_mode: bool, stream: bool) -> tuple[Route, int | None]:
        """The route for one request of ``tokens`` (``prompt_size``) and its size class (None: nothing to
        learn from it). Only a stream shows its first token's time; any other request takes the route
        predicted faster, or P's."""
        if tokens is None or not self.may_go_local(tokens, named_mode):
            return "remote", None
        k = size_class(tokens)
        remote, local = self.ttft_s.get(("remote", k)), self.ttft_s.get(("local", k))
        if not stream:
            return ("local" if remote is not None and local is not None and local < remote else "remote"), None
        n = self.seen[k] = self.seen.get(k, 0) + 1
        if remote is None:
            return "remote", k
        if local is None:
            return "local", k
        faster: Route = "local" if local < remote else "remote"
        slower: Route = "remote" if faster == "local" else "local"
        far = max(local, remote) > FAR * min(local, remote)
        every = REMEASURE_FAR_EVERY if far else REMEASURE_EVERY
        return (slower if n % every == 0 else faster), k

    def learn_ttft(self, route: Route, k: int, seconds: float) -> None:
        old = self.ttft_s.get((route, k))
        self.ttft_s[(route, k)] = seconds if old is None else old + NEW_WEIGHT * (seconds - old)

    def learn_usage(self, path: str, text_bytes: int | None, answer: bytes) -> None:
        """P's answer says how many tokens the prompt of ``text_bytes`` (``prompt_size``) was: the bytes
        per token of this path's text."""
        if not text_bytes:
            return
        try:
            usage = msgspec.json.decode(answer).get("usage")
        except (msgspec.DecodeError, AttributeError):
            return
        tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
            return
        sample, old = text_bytes / tokens, self.bytes_per_token.get(path)
        self.bytes_per_token[path] = sample if old is None else old + NEW_WEIGHT * (sample - old)
