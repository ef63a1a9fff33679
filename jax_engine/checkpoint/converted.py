"""The converted checkpoint format: the decoder's parameters already in the fused layout.

One safetensors file holds one tensor per parameter, named by its module path
(jax_engine/models/decoder.py, layout.LAYOUT: "model.layers.self_attn.qkv_proj.weight"), cast
to the serving dtype and optionally int8-quantized ("<path>.scale" beside); bfloat16 tensors are
stored as their raw uint16 bits under "<name>@bf16" (safetensors' numpy API has no bfloat16).
A marker file records the format, dtype and quantization. Loading is one read and one
device_put per tensor. `weights_convert` writes it (`write_converted`); the engine reads it.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_engine.checkpoint import layout
from jax_engine.errors import InvalidRequest

MARKER = "xlaserve_checkpoint.json"
FORMAT = "xlaserve-llama-nnx-v2"          # v1 named tensors by the pre-nnx pytree paths
WEIGHTS = "params.safetensors"
_BF16 = "@bf16"


def is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def converted_quantize(path: str) -> str:
    """The quantization a converted checkpoint was written with ("none" for an HF folder)."""
    if not is_converted(path):
        return "none"
    with open(os.path.join(path, MARKER)) as f:
        return str(json.load(f).get("quantize", "none"))


def write_converted(tensors: dict[str, Any], src: str, dst: str, dtype: Any, quantize: str) -> dict:
    """Write device `tensors` (by module path) to `dst` with `src`'s config and tokenizer files."""
    from safetensors.numpy import save_file  # heavy: safetensors

    flat = {}
    for name, arr in tensors.items():
        a = np.asarray(jax.device_get(arr))
        if a.dtype == jnp.bfloat16:
            flat[name + _BF16] = a.view(np.uint16)
        else:
            flat[name] = a
    os.makedirs(dst, exist_ok=True)
    save_file(flat, os.path.join(dst, WEIGHTS))
    for fn in os.listdir(src):
        full = os.path.join(src, fn)
        if os.path.isfile(full) and not fn.endswith((".safetensors", ".bin", ".pt")) and fn != "model.safetensors.index.json":
            shutil.copy2(full, os.path.join(dst, fn))
    meta = {"format": FORMAT, "dtype": jnp.dtype(dtype).name, "quantize": quantize, "source": os.path.abspath(src)}
    with open(os.path.join(dst, MARKER), "w") as f:
        json.dump(meta, f, indent=2)
    return meta


def load_converted(path: str, cfg, dtype, quantize: str, mesh,
                   progress: Optional[Callable[[int], None]] = None) -> dict[str, Any]:
    """Device tensors (by module path) from a converted checkpoint; dtype / quantization must
    match the file's."""
    from safetensors import safe_open  # heavy: safetensors

    with open(os.path.join(path, MARKER)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise InvalidRequest(f"{path}: converted format {meta.get('format')!r} is not {FORMAT!r}; "
                             "convert the model again with weights_convert")
    if quantize not in ("none", meta["quantize"]):
        raise InvalidRequest(f"{path} was converted with quantize={meta['quantize']}, asked for {quantize}")
    if jnp.dtype(dtype).name != meta["dtype"]:
        raise InvalidRequest(f"{path} was converted to {meta['dtype']}, asked for {jnp.dtype(dtype).name}")
    arrays: dict[str, np.ndarray] = {}
    with safe_open(os.path.join(path, WEIGHTS), framework="numpy") as h:
        for k in h.keys():
            a = h.get_tensor(k)
            if k.endswith(_BF16):
                k, a = k[:-len(_BF16)], a.view(jnp.bfloat16)
            arrays[k] = a
    r = cfg.kv_repeat
    if r > 1:
        if layout.scale_name(layout.QKV) in arrays:
            raise InvalidRequest("int8 converted checkpoints cannot be served with tp > KV heads; convert to float")
        names = [n for n in (layout.QKV, layout.O, layout.QKV_BIAS) if n in arrays]
        layers = [layout.regroup_layer({n: arrays[n][i] for n in names}, r) for i in range(cfg.num_layers)]
        for n in names:
            arrays[n] = np.stack([lay[n] for lay in layers])
    out: dict[str, Any] = {}
    for name, a in arrays.items():
        if layout.kind_of(name)[0] not in layout.LAYOUT:
            raise InvalidRequest(f"{path}: unknown tensor {name!r} (written by another version?)")
        out[name] = jax.device_put(a, layout.sharding_for(name, mesh))
    if progress:
        progress(cfg.num_layers)
    return out
