"""The converted checkpoint format: the decoder's parameters already in the fused layout.

One safetensors file holds one tensor per parameter kind, named by its flattened pytree path
(`layout.flatten`), cast to the serving dtype and optionally int8-quantized; bfloat16 tensors are
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
FORMAT = "xlaserve-llama-fused-v1"
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


def write_converted(params: dict, src: str, dst: str, dtype: Any, quantize: str) -> dict:
    """Write device `params` (fused layout) to `dst` with `src`'s config and tokenizer files."""
    from safetensors.numpy import save_file  # heavy: safetensors

    flat = {}
    for name, arr in layout.flatten(params).items():
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


def load_converted(path: str, cfg, dtype, quantize: str, mesh, progress: Optional[Callable[[int], None]] = None) -> dict:
    """Device params from a converted checkpoint; dtype / quantization must match the file's."""
    from safetensors import safe_open  # heavy: safetensors

    with open(os.path.join(path, MARKER)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise InvalidRequest(f"{path}: unknown converted format {meta.get('format')!r}")
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
        if "layers/qkv.q" in arrays:
            raise InvalidRequest("int8 converted checkpoints cannot be served with tp > KV heads; convert to float")
        names = [n for n in ("qkv", "o", "qkv_b") if "layers/" + n in arrays]
        layers = [layout.regroup_layer({n: arrays["layers/" + n][i] for n in names}, r) for i in range(cfg.num_layers)]
        for n in names:
            arrays["layers/" + n] = np.stack([lay[n] for lay in layers])
    params: dict = {"layers": {}}
    for name, a in arrays.items():
        kind, key, per_layer, part = layout.split_name(name)
        node = params["layers"] if per_layer else params
        sh = layout.scale_sharding_for(kind, mesh) if part == "s" else layout.sharding_for(kind, mesh)
        dev = jax.device_put(a, sh)
        if part:
            node.setdefault(key, {})[part] = dev
        else:
            node[key] = dev
        if progress and kind == "layers/down" and part in ("", "q"):
            progress(cfg.num_layers)
    return params
