"""GPU attention: Pallas (Triton) kernels over a GPU-owned paged KV layout, per query token.

Layout (chosen so no step ever copies or transposes the cache): k and v are each
[KVH, L * num_pages, page_size, D], layer l's page p at index l * num_pages + p, KV heads sharded
over mesh axis "model". That is exactly `paged_attention`'s [num_kv_heads, total_num_pages,
page_size, head_dim] with the layers folded into the page axis, so every layer hands the whole
buffer to the kernel and offsets its block tables by l * num_pages. The alternative -- keeping the
reference's [L, pages * page_size, KVH, D] and transposing inside the wrapper -- copies a layer's
entire cache per layer per step (O(cache), not O(tokens attended)), and slicing one layer out of a
stacked [L, KVH, pages, ...] cache inside the layer scan copies it just the same.

Ragged step (llama.StepInputs): every query token -- a decode row's one token or any token of a
prefill chunk -- is its own attention problem over its row's pages, keys at positions
s < kv_limit (= position + 1: causal over earlier pages and its own chunk) and, with a sliding
window w, s > position - w. Padding tokens (kv_limit 0) get zeros. Which kernel runs is decided at
trace time by the model alone, never by the step's mix of decode and prefill:

  no sliding window, or one at least the page table's span (w >= P * page_size, cannot bite):
      jax.experimental.pallas.ops.gpu.paged_attention with every TOKEN as its own "sequence":
      q [T, H, D] pre-scaled by 1/sqrt(D) (the kernel has no softmax scale), block_tables = each
      token's row's page table offset to the layer, lengths = kv_limit -- exactly causal, and 0
      for padding tokens (-> zeros). The kernel reads only the pages below a token's length, in
      place (the table is padded to a power-of-two k-split layout; pages past the length are never
      touched).
  a sliding window shorter than the span (Mistral):
      our own Pallas kernel `_window_call`, the same per-token paged loop with a lower bound:
      each token gets a block table of just the pages its window can touch ((w - 1) // page_size
      + 2 of them, starting at the page of position - w + 1; int32 indices only, gathered by XLA)
      and streams those pages from the cache in place, masking keys to [position - w + 1,
      kv_limit); grid (token, KV head), the token's G query heads of a KV head are one tile (GQA
      without repeating K/V), online softmax over blocks of `block_k` keys.

Neither path gathers keys: a token reads at most its own keys (or its window), so the cost does
not grow with the page table's width and the runner compiles one page bucket (`page_buckets =
False`). The price of treating each token alone: a prefill chunk of n tokens reads its keys n
times (O(n^2 / 2) key reads, mostly from L2) instead of once per query block as a ragged flash
kernel would; that kernel is the next step if prefill-heavy GPU steps turn out memory bound.

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
MAX_K_SPLITS = 16       # paged_attention's partitions of a token's pages (its default)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass
class Meta:
    slots: jax.Array        # [T] flat slot each new token writes
    table: jax.Array        # [T, P] the page table of each token's row
    positions: jax.Array    # [T]
    kv_limit: jax.Array     # [T] keys visible to each token (position + 1; 0 for padding)
    num_layers: int
    page_size: int
    window: int             # 0 = none
    scale: float


class PallasGPU:
    name = "pallas_gpu"
    # both kernels read only the pages a token needs, in place: one page bucket
    page_buckets = False

    def __init__(self, interpret: bool = False, block_k: int = 128):
        """block_k: keys per compute block of either kernel (rounded to whole pages)."""
        self.interpret = interpret
        self.block_k = block_k

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
        return Meta(slots=inp.slots, table=inp.page_table[inp.rows], positions=inp.positions,
                    kv_limit=inp.kv_limit, num_layers=cfg.num_layers, page_size=page_size,
                    window=int(cfg.sliding_window or 0), scale=1.0 / math.sqrt(cfg.head_dim))

    def write(self, kc: jax.Array, vc: jax.Array, li: jax.Array, k: jax.Array, v: jax.Array,
              m: Meta) -> tuple[jax.Array, jax.Array]:
        """k, v [T, KVH, D] of this step's tokens into layer li."""
        n = kc.shape[1] // m.num_layers
        page = li * n + m.slots // m.page_size
        off = m.slots % m.page_size
        kc = kc.at[:, page, off].set(k.transpose(1, 0, 2).astype(kc.dtype))
        vc = vc.at[:, page, off].set(v.transpose(1, 0, 2).astype(vc.dtype))
        return kc, vc

    def copy_page(self, cfg: Any, kc: jax.Array, vc: jax.Array, src: jax.Array, dst: jax.Array,
                  page_size: int) -> tuple[jax.Array, jax.Array]:
        """Copy page src to page dst in every layer (copy-on-write of a partly filled page)."""
        base = jnp.arange(cfg.num_layers) * (kc.shape[1] // cfg.num_layers)
        return kc.at[:, base + dst].set(kc[:, base + src]), vc.at[:, base + dst].set(vc[:, base + src])

    # ------------------------------------------------------------------ attention
    def attend(self, q: jax.Array, kc: jax.Array, vc: jax.Array, li: jax.Array, m: Meta) -> jax.Array:
        """q [T, KVH, G, D] (RoPE applied) -> attention output [T, KVH, G, D] in q.dtype."""
        base = li * (kc.shape[1] // m.num_layers)               # the layer's first page
        if m.window and m.window < m.table.shape[1] * m.page_size:
            return self._windowed(q, kc, vc, base, m)
        return self._paged(q, kc, vc, base, m)

    def _pages_per_block(self, ps: int, width: int) -> int:
        return min(max(1, self.block_k // ps), _next_pow2(width))

    def _paged(self, q, kc, vc, base, m: Meta) -> jax.Array:
        """Every token its own paged_attention sequence: its row's pages, length kv_limit."""
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

        T, kvh, G, D = q.shape
        Pn = m.table.shape[1]
        ppcb = self._pages_per_block(m.page_size, Pn)
        nblocks = -(-Pn // ppcb)
        splits = min(MAX_K_SPLITS, nblocks)
        part = ppcb * _next_pow2(-(-nblocks // splits))     # pages per k-split, a power of two
        table = jnp.pad(m.table, ((0, 0), (0, splits * part - Pn))) + base
        qs = (q.astype(jnp.float32) * m.scale).astype(kc.dtype).reshape(T, kvh * G, D)
        o = paged_attention(qs, kc, vc, table, m.kv_limit.astype(jnp.int32), block_h=16,
                            pages_per_compute_block=ppcb, k_splits=splits, interpret=self.interpret)
        return o.reshape(T, kvh, G, D).astype(q.dtype)

    def _windowed(self, q, kc, vc, base, m: Meta) -> jax.Array:
        """Every token over just the pages its sliding window touches, masked to [lo, hi)."""
        T, kvh, G, D = q.shape
        ps, w, Pn = m.page_size, m.window, m.table.shape[1]
        span = min(Pn, (w - 1) // ps + 2)                        # pages a window of w keys can touch
        ppb = self._pages_per_block(ps, span)
        width = max(ppb, _next_pow2(span))                       # a power of two, a multiple of ppb
        hi = m.kv_limit.astype(jnp.int32)
        lo = jnp.maximum(m.positions.astype(jnp.int32) - w + 1, 0)
        sees = hi > lo
        lo, hi = jnp.where(sees, lo, 0), jnp.where(sees, hi, 0)  # a token that sees nothing: empty loop
        first = lo // ps
        cols = first[:, None] + jnp.arange(width, dtype=jnp.int32)
        table = jnp.take_along_axis(jnp.pad(m.table, ((0, 0), (0, width))), cols, axis=1) + base
        Gp = max(16, _next_pow2(G))                              # tl.dot wants >= 16 rows
        qp = jnp.pad(q.astype(kc.dtype), ((0, 0), (0, 0), (0, Gp - G), (0, 0)))
        o = _window_call(qp, kc, vc, table.astype(jnp.int32), lo - first * ps, hi - first * ps, scale=m.scale,
                         pages_per_block=ppb, interpret=self.interpret)
        return o[:, :, :G].astype(q.dtype)


def _window_kernel(q_ref, k_ref, v_ref, tab_ref, lo_ref, hi_ref, o_ref, *, scale: float, pages_per_block: int):
    q = q_ref[...]                                           # [Gp, D]: one token's heads of one KV head
    Gp, D = q.shape
    block_k = pages_per_block * k_ref.shape[-2]
    lo = lo_ref[0]                                           # visible keys [lo, hi), relative to the
    hi = hi_ref[0]                                           # token's first table page

    def body(j, carry):
        acc, m_prev, l_prev = carry
        pages = tab_ref[pl.ds(j * pages_per_block, pages_per_block)]
        ks = k_ref[pages].reshape(block_k, D)
        vs = v_ref[pages].reshape(block_k, D)
        s = plgpu.dot(q, ks, trans_b=True) * scale           # [Gp, bk] float32
        kpos = j * block_k + jax.lax.broadcasted_iota(jnp.int32, (Gp, block_k), 1)
        mask = (kpos >= lo) & (kpos < hi)
        s = jnp.where(mask, s, NEG)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)
        l_next = l_prev * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(vs.dtype), vs)
        return acc, m_next, l_next

    init = (jnp.zeros((Gp, D), jnp.float32), jnp.full((Gp,), NEG, jnp.float32), jnp.zeros((Gp,), jnp.float32))
    acc, _, l = jax.lax.fori_loop(lo // block_k, (hi + block_k - 1) // block_k, body, init)
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "pages_per_block", "interpret"))
def _window_call(q, k, v, table, lo, hi, *, scale: float, pages_per_block: int, interpret: bool):
    """q [T, KVH, Gp, D]; k, v [KVH, pages, page_size, D]; table [T, W]; lo, hi [T] -> [T, KVH, Gp, D]."""
    T, kvh, Gp, D = q.shape
    _, N, ps, _ = k.shape
    W = table.shape[1]
    return pl.pallas_call(
        functools.partial(_window_kernel, scale=scale, pages_per_block=pages_per_block),
        grid=(T, kvh),
        in_specs=[
            pl.BlockSpec((None, None, Gp, D), lambda t, h: (t, h, 0, 0)),
            pl.BlockSpec((None, N, ps, D), lambda t, h: (h, 0, 0, 0)),
            pl.BlockSpec((None, N, ps, D), lambda t, h: (h, 0, 0, 0)),
            pl.BlockSpec((None, W), lambda t, h: (t, 0)),
            pl.BlockSpec((1,), lambda t, h: (t,)),
            pl.BlockSpec((1,), lambda t, h: (t,)),
        ],
        out_specs=pl.BlockSpec((None, None, Gp, D), lambda t, h: (t, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="xlaserve_window_attention",
    )(q, k, v, table, lo, hi)
