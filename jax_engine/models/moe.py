"""The mixture-of-experts MLP of Mixtral and Qwen3-MoE: top-k routing and grouped expert matmuls.

Routing as transformers does it: softmax over the router logits (float32), the top k experts,
their weights renormalised to sum to 1 (Mixtral always, Qwen3-MoE when norm_topk_prob). The T*k
(token, expert) pairs are sorted by expert and run through `jax.lax.ragged_dot` (one grouped GEMM
for gate_up, one for down: each expert multiplies only its own rows), then weighted and summed
back per token. Experts run on XLA (the CPU matmul kernel is not used for them).
Weights: router [H, E]; experts_gate_up [E, H, 2, I]; experts_down [E, I, H] (per layer).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def moe_mlp(h: jax.Array, router: jax.Array, gate_up: jax.Array, down: jax.Array, top_k: int, normalize: bool,
            act: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """h [T, H] -> [T, H]."""
    T, H = h.shape
    E, _, _, I = gate_up.shape
    logits = jnp.dot(h, router.astype(h.dtype), preferred_element_type=jnp.float32).astype(h.dtype)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_v, top_i = jax.lax.top_k(probs, top_k)                               # [T, k]
    if normalize:
        top_v = top_v / jnp.sum(top_v, axis=-1, keepdims=True)
    top_v = top_v.astype(h.dtype)
    flat = top_i.reshape(-1)
    order = jnp.argsort(flat, stable=True)                                   # pairs grouped by expert
    token = order // top_k
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    gu = jax.lax.ragged_dot(h[token], gate_up.reshape(E, H, 2 * I).astype(h.dtype), sizes,
                            preferred_element_type=jnp.float32).reshape(-1, 2, I).astype(h.dtype)
    y = jax.lax.ragged_dot(act(gu[:, 0]) * gu[:, 1], down.astype(h.dtype), sizes, preferred_element_type=jnp.float32)
    y = y.astype(h.dtype) * top_v.reshape(-1)[order][:, None]
    return jnp.zeros((T, H), h.dtype).at[token].add(y)
