"""The LoRA term of the decoder's four fused matrices, for a bank of S adapter slots.

Computed for all S slots at once and masked per token by its slot (the "stacked" form; why, with
the measurement: jax_engine/lora/bank.py): xa = x @ A_all [T, S, R] * onehot(slot), y = xa @ B_all.
`lb` is one layer's slice of the bank ([S, ...] arrays, layout in jax_engine/lora/adapter.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Bank = dict[str, jax.Array]


def token_mask(lora_slot: jax.Array, slots: int, dtype: jnp.dtype) -> jax.Array:
    """[T, S] one-hot of each token's slot (slot ids are 1-based; 0 = the base model, an all-zero row)."""
    return (lora_slot[:, None] == jnp.arange(1, slots + 1, dtype=lora_slot.dtype)[None]).astype(dtype)


def qkv_delta(h: jax.Array, lb: Bank, m: jax.Array, group: int) -> jax.Array:
    """LoRA term of the fused qkv for h [T, H]: [T, KVH, G+2, D] (q slots, then k, then v)."""
    xa = jnp.einsum("th,shcr->tscr", h, lb["qkv_a"], preferred_element_type=jnp.float32)
    xa = (xa * m[:, :, None, None]).astype(h.dtype)
    which = np.array([0] * group + [1, 2])                       # qkv_b's slot g reads q's, k's or v's A
    return jnp.einsum("tsgr,srkgd->tkgd", xa[:, :, which], lb["qkv_b"], preferred_element_type=jnp.float32)


def o_delta(a: jax.Array, lb: Bank, m: jax.Array) -> jax.Array:
    """LoRA term of o for the attention output a [T, KVH, G, D]: [T, H]."""
    xa = jnp.einsum("tkgd,skgdr->tsr", a, lb["o_a"], preferred_element_type=jnp.float32)
    xa = (xa * m[:, :, None]).astype(a.dtype)
    return jnp.einsum("tsr,srh->th", xa, lb["o_b"], preferred_element_type=jnp.float32)


def gate_up_delta(h: jax.Array, lb: Bank, m: jax.Array) -> jax.Array:
    """LoRA term of gate_up for h [T, H]: [T, 2, I]."""
    xa = jnp.einsum("th,shcr->tscr", h, lb["gu_a"], preferred_element_type=jnp.float32)
    xa = (xa * m[:, :, None, None]).astype(h.dtype)
    return jnp.einsum("tscr,srci->tci", xa, lb["gu_b"], preferred_element_type=jnp.float32)


def down_delta(x: jax.Array, lb: Bank, m: jax.Array) -> jax.Array:
    """LoRA term of down for x [T, I]: [T, H]."""
    xa = jnp.einsum("ti,sir->tsr", x, lb["down_a"], preferred_element_type=jnp.float32)
    xa = (xa * m[:, :, None]).astype(x.dtype)
    return jnp.einsum("tsr,srh->th", xa, lb["down_b"], preferred_element_type=jnp.float32)
