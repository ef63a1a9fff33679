"""The latency guard (jax_engine/decode/latency_guard.py): how far past the token budget a step
may go while streams decode beside it, from measured step times and the gaps the streams saw;
and the scheduler asking it (over the fake runner of test_scheduler_fake_runner.py)."""
from __future__ import annotations

import pytest

from jax_engine.decode.latency_guard import LatencyGuard
from jax_engine.decode.page_pool import PagePool
from jax_engine.decode.scheduler import Scheduler
from tests.unit.test_scheduler_fake_runner import FakeRunner, run, submit, tokens

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


def make_guarded(guard: LatencyGuard) -> Scheduler:
    """A scheduler over the fake runner with a 16-token budget and a 64-token burst budget."""
    runner = FakeRunner(max_running=4, max_batched_tokens=16, page_size=4)
    runner.budget_tokens, runner.max_tokens = 16, 64
    runner.token_buckets = [1, 2, 4, 8, 16, 20, 24, 28, 32, 40, 48, 56, 64]
    sched = Scheduler(runner, PagePool(64, 4), eos_ids=set(), max_model_len=256, name="fake",
                      burst_min_prompts=4, guard=guard)
    runner.sched = sched
    return sched


def steps_beside_a_stream(guard: LatencyGuard) -> tuple[list[int], list[int]]:
    """Stream a decodes; a 40-token prompt b arrives: the token counts of the steps while b
    prefills, and b's tokens."""
    sched = make_guarded(guard)
    submit(sched, "a", [5, 6, 7], new=30)
    sched._drain_control()
    for _ in range(3):
        sched.step()                                  # a prefilled, then decoding
    outs = submit(sched, "b", list(range(100, 140)), new=4)
    sched._drain_control()
    before = len(sched.runner.steps)
    sched.step()
    while any(s.req.request_id == "b" for s in sched.prefilling):
        sched.step()
    sizes = [st.num_tokens for st in sched.runner.steps[before:]]
    run(sched)
    return sizes, tokens(outs)


def test_the_scheduler_prefills_in_one_step_when_the_guard_allows_and_chunks_when_not():
    allow, b_tokens = steps_beside_a_stream(LatencyGuard(4.0))        # nothing measured: allowed
    assert allow == [41], allow                                        # a's token + the whole prompt (bucket 48)
    refuse = LatencyGuard(4.0)
    for _ in range(50):
        refuse.observe(1, 1.0, 1)                                      # 1 ms gaps: line 3.6 ms
    for b in (20, 24, 28, 32, 40, 48, 56, 64):
        refuse.observe(b, 50.0, 0)                                     # every step above 16 is long
    refuse.share = 0.0                                                 # and none may be spent
    chunked, b_tokens2 = steps_beside_a_stream(refuse)
    assert chunked == [16, 16, 11], chunked                            # a's token + 15 of the prompt per step
    assert b_tokens == b_tokens2 == list(range(140, 144))              # the fake runner's next = last + 1
    partial = LatencyGuard(4.0)
    for _ in range(50):
        partial.observe(1, 10.0, 1)                                    # line 36 ms
    for b, ms in ((20, 20.0), (24, 25.0), (28, 30.0), (32, 35.0), (40, 45.0), (48, 50.0)):
        partial.observe(b, ms, 0)
    partial.share = 0.0
    sizes, _ = steps_beside_a_stream(partial)
    assert sizes == [32, 10], sizes                                    # the largest step under the line, then the rest
