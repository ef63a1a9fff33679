"""HF Llama-family checkpoints -> the nnx decoder (jax_engine/models/decoder.py), by name mapping.

Every HF tensor of a layer is renamed by one table (`RENAMES`: HF name -> the module path it
feeds, and which part of that fused parameter it is); the few fused parameters then assemble
their parts (`FUSE`: q/k/v heads into qkv_proj, gate and up into gate_up_proj, one stack per MoE
expert), everything else is a transpose into the layout decoder.py documents. Tensors are read
from the memory map, transformed, cast, and written into preallocated stacked device buffers
with a donated in-place update, so host memory never holds more than one layer.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jax_engine.checkpoint.converted import is_converted, load_converted
from jax_engine.checkpoint.hf import CheckpointError, CheckpointReader
from jax_engine.checkpoint.layout import (
    LAYERS,
    LAYOUT,
    QUANTIZABLE,
    quantize_int8,
    regroup_layer,
    scale_name,
    sharding_for,
)
from jax_engine.models import decoder
from jax_engine.models.llama import LlamaConfig

# HF name within "model.layers.{i}." -> (module path under "model.layers.", part). A part names
# the piece of a fused parameter ("q", "gate"); None is the whole tensor.
RENAMES: tuple[tuple[str, str, Optional[str]], ...] = (
    (r"self_attn\.(q|k|v)_proj\.weight", "self_attn.qkv_proj.weight", r"\1"),
    (r"self_attn\.qkv_proj\.weight", "self_attn.qkv_proj.weight", "qkv"),           # Phi-3: fused rows
    (r"self_attn\.(q|k|v)_proj\.bias", "self_attn.qkv_proj.bias", r"\1"),
    (r"self_attn\.o_proj\.(weight|bias)", r"self_attn.o_proj.\1", None),
    (r"self_attn\.(q_norm|k_norm)\.weight", r"self_attn.\1.weight", None),
    (r"mlp\.(gate|up)_proj\.weight", "mlp.gate_up_proj.weight", r"\1"),
    (r"mlp\.gate_up_proj\.weight", "mlp.gate_up_proj.weight", "gate_up"),           # Phi-3
    (r"mlp\.down_proj\.weight", "mlp.down_proj.weight", None),
    (r"(input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|post_feedforward_layernorm)\.weight",
     r"\1.weight", None),
    (r"(?:mlp|block_sparse_moe)\.gate\.weight", "mlp.gate.weight", None),            # MoE router
)
# one MoE expert's matrix -> part (gate | up | down, expert): Qwen3-MoE, and Mixtral's w1 / w3 / w2
EXPERTS = (re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight"),
           re.compile(r"block_sparse_moe\.experts\.(\d+)\.w([123])\.weight"))
_MIXTRAL = {"1": "gate", "3": "up", "2": "down"}
IGNORED = re.compile(r"self_attn\.rotary_emb\.inv_freq")     # recomputed from the config (old Llama files)
_RULES = tuple((re.compile(p), t, part) for p, t, part in RENAMES)


def rename(hf: str) -> Optional[tuple[str, Any]]:
    """(module path under "model.layers.", part) of a layer's HF tensor (its name within the
    layer), None if the decoder has no place for it."""
    for rx, target, part in _RULES:
        m = rx.fullmatch(hf)
        if m:
            return m.expand(target), (m.expand(part) if part is not None else None)
    for rx in EXPERTS:
        m = rx.fullmatch(hf)
        if m:
            which = _MIXTRAL.get(m.group(2), m.group(2))
            target = "mlp.experts.down_proj.weight" if which == "down" else "mlp.experts.gate_up_proj.weight"
            return target, (which, int(m.group(1)))
    return None


def _qkv(parts: dict, cfg: LlamaConfig, bias: bool) -> np.ndarray:
    """q/k/v (or Phi-3's fused rows) -> [H, KVH, G+2, D] ([KVH, G+2, D] for the bias)."""
    nh, kvh, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    G = nh // kvh
    if "qkv" in parts:
        q, k, v = np.split(parts["qkv"], [nh * D, (nh + kvh) * D])
    else:
        q, k, v = parts["q"], parts["k"], parts["v"]
    lead = q.shape[1:]                                # (H,) for weights, () for biases
    w = np.concatenate([q.reshape((kvh, G, D) + lead), k.reshape((kvh, 1, D) + lead),
                        v.reshape((kvh, 1, D) + lead)], axis=1)
    return w if bias else w.transpose(3, 0, 1, 2)


def _gate_up(parts: dict, cfg: LlamaConfig) -> np.ndarray:
    gate, up = np.split(parts["gate_up"], 2) if "gate_up" in parts else (parts["gate"], parts["up"])
    return np.stack([gate, up]).transpose(2, 0, 1)                 # [H, 2, I]


def _experts(parts: dict, cfg: LlamaConfig, down: bool) -> np.ndarray:
    E = cfg.num_experts
    if down:                                                       # [E, I, H]
        return np.stack([parts[("down", e)].T for e in range(E)])
    return np.stack([np.stack([parts[("gate", e)].T, parts[("up", e)].T], axis=1) for e in range(E)])  # [E, H, 2, I]


L_ = LAYERS
FUSE: dict[str, Callable[[dict, LlamaConfig], np.ndarray]] = {
    L_ + "self_attn.qkv_proj.weight": lambda p, c: _qkv(p, c, bias=False),
    L_ + "self_attn.qkv_proj.bias": lambda p, c: _qkv(p, c, bias=True),
    L_ + "self_attn.o_proj.weight":                                # [H, nh*D] -> [KVH, G, D, H]
        lambda p, c: p.reshape(c.hidden_size, c.num_kv_heads, c.group, c.head_dim).transpose(1, 2, 3, 0),
    L_ + "mlp.gate_up_proj.weight": _gate_up,
    L_ + "mlp.down_proj.weight": lambda p, c: p.T,
    L_ + "mlp.gate.weight": lambda p, c: p.T,                      # router [H, E]
    L_ + "mlp.experts.gate_up_proj.weight": lambda p, c: _experts(p, c, down=False),
    L_ + "mlp.experts.down_proj.weight": lambda p, c: _experts(p, c, down=True),
}


def norm_plus_one(cfg: LlamaConfig) -> bool:
    """Gemma's RMSNorm multiplies by (1 + weight): the 1 is added here, once, at load."""
    return cfg.model_type in ("gemma2", "gemma3_text")


def hf_layer_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The HF tensors (names within a layer) a layer of this config must have, with their shapes:
    what the checkpoint is checked against before the mapping places anything."""
    H, nh, kvh, D, FF, E = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                            cfg.intermediate_size, cfg.num_experts)
    out: dict[str, tuple[int, ...]] = {"self_attn.o_proj.weight": (H, nh * D), "input_layernorm.weight": (H,),
                                       "post_attention_layernorm.weight": (H,)}
    if cfg.model_type == "phi3":         # fused [q; k; v] and [gate; up] rows
        out.update({"self_attn.qkv_proj.weight": ((nh + 2 * kvh) * D, H), "mlp.gate_up_proj.weight": (2 * FF, H)})
    else:
        out.update({f"self_attn.{n}_proj.weight": (m * D, H) for n, m in (("q", nh), ("k", kvh), ("v", kvh))})
    if cfg.qkv_bias:
        out.update({f"self_attn.{n}_proj.bias": (m * D,) for n, m in (("q", nh), ("k", kvh), ("v", kvh))})
    if cfg.o_bias:
        out["self_attn.o_proj.bias"] = (H,)
    if cfg.qk_norm:
        out.update({"self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,)})
    if cfg.sandwich_norms:
        out.update({"pre_feedforward_layernorm.weight": (H,), "post_feedforward_layernorm.weight": (H,)})
    if E and cfg.model_type == "mixtral":
        out["block_sparse_moe.gate.weight"] = (E, H)
        out.update({f"block_sparse_moe.experts.{e}.w{j}.weight": (H, FF) if j == 2 else (FF, H)
                    for e in range(E) for j in (1, 2, 3)})
    elif E:
        out["mlp.gate.weight"] = (E, H)
        out.update({f"mlp.experts.{e}.{n}_proj.weight": (H, FF) if n == "down" else (FF, H)
                    for e in range(E) for n in ("gate", "up", "down")})
    elif cfg.model_type != "phi3":
        out.update({"mlp.gate_proj.weight": (FF, H), "mlp.up_proj.weight": (FF, H)})
    if not E:
        out["mlp.down_proj.weight"] = (H, FF)
    return out


def hf_layer(reader: CheckpointReader, cfg: LlamaConfig, i: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """One HF layer as the decoder's per-layer tensors (float32 numpy, kv_repeat = 1): every tensor
    of `shapes` (hf_layer_shapes) read and checked, renamed by the table, fused."""
    pre = f"model.layers.{i}."
    extra = [k for k in reader.keys() if k.startswith(pre) and k[len(pre):] not in shapes
             and not IGNORED.fullmatch(k[len(pre):])]
    if extra:
        raise CheckpointError(f"{extra[0]}: the {cfg.model_type} decoder has no parameter for it "
                              f"(a config option the engine does not support?)")
    grouped: dict[str, dict] = {}
    for rel, shape in shapes.items():
        hit = rename(rel)
        assert hit is not None, rel                      # hf_layer_shapes and RENAMES agree (tested)
        target, part = hit
        grouped.setdefault(L_ + target, {})[part] = np.asarray(reader.get(pre + rel, shape), dtype=np.float32)
    out = {}
    for name, parts in grouped.items():
        src = parts[None] if set(parts) == {None} else parts       # one whole tensor, or the parts of a fused one
        out[name] = FUSE[name](src, cfg) if name in FUSE else src
        if norm_plus_one(cfg) and name.endswith("norm.weight"):
            out[name] = out[name] + 1.0
    return out


def hf_top(reader: CheckpointReader, cfg: LlamaConfig) -> dict[str, np.ndarray]:
    V, H = cfg.vocab_size, cfg.hidden_size
    out = {"model.embed_tokens.weight": np.asarray(reader.get("model.embed_tokens.weight", (V, H)), np.float32),
           "model.norm.weight": np.asarray(reader.get("model.norm.weight", (H,)), np.float32)
           + (1.0 if norm_plus_one(cfg) else 0.0)}
    if not cfg.tie_embeddings:              # HF [V, H] -> the module's [H, V]
        out["lm_head.weight"] = np.asarray(reader.get("lm_head.weight", (V, H)), np.float32).T
    return out


def _put_layer_fn():
    return jax.jit(lambda buf, x, i: jax.lax.dynamic_update_index_in_dim(buf, x, i, 0), donate_argnums=0)


class _Builder:
    """Places tensors on device under their module paths: top-level ones directly, per-layer ones
    into stacked buffers; int8 weights as "<path>.weight" and "<path>.scale"."""

    def __init__(self, cfg: LlamaConfig, dtype: Any, quantize: str, mesh: Optional[Mesh]):
        self.cfg, self.dtype, self.quantize, self.mesh = cfg, dtype, quantize, mesh
        self.tensors: dict[str, Any] = {}
        self._put = _put_layer_fn()

    def _cast(self, name: str, arr: np.ndarray) -> np.ndarray:
        # norms and biases stay float32 for accuracy; matrices take the serving dtype
        return arr.astype(np.float32 if LAYOUT[name].float32 else self.dtype)

    def _parts(self, name: str, arr: np.ndarray) -> dict[str, np.ndarray]:
        if self.quantize == "int8" and name in QUANTIZABLE:
            q, s = quantize_int8(arr, LAYOUT[name].contract)
            return {name: q, scale_name(name): s}
        return {name: self._cast(name, arr)}

    def put_top(self, name: str, arr: np.ndarray) -> None:
        for n, a in self._parts(name, arr).items():
            self.tensors[n] = jax.device_put(a, sharding_for(n, self.mesh))

    def put_layer(self, name: str, i: int, arr: np.ndarray) -> None:
        for n, a in self._parts(name, arr).items():
            if n not in self.tensors:
                self.tensors[n] = jnp.zeros((self.cfg.num_layers,) + a.shape, a.dtype, device=sharding_for(n, self.mesh))
            self.tensors[n] = self._put(self.tensors[n], a[None], i)


def load_hf_tensors(reader: CheckpointReader, cfg: LlamaConfig, dtype: Any, quantize: str,
                    mesh: Optional[Mesh], progress: Optional[Callable[[int], None]] = None) -> dict[str, Any]:
    """Stream an HF checkpoint into device tensors named by module path."""
    b = _Builder(cfg, dtype, quantize, mesh)
    for name, arr in hf_top(reader, cfg).items():
        b.put_top(name, arr)
    shapes = hf_layer_shapes(cfg)
    for i in range(cfg.num_layers):
        for name, arr in regroup_layer(hf_layer(reader, cfg, i, shapes), cfg.kv_repeat).items():
            b.put_layer(name, i, arr)
        if progress:
            progress(1)
    return b.tensors


def load_model(path: str, cfg: LlamaConfig, dtype: Any, quantize: str, mesh: Optional[Mesh],
               progress: Optional[Callable[[int], None]] = None) -> decoder.CausalLM:
    """The decoder module over an HF folder's weights or a converted checkpoint's."""
    if is_converted(path):
        tensors = load_converted(path, cfg, dtype, quantize, mesh, progress)
    else:
        tensors = load_hf_tensors(CheckpointReader(path), cfg, dtype, quantize, mesh, progress=progress)
    try:
        return decoder.build(cfg, tensors)
    except KeyError as e:
        raise CheckpointError(f"{path}: the checkpoint has no {e.args[0]} (every {cfg.model_type} layer needs it)") from e
