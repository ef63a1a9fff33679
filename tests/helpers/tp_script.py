"""Run in a subprocess with 4 forced host devices: TP 1/2/4 and 2 replicas x TP 2 agree, for the
base model and under a LoRA adapter (sharded LoRA B / A as the base weights, jax_engine/lora/bank.py);
and TP 2 of each newer dense family (DENSE) agrees with transformers."""
import asyncio
import json
import os
import sys
import tempfile

from tests.helpers.shared import fast_compile_xla_flags  # imports no jax

os.environ["XLA_FLAGS"] = fast_compile_xla_flags("--xla_force_host_platform_device_count=4")
os.environ["XLASERVE_PROGRESS"] = "0"

from jax_engine.config import ModelSpec  # noqa: E402
from jax_engine.decode.parity import prompt_logits  # noqa: E402
from jax_engine.engine import Engine  # noqa: E402
from tests.helpers import hf_models  # noqa: E402
from tests.helpers.engines import PROMPTS, engine_logits, greedy_all, small_args  # noqa: E402


def main() -> None:
    path = tempfile.mkdtemp()
    base = hf_models.build("qwen2", path)        # 2 KV heads: TP 4 exercises KV-head replication
    lora = tempfile.mkdtemp()
    hf_models.build_lora(base, lora, seed=5, r=4)
    results = {}
    for tp, replicas in [(1, 1), (2, 1), (4, 1), (2, 2)]:
        eng = Engine(small_args(models=[ModelSpec(name="m", path=path, tp=tp, replicas=replicas)],
                                loras=[("a", lora)], max_loras=2, max_lora_rank=8))
        eng.load_all(progress=False, warmup=False)
        w = eng.worker("m")
        logits = engine_logits(w, PROMPTS[0])
        toks = asyncio.run(greedy_all(eng, PROMPTS * 2, 16))
        per_replica = [s.total_generated_tokens for s in w.replicas]
        lora_logits = prompt_logits(w.replicas[-1].runner, PROMPTS[0], lora_slot=1)
        lora_toks = asyncio.run(greedy_all(eng, PROMPTS, 16, adapter="a"))
        results[f"{tp}x{replicas}"] = {"logits": logits.tolist(), "tokens": toks, "per_replica": per_replica,
                                       "lora_logits": lora_logits.tolist(), "lora_tokens": lora_toks,
                                       "devices": [str(d) for m in w.meshes if m is not None for d in m.devices.flat]}
        eng.shutdown()
    results["dense"] = {fam: dense_family(fam) for fam in DENSE}
    json.dump(results, sys.stdout)


# Phi-3 (fused qkv / gate_up, LongRoPE crossed by the decode), Gemma 2 / 3 (sandwich norms, per-layer
# windows shorter than the long prompt, soft-caps, local RoPE), YaRN and dynamic NTK (crossed too)
DENSE = ["phi3", "gemma2", "gemma3", "qwen2_yarn", "llama_dynamic"]


def dense_family(fam: str) -> dict:
    """TP 2 of `fam` beside transformers on the same weights (the one-device engine's own parity with
    transformers is tests/engine/test_decoder.py; comparing with transformers here spares a TP 1
    engine per family, ~15 s each on 2 cores)."""
    path = tempfile.mkdtemp()
    model = hf_models.build(fam, path)
    eng = Engine(small_args(models=[ModelSpec(name="m", path=path, tp=2)]))
    eng.load_all(progress=False, warmup=False)
    w = eng.worker("m")
    lin = w.replicas[0].runner.model().model.layers.self_attn.qkv_proj
    qkv = (lin.weight if lin.weight is not None else lin.panels)[...]
    out = {"logits": engine_logits(w, PROMPTS[3]).tolist(), "tokens": asyncio.run(greedy_all(eng, PROMPTS, 24)),
           "qkv_shards": len({s.device for s in qkv.addressable_shards}),
           "hf_logits": hf_models.hf_logits(model, PROMPTS[3]).tolist(),
           "hf_tokens": [hf_models.hf_greedy(model, p, 24) for p in PROMPTS]}
    eng.shutdown()
    return out


main()
