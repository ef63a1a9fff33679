"""Reference attention in pure JAX: the CPU backend and the fallback everywhere.

Cache layout: k and v are each [L, num_pages * page_size, KVH, D] (a flat slot axis; slot =
page * page_size + offset), KV heads sharded over mesh axis "model". Each row's keys are gathered
through its page table into [B, P * page_size, KVH, D] and masked by kv_lens, causality and the
sliding window; GQA by reshape (q is [B, Tq, KVH, G, D]), never by repeating K/V.

This is the math that used to live in llama.forward, op for op: the CPU parity tests against
transformers (1e-4 on logits, greedy tokens exact) pin it down.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


@dataclass
class Meta:
    gather: jax.Array       # [B, S] flat slots of each row's keys, in position order
    mask: jax.Array         # [B, 1, 1, Tq, S]
    flat_slots: jax.Array   # [B * Tq] slot each new token writes
    scale: float


class Reference:
    name = "reference"
    interpret = False

    def unsupported(self, cfg: Any, page_size: int, dtype: Any) -> None:
        return None

    def cache_specs(self, cfg: Any, num_pages: int, page_size: int) -> dict[str, tuple[tuple, P]]:
        kvh = cfg.num_kv_heads * cfg.kv_repeat
        shape = (cfg.num_layers, num_pages * page_size, kvh, cfg.head_dim)
        spec = P(None, None, "model", None)
        return {"k": (shape, spec), "v": (shape, spec)}

    def prepare(self, cfg: Any, inp: Any, page_size: int) -> Meta:
        B, Tq = inp.tokens.shape
        Pn = inp.page_table.shape[1]
        # keys of row b live at slots page_table[b] * page_size + offset, in position order
        gather = (inp.page_table[:, :, None] * page_size + jnp.arange(page_size)[None, None]).reshape(B, Pn * page_size)
        key_pos = jnp.arange(Pn * page_size)
        q_pos = inp.positions
        mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < inp.kv_lens[:, None, None])
        if cfg.sliding_window:
            mask &= key_pos[None, None, :] > q_pos[:, :, None] - cfg.sliding_window
        return Meta(gather=gather, mask=mask[:, None, None], flat_slots=inp.slots.reshape(-1),
                    scale=1.0 / math.sqrt(cfg.head_dim))

    def write(self, kc: jax.Array, vc: jax.Array, li: jax.Array, k: jax.Array, v: jax.Array,
              m: Meta) -> tuple[jax.Array, jax.Array]:
        """k, v [B, Tq, KVH, D] of this step's tokens into layer li."""
        B, Tq, kvh, D = k.shape
        kc = kc.at[li, m.flat_slots].set(k.reshape(B * Tq, kvh, D).astype(kc.dtype))
        vc = vc.at[li, m.flat_slots].set(v.reshape(B * Tq, kvh, D).astype(vc.dtype))
        return kc, vc

    def attend(self, q: jax.Array, kc: jax.Array, vc: jax.Array, li: jax.Array, m: Meta) -> jax.Array:
        """q [B, Tq, KVH, G, D] (RoPE applied) -> attention output [B, Tq, KVH, G, D] in q.dtype."""
        keys = kc[li, m.gather]                                       # [B, S, KVH, D]
        vals = vc[li, m.gather]
        s = jnp.einsum("btkgd,bskd->bkgts", q, keys.astype(q.dtype),
                       preferred_element_type=jnp.float32) * m.scale
        s = jnp.where(m.mask, s, -1e30)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("bkgts,bskd->btkgd", p.astype(vals.dtype), vals,
                          preferred_element_type=jnp.float32).astype(q.dtype)

    def copy_page(self, cfg: Any, kc: jax.Array, vc: jax.Array, src: jax.Array, dst: jax.Array,
                  page_size: int) -> tuple[jax.Array, jax.Array]:
        """Copy page src to page dst in every layer (copy-on-write of a partly filled page)."""
        def cp(buf):
            blk = jax.lax.dynamic_slice_in_dim(buf, src * page_size, page_size, axis=1)
            return jax.lax.dynamic_update_slice_in_dim(buf, blk, dst * page_size, axis=1)
        return cp(kc), cp(vc)
