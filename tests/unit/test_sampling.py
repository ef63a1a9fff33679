"""The on-device sampler against a NumPy statement of the rules (no engine, no model).

Kept set: temperature -> top-k -> top-p over the renormalised top-k mass -> min-p; the candidate
path (cut among the best 64) and the exact bisection path must agree with the reference and with
each other, and the draw must follow the kept, renormalised distribution.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_engine.decode import sampling as S
from jax_engine.decode.rows import SamplingRow

BASE = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, rep_pen=1.0, freq_pen=0.0, pres_pen=0.0,
            seeds=0, steps=0, bias=[], ban=[])
_sample = jax.jit(S.sample)


def arrays(rows: list[dict]) -> S.SamplingArrays:
    host = S.host_arrays([SamplingRow(**{**BASE, **r}) for r in rows], len(rows), 4, 4)
    return S.SamplingArrays(**{k: jnp.asarray(v) for k, v in host.items()})


def kept_reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The rules in plain NumPy, by a full sort."""
    s = logits.astype(np.float64) / temperature
    order = np.argsort(-s, kind="stable")
    p = np.exp(s[order] - s[order[0]])
    k = len(s) if top_k <= 0 else top_k
    p[k:] = 0.0
    mass = p.sum()
    above = np.cumsum(p) - p
    keep = (p > 0) & (above < top_p * mass) & (p >= min_p)
    keep[0] = True
    return set(order[keep].tolist())


def draw_support(logits: np.ndarray, row: dict, draws: int) -> tuple[set[int], np.ndarray]:
    """Tokens drawn for one row over `draws` seeds (one batch of rows, each its own seed)."""
    rows = [{**row, "seeds": s} for s in range(draws)]
    toks = np.asarray(_sample(jnp.asarray(np.broadcast_to(logits, (draws, logits.size)).copy()), arrays(rows)))
    return set(toks.tolist()), toks


def test_issue_example_top_k_then_top_p_over_the_renormalised_mass():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    got, _ = draw_support(logits, dict(top_k=2, top_p=0.5), 64)
    assert got == {0}          # [.4, .3] renormalised: .571 >= .5 after the first token
    got, _ = draw_support(logits, dict(top_k=2, top_p=0.6), 64)
    assert got == {0, 1}
    got, _ = draw_support(logits, dict(top_k=3, top_p=0.95), 256)
    assert got == {0, 1, 2}


@pytest.mark.parametrize("vocab", [50, 1000, 5000])
@pytest.mark.parametrize("params", [
    dict(temperature=0.7, top_k=50, top_p=0.9),     # candidate path (top_k <= 64)
    dict(temperature=1.0, top_k=0, top_p=0.3),      # cut among the candidates or beyond them
    dict(temperature=1.5, top_k=0, top_p=0.95),     # bisection path on the larger vocabularies
    dict(temperature=1.0, top_k=200, top_p=0.8),    # top_k above the prefilter: bisection
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2),
    dict(temperature=0.5, top_k=10, top_p=1.0, min_p=0.5),
    dict(temperature=1.0, top_k=3, top_p=1.0),
])
def test_support_matches_the_reference(vocab, params):
    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
    want = kept_reference(logits, params["temperature"], params["top_k"], params["top_p"], params.get("min_p", 0.0))
    got, toks = draw_support(logits, params, 512)
    assert got <= want, sorted(got - want)[:10]
    if len(want) <= 8:          # small kept sets: 512 draws reach every member
        assert got == want


def test_frequencies_follow_the_renormalised_distribution():
    logits = np.log(np.array([0.05, 0.3, 0.1, 0.25, 0.2, 0.09], np.float32))
    # top-4 {1, 3, 4, 2} renormalised .353 .294 .235 .118: top_p .8 keeps {1, 3, 4}
    params = dict(temperature=1.0, top_k=4, top_p=0.8)
    kept = kept_reference(logits, 1.0, 4, 0.8, 0.0)
    assert kept == {1, 3, 4}
    p = np.exp(logits.astype(np.float64))
    expect = np.array([p[i] if i in kept else 0.0 for i in range(6)])
    expect /= expect.sum()
    n = 4000
    _, toks = draw_support(logits, params, n)
    counts = np.bincount(toks, minlength=6)
    assert counts[expect == 0].sum() == 0
    chi2 = (((counts - n * expect) ** 2) / np.where(expect > 0, n * expect, 1))[expect > 0].sum()
    assert chi2 < 13.8, (counts, expect * n)   # chi-square, 2 dof, p = 0.001


def test_greedy_rows_take_the_first_maximum():
    logits = np.zeros((3, 300), np.float32)
    logits[0, [7, 200]] = 5.0               # a tie: the lower index wins, as argmax
    logits[1, 299] = 1.0
    logits[2, 0] = -1.0
    toks = np.asarray(_sample(jnp.asarray(logits), arrays([dict(temperature=0.0)] * 3)))
    assert toks.tolist() == [7, 299, 1]
    assert np.asarray(S.greedy(jnp.asarray(logits))).tolist() == [7, 299, 1]


def test_a_row_draws_the_same_token_whichever_path_its_batch_takes():
    """A batch with a row that needs the bisection runs the exact path for everyone; the other
    rows must not notice (a seeded request draws the same tokens whatever else is in the batch)."""
    rng = np.random.default_rng(3)
    V = 4000
    logits = (rng.standard_normal((8, V)) * 2).astype(np.float32)
    rows = [dict(temperature=0.8, top_k=40, top_p=0.9, seeds=2 ** 40 + i, steps=i) for i in range(8)]
    alone = np.asarray(_sample(jnp.asarray(logits), arrays(rows)))
    wide = dict(temperature=2.0, top_k=0, top_p=0.99, seeds=1)
    mixed = np.asarray(_sample(jnp.asarray(np.vstack([logits, logits[:1]])), arrays(rows + [wide])))
    assert mixed[:8].tolist() == alone.tolist()


def test_all_64_bits_of_the_seed_select_the_stream():
    logits = np.zeros(1000, np.float32)
    low, _ = draw_support(logits, dict(seeds=5), 1)
    a = [int(np.asarray(_sample(jnp.asarray(logits[None]), arrays([dict(seeds=5 + (h << 32), steps=s)])))[0])
         for h in (0, 1) for s in range(16)]
    assert a[:16] != a[16:]
    assert S.seed_key(2 ** 64 - 1) == (0xFFFFFFFF, 0xFFFFFFFF) and S.seed_key(7) == (0, 7)
    with pytest.raises(ValueError):
        S.seed_key(2 ** 64)


def test_banned_and_masked_tokens_are_never_drawn():
    logits = np.zeros(300, np.float32)
    logits[:150] = S.NEG_INF                  # a -inf-like mask over half the vocabulary
    got, _ = draw_support(logits, dict(temperature=1.0), 256)
    assert min(got) >= 150


def test_ties_at_the_cut_are_kept():
    """One threshold per row: tokens tied with the last kept one stay (as vLLM's top-k mask)."""
    logits = np.array([2.0, 1.0, 2.0, 2.0, 0.5], np.float32)
    got, _ = draw_support(logits, dict(top_k=2), 256)
    assert got == {0, 2, 3}


def test_host_arrays_packs_every_field_of_every_row_where_that_row_sits():
    """host_arrays fills its arrays a column at a time (runner._step_args' host cost): every field
    of every live row lands in that row's slot, padding rows (None, also between live ones) keep
    the greedy no-op defaults, all 64 bits of a seed are kept, and a seed outside [0, 2^64) is
    refused by name."""
    rows = [SamplingRow(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, rep_pen=1.2, freq_pen=0.3,
                        pres_pen=-0.4, seeds=2 ** 64 - 3, steps=41, bias=[(7, 2.5), (3, -1.0)], ban=[9],
                        logprobs=True),
            None,
            SamplingRow(temperature=0.1234567, top_k=0, seeds=123456789012, steps=0, logprobs=False),
            None]
    out = S.host_arrays(rows, 5, 4, 4)
    for i, r in ((0, rows[0]), (2, rows[2])):
        for k in ("temperature", "top_p", "min_p", "rep_pen", "freq_pen", "pres_pen"):
            assert out[k][i] == np.float32(getattr(r, k)), (i, k)
        assert out["top_k"][i] == r.top_k and out["steps"][i] == r.steps and out["logprobs"][i] == r.logprobs
        assert tuple(out["seeds"][i]) == S.seed_key(r.seeds)
    assert out["bias_ids"][0].tolist() == [7, 3, 0, 0] and out["bias_vals"][0].tolist() == [2.5, -1.0, 0, 0]
    assert out["ban_ids"][0].tolist() == [9, 0, 0, 0] and out["ban_on"][0].tolist() == [True, False, False, False]
    for i in (1, 3, 4):
        assert out["temperature"][i] == 0 and out["top_p"][i] == 1 and out["rep_pen"][i] == 1
        assert out["steps"][i] == 0 and not out["logprobs"][i] and not out["seeds"][i].any()
    for bad in (-1, 2 ** 64):
        with pytest.raises(ValueError, match="seed"):
            S.host_arrays([SamplingRow(seeds=bad)], 1, 4, 4)
