"""The latency guard (jax_engine/decode/latency_guard.py): how far past the token budget a step
may go while streams decode beside it, from measured step times and the gaps the streams saw.
The scheduler asking it: test_scheduler_fake_runner.py (fake runner) and
tests/engine/test_scheduler.py (real engine)."""
from __future__ import annotations

import pytest

from jax_engine.decode.latency_guard import LatencyGuard

BUCKETS = [80, 96, 128, 160]


def seeded(ratio: float = 4.0, gap_ms: float = 20.0, steps: int = 100, streams: int = 2, safety: float = 0.9,
           share: float = 0.007, window: int = 2048) -> LatencyGuard:
    """A guard that has seen `steps` plain decode steps of `gap_ms` beside `streams` streams, and
    the step times of the buckets above the budget: 80 -> 60 ms, 96 -> 70, 128 -> 90, 160 -> 105."""
    g = LatencyGuard(ratio, share=share, window=window, safety=safety)
    for _ in range(steps):
        g.observe(8, gap_ms, streams)
    for b, ms in zip(BUCKETS, (60.0, 70.0, 90.0, 105.0)):
        g.observe(b, ms, 0)            # measured on idle steps: no stream waited, no gap counted
    return g


def test_nothing_decoding_or_nothing_measured_allows_the_whole_step():
    assert LatencyGuard(4.0).choose(BUCKETS, decoding=3) == 160            # no gap seen yet
    assert seeded().choose(BUCKETS, decoding=0) == 160                       # no stream waits
    g = seeded()
    del g.cost[160]
    assert g.choose(BUCKETS, decoding=1) == 160                              # never run: find out


def test_a_step_under_the_line_is_allowed_a_long_one_only_within_the_share():
    # median gap 20 ms: the line is 0.9 * 4 * 20 = 72 ms
    g = seeded(share=0.007, window=2048)
    assert g.median_gap() == 20.0 and g.line() == pytest.approx(72.0)
    # the one-shot step (105 ms) is long; 14.3 long gaps of 2048 are allowed: 2 streams beside it, fine
    assert g.choose(BUCKETS, decoding=2) == 160
    for _ in range(6):                   # six such steps happened, 2 streams each: 12 long gaps
        g.observe(160, 105.0, 2)
    assert g.choose(BUCKETS, decoding=1) == 160       # 13 <= 14.3
    assert g.choose(BUCKETS, decoding=3) == 96        # 15 > 14.3: the largest bucket under the line
    g.cost[80] = g.cost[96] = 80.0                     # nothing above the budget fits under the line
    assert g.choose(BUCKETS, decoding=3) is None
    # a slower median moves the line: 40 ms gaps, line 144 ms, the 105 ms step is not long at all
    slow = seeded(gap_ms=40.0)
    assert slow.choose(BUCKETS, decoding=30) == 160


def test_old_gaps_leave_the_window():
    g = seeded(window=256, steps=100, streams=2)       # 200 gaps of 20 ms
    for _ in range(8):
        g.observe(160, 105.0, 2)                       # 16 long gaps: over 0.007 * 256
    assert g.choose(BUCKETS, decoding=1) == 96
    for _ in range(200):                               # 400 fresh 20 ms gaps push them out
        g.observe(8, 20.0, 2)
    assert g._gaps < 256 + 2
    assert g.choose(BUCKETS, decoding=1) == 160


def test_ratio_must_exceed_one():
    with pytest.raises(ValueError, match="must be > 1"):
        LatencyGuard(1.0)
