"""The decoder as flax.nnx modules: HF-named parameter paths, loading by the rename table, the
sharding metadata, and the loader's refusals. Parity with transformers per family is
tests/engine/test_decoder.py's (it runs through these modules)."""
from __future__ import annotations

import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from jax_engine.checkpoint import layout
from jax_engine.checkpoint.converted import MARKER
from jax_engine.checkpoint.hf import CheckpointError, CheckpointReader, read_config
from jax_engine.decode.parity import prompt_logits
from jax_engine.decode.runner import ModelRunner, RunnerConfig
from jax_engine.errors import InvalidRequest
from jax_engine.models import decoder, llama_weights
from jax_engine.models.llama import LlamaConfig
from tests.helpers import hf_models

FAMILIES = ("llama3", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe", "llama_tied")


def _flat(state: nnx.State) -> dict[str, nnx.Variable]:
    return {".".join(map(str, path)): v for path, v in nnx.to_flat_state(state)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for fam in FAMILIES:
        path = str(tmp_path_factory.mktemp(fam))
        hf_models.build(fam, path)
        out[fam] = path
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_every_hf_tensor_lands_on_its_named_path(checkpoints, family):
    """Each HF tensor of the checkpoint maps (layer index dropped, fused projections as vLLM names
    them) onto a parameter path of the module, every module parameter is fed by one, and the
    stacked values are the HF tensors' (spot-checked: a norm and a projection of the last layer)."""
    path = checkpoints[family]
    cfg = LlamaConfig.from_hf(read_config(path))
    model = llama_weights.load_model(path, cfg, np.float32, "none", None)
    params = _flat(nnx.state(model))
    reader = CheckpointReader(path)
    fed = set()
    for key in reader.keys():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
        if m:
            target, _ = llama_weights.rename(m.group(2))
            fed.add(layout.LAYERS + target)
        else:
            fed.add(key)
    assert fed == set(params), (sorted(fed ^ set(params)))
    for name in params:                                  # every path has its one row in the layout table
        assert layout.kind_of(name)[0] in layout.LAYOUT
    last = cfg.num_layers - 1
    ln = np.asarray(reader.get(f"model.layers.{last}.input_layernorm.weight"))
    got = np.asarray(params["model.layers.input_layernorm.weight"][...][last])
    np.testing.assert_array_equal(got, ln + (1.0 if family.startswith("gemma") else 0.0))
    o = np.asarray(reader.get(f"model.layers.{last}.self_attn.o_proj.weight"))           # [H, nh*D]
    got_o = np.asarray(params["model.layers.self_attn.o_proj.weight"][...][last])       # [KVH, G, D, H]
    np.testing.assert_array_equal(got_o.reshape(-1, cfg.hidden_size).T, o)
    assert (model.lm_head is None) == cfg.tie_embeddings
    assert isinstance(model.model.layers.mlp, decoder.MoE) == bool(cfg.num_experts)


def test_sharding_metadata_is_the_layout_table(checkpoints):
    """Every parameter carries its LAYOUT partition spec as nnx sharding metadata (int8 scales
    their scale spec), and the runner places the state by it on a mesh."""
    path = checkpoints["qwen2"]                          # biases, and int8 for the scales
    cfg = LlamaConfig.from_hf(read_config(path))
    model = llama_weights.load_model(path, cfg, np.float32, "int8", None)
    specs = _flat(nnx.get_partition_spec(nnx.state(model)))
    assert any(n.endswith(layout.SCALE) for n in specs)
    for name, spec in specs.items():
        assert spec.get_value() == layout.spec_of(name), name
    assert specs["model.layers.self_attn.qkv_proj.weight"].get_value() == P(None, None, "model", None, None)
    assert specs["model.layers.self_attn.qkv_proj.scale"].get_value() == P(None, "model", None, None)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1), ("model",))
    sh = _flat(decoder.shardings(nnx.state(model), mesh))
    assert sh["lm_head.weight"].get_value().spec == P(None, "model")


def test_step_programs_take_the_state_pytree(checkpoints):
    """The runner splits the module once: its programs take the nnx.State (leaves = the module's
    arrays, nothing else), and merging it back gives the same logits as the module itself."""
    path = checkpoints["gemma2"]
    cfg = LlamaConfig.from_hf(read_config(path))
    model = llama_weights.load_model(path, cfg, np.float32, "none", None)
    rc = RunnerConfig(page_size=8, num_pages=16, max_running=2, max_batched_tokens=32, max_model_len=64, max_n=1, top_n=1)
    runner = ModelRunner(cfg, model, rc, None, np.float32)
    assert isinstance(runner.params, nnx.State)
    assert len(jax.tree_util.tree_leaves(runner.params)) == len(jax.tree_util.tree_leaves(nnx.state(model)))
    hf = hf_models.hf_logits(_hf(path), [5, 9, 11, 2])
    np.testing.assert_allclose(prompt_logits(runner, [5, 9, 11, 2]), hf, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="another config"):
        ModelRunner(LlamaConfig.from_hf({**read_config(path), "rms_norm_eps": 1e-3}), model, rc, None, np.float32)


def _hf(path):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path, torch_dtype="float32").eval()


def _copy_with(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    t = load_file(os.path.join(dst, "model.safetensors"))
    edit(t)
    save_file(t, os.path.join(dst, "model.safetensors"))
    return dst


def test_loader_refuses_what_it_cannot_place(checkpoints, tmp_path):
    """A tensor the module has no parameter for (a down_proj bias, which no supported family
    has) is refused by name instead of dropped; a missing expert too."""
    src = checkpoints["llama3"]
    cfg = LlamaConfig.from_hf(read_config(src))
    bad = _copy_with(src, str(tmp_path / "bias"),
                     lambda t: t.__setitem__("model.layers.0.mlp.down_proj.bias", np.zeros(cfg.hidden_size, np.float32)))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.down_proj\.bias.*no parameter"):
        llama_weights.load_model(bad, cfg, np.float32, "none", None)
    moe = checkpoints["mixtral"]
    mcfg = LlamaConfig.from_hf(read_config(moe))
    gone = _copy_with(moe, str(tmp_path / "expert"), lambda t: t.pop("model.layers.1.block_sparse_moe.experts.7.w2.weight"))
    with pytest.raises(CheckpointError, match=r"experts\.7\.w2\.weight.*missing"):
        llama_weights.load_model(gone, mcfg, np.float32, "none", None)


def test_old_converted_format_is_refused_with_the_fix(checkpoints, tmp_path):
    from weights_convert.convert import convert

    dst = str(tmp_path / "conv")
    convert(checkpoints["llama3"], dst, progress=False)
    cfg = LlamaConfig.from_hf(read_config(dst))
    tensors = load_file(os.path.join(dst, "params.safetensors"))
    assert "model.layers.self_attn.qkv_proj.weight" in tensors        # stored by module path
    meta = json.load(open(os.path.join(dst, MARKER)))
    meta["format"] = "xlaserve-llama-fused-v1"
    json.dump(meta, open(os.path.join(dst, MARKER), "w"))
    with pytest.raises(InvalidRequest, match="convert the model again with weights_convert"):
        llama_weights.load_model(dst, cfg, np.float32, "none", None)


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_shapes_and_renames_agree(family):
    """Every tensor the loader requires of a layer has a place in the rename table (no config's
    expected tensor falls through)."""
    cfg = LlamaConfig.from_hf(hf_models.family_config(family).to_dict())
    for rel in llama_weights.hf_layer_shapes(cfg):
        assert llama_weights.rename(rel) is not None, rel


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_int8_experts(checkpoints, family):
    """--quantize int8 quantizes the experts too (per expert and output channel): the module holds
    int8 experts with scales, the sorted dispatch (int8 widened block by block inside its loop)
    equals the dense formulation over the dequantised experts, and the logits stay within int8's
    error of transformers' float32 ones."""
    import jax.numpy as jnp

    from jax_engine.models import moe

    path = checkpoints[family]
    cfg = LlamaConfig.from_hf(read_config(path))
    model = llama_weights.load_model(path, cfg, np.float32, "int8", None)
    ex = model.model.layers.mlp.experts
    assert ex.gate_up_proj.weight[...].dtype == jnp.int8 and ex.gate_up_proj.scale[...].shape == (
        cfg.num_layers, cfg.num_experts, 2, cfg.intermediate_size)
    assert ex.down_proj.scale[...].shape == (cfg.num_layers, cfg.num_experts, cfg.hidden_size)
    h = jnp.asarray(np.random.default_rng(0).standard_normal((12, cfg.hidden_size)).astype(np.float32))
    router = model.model.layers.mlp.gate.weight[...][1]
    args = (h, router, ex.gate_up_proj.xla_weight(), ex.down_proj.xla_weight(), cfg.experts_per_token,
            cfg.normalize_top_k, jax.nn.silu)
    sorted_ = moe.moe_mlp(*args, method="sorted", layer=jnp.int32(1))
    dense = moe.moe_mlp(*args, method="dense", layer=jnp.int32(1))
    np.testing.assert_allclose(np.asarray(sorted_), np.asarray(dense), atol=2e-5, rtol=1e-5)
    rc = RunnerConfig(page_size=8, num_pages=16, max_running=2, max_batched_tokens=32, max_model_len=64, max_n=1, top_n=1)
    prompt = [5, 9, 11, 2, 40, 41, 7]
    got = prompt_logits(ModelRunner(cfg, model, rc, None, np.float32), prompt)
    want = hf_models.hf_logits(_hf(path), prompt)
    err = float(np.max(np.abs(got - want)))
    assert 1e-6 < err < 0.05, err                      # quantized (not bit-equal), within int8's error
