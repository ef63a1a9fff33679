"""Expert parallelism (--ep) and tensor parallelism (--tp) of the mixture-of-experts families on CPU
with 4 forced host devices: EP 2, TP 2, EP 2 x TP 2 and EP 4 agree with 1 device (prefill logits
within 1e-4, float32; 32 greedy tokens equal), so does EP 2 x TP 2 with int8 experts against int8
on 1 device, and the expert weights really are sharded.

The forced device count is fixed when JAX initialises, so the engines run in a subprocess: this
file itself, run as `python -m tests.engine.test_moe_parallel` (nothing at its top level imports jax).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

FAMILIES = ("mixtral", "qwen3_moe")
# (tp, ep[, quantize]) per family; 1 x 1 (of the same quantization) is the reference. EP 2 and TP 2
# alone run on qwen3_moe only: the same expert module, and each engine here compiles its own programs
LAYOUTS = {"mixtral": [(1, 1), (2, 2), (1, 4)],
           "qwen3_moe": [(1, 1), (1, 2), (2, 1), (2, 2), (1, 1, "int8"), (2, 2, "int8")]}
DEVICES = 4
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def res():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/engine/ -> repo
    out = subprocess.run([sys.executable, "-m", "tests.engine.test_moe_parallel"], cwd=root, capture_output=True,
                         text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fam", FAMILIES)
def test_ep_and_tp_match_one_device(res, fam):
    for key, r in res[fam].items():
        base = res[fam]["1x1" + key[3:]]                  # "2x2-int8" against "1x1-int8"
        if key.startswith("1x1"):
            continue
        for i, (got, want) in enumerate(zip(r["logits"], base["logits"])):
            err = float(np.max(np.abs(np.array(got) - np.array(want))))
            assert err <= 1e-4, f"{fam} tp x ep {key}: prompt {i} logits differ from 1 device by {err:.2e}"
        assert r["tokens"] == base["tokens"], f"{fam} tp x ep {key}: greedy tokens differ from 1 device"


@pytest.mark.parametrize("fam", FAMILIES)
def test_experts_are_sharded(res, fam):
    """Each device holds E / ep experts and I / tp of each; attention stays sharded over 'model' only."""
    E = res[fam]["1x1"]["experts"]
    for key, r in res[fam].items():
        tp, ep = (int(x) for x in key.split("-")[0].split("x"))
        L, e, H, two, inter = r["gate_up_global"]
        assert r["gate_up_shard"] == [L, E // ep, H, two, inter // tp], key
        assert r["down_shard"] == [L, E // ep, inter // tp, H], key
        assert r["int8"] == key.endswith("int8"), key        # --quantize int8 quantizes the experts
        if tp * ep > 1:
            assert r["mesh"] == ({"data": 1, "expert": ep, "model": tp} if ep > 1 else {"data": 1, "model": tp}), key
            assert len(set(r["devices"])) == tp * ep, key


def test_ep_refused_on_a_dense_model(tmp_path):
    from jax_engine.config import ModelSpec
    from jax_engine.engine import Engine
    from jax_engine.errors import InvalidRequest
    from tests.helpers import hf_models
    from tests.helpers.engines import small_args

    path = str(tmp_path / "qwen2")
    hf_models.build("qwen2", path)
    engine = Engine(small_args(models=[ModelSpec(name="m", path=path)], ep=2))
    with pytest.raises(InvalidRequest, match="--ep 2: expert parallelism needs a mixture-of-experts model"):
        engine.load_all(progress=False, warmup=False)
    engine.shutdown()


def test_ep_flag_reaches_engine_args(tmp_path):
    from frontends.cli import engine_args, parse_serve_args

    assert engine_args(parse_serve_args(["--model", f"m={tmp_path}"])).ep == 1
    args = engine_args(parse_serve_args(["--model", f"m={tmp_path}", "--ep", "2", "--tp", "2"]))
    assert (args.ep, args.tp) == (2, 2)


# =============================================================================================
# the subprocess
# =============================================================================================
def _child() -> None:
    from tests.helpers.shared import fast_compile_xla_flags

    os.environ["XLA_FLAGS"] = fast_compile_xla_flags(f"--xla_force_host_platform_device_count={DEVICES}")
    os.environ["XLASERVE_PROGRESS"] = "0"
    import asyncio
    import tempfile

    from jax_engine.config import ModelSpec
    from jax_engine.engine import Engine
    from tests.helpers import hf_models
    from tests.helpers.engines import PROMPTS, engine_logits, greedy_all, small_args

    results: dict = {}
    for fam in FAMILIES:
        path = tempfile.mkdtemp()
        hf_models.build(fam, path)
        results[fam] = {}
        for tp, ep, *q in LAYOUTS[fam]:
            quant = q[0] if q else "none"
            eng = Engine(small_args(models=[ModelSpec(name="m", path=path, tp=tp, ep=ep, quantize=quant)],
                                    cpu_matmul="xla", attention_backend="reference"))
            eng.load_all(progress=False, warmup=False)
            w = eng.worker("m")
            experts = w.replicas[0].runner.model().model.layers.mlp.experts
            gu, dn = experts.gate_up_proj.weight[...], experts.down_proj.weight[...]
            mesh = w.meshes[0]
            results[fam][f"{tp}x{ep}" + ("" if quant == "none" else f"-{quant}")] = {
                "logits": [engine_logits(w, p).tolist() for p in (PROMPTS[0], PROMPTS[3])],
                "tokens": asyncio.run(greedy_all(eng, PROMPTS, NEW_TOKENS)),
                "experts": w.cfg.num_experts,
                "gate_up_global": list(gu.shape),
                "int8": str(gu.dtype) == "int8",
                "gate_up_shard": list(gu.addressable_shards[0].data.shape),
                "down_shard": list(dn.addressable_shards[0].data.shape),
                "mesh": dict(mesh.shape) if mesh is not None else None,
                "devices": [str(d) for d in mesh.devices.flat] if mesh is not None else [],
            }
            eng.shutdown()
    print(json.dumps(results))


if __name__ == "__main__":
    _child()
