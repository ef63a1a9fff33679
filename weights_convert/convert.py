"""`python -m weights_convert SRC DST [--dtype] [--quantize int8]`: a fast-loading checkpoint.

The offline tool only: it reads an HF folder with the engine's own loader and writes the
engine's converted format (jax_engine/checkpoint/converted.py describes it): the decoder's
parameters already in the fused, stacked layout, cast to the serving dtype and optionally
int8-quantized, plus the source's config and tokenizer files.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional


def convert(src: str, dst: str, dtype: str = "float32", quantize: str = "none", progress: bool = True) -> dict:
    # heavy: jax and the engine's loaders (not needed for --help)
    import jax
    from tqdm import tqdm

    from jax_engine.checkpoint.converted import write_converted
    from jax_engine.checkpoint.hf import CheckpointReader, read_config
    from jax_engine.executor.backend import resolve_dtype
    from jax_engine.models.llama import LlamaConfig
    from jax_engine.models.llama_weights import load_hf_tensors

    t0 = time.time()
    cfg = LlamaConfig.from_hf(read_config(src))
    jdt = resolve_dtype(dtype)
    with jax.default_device(jax.devices("cpu")[0]):
        bar = tqdm(total=cfg.num_layers, desc="converting", unit="layer", disable=not progress)
        tensors = load_hf_tensors(CheckpointReader(src), cfg, jdt, quantize, None, progress=bar.update)
        bar.close()
    meta = write_converted(tensors, src, dst, jdt, quantize)
    meta["seconds"] = round(time.time() - t0, 3)
    return meta


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
