"""Platform-dependent defaults, in one place.

`--dtype auto` for decoders means float32 on CPU and bfloat16 on GPU and TPU: weights,
activations between layers and the KV cache are stored in bfloat16 there (half the bytes a
memory-bound decode step reads), while every matmul and the attention scores accumulate in
float32 (`preferred_element_type`), RMSNorm, RoPE and softmax run in float32, and logits and
sampling stay float32. On CPU XLA runs bfloat16 matmuls slower than float32, so float32 it is.
An explicit `--dtype bfloat16` on CPU keeps the KV cache in float32 (`kv_dtype`): XLA:CPU does not
update a bfloat16 buffer in place inside the layer scan (one batch-1 step took ~170 ms, all in
the cache writes, against 0.01 ms for float32).

Encoders (jax_engine/encode/worker.py) keep their own rule: float32 on CPU, elsewhere the
checkpoint's saved half dtype if it has one (bfloat16 / float16 -> bfloat16), else float32.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jax_engine.errors import InvalidRequest

DTYPE_NAMES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


def platform() -> str:
    """The default JAX backend: 'cpu', 'gpu' (CUDA / ROCm) or 'tpu'. Tests monkeypatch this."""
    return jax.default_backend()


def is_accelerator(name: Optional[str] = None) -> bool:
    return (name or platform()) != "cpu"


def default_decoder_dtype(name: Optional[str] = None) -> str:
    """What `auto` means for a decoder on this platform."""
    return "bfloat16" if is_accelerator(name) else "float32"


def resolve_dtype(choice: Optional[str], name: Optional[str] = None) -> jnp.dtype:
    """A decoder's dtype from the `--dtype` choice (`auto` / '' / None = the platform default)."""
    if choice in ("auto", "", None):
        choice = default_decoder_dtype(name)
    if choice not in DTYPE_NAMES:
        raise InvalidRequest(f"dtype {choice!r} is not supported (auto, float32, bfloat16)")
    return DTYPE_NAMES[choice]


def kv_dtype(dtype, name: Optional[str] = None) -> jnp.dtype:
    """The KV cache's dtype for a decoder running in `dtype`: float32 on CPU (see above)."""
    return jnp.dtype(jnp.float32) if not is_accelerator(name) else jnp.dtype(dtype)
