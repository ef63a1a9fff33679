"""A tiny Llama in the engine's fused layout (no checkpoint on disk): random weights from a seed,
for tests that build the decoder module or a ModelRunner directly."""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np

from jax_engine.models.llama import LlamaConfig


def tiny_llama(seed: int, L: int, KVH: int, G: int, D: int, H: int = 32, I: int = 64, V: int = 97,
               window: Optional[int] = None) -> tuple[LlamaConfig, dict]:
    """(config, fused-layout tensors) of an L-layer Llama with KVH KV heads of G queries each,
    head size D, hidden H, MLP width I, vocabulary V; weights N(0, 0.3^2), norms ones."""
    rng = np.random.default_rng(seed)
    cfg = LlamaConfig(architecture="LlamaForCausalLM", model_type="llama", vocab_size=V, hidden_size=H,
                      intermediate_size=I, num_layers=L, num_heads=KVH * G, num_kv_heads=KVH, head_dim=D,
                      rms_eps=1e-6, max_position_embeddings=256,
                      inv_freq=tuple(1.0 / (10000.0 ** (np.arange(0, D, 2) / D))), sliding_window=window)
    w = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32) * 0.3)  # noqa: E731
    lay = "model.layers."
    tensors = {"model.embed_tokens.weight": w(V, H), "model.norm.weight": jnp.ones(H), "lm_head.weight": w(H, V),
               lay + "input_layernorm.weight": jnp.ones((L, H)), lay + "post_attention_layernorm.weight": jnp.ones((L, H)),
               lay + "self_attn.qkv_proj.weight": w(L, H, KVH, G + 2, D), lay + "self_attn.o_proj.weight": w(L, KVH, G, D, H),
               lay + "mlp.gate_up_proj.weight": w(L, H, 2, I), lay + "mlp.down_proj.weight": w(L, I, H)}
    return cfg, tensors
