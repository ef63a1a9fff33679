"""Multi-LoRA against PEFT: adapters built with `peft` on tiny random decoders of every family
(random non-zero A and B), served from padded slots, mixed in one batch, loaded and unloaded at
run time without compiles, prefix pages never shared across adapters."""
from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from jax_engine.config import EngineArgs, ModelSpec
from jax_engine.decode.parity import prompt_logits
from jax_engine.engine import Engine
from jax_engine.errors import AlreadyExists, InvalidRequest, NotFound, Overloaded, PermissionDenied
from jax_engine.types import GenerateRequest, SamplingParams
from tests.helpers import hf_models

PROMPT = list(range(3, 40))
PROMPT2 = [7, 8, 9, 10, 11]


def _args(path: str, **kw) -> EngineArgs:
    base = dict(models=[ModelSpec(name="m", path=path)], max_running_requests=4, max_num_batched_tokens=64,
                max_model_len=128, page_size=8, dtype="float32", max_loras=2, max_lora_rank=16)
    base.update(kw)
    return EngineArgs(**base)


async def _gen(engine: Engine, prompt: list[int], adapter=None, n: int = 32, out=None) -> list[int]:
    """Greedy tokens; EOS banned for all n tokens, as transformers' min_new_tokens does (hf_greedy)."""
    toks = []
    req = GenerateRequest(request_id="", prompt_ids=list(prompt), adapter=adapter,
                          params=SamplingParams(temperature=0.0, max_new_tokens=n, min_new_tokens=n))
    async for o in engine.generate(req):
        toks += o.new_token_ids
        if out is not None:
            out.append(o)
    return toks


def _slot(engine: Engine, name: str) -> int:
    return engine.worker("m").lora_table.acquire(name)[0]


@pytest.mark.parametrize("family,matmul", [("llama3", "xla"), ("mistral", "auto"), ("qwen2", "auto"), ("qwen3", "auto"),
                                           ("phi3", "auto"), ("gemma2", "auto"), ("llama3", "kernel")])
def test_adapter_matches_peft(tmp_path, family, matmul):
    """Prefill logits <= 1e-4 and 32 greedy tokens equal to transformers + peft, for an adapter on
    every matrix and one on a subset with rsLoRA scaling, with a base row in the same engine; the
    base matmuls on XLA's dot, the CPU kernel (the LoRA term stays an XLA einsum) or as measured."""
    base = hf_models.build(family, str(tmp_path / "base"))
    fused = family == "phi3"             # Phi-3's fused qkv_proj / gate_up_proj: one A, B split by rows
    every = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if fused else None
    pa = hf_models.build_lora(base, str(tmp_path / "a"), seed=1, r=8, alpha=16, targets=every)
    pb = hf_models.build_lora(base, str(tmp_path / "b"), seed=2, r=4, alpha=8, rslora=True,
                              targets=["qkv_proj", "down_proj"] if fused else ["q_proj", "v_proj", "down_proj"])
    eng = Engine(_args(str(tmp_path / "base"), loras=[("a", str(tmp_path / "a")), ("b", str(tmp_path / "b"))],
                       cpu_matmul=matmul))
    eng.load_all(progress=False, warmup=False)
    try:
        runner = eng.worker("m").replicas[0].runner
        for name, ref in (("a", pa), ("b", pb)):
            got = prompt_logits(runner, PROMPT, _slot(eng, name))
            want = hf_models.hf_logits(ref, PROMPT)
            assert np.abs(want - hf_models.hf_logits(base, PROMPT)).max() > 0.05, "the adapter must change the logits"
            err = np.abs(got - want).max()
            assert err <= 1e-4, f"{family} adapter {name}: logits differ from peft by {err:.2e}"
        async def together():
            return await asyncio.gather(_gen(eng, PROMPT), _gen(eng, PROMPT, "a"), _gen(eng, PROMPT, "b"))
        toks = asyncio.run(together())
        assert toks[0] == hf_models.hf_greedy(base, PROMPT, 32)
        assert toks[1] == hf_models.hf_greedy(pa, PROMPT, 32)
        assert toks[2] == hf_models.hf_greedy(pb, PROMPT, 32)
        assert toks[1] != toks[0] and toks[2] != toks[0]
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = hf_models.build("qwen2", str(root / "base"))
    refs = {n: hf_models.build_lora(base, str(root / n), seed=s, r=r)
            for n, s, r in (("a", 11, 8), ("b", 12, 16), ("c", 13, 4))}
    refs["big"] = hf_models.build_lora(base, str(root / "big"), seed=14, r=32)
    return root, base, refs


@pytest.fixture(scope="module")
def warm_engine(lora_models):
    """Warmed engine with LoRA enabled and no adapter yet: loads below must compile nothing."""
    root, _, _ = lora_models
    eng = Engine(_args(str(root / "base"), enable_lora=True, max_loras=2, model_root=str(root)))
    eng.load_all(progress=False, warmup=True)
    yield eng
    eng.shutdown()


def test_mixed_batch_and_load_cycle_compile_nothing(warm_engine, lora_models):
    root, base, refs = lora_models
    eng = warm_engine
    alone = {n: hf_models.hf_greedy(m, PROMPT, 24) for n, m in (("base", base), ("a", refs["a"]), ("b", refs["b"]))}
    asyncio.run(eng.load_adapter("a", str(root / "a")))
    asyncio.run(eng.load_adapter("b", str(root / "b")))
    with pytest.raises(Overloaded):
        eng.load_adapter_sync("c", str(root / "c"))
    # base, a and b rows in the same steps (and twice each, so rows of one adapter share steps too)
    names = [None, "a", "b", "b", None, "a"]

    async def mixed():
        return await asyncio.gather(*[_gen(eng, PROMPT, n, 24) for n in names])
    for n, toks in zip(names, asyncio.run(mixed())):
        assert toks == alone[n or "base"], f"row under {n or 'base'} differs from its solo run"
    assert eng.stats("m").lora_slots_used == 2
    # unload b, load c into its slot, then b's slot holds c: c's tokens are c's
    asyncio.run(eng.unload_adapter("b"))
    with pytest.raises(NotFound):
        asyncio.run(_gen(eng, PROMPT, "b", 4))
    asyncio.run(eng.load_adapter("c", str(root / "c")))
    assert asyncio.run(_gen(eng, PROMPT, "c", 24)) == hf_models.hf_greedy(refs["c"], PROMPT, 24)
    assert asyncio.run(_gen(eng, PROMPT, "a", 24)) == alone["a"]
    asyncio.run(eng.unload_adapter("c"))
    asyncio.run(eng.unload_adapter("a"))
    assert eng.adapters() == [] and eng.stats("m").lora_slots_used == 0
    assert eng.compilations_after_warmup() == 0


def test_prefix_pages_not_shared_across_adapters(warm_engine, lora_models):
    root, _, _ = lora_models
    eng = warm_engine
    eng.load_adapter_sync("a", str(root / "a"))
    try:
        def cached(adapter):
            outs = []
            asyncio.run(_gen(eng, PROMPT, adapter, 2, outs))
            return outs[-1].cached_tokens

        cached(None)                              # the base prefix is cached from here on
        assert cached(None) > 0, "the base model reuses its own prefix"
        assert cached("a") == 0, "an adapter must not reuse the base model's pages"
        assert cached("a") > 0, "an adapter reuses its own prefix"
        asyncio.run(eng.unload_adapter("a"))
        eng.load_adapter_sync("a", str(root / "a"))
        assert cached("a") == 0, "a reloaded adapter must not reuse pages of the earlier load"
    finally:
        asyncio.run(eng.unload_adapter("a"))


def test_unload_finishes_in_flight_requests(warm_engine, lora_models):
    root, _, refs = lora_models
    eng = warm_engine
    eng.load_adapter_sync("a", str(root / "a"))

    async def scenario():
        outs = []
        task = asyncio.create_task(_gen(eng, PROMPT, "a", 40, outs))
        while not outs:                       # the request is running under the adapter
            await asyncio.sleep(0.01)
        await eng.unload_adapter("a")
        assert [a.state for a in eng.adapters()] == ["unloading"]
        with pytest.raises(NotFound, match="being unloaded"):
            await _gen(eng, PROMPT2, "a", 2)
        return await task, outs

    toks, outs = asyncio.run(scenario())
    assert toks == hf_models.hf_greedy(refs["a"], PROMPT, 40) and outs[-1].finish_reason == "length"
    assert eng.adapters() == [] and eng.stats("m").lora_slots_used == 0


def test_adapter_errors(warm_engine, lora_models, tmp_path):
    root, base, _ = lora_models
    eng = warm_engine
    with pytest.raises(InvalidRequest, match="exceeds --max-lora-rank 16"):
        eng.load_adapter_sync("big", str(root / "big"))
    with pytest.raises(InvalidRequest, match="adapter_config.json"):
        eng.load_adapter_sync("x", str(root / "base"))
    emb = hf_models.build_lora(base, str(tmp_path / "emb"), seed=3, targets=["q_proj", "embed_tokens"])
    del emb
    with pytest.raises(InvalidRequest, match="embed_tokens"):
        eng.load_adapter_sync("emb", str(tmp_path / "emb"))
    with pytest.raises(PermissionDenied):              # network-supplied path outside --model-root
        asyncio.run(eng.load_adapter("emb", str(tmp_path / "emb")))
    with pytest.raises(NotFound):
        asyncio.run(_gen(eng, PROMPT2, "nope", 2))
    with pytest.raises(NotFound):
        asyncio.run(eng.unload_adapter("nope"))
    eng.load_adapter_sync("a", str(root / "a"))
    try:
        with pytest.raises(AlreadyExists):
            eng.load_adapter_sync("a", str(root / "c"))
        with pytest.raises(InvalidRequest, match="served model"):
            eng.load_adapter_sync("m", str(root / "c"))
    finally:
        asyncio.run(eng.unload_adapter("a"))
    assert eng.adapters() == [] and eng.compilations_after_warmup() == 0


def test_lora_disabled(tmp_path):
    hf_models.build("llama3", str(tmp_path / "base"))
    hf_models.build_lora(hf_models.build("llama3", str(tmp_path / "b2")), str(tmp_path / "a"), seed=1)
    eng = Engine(_args(str(tmp_path / "base")))
    eng.load_all(progress=False, warmup=False)
    try:
        assert eng.worker("m").replicas[0].runner.lora is None
        with pytest.raises(InvalidRequest, match="--enable-lora"):
            eng.load_adapter_sync("a", str(tmp_path / "a"))
        with pytest.raises(NotFound, match="not enabled"):
            asyncio.run(_gen(eng, PROMPT2, "a", 2))
        assert eng.stats("m").lora_slots_total == 0
    finally:
        eng.shutdown()
    assert os.path.isdir(tmp_path / "a")
