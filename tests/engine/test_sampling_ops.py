"""The step tail's two-level reductions (sampling.greedy, sampling.logprobs_of) against numpy.

Both read the vocabulary in BLOCK-wide blocks (block maxima first, then the chosen blocks), so the
cases that matter are ties across and inside blocks, a vocabulary that is not a whole number of
blocks (the padded tail block), and rows where every token is banned (NEG_INF everywhere)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_engine.decode import sampling

# whole blocks, a ragged tail block, and the small-vocabulary one-level path
VOCABS = [4 * sampling.BLOCK, 7 * sampling.BLOCK + 37, 1000, 3 * sampling.BLOCK + 5]


def _rows(V: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((6, V)).astype(np.float32)
    B = sampling.BLOCK
    x[1, [3, V - 1]] = 9.0                       # tie across the first and the (padded) last block
    x[2, [B + 5, B + 9]] = 9.0                   # tie inside one block
    x[3] = sampling.NEG_INF                      # every token banned
    x[4, :] = 0.0                                # all equal
    x[5, V - 1] = 50.0                           # the maximum in the ragged tail block
    return x


@pytest.mark.parametrize("V", VOCABS)
def test_greedy_is_the_first_maximum(V):
    x = _rows(V, V)
    got = np.asarray(jax.jit(sampling.greedy)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))   # numpy: the first maximum
    assert got.dtype == np.int32


@pytest.mark.parametrize("V", VOCABS)
@pytest.mark.parametrize("n", [1, 5])
def test_logprobs_of_matches_float64_log_softmax_and_top_n(V, n):
    x = _rows(V, V + 1)
    x = x[[0, 1, 2, 4, 5]]                       # a fully banned row has no meaningful logprobs
    tok = np.array([0, 3, V - 1, 7, V - 1], np.int32)
    chosen, top_v, top_i = jax.jit(lambda a, t: sampling.logprobs_of(a, t, n))(jnp.asarray(x), jnp.asarray(tok))
    x64 = x.astype(np.float64)
    lp = x64 - (np.log(np.exp(x64 - x64.max(-1, keepdims=True)).sum(-1, keepdims=True)) + x64.max(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(chosen), lp[np.arange(len(tok)), tok], rtol=0, atol=2e-6)
    order = np.argsort(-x, axis=-1, kind="stable")[:, :n]        # descending, ties: lower index first
    np.testing.assert_array_equal(np.asarray(top_i), order)
    np.testing.assert_allclose(np.asarray(top_v), np.take_along_axis(lp, order, -1), rtol=0, atol=2e-6)
