"""The scheduler's speculation policy (jax_engine/decode/speculate.py): which guesses a step
verifies under a measured step-cost table, and when a sequence stops guessing."""
from __future__ import annotations

from jax_engine.decode.speculate import Drafter, SpecTrack


class _Wrong:
    def propose(self, tokens, k):
        return [0] * k

    def finish(self, tokens=None):
        pass


class _Spec:
    def start(self, prompt):
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
