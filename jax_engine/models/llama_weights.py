"""HF Llama-family tensors -> the fused, stacked, sharded layout of jax_engine/checkpoint/layout.py.

Each tensor is read from the memory map, transformed, cast, and written into a preallocated
device buffer with a donated in-place update, so host memory never holds more than one layer.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jax_engine.checkpoint.converted import is_converted, load_converted
from jax_engine.checkpoint.hf import CheckpointReader
from jax_engine.checkpoint.layout import (
    LAYOUT,
    QUANTIZABLE,
    quantize_int8,
    regroup_layer,
    scale_sharding_for,
    sharding_for,
)
from jax_engine.models.llama import LlamaConfig


def _hf_layer(reader: CheckpointReader, cfg: LlamaConfig, i: int) -> dict[str, np.ndarray]:
    """One HF layer in our layout with kv_repeat = 1 (float32 numpy)."""
    pre = f"model.layers.{i}."
    H, nh, kvh, D, FF = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    G = nh // kvh
    g = lambda n, shape: np.asarray(reader.get(pre + n, shape), dtype=np.float32)  # noqa: E731
    if cfg.model_type == "phi3":         # fused [q; k; v] and [gate; up] rows
        qkv = g("self_attn.qkv_proj.weight", ((nh + 2 * kvh) * D, H))
        q_w, k_w, v_w = np.split(qkv, [nh * D, (nh + kvh) * D])
        gate_w, up_w = np.split(g("mlp.gate_up_proj.weight", (2 * FF, H)), 2)
    else:
        q_w, k_w, v_w = (g(f"self_attn.{n}_proj.weight", (m * D, H)) for n, m in (("q", nh), ("k", kvh), ("v", kvh)))
        if not cfg.num_experts:
            gate_w, up_w = g("mlp.gate_proj.weight", (FF, H)), g("mlp.up_proj.weight", (FF, H))
    q = q_w.reshape(kvh, G, D, H)
    k = k_w.reshape(kvh, 1, D, H)
    v = v_w.reshape(kvh, 1, D, H)
    out = {
        "qkv": np.concatenate([q, k, v], axis=1).transpose(3, 0, 1, 2),
        "o": g("self_attn.o_proj.weight", (H, nh * D)).reshape(H, kvh, G, D).transpose(1, 2, 3, 0),
        "ln1": g("input_layernorm.weight", (H,)),
    }
    if cfg.num_experts:
        out.update(_hf_experts(g, cfg))
    else:
        out["gate_up"] = np.stack([gate_w, up_w]).transpose(2, 0, 1)
        out["down"] = g("mlp.down_proj.weight", (H, FF)).T
    if cfg.sandwich_norms:        # Gemma: input, post-attention, pre- and post-feedforward norms
        out["post_attn_norm"] = g("post_attention_layernorm.weight", (H,))
        out["ln2"] = g("pre_feedforward_layernorm.weight", (H,))
        out["post_ff_norm"] = g("post_feedforward_layernorm.weight", (H,))
    else:
        out["ln2"] = g("post_attention_layernorm.weight", (H,))
    if cfg.qkv_bias:
        qb = g("self_attn.q_proj.bias", (nh * D,)).reshape(kvh, G, D)
        kb = g("self_attn.k_proj.bias", (kvh * D,)).reshape(kvh, 1, D)
        vb = g("self_attn.v_proj.bias", (kvh * D,)).reshape(kvh, 1, D)
        out["qkv_b"] = np.concatenate([qb, kb, vb], axis=1)
    if cfg.qk_norm:
        out["q_norm"] = g("self_attn.q_norm.weight", (D,))
        out["k_norm"] = g("self_attn.k_norm.weight", (D,))
    if _norm_plus_one(cfg):
        for n in NORMS:
            if n in out:
                out[n] = out[n] + 1.0
    return out


def _hf_experts(g: Callable[[str, tuple], np.ndarray], cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """Router [H, E], experts_gate_up [E, H, 2, I], experts_down [E, I, H] of one MoE layer
    (Mixtral: block_sparse_moe.{gate, experts.e.w1 / w3 / w2}; Qwen3-MoE: mlp.{gate, experts.e.*_proj})."""
    H, E, FF = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size
    if cfg.model_type == "mixtral":
        pre, names = "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        pre, names = "mlp.", ("gate_proj", "up_proj", "down_proj")
    ex = [[g(f"{pre}experts.{e}.{n}.weight", (FF, H) if i < 2 else (H, FF)) for i, n in enumerate(names)]
          for e in range(E)]
    return {"router": g(f"{pre}gate.weight", (E, H)).T,
            "experts_gate_up": np.stack([np.stack([gt.T, up.T], axis=1) for gt, up, _ in ex]),
            "experts_down": np.stack([dn.T for _, _, dn in ex])}


NORMS = ("ln1", "ln2", "post_attn_norm", "post_ff_norm", "q_norm", "k_norm", "final_norm")


def _norm_plus_one(cfg: LlamaConfig) -> bool:
    """Gemma's RMSNorm multiplies by (1 + weight): the 1 is added here, once, at load."""
    return cfg.model_type in ("gemma2", "gemma3_text")


def _hf_top(reader: CheckpointReader, cfg: LlamaConfig) -> dict[str, np.ndarray]:
    V, H = cfg.vocab_size, cfg.hidden_size
    out = {
        "embed": np.asarray(reader.get("model.embed_tokens.weight", (V, H)), np.float32),
        "final_norm": np.asarray(reader.get("model.norm.weight", (H,)), np.float32) + (1.0 if _norm_plus_one(cfg) else 0.0),
    }
    if not cfg.tie_embeddings:
        out["lm_head"] = np.asarray(reader.get("lm_head.weight", (V, H)), np.float32).T
    return out


def _put_layer_fn():
    return jax.jit(lambda buf, x, i: jax.lax.dynamic_update_index_in_dim(buf, x, i, 0), donate_argnums=0)


class _Builder:
    """Places tensors on device: top-level ones directly, per-layer ones into stacked buffers."""

    def __init__(self, cfg: LlamaConfig, dtype: Any, quantize: str, mesh: Optional[Mesh]):
        self.cfg, self.dtype, self.quantize, self.mesh = cfg, dtype, quantize, mesh
        self.params: dict[str, Any] = {"layers": {}}
        self._put = _put_layer_fn()

    def _cast(self, name: str, arr: np.ndarray) -> np.ndarray:
        # norms and biases stay float32 for accuracy; matrices take the serving dtype
        if LAYOUT[name].float32:
            return arr.astype(np.float32)
        return arr.astype(self.dtype)

    def put_top(self, name: str, arr: np.ndarray) -> None:
        if self.quantize == "int8" and name in QUANTIZABLE:
            q, s = quantize_int8(arr, LAYOUT[name].contract)
            self.params[name] = {"q": jax.device_put(q, sharding_for(name, self.mesh)),
                                 "s": jax.device_put(s, scale_sharding_for(name, self.mesh))}
        else:
            self.params[name] = jax.device_put(self._cast(name, arr), sharding_for(name, self.mesh))

    def put_layer(self, name: str, i: int, arr: np.ndarray) -> None:
        key = "layers/" + name
        L = self.cfg.num_layers
        store = self.params["layers"]
        if self.quantize == "int8" and key in QUANTIZABLE:
            q, s = quantize_int8(arr, LAYOUT[key].contract)
            if name not in store:
                store[name] = {
                    "q": jnp.zeros((L,) + q.shape, jnp.int8, device=sharding_for(key, self.mesh)),
                    "s": jnp.zeros((L,) + s.shape, jnp.float32, device=scale_sharding_for(key, self.mesh)),
                }
            store[name]["q"] = self._put(store[name]["q"], q[None], i)
            store[name]["s"] = self._put(store[name]["s"], s[None], i)
            return
        arr = self._cast(key, arr)
        if name not in store:
            store[name] = jnp.zeros((L,) + arr.shape, arr.dtype, device=sharding_for(key, self.mesh))
        store[name] = self._put(store[name], arr[None], i)


def load_hf_params(reader: CheckpointReader, cfg: LlamaConfig, dtype: Any, quantize: str,
                   mesh: Optional[Mesh], progress: Optional[Callable[[int], None]] = None) -> dict:
    """Stream an HF checkpoint into device params."""
    b = _Builder(cfg, dtype, quantize, mesh)
    for name, arr in _hf_top(reader, cfg).items():
        b.put_top(name, arr)
    for i in range(cfg.num_layers):
        layer = regroup_layer(_hf_layer(reader, cfg, i), cfg.kv_repeat)
        for name, arr in layer.items():
            b.put_layer(name, i, arr)
        if progress:
            progress(1)
    return b.params


def load_params(path: str, cfg: LlamaConfig, dtype: Any, quantize: str, mesh: Optional[Mesh],
                progress: Optional[Callable[[int], None]] = None) -> dict:
    """Device params from an HF folder, or from a converted checkpoint (already in the layout)."""
    if is_converted(path):
        return load_converted(path, cfg, dtype, quantize, mesh, progress)
    return load_hf_params(CheckpointReader(path), cfg, dtype, quantize, mesh, progress=progress)


def count_params(cfg: LlamaConfig) -> int:
    H, V, FF, L = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.num_layers
    nh, kvh, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    mlp = cfg.num_experts * (3 * H * FF + H) if cfg.num_experts else 3 * H * FF
    per_layer = H * (nh + 2 * kvh) * D + nh * D * H + mlp + 2 * H
    return V * H * (1 if cfg.tie_embeddings else 2) + L * per_layer + H
