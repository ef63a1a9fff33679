"""Scheduler behaviour through the Engine interface with a tiny real decoder."""
from __future__ import annotations

import asyncio
import random

import jax.numpy as jnp
import numpy as np
import pytest

from jax_engine.decode.page_pool import chain_hashes
from jax_engine.decode.rows import SamplingRow
from jax_engine.errors import InvalidRequest, Overloaded
from jax_engine.types import EmbedRequest, GenerateRequest, SamplingParams
from tests.helpers.engines import PS, build_tiny_decoder, make_engine, run


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_decoder(str(tmp_path_factory.mktemp("demo")))


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = make_engine(model_dir)
    yield eng
    eng.shutdown()


def greedy(prompt, new_tokens, **kw):
    return dict(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True, **kw)


def test_concurrent_greedy_equals_sequential(engine):
    rng = random.Random(0)
    reqs = [([rng.randrange(10, 500) for _ in range(rng.randrange(1, 40))], rng.randrange(1, 24)) for _ in range(64)]

    async def main():
        seq = [await run(engine, p, **greedy(p, n)) for p, n in reqs[:16]]
        conc = await asyncio.gather(*[run(engine, p, **greedy(p, n)) for p, n in reqs])
        return seq, conc

    seq, conc = asyncio.run(main())
    for (p, n), a, b in zip(reqs, seq, conc):
        assert a[0]["tokens"] == b[0]["tokens"]
    for (p, n), b in zip(reqs, conc):
        assert len(b[0]["tokens"]) == n and b[0]["final"].finish_reason == "length"
    # the remaining 48 against one-at-a-time runs too
    rest = asyncio.run(_sequential(engine, reqs[16:]))
    for a, b in zip(rest, conc[16:]):
        assert a[0]["tokens"] == b[0]["tokens"]


async def _sequential(engine, reqs):
    return [await run(engine, p, **greedy(p, n)) for p, n in reqs]


def test_seeded_sampling_reproducible_and_batch_independent(engine):
    p = [5, 6, 7, 8]
    kw = dict(temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=1234)

    async def main():
        alone = await run(engine, p, **kw)
        noise = [run(engine, [9 + i] * (3 + i), temperature=0.8, max_new_tokens=12, seed=i) for i in range(5)]
        together = (await asyncio.gather(run(engine, p, **kw), *noise))[0]
        other_seed = await run(engine, p, **{**kw, "seed": 99})
        return alone, together, other_seed

    alone, together, other = asyncio.run(main())
    assert alone[0]["tokens"] == together[0]["tokens"]
    assert alone[0]["tokens"] != other[0]["tokens"]


def test_top_k_one_is_greedy_and_filters_restrict_support(engine):
    p = [20, 21, 22]

    async def main():
        g = await run(engine, p, **greedy(p, 8))
        k1 = await run(engine, p, temperature=1.5, top_k=1, max_new_tokens=8, ignore_eos=True, seed=7)
        lp = await run(engine, p, temperature=0.0, max_new_tokens=1, top_logprobs=5, logprobs=True)
        draws = {}
        # a peaked distribution with known shares: 10 > 9.5 > 9 (about 0.50 / 0.30 / 0.18 of the mass)
        peak = {101: 10.0, 102: 9.5, 103: 9.0}
        for name, extra in [("k3", dict(top_k=3)), ("p", dict(top_p=0.4, logit_bias=peak)),
                            ("minp", dict(min_p=0.5, logit_bias=peak)), ("peak", dict(logit_bias=peak))]:
            outs = await asyncio.gather(*[run(engine, p, temperature=1.0, max_new_tokens=1, seed=s, **extra)
                                          for s in range(40)])
            draws[name] = {o[0]["tokens"][0] for o in outs}
        free = await asyncio.gather(*[run(engine, p, temperature=5.0, max_new_tokens=1, seed=s) for s in range(40)])
        return g, k1, lp, draws, {o[0]["tokens"][0] for o in free}

    g, k1, lp, draws, free = asyncio.run(main())
    assert k1[0]["tokens"] == g[0]["tokens"]
    top = [t for t, _ in lp[0]["logprobs"][0].top]
    assert draws["k3"] <= set(top[:3]) and len(draws["k3"]) >= 2
    assert draws["p"] == {101}             # 101 alone holds more than 40% of the mass
    assert draws["minp"] == {101, 102}     # 103 is below half of 101's probability
    assert {101, 102, 103} <= draws["peak"]
    assert len(free) > 10                  # unrestricted sampling at high temperature spreads widely


def test_logit_bias_forces_token(engine):
    out = asyncio.run(run(engine, [3, 4, 5], temperature=1.0, max_new_tokens=6, ignore_eos=True,
                          logit_bias={321: 100.0}, seed=1))
    assert out[0]["tokens"] == [321] * 6


def test_penalties_match_transformers_processors():
    import jax.numpy as jnp
    import torch
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from jax_engine.decode import sampling

    rng = np.random.default_rng(0)
    V, R = 50, 3
    logits = rng.standard_normal((R, V)).astype(np.float32) * 3
    prompt = [[1, 2, 3], [4, 4], [7]]
    output = [[3, 5, 5], [9], []]
    counts = np.zeros((R, V), np.int32)
    pm = np.zeros((R, V), bool)
    for i in range(R):
        pm[i, prompt[i]] = True
        for t in output[i]:
            counts[i, t] += 1
    rows = [SamplingRow(temperature=1.0, rep_pen=1.3, freq_pen=0.5, pres_pen=0.25)] * R
    sa = sampling.SamplingArrays(**{k: jnp.asarray(v) for k, v in sampling.host_arrays(rows, R, 4, 4).items()})
    ours = np.asarray(sampling.process_logits(jnp.asarray(logits), sa, jnp.asarray(counts), jnp.asarray(pm)))
    for i in range(R):
        ids = torch.tensor([prompt[i] + output[i]])
        ref = RepetitionPenaltyLogitsProcessor(1.3)(ids, torch.tensor(logits[i:i + 1])).numpy()[0]
        ref = ref - 0.5 * counts[i] - 0.25 * (counts[i] > 0)   # OpenAI frequency / presence formula
        np.testing.assert_allclose(ours[i], ref, rtol=1e-6, atol=1e-6)


def test_stop_conditions_and_finish_reasons(engine, model_dir):
    p = "the quick brown fox"

    async def main():
        base = await run(engine, p, **greedy(p, 24))
        return base

    base = asyncio.run(main())[0]
    tok = engine.tokenizer("gen")
    ids, text = base["tokens"], base["text"]
    assert text == tok.decode(ids, skip_special_tokens=True)
    lens = [len(tok.decode(ids[:i], skip_special_tokens=True)) for i in range(len(ids) + 1)]
    # a 2-character stop string made of the last char of token i-1 and the first of token i
    cut = None
    for i in range(2, len(ids) - 1):
        if lens[i] > lens[i - 1] and lens[i + 1] > lens[i] and text.find(text[lens[i] - 1:lens[i] + 1]) == lens[i] - 1:
            cut = i
            break
    assert cut is not None, "no usable token boundary in the sample output"
    start = lens[cut] - 1
    stop = text[start:start + 2]

    async def more():
        s = await run(engine, p, **greedy(p, 24, stop=[stop]))
        s_inc = await run(engine, p, **greedy(p, 24, stop=[stop], include_stop_str_in_output=True))
        tid = await run(engine, p, **greedy(p, 24, stop_token_ids=[base["tokens"][4]]))
        eos = await run(engine, [5, 6], temperature=1.0, max_new_tokens=8, logit_bias={2: 100.0}, seed=0)
        min_new = await run(engine, [5, 6], temperature=1.0, max_new_tokens=8, min_new_tokens=5,
                            logit_bias={2: 100.0}, seed=0)
        ign = await run(engine, [5, 6], temperature=1.0, max_new_tokens=8, ignore_eos=True,
                        logit_bias={2: 100.0}, seed=0)
        return s, s_inc, tid, eos, min_new, ign

    s, s_inc, tid, eos, min_new, ign = asyncio.run(more())
    f = s[0]["final"]
    assert f.finish_reason == "stop" and f.matched_stop == stop
    assert s[0]["text"] == text[:start] and s[0]["tokens"] == ids[:cut + 1]
    assert s_inc[0]["text"] == text[:start] + stop
    f = tid[0]["final"]
    first = base["tokens"].index(base["tokens"][4])
    assert f.finish_reason == "stop" and f.matched_stop == base["tokens"][4]
    assert tid[0]["tokens"] == base["tokens"][:first + 1]
    assert eos[0]["tokens"] == [2] and eos[0]["final"].matched_stop == 2
    assert min_new[0]["tokens"][-1] == 2 and len(min_new[0]["tokens"]) == 6
    assert 2 not in min_new[0]["tokens"][:5]
    assert ign[0]["tokens"] == [2] * 8 and ign[0]["final"].finish_reason == "length"


def test_logprobs_and_prompt_logprobs(engine):
    p = list(range(30, 50))
    out = asyncio.run(run(engine, p, **greedy(p, 4, logprobs=True, top_logprobs=3, prompt_logprobs_start=0)))[0]
    assert len(out["logprobs"]) == 4
    for lp, t in zip(out["logprobs"], out["tokens"]):
        assert lp.token_id == t and lp.top[0][0] == t and abs(lp.top[0][1] - lp.logprob) < 1e-5
        assert [v for _, v in lp.top] == sorted([v for _, v in lp.top], reverse=True)
    pl = out["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(p)
    assert [x.token_id for x in pl[1:]] == p[1:]
    assert all(x.logprob <= 0 and len(x.top) == 3 for x in pl[1:])
    out2 = asyncio.run(run(engine, p, **greedy(p, 1, prompt_logprobs_start=15)))[0]
    assert [x.token_id for x in out2["prompt_logprobs"]] == p[15:]
    assert abs(out2["prompt_logprobs"][0].logprob - pl[15].logprob) < 1e-5


def test_n_sequences_share_prompt(engine):
    p = list(range(40, 61))     # 21 tokens: 2 full pages + a partial one
    out = asyncio.run(run(engine, p, temperature=1.0, max_new_tokens=10, n=3, seed=5, ignore_eos=True))
    assert sorted(out) == [0, 1, 2]
    assert len({tuple(out[i]["tokens"]) for i in out}) >= 2
    g = asyncio.run(run(engine, p, **greedy(p, 10, n=2)))
    assert g[0]["tokens"] == g[1]["tokens"] == asyncio.run(run(engine, p, **greedy(p, 10)))[0]["tokens"]
    assert engine.stats("gen").pages_used == 0


def test_prefix_cache_reuse(engine):
    shared = list(range(100, 100 + 3 * PS))

    async def main():
        a = await run(engine, shared + [7, 8, 9], **greedy(None, 8))
        b = await run(engine, shared + [7, 8, 9], **greedy(None, 8))
        c = await run(engine, shared + [10, 11], **greedy(None, 8))
        return a, b, c

    hits0 = engine.stats("gen").prefix_cache_hit_tokens
    a, b, c = asyncio.run(main())
    assert b[0]["final"].cached_tokens == 3 * PS and c[0]["final"].cached_tokens == 3 * PS
    assert a[0]["tokens"] == b[0]["tokens"]
    assert engine.stats("gen").prefix_cache_hit_tokens - hits0 >= 6 * PS


def test_a_page_aligned_prompt_asked_again_computes_only_its_last_token(engine):
    p = list(range(300, 300 + 3 * PS))          # 3 full pages, nothing after them
    sched = engine._workers["gen"].replicas[0]
    first = asyncio.run(run(engine, p, **greedy(None, 8, logprobs=True)))[0]
    pages = [sched.pool._page_of[h] for h in chain_hashes(p, PS)]
    k0, v0 = np.asarray(sched.runner.state["k"]), np.asarray(sched.runner.state["v"])
    computed0 = sched.total_prompt_tokens
    again = asyncio.run(run(engine, p, **greedy(None, 8, logprobs=True)))[0]
    assert sched.total_prompt_tokens - computed0 == 1 and again["final"].cached_tokens == 3 * PS - 1
    assert again["tokens"] == first["tokens"]
    np.testing.assert_allclose([lp.logprob for lp in again["logprobs"]], [lp.logprob for lp in first["logprobs"]],
                               atol=1e-5)
    # the shared pages' KV is exactly as the first request wrote it
    k1, v1 = np.asarray(sched.runner.state["k"]), np.asarray(sched.runner.state["v"])
    assert k0.ndim == 4                          # [L, pages * page_size, KVH, D]
    rows = np.concatenate([np.arange(q * PS, (q + 1) * PS) for q in pages])
    assert np.array_equal(k0[:, rows], k1[:, rows]) and np.array_equal(v0[:, rows], v1[:, rows])
    # and the last token's KV is read, never written: a marked value there survives a third ask
    last = pages[-1] * PS + PS - 1
    marked = k1.copy()
    marked[:, last] += 1.0
    sched.runner.state = {**sched.runner.state, "k": jnp.asarray(marked)}
    asyncio.run(run(engine, p, **greedy(None, 2)))
    assert np.array_equal(np.asarray(sched.runner.state["k"])[:, last], marked[:, last])
    sched.runner.state = {**sched.runner.state, "k": jnp.asarray(k1)}
    assert engine.compilations_after_warmup() == 0      # the 1-token row is data, not a new program


def test_tiny_pool_preempts_and_stays_correct(model_dir, engine):
    rng = random.Random(1)
    reqs = [([rng.randrange(10, 500) for _ in range(rng.randrange(5, 20))], 20) for _ in range(32)]
    expected = asyncio.run(_sequential(engine, reqs))
    small = make_engine(model_dir, warmup=False, num_pages=14, enable_prefix_cache=False)
    try:
        got = asyncio.run(_gather(small, reqs))
        st = small.stats("gen")
        assert st.preemptions > 0, "the pool was meant to be too small to hold all sequences"
        for a, b in zip(expected, got):
            assert a[0]["tokens"] == b[0]["tokens"]
        assert st.pages_used == 0
        # a pool that evicts cached pages under pressure stays correct too
        evicting = make_engine(model_dir, warmup=False, num_pages=14, enable_prefix_cache=True)
        got2 = asyncio.run(_gather(evicting, reqs + reqs[:8]))
        for a, b in zip(expected + expected[:8], got2):
            assert a[0]["tokens"] == b[0]["tokens"]
        evicting.shutdown()
    finally:
        small.shutdown()


async def _gather(engine, reqs):
    return await asyncio.gather(*[run(engine, p, **greedy(p, n)) for p, n in reqs])


def test_abort_and_abandon_return_pages(engine):
    async def main():
        req = GenerateRequest(request_id="abort-me", prompt_ids=list(range(10, 40)),
                              params=SamplingParams(temperature=0, max_new_tokens=90, ignore_eos=True))
        it = engine.generate(req)
        first = await it.__anext__()
        assert engine.abort("abort-me") is True
        rest = [o async for o in it]
        # an abandoned iterator aborts its request too
        req2 = GenerateRequest(request_id="abandon", prompt_ids=list(range(10, 40)),
                               params=SamplingParams(temperature=0, max_new_tokens=90, ignore_eos=True, n=2))
        it2 = engine.generate(req2)
        await it2.__anext__()
        await it2.aclose()
        for _ in range(200):
            if engine.stats("gen").running_requests == 0:
                break
            await asyncio.sleep(0.01)
        return first, rest

    first, rest = asyncio.run(main())
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert first.completion_tokens + sum(len(o.new_token_ids) for o in rest) < 90
    st = engine.stats("gen")
    assert st.pages_used == 0 and st.running_requests == 0 and st.waiting_requests == 0
    assert engine.abort("unknown-id") is False


def test_randomized_mix_compiles_nothing(engine):
    rng = random.Random(3)

    def params():
        kw = dict(max_new_tokens=rng.randrange(1, 12), temperature=rng.choice([0.0, 0.7, 1.3]),
                  ignore_eos=rng.random() < 0.5, seed=rng.randrange(1000))
        if rng.random() < 0.3:
            kw.update(top_k=rng.randrange(1, 20), top_p=rng.uniform(0.2, 1.0), min_p=rng.uniform(0, 0.2))
        if rng.random() < 0.3:
            kw.update(logprobs=True, top_logprobs=rng.randrange(0, 5))
        if rng.random() < 0.2:
            kw.update(n=rng.randrange(1, 4))
        if rng.random() < 0.2:
            kw.update(stop=["e", "th"], repetition_penalty=1.2, presence_penalty=0.5)
        if rng.random() < 0.1:
            kw.update(prompt_logprobs_start=0)
        return kw

    async def main():
        jobs = [run(engine, [rng.randrange(10, 500) for _ in range(rng.randrange(1, 100))], **params())
                for _ in range(200)]
        return await asyncio.gather(*jobs)

    outs = asyncio.run(main())
    assert len(outs) == 200 and all(all(r["final"] is not None for r in o.values()) for o in outs)
    assert engine.compilations_after_warmup() == 0


def test_validation_and_overload(model_dir, engine):
    async def expect(exc, match, prompt=None, **kw):
        with pytest.raises(exc, match=match):
            await run(engine, prompt if prompt is not None else [1, 2, 3], **kw)

    async def main():
        await expect(InvalidRequest, "prompt.*empty", prompt=[])
        await expect(InvalidRequest, "out of range", prompt=[1, 99999])
        await expect(InvalidRequest, "exceeds the context length 128", max_new_tokens=126)
        await expect(InvalidRequest, "prompt: 200 tokens exceeds", prompt=[5] * 200)
        await expect(InvalidRequest, "temperature", temperature=float("nan"))
        await expect(InvalidRequest, "top_p", top_p=0.0)
        await expect(InvalidRequest, "n: must be in", n=100)
        await expect(InvalidRequest, "top_logprobs", top_logprobs=50)
        await expect(InvalidRequest, "stop: 40 stop strings", stop=["x"] * 40)
        await expect(InvalidRequest, "logit_bias", logit_bias={100000: 1.0})
        await expect(InvalidRequest, "max_new_tokens: must be >= 1", max_new_tokens=0)
    asyncio.run(main())

    full = make_engine(model_dir, warmup=False, max_waiting_requests=2, max_running_requests=1)
    try:
        async def flood():
            tasks = [asyncio.create_task(run(full, [1, 2, 3], request_id=f"r{i}", temperature=0.0,
                                             max_new_tokens=120, ignore_eos=True)) for i in range(3)]
            for _ in range(3):
                await asyncio.sleep(0)      # each task submits on its first step
            with pytest.raises(Overloaded, match="waiting queue is full"):
                await run(full, [1, 2], max_new_tokens=2)
            with pytest.raises(Overloaded, match="waiting queue is full"):   # the decoder as embedder too
                await full.embed(EmbedRequest(request_id="", token_ids=[[1, 2, 3]], model="gen"))
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(flood())
    finally:
        full.shutdown()


def test_fault_in_one_step_fails_only_its_requests(model_dir):
    eng = make_engine(model_dir, warmup=False, max_running_requests=2)
    runner = eng._workers["gen"].replicas[0].runner
    calls = {"step": 0}

    def hook(program: str) -> None:
        if program.startswith("step"):      # 1: both prompts (and first tokens), 2-3: decode both
            calls["step"] += 1
            if calls["step"] == 3:
                raise RuntimeError("injected fault")

    try:
        runner.fault_hook = hook
        before = eng.counters.snapshot()

        async def main():
            return await asyncio.gather(*[run(eng, [10 + i, 20, 30], **greedy(None, 6)) for i in range(3)])

        outs = asyncio.run(main())
        finals = [o[0]["final"] for o in outs]
        failed = [f for f in finals if f.finish_reason == "error"]
        ok = [f for f in finals if f.finish_reason == "length"]
        assert len(failed) == 2 and all("injected fault" in f.error for f in failed)
        assert len(ok) == 1 and ok[0].completion_tokens == 6       # the queued request was not in the step
        runner.fault_hook = None
        again = asyncio.run(run(eng, [1, 2, 3], **greedy(None, 4)))
        assert again[0]["final"].finish_reason == "length" and eng.healthy()
        st = eng.stats("gen")
        assert st.pages_used == 0 and st.running_requests == 0
        after = eng.counters.snapshot()
        delta = {k: after[k] - before[k] for k in after}
        assert delta == {"accepted": 4, "completed": 2, "errored": 2, "cancelled": 0}
    finally:
        eng.shutdown()


def test_fault_in_admission_fails_only_that_request(model_dir):
    """A failed set_slot (the penalty-state reset at admission) ends that request with an error,
    frees its pages and slot, and the next request is served normally."""
    eng = make_engine(model_dir, warmup=False)
    runner = eng._workers["gen"].replicas[0].runner
    calls = {"set_slot": 0}

    def hook(program: str) -> None:
        if program == "set_slot":
            calls["set_slot"] += 1
            if calls["set_slot"] == 1:
                raise RuntimeError("injected admission fault")

    try:
        runner.fault_hook = hook
        first = asyncio.run(run(eng, [5, 6, 7], **greedy(None, 4)))[0]["final"]
        assert first.finish_reason == "error" and "injected admission fault" in first.error
        second = asyncio.run(run(eng, [5, 6, 7], **greedy(None, 4)))[0]["final"]
        assert second.finish_reason == "length" and second.completion_tokens == 4
        st = eng.stats("gen")
        assert st.pages_used == 0 and st.running_requests == 0 and eng.healthy()
    finally:
        eng.shutdown()


def test_page_buckets_follow_the_attention_backend(model_dir):
    """The reference gathers each token's whole page bucket, so its step programs are bucketed by
    pages (--page-bucket-ratio); the CPU kernel reads only valid keys: one page bucket."""
    from frontends.cli import engine_args, parse_serve_args

    ns = parse_serve_args(["--model", model_dir, "--page-bucket-ratio", "4"])
    assert engine_args(ns).page_bucket_ratio == 4
    with pytest.raises(SystemExit):
        parse_serve_args(["--model", model_dir, "--page-bucket-ratio", "1"])
    for backend, want in (("reference", [1, 2, 4, 8, 16]), ("auto", [16])):   # 128 tokens / 8 = 16 pages
        eng = make_engine(model_dir, warmup=False, attention_backend=backend)
        try:
            r = eng._workers["gen"].replicas[0].runner
            assert r.page_buckets == want, backend
            keys = r.all_keys()
            assert {k[1][1] for k in keys if k[0] == "step"} == set(want)
            assert {k[1][0] for k in keys if k[0] == "step"} == set(r.token_buckets)
            assert len([k for k in keys if k[0] == "step"]) == len({k[1] for k in keys if k[0] == "step"})
            assert r.token_buckets == [1, 2, 4, 8, 16, 32, 64]
        finally:
            eng.shutdown()


def test_request_larger_than_the_pool_is_invalid(model_dir):
    eng = make_engine(model_dir, warmup=False, num_pages=6)    # 5 usable pages of 8 tokens
    try:
        with pytest.raises(InvalidRequest, match="needs 6 KV pages of 8 tokens but the pool has 5"):
            asyncio.run(run(eng, [1] * 20, max_new_tokens=25))
        out = asyncio.run(run(eng, [1] * 20, temperature=0.0, ignore_eos=True))   # default fits the pool
        assert out[0]["final"].finish_reason == "length" and out[0]["final"].completion_tokens == 20
    finally:
        eng.shutdown()


def gate_steps(runner):
    """Wrap runner.step: every step's rows are recorded in `steps`; gate.clear() holds the
    scheduler inside its next step until gate.set(). Returns (steps, gate, the original step)."""
    import threading

    steps: list = []
    gate = threading.Event()
    gate.set()
    step = runner.step

    def gated(rows, greedy_, masks=None):
        gate.wait()
        steps.append(rows)
        return step(rows, greedy_, masks)

    runner.step = gated
    return steps, gate, step


def test_one_ragged_step_mixes_decode_chunks_prompt_logprobs_and_a_fork(model_dir):
    """One step holds a running sequence's decode token, three prompt chunks of different lengths
    (one with prompt logprobs, one an n = 2 request whose two first tokens are drawn from the same
    row), and every request's output equals running it alone."""
    eng = make_engine(model_dir, warmup=False, max_num_batched_tokens=128)
    runner = eng._workers["gen"].replicas[0].runner
    steps, gate, step = gate_steps(runner)
    reqs = {
        "a": (list(range(10, 17)), greedy(None, 40)),
        "b": (list(range(50, 100)), greedy(None, 5)),
        "c": (list(range(200, 221)), greedy(None, 3, prompt_logprobs_start=0, logprobs=True, top_logprobs=2)),
        "d": (list(range(300, 311)), dict(temperature=0.9, max_new_tokens=6, n=2, seed=11, ignore_eos=True)),
    }
    try:
        async def mixed():
            a = asyncio.ensure_future(run(eng, reqs["a"][0], **reqs["a"][1]))
            while sum(len(r) for r in steps) < 3:       # a is decoding
                await asyncio.sleep(0.005)
            gate.clear()                                 # hold the scheduler inside its next step ...
            await asyncio.sleep(0.05)
            rest = [asyncio.ensure_future(run(eng, reqs[k][0], **reqs[k][1])) for k in "bcd"]
            await asyncio.sleep(0.3)                     # ... until b, c and d are all queued
            gate.set()
            return dict(zip("abcd", await asyncio.gather(a, *rest)))

        together = asyncio.run(mixed())
        mixed_steps = [rows for rows in steps if sum(len(r.tokens) > 1 for r in rows) == 3]
        assert mixed_steps, "b, c and d were not prefilled in one step"
        rows = mixed_steps[0]
        assert len(rows[0].tokens) == 1 and len(rows[0].samples) == 1             # a's decode token first
        assert sorted(len(r.tokens) for r in rows[1:]) == [11, 21, 50]
        assert sorted(len(r.samples) for r in rows[1:]) == [1, 1, 2]            # d's fork: two draws, one row
        runner.step = step
        for k, (prompt, params) in reqs.items():
            alone = asyncio.run(run(eng, prompt, **params))
            assert sorted(alone) == sorted(together[k])
            for i in alone:
                assert together[k][i]["tokens"] == alone[i]["tokens"], (k, i)
            if k == "c":
                got = [x.logprob for x in together[k][0]["prompt_logprobs"][1:]]
                want = [x.logprob for x in alone[0]["prompt_logprobs"][1:]]
                assert len(got) == 20 and np.allclose(got, want, atol=1e-5)
        assert eng.stats("gen").pages_used == 0
    finally:
        runner.step = step
        gate.set()
        eng.shutdown()


def test_burst_budget_prefills_a_backlog_then_returns_to_the_latency_budget(model_dir):
    """With burst_min_prompts prompts waiting, a step takes up to the burst budget (decode token
    first, then the prompts' chunks filling it); with fewer waiting it is back at the latency
    budget; with nothing decoding a prompt is prefilled in one burst step. Outputs equal
    one-at-a-time runs, and the burst buckets were compiled at warmup."""
    eng = make_engine(model_dir, max_num_batched_tokens=32, burst_batched_tokens=128, burst_min_prompts=3,
                      enable_prefix_cache=False,    # every run computes its whole prompt
                      itl_p99_ratio=0)              # the burst rule alone (the latency guard: test below)
    sched = eng._workers["gen"].replicas[0]
    runner = sched.runner
    assert runner.token_buckets == [1, 2, 4, 8, 16, 32, 64, 128] and (sched.budget, sched.burst) == (32, 128)
    steps, gate, step = gate_steps(runner)
    a = (list(range(10, 17)), greedy(None, 30))
    backlog = [(list(range(40 + 50 * i, 80 + 50 * i)), greedy(None, 4)) for i in range(4)]   # 4 x 40 tokens
    pair = [(list(range(20 + 60 * i, 60 + 60 * i)), greedy(None, 3)) for i in range(2)]       # 2 x 40 tokens

    async def behind_a(group):
        first = asyncio.ensure_future(run(eng, a[0], **a[1]))
        while sum(len(r) for r in steps) < 3:             # a is decoding
            await asyncio.sleep(0.005)
        gate.clear()                                      # hold the scheduler inside its next step ...
        await asyncio.sleep(0.05)
        rest = [asyncio.ensure_future(run(eng, p, **kw)) for p, kw in group]
        await asyncio.sleep(0.3)                          # ... until the whole group is admitted
        start = len(steps)
        gate.set()
        outs = await asyncio.gather(first, *rest)
        return outs, [sum(len(r.tokens) for r in rows) for rows in steps[start:]]

    try:
        before = eng.compilations_after_warmup()
        outs, sizes = asyncio.run(behind_a(backlog))
        # 4 waiting >= 3: a's token + 127 prompt tokens in one step, then 33 left for one prompt
        # alone (below the threshold): back to 32 per step (a, the prompt's chunk, first tokens)
        assert sizes[1] == 128, sizes
        assert max(sizes[2:]) <= 32, sizes
        assert sched.burst_steps >= 1
        burst_steps = sched.burst_steps
        steps.clear()
        outs2, sizes2 = asyncio.run(behind_a(pair))     # 2 waiting < 3: the latency budget holds
        assert max(sizes2[1:]) <= 32 and sched.burst_steps == burst_steps, sizes2
        for (prompt, params), got in zip([a] + backlog + pair, outs + outs2[1:]):
            steps.clear()          # alone on an idle engine: the whole prompt in one burst step
            assert asyncio.run(run(eng, prompt, **params))[0]["tokens"] == got[0]["tokens"]
            assert sum(len(r.tokens) for r in steps[0]) == len(prompt), prompt
        runner.step = step
        assert eng.compilations_after_warmup() == before == 0
        assert eng.stats("gen").burst_steps == sched.burst_steps and eng.stats("gen").pages_used == 0
    finally:
        runner.step = step
        gate.set()
        eng.shutdown()


def test_burst_budget_is_capped_by_what_a_step_can_hold(model_dir):
    """2 rows of at most 64 tokens hold 128 tokens: a 256 burst budget becomes 128, and every
    program's example arguments build (the warm-up would compile each of them)."""
    eng = make_engine(model_dir, warmup=False, max_running_requests=2, max_model_len=64, max_num_batched_tokens=32,
                      burst_batched_tokens=256, itl_p99_ratio=0)
    try:
        sched = eng._workers["gen"].replicas[0]
        runner = sched.runner
        assert runner.max_tokens == sched.burst == 128 and runner.token_buckets[-2:] == [64, 128]
        for prog, key in runner.all_keys():
            runner._example(prog, key)
    finally:
        eng.shutdown()


def test_latency_guard_lets_a_prompt_beside_a_stream_through_in_one_step_or_chunks_it(model_dir):
    """With the latency guard on (the default where a burst budget exists), a prompt arriving
    beside a decoding stream is prefilled in one step past the latency budget while the guard's
    measurements allow it, and chunked at the budget when they do not; the x1.25 buckets above
    the budget were compiled at warmup (no compile after it), outputs equal one-at-a-time runs."""
    eng = make_engine(model_dir, max_num_batched_tokens=16, burst_batched_tokens=64, burst_min_prompts=4,
                      enable_prefix_cache=False)
    sched = eng._workers["gen"].replicas[0]
    runner = sched.runner
    assert sched.guard is not None and sched.guard.ratio == 4.0
    assert runner.token_buckets == [1, 2, 4, 8, 16, 20, 24, 28, 32, 40, 48, 56, 64]
    steps, gate, step = gate_steps(runner)
    a = (list(range(10, 17)), greedy(None, 40))
    b = (list(range(40, 80)), greedy(None, 4))          # 40 prompt tokens

    async def beside_a():
        first = asyncio.ensure_future(run(eng, a[0], **a[1]))
        while sum(len(r) for r in steps) < 3:             # a is decoding
            await asyncio.sleep(0.005)
        gate.clear()
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(run(eng, b[0], **b[1]))
        await asyncio.sleep(0.3)                          # b admitted
        start = len(steps)
        gate.set()
        outs = await asyncio.gather(first, second)
        sizes = [sum(len(r.tokens) for r in rows) for rows in steps[start:]]
        return outs, sizes

    try:
        outs, sizes = asyncio.run(beside_a())
        # the step gate.clear() held was a's decode step; then a's token + b's 40 in one step
        assert sizes[1] == 41, sizes
        g = sched.guard
        for bucket in runner.token_buckets:
            if bucket > 16:
                g.cost[bucket] = 1e6                      # every step past the budget now looks long
        g.share = 0.0
        steps.clear()
        outs2, sizes2 = asyncio.run(beside_a())
        assert max(sizes2) <= 16 and sizes2[1:4] == [16, 16, 11], sizes2     # 15 + 15 + 10 beside a's token
        for (prompt, params), got in zip([a, b], outs):
            alone = asyncio.run(run(eng, prompt, **params))[0]["tokens"]
            assert got[0]["tokens"] == alone
        assert [o[0]["tokens"] for o in outs2] == [o[0]["tokens"] for o in outs]
        runner.step = step
        assert eng.compilations_after_warmup() == 0
    finally:
        runner.step = step
        gate.set()
        eng.shutdown()
