"""A send's mode chosen per request from what earlier sends measured: layer-wise or bulk (no I/O).

Layer-wise writes each layer as the forward hands it over, so the wire runs behind the compute; bulk
holds every layer and writes them together after the last, so nothing of the transfer runs beside the
forward. Which finishes first depends on the link to that D, on how long this step computes, and on
what the per-layer writes cost the forward where they share its cores (a CPU host): all three are
measured here from finished sends, none is a fixed threshold. docs/modes.md has the model and its limits.

Per finished send the engine reports a ``SendMeasure``: the forward's window (first layer handed to
the last), the tail (last layer handed to DONE), the time its writes were in flight and the bytes.
Moving estimates (``WEIGHT`` for the newest sample) keep, per destination, the link's rate (bytes /
time in flight); per mode and step size (a power of two of the step's tokens), the forward's time per
token of the step; per mode, the fixed tail beyond the wire. A request of ``n`` tokens whose KV is
``B`` bytes, in a step of ``s`` tokens, with ``w = B / rate`` and ``L`` layers, is predicted to take

    bulk:        window_bulk(s) + w + fixed_bulk
    layer-wise:  window_lw(s) + max(w - window_lw(s), w / L) + fixed_lw

(layer-wise: the last layer's write after the forward, or whatever of the wire the forward could not
hide). A mode not yet measured at a step size is tried first (layer-wise, then bulk), and every
``explore_every``-th request of a step size takes the mode predicted to lose (``FAR_EXPLORE`` times as
rarely when it is predicted to lose by more than ``CLOSE``), so that both estimates follow a link or a
load that changes.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

LAYERWISE, BULK = "layerwise", "bulk"
MODES = (LAYERWISE, BULK, "auto")   # what a deployment configures: a fixed mode, or chosen per request
WEIGHT = 0.5                        # of the newest sample in every moving estimate
EXPLORE_EVERY = 16     # requests of a step size between re-measures of the mode predicted to lose ...
CLOSE = 1.2            # ... while its prediction is within this factor of the winner's, else
FAR_EXPLORE = 8        # ... this many times as rarely


class LayerTimes(Protocol):
    handed_s: float
    submitted_s: float
    landed_s: float


@dataclass(frozen=True)
class SendMeasure:
    """What one finished send measured, with what it was chosen for."""

    mode: str            # LAYERWISE or BULK
    step_tokens: int     # tokens the forward computed in the send's step (every request of it)
    prompt_tokens: int
    dest: str            # the destination's key (D's control endpoint)
    window_s: float      # the forward: first layer handed -> last layer handed
    tail_s: float        # last layer handed -> DONE acknowledged
    busy_s: float        # time at least one of its writes was in flight
    nbytes: int
    layers: int


def measured(layers: Iterable[LayerTimes], finished_s: float) -> tuple[float, float, float, int]:
    """(window_s, tail_s, busy_s, layers) of a finished send from its per-layer times."""
    times = list(layers)
    spans = sorted((t.submitted_s, t.landed_s) for t in times)
    handed = [t.handed_s for t in times]
    if not spans:
        return 0.0, 0.0, 0.0, 0
    busy, start, end = 0.0, spans[0][0], spans[0][1]
    for s, e in spans[1:]:   # the union of the writes' intervals: each second of the wire counted once
        if s > end:
            busy += end - start
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    return max(handed) - min(handed), max(0.0, finished_s - max(handed)), busy, len(spans)


def step_bucket(step_tokens: int) -> int:
    """Step sizes within a factor of two share a time-per-token estimate (attention grows with size)."""
    return max(0, step_tokens - 1).bit_length()


@dataclass(frozen=True)
class Choice:
    mode: str
    why: str
    predicted_s: dict[str, float] = field(default_factory=dict)   # empty while a mode is unmeasured


def _blend(old: float | None, new: float) -> float:
    return new if old is None else old + WEIGHT * (new - old)


class ModeChooser:
    """Per engine: ``choose`` before each send, ``observe`` each finished one (one thread: the scheduler's)."""

    def __init__(self, explore_every: int = EXPLORE_EVERY) -> None:
        if explore_every < 2:
            raise ValueError(f"explore_every must be >= 2, got {explore_every}")
        self.explore_every = explore_every
        self._rate: dict[str, float] = {}            # dest -> bytes/s; "" = any destination
        self._bytes_per_token: float | None = None
        self._per_token: dict[tuple[str, int], float] = {}   # (mode, step bucket) -> forward s per step token
        self._fixed: dict[str, float] = {}           # mode -> tail beyond the modeled wire, s
        self._layers = 0
        self._asked: collections.Counter[int] = collections.Counter()

    def choose(self, *, step_tokens: int, prompt_tokens: int, dest: str) -> Choice:
        bucket = step_bucket(step_tokens)
        for mode in (LAYERWISE, BULK):
            if (mode, bucket) not in self._per_token:
                return Choice(mode, f"not yet measured at steps of ~{1 << bucket} tokens")
        rate = self._rate.get(dest) or self._rate.get("")
        if rate is None or self._bytes_per_token is None:
            return Choice(LAYERWISE, "no rate measured yet")
        wire = self._bytes_per_token * prompt_tokens / rate
        lw_window = self._per_token[LAYERWISE, bucket] * step_tokens
        bulk_window = self._per_token[BULK, bucket] * step_tokens
        predicted = {
            LAYERWISE: lw_window + max(wire - lw_window, wire / max(1, self._layers)) + self._fixed.get(LAYERWISE, 0.0),
            BULK: bulk_window + wire + self._fixed.get(BULK, 0.0)}
        best = LAYERWISE if predicted[LAYERWISE] <= predicted[BULK] else BULK
        other = BULK if best == LAYERWISE else LAYERWISE
        self._asked[bucket] += 1
        # a loser by far is re-measured rarely: each re-measure costs its request that much
        every = self.explore_every * (1 if predicted[other] <= CLOSE * predicted[best] else FAR_EXPLORE)
        if self._asked[bucket] % every == 0:
            return Choice(other, f"re-measuring (predicted {best} faster)", predicted)
        return Choice(best, "predicted faster", predicted)

    def observe(self, m: SendMeasure) -> None:
        """One finished send's figures into the estimates; a degenerate one (no bytes, no layers) is skipped."""
        if m.mode not in (LAYERWISE, BULK) or m.nbytes <= 0 or m.layers <= 0 or m.step_tokens <= 0 \
                or m.prompt_tokens <= 0 or m.busy_s <= 0:
            return
        sample = m.nbytes / m.busy_s
        for where in {m.dest, ""}:
            self._rate[where] = _blend(self._rate.get(where), sample)
        self._bytes_per_token = _blend(self._bytes_per_token, m.nbytes / m.prompt_tokens)
        self._layers = m.layers
        key = (m.mode, step_bucket(m.step_tokens))
        self._per_token[key] = _blend(self._per_token.get(key), m.window_s / m.step_tokens)
        wire = m.nbytes / self._rate[m.dest]
        modeled = wire if m.mode == BULK else max(wire - m.window_s, wire / m.layers)
        self._fixed[m.mode] = _blend(self._fixed.get(m.mode), m.tail_s - modeled)

    def snapshot(self) -> dict[str, object]:
        """The estimates as they stand (logs, tests)."""
        return {"rate_bytes_s": dict(self._rate), "bytes_per_token": self._bytes_per_token,
                "s_per_step_token": {f"{mode}@{1 << b}": v for (mode, b), v in self._per_token.items()},
                "fixed_s": dict(self._fixed), "layers": self._layers}
