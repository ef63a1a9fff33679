"""The step program's small sample branch (runner.FEW_SAMPLES): a step whose real sample rows fit
in `few_samples` runs the LM head over those rows only. Its tokens, logprobs and penalty counts
must equal the full branch's, which the same rows take when more rows sample."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_engine.decode.rows import SampleRow, SamplingRow, StepRow
from jax_engine.decode.runner import ModelRunner, RunnerConfig
from jax_engine.models import decoder
from tests.helpers.tiny_llama import tiny_llama

PS, L, KVH, G, D, H, I, V = 16, 2, 2, 2, 16, 32, 64, 97


def tiny_runner() -> ModelRunner:
    cfg, tensors = tiny_llama(5, L, KVH, G, D, H, I, V)
    rc = RunnerConfig(page_size=PS, num_pages=24, max_running=8, max_batched_tokens=32, max_model_len=64, max_n=1,
                      top_n=2)
    return ModelRunner(cfg, decoder.build(cfg, tensors), rc, None, jnp.float32)


def test_few_sample_rows_equal_the_full_branch():
    greedy = SamplingRow(rep_pen=1.3)
    sampled = SamplingRow(temperature=0.8, top_k=20, seeds=77, freq_pen=0.5)
    first = [StepRow(list(range(3, 19)), 0, [1, 9], [SampleRow(0, greedy)]),          # 16-token prompt
             StepRow(list(range(30, 38)), 0, [2], [SampleRow(1, sampled)])]         # 8-token prompt
    extra = [StepRow([50 + i], 0, [3 + i], [SampleRow(2 + i, greedy)]) for i in range(6)]   # 1-token prompts
    runs = {}
    for name, rows in (("few", first), ("full", first + extra)):
        r = tiny_runner()
        assert r.few_samples == 2
        out1 = r.step(rows, greedy=False)
        key, args = r._step_args(rows)
        assert key[0] == 32 and args[3].shape[0] == 8          # both runs: the same bucket, 8 sample rows
        # decode two more tokens for the first two rows (penalties now see the drawn tokens)
        toks = out1.tokens[:2].tolist()
        outs = [out1]
        for pos in range(2):
            dec = [StepRow([toks[0]], 16 + pos, [1, 9], [SampleRow(0, greedy)]),
                   StepRow([toks[1]], 8 + pos, [2], [SampleRow(1, SamplingRow(**{**sampled.__dict__, "steps": pos + 1}))])]
            o = r.step(dec + (extra if name == "full" else []), greedy=False)
            toks = o.tokens[:2].tolist()
            outs.append(o)
        runs[name] = (outs, r)
    for a, b in zip(runs["few"][0], runs["full"][0]):
        assert a.tokens[:2].tolist() == b.tokens[:2].tolist()
        np.testing.assert_allclose(a.logprobs[:2], b.logprobs[:2], atol=1e-5)
        np.testing.assert_allclose(a.top_values[:2], b.top_values[:2], atol=1e-5)
        assert a.top_ids[:2].tolist() == b.top_ids[:2].tolist()
    counts_few = np.asarray(runs["few"][1].state["counts"])[:2]
    counts_full = np.asarray(runs["full"][1].state["counts"])[:2]
    assert counts_few.sum() == 6 and (counts_few == counts_full).all()


def test_the_step_program_holds_a_two_row_lm_head_beside_the_full_one():
    r = tiny_runner()
    rows = [StepRow(list(range(3, 19)), 0, [1], [SampleRow(0, SamplingRow())])]
    key, args = r._step_args(rows)
    hlo = r.programs.get("step", key, args).as_text()
    assert f"f32[2,{V}]" in hlo and f"f32[8,{V}]" in hlo


def test_logprobs_are_computed_only_when_a_sample_row_asks():
    """SamplingRow.logprobs gates the step's logprob / top-N branch: a step where no row asks
    returns zeros there (the tokens unchanged); one asking row gets what an all-asking step gives
    (the flag is data: the same program either way)."""
    rows = lambda want: [StepRow(list(range(3, 19)), 0, [1], [SampleRow(0, SamplingRow(logprobs=want[0]))]),  # noqa: E731
                         StepRow(list(range(30, 38)), 0, [2], [SampleRow(1, SamplingRow(logprobs=want[1]))])]
    outs = {}
    for want in ((True, True), (False, False), (False, True)):
        r = tiny_runner()
        outs[want] = r.step(rows(want), greedy=True)
    full, none, one = outs[True, True], outs[False, False], outs[False, True]
    assert full.tokens[:2].tolist() == none.tokens[:2].tolist() == one.tokens[:2].tolist()
    assert np.all(full.logprobs[:2] < 0) and np.all(full.top_values[:2] < 0)
    assert np.all(none.logprobs[:2] == 0) and np.all(none.top_values[:2] == 0) and np.all(none.top_ids[:2] == 0)
    np.testing.assert_array_equal(one.logprobs[:2], full.logprobs[:2])      # the step computes every row then
    np.testing.assert_array_equal(one.top_ids[:2], full.top_ids[:2])
