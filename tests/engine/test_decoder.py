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
FAMILIES = ["llama3", "mistral", "qwen2", "qwen3", "llama_tied", "qwen2_yarn", "phi3", "gemma2", "gemma3",
            "mixtral", "qwen3_moe", "llama3+xla", "mistral+xla"]


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
    """Mixture-of-experts models: experts are not tensor-parallel yet and never on the CPU matmul kernel."""
    from jax_engine.errors import InvalidRequest

    path = str(tmp_path / "mixtral")
    hf_models.build("mixtral", path)
    for kw, needle in ((dict(tp=2), "--tp 1"), (dict(cpu_matmul="kernel"), "mixture-of-experts")):
        engine = Engine(small_args(models=[ModelSpec(name="m", path=path)], **kw))
        with pytest.raises(InvalidRequest, match=needle):
            engine.load_all(progress=False, warmup=False)
        engine.shutdown()
