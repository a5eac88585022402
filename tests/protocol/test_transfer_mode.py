"""The per-request transfer mode (aiolayer.protocol.mode): what a finished send's layer times reduce to,
and the choice that follows from the estimates, on sends made up to the regimes measured on real engines
(docs/modes.md): a slow link where layer-wise hides the wire, a fast one where its per-layer work on the
forward's core costs more than it hides."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from aiolayer.protocol.mode import BULK, LAYERWISE, ModeChooser, SendMeasure, measured, step_bucket

MB = 1_000_000
LAYERS = 16


@dataclass
class Times:
    handed_s: float
    submitted_s: float
    landed_s: float


def test_a_sends_figures_count_each_second_of_the_wire_once():
    layers = [Times(1.0, 1.0, 1.5), Times(1.2, 1.3, 1.6), Times(2.0, 2.1, 2.2)]   # two overlap, one apart
    window, tail, busy, count = measured(iter(layers), finished_s=2.5)   # one pass over an iterator is enough
    assert (round(window, 6), round(tail, 6), round(busy, 6), count) == (1.0, 0.5, 0.7, 3)
    assert measured([], 1.0) == (0.0, 0.0, 0.0, 0)


def _send(mode: str, *, rate: float, window_s: float, tokens: int = 2000, mb: float = 32.0,
          fixed_s: float = 0.005, dest: str = "tcp://d:1") -> SendMeasure:
    """A send as the engines report it: the wire at ``rate`` bytes/s, layer-wise's writes behind the
    forward (its tail whatever the forward could not hide, at least the last layer), bulk's after it."""
    wire = mb * MB / rate
    tail = (max(wire - window_s, wire / LAYERS) if mode == LAYERWISE else wire) + fixed_s
    return SendMeasure(mode=mode, step_tokens=tokens, prompt_tokens=tokens, dest=dest, window_s=window_s,
                       tail_s=tail, busy_s=wire, nbytes=int(mb * MB), layers=LAYERS)


def _teach(chooser: ModeChooser, *, rate: float, lw_window: float, bulk_window: float, times: int = 3) -> None:
    for _ in range(times):
        chooser.observe(_send(LAYERWISE, rate=rate, window_s=lw_window))
        chooser.observe(_send(BULK, rate=rate, window_s=bulk_window))


def _choose(chooser: ModeChooser, tokens: int = 2000, dest: str = "tcp://d:1"):
    return chooser.choose(step_tokens=tokens, prompt_tokens=tokens, dest=dest)


def test_an_unmeasured_step_size_tries_layerwise_then_bulk():
    chooser = ModeChooser()
    first = _choose(chooser)
    assert (first.mode, first.predicted_s) == (LAYERWISE, {})
    chooser.observe(_send(LAYERWISE, rate=125 * MB, window_s=0.5))
    assert _choose(chooser).mode == BULK                       # layer-wise measured, bulk not yet
    chooser.observe(_send(BULK, rate=125 * MB, window_s=0.5))
    assert _choose(chooser).why == "predicted faster"
    assert _choose(chooser, tokens=200).mode == LAYERWISE      # another step size: measured on its own


def test_a_slow_link_goes_layerwise_a_fast_one_with_a_costly_forward_goes_bulk():
    # 1 Gbit/s: 32 MB is 256 ms on the wire, hidden behind a 500 ms forward even if layer-wise slows it 10%
    slow = ModeChooser()
    _teach(slow, rate=125 * MB, lw_window=0.55, bulk_window=0.5)
    choice = _choose(slow)
    assert choice.mode == LAYERWISE, choice
    assert choice.predicted_s[BULK] - choice.predicted_s[LAYERWISE] == pytest.approx(0.256 - 0.05 - 0.016, abs=0.01)
    # unshaped: 32 MB in 20 ms; layer-wise's writes on the forward's core cost it 70 ms: bulk wins
    fast = ModeChooser()
    _teach(fast, rate=1600 * MB, lw_window=0.57, bulk_window=0.5)
    assert _choose(fast).mode == BULK


def test_the_choice_follows_the_link_when_its_rate_changes():
    chooser = ModeChooser()
    _teach(chooser, rate=125 * MB, lw_window=0.55, bulk_window=0.5)
    assert _choose(chooser).mode == LAYERWISE
    for _ in range(4):    # the link got fast: the sends (whichever mode) measure it
        chooser.observe(_send(LAYERWISE, rate=1600 * MB, window_s=0.57))
    assert _choose(chooser).mode == BULK


def test_each_destination_has_its_own_rate_and_a_new_one_starts_from_all_of_them():
    chooser = ModeChooser()
    _teach(chooser, rate=1600 * MB, lw_window=0.57, bulk_window=0.5)
    for _ in range(3):   # a far D, at 1 Gbit/s: its sends measured its link only
        chooser.observe(_send(LAYERWISE, rate=125 * MB, window_s=0.57, dest="tcp://far:1"))
    assert _choose(chooser, dest="tcp://far:1").mode == LAYERWISE
    assert _choose(chooser, dest="tcp://d:1").mode == BULK
    assert chooser.snapshot()["rate_bytes_s"][""] > 125 * MB      # any other D: the blend of every send


def test_every_nth_request_re_measures_the_mode_predicted_to_lose_and_a_far_loser_rarely():
    chooser = ModeChooser(explore_every=4)
    _teach(chooser, rate=250 * MB, lw_window=0.58, bulk_window=0.5)   # bulk predicted within 20%
    modes = [_choose(chooser).mode for _ in range(8)]
    assert modes == [LAYERWISE, LAYERWISE, LAYERWISE, BULK] * 2
    far = ModeChooser(explore_every=4)
    _teach(far, rate=40 * MB, lw_window=0.55, bulk_window=0.5)       # bulk predicted 1.6x slower
    modes = [_choose(far).mode for _ in range(64)]
    assert modes.count(BULK) == 2 and modes[31] == modes[63] == BULK
    with pytest.raises(ValueError, match="explore_every"):
        ModeChooser(explore_every=1)


def test_degenerate_figures_change_nothing():
    chooser = ModeChooser()
    before = chooser.snapshot()
    for bad in (dict(nbytes=0), dict(layers=0), dict(busy_s=0.0), dict(step_tokens=0), dict(mode="auto")):
        chooser.observe(SendMeasure(**{**_send(LAYERWISE, rate=125 * MB, window_s=0.5).__dict__, **bad}))
    assert chooser.snapshot() == before


def test_step_sizes_within_a_factor_of_two_share_an_estimate():
    assert step_bucket(1025) == step_bucket(2048) != step_bucket(1024)
    assert step_bucket(0) == step_bucket(1) == 0
