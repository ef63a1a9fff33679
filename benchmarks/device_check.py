"""Device check: GPU parity, a ~1B-parameter generate benchmark and a serve check, one JSON line.

Run it through benchmarks/device_check.sh (its header says how, and how to carry it to a lent
GPU machine). Steps of `run`, each recorded in the summary even when it fails or is skipped:

  parity  A tiny random Llama built with transformers by `prepare` (on a machine with torch),
          saved with HF's float32 logits and 32 greedy tokens for 4 prompts. xlaserve loads it
          in float32 and in bfloat16 on the device and compares: full prefill logits (max abs
          error against a tolerance: tight for float32, loose for bfloat16), prompt logprobs
          through the serving path, and greedy tokens of 4 requests decoded together through
          the paged cache. A greedy mismatch passes only where HF's own top-2 margin at the
          first differing step is below the tolerance (a near tie, not a bug). The same for
          one newer dense family and one mixture of experts (EXTRA_FAMILIES: Gemma 2 with
          soft-caps and windows shorter than the long prompt, Qwen3-MoE with 8 experts top-2),
          float32 and bfloat16 with the first attention backend only.
  bench   A random Llama written on the device (default ~1.1 B parameters: hidden 2048, 16
          layers, 32 heads, 8 KV heads, intermediate 8192, vocab 32000; bf16 safetensors),
          served in-process with `--dtype auto` (bfloat16 on GPU). For batch 1 / 16 / 64:
          decode tokens/s, step time, TTFT, inter-token latency, and memory-bandwidth
          utilisation = (weight bytes + live KV bytes read per decode step) / step time / peak
          (--peak-tbps, H200: 4.8). Also: load and compile (warmup) time, programs compiled,
          compilations after warmup (must stay 0), a measured device read bandwidth.
  serve   `xlaserve serve` on the same folder with the same engine arguments (so every
          program comes from the persistent compilation cache the bench step filled): 16
          concurrent gRPC Generate streams, then Poisson arrivals of OpenAI chat streams over
          HTTP; TTFT / ITL / tokens/s / errors, compilations after warmup from /metrics.

`--dry-run` runs the same code on CPU with a tiny config (~1.5 minutes on 2 vCPUs, nearly all of it
XLA compiling the tiny engines' programs at LLVM level 0, which device_check.sh sets;
tests/e2e/test_device_check.py runs it).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from typing import Any, Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C

REPO = C.REPO_ROOT
DEFAULT_WORK = os.path.join(REPO, ".device_check")
TINY_FAMILY = "llama3"     # tests/helpers/hf_models.py: vocab 512, hidden 64, 2 layers, llama3 RoPE scaling
# also checked (tiny-<family>/, reference-<family>.npz): a newer dense family (attention and final
# soft-caps, a 24-token window on alternate layers, GeGLU, +1 norms) and a mixture of experts
# (8 experts top-2, grouped expert matmuls: jax.lax.ragged_dot on GPU)
EXTRA_FAMILIES = ("gemma2", "qwen3_moe")
PARITY_PROMPTS = [list(range(3, 40)), [7, 8, 9], list(range(100, 130)), [11] * 5 + list(range(200, 251))]
PARITY_NEW = 32

BENCH_MODELS = {
    # ~1.1 B parameters (untied lm_head), the device run
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096),
    # the dry run: same family and code paths
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
}
# packages the H200 image lacks (or has too old for the generated gRPC / protobuf code); `prepare
# --wheels` downloads the versions installed here as cp312 manylinux wheels
WHEELS = ["grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "fastapi", "starlette", "pydantic",
          "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions", "opentelemetry-api", "uvicorn"]
PLATFORM_TAGS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                 "manylinux1_x86_64"]


# =============================================================================================
# prepare (a machine with torch + transformers)
# =============================================================================================
def prepare(work: str, wheels: bool = False) -> dict:
    """Tiny HF models + HF reference logits / greedy tokens under work/; optionally the wheels."""
    t0 = time.perf_counter()
    path, npz = _family_paths(work, TINY_FAMILY)
    meta = _prepare_family(TINY_FAMILY, path, npz)
    out = {"model": os.path.relpath(path, REPO) if path.startswith(REPO) else path, "reference": "reference.npz", **meta,
           "extra_families": {}}
    for fam in EXTRA_FAMILIES:
        _prepare_family(fam, *_family_paths(work, fam))
        out["extra_families"][fam] = {"model": f"tiny-{fam}", "reference": f"reference-{fam}.npz"}
    out["seconds"] = C.rnd(time.perf_counter() - t0, 1)
    if wheels:
        out["wheels"] = download_wheels(os.path.join(work, "wheels"))
    return out


def _family_paths(work: str, family: str) -> tuple[str, str]:
    """(model folder, reference .npz) of a family under work/ (the Llama keeps its original names)."""
    if family == TINY_FAMILY:
        return os.path.join(work, "tiny-llama"), os.path.join(work, "reference.npz")
    return os.path.join(work, f"tiny-{family}"), os.path.join(work, f"reference-{family}.npz")


def _prepare_family(family: str, path: str, npz: str) -> dict:
    """One tiny random HF model (tests/helpers/hf_models.py) and its float32 reference outputs."""
    import numpy as np
    import torch

    from tests.helpers import hf_models

    if os.path.isdir(path):
        shutil.rmtree(path)
    model = hf_models.build(family, path, seed=0)
    arrays: dict[str, Any] = {}
    with torch.no_grad():
        for i, p in enumerate(PARITY_PROMPTS):
            arrays[f"prompt_{i}"] = np.array(p, np.int32)
            arrays[f"logits_{i}"] = hf_models.hf_logits(model, p).astype(np.float32)
            ids, toks, margins = list(p), [], []
            for _ in range(PARITY_NEW):       # plain greedy, full recompute: no generate() processors
                last = model(torch.tensor([ids])).logits[0, -1].double()
                top2 = torch.topk(last, 2).values
                tok = int(torch.argmax(last))
                toks.append(tok)
                margins.append(float(top2[0] - top2[1]))
                ids.append(tok)
            arrays[f"greedy_{i}"] = np.array(toks, np.int32)
            arrays[f"margin_{i}"] = np.array(margins, np.float64)
    meta = {"family": family, "prompts": len(PARITY_PROMPTS), "new_tokens": PARITY_NEW,
            "torch": torch.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except Exception:
        pass
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez(npz, **arrays)
    return meta


def prepared(work: str) -> bool:
    """Every family's reference is under work/."""
    return all(os.path.isfile(_family_paths(work, f)[1]) for f in (TINY_FAMILY, *EXTRA_FAMILIES))


def download_wheels(dest: str) -> dict:
    """cp312 manylinux wheels of WHEELS at the versions installed here (pip download, no deps)."""
    from importlib.metadata import PackageNotFoundError, version

    if os.path.isdir(dest):
        shutil.rmtree(dest)       # one version of each: two would stop the install there
    os.makedirs(dest)
    pins = []
    for name in WHEELS:
        try:
            pins.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            C.log(f"  {name} is not installed here; skipped")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "-d", dest]
    for tag in PLATFORM_TAGS:
        cmd += ["--platform", tag]
    r = subprocess.run(cmd + pins, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"pip download failed:\n{r.stderr[-2000:]}")
    files = sorted(os.listdir(dest))
    size = sum(os.path.getsize(os.path.join(dest, f)) for f in files)
    return {"pins": pins, "files": len(files), "mib": C.rnd(size / 2 ** 20, 1)}


# =============================================================================================
# helpers
# =============================================================================================
class Deadline:
    def __init__(self, budget_s: float):
        self.t0 = time.perf_counter()
        self.budget_s = budget_s

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)


def device_info() -> dict:
    import jax

    d = jax.devices()[0]
    info: dict[str, Any] = {"platform": jax.default_backend(), "kind": d.device_kind, "count": jax.device_count(),
                            "jax": jax.__version__, "python": sys.version.split()[0],
                            "xla_flags": os.environ.get("XLA_FLAGS", "")}
    try:
        import jaxlib

        info["jaxlib"] = jaxlib.__version__
    except Exception:
        pass
    for mod in ("grpc", "google.protobuf", "fastapi", "transformers"):
        try:
            info.setdefault("versions", {})[mod.split(".")[-1]] = __import__(mod, fromlist=["_"]).__version__
        except Exception as e:
            info.setdefault("versions", {})[mod.split(".")[-1]] = f"missing ({type(e).__name__})"
    info["matmul_precision"] = str(getattr(jax.config, "jax_default_matmul_precision", "?"))
    ms = memory_stats()
    if ms.get("bytes_limit"):
        info["memory_gib"] = C.rnd(ms["bytes_limit"] / 2 ** 30, 1)
    return info


def memory_stats() -> dict:
    import jax

    try:
        return jax.devices()[0].memory_stats() or {}
    except Exception:
        return {}


def read_bandwidth_tbps(gib: float, repeats: int = 5) -> Optional[float]:
    """Best-of-N read bandwidth of a jitted sum over `gib` GiB on the default device."""
    import jax
    import jax.numpy as jnp

    n = int(gib * 2 ** 30) // 4
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda v: jnp.sum(v))
    f(x).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    del x
    return C.rnd(n * 4 / best / 1e12, 3)


def engine_args(**kw):
    """EngineArgs for the in-process engines; XLASERVE_CPU_MATMUL applies as it does to `serve`
    (the dry run sets xla: on CPU every tiny model would otherwise time its matmul paths first)."""
    from jax_engine.config import EngineArgs

    return EngineArgs(**{"cpu_matmul": os.environ.get("XLASERVE_CPU_MATMUL", "auto"), **kw})


def run_requests(engine, prompts: list[list[int]], new_tokens: int, loop, stagger_tokens: int = 0,
                 **params) -> list[dict]:
    """Every prompt as one greedy ignore-EOS request, all at once (or, with stagger_tokens, the
    first one alone until it has that many tokens, so the others' prompt chunks share ragged
    steps with its decode tokens); per-request token arrivals."""
    from jax_engine.types import GenerateRequest, SamplingParams

    recs: list[dict[str, Any]] = [{"events": [], "ids": [], "finish_reason": None, "prompt_logprobs": None}
                                  for _ in prompts]

    async def one(p: list[int], rec: dict) -> dict:
        sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True, **params)
        async for out in engine.generate(GenerateRequest(request_id="", prompt_ids=list(p), params=sp)):
            if out.prompt_logprobs is not None:
                rec["prompt_logprobs"] = out.prompt_logprobs
            if out.new_token_ids:
                rec["events"].append((time.perf_counter(), len(out.new_token_ids)))
                rec["ids"] += out.new_token_ids
            if out.finished:
                rec["finish_reason"] = out.finish_reason
                if out.error:
                    rec["error"] = out.error
        return rec

    async def all_() -> list[dict]:
        if not stagger_tokens:
            return await asyncio.gather(*[one(p, r) for p, r in zip(prompts, recs)])
        first = asyncio.ensure_future(one(prompts[0], recs[0]))
        while not first.done() and len(recs[0]["ids"]) < stagger_tokens:
            await asyncio.sleep(0.001)
        rest = await asyncio.gather(*[one(p, r) for p, r in zip(prompts[1:], recs[1:])])
        return [await first, *rest]

    t0 = time.perf_counter()
    loop.run_until_complete(all_())
    for r in recs:
        r["t0"] = t0
    return recs


# =============================================================================================
# step 1: parity
# =============================================================================================
def engine_logits(worker, prompt: list[int]):
    """Prefill logits of every prompt position through the paged-cache forward."""
    from jax_engine.decode.parity import prompt_logits

    return prompt_logits(worker.replicas[0].runner, prompt)


def _backend_kw(name: Optional[str]) -> dict:
    """EngineArgs(attention_backend=...) where the engine has that option and one was chosen."""
    from jax_engine.config import EngineArgs

    return {"attention_backend": name} if name and "attention_backend" in EngineArgs.__dataclass_fields__ else {}


def _backend_of(worker) -> Optional[str]:
    return getattr(worker.cfg, "attention_backend", None)


def step_parity(work: str, cache_dir: str, tols: dict[str, float], backends: Sequence[str] = ("auto",)) -> dict:
    """The tiny Llama at every dtype x backend; then EXTRA_FAMILIES at every dtype, first backend.
    `tols` as given ({"float32": .., "bfloat16": None = 4% of each family's largest logit})."""
    out = _parity_family(TINY_FAMILY, work, cache_dir, _tols(work, tols), backends)
    out["families"] = {}
    for fam in EXTRA_FAMILIES:
        out["families"][fam] = r = _parity_family(fam, work, cache_dir, _tols(work, tols, fam), backends[:1])
        out["ok"] = out["ok"] and r["ok"]
    return out


def _parity_family(family: str, work: str, cache_dir: str, tols: dict[str, float], backends: Sequence[str]) -> dict:
    import numpy as np

    from jax_engine.config import ModelSpec
    from jax_engine.engine import Engine

    path, ref_path = _family_paths(work, family)
    if not os.path.isfile(ref_path):
        raise FileNotFoundError(f"{ref_path} is missing: run `bash benchmarks/device_check.sh prepare` first")
    ref = np.load(ref_path)
    n = json.loads(str(ref["meta"]))["prompts"]
    prompts = [ref[f"prompt_{i}"].tolist() for i in range(n)]
    ref_logits = [ref[f"logits_{i}"] for i in range(n)]
    absmax = max(float(np.abs(x).max()) for x in ref_logits)
    out: dict[str, Any] = {"model": family, "prompts": n, "prompt_lens": [len(p) for p in prompts],
                           "new_tokens": int(ref["greedy_0"].shape[0]), "ref_logits_absmax": C.rnd(absmax, 4)}
    ok = True
    # page size 16: the smallest the GPU Pallas kernels take, so `auto` runs them there
    runs = [(dtype, tol, be) for be in backends for dtype, tol in tols.items()]
    for dtype, tol, be in runs:
        key = dtype if be == backends[0] else f"{dtype}@{be}"
        t0 = time.perf_counter()
        args = engine_args(models=[ModelSpec(name="m", path=path, dtype=dtype)], max_running_requests=4,
                           max_num_batched_tokens=64, max_model_len=128, page_size=16, enable_prefix_cache=False,
                           compile_cache_dir=cache_dir, **_backend_kw(be))
        engine = Engine(args)
        loop = asyncio.new_event_loop()
        try:
            engine.load_all(progress=False, warmup=False)
            worker = engine.worker("m")
            res: dict[str, Any] = {"tol": tol, "engine_dtype": worker.info.dtype,
                                   "kv_dtype": str(worker.replicas[0].runner.state["k"].dtype),
                                   "attention_backend": _backend_of(worker)}
            errs = [float(np.max(np.abs(engine_logits(worker, p) - r))) for p, r in zip(prompts, ref_logits)]
            res["logits_max_abs_err"] = C.rnd(max(errs), 7)
            res["logits_rel_err"] = C.rnd(max(errs) / max(absmax, 1e-30), 6)
            # prompt logprobs through the serving path (scheduler + compiled programs)
            rec = run_requests(engine, [prompts[0]], 1, loop, prompt_logprobs_start=0)[0]
            lp = rec["prompt_logprobs"] or []
            ref_lp = _log_softmax(ref_logits[0])
            lp_errs = [abs(e.logprob - float(ref_lp[j - 1, prompts[0][j]])) for j, e in enumerate(lp) if e is not None]
            res["prompt_logprobs_max_abs_err"] = C.rnd(max(lp_errs), 7) if lp_errs else None
            # greedy: all prompts decoded together
            recs = run_requests(engine, prompts, out["new_tokens"], loop)
            res["greedy"] = greedy_compare([r["ids"] for r in recs], ref, n, tol)
            # the same with the first prompt decoding while the others' chunks join its ragged steps
            recs = run_requests(engine, prompts, out["new_tokens"], loop, stagger_tokens=4)
            res["greedy_staggered"] = greedy_compare([r["ids"] for r in recs], ref, n, tol)
            res["ok"] = bool(max(errs) <= tol and lp_errs and max(lp_errs) <= 2 * tol and res["greedy"]["ok"]
                             and res["greedy_staggered"]["ok"])
            res["seconds"] = C.rnd(time.perf_counter() - t0, 1)
        finally:
            engine.shutdown(timeout=2.0)
            loop.close()
        out[key] = res
        ok = ok and res["ok"]
        C.log(f"parity {family} {key} ({res['attention_backend']}): logits err {res['logits_max_abs_err']} (tol {tol}), "
              f"prompt lp err {res['prompt_logprobs_max_abs_err']}, greedy {res['greedy']['exact']}/{n} exact, ok {res['ok']}")
    out["ok"] = ok
    return out


def _log_softmax(x):
    import numpy as np

    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def greedy_compare(got: list[list[int]], ref, n: int, tol: float) -> dict:
    """Exact sequences, and for each mismatch whether HF's top-2 margin there was a near tie."""
    exact, mism = 0, []
    for i in range(n):
        want = ref[f"greedy_{i}"].tolist()
        g = list(got[i])
        if g == want:
            exact += 1
            continue
        k = next((j for j, (a, b) in enumerate(zip(g, want)) if a != b), min(len(g), len(want)))
        margin = float(ref[f"margin_{i}"][k]) if k < len(want) else None
        mism.append({"prompt": i, "first_diff": k, "hf_margin": C.rnd(margin, 6),
                     "near_tie": margin is not None and margin <= 2 * tol, "len": len(g)})
    return {"exact": exact, "of": n, "mismatches": mism,
            "ok": all(m["near_tie"] and m["len"] == len(ref["greedy_0"]) for m in mism)}


# =============================================================================================
# step 2: generate benchmark
# =============================================================================================
def write_bench_model(path: str, model: str, seed: int = 0) -> dict:
    """A random Llama folder in bfloat16 (config, safetensors, padded byte-level tokenizer), fast.

    Tensors are filled from one pool of 4M normal draws (x 0.02) at random offsets: decode
    speed does not depend on the values, and this writes ~2 GiB in seconds."""
    import numpy as np
    from ml_dtypes import bfloat16

    from benchmarks import generate_vs_hf as G
    from jax_engine.models.demo import llama_config, write_tokenizer

    cfgs = BENCH_MODELS[model]
    marker = os.path.join(path, "device_check_model.json")
    if os.path.isfile(marker):
        with open(marker) as f:
            return json.load(f)
    t0 = time.perf_counter()
    os.makedirs(path, exist_ok=True)
    ids = write_tokenizer(path, vocab_size=512)
    G.pad_tokenizer(path, cfgs["vocab_size"])
    cfg = llama_config(**cfgs, bos_token_id=ids["<|bos|>"], eos_token_id=ids["<|eos|>"], pad_token_id=ids["<|pad|>"],
                       torch_dtype="bfloat16")
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // nh
    shapes: list[tuple[str, tuple[int, ...], bool]] = [("model.embed_tokens.weight", (v, h), False),
                                                      ("model.norm.weight", (h,), True), ("lm_head.weight", (v, h), False)]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes += [(p + "self_attn.q_proj.weight", (nh * hd, h), False), (p + "self_attn.k_proj.weight", (kvh * hd, h), False),
                   (p + "self_attn.v_proj.weight", (kvh * hd, h), False), (p + "self_attn.o_proj.weight", (h, nh * hd), False),
                   (p + "mlp.gate_proj.weight", (inter, h), False), (p + "mlp.up_proj.weight", (inter, h), False),
                   (p + "mlp.down_proj.weight", (h, inter), False), (p + "input_layernorm.weight", (h,), True),
                   (p + "post_attention_layernorm.weight", (h,), True)]
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(1 << 22) * 0.02).astype(bfloat16)
    header, off = {}, 0
    for name, shape, _ in shapes:
        nbytes = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    header["__metadata__"] = {"format": "pt"}
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for name, shape, is_norm in shapes:
            size = int(np.prod(shape))
            if is_norm:
                a = (1.0 + 0.1 * rng.standard_normal(size)).astype(bfloat16)
            else:
                a = np.resize(np.roll(pool, int(rng.integers(0, pool.size))), size)
            f.write(np.ascontiguousarray(a).view(np.uint8).data)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    params = sum(int(np.prod(s)) for _, s, _ in shapes)
    meta = {"model": model, "params": params, "file_gib": C.rnd(off / 2 ** 30, 2), "random_weights": True,
            "write_s": C.rnd(time.perf_counter() - t0, 1)}
    with open(marker, "w") as f:
        json.dump(meta, f)
    return meta


def bench_engine_kw(a) -> dict:
    return dict(max_running_requests=max(a.batches), max_num_batched_tokens=a.max_batched_tokens,
                max_model_len=a.max_model_len, page_size=16, enable_prefix_cache=False, max_n=a.max_n,
                compile_cache_dir=a.cache_dir, cpu_matmul=os.environ.get("XLASERVE_CPU_MATMUL", "auto"))


def step_bench(a, dl: Deadline) -> dict:
    import jax

    from benchmarks import generate_vs_hf as G
    from jax_engine.config import ModelSpec
    from jax_engine.engine import Engine

    out: dict[str, Any] = {"model_name": a.model, "config": BENCH_MODELS[a.model]}
    out["model"] = write_bench_model(a.model_dir, a.model)
    C.log(f"bench model: {out['model']}")
    out["measured_read_tbps"] = read_bandwidth_tbps(a.probe_gib)
    kw = bench_engine_kw(a)
    out["engine_args"] = {k: v for k, v in kw.items() if k != "compile_cache_dir"}
    out["dtype_requested"] = a.dtype
    t0 = time.perf_counter()
    out["quantize"] = a.quantize
    engine = Engine(engine_args(models=[ModelSpec(name="bench", path=a.model_dir, dtype=a.dtype, quantize=a.quantize)],
                                **kw, **_backend_kw(a.attention_backend)))
    loop = asyncio.new_event_loop()
    try:
        engine.load_all(progress=False)           # load, compile every program, start
        worker = engine.worker("bench")
        runner = worker.replicas[0].runner
        out["programs"] = len(runner.all_keys())
        out["warmup_s"] = C.rnd(worker.warmup_s, 1)
        out["load_s"] = C.rnd(time.perf_counter() - t0 - worker.warmup_s, 1)
        C.log(f"bench engine: load {out['load_s']}s, warmup {out['warmup_s']}s ({out['programs']} programs)")
        out["dtype"] = worker.info.dtype
        out["attention_backend"] = _backend_of(worker)
        out["kv_dtype"] = str(runner.state["k"].dtype)
        out["num_pages"] = runner.rc.num_pages
        leaves = jax.tree_util.tree_leaves(runner.params)
        total = sum(x.nbytes for x in leaves)
        embed = sum(x.nbytes for x in jax.tree_util.tree_leaves(runner.params.get("embed", {})))
        out["weight_bytes"] = {"all": int(total), "per_decode_step": int(total - embed)}
        cfg_hf = {**BENCH_MODELS[a.model]}
        kv_itemsize = runner.state["k"].dtype.itemsize
        vocab = cfg_hf["vocab_size"]
        ps = 16
        # the KV span a decode step's attention reads: the page bucket where the backend buckets pages
        pb_tokens = ps * next(b for b in runner.page_buckets if b * ps >= a.prompt_len + a.new_tokens)
        out["token_buckets"], out["page_buckets"] = runner.token_buckets, runner.page_buckets
        before = engine.compilations_after_warmup()
        rows: dict[str, Any] = {}
        for B in a.batches:
            if dl.left() < a.reserve_s:
                rows[str(B)] = {"skipped": "time budget"}
                continue
            run_requests(engine, G.make_prompts(B, a.prompt_len, vocab, 900 + B), 4, loop)   # warm the path
            reps = [bench_once(engine, loop, B, a, vocab, 1000 * B + r) for r in range(a.repeats)]
            row = {k: C.rnd(C.median(r[k] for r in reps), 3) for k in reps[0] if isinstance(reps[0][k], (int, float))}
            row["errors"] = sum(r["errors"] for r in reps)
            step_s = B / row["decode_tok_s"] if row.get("decode_tok_s") else None
            peak = {"torch_sum_gbps": a.peak_tbps * 1000, "peak_gflops": a.peak_tflops * 1000}
            rl = G.roofline(cfg_hf, out["weight_bytes"]["per_decode_step"], kv_itemsize, B, a.prompt_len,
                            a.new_tokens, peak, "peak_gflops", engine_kv_tokens=pb_tokens)
            live = rl["weight_bytes_per_step"] + rl["kv_bytes_per_step"]
            gathered = rl["weight_bytes_per_step"] + rl.get("engine_kv_bytes_read_per_step", 0)
            row["step_ms"] = C.rnd(step_s * 1e3, 3) if step_s else None
            row["bytes_per_step"] = int(live)
            row["bw_util"] = C.rnd(live / step_s / (a.peak_tbps * 1e12), 4) if step_s else None
            row["bw_util_gathered_kv"] = C.rnd(gathered / step_s / (a.peak_tbps * 1e12), 4) if step_s else None
            row["roofline_decode_tok_s"] = rl["decode_tok_s"]
            if rl.get("prefill_s") and row.get("prefill_s"):
                row["prefill_flops_util"] = C.rnd(rl["prefill_s"] / row["prefill_s"], 4)
            rows[str(B)] = row
            C.log(f"  batch {B}: {row.get('decode_tok_s')} tok/s, step {row['step_ms']} ms, TTFT "
                  f"{row.get('ttft_ms')} ms, ITL p50 {row.get('itl_ms_p50')} ms, bw util {row['bw_util']}")
        out["batches"] = rows
        out["compilations_after_warmup"] = engine.compilations_after_warmup() - before
        ms = memory_stats()
        if ms.get("peak_bytes_in_use"):
            out["peak_mem_gib"] = C.rnd(ms["peak_bytes_in_use"] / 2 ** 30, 2)
    finally:
        engine.shutdown(timeout=5.0)
        loop.close()
    done = [r for r in out["batches"].values() if "skipped" not in r]
    out["ok"] = bool(done) and all(r["errors"] == 0 and r.get("decode_tok_s") for r in done) \
        and out["compilations_after_warmup"] == 0
    return out


def bench_once(engine, loop, B: int, a, vocab: int, seed: int) -> dict:
    from benchmarks import generate_vs_hf as G

    recs = run_requests(engine, G.make_prompts(B, a.prompt_len, vocab, seed), a.new_tokens, loop)
    t0 = recs[0]["t0"]
    m = G.stream_metrics(t0, recs, a.new_tokens)
    itl = [y[0] - x[0] for r in recs for x, y in zip(r["events"], r["events"][1:])]
    ttft = [r["events"][0][0] - t0 for r in recs if r["events"]]
    return {"decode_tok_s": m["decode_tok_s"], "prefill_s": m["prefill_s"],
            "ttft_ms": C.percentile(ttft, 50) * 1e3, "ttft_ms_first": m.get("ttft_first_s", float("nan")) * 1e3,
            "itl_ms_p50": C.percentile(itl, 50) * 1e3, "itl_ms_p99": C.percentile(itl, 99) * 1e3,
            "e2e_s": m["e2e_s"], "errors": m["errors"]}


# =============================================================================================
# step 3: serve
# =============================================================================================
def step_serve(a, dl: Deadline) -> dict:
    from benchmarks import generate_vs_hf as G
    from benchmarks import serve_load as S

    write_bench_model(a.model_dir, a.model)
    kw = bench_engine_kw(a)
    extra = ["--compile-cache-dir", a.cache_dir, "--max-n", str(kw["max_n"])]
    if a.dtype != "auto":
        extra += ["--dtype", a.dtype]
    if a.quantize != "none":
        extra += ["--quantize", a.quantize]
    if _backend_kw(a.attention_backend):
        extra += ["--attention-backend", a.attention_backend]
    server = S.Server(["--model", f"{S.GEN_MODEL}={a.model_dir}",
                       "--max-running-requests", str(kw["max_running_requests"]),
                       "--max-num-batched-tokens", str(kw["max_num_batched_tokens"]),
                       "--max-model-len", str(kw["max_model_len"]), "--page-size", "16", "--no-prefix-cache",
                       "--log-level", "info", *extra])
    out: dict[str, Any] = {"cmd": " ".join(server.cmd[2:])}
    loop = asyncio.new_event_loop()
    clients = None
    try:
        out["ready_s"] = C.rnd(server.wait_ready(max(30.0, min(420.0, dl.left() - 45))), 1)
        C.log(f"server ready in {out['ready_s']}s")
        m = re.search(r"dtype (\w+), quantization", server.tail(400))
        out["served_dtype"] = m.group(1) if m else None
        out["compiles_after_warmup_start"] = sum(S.scrape_compiles(server.http).values())
        clients = loop.run_until_complete(S._make_clients(server.grpc, server.http))
        vocab = BENCH_MODELS[a.model]["vocab_size"]
        # (a) concurrent gRPC streams
        prompts = G.make_prompts(a.serve_streams, a.prompt_len, vocab, 77)

        async def streams(ps: list[list[int]], new: int) -> list[dict]:
            return await asyncio.gather(*[clients.grpc_generate(p, new) for p in ps])

        loop.run_until_complete(streams(prompts[:2], 4))        # warm the path
        t0 = time.perf_counter()
        recs = loop.run_until_complete(streams(prompts, a.serve_new))
        for r in recs:
            r["finish_reason"] = "length" if r["error"] is None else "error"
        sm = G.stream_metrics(t0, recs, a.serve_new)
        itl = [y[0] - x[0] for r in recs for x, y in zip(r["events"], r["events"][1:])]
        out["grpc_streams"] = {"streams": a.serve_streams, "prompt_len": a.prompt_len, "new_tokens": a.serve_new,
                               "decode_tok_s": C.rnd(sm["decode_tok_s"], 1), "ttft_ms_p50": C.rnd(
                                   C.percentile([r["events"][0][0] - r["t_send"] for r in recs if r["events"]], 50) * 1e3, 1),
                               "itl_ms": C.summarize(itl, 1e3, 2), "errors": sm["errors"],
                               "error_samples": list({r["error"] for r in recs if r["error"]})[:3]}
        C.log(f"  grpc streams: {out['grpc_streams']['decode_tok_s']} tok/s, errors {sm['errors']}")
        # (b) Poisson arrivals of OpenAI chat streams over HTTP
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(a.model_dir, local_files_only=True)
        workload = S.make_workload(a.serve_requests, 7, tok, (a.prompt_len // 4, a.prompt_len), (a.serve_new // 4, a.serve_new))
        recs = loop.run_until_complete(S.poisson_run(clients, "http", workload, a.serve_rate, 7))
        lm = S.load_metrics(recs, a.serve_rate)
        out["http_poisson"] = {k: lm[k] for k in ("offered_rate_rps", "requests", "errors", "error_samples",
                                                  "output_tok_s", "ttft_ms", "itl_ms", "duration_s")}
        C.log(f"  http poisson: {lm['output_tok_s']} tok/s, TTFT p50 {lm['ttft_ms'].get('p50')} ms, errors {lm['errors']}")
        out["compiles_after_warmup_end"] = sum(S.scrape_compiles(server.http).values())
    finally:
        if clients is not None:
            loop.run_until_complete(clients.close())
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        out["exit_code"] = server.stop()
        if not out.get("ready_s") or out["exit_code"] not in (0, None):
            out["log_tail"] = server.tail(15)
    errors = out.get("grpc_streams", {}).get("errors", 1) + out.get("http_poisson", {}).get("errors", 1)
    out["ok"] = bool(errors == 0 and out.get("compiles_after_warmup_end") == 0 and out["exit_code"] == 0)
    if out["ok"]:
        os.unlink(server.log.name)
    else:
        out["log"] = server.log.name
    return out


# =============================================================================================
# main
# =============================================================================================
def parse(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.device_check", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="build the tiny HF model and its reference outputs (needs torch)")
    p.add_argument("--work", default=DEFAULT_WORK)
    p.add_argument("--wheels", action="store_true", help="also download the wheels the GPU machine lacks")
    r = sub.add_parser("run", help="the checks, on whatever device JAX sees")
    r.add_argument("--work", default=DEFAULT_WORK, help="prepared folder (default .device_check)")
    r.add_argument("--dry-run", action="store_true", help="CPU, tiny config and shapes (~1.5 min on 2 vCPUs)")
    r.add_argument("--steps", default="parity,bench,serve")
    r.add_argument("--peak-tbps", type=float, default=4.8, help="chip memory bandwidth, TB/s (H200: 4.8)")
    r.add_argument("--peak-tflops", type=float, default=989.0, help="chip dense bf16 TFLOP/s (H200: 989)")
    r.add_argument("--dtype", default="auto", help="bench / serve dtype (auto = bfloat16 on GPU)")
    r.add_argument("--quantize", default="none", choices=["none", "int8", "w8a8"],
                   help="bench / serve weights (w8a8: int8 activations too; its XLA path has not run on a GPU yet)")
    r.add_argument("--attention-backend", default=None, help="bench / serve --attention-backend (default: the engine's)")
    r.add_argument("--parity-backends", default=None,
                   help="attention backends the parity step runs (default auto,reference on a device; dry: auto)")
    r.add_argument("--model", choices=list(BENCH_MODELS), default=None, help="bench model (default 1b; dry: tiny)")
    r.add_argument("--batches", default=None, help="default 1,16,64; dry: 1,2")
    r.add_argument("--prompt-len", type=int, default=None, help="default 128; dry: 16")
    r.add_argument("--new-tokens", type=int, default=None, help="default 128; dry: 16")
    r.add_argument("--repeats", type=int, default=None, help="timed runs per batch (default 3; dry 1)")
    r.add_argument("--max-batched-tokens", type=int, default=None, help="default 512; dry 32")
    r.add_argument("--serve-streams", type=int, default=None, help="default 16; dry 2")
    r.add_argument("--serve-new", type=int, default=None, help="default 64; dry 8")
    r.add_argument("--serve-requests", type=int, default=None, help="default 16; dry 3")
    r.add_argument("--serve-rate", type=float, default=None, help="requests/s (default 8; dry 4)")
    r.add_argument("--fp32-tol", type=float, default=1e-3, help="float32 max abs logit error")
    r.add_argument("--bf16-tol", type=float, default=None, help="bfloat16 max abs logit error (default 0.04 x "
                   "the reference logits' max |value|, at least 2e-3)")
    r.add_argument("--budget-s", type=float, default=None, help="stop starting steps after this (default 420; dry 540)")
    r.add_argument("--out", default=None, help="also write the summary here (default $OUT/device_check.json if set)")
    a = ap.parse_args(list(argv))
    if a.cmd == "run":
        dry = a.dry_run
        a.model = a.model or ("tiny" if dry else "1b")
        a.batches = [int(x) for x in (a.batches or ("1,2" if dry else "1,16,64")).split(",")]
        a.prompt_len = a.prompt_len or (16 if dry else 128)
        a.new_tokens = a.new_tokens or (16 if dry else 128)
        a.repeats = a.repeats or (1 if dry else 3)
        a.max_batched_tokens = a.max_batched_tokens or (32 if dry else 512)
        a.max_n = 1 if dry else 8          # n > 1 is not exercised; the dry run compiles fewer programs
        a.serve_streams = a.serve_streams or (2 if dry else 16)
        a.serve_new = a.serve_new or (8 if dry else 64)
        a.serve_requests = a.serve_requests or (3 if dry else 16)
        a.serve_rate = a.serve_rate or (4.0 if dry else 8.0)
        a.budget_s = a.budget_s or (540.0 if dry else 420.0)
        a.max_model_len = max(64, 1 << (a.prompt_len + a.new_tokens - 1).bit_length())
        a.parity_backends = [x for x in (a.parity_backends or ("auto" if dry else "auto,reference")).split(",") if x]
        a.probe_gib = 0.0625 if dry else 2.0
        a.reserve_s = 5.0 if dry else 20.0
        a.model_dir = os.path.join(a.work, f"bench-{a.model}")
        a.cache_dir = os.path.join(a.work, "jax_cache")
    return a


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    os.makedirs(a.work, exist_ok=True)
    if a.cmd == "prepare":
        res = prepare(a.work, a.wheels)
        print(json.dumps(res), flush=True)
        return 0
    return run(a)


def run(a) -> int:
    dl = Deadline(a.budget_s)
    doc: dict[str, Any] = {"device_check": 1, "mode": "dry_run" if a.dry_run else "device",
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "peak": {"hbm_tbps": a.peak_tbps, "bf16_tflops": a.peak_tflops}, "errors": []}
    partial = os.path.join(a.work, "partial.json")

    def save() -> None:
        doc["elapsed_s"] = C.rnd(time.perf_counter() - dl.t0, 1)
        with open(partial, "w") as f:
            json.dump(doc, f, default=C._json_default)

    steps = [s for s in a.steps.split(",") if s]
    try:
        doc["device"] = device_info()
    except Exception as e:
        doc["errors"].append(f"device: {type(e).__name__}: {e}")
        steps = []
    if not a.dry_run and doc.get("device", {}).get("platform") == "cpu":
        doc["errors"].append("no accelerator visible to JAX: bench and serve skipped (use --dry-run on CPU)")
        steps = [s for s in steps if s == "parity"]
    save()
    if "parity" in steps:
        if not prepared(a.work):
            try:    # torch + transformers present (the dry run here; the H200 image has them too)
                C.log("no prepared reference: preparing it now ...")
                doc["prepared_here"] = prepare(a.work)
            except Exception as e:
                doc["errors"].append(f"prepare: {type(e).__name__}: {e}")
    tols = {"float32": a.fp32_tol, "bfloat16": a.bf16_tol}
    plan = [("parity", 20.0, lambda: step_parity(a.work, a.cache_dir, tols, a.parity_backends)),
            ("bench", 60.0 if not a.dry_run else 10.0, lambda: step_bench(a, dl)),
            ("serve", 45.0 if not a.dry_run else 10.0, lambda: step_serve(a, dl))]
    for name, need_s, fn in plan:
        if name not in steps:
            doc[name] = {"skipped": "not requested" if "device" in doc else "no device"}
            continue
        if dl.left() < need_s:
            doc[name] = {"skipped": f"time budget ({dl.left():.0f}s left)", "ok": False}
            save()
            continue
        t0 = time.perf_counter()
        C.log(f"== {name} ({dl.left():.0f}s of the budget left)")
        try:
            doc[name] = fn()
        except Exception as e:
            doc[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:500]}"}
            doc["errors"].append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            traceback.print_exc(file=sys.stderr)
        doc[name]["step_s"] = C.rnd(time.perf_counter() - t0, 1)
        save()
    doc["ok"] = all(doc.get(s, {}).get("ok") for s in steps) and bool(steps) and not doc["errors"]
    doc["headline"] = headline(doc)
    save()
    line = json.dumps(doc, default=C._json_default, separators=(",", ":"))
    for dest in filter(None, [a.out, os.path.join(os.environ["OUT"], "device_check.json") if os.environ.get("OUT") else None]):
        os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
        with open(dest, "w") as f:
            f.write(line + "\n")
    with open(os.path.join(a.work, "summary.json"), "w") as f:
        f.write(line + "\n")
    print(line, flush=True)
    return 0 if doc["ok"] else 1


def _tols(work: str, tols: dict, family: str = TINY_FAMILY) -> dict:
    """The bfloat16 tolerance scales with the family's reference logits unless given."""
    if tols["bfloat16"] is None:
        import numpy as np

        ref = np.load(_family_paths(work, family)[1])
        absmax = max(float(np.abs(ref[k]).max()) for k in ref.files if k.startswith("logits_"))
        tols = dict(tols, bfloat16=C.rnd(max(2e-3, 0.04 * absmax), 5))
    return tols


def headline(doc: dict) -> dict:
    """The few numbers worth reading first."""
    h: dict[str, Any] = {"platform": doc.get("device", {}).get("platform"), "kind": doc.get("device", {}).get("kind")}
    p = doc.get("parity", {})
    for key, r in p.items():
        if isinstance(r, dict) and "logits_max_abs_err" in r:
            h[f"parity_{key}_err"] = r["logits_max_abs_err"]
    for fam, fr in (p.get("families") or {}).items():
        for key, r in fr.items():
            if isinstance(r, dict) and "logits_max_abs_err" in r:
                h[f"parity_{fam}_{key}_err"] = r["logits_max_abs_err"]
    b = doc.get("bench", {})
    for B, row in (b.get("batches") or {}).items():
        if "decode_tok_s" in row:
            h[f"b{B}_tok_s"] = row["decode_tok_s"]
            h[f"b{B}_bw_util"] = row.get("bw_util")
    if "1" in (b.get("batches") or {}):
        h["b1_ttft_ms"] = b["batches"]["1"].get("ttft_ms")
        h["b1_itl_ms"] = b["batches"]["1"].get("itl_ms_p50")
    s = doc.get("serve", {})
    if "grpc_streams" in s:
        h["serve_grpc_tok_s"] = s["grpc_streams"]["decode_tok_s"]
    if "http_poisson" in s:
        h["serve_http_ttft_ms_p50"] = s["http_poisson"]["ttft_ms"].get("p50")
    return h


if __name__ == "__main__":
    sys.exit(main())
