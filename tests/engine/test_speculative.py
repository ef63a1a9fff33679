"""Speculative decoding (--speculative ngram / suffix): the output is what the model produces
without it, token for token for greedy rows and in distribution for sampled rows; guesses are
actually made and accepted; nothing leaks and nothing compiles after warmup.

One warmed engine serves every test here; a test switches speculation on and off by giving the
replica's scheduler a Drafter or None (the runner's programs are the same either way)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from jax_engine.config import ModelSpec
from jax_engine.decode import runner as runner_mod
from jax_engine.decode import speculate
from jax_engine.decode.speculate import Drafter
from jax_engine.engine import Engine
from jax_engine.errors import InvalidRequest
from jax_engine.types import Constraint
from tests.helpers import hf_models
from tests.helpers.engines import PROMPTS, build_tiny_decoder, engine_logits, greedy_all, make_engine, run, small_args

K = 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_tiny_decoder(str(tmp_path_factory.mktemp("tiny_spec")))
    eng = make_engine(path, warmup=True, speculative="ngram", num_speculative_tokens=K)
    runner = _sched(eng).runner
    # warmup measured the step programs (the planner's cost table), monotone in the token bucket
    for greedy in (True, False):
        ms = [runner.step_ms[(T, spec, greedy)] for T in runner.token_buckets for spec in (False, True)]
        assert len(ms) == 2 * len(runner.token_buckets) and ms == sorted(ms)
    runner.step_ms = {}     # every width costs the same here: the planner verifies every guess
    yield eng
    eng.shutdown(timeout=5.0)


def _sched(engine):
    return engine._workers["gen"].replicas[0]


def _use(engine, method):
    """Speculate with `method` ("off": not at all) from now on; returns the new drafter (or None)."""
    s = _sched(engine)
    s.drafter = None if method == "off" else Drafter(method, K)
    return s.drafter


# prompts a tiny random model continues with repeats (so there is something to guess) and without
LOOPY = [[5, 6, 7, 8] * 6, [9, 10] * 10, [30 + i % 7 for i in range(40)]]
FRESH = [list(range(3, 40)), list(range(100, 130))]


def _requests():
    """16 requests over every sampling feature that must stay exact under speculation."""
    reqs = []
    for i in range(16):
        p = (LOOPY + FRESH)[i % 5]
        kw = dict(temperature=0.0, max_new_tokens=[40, 7, 25, 33][i % 4], logprobs=True, top_logprobs=2)
        if i % 4 == 1:
            kw.update(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3)
        if i % 4 == 2:
            kw.update(logit_bias={17: 3.0, 430: -5.0}, min_new_tokens=12)
        if i % 8 == 3:
            kw.update(n=2)
        reqs.append((p, kw))
    return reqs


class _Logprob(float):
    """A logprob that equals another within 1e-4. A verifying step computes a row's logits in a
    wider program than a plain decode step, and XLA:CPU need not sum in the same order for every
    program shape: on a 2-vCPU AMX Xeon, of the batch-1 runs' logprobs, one rounded to -5.7102
    with speculation and -5.7103 without (the same token, the same top ids), which failed an
    equality of 4-decimal roundings. Tokens, text, finish reasons and top ids stay exact."""

    __hash__ = float.__hash__

    def __eq__(self, other):
        return isinstance(other, float) and abs(float(self) - float(other)) <= 1e-4


def _key(res):
    """Everything a client sees of one request's answer, per sequence."""
    out = []
    for idx in sorted(res):
        r = res[idx]
        f = r["final"]
        out.append((r["tokens"], r["text"], f.finish_reason, f.matched_stop,
                    [(lp.token_id, _Logprob(lp.logprob), [t for t, _ in lp.top]) for lp in r["logprobs"]]))
    return out


def _run_all(engine, reqs):
    async def main():
        return await asyncio.gather(*[run(engine, p, **kw) for p, kw in reqs])
    return [_key(r) for r in asyncio.run(main())]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_output_unchanged_batch_16_and_1(engine, method):
    reqs = _requests()
    _use(engine, "off")
    want = _run_all(engine, reqs)
    d = _use(engine, method)
    got = _run_all(engine, reqs)                        # all 16 at once
    got += _run_all(engine, reqs)                       # again: the suffix cache now knows the answers
    one = [_run_all(engine, [r])[0] for r in reqs[:4]]  # batch 1
    assert got[:16] == want and got[16:] == want and one == want[:4]
    st = d.stats()
    assert st.verify_rows > 0 and st.accepted_tokens > 0, st
    if method == "suffix":   # a repeated request is guessed almost entirely
        assert st.accept_rate > 0.5, st
    s = _sched(engine)
    assert s.pool.num_used() == 0 and not s.requests             # no page or request leaked


def test_stop_strings_and_max_tokens_cut_inside_an_accepted_run(engine):
    _use(engine, "off")
    base = _run_all(engine, [(LOOPY[0], dict(temperature=0.0, max_new_tokens=40))])[0][0]
    text = base[1]
    stop = text[len(text) // 3: len(text) // 3 + 3]
    reqs = [(LOOPY[0], dict(temperature=0.0, max_new_tokens=40, stop=[stop])),
            (LOOPY[0], dict(temperature=0.0, max_new_tokens=40, stop=[stop], include_stop_str_in_output=True)),
            (LOOPY[0], dict(temperature=0.0, max_new_tokens=13)),
            (LOOPY[0], dict(temperature=0.0, max_new_tokens=40, stop_token_ids=[base[0][20]]))]
    want = _run_all(engine, reqs)
    d = _use(engine, "suffix")
    _run_all(engine, [(LOOPY[0], dict(temperature=0.0, max_new_tokens=40))])   # the cache learns the answer
    got = _run_all(engine, reqs)
    assert got == want
    assert want[0][0][2] == "stop" and want[2][0][2] == "length" and len(want[2][0][0]) == 13
    assert d.stats().accepted_tokens > 20


def test_constrained_rows_verify_against_the_grammar(engine):
    c = Constraint(kind="regex", spec="(ab|cd){3,12}")
    reqs = [(LOOPY[i], dict(temperature=0.0, max_new_tokens=30, constraint=c)) for i in range(3)]
    _use(engine, "off")
    want = _run_all(engine, reqs)
    d = _use(engine, "suffix")
    got = _run_all(engine, reqs) + _run_all(engine, reqs)
    assert got == want + want
    assert d.stats().accepted_tokens > 0


def test_sampled_tokens_keep_their_distribution(engine, monkeypatch):
    """Chi-square over the first three tokens (top-k 3: 27 outcomes) with a guess for the second on
    every request, the least likely candidate (so most guesses are rejected and the residual draw
    is exercised) and an accepted guess followed by the free draw of the third: the rejection rule
    must leave p(x1) p(x2 | x1) p(x3 | x1 x2) as it is."""
    worker = engine._workers["gen"]
    prompt = [5, 6, 7, 8, 9]
    n, temp, top_k = 3000, 1.5, 3

    def probs(ctx):
        lg = engine_logits(worker, ctx)[-1].astype(np.float64)
        top = np.argsort(-lg)[:top_k]
        z = lg[top] / temp
        p = np.exp(z - z.max())
        return dict(zip(top.tolist(), (p / p.sum()).tolist()))

    p1 = probs(prompt)
    p2 = {a: probs(prompt + [a]) for a in p1}
    joint = {(a, b, c): p1[a] * p2[a][b] * pc for a in p1 for b in p2[a]
             for c, pc in probs(prompt + [a, b]).items()}
    guess = {a: min(p2[a], key=p2[a].get) for a in p1}     # the least likely second token

    class Fixed:
        def propose(self, tokens, k):
            return [guess[tokens[len(prompt)]]][:k] if len(tokens) == len(prompt) + 1 else []

        def finish(self, tokens=None):
            pass

    class Always:
        def start(self, prompt, greedy=True):
            return Fixed()

    d = _use(engine, "ngram")
    d.speculator = Always()
    d.min_accept_rate = 0.0                         # never pause: every request verifies its guess
    monkeypatch.setattr(speculate, "MARGIN", -1.0)  # and pricing keeps any guess, however unlikely

    async def main():
        out = []
        for lo in range(0, n, 200):      # within --max-waiting-requests
            out += await asyncio.gather(*[run(engine, prompt, seed=1000 + i, temperature=temp, top_k=top_k,
                                              max_new_tokens=3) for i in range(lo, lo + 200)])
        return out
    res = asyncio.run(main())
    counts: dict = {}
    for r in res:
        c = tuple(r[0]["tokens"])
        counts[c] = counts.get(c, 0) + 1
    assert set(counts) <= set(joint)
    st = d.stats()
    assert st.verify_rows == n and 0 < st.accepted_tokens < n / 2, st
    chi2 = sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in joint.items())
    assert len(joint) == 27 and chi2 < 54.05, (chi2, counts, joint)   # p = 0.001 at 26 degrees of freedom


def test_planner_costs_sampled_steps_with_the_sampled_table(engine):
    """The planner prices a step by the program it will run: with a cost table where verifying
    sampled steps is ruinous and greedy ones are free, a sampled request makes no guess and a
    greedy one does (with one table for both, both would)."""
    runner = _sched(engine).runner
    table = {}
    for T in runner.token_buckets:
        table[(T, False, True)] = table[(T, True, True)] = table[(T, False, False)] = 1.0
        table[(T, True, False)] = 1000.0
    runner.step_ms = table
    class Guess:                                    # always has guesses to offer
        def propose(self, tokens, k):
            return [5] * k

        def finish(self, tokens=None):
            pass

    class Always:
        def start(self, prompt, greedy=True):
            return Guess()

    try:
        d = _use(engine, "ngram")
        d.speculator = Always()
        asyncio.run(run(engine, LOOPY[0], seed=3, temperature=0.7, max_new_tokens=30))
        assert d.stats().proposed_tokens == 0
        asyncio.run(run(engine, LOOPY[0], temperature=0.0, max_new_tokens=30))
        assert d.stats().proposed_tokens > 0
    finally:
        runner.step_ms = {}


def test_served_steps_keep_the_cost_model_current(engine):
    """Each served plain step moves the cost model's one live offset toward what it cost above its
    table entry (runner._observe), so every width is priced with what serving adds, the widths it
    rarely runs too: with a table that prices every step at 1e6 ms the offset goes toward -1e6 and
    every entry's price comes down alike, the table itself unchanged; with no table (time_steps
    did not run) nothing is learned. Served verifying steps move their kind's scale instead
    (greedy and sampled apart), and leave the offset alone."""
    runner = _sched(engine).runner
    table = {(T, spec, greedy): 1e6 for T in runner.token_buckets for spec in (False, True)
             for greedy in (False, True)}
    runner.step_ms = dict(table)
    runner.live_offset_ms, runner.spec_scale = 0.0, {True: 1.0, False: 1.0}
    try:
        _use(engine, "off")
        asyncio.run(run(engine, LOOPY[0], temperature=0.0, max_new_tokens=12))
        assert runner.step_ms == table
        assert -1e6 < runner.live_offset_ms < -1e5                  # 12 steps at weight 0.05: ~-0.46e6
        assert runner.spec_scale == {True: 1.0, False: 1.0}
        prices = {runner.step_cost(T, spec, greedy) for T, spec, greedy in table}
        assert len(prices) == 1 and prices.pop() == 1e6 + runner.live_offset_ms

        # verifying steps: a greedy one 3x its price moves the greedy scale only, not the offset
        offset, T = runner.live_offset_ms, runner.token_buckets[-1]
        runner._observe((T, True, True), 3.0 * (1e6 + offset))
        assert runner.live_offset_ms == offset and runner.spec_scale[False] == 1.0
        assert runner.spec_scale[True] == pytest.approx(1.0 + runner_mod.SPEC_SCALE_WEIGHT * 2.0)
        assert runner.step_cost(T, True, True) == pytest.approx((1e6 + offset) * runner.spec_scale[True])
        assert runner.step_cost(T, False, True) == 1e6 + offset and runner.step_cost(T, True, False) == 1e6 + offset
        runner._observe((T, True, False), 0.0)          # one step's ratio counts within the range
        assert runner.spec_scale[False] == pytest.approx(
            1.0 + runner_mod.SPEC_SCALE_WEIGHT * (runner_mod.SPEC_SCALE_RANGE[0] - 1.0))

        # served: a speculating engine's verifying steps move the greedy scale
        runner.spec_scale = {True: 1.0, False: 1.0}
        d = _use(engine, "ngram")
        asyncio.run(run(engine, LOOPY[0], temperature=0.0, max_new_tokens=24))
        assert d.stats().verify_rows > 0
        assert runner.spec_scale[True] < 1.0 and runner.spec_scale[False] == 1.0  # far below 1e6 ms

        runner.step_ms, runner.live_offset_ms = {}, 0.0
        runner.spec_scale = {True: 1.0, False: 1.0}
        asyncio.run(run(engine, LOOPY[0], temperature=0.0, max_new_tokens=4))
        assert runner.step_ms == {} and runner.live_offset_ms == 0.0 and runner.spec_scale == {True: 1.0, False: 1.0}
    finally:
        runner.step_ms, runner.live_offset_ms = {}, 0.0
        runner.spec_scale = {True: 1.0, False: 1.0}


def test_no_compiles_after_warmup_with_speculation(engine, monkeypatch):
    """Also for the steps where a prompt's last chunk carries guesses (the second pass: the
    suffix cache knows the answers)."""
    _use(engine, "suffix")
    runner = _sched(engine).runner
    prompt_guesses = []
    step = runner.step

    def spy(rows, greedy, masks=None):
        # a decode row's first sample sits at its token 0; a prompt chunk's at its last token (token
        # 0 too for a fully cached prompt's one-token row, which is marked cached)
        prompt_guesses.extend(len(r.samples) - 1 for r in rows if r.samples and (r.samples[0].at > 0 or r.cached))
        return step(rows, greedy, masks)
    monkeypatch.setattr(runner, "step", spy)
    _run_all(engine, _requests())
    _run_all(engine, _requests())
    st = engine.stats("gen")
    assert st.compilations_after_warmup == 0
    assert max(prompt_guesses) > 0
    assert st.spec is None or st.spec.method in ("ngram", "suffix")


@pytest.mark.parametrize("kw,match", [(dict(speculative="draft"), "--speculative"),
                                      (dict(speculative="ngram", num_speculative_tokens=0), "--num-speculative-tokens"),
                                      (dict(speculative="suffix", num_speculative_tokens=17), "--num-speculative-tokens")])
def test_bad_flags_are_refused(tmp_path, kw, match):
    path = build_tiny_decoder(str(tmp_path / "m"))
    with pytest.raises(InvalidRequest, match=match):
        Engine(small_args(models=[ModelSpec(name="gen", path=path)], **kw)).load_all(progress=False, warmup=False)


FAMILIES = ["llama3", "mistral", "qwen2", "qwen3", "qwen2_yarn", "phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_greedy_equals_transformers_with_suffix_speculation(family, tmp_path):
    """Each decoder family, two prompts answered twice (the second time mostly guessed from the
    first answer), against transformers' greedy tokens."""
    path = str(tmp_path / family)
    model = hf_models.build(family, path)
    moe = family in ("mixtral", "qwen3_moe")
    kw = dict(cpu_matmul="xla", attention_backend="reference") if moe else {}
    eng = Engine(small_args(models=[ModelSpec(name="m", path=path)], speculative="suffix",
                            num_speculative_tokens=K, **kw))
    try:
        eng.load_all(progress=False, warmup=False)
        prompts = [PROMPTS[0], PROMPTS[3]]               # 37 and 56 tokens: beyond the test windows
        want = [hf_models.hf_greedy(model, p, 20) for p in prompts]
        assert asyncio.run(greedy_all(eng, prompts, 20)) == want
        assert asyncio.run(greedy_all(eng, prompts, 20)) == want
        st = eng.stats("m").spec
        assert st is not None and st.accepted_tokens >= 20, st
    finally:
        eng.shutdown(timeout=5.0)
