"""The scheduler's speculation policy (jax_engine/decode/speculate.py): which guesses a step
verifies under a measured step-cost table, and when a sequence stops guessing."""
from __future__ import annotations

from jax_engine.decode.speculate import HOST_CLIP, HOST_EMA, HOST_JUMP_MS, Drafter, SpecTrack


class _Wrong:
    def propose(self, tokens, k):
        return [0] * k

    def finish(self, tokens=None):
        pass


class _Spec:
    def start(self, prompt, greedy=True):
        return _Wrong()


def _drafter() -> Drafter:
    return Drafter("ngram", 4, speculator=_Spec())


def _track(q: float) -> SpecTrack:
    return SpecTrack(_Wrong(), rate=q)


def test_flat_cost_verifies_every_guess():
    d = _drafter()
    take = d.choose([[1, 2, 3, 4], [5, 6]], [_track(0.5), _track(0.9)], 2, 64, lambda T, spec: 1.0)
    assert take == [4, 2]


def test_room_caps_the_guesses_and_likely_ones_go_first():
    d = _drafter()
    take = d.choose([[1, 2, 3, 4], [5, 6, 7, 8]], [_track(0.3), _track(0.95)], 2, 5, lambda T, spec: 1.0)
    assert take == [1, 4]


def test_cost_proportional_to_tokens_verifies_nothing():
    """When a step costs its width, a guess that may be rejected never pays."""
    d = _drafter()
    take = d.choose([[1, 2, 3, 4]] * 8, [_track(0.9)] * 8, 8, 64, lambda T, spec: float(T))
    assert take == [0] * 8


def test_bucketed_cost_keeps_the_guesses_that_fit_a_cheap_bucket():
    # 8 decode tokens cost 2 ms; up to 16 tokens 2.5 ms; beyond that 8 ms
    cost = {8: 2.0, 16: 2.5, 32: 8.0, 64: 8.0}

    def c(T, spec):
        return next(v for b, v in sorted(cost.items()) if b >= T)

    d = _drafter()
    take = d.choose([[1, 2, 3, 4]] * 8, [_track(0.8)] * 8, 8, 56, c)
    assert take == [1] * 8        # (8 + 8 * 0.8) / 2.5 beats 8 / 2 and anything in the 8 ms buckets


def test_low_acceptance_stops_guessing_and_good_rows_keep_going():
    d = _drafter()
    t = d.start([1, 2, 3])
    made = 0
    for _ in range(300):
        g = d.propose(t, [1, 2, 3], 4)
        if g:
            made += 1
            d.record(t, len(g), 0)
    assert made < 20                  # backoff doubles to 64 steps between probes
    t2 = d.start([1])
    for _ in range(50):
        d.record(t2, 4, 4)
        assert d.propose(t2, [1], 4) == [0] * 4
    st = d.stats()
    assert st.verify_rows == made + 50 and st.accepted_tokens == 200
    assert st.accepted_histogram[0] == made and st.accepted_histogram[4] == 50
    assert abs(st.accept_length - (1 + 200 / (made + 50))) < 1e-9


def test_prefill_tokens_in_the_step_are_priced_as_its_base():
    """Guesses are priced on top of the step's prefill tokens: a chunk that already fills most of
    a bucket makes the guesses that fit that bucket nearly free, and one that fills it makes any
    guess start a wider bucket."""
    cost = {8: 2.0, 16: 2.5, 32: 8.0, 64: 16.0}

    def c(T, spec):
        return next(v for b, v in sorted(cost.items()) if b >= T)

    d = _drafter()
    props, tracks = [[1, 2, 3, 4]] * 4, [_track(0.5)] * 4
    assert d.choose(props, tracks, 4, 60, c) == [1] * 4                  # 4 decode + 4 guesses fit 8
    assert d.choose(props, tracks, 4, 40, c, chunk_tokens=20) == [2, 2, 2, 2]   # 24 + 8 fill 32
    assert d.choose(props, tracks, 4, 32, c, chunk_tokens=28) == [0] * 4         # 32: any guess costs 64


def test_rows_that_can_all_end_now_verify_every_guess_left():
    """When every row's guesses run to its request's end and no prompt would share the next step
    (`ends`), the step takes them all if what that adds costs less than the step the leftovers would need
    alone, weighted by the chance that every guess is accepted. Measured costs of the trained
    model (ms): the 8 rows' last 15 tokens each fit 128, the one-step pricing stops at 112."""
    cost = {8: 1.4, 16: 2.0, 112: 6.5, 128: 7.3, 160: 9.5}

    def c(T, spec):
        return next(v for b, v in sorted(cost.items()) if b >= T)

    d = _drafter()
    d.max_tokens = 16
    props = [[7] * 14] * 8                  # 8 decode tokens + 112 guesses = 120 tokens
    sure = [_track(0.999)] * 8
    myopic = d.choose(props, sure, 8, 248, c, widths=sorted(cost))
    assert sum(myopic) == 104               # 112 tokens: (8 + 104) / 6.5 beats 120 / 7.3
    assert d.choose(props, sure, 8, 248, c, widths=sorted(cost), ends=[14] * 8) == [14] * 8
    # a row whose proposal stops short of its end cannot end now: the one-step pricing decides
    assert d.choose(props, sure, 8, 248, c, widths=sorted(cost), ends=[14] * 7 + [20]) == myopic
    # likely rejections: the leftover step would be needed anyway
    unsure = [_track(0.97)] * 8             # 0.97^112 ~ 0.03
    assert sum(d.choose(props, unsure, 8, 248, c, widths=sorted(cost), ends=[14] * 8)) < 112


def test_new_sequences_start_from_the_recent_acceptance():
    """A new sequence's q is the drafter's recent acceptance, not a constant: after many poor
    verifications new rows bet less (never below min_accept_rate), after good ones more."""
    d = _drafter()
    assert d.start([1]).rate == 0.7
    t = d.start([1])
    for _ in range(200):
        d.record(t, 4, 1)                   # 1 of 2 trials each time: q -> 0.5
    assert abs(d.start([1]).rate - 0.5) < 0.01
    for _ in range(200):
        d.record(t, 4, 0)
    assert d.start([1]).rate == d.min_accept_rate
    for _ in range(400):
        d.record(t, 4, 4)
    assert d.start([1]).rate > 0.99


def test_greedy_and_sampled_sequences_keep_a_prior_each():
    """A sampled sequence starts from the recent acceptance of sampled sequences, not of greedy
    ones (argmax matches and rejection sampling accept at very different rates): after greedy
    rows accepted every guess, a new sampled row still starts where sampled ones left off."""
    d = _drafter()
    g, s = d.start([1], greedy=True), d.start([1], greedy=False)
    assert g.greedy and not s.greedy
    for _ in range(300):
        d.record(g, 4, 4)
    for _ in range(300):
        d.record(s, 4, 1)                   # 1 of 2 trials each time: q -> 0.5
    assert d.start([1], greedy=True).rate > 0.99
    assert abs(d.start([1], greedy=False).rate - 0.5) < 0.01


def test_pricing_only_at_the_bucket_edges_chooses_what_pricing_every_count_does():
    import random

    widths = [1, 2, 4, 8, 16, 32, 40, 48, 56, 64]
    table = {w: 0.4 + 0.08 * w + (0.3 if w > 16 else 0) for w in widths}
    calls: list[int] = []

    def cost(T, spec):
        calls.append(T)
        return next(table[w] for w in widths if w >= T) * (1.1 if spec else 1.0)

    rnd = random.Random(0)
    d = _drafter()
    for _ in range(300):
        rows = rnd.randint(1, 8)
        props = [[0] * rnd.randint(0, 8) for _ in range(rows)]
        tracks = [_track(rnd.choice([0.3, 0.5, 0.8, 0.95, 0.99])) for _ in range(rows)]
        chunk = rnd.choice([0, 0, 5, 20])
        room = 64 - rows - chunk
        calls.clear()
        every = d.choose(props, tracks, rows, room, cost, chunk)
        n_every = len(calls)
        calls.clear()
        edges = d.choose(props, tracks, rows, room, cost, chunk, widths)
        assert edges == every
        assert len(calls) <= min(n_every, len(widths) + 2)


def test_planning_pauses_while_it_keeps_no_guess_and_resumes_when_it_does():
    d = _drafter()
    d.explore_every = 10**9                 # explorations: the tests below
    opened = []
    for step in range(300):
        if d.gate():
            opened.append(step)
            d.planned(0)
    # 8 planned steps, then probes after pauses of 4, 8, 16, 32, 64, 64, ... steps
    assert opened[:8] == list(range(8))
    gaps = [b - a for a, b in zip(opened[7:], opened[8:])]
    assert gaps[:6] == [5, 9, 17, 33, 65, 65]
    while not d.gate():
        pass
    d.planned(3)                            # a plan that keeps a guess: the cycle starts over
    assert all(d.gate() for _ in range(1)) and d.gate_backoff == 4 and d.idle_plans == 0



def test_a_new_sequence_ends_the_pause_with_one_probe():
    """A request that repeats an earlier answer must not wait out the pause the earlier, unguessable
    text built up; the backoff stays, so an idle probe pauses again for longer."""
    d = _drafter()
    for _ in range(100):                    # unguessable text: planning is paused
        if d.gate():
            d.planned(0)
    while d.gate_pause == 0:                # land inside a pause
        if d.gate():
            d.planned(0)
    backoff = d.gate_backoff
    d.start([1, 2, 3])
    assert d.gate()                         # the new sequence's first step is planned
    d.planned(0)                            # an idle probe: paused again, backoff kept growing
    assert d.gate_pause == backoff and not d.gate()


def test_guesses_must_beat_the_plain_step_by_the_margin():
    """8 rows, one guess each at q: a 16-token step at 1.5x the 8-token step's time emits 8 + 8q
    tokens. q = 0.52 (1.52 / 1.5 = 1.013x more tokens per ms) is within the margin for the
    costs' noise and verifies nothing; q = 0.6 (1.07x) verifies every guess."""
    from jax_engine.decode.speculate import MARGIN

    def c(T, spec):
        return 2.0 if T <= 8 else 3.0

    d = _drafter()
    assert 1.52 / 1.5 < 1 + MARGIN < 1.6 / 1.5
    assert d.choose([[1]] * 8, [_track(0.52)] * 8, 8, 56, c) == [0] * 8
    assert d.choose([[1]] * 8, [_track(0.6)] * 8, 8, 56, c) == [1] * 8


def test_measured_host_time_of_verifying_steps_is_priced():
    """The same 8 rows at q = 0.7 pay on the program table alone (1.13x), but not once the
    scheduler has measured that a verifying step costs 1 ms more host time than a plain one
    (9.6 tokens / 4 ms against 8 / 2); measured as equal, they pay again."""
    d = _drafter()
    assert d.host_cost(True) == d.host_cost(False) == 0.0       # nothing measured yet

    def c(T, spec):
        return (2.0 if T <= 8 else 3.0) + d.host_cost(spec)

    for _ in range(200):
        d.observe_host(False, 0.5)
        d.observe_host(True, 1.5)
    assert abs(d.host_cost(False) - 0.5) < 1e-6 and abs(d.host_cost(True) - 1.5) < 1e-3
    assert d.choose([[1]] * 8, [_track(0.7)] * 8, 8, 56, c) == [0] * 8
    for _ in range(200):
        d.observe_host(True, 0.5)
    assert d.choose([[1]] * 8, [_track(0.7)] * 8, 8, 56, c) == [1] * 8


def test_a_verifying_step_not_yet_measured_is_priced_as_a_plain_one():
    d = _drafter()
    d.observe_host(False, 0.8)
    assert d.host_cost(True) == d.host_cost(False) == 0.8


def test_one_pause_of_the_scheduler_does_not_price_guessing_out():
    """A 200 ms sample on the first verifying step (a GC pass, another thread holding the GIL)
    counts as HOST_CLIP x the plain average it starts from + HOST_JUMP_MS, weighted HOST_EMA: the
    8 rows at q = 0.7, which pay when both kinds of step cost the same host time, still pay. Taken
    at face value (as before) it priced guessing out. A lasting cost still gets in: a run of slow
    verifying steps raises the average until guessing stops paying."""
    d = _drafter()

    def c(T, spec):
        return (2.0 if T <= 8 else 3.0) + d.host_cost(spec)

    d.observe_host(False, 0.5)
    d.observe_host(True, 200.0)
    assert abs(d.host_cost(True) - (0.5 + HOST_EMA * ((HOST_CLIP - 1) * 0.5 + HOST_JUMP_MS))) < 1e-9
    assert d.choose([[1]] * 8, [_track(0.7)] * 8, 8, 56, c) == [1] * 8
    for _ in range(100):
        d.observe_host(True, 200.0)
    assert d.host_cost(True) > 10 and d.choose([[1]] * 8, [_track(0.7)] * 8, 8, 56, c) == [0] * 8
    d2 = _drafter()
    d2.observe_host(False, 300.0)                # a plain first sample is clipped too
    assert d2.host_cost(False) == HOST_JUMP_MS
    d3 = _drafter()
    d3.observe_host(True, 1.0)                   # verifying before any plain step: from 0
    assert abs(d3.host_cost(True) - HOST_EMA * 1.0) < 1e-12 and d3.host_cost(False) == 0.0


def test_rows_priced_out_are_explored_and_learn_their_rate():
    """At a q the pricing never verifies (8 rows, a wider step costing 1.5x), no guess would ever be
    verified and q would never change. After EXPLORE_EVERY steps without a verified guess one step
    verifies up to EXPLORE_GUESSES guesses per row, and what it accepted replaces q outright."""
    from jax_engine.decode.speculate import EXPLORE_EVERY, EXPLORE_GUESSES, EXPLORE_PRIOR

    def c(T, spec):
        return 2.0 if T <= 8 else 3.0

    d = _drafter()
    tracks = [_track(0.3) for _ in range(8)]
    props = [[1, 2, 3, 4, 5, 6]] * 8
    verified = []
    for step in range(EXPLORE_EVERY * 3 + 1):
        take = d.choose(props, tracks, 8, 56, c) if d.gate() else [0] * 8
        d.planned(sum(take))
        if any(take):
            verified.append((step, take, all(t.explored for t in tracks)))
    # the second exploration waits twice as long: the pricing kept nothing after the first
    assert [s for s, _, _ in verified] == [EXPLORE_EVERY - 1, 3 * EXPLORE_EVERY - 1]
    assert verified[0][1:] == ([EXPLORE_GUESSES] * 8, True)
    d.choose(props, tracks, 8, 56, c)         # the step after an exploration is priced again
    assert not any(t.explored for t in tracks)
    for t in tracks:
        t.explored = True
    # a repeated text: every explored guess accepted, q near 1 (the drafter's prior weighs in as
    # EXPLORE_PRIOR trials) and the pricing keeps guessing
    for t in tracks:
        prior = d.prior[True]
        d.record(t, EXPLORE_GUESSES, EXPLORE_GUESSES)
        assert t.rate == (EXPLORE_GUESSES + EXPLORE_PRIOR * prior) / (EXPLORE_GUESSES + EXPLORE_PRIOR)
    assert all(t.rate > 0.85 and not t.explored for t in tracks)
    assert d.gate() and any(d.choose(props, tracks, 8, 56, c))
    # text it cannot predict: the exploration's 0 of 4 pauses the row as any verification would
    t = _track(0.3)
    t.explored = True
    d.record(t, EXPLORE_GUESSES, 0)
    assert t.pause > 0 and t.rate == d.min_accept_rate


def test_explorations_the_pricing_does_not_follow_back_off():
    """Text nothing predicts: each exploration finds guesses that do not pay, so the next one waits
    twice as long (64, 128, 256, then MAX_EXPLORE_EVERY steps); a priced step that keeps a guess
    brings the interval back to EXPLORE_EVERY."""
    from jax_engine.decode.speculate import EXPLORE_EVERY, MAX_EXPLORE_EVERY

    def c(T, spec):
        return 2.0 if T <= 8 else 3.0

    d = _drafter()
    tracks = [_track(0.3) for _ in range(8)]
    props = [[1, 2, 3, 4]] * 8
    explored = []
    for step in range(4000):
        take = d.choose(props, tracks, 8, 56, c) if d.gate() else [0] * 8
        d.planned(sum(take))
        if any(take):
            explored.append(step)
    gaps = [b - a for a, b in zip([-1] + explored, explored)]
    assert gaps[:5] == [EXPLORE_EVERY, 2 * EXPLORE_EVERY, 4 * EXPLORE_EVERY, MAX_EXPLORE_EVERY, MAX_EXPLORE_EVERY]
    assert d.explore_every == MAX_EXPLORE_EVERY
    d.planned(3)                              # a priced step with guesses (not an exploration)
    assert d.explore_every == EXPLORE_EVERY and d.unverified_steps == 0
