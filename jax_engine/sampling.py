"""On-device sampling with per-row parameter arrays (DESIGN §6): one program serves any mix.

Rules where engines differ (chosen here, stated in the README):
- penalties follow vLLM: repetition (HF/CTRL multiplicative) over prompt + output tokens;
  frequency and presence (OpenAI additive) over output tokens only;
- order: penalties -> logit_bias -> min_new_tokens mask -> temperature -> top-k -> top-p -> min-p;
- reported logprobs are the model's raw log-softmax (vLLM's default), not the processed ones;
- the PRNG key of a row is fold_in(PRNGKey(seed), number of tokens generated so far), so a
  seeded request draws the same tokens whatever else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -1e30


@dataclass
class SamplingArrays:
    """Per-row sampling parameters, always passed at full shape (no pytree changes)."""

    temperature: jax.Array   # [R] f32, 0 = greedy
    top_k: jax.Array         # [R] i32, <= 0 = off
    top_p: jax.Array         # [R] f32
    min_p: jax.Array         # [R] f32
    rep_pen: jax.Array       # [R] f32
    freq_pen: jax.Array      # [R] f32
    pres_pen: jax.Array      # [R] f32
    bias_ids: jax.Array      # [R, NB] i32 (padding: id 0 with value 0)
    bias_vals: jax.Array     # [R, NB] f32
    ban_ids: jax.Array       # [R, NBAN] i32 tokens masked while under min_new_tokens
    ban_on: jax.Array        # [R, NBAN] bool
    seeds: jax.Array         # [R] u32
    steps: jax.Array         # [R] i32 tokens generated so far


jax.tree_util.register_dataclass(
    SamplingArrays,
    data_fields=["temperature", "top_k", "top_p", "min_p", "rep_pen", "freq_pen", "pres_pen",
                 "bias_ids", "bias_vals", "ban_ids", "ban_on", "seeds", "steps"],
    meta_fields=[],
)


def process_logits(logits: jax.Array, sa: SamplingArrays, counts: jax.Array, prompt_mask: jax.Array) -> jax.Array:
    """Penalties, bias and bans. counts [R, V] output-token counts; prompt_mask [R, V] bool."""
    R = logits.shape[0]
    rows = jnp.arange(R)[:, None]
    seen = (counts > 0) | prompt_mask
    rep = sa.rep_pen[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - sa.freq_pen[:, None] * counts - sa.pres_pen[:, None] * (counts > 0)
    logits = logits.at[rows, sa.bias_ids].add(sa.bias_vals)
    logits = logits.at[rows, sa.ban_ids].add(jnp.where(sa.ban_on, NEG_INF, 0.0))
    return logits


def greedy(logits: jax.Array) -> jax.Array:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def sample(logits: jax.Array, sa: SamplingArrays) -> jax.Array:
    """Draw one token per row; rows with temperature 0 take the argmax."""
    V = logits.shape[-1]
    is_greedy = sa.temperature <= 0.0
    t = jnp.where(is_greedy, 1.0, sa.temperature)[:, None]
    scaled = logits / t
    order = jnp.argsort(-scaled, axis=-1)
    srt = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(srt, axis=-1)
    ranks = jnp.arange(V)[None]
    k = jnp.where(sa.top_k <= 0, V, sa.top_k)[:, None]
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    drop = (ranks >= k) | (cum_before >= sa.top_p[:, None]) | (probs < sa.min_p[:, None] * probs[:, :1])
    drop = drop.at[:, 0].set(False)
    srt = jnp.where(drop, NEG_INF, srt)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(sa.seeds, sa.steps)
    pick = jax.vmap(jax.random.categorical)(keys, srt)
    token = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(is_greedy, greedy(logits), token)


def logprobs_of(raw_logits: jax.Array, tokens: jax.Array, top_n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(chosen logprob [R], top-N logprobs [R, N], top-N ids [R, N]) from raw logits."""
    lp = jax.nn.log_softmax(raw_logits, axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    top_v, top_i = jax.lax.top_k(lp, top_n)
    return chosen, top_v, top_i.astype(jnp.int32)


def host_arrays(rows: list, R: int, num_bias: int, num_ban: int) -> dict[str, np.ndarray]:
    """Numpy arrays for SamplingArrays from per-row dicts (padding rows are greedy no-ops)."""
    out = {
        "temperature": np.zeros(R, np.float32), "top_k": np.zeros(R, np.int32),
        "top_p": np.ones(R, np.float32), "min_p": np.zeros(R, np.float32),
        "rep_pen": np.ones(R, np.float32), "freq_pen": np.zeros(R, np.float32),
        "pres_pen": np.zeros(R, np.float32), "bias_ids": np.zeros((R, num_bias), np.int32),
        "bias_vals": np.zeros((R, num_bias), np.float32), "ban_ids": np.zeros((R, num_ban), np.int32),
        "ban_on": np.zeros((R, num_ban), bool), "seeds": np.zeros(R, np.uint32),
        "steps": np.zeros(R, np.int32),
    }
    for i, r in enumerate(rows):
        if r is None:
            continue
        for k in ("temperature", "top_k", "top_p", "min_p", "rep_pen", "freq_pen", "pres_pen", "seeds", "steps"):
            out[k][i] = r[k]
        b = r["bias"]
        if b:
            ids, vals = zip(*b)
            out["bias_ids"][i, :len(ids)] = ids
            out["bias_vals"][i, :len(vals)] = vals
        if r["ban"]:
            out["ban_ids"][i, :len(r["ban"])] = r["ban"]
            out["ban_on"][i, :len(r["ban"])] = True
    return out
