"""Converted checkpoints, warmup coverage (no compiles after warmup), and loader errors."""
from __future__ import annotations

import asyncio
import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jax_engine.config import ModelSpec
from jax_engine.decode.worker import GenerateWorker
from jax_engine.engine import Engine
from jax_engine.errors import InvalidRequest, NotFound
from jax_engine.executor.compilation import global_compile_count
from tests.helpers import hf_models
from tests.helpers.engines import PROMPTS, engine_logits, greedy_all, small_args
from weights_convert.convert import convert
from weights_convert.convert import main as convert_main


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    model = hf_models.build("llama3", path)
    return path, model


def _logits(path: str, engine_kw: dict = None, **spec) -> np.ndarray:
    w = GenerateWorker(ModelSpec(name="m", path=path, **spec), small_args(**(engine_kw or {})))
    return engine_logits(w, PROMPTS[0])


def test_converted_checkpoints_load_and_match(src, tmp_path):
    path, model = src
    ref = hf_models.hf_logits(model, PROMPTS[0])
    base = _logits(path)
    # float32: exactly the same numbers as loading the HF folder
    f32 = str(tmp_path / "f32")
    assert convert_main([path, f32]) == 0
    assert np.array_equal(_logits(f32), base)
    # bfloat16 weights: bound stated in the README (bf16 has an 8-bit mantissa)
    bf16 = str(tmp_path / "bf16")
    convert(path, bf16, dtype="bfloat16", progress=False)
    err_bf16 = np.max(np.abs(_logits(bf16, dtype="bfloat16") - ref))
    assert err_bf16 < 0.05, f"bfloat16 max abs logit error {err_bf16}"
    # bfloat16 through the CPU kernel's pair path (the default here) against XLA's dot: the same
    # bfloat16 operands with float32 sums, so only the summation order (and the bfloat16 rounding
    # of each layer's output after it) differs
    xla_bf16 = _logits(bf16, dtype="bfloat16", engine_kw=dict(cpu_matmul="xla", attention_backend="reference"))
    kern_bf16 = _logits(bf16, dtype="bfloat16", engine_kw=dict(cpu_matmul="kernel"))
    assert np.max(np.abs(xla_bf16 - kern_bf16)) < 0.02
    # int8 weight-only, per-output-channel scales
    i8 = str(tmp_path / "i8")
    convert(path, i8, quantize="int8", progress=False)
    ours_i8 = _logits(i8)
    err_i8 = np.max(np.abs(ours_i8 - ref))
    assert err_i8 < 0.02, f"int8 max abs logit error {err_i8}"
    # quantizing at load from the HF folder gives the same result as the converted int8 file
    assert np.allclose(_logits(path, quantize="int8"), ours_i8, atol=1e-6)
    # int8 through the CPU kernel (the default here) equals int8 through XLA's dot
    xla_i8 = _logits(i8, engine_kw=dict(cpu_matmul="xla", attention_backend="reference"))
    assert np.max(np.abs(xla_i8 - ours_i8)) < 1e-4
    # int8 in a bfloat16 model: the kernel's K-pair int8 panels with bfloat16 activations vs XLA's dot
    i8_bf16 = {m: _logits(path, dtype="bfloat16", quantize="int8", engine_kw=dict(cpu_matmul=m, attention_backend="reference"))
               for m in ("xla", "kernel")}
    assert np.max(np.abs(i8_bf16["kernel"] - i8_bf16["xla"])) < 0.02
    assert np.max(np.abs(i8_bf16["kernel"] - ref)) < 0.05
    with open(os.path.join(i8, "xlaserve_checkpoint.json")) as f:
        assert json.load(f)["quantize"] == "int8"
    # the tokenizer and config travel with the checkpoint
    assert os.path.isfile(os.path.join(i8, "tokenizer.json")) and os.path.isfile(os.path.join(i8, "config.json"))
    # dtype mismatch between file and request is a clear error
    with pytest.raises(InvalidRequest, match="converted to float32"):
        GenerateWorker(ModelSpec(name="m", path=f32, dtype="bfloat16"), small_args())


def test_w8a8_matches_transformers_on_both_paths(src, tmp_path):
    """--quantize w8a8 (int8 weights, int8 activations per row): the kernel path and XLA's int8 dot
    feed the same integers to exact int32 sums (logits equal to float rounding); against
    transformers' float32 logits the error is the two quantizations'; a checkpoint converted with
    --quantize int8 serves w8a8 with the same numbers as quantizing at load."""
    path, model = src
    ref = hf_models.hf_logits(model, PROMPTS[0])
    a8 = {m: _logits(path, quantize="w8a8", engine_kw=dict(cpu_matmul=m, attention_backend="reference"))
          for m in ("xla", "kernel")}
    assert np.max(np.abs(a8["kernel"] - a8["xla"])) < 1e-5
    err = np.max(np.abs(a8["kernel"] - ref))
    assert err < 0.03, f"w8a8 max abs logit error {err}"
    # activations are quantized: not the weight-only int8 numbers
    assert np.max(np.abs(a8["kernel"] - _logits(path, quantize="int8"))) > 1e-4
    i8 = str(tmp_path / "i8")
    convert(path, i8, quantize="int8", progress=False)
    assert np.allclose(_logits(i8, quantize="w8a8"), a8["kernel"], atol=1e-6)


def test_w8a8_refused_for_mixture_of_experts(tmp_path):
    path = str(tmp_path / "moe")
    hf_models.build("mixtral", path)
    with pytest.raises(InvalidRequest, match="w8a8 is not supported for mixture-of-experts"):
        GenerateWorker(ModelSpec(name="m", path=path, quantize="w8a8"), small_args())


@pytest.mark.parametrize("quantize", ["none", "w8a8"])
def test_no_compilation_after_warmup_for_every_bucket(src, quantize):
    path, _ = src
    eng = Engine(small_args(models=[ModelSpec(name="m", path=path, quantize=quantize)]))
    eng.load_all(progress=False)
    runner = eng.decoder_runners()["m/0"]
    assert runner.cfg.act_int8 == (quantize == "w8a8")
    n_programs = len(runner.programs)
    before = global_compile_count()
    # run every compiled shape once with real arguments built by the serving path
    for prog, key in runner.all_keys():
        out = runner._run(prog, key, runner._example(prog, key))
        if prog.startswith(("step", "draw")):
            runner.state = out[1]
        elif prog in ("copy_page", "set_slot"):
            runner.state = out
    assert runner.programs.compilations_after_warmup == 0
    assert len(runner.programs) == n_programs
    assert global_compile_count() == before, "a backend compilation happened after warmup"
    # and a real mixed workload through the engine compiles nothing either
    asyncio.run(greedy_all(eng, PROMPTS, 9, model="m"))
    assert eng.compilations_after_warmup() == 0
    eng.shutdown()


def test_loader_errors(src, tmp_path):
    path, _ = src
    args = small_args()
    # unreadable folder
    with pytest.raises(NotFound, match="not a readable directory"):
        GenerateWorker(ModelSpec(name="m", path=str(tmp_path / "nope")), args)
    # unknown architecture lists the supported ones
    bad = str(tmp_path / "arch")
    shutil.copytree(path, bad)
    cfg = json.load(open(os.path.join(bad, "config.json")))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "gpt2"
    json.dump(cfg, open(os.path.join(bad, "config.json"), "w"))
    with pytest.raises(InvalidRequest, match="supported: LlamaForCausalLM"):
        Engine(small_args(models=[ModelSpec(name="m", path=bad)])).load_all(progress=False, warmup=False)
    # missing tensor
    miss = str(tmp_path / "missing")
    shutil.copytree(path, miss)
    t = load_file(os.path.join(miss, "model.safetensors"))
    del t["model.layers.1.mlp.down_proj.weight"]
    save_file(t, os.path.join(miss, "model.safetensors"))
    with pytest.raises(InvalidRequest, match="model.layers.1.mlp.down_proj.weight.*missing"):
        GenerateWorker(ModelSpec(name="m", path=miss), args)
    # wrong shape
    shape = str(tmp_path / "shape")
    shutil.copytree(path, shape)
    t = load_file(os.path.join(shape, "model.safetensors"))
    t["model.norm.weight"] = np.ones(7, np.float32)
    save_file(t, os.path.join(shape, "model.safetensors"))
    with pytest.raises(InvalidRequest, match=r"model.norm.weight.*shape \(7,\), expected \(64,\)"):
        GenerateWorker(ModelSpec(name="m", path=shape), args)
    # no weights at all
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    shutil.copy(os.path.join(path, "config.json"), empty)
    with pytest.raises(InvalidRequest, match="cannot load a tokenizer"):
        GenerateWorker(ModelSpec(name="m", path=empty), args)
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(path, fn), empty)
    with pytest.raises(InvalidRequest, match="no \\*.safetensors"):
        GenerateWorker(ModelSpec(name="m", path=empty), args)
