"""CPU backend: the reference's cache layout and prefill math, plus a C++ decode kernel.

Decode (one query token per row) calls jax_engine/kernels/cpu.cc through an XLA custom call that
walks each row's page table and reads only its valid keys, in place; the reference instead
gathers the whole page bucket of every row into a fresh [B, S, KVH, D] array per layer (about a
quarter of a batch-16 decode step on 2 cores). Prefill chunks (Tq > 1) keep the reference's
masked softmax, which XLA runs as large batched matmuls. float32 caches (what CPU always uses,
jax_engine/backend.kv_dtype), tp 1 only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jax_engine.attention.reference import Meta, Reference
from jax_engine.kernels import cpu as cpu_kernels


@dataclass
class CpuMeta(Meta):
    page_table: Optional[jax.Array] = None   # [B, P]
    kv_lens: Optional[jax.Array] = None      # [B]
    positions: Optional[jax.Array] = None    # [B, Tq]
    page_size: int = 0
    window: int = 0


class CpuKernel(Reference):
    name = "cpu"

    def unsupported(self, cfg: Any, page_size: int, dtype: Any) -> Optional[str]:
        if jnp.dtype(dtype) not in (jnp.float32, jnp.bfloat16):   # the KV cache is float32 on CPU either way
            return f"the CPU decode kernel takes float32 or bfloat16 models (dtype {jnp.dtype(dtype).name})"
        if not cpu_kernels.available():
            return f"the CPU kernels did not build: {cpu_kernels.reason()}"
        return None

    def prepare(self, cfg: Any, inp: Any, page_size: int) -> CpuMeta:
        m = super().prepare(cfg, inp, page_size)
        return CpuMeta(gather=m.gather, mask=m.mask, flat_slots=m.flat_slots, scale=m.scale,
                       page_table=inp.page_table, kv_lens=inp.kv_lens, positions=inp.positions,
                       page_size=page_size, window=int(cfg.sliding_window or 0))

    def attend(self, q: jax.Array, kc: jax.Array, vc: jax.Array, li: jax.Array, m: CpuMeta) -> jax.Array:
        B, Tq, kvh, G, D = q.shape
        if Tq != 1 or kc.dtype != jnp.float32:
            return super().attend(q, kc, vc, li, m)
        out = cpu_kernels.decode_attention(q[:, 0], kc, vc, m.page_table, m.kv_lens, m.positions[:, 0], li,
                                           page_size=m.page_size, window=m.window, scale=m.scale)
        return out[:, None].astype(q.dtype)
