"""Speculation's step-cost table (runner.time_steps): timed in passes over every width, made
monotone from above, so a host stall during warmup cannot price a range of widths wrongly."""
from jax_engine.decode.runner import monotone_costs, time_passes

BUCKETS = [8, 16, 32, 40, 48, 56, 64]
TRUE = {8: 1.2, 16: 1.5, 32: 1.8, 40: 2.1, 48: 2.4, 56: 2.7, 64: 3.2}   # ms, plain; spec +0.1


def _table(values: dict[int, float], greedy: bool = True) -> dict[tuple[int, bool, bool], float]:
    out = {}
    for T, ms in values.items():
        out[(T, False, greedy)] = ms
        out[(T, True, greedy)] = ms + 0.1
    return out


def test_a_stall_inflates_no_width_unless_it_hits_both_passes():
    """A 10 ms stall covering a whole back-to-back run of one width (3 calls) in the first pass:
    the second pass still times that width at its cost."""
    now = [0.0]
    calls = [0]

    def clock() -> float:
        return now[0]

    def step(rows, greedy):
        calls[0] += 1
        T, spec = rows
        stall = 10.0 if 4 <= calls[0] < 7 else 0.0       # the second key's three steps, first pass
        now[0] += (TRUE[T] + (0.1 if spec else 0.0) + stall) / 1000.0

    rows = {(T, spec, True): (T, spec) for T in BUCKETS for spec in (False, True)}
    best = time_passes(rows, step, repeats=3, clock=clock)
    assert calls[0] == 2 * 3 * len(rows)
    for (T, spec, _), ms in best.items():
        assert abs(ms - (TRUE[T] + (0.1 if spec else 0.0))) < 1e-6
    now[0], calls[0] = 0.0, 0                            # one pass only: the stalled width keeps it
    one = time_passes(rows, step, repeats=3, passes=1, clock=clock)
    assert one[(8, True, True)] > 10.0


def test_an_inflated_width_is_lowered_not_propagated_to_wider_ones():
    timed = _table({**TRUE, 32: 3.38})           # 32 tokens timed during a stall
    fixed = monotone_costs(timed, BUCKETS)
    assert fixed[(32, False, True)] == TRUE[40] and fixed[(32, True, True)] == TRUE[40]
    for T in (40, 48, 56, 64):                   # the wider widths keep what they measured
        assert fixed[(T, False, True)] == TRUE[T] and fixed[(T, True, True)] == TRUE[T] + 0.1
    order = [fixed[(T, spec, True)] for T in BUCKETS for spec in (False, True)]
    assert order == sorted(order)


def test_tables_are_monotone_apart_and_a_plain_step_never_costs_more_than_its_spec_one():
    timed = {**_table(TRUE, True), **_table({T: 2 * ms for T, ms in TRUE.items()}, False)}
    timed[(16, False, True)] = 1.9                # plain above its spec (1.6) and above 32's
    fixed = monotone_costs(timed, BUCKETS)
    assert fixed[(16, False, True)] == 1.6
    for greedy in (True, False):
        order = [fixed[(T, spec, greedy)] for T in BUCKETS for spec in (False, True)]
        assert order == sorted(order)
    assert fixed[(64, True, False)] == 2 * TRUE[64] + 0.1     # the sampled table is its own
