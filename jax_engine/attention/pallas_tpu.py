"""TPU attention: jax.experimental.pallas.ops.tpu.ragged_paged_attention over a TPU-owned layout.

Layout: ONE combined buffer [L * num_pages, page_size, 2 * KVH, D] in state["k"] (K of head h at
2h, V at 2h + 1: the kernel's `kv_pages`), layer l's page p at index l * num_pages + p, the
combined head axis sharded over mesh axis "model" (each device holds whole K/V pairs of its
heads); state["v"] is an empty placeholder. The whole buffer goes to the kernel every layer (it
DMAs only the pages it needs) with page indices offset by l * num_pages, so no step copies,
slices or re-interleaves the cache; keeping separate K and V would re-interleave all of it per
layer per step.

Metadata: the kernel takes exactly the ragged step's layout (llama.StepInputs): a flat token
list with each row's queries contiguous at cu_q_lens offsets, real rows first (num_seqs of them),
and a row's queries the LAST q_len of its kv_len (a chunk ends at the row's kv length). So q goes
to the kernel as it is, with the rows' page tables offset to the layer; padding tokens (after
cu_q_lens[num_seqs]) get zeros. The kernel reads only the pages it needs, so the page table's
width costs nothing (`page_buckets = False`).

Tested on CPU against the kernel module's own `ref_ragged_paged_attention` (same layout and
metadata, pure JAX); the Mosaic kernel itself does not run in TPU interpret mode on CPU with
jax 0.10.2 (the interpreter fails on the kernel's ref reshape: "'ReshapeTransform' object has no
attribute 'indices'"), and has not been run on a TPU here.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


@dataclass
class Meta:
    slots: jax.Array        # [T]
    page_table: jax.Array   # [R, P]
    kv_lens: jax.Array      # [R]
    cu_q_lens: jax.Array    # [R + 1]
    num_seqs: jax.Array     # [1]
    num_layers: int
    page_size: int
    window: Optional[int]
    scale: float


class PallasTPU:
    name = "pallas_tpu"
    page_buckets = False

    def __init__(self, interpret: bool = False, kernel: Optional[Callable] = None,
                 block_sizes: Optional[tuple[int, int]] = None):
        """kernel: ragged_paged_attention by default (tests pass ref_ragged_paged_attention);
        block_sizes: (num_kv_pages_per_block, num_queries_per_block), None = the tuned table."""
        self.interpret = interpret
        self.kernel = kernel
        self.block_sizes = block_sizes

    # ------------------------------------------------------------------ layout
    def unsupported(self, cfg: Any, page_size: int, dtype: Any) -> Optional[str]:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

        kvh = cfg.num_kv_heads * cfg.kv_repeat
        if cfg.head_dim % 128:
            return f"head_dim {cfg.head_dim} is not a multiple of 128 (ragged_paged_attention's lane width)"
        try:
            rpa.get_min_heads_per_blk(kvh * (cfg.num_heads // kvh), 2 * kvh, dtype, dtype)
        except (ValueError, AssertionError) as e:
            return f"ragged_paged_attention does not tile {kvh} KV heads in {jnp.dtype(dtype).name}: {e}"
        return None

    def cache_specs(self, cfg: Any, num_pages: int, page_size: int) -> dict[str, tuple[tuple, P]]:
        kvh = cfg.num_kv_heads * cfg.kv_repeat
        shape = (cfg.num_layers * num_pages, page_size, 2 * kvh, cfg.head_dim)
        return {"k": (shape, P(None, None, "model", None)), "v": ((0,), P())}

    def prepare(self, cfg: Any, inp: Any, page_size: int) -> Meta:
        return Meta(slots=inp.slots, page_table=inp.page_table, kv_lens=inp.kv_lens, cu_q_lens=inp.cu_q_lens,
                    num_seqs=inp.num_rows, num_layers=cfg.num_layers, page_size=page_size,
                    window=cfg.sliding_window or None, scale=1.0 / math.sqrt(cfg.head_dim))

    def write(self, kc: jax.Array, vc: jax.Array, li: jax.Array, k: jax.Array, v: jax.Array,
              m: Meta) -> tuple[jax.Array, jax.Array]:
        T, kvh, D = k.shape
        n = kc.shape[0] // m.num_layers
        kv = jnp.stack([k, v], axis=2).reshape(T, 2 * kvh, D).astype(kc.dtype)   # K, V interleaved
        return kc.at[li * n + m.slots // m.page_size, m.slots % m.page_size].set(kv), vc

    def copy_page(self, cfg: Any, kc: jax.Array, vc: jax.Array, src: jax.Array, dst: jax.Array,
                  page_size: int) -> tuple[jax.Array, jax.Array]:
        base = jnp.arange(cfg.num_layers) * (kc.shape[0] // cfg.num_layers)
        return kc.at[base + dst].set(kc[base + src]), vc

    # ------------------------------------------------------------------ attention
    def attend(self, q: jax.Array, kc: jax.Array, vc: jax.Array, li: jax.Array, m: Meta) -> jax.Array:
        T, kvh, G, D = q.shape
        n = kc.shape[0] // m.num_layers
        kw = {}
        if self.block_sizes is not None:
            kw = dict(num_kv_pages_per_block=self.block_sizes[0], num_queries_per_block=self.block_sizes[1])
        if self.kernel is not None:
            kernel = self.kernel
        else:
            from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention as kernel
        ctx = contextlib.nullcontext()
        if self.interpret:
            from jax.experimental.pallas import tpu as pltpu
            ctx = pltpu.force_tpu_interpret_mode(pltpu.InterpretParams())
        with ctx:
            out = kernel(q.reshape(T, kvh * G, D), kc, m.kv_lens, m.page_table + li * n, m.cu_q_lens, m.num_seqs,
                         sm_scale=m.scale, sliding_window=m.window, **kw)
        out = jnp.pad(out, ((0, T - out.shape[0]), (0, 0), (0, 0)))     # the reference returns only real tokens
        real = jnp.arange(T) < m.cu_q_lens[m.num_seqs[0]]
        return jnp.where(real[:, None, None], out, 0).reshape(T, kvh, G, D).astype(q.dtype)
