"""The decoder's fused, stacked weight layout: the one table both loaders follow.

Every parameter of the Llama-family decoder (jax_engine/models/decoder.py documents the module
paths and shapes) has one row in `LAYOUT`: how it is sharded over the tensor-parallel mesh axis `model`,
whether it stays float32 whatever the serving dtype, and, for int8 weight-only quantization,
its contraction axes and how its per-output-channel scale is sharded. The HF loader
(jax_engine/models/llama_weights.py), the converted-checkpoint reader (`converted.py`) and the
offline converter (weights_convert/) all read this table, and the nnx modules carry its
partition specs as their parameters' sharding metadata; nothing else spells the layout.

Names are the modules' parameter paths, which follow Hugging Face's with the layer index dropped
("model.layers.self_attn.qkv_proj.weight"); an int8 weight's per-channel scale is "<path>.scale".
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
    scale_spec: Optional[P] = None                # int8: partition spec of the scale

    @property
    def quantizable(self) -> bool:
        return self.contract is not None


L_ = "model.layers."
LAYOUT: dict[str, Kind] = {
    "model.embed_tokens.weight": Kind(P(None, None)),
    "lm_head.weight": Kind(P(None, "model"), contract=(0,), scale_spec=P("model")),   # keep axis V
    "model.norm.weight": Kind(P(None), float32=True),
    L_ + "self_attn.qkv_proj.weight": Kind(P(None, None, "model", None, None), contract=(0,),
                                           scale_spec=P(None, "model", None, None)),             # [L, KVH, G+2, D]
    L_ + "self_attn.qkv_proj.bias": Kind(P(None, "model", None, None), float32=True),
    L_ + "self_attn.o_proj.bias": Kind(P(None, None), float32=True),                       # [L, H]
    L_ + "self_attn.o_proj.weight": Kind(P(None, "model", None, None, None), contract=(0, 1, 2),
                                         scale_spec=P(None, None)),                               # [L, H]
    L_ + "mlp.gate_up_proj.weight": Kind(P(None, None, None, "model"), contract=(0,),
                                         scale_spec=P(None, None, "model")),
    L_ + "mlp.down_proj.weight": Kind(P(None, "model", None), contract=(0,), scale_spec=P(None, None)),
    L_ + "input_layernorm.weight": Kind(P(None, None), float32=True),
    L_ + "post_attention_layernorm.weight": Kind(P(None, None), float32=True),
    L_ + "mlp.gate.weight": Kind(P(None, None, None)),                   # MoE router [L, H, E]
    # MoE experts: E over the expert-parallel axis 'expert' (--ep; meshes without it leave E whole),
    # each expert's I over 'model' (jax_engine/models/moe.py runs them under shard_map)
    # int8: per expert and output channel, the scales [L, E, 2, I] and [L, E, H]
    L_ + "mlp.experts.gate_up_proj.weight": Kind(P(None, "expert", None, None, "model"), contract=(1,),
                                                 scale_spec=P(None, "expert", None, "model")),   # [L, E, H, 2, I]
    L_ + "mlp.experts.down_proj.weight": Kind(P(None, "expert", "model", None), contract=(1,),
                                              scale_spec=P(None, "expert", None)),               # [L, E, I, H]
    L_ + "pre_feedforward_layernorm.weight": Kind(P(None, None), float32=True),     # Gemma's sandwich norms
    L_ + "post_feedforward_layernorm.weight": Kind(P(None, None), float32=True),
    L_ + "self_attn.q_norm.weight": Kind(P(None, None), float32=True),
    L_ + "self_attn.k_norm.weight": Kind(P(None, None), float32=True),
}
QUANTIZABLE = frozenset(n for n, k in LAYOUT.items() if k.quantizable)
LAYERS = L_
SCALE = ".scale"


def kind_of(name: str) -> tuple[str, bool]:
    """A tensor name -> (its LAYOUT entry, whether it is an int8 weight's scale)."""
    if name.endswith(SCALE):
        return name[:-len(SCALE)] + ".weight", True
    return name, False


def scale_name(name: str) -> str:
    """The name of int8 weight `name`'s scale: "<path>.weight" -> "<path>.scale"."""
    assert name.endswith(".weight"), name
    return name[:-len(".weight")] + SCALE


def spec_of(name: str) -> P:
    """The partition spec of tensor `name` (an int8 weight's "<path>.scale" included)."""
    kind, is_scale = kind_of(name)
    k = LAYOUT[kind]
    return (k.scale_spec if is_scale else k.spec) or P()


def on_mesh(spec: P, mesh: Mesh) -> P:
    """`spec` with the axis names `mesh` does not have replaced by None (the 'expert' axis exists
    only on expert-parallel meshes)."""
    return P(*(a if a is None or a in mesh.axis_names else None for a in spec))


def sharding_for(name: str, mesh: Optional[Mesh]) -> Any:
    """Where tensor `name` (an int8 weight's "<path>.scale" included) lives on `mesh`."""
    if mesh is None:
        return jax.local_devices()[0]
    return NamedSharding(mesh, on_mesh(spec_of(name), mesh))


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


QKV, O, QKV_BIAS = (LAYERS + "self_attn.qkv_proj.weight", LAYERS + "self_attn.o_proj.weight",
                    LAYERS + "self_attn.qkv_proj.bias")


def regroup_layer(layer: dict[str, np.ndarray], r: int) -> dict[str, np.ndarray]:
    """One layer's tensors (by name) with every KV head of qkv, o and the qkv bias replicated r
    times (in place)."""
    layer[QKV], layer[O] = regroup_kv(layer[QKV], layer[O], r)
    if QKV_BIAS in layer:
        layer[QKV_BIAS] = regroup_bias(layer[QKV_BIAS], r)
    return layer
