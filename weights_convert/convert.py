"""`python -m weights_convert SRC DST [--dtype] [--quantize int8]`: a fast-loading checkpoint.

The output holds the decoder's parameters already in the engine's fused, stacked layout
(one safetensors tensor per parameter kind, named by its pytree path), cast to the serving
dtype and optionally int8-quantized, plus the source's config and tokenizer files. Loading it
is one read and one device_put per tensor: no transposes, concatenations or quantization.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Any, Callable, Optional

import numpy as np

MARKER = "xlaserve_checkpoint.json"
FORMAT = "xlaserve-llama-fused-v1"
WEIGHTS = "params.safetensors"


def is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def converted_quantize(path: str) -> str:
    """The quantization a converted checkpoint was written with ("none" for an HF folder)."""
    if not is_converted(path):
        return "none"
    with open(os.path.join(path, MARKER)) as f:
        return str(json.load(f).get("quantize", "none"))


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and not ("q" in v and "s" in v and len(v) == 2):
            out.update(_flatten(v, name + "/"))
        elif isinstance(v, dict):
            out[name + ".q"] = v["q"]
            out[name + ".s"] = v["s"]
        else:
            out[name] = v
    return out


def convert(src: str, dst: str, dtype: str = "float32", quantize: str = "none", progress: bool = True) -> dict:
    import jax
    import jax.numpy as jnp
    from safetensors.numpy import save_file
    from tqdm import tqdm

    from jax_engine.backend import resolve_dtype
    from jax_engine.models.llama import LlamaConfig
    from jax_engine.models.llama_weights import load_hf_params
    from weights_convert.hf import CheckpointReader, read_config

    t0 = time.time()
    hf = read_config(src)
    cfg = LlamaConfig.from_hf(hf)
    jdt = resolve_dtype(dtype)
    with jax.default_device(jax.devices("cpu")[0]):
        bar = tqdm(total=cfg.num_layers, desc="converting", unit="layer", disable=not progress)
        params = load_hf_params(CheckpointReader(src), cfg, jdt, quantize, None, progress=bar.update)
        bar.close()
    flat = {}
    for name, arr in _flatten(params).items():
        a = np.asarray(jax.device_get(arr))
        if a.dtype == jnp.bfloat16:
            # safetensors' numpy API has no bfloat16; store the raw bits and mark the name
            flat[name + "@bf16"] = a.view(np.uint16)
        else:
            flat[name] = a
    os.makedirs(dst, exist_ok=True)
    save_file(flat, os.path.join(dst, WEIGHTS))
    for fn in os.listdir(src):
        full = os.path.join(src, fn)
        if os.path.isfile(full) and not fn.endswith((".safetensors", ".bin", ".pt")) and fn != "model.safetensors.index.json":
            shutil.copy2(full, os.path.join(dst, fn))
    meta = {"format": FORMAT, "dtype": jnp.dtype(jdt).name, "quantize": quantize, "source": os.path.abspath(src)}
    with open(os.path.join(dst, MARKER), "w") as f:
        json.dump(meta, f, indent=2)
    meta["seconds"] = round(time.time() - t0, 3)
    return meta


def load_converted(path: str, cfg, dtype, quantize: str, mesh, progress: Optional[Callable[[int], None]] = None) -> dict:
    """Device params from a converted checkpoint; dtype / quantization must match the file's."""
    import jax
    import jax.numpy as jnp
    from safetensors import safe_open

    from jax_engine.errors import InvalidRequest
    from jax_engine.models.llama_weights import regroup_bias, regroup_kv, scale_sharding_for, sharding_for

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
            if k.endswith("@bf16"):
                k, a = k[:-5], a.view(jnp.bfloat16)
            arrays[k] = a
    r = cfg.kv_repeat
    if r > 1:
        if "layers/qkv.q" in arrays:
            raise InvalidRequest("int8 converted checkpoints cannot be served with tp > KV heads; convert to float")
        qkv = np.stack([regroup_kv(q, o, r)[0] for q, o in zip(arrays["layers/qkv"], arrays["layers/o"])])
        o = np.stack([regroup_kv(q, o, r)[1] for q, o in zip(arrays["layers/qkv"], arrays["layers/o"])])
        arrays["layers/qkv"], arrays["layers/o"] = qkv, o
        if "layers/qkv_b" in arrays:
            arrays["layers/qkv_b"] = np.stack([regroup_bias(b, r) for b in arrays["layers/qkv_b"]])
    params: dict = {"layers": {}}
    for name, a in arrays.items():
        base, _, part = name.partition(".")
        node = params["layers"] if base.startswith("layers/") else params
        key = base.split("/", 1)[1] if base.startswith("layers/") else base
        sh = scale_sharding_for(base, mesh) if part == "s" else sharding_for(base, mesh)
        dev = jax.device_put(a, sh)
        if part:
            node.setdefault(key, {})[part] = dev
        else:
            node[key] = dev
        if progress and base == "layers/down" and part in ("", "q"):
            progress(cfg.num_layers)
    return params


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="weights_convert", description=__doc__.splitlines()[0])
    ap.add_argument("src", help="HF model folder (config.json + *.safetensors + tokenizer)")
    ap.add_argument("dst", help="output folder")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--quantize", default="none", choices=["none", "int8"])
    a = ap.parse_args(argv)
    try:
        meta = convert(a.src, a.dst, a.dtype, a.quantize)
    except Exception as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(meta))
    return 0
