"""The LoRA term of the decoder's four fused matrices, for a bank of S adapter slots.

Computed for all S slots at once and masked per token by its slot (the "stacked" form):
xa = (x @ A_all [in, S*R]) * onehot(slot), y = xa @ B_all [S*R, out], two plain 2-D GEMMs per
matrix (q, k, v and gate, up share their A GEMM). `lb` is one layer's slice of the bank
(jax_engine/lora/bank.py). Why stacked: gathering each token's own A and B instead was slower at
7 of 8 measured shapes of the 'small' model, 1.2-10x (benchmarks/lora_decode.py, README).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

Bank = dict[str, jax.Array]


def token_mask(lora_slot: jax.Array, slots: int, rank: int, dtype: jnp.dtype) -> jax.Array:
    """[T, S*R]: each token's slot one-hot (slot ids are 1-based; 0 = the base model, all zero),
    repeated over the rank, in the S-major order of the bank's reshaped operands."""
    onehot = (lora_slot[:, None] == jnp.arange(1, slots + 1, dtype=lora_slot.dtype)[None]).astype(dtype)
    return jnp.repeat(onehot, rank, axis=1)


def _a(x: jax.Array, a: jax.Array, parts: int) -> jax.Array:
    """x [T, in...] @ A [in..., (parts,) S, R] -> [T, parts, S*R] (float32 accumulation)."""
    T = x.shape[0]
    k = math.prod(a.shape[:a.ndim - 2 - (parts > 1)])
    y = jnp.dot(x.reshape(T, k), a.reshape(k, -1), preferred_element_type=jnp.float32)
    return y.reshape(T, parts, -1)


def _b(xa: jax.Array, b: jax.Array) -> jax.Array:
    """xa [T, S*R] @ B [S, R, out...] -> [T, out...]."""
    out = b.shape[2:]
    y = jnp.dot(xa, b.reshape(-1, math.prod(out)), preferred_element_type=jnp.float32)
    return y.reshape((xa.shape[0],) + out)


def qkv_delta(h: jax.Array, lb: Bank, m: jax.Array) -> jax.Array:
    """LoRA term of the fused qkv for h [T, H]: [T, KVH, G+2, D] (q slots, then k, then v)."""
    xa = (_a(h, lb["qkv_a"], 3) * m[:, None]).astype(h.dtype)
    q = _b(xa[:, 0], lb["q_b"])
    k, v = _b(xa[:, 1], lb["k_b"]), _b(xa[:, 2], lb["v_b"])
    return jnp.concatenate([q, k[:, :, None], v[:, :, None]], axis=2)


def o_delta(a: jax.Array, lb: Bank, m: jax.Array) -> jax.Array:
    """LoRA term of o for the attention output a [T, KVH, G, D]: [T, H]."""
    xa = (_a(a, lb["o_a"], 1)[:, 0] * m).astype(a.dtype)
    return _b(xa, lb["o_b"])


def gate_up_delta(h: jax.Array, lb: Bank, m: jax.Array) -> jax.Array:
    """LoRA term of gate_up for h [T, H]: [T, 2, I]."""
    xa = (_a(h, lb["gu_a"], 2) * m[:, None]).astype(h.dtype)
    return jnp.stack([_b(xa[:, 0], lb["gate_b"]), _b(xa[:, 1], lb["up_b"])], axis=1)


def down_delta(x: jax.Array, lb: Bank, m: jax.Array) -> jax.Array:
    """LoRA term of down for x [T, I]: [T, H]."""
    xa = (_a(x, lb["down_a"], 1)[:, 0] * m).astype(x.dtype)
    return _b(xa, lb["down_b"])
