"""GPU attention: Pallas (Triton) kernels over a GPU-owned paged KV layout.

Layout (chosen so no step ever copies or transposes the cache): k and v are each
[KVH, L * num_pages, page_size, D], layer l's page p at index l * num_pages + p, KV heads sharded
over mesh axis "model". That is exactly `paged_attention`'s [num_kv_heads, total_num_pages,
page_size, head_dim] with the layers folded into the page axis, so every layer hands the whole
buffer to the kernel and offsets its block table by l * num_pages. The alternative -- keeping the
reference's [L, pages * page_size, KVH, D] and transposing inside the wrapper -- copies a layer's
entire cache per layer per step (O(cache), not O(tokens attended)), and slicing one layer out of a
stacked [L, KVH, pages, ...] cache inside the layer scan copies it just the same.

  decode (Tq == 1, no sliding window that can bite within the row's pages):
      jax.experimental.pallas.ops.gpu.paged_attention; q is pre-scaled by 1/sqrt(D) (the kernel
      has no softmax scale); lengths = kv_lens (0 for padding rows -> output 0), which is causal
      because a decode row's kv_len is its position + 1 (the runner's decode rows).
  prefill, and decode with a sliding window shorter than the row's page span:
      the row's pages are gathered (XLA) into [KVH, B, S, D] and an own Pallas flash kernel runs
      over them: grid (row, KV head, query block), query rows are (token, group) pairs of one KV
      head (GQA without repeating K/V), each query row attends keys in [lo, hi) with
      hi = min(position + 1, kv_len) and lo = position - window + 1 (or 0); only the key blocks
      that some query row of the block can see are visited.

Limits: head_dim and page_size must be powers of two >= 16 (Triton block shapes and tl.dot
minimums); `unsupported()` says so at start-up and `auto` then falls back to the reference.
Tested on CPU in Pallas interpret mode only (tests/engine/test_attention_backends.py); the Triton
lowering, speed and numerics on a real GPU are not verified yet.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

NEG = -1e30


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap that divides n."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


@dataclass
class Meta:
    slots: jax.Array        # [B * Tq]
    page_table: jax.Array   # [B, P]
    kv_lens: jax.Array      # [B]
    positions: jax.Array    # [B, Tq]
    num_layers: int
    page_size: int
    window: Optional[int]
    scale: float


class PallasGPU:
    name = "pallas_gpu"

    def __init__(self, interpret: bool = False, block_q: int = 64, block_k: int = 64):
        self.interpret = interpret
        self.block_q, self.block_k = block_q, block_k

    # ------------------------------------------------------------------ layout
    def unsupported(self, cfg: Any, page_size: int, dtype: Any) -> Optional[str]:
        if not (_pow2(cfg.head_dim) and cfg.head_dim >= 16):
            return f"head_dim {cfg.head_dim} is not a power of two >= 16 (Triton block shapes)"
        if not (_pow2(page_size) and page_size >= 16):
            return f"page size {page_size} is not a power of two >= 16 (Triton block shapes)"
        return None

    def cache_specs(self, cfg: Any, num_pages: int, page_size: int) -> dict[str, tuple[tuple, P]]:
        kvh = cfg.num_kv_heads * cfg.kv_repeat
        shape = (kvh, cfg.num_layers * num_pages, page_size, cfg.head_dim)
        spec = P("model", None, None, None)
        return {"k": (shape, spec), "v": (shape, spec)}

    def prepare(self, cfg: Any, inp: Any, page_size: int) -> Meta:
        return Meta(slots=inp.slots.reshape(-1), page_table=inp.page_table, kv_lens=inp.kv_lens,
                    positions=inp.positions, num_layers=cfg.num_layers, page_size=page_size,
                    window=cfg.sliding_window or None, scale=1.0 / math.sqrt(cfg.head_dim))

    def write(self, kc: jax.Array, vc: jax.Array, li: jax.Array, k: jax.Array, v: jax.Array,
              m: Meta) -> tuple[jax.Array, jax.Array]:
        B, Tq, kvh, D = k.shape
        n = kc.shape[1] // m.num_layers
        page = li * n + m.slots // m.page_size
        off = m.slots % m.page_size
        kc = kc.at[:, page, off].set(k.reshape(B * Tq, kvh, D).transpose(1, 0, 2).astype(kc.dtype))
        vc = vc.at[:, page, off].set(v.reshape(B * Tq, kvh, D).transpose(1, 0, 2).astype(vc.dtype))
        return kc, vc

    def copy_page(self, cfg: Any, kc: jax.Array, vc: jax.Array, src: jax.Array, dst: jax.Array,
                  page_size: int) -> tuple[jax.Array, jax.Array]:
        """Copy page src to page dst in every layer (copy-on-write of a partly filled page)."""
        base = jnp.arange(cfg.num_layers) * (kc.shape[1] // cfg.num_layers)
        return kc.at[:, base + dst].set(kc[:, base + src]), vc.at[:, base + dst].set(vc[:, base + src])

    # ------------------------------------------------------------------ attention
    def attend(self, q: jax.Array, kc: jax.Array, vc: jax.Array, li: jax.Array, m: Meta) -> jax.Array:
        B, Tq, kvh, G, D = q.shape
        Pn = m.page_table.shape[1]
        n = kc.shape[1] // m.num_layers
        table = m.page_table + li * n
        window_bites = m.window is not None and m.window < Pn * m.page_size
        if Tq == 1 and not window_bites:
            return self._decode(q, kc, vc, table, m)
        return self._flash(q, kc, vc, table, m)

    def _decode(self, q, kc, vc, table, m: Meta) -> jax.Array:
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

        B, _, kvh, G, D = q.shape
        Pn = table.shape[1]
        ppcb = _pow2_divisor(Pn, 8)                      # pages per compute block (block_k = ppcb * page_size)
        splits = max(d for d in range(1, 17) if (Pn // ppcb) % d == 0)
        qs = (q.astype(jnp.float32) * m.scale).astype(q.dtype).reshape(B, kvh * G, D)
        o = paged_attention(qs, kc, vc, table, m.kv_lens, block_h=16, pages_per_compute_block=ppcb,
                            k_splits=splits, interpret=self.interpret)
        return o.reshape(B, 1, kvh, G, D).astype(q.dtype)

    def _flash(self, q, kc, vc, table, m: Meta) -> jax.Array:
        B, Tq, kvh, G, D = q.shape
        Pn = table.shape[1]
        S = Pn * m.page_size
        keys = kc[:, table].reshape(kvh, B, S, D)        # the rows' pages, in position order
        vals = vc[:, table].reshape(kvh, B, S, D)
        R = Tq * G
        bq = min(self.block_q, max(16, 1 << (R - 1).bit_length()))
        Rp = -(-R // bq) * bq
        bk = m.page_size * _pow2_divisor(Pn, max(1, self.block_k // m.page_size))
        # one query row per (token, group) pair of a KV head; its visible keys are [lo, hi)
        pos = m.positions
        hi = jnp.minimum(pos + 1, m.kv_lens[:, None])
        lo = jnp.maximum(pos - m.window + 1, 0) if m.window else jnp.zeros_like(pos)
        lo = jnp.where(hi > lo, lo, S)                   # rows that see nothing don't widen the key range
        hi = jnp.where(hi > lo, hi, 0)
        lo = jnp.pad(jnp.repeat(lo, G, axis=1), ((0, 0), (0, Rp - R)), constant_values=S)
        hi = jnp.pad(jnp.repeat(hi, G, axis=1), ((0, 0), (0, Rp - R)))
        qr = q.transpose(0, 2, 1, 3, 4).reshape(B, kvh, R, D)
        qr = jnp.pad(qr, ((0, 0), (0, 0), (0, Rp - R), (0, 0)))
        o = _flash_call(qr, keys, vals, lo.astype(jnp.int32), hi.astype(jnp.int32), scale=m.scale,
                        block_q=bq, block_k=bk, interpret=self.interpret)
        return o[:, :, :R].reshape(B, kvh, Tq, G, D).transpose(0, 2, 1, 3, 4)


def _flash_kernel(q_ref, k_ref, v_ref, lo_ref, hi_ref, o_ref, *, scale: float, block_k: int):
    q = q_ref[...]                                           # [bq, D]
    lo = lo_ref[...]                                         # [bq]
    hi = hi_ref[...]
    bq, D = q.shape
    start = jnp.min(lo) // block_k
    end = (jnp.max(hi) + block_k - 1) // block_k

    def body(j, carry):
        acc, m_prev, l_prev = carry
        ks = k_ref[pl.ds(j * block_k, block_k), :]
        vs = v_ref[pl.ds(j * block_k, block_k), :]
        s = plgpu.dot(q, ks, trans_b=True) * scale           # [bq, bk] float32
        kpos = j * block_k + jax.lax.broadcasted_iota(jnp.int32, (bq, block_k), 1)
        mask = (kpos >= lo[:, None]) & (kpos < hi[:, None])
        s = jnp.where(mask, s, NEG)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)
        l_next = l_prev * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(vs.dtype), vs)
        return acc, m_next, l_next

    init = (jnp.zeros((bq, D), jnp.float32), jnp.full((bq,), NEG, jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, _, l = jax.lax.fori_loop(start, end, body, init)
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "interpret"))
def _flash_call(q, k, v, lo, hi, *, scale: float, block_q: int, block_k: int, interpret: bool):
    """q [B, KVH, Rp, D]; k, v [KVH, B, S, D]; lo, hi [B, Rp] -> [B, KVH, Rp, D]."""
    B, kvh, Rp, D = q.shape
    S = k.shape[2]
    return pl.pallas_call(
        functools.partial(_flash_kernel, scale=scale, block_k=block_k),
        grid=(B, kvh, Rp // block_q),
        in_specs=[
            pl.BlockSpec((None, None, block_q, D), lambda b, h, i: (b, h, i, 0)),
            pl.BlockSpec((None, None, S, D), lambda b, h, i: (h, b, 0, 0)),
            pl.BlockSpec((None, None, S, D), lambda b, h, i: (h, b, 0, 0)),
            pl.BlockSpec((None, block_q), lambda b, h, i: (b, i)),
            pl.BlockSpec((None, block_q), lambda b, h, i: (b, i)),
        ],
        out_specs=pl.BlockSpec((None, None, block_q, D), lambda b, h, i: (b, h, i, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="xlaserve_flash_prefill",
    )(q, k, v, lo, hi)
