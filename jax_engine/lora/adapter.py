"""A PEFT LoRA adapter folder -> host arrays in the decoder's fused layout, one slot's worth.

PEFT stores, per adapted module, lora_A [r, in] and lora_B [out, r] and applies
y += B(A(x)) * scaling with scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora).
Here the scaling is folded into B, the rank is zero-padded to --max-lora-rank, and the matrices
are laid out like the base weights they adapt (jax_engine/models/llama.py), so the step program
adds the contribution with plain 2-D GEMMs (jax_engine/models/lora.py):
  qkv_a [L, H, 3, R]           A of q, k, v (the three share the layer's normed input)
  q_b [L, R, KVH, G, D]        k_b, v_b [L, R, KVH, D]
  o_a   [L, KVH, G, D, R]      o_b [L, R, H]
  gu_a  [L, H, 2, R]           A of gate, up;  gate_b, up_b [L, R, I]
  down_a [L, I, R]             down_b [L, R, H]
A module the adapter leaves alone has zero A and B. With KV heads replicated for tensor
parallelism (kv_repeat) q/k/v_b and o_a are regrouped exactly as the base qkv and o are.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np

from jax_engine.checkpoint.hf import CheckpointReader
from jax_engine.checkpoint.layout import regroup_kv
from jax_engine.errors import InvalidRequest
from jax_engine.models.llama import LlamaConfig

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "qkv_proj", "gate_up_proj")      # the last two: Phi-3's fused matrices (one A, B split by rows)
ARRAYS = ("qkv_a", "q_b", "k_b", "v_b", "o_a", "o_b", "gu_a", "gate_b", "up_b", "down_a", "down_b")
_TENSOR = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass
class LoraAdapter:
    """One adapter, ready to be written into a slot: `arrays` holds the ARRAYS above (rank padded)."""

    name: str
    path: str
    rank: int
    alpha: float
    scaling: float
    target_modules: list[str]
    arrays: dict[str, np.ndarray] = field(repr=False)


def array_shapes(cfg: LlamaConfig, rank: int) -> dict[str, tuple[int, ...]]:
    """Shapes of one slot's arrays (without the slot axis) for a (regrouped) config."""
    L, H, D, I = cfg.num_layers, cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    kvh = cfg.num_kv_heads * cfg.kv_repeat
    G = cfg.num_heads // kvh
    return {"qkv_a": (L, H, 3, rank), "q_b": (L, rank, kvh, G, D), "k_b": (L, rank, kvh, D), "v_b": (L, rank, kvh, D),
            "o_a": (L, kvh, G, D, rank), "o_b": (L, rank, H), "gu_a": (L, H, 2, rank), "gate_b": (L, rank, I),
            "up_b": (L, rank, I), "down_a": (L, I, rank), "down_b": (L, rank, H)}


def _config(path: str) -> dict:
    f = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(f):
        raise InvalidRequest(f"lora: {path!r} has no adapter_config.json (a PEFT LoRA folder is expected)")
    try:
        with open(f) as fh:
            return json.load(fh)
    except (OSError, ValueError) as e:
        raise InvalidRequest(f"lora: {f} is not valid JSON: {e}") from None


def _check_config(c: dict, max_rank: int) -> tuple[int, float, float]:
    """(rank, alpha, scaling) of a supported LoRA config; InvalidRequest naming what is not."""
    if str(c.get("peft_type", "LORA")).upper() != "LORA":
        raise InvalidRequest(f"lora: peft_type {c.get('peft_type')!r} is not supported (only LORA)")
    r = c.get("r")
    if not isinstance(r, int) or r < 1:
        raise InvalidRequest(f"lora: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise InvalidRequest(f"lora: rank {r} exceeds --max-lora-rank {max_rank}")
    alpha = float(c.get("lora_alpha", r))
    refused = {
        "use_dora": bool(c.get("use_dora")),
        "bias": c.get("bias", "none") not in (None, "none"),
        "modules_to_save": bool(c.get("modules_to_save")),
        "rank_pattern": bool(c.get("rank_pattern")),
        "alpha_pattern": bool(c.get("alpha_pattern")),
        "fan_in_fan_out": bool(c.get("fan_in_fan_out")),
        "layer_replication": bool(c.get("layer_replication")),
    }
    bad = [k for k, v in refused.items() if v]
    if bad:
        raise InvalidRequest(f"lora: {', '.join(bad)} is not supported (plain LoRA on q/k/v/o/gate/up/down only)")
    scaling = alpha / math.sqrt(r) if c.get("use_rslora") else alpha / r
    return r, alpha, scaling


def load_adapter(name: str, path: str, cfg: LlamaConfig, max_rank: int, dtype: np.dtype) -> LoraAdapter:
    """Read and validate a PEFT LoRA folder for this base config; InvalidRequest on anything unsupported."""
    c = _config(path)
    r, alpha, scaling = _check_config(c, max_rank)
    if not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        raise InvalidRequest(f"lora: {path!r} has no adapter_model.safetensors")
    reader = CheckpointReader(path)
    L, H, D, I = cfg.num_layers, cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nh, kvh = cfg.num_heads, cfg.num_kv_heads
    G = nh // kvh
    ins = {"q_proj": H, "k_proj": H, "v_proj": H, "o_proj": nh * D, "gate_proj": H, "up_proj": H, "down_proj": I,
           "qkv_proj": H, "gate_up_proj": H}
    outs = {"q_proj": nh * D, "k_proj": kvh * D, "v_proj": kvh * D, "o_proj": H, "gate_proj": I, "up_proj": I,
            "down_proj": H, "qkv_proj": (nh + 2 * kvh) * D, "gate_up_proj": 2 * I}
    A: dict[tuple[int, str], np.ndarray] = {}
    B: dict[tuple[int, str], np.ndarray] = {}
    fused_model = cfg.model_type == "phi3"
    for key in reader.keys():
        m = _TENSOR.match(key)
        if m is None or m.group(3) not in MODULES:
            raise InvalidRequest(f"lora: tensor {key!r} adapts a module that is not supported "
                                 f"(LoRA on {', '.join(MODULES)} only)")
        if (m.group(3) in ("qkv_proj", "gate_up_proj") and not fused_model) or (
                fused_model and m.group(3) in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            raise InvalidRequest(f"lora: tensor {key!r} names a module model type {cfg.model_type!r} does not have")
        layer, mod, ab = int(m.group(1)), m.group(3), m.group(4)
        if layer >= L:
            raise InvalidRequest(f"lora: tensor {key!r} names layer {layer} but the model has {L}")
        shape = (r, ins[mod]) if ab == "A" else (outs[mod], r)
        arr = np.asarray(reader.get(key, shape), np.float32)
        (A if ab == "A" else B)[(layer, mod)] = arr
    if set(A) != set(B):
        missing = sorted(set(A) ^ set(B))[0]
        raise InvalidRequest(f"lora: layer {missing[0]} {missing[1]} has only one of lora_A / lora_B")
    if not A:
        raise InvalidRequest(f"lora: {path!r} holds no LoRA tensors")

    # HF -> our layout at kv_repeat 1, rank padded to max_rank, scaling folded into B
    R = max_rank
    z = np.zeros
    qkv_a, qkv_b = z((L, H, 3, R), np.float32), z((L, R, kvh, G + 2, D), np.float32)
    o_a, o_b = z((L, kvh, G, D, R), np.float32), z((L, R, H), np.float32)
    gu_a, gu_b = z((L, H, 2, R), np.float32), z((L, R, 2, I), np.float32)
    down_a, down_b = z((L, I, R), np.float32), z((L, R, H), np.float32)
    parts: list[tuple[int, str, np.ndarray, np.ndarray]] = []     # (layer, unfused module, A, B)
    for (li, mod), a in A.items():
        b = B[(li, mod)] * scaling
        if mod == "qkv_proj":
            parts += [(li, p, a, bp) for p, bp in zip(("q_proj", "k_proj", "v_proj"), np.split(b, [nh * D, (nh + kvh) * D]))]
        elif mod == "gate_up_proj":
            parts += [(li, p, a, bp) for p, bp in zip(("gate_proj", "up_proj"), np.split(b, 2))]
        else:
            parts.append((li, mod, a, b))
    for li, mod, a, b in parts:
        if mod in ("q_proj", "k_proj", "v_proj"):
            c = ("q_proj", "k_proj", "v_proj").index(mod)
            qkv_a[li, :, c, :r] = a.T
            if mod == "q_proj":
                qkv_b[li, :r, :, :G] = b.reshape(kvh, G, D, r).transpose(3, 0, 1, 2)
            else:
                qkv_b[li, :r, :, G + c - 1] = b.reshape(kvh, D, r).transpose(2, 0, 1)
        elif mod == "o_proj":
            o_a[li, ..., :r] = a.reshape(r, kvh, G, D).transpose(1, 2, 3, 0)
            o_b[li, :r] = b.T
        elif mod in ("gate_proj", "up_proj"):
            c = 0 if mod == "gate_proj" else 1
            gu_a[li, :, c, :r] = a.T
            gu_b[li, :r, c] = b.T
        else:
            down_a[li, :, :r] = a.T
            down_b[li, :r] = b.T
    if cfg.kv_repeat > 1:   # regroup like the base qkv / o (R plays the role of H)
        pairs = [regroup_kv(qkv_b[li], o_a[li], cfg.kv_repeat) for li in range(L)]
        qkv_b = np.stack([p[0] for p in pairs])
        o_a = np.stack([p[1] for p in pairs])
    Gr = qkv_b.shape[3] - 2                  # query heads per (replicated) KV head
    arrays = dict(qkv_a=qkv_a, q_b=qkv_b[:, :, :, :Gr], k_b=qkv_b[:, :, :, Gr], v_b=qkv_b[:, :, :, Gr + 1],
                  o_a=o_a, o_b=o_b, gu_a=gu_a, gate_b=gu_b[:, :, 0], up_b=gu_b[:, :, 1], down_a=down_a, down_b=down_b)
    want = array_shapes(cfg, R)
    assert all(arrays[k].shape == want[k] for k in ARRAYS), {k: arrays[k].shape for k in ARRAYS}
    targets = sorted({mod for _, mod in A}, key=MODULES.index)
    return LoraAdapter(name=name, path=os.path.abspath(path), rank=r, alpha=alpha, scaling=scaling,
                       target_modules=targets, arrays={k: np.ascontiguousarray(v, dtype=dtype) for k, v in arrays.items()})
