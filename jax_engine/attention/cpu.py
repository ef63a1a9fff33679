"""CPU backend: the reference's cache layout, with a C++ kernel for every query token.

Every token of a ragged step (a decode row's one token or a prefill chunk's) calls
jax_engine/kernels/cpu.cc through an XLA custom call that walks its row's page table and reads
only the keys it may see (position + 1 of them, fewer inside a sliding window), in place: a
decode row streams its pages as before, a prefill token reads its chunk's earlier keys and the
row's earlier pages. The reference instead gathers the whole page bucket per token into a fresh
array. Because the kernel reads only valid keys, the step program does not depend on the page
table's width (`page_buckets = False`: one bucket, the model's full span). float32 caches (what
CPU always uses, jax_engine/backend.kv_dtype), tp 1 only.
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from jax_engine.attention.reference import Meta, Reference
from jax_engine.kernels import cpu as cpu_kernels


class CpuKernel(Reference):
    name = "cpu"
    page_buckets = False

    def unsupported(self, cfg: Any, page_size: int, dtype: Any) -> Optional[str]:
        if jnp.dtype(dtype) not in (jnp.float32, jnp.bfloat16):   # the KV cache is float32 on CPU either way
            return f"the CPU attention kernel takes float32 or bfloat16 models (dtype {jnp.dtype(dtype).name})"
        if not cpu_kernels.available():
            return f"the CPU kernels did not build: {cpu_kernels.reason()}"
        return None

    def attend(self, q: jax.Array, kc: jax.Array, vc: jax.Array, li: jax.Array, m: Meta) -> jax.Array:
        if kc.dtype != jnp.float32 or m.softcap or m.windows is not None:   # the kernel has neither (Gemma)
            return super().attend(q, kc, vc, li, m)
        out = cpu_kernels.decode_attention(q, kc, vc, m.table, m.kv_limit, m.positions, li,
                                           page_size=m.page_size, window=m.window, scale=m.scale)
        return out.astype(q.dtype)
