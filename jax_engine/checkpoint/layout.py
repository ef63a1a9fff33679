"""The decoder's fused, stacked weight layout: the one table both loaders follow.

Every parameter kind of the Llama-family decoder (jax_engine/models/llama.py documents the
shapes) has one row in `LAYOUT`: how it is sharded over the tensor-parallel mesh axis `model`,
whether it stays float32 whatever the serving dtype, and, for int8 weight-only quantization,
its contraction axes and how its per-output-channel scale is sharded. The HF loader
(jax_engine/models/llama_weights.py), the converted-checkpoint reader (`converted.py`) and the
offline converter (weights_convert/) all read this table; nothing else spells the layout.

Names are pytree paths: top-level kinds by name ("embed"), per-layer kinds under "layers/"
("layers/qkv"); a quantized kind is a {"q", "s"} pair, flattened as "<name>.q" / "<name>.s".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


@dataclass(frozen=True)
class Kind:
    spec: P                                       # partition spec of the tensor ('model' = TP axis)
    float32: bool = False                         # norms and biases stay float32 for accuracy
    contract: Optional[tuple[int, ...]] = None    # int8: contraction axes of one (unstacked) weight
    scale_keeps: Optional[tuple[int, ...]] = None  # int8: the dims of the stacked weight a scale keeps
    scale_spec: Optional[P] = None                # int8: partition spec of the scale

    @property
    def quantizable(self) -> bool:
        return self.contract is not None


LAYOUT: dict[str, Kind] = {
    "embed": Kind(P(None, None)),
    "lm_head": Kind(P(None, "model"), contract=(0,), scale_keeps=(1,), scale_spec=P("model")),   # keep axis V
    "final_norm": Kind(P(None), float32=True),
    "layers/qkv": Kind(P(None, None, "model", None, None), contract=(0,), scale_keeps=(1, 2, 3),
                       scale_spec=P(None, "model", None, None)),                                 # [L, KVH, G+2, D]
    "layers/qkv_b": Kind(P(None, "model", None, None), float32=True),
    "layers/o": Kind(P(None, "model", None, None, None), contract=(0, 1, 2), scale_keeps=(4,),
                     scale_spec=P(None, None)),                                                 # [L, H]
    "layers/gate_up": Kind(P(None, None, None, "model"), contract=(0,), scale_keeps=(2, 3),
                           scale_spec=P(None, None, "model")),
    "layers/down": Kind(P(None, "model", None), contract=(0,), scale_keeps=(2,), scale_spec=P(None, None)),
    "layers/ln1": Kind(P(None, None), float32=True),
    "layers/ln2": Kind(P(None, None), float32=True),
    "layers/router": Kind(P(None, None, None)),                      # MoE [L, H, E]
    # MoE experts: E over the expert-parallel axis 'expert' (--ep; meshes without it leave E whole),
    # each expert's I over 'model' (jax_engine/models/moe.py runs them under shard_map)
    "layers/experts_gate_up": Kind(P(None, "expert", None, None, "model")),   # [L, E, H, 2, I]
    "layers/experts_down": Kind(P(None, "expert", "model", None)),            # [L, E, I, H]
    "layers/post_attn_norm": Kind(P(None, None), float32=True),     # Gemma's sandwich norms
    "layers/post_ff_norm": Kind(P(None, None), float32=True),
    "layers/q_norm": Kind(P(None, None), float32=True),
    "layers/k_norm": Kind(P(None, None), float32=True),
}
QUANTIZABLE = frozenset(n for n, k in LAYOUT.items() if k.quantizable)
LAYERS = "layers/"


def on_mesh(spec: P, mesh: Mesh) -> P:
    """`spec` with the axis names `mesh` does not have replaced by None (the 'expert' axis exists
    only on expert-parallel meshes)."""
    return P(*(a if a is None or a in mesh.axis_names else None for a in spec))


def sharding_for(name: str, mesh: Optional[Mesh]) -> Any:
    if mesh is None:
        return jax.local_devices()[0]
    return NamedSharding(mesh, on_mesh(LAYOUT[name].spec, mesh))


def scale_sharding_for(name: str, mesh: Optional[Mesh]) -> Any:
    if mesh is None:
        return jax.local_devices()[0]
    return NamedSharding(mesh, LAYOUT[name].scale_spec)


def quantize_int8(w: np.ndarray, contract_axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel int8: w ≈ q * s, s = max|w| / 127 over the contraction axes."""
    amax = np.max(np.abs(w), axis=contract_axes, keepdims=True)
    s = np.where(amax == 0, 1.0, amax / 127.0).astype(np.float32)
    q = np.clip(np.rint(w / s), -127, 127).astype(np.int8)
    return q, np.squeeze(s, axis=contract_axes)


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


def regroup_layer(layer: dict[str, np.ndarray], r: int) -> dict[str, np.ndarray]:
    """One layer's {"qkv", "o", ["qkv_b"]} with every KV head replicated r times (in place)."""
    layer["qkv"], layer["o"] = regroup_kv(layer["qkv"], layer["o"], r)
    if "qkv_b" in layer:
        layer["qkv_b"] = regroup_bias(layer["qkv_b"], r)
    return layer


def flatten(params: dict) -> dict[str, Any]:
    """{"embed": a, "layers": {"qkv": {"q", "s"}}} -> {"embed": a, "layers/qkv.q": .., "layers/qkv.s": ..}."""
    out: dict[str, Any] = {}
    for k, v in params.items():
        if k == "layers":
            out.update({LAYERS + n: x for n, x in flatten(v).items()})
        elif isinstance(v, dict):
            out[k + ".q"], out[k + ".s"] = v["q"], v["s"]
        else:
            out[k] = v
    return out


def split_name(flat_name: str) -> tuple[str, str, bool, str]:
    """A flattened name -> (layout kind, pytree key, per-layer?, part: "" | "q" | "s")."""
    base, _, part = flat_name.partition(".")
    per_layer = base.startswith(LAYERS)
    return base, (base[len(LAYERS):] if per_layer else base), per_layer, part
