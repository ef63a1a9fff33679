"""HF Llama-family tensors -> our fused, stacked, sharded layout (see llama.py docstring).

Each tensor is read from the memory map, transformed, cast, and written into a preallocated
device buffer with a donated in-place update, so host memory never holds more than one layer.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_engine.models.llama import LlamaConfig
from weights_convert.hf import CheckpointReader

# partition specs of each parameter kind ('model' = the tensor-parallel axis)
SPECS = {
    "embed": P(None, None),
    "lm_head": P(None, "model"),
    "final_norm": P(None),
    "layers/qkv": P(None, None, "model", None, None),
    "layers/qkv_b": P(None, "model", None, None),
    "layers/o": P(None, "model", None, None, None),
    "layers/gate_up": P(None, None, None, "model"),
    "layers/down": P(None, "model", None),
    "layers/ln1": P(None, None),
    "layers/ln2": P(None, None),
    "layers/q_norm": P(None, None),
    "layers/k_norm": P(None, None),
}
# per-output-channel int8 scales: the dims a scale keeps, and their specs
SCALE_SPECS = {
    "lm_head": (1, P("model")),                                   # keep axis V
    "layers/qkv": ((1, 2, 3), P(None, "model", None, None)),      # per-layer [KVH, G+2, D]
    "layers/o": ((4,), P(None, None)),                            # [L, H]
    "layers/gate_up": ((2, 3), P(None, None, "model")),
    "layers/down": ((2,), P(None, None)),
}
QUANTIZABLE = set(SCALE_SPECS)


def sharding_for(name: str, mesh: Optional[Mesh]) -> Any:
    if mesh is None:
        return jax.local_devices()[0]
    return NamedSharding(mesh, SPECS[name])


def scale_sharding_for(name: str, mesh: Optional[Mesh]) -> Any:
    if mesh is None:
        return jax.local_devices()[0]
    return NamedSharding(mesh, SCALE_SPECS[name][1])


def quantize_int8(w: np.ndarray, contract_axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel int8: w ≈ q * s, s = max|w| / 127 over the contraction axes."""
    amax = np.max(np.abs(w), axis=contract_axes, keepdims=True)
    s = np.where(amax == 0, 1.0, amax / 127.0).astype(np.float32)
    q = np.clip(np.rint(w / s), -127, 127).astype(np.int8)
    return q, np.squeeze(s, axis=contract_axes)


def _contract_axes(name: str) -> tuple[int, ...]:
    """Contraction axes of one layer's (unstacked) weight."""
    return {"lm_head": (0,), "layers/qkv": (0,), "layers/o": (0, 1, 2),
            "layers/gate_up": (0,), "layers/down": (0,)}[name]


def regroup_kv(qkv: np.ndarray, o: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray]:
    """Replicate each KV head r times (TP larger than the KV head count).

    qkv [H, KVH, G+2, D] -> [H, KVH*r, G/r+2, D]; o [KVH, G, D, H] -> [KVH*r, G/r, D, H].
    Query heads keep their HF order, so effective KV head j serves query heads j*G'..(j+1)*G'.
    """
    if r == 1:
        return qkv, o
    H, kvh, g2, D = qkv.shape
    G = g2 - 2
    Gp = G // r
    q = qkv[:, :, :G].reshape(H, kvh * r, Gp, D)
    k = np.repeat(qkv[:, :, G:G + 1], r, axis=1)
    v = np.repeat(qkv[:, :, G + 1:G + 2], r, axis=1)
    return np.concatenate([q, k, v], axis=2), o.reshape(kvh * r, Gp, D, o.shape[-1])


def regroup_bias(b: np.ndarray, r: int) -> np.ndarray:
    if r == 1:
        return b
    kvh, g2, D = b.shape
    G = g2 - 2
    q = b[:, :G].reshape(kvh * r, G // r, D)
    return np.concatenate([q, np.repeat(b[:, G:G + 1], r, 0), np.repeat(b[:, G + 1:], r, 0)], axis=1)


def _hf_layer(reader: CheckpointReader, cfg: LlamaConfig, i: int) -> dict[str, np.ndarray]:
    """One HF layer in our layout with kv_repeat = 1 (float32 numpy)."""
    pre = f"model.layers.{i}."
    H, nh, kvh, D, I = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    G = nh // kvh
    g = lambda n, shape: np.asarray(reader.get(pre + n, shape), dtype=np.float32)  # noqa: E731
    q = g("self_attn.q_proj.weight", (nh * D, H)).reshape(kvh, G, D, H)
    k = g("self_attn.k_proj.weight", (kvh * D, H)).reshape(kvh, 1, D, H)
    v = g("self_attn.v_proj.weight", (kvh * D, H)).reshape(kvh, 1, D, H)
    out = {
        "qkv": np.concatenate([q, k, v], axis=1).transpose(3, 0, 1, 2),
        "o": g("self_attn.o_proj.weight", (H, nh * D)).reshape(H, kvh, G, D).transpose(1, 2, 3, 0),
        "gate_up": np.stack([g("mlp.gate_proj.weight", (I, H)), g("mlp.up_proj.weight", (I, H))]).transpose(2, 0, 1),
        "down": g("mlp.down_proj.weight", (H, I)).T,
        "ln1": g("input_layernorm.weight", (H,)),
        "ln2": g("post_attention_layernorm.weight", (H,)),
    }
    if cfg.qkv_bias:
        qb = g("self_attn.q_proj.bias", (nh * D,)).reshape(kvh, G, D)
        kb = g("self_attn.k_proj.bias", (kvh * D,)).reshape(kvh, 1, D)
        vb = g("self_attn.v_proj.bias", (kvh * D,)).reshape(kvh, 1, D)
        out["qkv_b"] = np.concatenate([qb, kb, vb], axis=1)
    if cfg.qk_norm:
        out["q_norm"] = g("self_attn.q_norm.weight", (D,))
        out["k_norm"] = g("self_attn.k_norm.weight", (D,))
    return out


def _hf_top(reader: CheckpointReader, cfg: LlamaConfig) -> dict[str, np.ndarray]:
    V, H = cfg.vocab_size, cfg.hidden_size
    out = {
        "embed": np.asarray(reader.get("model.embed_tokens.weight", (V, H)), np.float32),
        "final_norm": np.asarray(reader.get("model.norm.weight", (H,)), np.float32),
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
        if name.endswith(("norm", "ln1", "ln2", "qkv_b")) or name == "final_norm":
            return arr.astype(np.float32)
        return arr.astype(self.dtype)

    def put_top(self, name: str, arr: np.ndarray) -> None:
        if self.quantize == "int8" and name in QUANTIZABLE:
            q, s = quantize_int8(arr, _contract_axes(name))
            self.params[name] = {"q": jax.device_put(q, sharding_for(name, self.mesh)),
                                 "s": jax.device_put(s, scale_sharding_for(name, self.mesh))}
        else:
            self.params[name] = jax.device_put(self._cast(name, arr), sharding_for(name, self.mesh))

    def put_layer(self, name: str, i: int, arr: np.ndarray) -> None:
        key = "layers/" + name
        L = self.cfg.num_layers
        store = self.params["layers"]
        if self.quantize == "int8" and key in QUANTIZABLE:
            q, s = quantize_int8(arr, _contract_axes(key))
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
        layer = _hf_layer(reader, cfg, i)
        layer["qkv"], layer["o"] = regroup_kv(layer["qkv"], layer["o"], cfg.kv_repeat)
        if "qkv_b" in layer:
            layer["qkv_b"] = regroup_bias(layer["qkv_b"], cfg.kv_repeat)
        for name, arr in layer.items():
            b.put_layer(name, i, arr)
        if progress:
            progress(1)
    return b.params


def count_params(cfg: LlamaConfig) -> int:
    H, V, I, L = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.num_layers
    nh, kvh, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_layer = H * (nh + 2 * kvh) * D + nh * D * H + 3 * H * I + 2 * H
    return V * H * (1 if cfg.tie_embeddings else 2) + L * per_layer + H
