"""Decoder parity with transformers (PyTorch, fp32) for each supported family.

Tolerance: prefill logits within 1e-4 max abs. Both sides compute in float32; the remaining
difference is summation order (XLA vs MKL), ~1e-6 relative on logits of magnitude < 1.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from jax_engine.config import ModelSpec
from jax_engine.engine import Engine
from tests.helpers import hf_models
from tests.helpers.engines import PROMPTS, engine_logits, greedy_all, small_args

# on CPU the defaults run the C++ matmul and decode-attention kernels; "+xla" is the same model on
# XLA's dot and the pure-JAX attention (the path of bfloat16, int8 and tensor parallelism)
FAMILIES = ["llama3", "mistral", "qwen2", "qwen3", "llama_tied", "qwen2_yarn", "llama_dynamic", "phi3", "gemma2",
            "gemma3", "mixtral", "qwen3_moe", "llama3+xla", "mistral+xla"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    arch, _, variant = request.param.partition("+")
    path = str(tmp_path_factory.mktemp(arch))
    model = hf_models.build(arch, path)
    moe = arch in ("mixtral", "qwen3_moe")          # experts run on XLA's grouped matmul (models/moe.py)
    kw = dict(cpu_matmul="xla", attention_backend="reference") if variant == "xla" or moe else dict(cpu_matmul="kernel")
    engine = Engine(small_args(models=[ModelSpec(name="m", path=path)], **kw))
    engine.load_all(progress=False, warmup=False)
    want = ("xla", "reference") if variant == "xla" or moe else ("kernel", "cpu")
    assert (engine._workers["m"].cfg.matmul, engine._workers["m"].cfg.attention_backend) == want
    yield request.param, model, engine
    engine.shutdown()


def test_prefill_logits_match_transformers(family):
    name, model, engine = family
    worker = engine._workers["m"]
    for prompt in PROMPTS[:2] + PROMPTS[3:]:
        ours = engine_logits(worker, prompt)
        ref = hf_models.hf_logits(model, prompt)
        err = float(np.max(np.abs(ours - ref)))
        assert err <= 1e-4, f"{name}: max abs logit error {err:.2e} for a {len(prompt)}-token prompt"


def test_greedy_batch_matches_transformers_generate(family):
    name, model, engine = family
    got = asyncio.run(greedy_all(engine, PROMPTS, 32))
    for p, toks in zip(PROMPTS, got):
        assert toks == hf_models.hf_greedy(model, p, 32), f"{name}: greedy tokens differ for prompt of {len(p)}"
    st = engine.stats("m")
    assert st.running_requests == 0 and st.total_generated_tokens >= 4 * 32


def test_decoder_as_embedder_last_token_pooling(family):
    import torch

    from jax_engine.types import EmbedRequest

    name, model, engine = family
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    out = asyncio.run(engine.embed(EmbedRequest(request_id="e", token_ids=prompts, model="m")))
    assert out.embeddings.shape == (3, model.config.hidden_size) and out.prompt_tokens == sum(map(len, prompts))
    for vec, p in zip(out.embeddings, prompts):
        with torch.no_grad():
            h = model.model(torch.tensor([p])).last_hidden_state[0, -1].numpy()
        ref = h / np.linalg.norm(h)
        assert float(np.dot(vec, ref)) >= 0.99999 and np.max(np.abs(vec - ref)) < 1e-4
    assert engine.stats("m").pages_used == 0


def test_moe_refuses_what_it_cannot_run(tmp_path):
    """Mixture-of-experts models: --ep must divide the experts; experts never run on the CPU matmul kernel."""
    from jax_engine.errors import InvalidRequest

    path = str(tmp_path / "mixtral")
    hf_models.build("mixtral", path)
    for kw, needle in ((dict(ep=3), "--ep 3 does not divide the 8 experts"), (dict(cpu_matmul="kernel"), "mixture-of-experts")):
        engine = Engine(small_args(models=[ModelSpec(name="m", path=path)], **kw))
        with pytest.raises(InvalidRequest, match=needle):
            engine.load_all(progress=False, warmup=False)
        engine.shutdown()


def _hf_one_at_a_time(model, prompt: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    """transformers fed one token per forward through its cache: (prompt logits, n greedy tokens).
    Dynamic NTK then rotates token p with the base of a (p + 1)-token sequence, as its generate
    does for every generated token."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()

    def step(token: int, pos: int) -> np.ndarray:
        with torch.no_grad():
            out = model(torch.tensor([[token]]), cache=cache, use_cache=True, position_ids=torch.tensor([[pos]]))
        return out.logits[0, -1].float().numpy()

    logits = [step(t, p) for p, t in enumerate(prompt)]
    toks = [int(np.argmax(logits[-1]))]
    for p in range(len(prompt), len(prompt) + n - 1):
        toks.append(int(np.argmax(step(toks[-1], p))))
    return np.stack(logits), toks


def test_dynamic_rope_beyond_the_original_context(tmp_path):
    """Dynamic NTK past the original 64-token context, for a 90-token prompt (the documented rule,
    llama._rope_dynamic): token p rotates with the base of a (p + 1)-token sequence. That is
    transformers fed one token at a time (its generate after a prompt within the context); its
    one-shot forward of the whole prompt uses the prompt length's base for every token instead."""
    import copy

    import torch
    import transformers as tf

    path = str(tmp_path / "dyn")
    model = hf_models.build("llama_dynamic", path)
    prompt = list(range(3, 93))
    ref, ref_toks = _hf_one_at_a_time(model, prompt, 8)
    engine = Engine(small_args(models=[ModelSpec(name="m", path=path)], cpu_matmul="xla", attention_backend="reference"))
    engine.load_all(progress=False, warmup=False)
    try:
        ours = engine_logits(engine._workers["m"], prompt)
        assert float(np.max(np.abs(ours - ref))) <= 1e-4
        got = asyncio.run(greedy_all(engine, [prompt], 8))[0]     # chunked prefill (64 + 26), then decode
        assert got == ref_toks
    finally:
        engine.shutdown()
    whole = hf_models.hf_logits(model, prompt)              # every token with the base of 90 tokens
    assert float(np.max(np.abs(whole - ref))) > 1e-3
    plain_cfg = copy.deepcopy(model.config)
    plain_cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    plain = tf.LlamaForCausalLM(plain_cfg).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        plain_logits = plain(torch.tensor([prompt])).logits[0].numpy()
    assert float(np.max(np.abs(plain_logits[:64] - ref[:64]))) <= 1e-5    # plain RoPE within the context
    assert float(np.max(np.abs(plain_logits[64:] - ref[64:]))) > 1e-3     # and scaled beyond it


def test_dynamic_rope_config_rules():
    """Dynamic NTK: the served context is the original times the factor (vLLM's), plain RoPE
    frequencies within it; an NTK alpha, a factor below 1 and dynamic / longrope per layer type
    (Gemma 3's rope_parameters) are refused."""
    from jax_engine.errors import InvalidRequest
    from jax_engine.models.llama import LlamaConfig

    base = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64, hidden_size=32,
                num_attention_heads=2, num_hidden_layers=1, intermediate_size=64, max_position_embeddings=100)
    plain = LlamaConfig.from_hf(base)
    dyn = LlamaConfig.from_hf({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 2.5}})
    assert dyn.rope_dynamic == (2.5, 100, 10000.0) and dyn.max_position_embeddings == 250
    assert dyn.inv_freq == plain.inv_freq and plain.rope_dynamic == ()
    for rope, needle in (({"rope_type": "dynamic", "factor": 2.0, "alpha": 1.0}, "alpha"),
                         ({"rope_type": "dynamic", "factor": 0.5}, "factor >= 1")):
        with pytest.raises(InvalidRequest, match=needle):
            LlamaConfig.from_hf({**base, "rope_scaling": rope})
    gemma3 = {**base, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 16,
              "hidden_activation": "gelu_pytorch_tanh", "layer_types": ["full_attention"]}
    for t in ("dynamic", "longrope"):
        rp = {"full_attention": {"rope_type": t, "factor": 2.0, "rope_theta": 1e6},
              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
        with pytest.raises(InvalidRequest, match="per layer type"):
            LlamaConfig.from_hf({**gemma3, "rope_parameters": rp})


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gate_activation_rounds_bfloat16_once_as_torch_does(act):
    """XLA's path of the MLP gate activation on bfloat16 tensors computes in float32 and rounds
    once, as torch's kernels do: silu equals torch's bits on 8,192 values (jax.nn.silu written
    in bfloat16 rounded after every op: 2,998 of them differed), the tanh GELU nearly so (it
    differed in 3,090 before, 305 now: tanh's own last bits). float32 is unchanged."""
    import jax
    import jax.numpy as jnp
    import torch
    import torch.nn.functional as F

    from jax_engine.models.decoder import gate_activation

    x = (np.random.default_rng(0).standard_normal(8192) * 4).astype(np.float32)
    t = torch.from_numpy(x).to(torch.bfloat16)
    want = (F.silu(t) if act == "silu" else F.gelu(t, approximate="tanh")).float().numpy()
    fn = jax.jit(gate_activation(act))
    got = fn(jnp.asarray(x).astype(jnp.bfloat16))
    assert got.dtype == jnp.bfloat16
    differ = int((np.asarray(got.astype(jnp.float32)) != want).sum())
    assert differ == 0 if act == "silu" else differ < 8192 * 0.05, differ
    base = jax.nn.silu if act == "silu" else (lambda v: jax.nn.gelu(v, approximate=True))
    np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(x))), np.asarray(jax.jit(base)(jnp.asarray(x))))
