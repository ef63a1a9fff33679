"""Reference attention in pure JAX: the ground truth for every backend and the fallback anywhere.

Cache layout: k and v are each [L, num_pages * page_size, KVH, D] (a flat slot axis; slot =
page * page_size + offset), KV heads sharded over mesh axis "model".

Ragged step (llama.StepInputs): every query token is its own attention problem -- the keys of its
row's pages at positions below its `kv_limit` (position + 1, so causal over earlier pages and its
own chunk) and inside the sliding window. Each token's keys are gathered through its row's page
table into [T, S, KVH, D] (S = the page bucket's span) and a masked softmax runs over them; GQA by
reshape (q is [T, KVH, G, D]), never by repeating K/V. That gather is T x S x KVH x D, so tokens go
through it in blocks of at most GATHER_BYTES; the decode-only step (one token per row) gathers
exactly what the row-batched formulation did. The CPU and TPU backends read pages in place instead.

The CPU parity tests against transformers (1e-4 on logits, greedy tokens exact) pin this down.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

GATHER_BYTES = 64 << 20     # the largest per-block key gather (K and V each)


@dataclass
class Meta:
    table: jax.Array        # [T, P] the page table of each token's row
    positions: jax.Array    # [T]
    kv_limit: jax.Array     # [T]
    flat_slots: jax.Array   # [T] slot each new token writes
    page_size: int
    window: int             # 0 = none
    scale: float
    softcap: float = 0.0    # scores -> softcap * tanh(scores / softcap) before the mask (Gemma 2)
    windows: Optional[jax.Array] = None   # [L] per-layer window (0 = global), overrides `window` (Gemma)


class Reference:
    name = "reference"
    interpret = False
    # the step's cost grows with the page table's width (the per-token gather): the runner buckets it
    page_buckets = True

    def unsupported(self, cfg: Any, page_size: int, dtype: Any) -> None:
        return None

    def cache_specs(self, cfg: Any, num_pages: int, page_size: int) -> dict[str, tuple[tuple, P]]:
        kvh = cfg.num_kv_heads * cfg.kv_repeat
        shape = (cfg.num_layers, num_pages * page_size, kvh, cfg.head_dim)
        spec = P(None, None, "model", None)
        return {"k": (shape, spec), "v": (shape, spec)}

    def prepare(self, cfg: Any, inp: Any, page_size: int) -> Meta:
        return Meta(table=inp.page_table[inp.rows], positions=inp.positions, kv_limit=inp.kv_limit,
                    flat_slots=inp.slots, page_size=page_size, window=int(cfg.sliding_window or 0),
                    scale=1.0 / math.sqrt(cfg.head_dim), softcap=float(getattr(cfg, "attn_softcap", 0.0)),
                    windows=jnp.asarray(cfg.layer_windows, jnp.int32) if getattr(cfg, "layer_windows", ()) else None)

    def write(self, kc: jax.Array, vc: jax.Array, li: jax.Array, k: jax.Array, v: jax.Array,
              m: Meta) -> tuple[jax.Array, jax.Array]:
        """k, v [T, KVH, D] of this step's tokens into layer li."""
        kc = kc.at[li, m.flat_slots].set(k.astype(kc.dtype))
        vc = vc.at[li, m.flat_slots].set(v.astype(vc.dtype))
        return kc, vc

    def attend(self, q: jax.Array, kc: jax.Array, vc: jax.Array, li: jax.Array, m: Meta) -> jax.Array:
        """q [T, KVH, G, D] (RoPE applied) -> attention output [T, KVH, G, D] in q.dtype."""
        T, kvh, G, D = q.shape
        S = m.table.shape[1] * m.page_size
        blk = T
        while blk > 1 and blk * S * kvh * D * kc.dtype.itemsize > GATHER_BYTES and blk % 2 == 0:
            blk //= 2
        kl, vl = kc[li], vc[li]

        def block(args):
            qb, table, pos, limit = args
            n = qb.shape[0]
            gather = (table[:, :, None] * m.page_size + jnp.arange(m.page_size)).reshape(n, S)
            keys, vals = kl[gather], vl[gather]                       # [n, S, KVH, D]
            key_pos = jnp.arange(S)[None]
            mask = key_pos < limit[:, None]
            if m.windows is not None:
                win = m.windows[li]
                mask &= (win == 0) | (key_pos > pos[:, None] - win)
            elif m.window:
                mask &= key_pos > pos[:, None] - m.window
            s = jnp.einsum("tkgd,tskd->tkgs", qb, keys.astype(qb.dtype), preferred_element_type=jnp.float32) * m.scale
            if m.softcap:
                s = jnp.tanh(s / m.softcap) * m.softcap
            s = jnp.where(mask[:, None, None, :], s, -1e30)
            p = jax.nn.softmax(s, axis=-1)
            return jnp.einsum("tkgs,tskd->tkgd", p.astype(vals.dtype), vals,
                              preferred_element_type=jnp.float32).astype(qb.dtype)

        if blk == T:
            return block((q, m.table, m.positions, m.kv_limit))
        nb = T // blk
        split = lambda a: a.reshape((nb, blk) + a.shape[1:])        # noqa: E731
        out = jax.lax.map(block, (split(q), split(m.table), split(m.positions), split(m.kv_limit)))
        return out.reshape(q.shape)

    def copy_page(self, cfg: Any, kc: jax.Array, vc: jax.Array, src: jax.Array, dst: jax.Array,
                  page_size: int) -> tuple[jax.Array, jax.Array]:
        """Copy page src to page dst in every layer (copy-on-write of a partly filled page)."""
        def cp(buf):
            blk = jax.lax.dynamic_slice_in_dim(buf, src * page_size, page_size, axis=1)
            return jax.lax.dynamic_update_slice_in_dim(buf, blk, dst * page_size, axis=1)
        return cp(kc), cp(vc)
