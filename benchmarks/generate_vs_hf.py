"""xlaserve's engine vs `transformers` generate on a random 'small' Llama (CPU, each in its own process).

Model 'small': vocab 32000, hidden 768, 12 layers, 12 heads, 4 KV heads, intermediate 2048,
float32, untied lm_head (124.7 M parameters), random weights written once with numpy into a
cache folder. Its tokenizer is the demo byte-level BPE (512 tokens: the trainer cannot learn
32000 merges from the demo text) padded up to the model's vocabulary with merges of existing
tokens, so every id the model can produce decodes to text (the HTTP streams in serve_load.py
need that); this benchmark itself feeds token ids only. 'small-v152k' is the same shape with a
151,936-token vocabulary (Qwen2's), for the sampled-decode rows.

Work: a random prompt of 128 tokens, exactly 128 new tokens (greedy; EOS ignored), batch 1 and
batch 16. Peer: `model.generate` with `cache_implementation="static"` and (float32 only) the
default dynamic cache, sdpa attention, torch using every core, in a benchmarks/peer_worker.py
subprocess (no jax there, no torch here), loaded once per dtype and alternated round by round.

Second peer: llama.cpp (llama-cpp-python, benchmarks/llamacpp_peer.py, its own process), on GGUF
files converted from the same HF folder by llama.cpp's own convert_hf_to_gguf.py
(benchmarks/gguf.py), greedy, every usable core; batch B as B sequences of one llama_batch per
step (the way llama-batched-bench runs; see llamacpp_peer.py). Skipped, and said so in the
results, when llama_cpp is not installed (`pip install -e ".[bench]"`) or with --peers hf.

Rows and their peers (every ratio names the peer's dtype):
  float32   engine float32            vs transformers float32 (targets), llama.cpp F32
  bfloat16  engine bfloat16 weights   vs transformers bfloat16 (torch_dtype=torch.bfloat16),
                                         llama.cpp BF16 where the CPU has avx512_bf16, else F16
                                         (--llamacpp-half forces one; both 2 bytes per weight)
  int8      engine int8 weight-only   vs transformers float32 (torch has no weight-only int8 here),
                                         llama.cpp Q8_0
  bfloat16+int8  engine bfloat16 model with int8 weight-only (bfloat16 activations: the kernel's
                 K-pair int8 path) vs transformers bfloat16, llama.cpp Q8_0 (whose activations
                 are int8 blocks: the engine's bfloat16 ones are at least as precise)
  w8a8      engine --quantize w8a8: int8 weights and int8 activations (each matmul input
            quantized per row, int32 sums; cpu.cc GemmI8A8Impl) vs transformers float32,
            llama.cpp Q8_0 (int8 weights and int8 activation blocks of 32: the same arithmetic,
            llama.cpp's blocks finer than the engine's rows). Its compute roofline uses the fp32
            probe (torch has no int8 GEMM probe here), so it can pass 100 %.
Each round runs every side once, one after the other (xlaserve, llama.cpp, transformers static,
transformers dynamic), the first side rotating from round to round; figures are medians.
On CPU the engine keeps the KV cache in float32 whatever the weight dtype (backend.kv_dtype);
the roofline uses the KV itemsize the engine really allocated.

Sampled decode: batch 16 (quick 4), temperature 0.7, top_p 0.9, top_k 50, on 'small' and on
'small-v152k': engine decode tok/s sampled vs greedy in alternating rounds of the same run.

Engine settings (EngineArgs), and why:
  max_running_requests=16     the batch-16 case runs as 16 concurrent requests, one decode row each
  max_num_batched_tokens=2048 = 16 x 128: one scheduler step may prefill all 16 prompts, so
                              decoding then runs with all 16 rows, like HF's batched prefill
  max_model_len=512           128 + 128 tokens fit with room; keeps the page-bucket list short
  page_size=16                the engine default; 512 / 16 = 32 pages per sequence at most
  enable_prefix_cache=False   HF has none, and repeated prompts must not skip prefill

Measures (each side's own clock):
  prefill_s    HF: generate() start -> first logits. Engine: submit -> the moment every
               sequence has its first token (batch 1: time to first token).
  decode_tok_s HF: batch x 127 / (last logits - first logits). Engine: tokens that arrive while
               all sequences are decoding (after the last first-token, up to the first finish)
               / that time; for batch 1 the same formula as HF.
  e2e_s        whole generate() call / submit -> last token of the last request.
Roofline, per row: min(bandwidth roofline, compute roofline).
  bandwidth: the best read bandwidth of every probe in this run (the peer probes at the start
             and after every row) / bytes a decode step must read (the engine's weight bytes
             except the embedding table, plus the KV of every row at the average context,
             at the engine's real KV itemsize).
  compute:   this run's torch matmul rate (bf16 probe for the bfloat16 row, fp32 otherwise) /
             FLOPs per step (2 x non-embedding parameters x rows, plus attention over the context).
Prefill roofline: linear + attention FLOPs / the same matmul rate.

Run:  python -m benchmarks.generate_vs_hf [--quick] [--repeats N] [--dtypes float32,bfloat16,int8]
                                          [--no-sampled] [--peers hf,llamacpp] [--llamacpp-half auto]
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C
from benchmarks import gguf as G
from benchmarks.peer_worker import Peer, PeerError

NAME = "generate_vs_hf"

_SMALL = {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
          "num_attention_heads": 12, "num_key_value_heads": 4, "max_position_embeddings": 2048}
_TINY = {"vocab_size": 8000, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 2048}
QWEN_VOCAB = 151936
MODELS = {
    "small": _SMALL,                                   # the 'small' model
    "tiny": _TINY,                                     # quick mode: same code paths, a fraction of the work
    "small-v152k": {**_SMALL, "vocab_size": QWEN_VOCAB},   # sampled decode over a Qwen-sized vocabulary
    "tiny-v152k": {**_TINY, "vocab_size": QWEN_VOCAB},
}
TOKENIZER_VOCAB = 512
# the sampled-decode row's parameters (the issue's)
SAMPLED = {"temperature": 0.7, "top_p": 0.9, "top_k": 50}
# which peer dtype each engine row is compared with
DEFAULT_DTYPES = "float32,bfloat16,int8,bfloat16+int8,w8a8"
# a row's name -> (engine --dtype, --quantize)
ENGINE_ROW = {"float32": ("float32", "none"), "bfloat16": ("bfloat16", "none"), "int8": ("float32", "int8"),
              "bfloat16+int8": ("bfloat16", "int8"), "w8a8": ("float32", "w8a8")}
PEER_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "int8": "float32", "bfloat16+int8": "bfloat16",
              "w8a8": "float32"}


def cache_root() -> str:
    return C.bench_cache_root()


def ensure_model(name: str, root: str | None = None) -> str:
    """Write the random model folder once (config, safetensors, tokenizer); returns its path."""
    from jax_engine.models.demo import llama_config, write_random_llama, write_tokenizer

    path = os.path.join(root or cache_root(), f"{name}-llama-v2")
    marker = os.path.join(path, "bench_model.json")
    if os.path.isfile(marker):
        return path
    C.log(f"writing the random '{name}' Llama to {path} (once) ...")
    os.makedirs(path, exist_ok=True)
    ids = write_tokenizer(path, vocab_size=TOKENIZER_VOCAB)
    pad_tokenizer(path, MODELS[name]["vocab_size"])
    cfg = llama_config(**MODELS[name], bos_token_id=ids["<|bos|>"], eos_token_id=ids["<|eos|>"],
                       pad_token_id=ids["<|pad|>"], torch_dtype="float32")
    write_random_llama(path, cfg, seed=0)
    with open(marker, "w") as f:
        json.dump({"model": name, "seed": 0, "random_weights": True, "tokenizer_vocab": TOKENIZER_VOCAB,
                   "note": "xlaserve benchmark model: RANDOM weights; the tokenizer is smaller than the vocab"}, f)
    return path


def pad_tokenizer(path: str, vocab_size: int) -> None:
    """Grow tokenizer.json's BPE vocabulary to `vocab_size` with merges of existing tokens.

    Appended merges rank last, so text the trained merges already cover tokenizes as before;
    the point is that every id below vocab_size is a real token with text.
    """
    fn = os.path.join(path, "tokenizer.json")
    with open(fn) as f:
        tj = json.load(f)
    vocab: dict[str, int] = tj["model"]["vocab"]
    merges: list = tj["model"]["merges"]
    special = {t["content"] for t in tj.get("added_tokens", [])}
    base = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in special]
    next_id = max(vocab.values()) + 1
    for a in base:
        for b in base:
            if next_id >= vocab_size:
                break
            if a + b not in vocab:
                vocab[a + b] = next_id
                merges.append([a, b] if merges and isinstance(merges[0], list) else f"{a} {b}")
                next_id += 1
        if next_id >= vocab_size:
            break
    with open(fn, "w") as f:
        json.dump(tj, f, ensure_ascii=False)


def make_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(10, vocab, size=(batch, length)).tolist()


# =============================================================================================
# the engine side (this process); the transformers side lives in peer_worker.py
# =============================================================================================
class EngineSide:
    def __init__(self, path: str, dtype: str, quantize: str, max_running: int, max_model_len: int,
                 pids: Sequence[int] = ()):
        from jax_engine.config import ModelSpec

        self.name = "bench"
        spec = ModelSpec(name=self.name, path=path, dtype=dtype, quantize=quantize)
        self.engine, self.load_s = C.build_engine(
            [spec], max_running_requests=max_running, max_num_batched_tokens=max_running * 128,
            max_model_len=max_model_len, page_size=16, enable_prefix_cache=False)
        self.max_running = max_running
        self.pids = list(pids)      # the peer's process: its CPU counts in every window
        self.loop = asyncio.new_event_loop()

    def runner(self):
        return self.engine.worker(self.name).replicas[0].runner

    def weight_bytes(self, batches: Sequence[int]) -> dict:
        """Bytes of the parameters a decode step of each batch size reads (all but the embedding
        table, and of a matrix the measured --cpu-matmul plan keeps in both layouts only the
        layout that serves that many rows), and in all."""
        import jax

        from jax_engine.models.decoder import linears

        runner = self.runner()
        model = runner.model()
        total = sum(x.nbytes for x in jax.tree_util.tree_leaves(runner.params))
        embed = int(model.model.embed_tokens.weight[...].nbytes)
        mats = linears(model)

        def nbytes(*vs) -> int:
            return sum(int(v[...].nbytes) for v in vs if v is not None)

        def unused(batch: int) -> int:
            plan = runner.cfg.matmul_plan
            if runner.cfg.matmul != "mixed" or plan is None:
                return 0
            skip = 0
            for name, routes in plan.routes:
                if len(plan.layouts(name)) < 2:
                    continue
                path = next(p for max_m, p in routes if batch <= max_m)
                lin = mats[name]
                skip += nbytes(lin.weight, lin.scale) if path == "kernel" else nbytes(lin.panels, lin.panels_scale)
            return skip

        per_batch = {str(B): int(total - embed - unused(B)) for B in batches}
        return {"per_decode_step": per_batch, "all": int(total), "embedding": int(embed),
                "note": "per batch size: a matrix kept in two layouts counts once, in the layout serving it"}

    def kv_itemsize(self) -> int:
        """Bytes per KV element as the engine allocated them (float32 on CPU for every dtype)."""
        return int(self.runner().kv_dtype.itemsize)

    def generate(self, prompts: list[list[int]], new_tokens: int, sampling: dict | None = None) -> dict:
        with C.cpu_window(self.pids) as w:
            res = self.loop.run_until_complete(engine_requests(self.engine, prompts, new_tokens, sampling))
        res["cpu"] = w.result
        res["headline"] = f"prefill {res['prefill_s'] * 1e3:.0f} ms, decode {res['decode_tok_s']:.1f} tok/s"
        return res

    def close(self) -> None:
        self.engine.shutdown()
        self.loop.close()


def hf_round(peer: Peer, dtype: str, prompts: list[list[int]], new_tokens: int, cache: str | None) -> dict:
    """One transformers generate() round in the peer process, inside a CPU window over both."""
    res = peer.timed("hf_generate", dtype=dtype, prompts=prompts, new_tokens=new_tokens, cache=cache)
    res["headline"] = f"prefill {res['prefill_s'] * 1e3:.0f} ms, decode {res['decode_tok_s']:.1f} tok/s"
    return res


def llamacpp_round(peer: Peer, prompts: list[list[int]], new_tokens: int) -> dict:
    """One llama.cpp round (the GGUF loaded for this row) in its process, in a CPU window."""
    res = peer.timed("generate", prompts=prompts, new_tokens=new_tokens)
    res["headline"] = f"prefill {res['prefill_s'] * 1e3:.0f} ms, decode {res['decode_tok_s']:.1f} tok/s"
    return res


async def engine_requests(engine, prompts: list[list[int]], new_tokens: int, sampling: dict | None = None) -> dict:
    """Submit every prompt at once (greedy unless `sampling` is given), ignoring EOS; time every
    streamed token. Sampled requests get fixed seeds (request i: seed i), so rounds repeat."""
    from jax_engine.types import GenerateRequest, SamplingParams

    async def one(i: int, p: list[int]) -> dict:
        events: list[tuple[float, int]] = []
        ids: list[int] = []
        reason = None
        kw = dict(sampling, seed=i) if sampling else {"temperature": 0.0}
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, **kw)
        async for out in engine.generate(GenerateRequest(request_id="", prompt_ids=list(p), params=params)):
            if out.new_token_ids:
                events.append((time.perf_counter(), len(out.new_token_ids)))
                ids += out.new_token_ids
            if out.finished:
                reason = out.finish_reason
        return {"events": events, "ids": ids, "finish_reason": reason}

    t0 = time.perf_counter()
    reqs = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    return stream_metrics(t0, reqs, new_tokens)




def stream_metrics(t0: float, reqs: list[dict], new_tokens: int) -> dict:
    """Prefill / steady decode / e2e figures from per-request token arrival times."""
    firsts = [r["events"][0][0] for r in reqs if r["events"]]
    lasts = [r["events"][-1][0] for r in reqs if r["events"]]
    errors = sum(1 for r in reqs if r["finish_reason"] not in ("length", "stop") or len(r["ids"]) != new_tokens)
    if not firsts:
        return {"prefill_s": float("nan"), "decode_tok_s": float("nan"), "e2e_s": float("nan"), "errors": errors}
    all_first, first_done = max(firsts), min(lasts)
    n = sum(k for r in reqs for (t, k) in r["events"] if all_first < t <= first_done)
    window = first_done - all_first
    gaps = [b[0] - a[0] for a, b in zip(reqs[0]["events"], reqs[0]["events"][1:])]
    total_tokens = sum(len(r["ids"]) for r in reqs)
    return {
        "prefill_s": all_first - t0,
        "ttft_first_s": min(firsts) - t0,
        "decode_tok_s": n / window if window > 0 and n else float("nan"),
        "decode_window_s": window, "decode_window_tokens": n,
        "ms_per_step_p50": C.percentile(gaps, 50) * 1e3 if gaps else None,
        "e2e_s": max(lasts) - t0, "e2e_tok_s": total_tokens / (max(lasts) - t0),
        "tokens": total_tokens, "errors": errors,
        "output_ids": [r["ids"] for r in reqs],
    }


# =============================================================================================
# roofline
# =============================================================================================
def _shape(cfg: dict) -> tuple[int, int, int, int, int, int, int]:
    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    nh, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    return L, H, nh, kvh, hd, cfg["intermediate_size"], cfg["vocab_size"]


def matmul_params(cfg: dict) -> int:
    """Parameters every token multiplies with: the layers' linears and the lm_head (not the embedding)."""
    L, H, nh, kvh, hd, inter, V = _shape(cfg)
    return L * (H * (nh + 2 * kvh) * hd + nh * hd * H + 3 * H * inter) + H * V


def decode_flops(cfg: dict, batch: int, ctx: float) -> float:
    """FLOPs of one decode step: 2 per matmul parameter per row, plus QK^T and PV over ctx keys."""
    L, _, nh, _, hd, _, _ = _shape(cfg)
    return batch * (2 * matmul_params(cfg) + L * 2 * 2 * nh * hd * ctx)


def prefill_flops(cfg: dict, batch: int, T: int) -> float:
    """FLOPs of prefilling `batch` prompts of T tokens (causal attention: half the T x T scores)."""
    L, H, nh, _, hd, _, V = _shape(cfg)
    return batch * (2 * (matmul_params(cfg) - H * V) * T + L * 2 * 2 * nh * hd * T * T / 2 + 2 * H * V)


def compute_probe(dtype: str) -> str:
    """Which matmul probe bounds a row: bf16 for bfloat16 weights, fp32 otherwise (int8 weights
    are dequantized into float32 arithmetic)."""
    return "torch_matmul_bf16_gflops" if ENGINE_ROW[dtype][0] == "bfloat16" else "torch_matmul_fp32_gflops"


def roofline(cfg: dict, weight_bytes: int, kv_itemsize: int, batch: int, prompt: int, new: int,
             limits: dict, probe: str, engine_kv_tokens: int | None = None) -> dict:
    """Decode and prefill rooflines that the host can reach: min(bandwidth, compute)."""
    L, _, _, kvh, hd, _, _ = _shape(cfg)
    bw, gflops = limits.get("torch_sum_gbps"), limits.get(probe)
    ctx = prompt + new / 2                     # average context length over the decode
    kv_per_token = L * 2 * kvh * hd * kv_itemsize
    step_bytes = weight_bytes + batch * ctx * kv_per_token
    out: dict[str, Any] = {
        "bandwidth_gbps": bw, "bandwidth_probes": limits.get("probes"), "weight_bytes_per_step": weight_bytes,
        "kv_itemsize": kv_itemsize, "kv_bytes_per_step": int(batch * ctx * kv_per_token),
        "bandwidth_tok_s": C.rnd(batch * bw * 1e9 / step_bytes, 1) if bw else None,
        "compute_probe": probe, "compute_gflops": gflops,
        "decode_gflop_per_step": C.rnd(decode_flops(cfg, batch, ctx) / 1e9, 3),
        "compute_tok_s": C.rnd(batch * gflops * 1e9 / decode_flops(cfg, batch, ctx), 1) if gflops else None,
    }
    bounds = {k: out[f"{k}_tok_s"] for k in ("bandwidth", "compute") if out[f"{k}_tok_s"]}
    if bounds:
        out["bound"] = min(bounds, key=bounds.get)
        out["decode_tok_s"] = bounds[out["bound"]]
        out["decode_ms_per_step"] = C.rnd(batch / out["decode_tok_s"] * 1e3, 2)
    if engine_kv_tokens:
        # the reference attention gathers whole page buckets, not just the live context
        out["engine_kv_bytes_read_per_step"] = int(batch * engine_kv_tokens * kv_per_token)
    if gflops:
        out["prefill_gflop"] = C.rnd(prefill_flops(cfg, batch, prompt) / 1e9, 2)
        out["prefill_s"] = C.rnd(prefill_flops(cfg, batch, prompt) / (gflops * 1e9), 4)
    return out


# =============================================================================================
# main
# =============================================================================================
def main(argv: Sequence[str] | None = None) -> dict:
    C.engine_process()
    ap = argparse.ArgumentParser(prog="python -m benchmarks.generate_vs_hf", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, short runs (smoke test, < 2 min)")
    ap.add_argument("--model", choices=[m for m in MODELS if not m.endswith("v152k")], default=None,
                    help="default small; quick: tiny")
    ap.add_argument("--repeats", type=int, default=None, help="rounds per comparison (default 3; quick 1)")
    ap.add_argument("--retries", type=int, default=None, help="extra rounds when a round was disturbed (default 2)")
    ap.add_argument("--dtypes", default=None,
                    help="engine rows, int8 = float32 + int8 weights, bfloat16+int8 = bfloat16 + int8 weights, "
                         "w8a8 = int8 weights and activations (default float32,bfloat16,int8,bfloat16+int8,w8a8; "
                         "quick float32)")
    ap.add_argument("--batches", default=None, help="batch sizes (default 1,16; quick 1,4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128; quick 64")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128; quick 32")
    ap.add_argument("--bandwidth-gib", type=float, default=None, help="probe buffer (default 2; quick 0.5)")
    ap.add_argument("--model-dir", default=None, help="where the random model is cached")
    ap.add_argument("--no-sampled", action="store_true", help="skip the sampled-vs-greedy decode rows")
    ap.add_argument("--peers", default="hf,llamacpp",
                    help="peers beside the engine: hf (transformers generate), llamacpp (llama-cpp-python; skipped "
                         "with a note when not installed). Default hf,llamacpp")
    ap.add_argument("--llamacpp-half", choices=["auto", "bf16", "f16"], default="auto",
                    help="GGUF type against the bfloat16 row (default auto: BF16 with avx512_bf16, else F16)")
    ap.add_argument("--results-name", default=NAME,
                    help=f"results file name (default {NAME}); another host class keeps its own file beside the "
                         f"default one, e.g. {NAME}_avx2 on a host without AVX-512: the README shows each "
                         f"{NAME}*.json with its host line")
    ap.add_argument("--merge", action="store_true",
                    help="merge this run's rows into the previous results file (re-measure disturbed parts)")
    C.add_round_args(ap)
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    quick = a.quick
    model_name = a.model or ("tiny" if quick else "small")
    batches = [int(x) for x in (a.batches or ("1,4" if quick else "1,16")).split(",")]
    prompt_len = a.prompt_len or (64 if quick else 128)
    new_tokens = a.new_tokens or (32 if quick else 128)
    run = {
        "quick": quick, "model": model_name, "quiet_s": C.quiet_seconds(a), "repeats": a.repeats or (1 if quick else 3),
        "retries": a.retries if a.retries is not None else (0 if quick else 2), "batches": batches,
        "prompt_len": prompt_len, "new_tokens": new_tokens, "max_running": max(batches),
        # the 512 for the real runs; quick mode keeps the bucket lists (and warmup) short
        "max_model_len": max(128 if quick else 512, 2 ** (prompt_len + new_tokens - 1).bit_length()),
        "bandwidth_gib": a.bandwidth_gib or (0.5 if quick else 2.0), "probe_repeats": 3 if quick else 5,
        "peers": [p.strip() for p in a.peers.split(",") if p.strip()],
    }
    dtypes = [d.strip() for d in (a.dtypes or ("float32" if quick else DEFAULT_DTYPES)).split(",") if d.strip()]

    doc = C.header(NAME, quick, sys.argv[1:] if argv is None else argv)
    doc["quiet_wait"] = C.wait_for_quiet(0 if quick else 60)
    total = C.CpuWindow().start()
    path = ensure_model(model_name, a.model_dir)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    C.log("starting the transformers peer process; measuring machine limits ...")
    peer = Peer()
    llama, llama_note = start_llamacpp(run)
    pids = [peer.pid] + ([llama.pid] if llama else [])
    peer.window_pids = pids
    if llama:
        llama.window_pids = pids
    total.pids = pids
    probes = [probe_limits(peer, run)]
    hf_loaded: dict[str, dict] = {}
    llama_loaded: dict[str, dict] = {}
    llama_failed: dict[str, str] = {}
    raw: dict[str, dict] = {}
    sampled: dict[str, dict] = {}
    for dtype in dtypes:
        peer_dtype = PEER_DTYPE[dtype]
        if "hf" in run["peers"] and peer_dtype not in hf_loaded:
            hf_loaded[peer_dtype] = load_peer_model(peer, path, peer_dtype, run, cfg["vocab_size"])
        ltype = G.llama_type(dtype, half=a.llamacpp_half) if llama else None
        row_llama = llama
        if llama:
            old_pid = llama.pid
            llama, ok = load_llamacpp_row(llama, dtype, path, ltype, run, cfg["vocab_size"], llama_loaded, llama_failed)
            if llama.pid != old_pid:          # a restarted peer (for this row's retry, or for the next rows)
                pids[1:] = [llama.pid]
                peer.window_pids = llama.window_pids = total.pids = pids
            row_llama = llama if ok else None
        raw[dtype] = measure_row(path, dtype, peer, run, cfg["vocab_size"],
                                 sampled_into=sampled if dtype == "float32" and not a.no_sampled else None,
                                 llama=row_llama, llama_type=ltype if row_llama else None)
        if row_llama:
            llama.call("unload")
        probes.append(probe_limits(peer, run))
    if not a.no_sampled:
        names = ([] if model_name in sampled else [model_name]) + [f"{model_name}-v152k"]
        sampled.update(measure_sampled_models(names, a.model_dir, peer, run))
    limits = C.combine_limits(probes)
    doc["limits"] = limits
    doc["setup"] = {
        "model": model_name, "config": {k: cfg[k] for k in MODELS[model_name]},
        "params": next(iter(hf_loaded.values()))["params"] if hf_loaded else
        (next(iter(llama_loaded.values()))["params"] if llama_loaded else None), "model_dir": path,
        "peers": run["peers"],
        "prompt_len": prompt_len, "new_tokens": new_tokens, "batches": batches, "repeats": run["repeats"],
        "retries": run["retries"], "torch_threads": peer.hello["torch_threads"],
        "peer": {"process": "benchmarks/peer_worker.py subprocess", "dtypes": PEER_DTYPE,
                 "load_s": {d: C.rnd(x["load_s"], 2) for d, x in hf_loaded.items()}},
        "llamacpp": {**llamacpp_setup(llama, llama_note, llama_loaded, a.llamacpp_half),
                     **({"failed": llama_failed} if llama_failed else {})},
        "engine_args": {"max_running_requests": run["max_running"], "max_num_batched_tokens": run["max_running"] * 128,
                        "max_model_len": run["max_model_len"], "page_size": 16, "enable_prefix_cache": False},
        "sampling": "greedy (temperature 0), ignore_eos, max_new_tokens = new_tokens",
    }
    doc["rows"] = {d: summarize_row(r, cfg, limits, run, d) for d, r in raw.items()}
    if sampled:
        doc["sampled"] = sampled
    doc["process_isolation"] = {"engine": C.isolation_report(C.ENGINE_BLOCKED), "peer": peer.isolation(),
                                **({"llamacpp": llama.isolation()} if llama else {})}
    doc["cpu"] = total.stop()
    peer.close()
    if llama:
        llama.close()
    doc["busy_processes_at_end"] = C.busy_processes()
    if a.merge:
        doc = merge_into_previous(doc, quick, a.results_name)
        batches = doc["setup"]["batches"]
    doc["targets"] = targets(doc["rows"], batches)
    if not a.no_plot:
        doc["plots"] = plots(doc["rows"], batches, quick, doc["cpu"], doc["setup"], a.results_name)
    return C.finish(doc, a.results_name, quick)


def start_llamacpp(run: dict) -> tuple[Peer | None, str | None]:
    """The llama.cpp peer process, or (None, why not)."""
    import importlib.util

    if "llamacpp" not in run["peers"]:
        return None, "not requested (--peers)"
    if importlib.util.find_spec("llama_cpp") is None:
        C.log("llama-cpp-python is not installed: no llama.cpp rows (pip install -e '.[bench]')")
        return None, "llama-cpp-python not installed (pip install -e '.[bench]')"
    C.log("starting the llama.cpp peer process ...")
    return Peer(module="benchmarks.llamacpp_peer"), None


def load_llamacpp_model(llama: Peer, path: str, gguf_type: str, run: dict, vocab: int,
                        extra_bufts: bool = True) -> dict:
    """Convert (once) and load this row's GGUF in the llama.cpp peer; warm every batch size."""
    gguf = G.ensure_gguf(path, gguf_type)
    C.log(f"loading llama.cpp ({gguf_type}{'' if extra_bufts else ', extra buffer types off'}) in its peer process ...")
    info = llama.call("load", path=gguf, batches=run["batches"], prompt_len=run["prompt_len"],
                      new_tokens=run["new_tokens"], extra_bufts=extra_bufts)
    for B in run["batches"]:
        llama.call("generate", prompts=make_prompts(B, run["prompt_len"], vocab, 999), new_tokens=4)
    return {**info, "gguf_type": gguf_type, "extra_bufts": extra_bufts}


def load_llamacpp_row(llama: Peer, dtype: str, path: str, gguf_type: str, run: dict, vocab: int, loaded: dict,
                      failed: dict, restart=start_llamacpp) -> tuple[Peer, bool]:
    """Load engine row `dtype`'s GGUF into the llama.cpp peer (into `loaded`). A peer that crashes
    on one GGUF type (seen: SIGSEGV in llama.cpp's Q8_0 warm-up on an AMX Xeon, in its repacked /
    AMX weight path) is restarted and tried once more with llama.cpp's extra buffer types off
    (what its users do there: `--no-extra-bufts`); the first failure is kept in `failed` as
    "... (retried ...)". Only when that fails too does the row lose its llama.cpp columns, not the
    whole run. Returns (the peer to use from now on, whether this row has llama.cpp)."""
    try:
        loaded[dtype] = load_llamacpp_model(llama, path, gguf_type, run, vocab)
        return llama, True
    except PeerError as e:
        first = f"{gguf_type}: {e}"
        C.log(f"llama.cpp failed on {gguf_type}: {e}; retrying with its extra buffer types off")
        llama.close()
    llama = restart(run)[0]
    try:
        loaded[dtype] = load_llamacpp_model(llama, path, gguf_type, run, vocab, extra_bufts=False)
        failed[dtype] = f"{first} (retried with extra buffer types off: measured so)"
        return llama, True
    except PeerError as e:
        C.log(f"llama.cpp failed on {gguf_type} again: {e}; this row has no llama.cpp columns")
        failed[dtype] = f"{first}; with extra buffer types off: {e}"
        llama.close()
        return restart(run)[0], False


def llamacpp_setup(llama: Peer | None, note: str | None, loaded: dict, half: str) -> dict:
    """What the results say about the llama.cpp peer: version, build, files, contexts; or why it is absent."""
    if llama is None:
        return {"skipped": note}
    return {"process": "benchmarks/llamacpp_peer.py subprocess (no jax, no torch)", **llama.hello,
            "converter": "llama.cpp's convert_hf_to_gguf.py from the llama-cpp-python sdist (benchmarks/gguf.py)",
            "half_type_choice": half, "types": {d: x["gguf_type"] for d, x in loaded.items()},
            "models": {d: {k: v for k, v in x.items() if k != "contexts"} for d, x in loaded.items()},
            "contexts": next(iter(loaded.values()))["contexts"] if loaded else None,
            "how": "low-level llama_cpp API: per batch size one context (n_seq_max = B); prefill = one llama_batch "
                   "of B x prompt tokens; decode = one llama_batch of B tokens (seq_id 0..B-1) per step; "
                   "greedy argmax; KV cleared before every call"}


def probe_limits(peer: Peer, run: dict) -> dict:
    return peer.limits(run["bandwidth_gib"], run["probe_repeats"], matmul=True)


def load_peer_model(peer: Peer, path: str, dtype: str, run: dict, vocab: int) -> dict:
    """Load transformers in `dtype` in the peer and warm generate() at every batch size and cache."""
    C.log(f"loading transformers ({dtype}) in the peer ...")
    info = peer.call("hf_load", path=path, dtype=dtype)
    for B in run["batches"]:
        for cache in ("static", None):
            peer.call("hf_generate", dtype=dtype, prompts=make_prompts(B, run["prompt_len"], vocab, 999),
                      new_tokens=4, cache=cache)
    return info


def round_prompts(B: int, run: dict, vocab: int, base: int):
    """prompts_for(side): run_pairs calls each side once per round, so the k-th call of every
    side gets the same prompts (round k), and every round gets new ones."""
    calls: dict[str, int] = {}

    def prompts_for(side: str) -> list[list[int]]:
        calls[side] = calls.get(side, 0) + 1
        return make_prompts(B, run["prompt_len"], vocab, base + calls[side])
    return prompts_for


def measure_row(path: str, dtype: str, peer: Peer, run: dict, vocab: int,
                sampled_into: dict | None = None, llama: Peer | None = None, llama_type: str | None = None) -> dict:
    """Alternating rounds engine / llama.cpp / transformers for one engine dtype at every batch size.

    `llama` is the llama.cpp peer with this row's GGUF (`llama_type`) already loaded and warmed."""
    eng_dtype, quant = ENGINE_ROW[dtype]
    peer_dtype = PEER_DTYPE[dtype]
    C.log(f"loading + warming the engine ({dtype}) ...")
    gc.collect()
    # a cold start times the matmul paths (kernels/choose.py): not while the peer that just loaded
    # and warmed this row's model is still busy
    C.settle(run["quiet_s"])
    try:
        eng = EngineSide(path, eng_dtype, quant, run["max_running"], run["max_model_len"], pids=peer.window_pids)
    except Exception as e:  # noqa: BLE001 -- any load failure: report it in the row and carry on
        C.log(f"engine {dtype} failed to load: {e!r}")
        return {"error": f"load failed: {e!r}"}
    # warm the engine's serving path once per batch size (programs are already compiled)
    for B in run["batches"]:
        eng.generate(make_prompts(B, run["prompt_len"], vocab, 998), 4)
    before = C.compile_counts(eng.engine)
    hf = "hf" in run["peers"]
    peer_dtypes = {**({"hf_static": peer_dtype} if hf else {}),
                   **({"hf_dynamic": peer_dtype} if hf and dtype == "float32" else {}),
                   **({"llamacpp": llama_type} if llama else {})}
    out: dict[str, Any] = {"engine_load_and_warmup_s": C.rnd(eng.load_s, 1), "weight_bytes": eng.weight_bytes(run["batches"]),
                           "kv_itemsize": eng.kv_itemsize(), "quantize": quant, "engine_dtype": eng_dtype,
                           "peer_dtype": peer_dtype, "peer_dtypes": peer_dtypes, "runs": {}}
    for B in run["batches"]:
        prompts_for = round_prompts(B, run, vocab, 1000 * B)
        new = run["new_tokens"]
        sides = row_sides(eng, peer, peer_dtype, prompts_for, new, dynamic=dtype == "float32", hf=hf, llama=llama)
        out["runs"][B] = C.run_pairs(sides, run["repeats"], run["retries"], label=f"{dtype} b{B}",
                                     first=run["batches"].index(B), quiet_s=run["quiet_s"])
    after = C.compile_counts(eng.engine)
    out["compilations"] = {"engine_after_warmup": after["engine_after_warmup"],
                           "during_timing": after["engine_after_warmup"] - before["engine_after_warmup"],
                           "jax_during_timing": after["jax_process_total"] - before["jax_process_total"]}
    if sampled_into is not None:
        sampled_into[run["model"]] = measure_sampled(eng, run, vocab)
    eng.close()
    gc.collect()
    return out


def row_sides(eng: EngineSide, peer: Peer, peer_dtype: str, prompts_for, new: int, dynamic: bool, hf: bool = True,
              llama: Peer | None = None) -> dict:
    """The round functions of one batch size, in round order: the engine, llama.cpp, HF static
    cache (and HF dynamic cache)."""
    sides = {"xlaserve": lambda: eng.generate(prompts_for("xlaserve"), new)}
    if llama is not None:
        sides["llamacpp"] = lambda: llamacpp_round(llama, prompts_for("llamacpp"), new)
    if hf:
        sides["hf_static"] = lambda: hf_round(peer, peer_dtype, prompts_for("hf_static"), new, "static")
        if dynamic:
            sides["hf_dynamic"] = lambda: hf_round(peer, peer_dtype, prompts_for("hf_dynamic"), new, None)
    return sides


def measure_sampled(eng: EngineSide, run: dict, vocab: int) -> dict:
    """Engine decode tok/s with the issue's sampling parameters vs greedy, alternating rounds."""
    B = 4 if run["quick"] else 16
    B = min(B, eng.max_running)
    new = run["new_tokens"]
    eng.generate(make_prompts(B, run["prompt_len"], vocab, 997), 4, SAMPLED)      # warm both paths
    eng.generate(make_prompts(B, run["prompt_len"], vocab, 996), 4)
    before = C.compile_counts(eng.engine)
    prompts_for = round_prompts(B, run, vocab, 7000)
    runs = C.run_pairs({"greedy": lambda: eng.generate(prompts_for("greedy"), new),
                        "sampled": lambda: eng.generate(prompts_for("sampled"), new, SAMPLED)},
                       run["repeats"], run["retries"], label=f"sampled vs greedy b{B} (vocab {vocab})",
                       quiet_s=run["quiet_s"])
    after = C.compile_counts(eng.engine)
    ps = C.paired_summary(runs["sampled"], runs["greedy"], "decode_tok_s", 1)
    clean = ps["clean_rounds"] > 0
    return {"vocab_size": vocab, "batch": B, "sampling": SAMPLED, "new_tokens": new,
            "prompt_len": run["prompt_len"], "engine_dtype": "float32",
            "sampled_decode_tok_s": ps["a_clean"] if clean else ps["a"],
            "greedy_decode_tok_s": ps["b_clean"] if clean else ps["b"],
            "ratio_sampled_over_greedy": ps["best"], "from_clean_rounds": clean, "all_rounds": ps,
            "errors": sum(r["errors"] for side in runs.values() for r in side),
            "compilations_during_timing": after["engine_after_warmup"] - before["engine_after_warmup"]}


def measure_sampled_models(names: list[str], model_dir: str | None, peer: Peer, run: dict) -> dict:
    """Sampled rows on models whose engine the dtype rows did not load (the large-vocabulary
    one, and the main model when the float32 row was not run)."""
    out = {}
    B = min(4 if run["quick"] else 16, run["max_running"])
    for name in names:
        path = ensure_model(name, model_dir)
        with open(os.path.join(path, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        C.log(f"loading + warming the engine for sampled decode on '{name}' (vocab {vocab}) ...")
        gc.collect()
        eng = EngineSide(path, "float32", "none", B, run["max_model_len"], pids=peer.window_pids)
        try:
            out[name] = measure_sampled(eng, run, vocab)
        finally:
            eng.close()
            gc.collect()
    return out


def summarize_row(raw: dict, cfg: dict, limits: dict, run: dict, dtype: str) -> dict:
    """A row's per-batch summaries, with rooflines from the best limits of the whole run."""
    if "error" in raw:
        return raw
    row = {k: v for k, v in raw.items() if k != "runs"}
    for B, runs in raw["runs"].items():
        per_step = raw["weight_bytes"]["per_decode_step"]
        per_step = per_step[str(B)] if isinstance(per_step, dict) else per_step   # older results: one number
        row[f"batch_{B}"] = summarize_batch(runs, cfg, per_step, raw["kv_itemsize"],
                                            B, run["prompt_len"], run["new_tokens"], limits, run["max_model_len"],
                                            dtype, raw.get("peer_dtypes"))
    return row


def merge_into_previous(doc: dict, quick: bool, name: str = NAME) -> dict:
    """Put this run's (dtype, batch) entries into the previous result file's rows.

    For re-measuring the parts of a long run that other processes disturbed. Every batch
    entry carries its own roofline (with the bandwidth of the run that measured it), and the
    merged document lists every run that contributed."""
    path = C.result_path(name, quick)
    if not os.path.isfile(path):
        return doc
    with open(path) as f:
        old = json.load(f)
    if old.get("setup", {}).get("model") != doc["setup"]["model"]:
        raise SystemExit("--merge: the previous result is for another model")
    runs = old.get("merged_runs") or [{"started": old.get("started"), "argv": old.get("argv"), "cpu": old.get("cpu"),
                                       "limits": old.get("limits")}]
    runs.append({"started": doc["started"], "argv": doc["argv"], "cpu": doc["cpu"], "limits": doc["limits"]})
    for dtype, row in doc["rows"].items():
        target_row = old["rows"].setdefault(dtype, {})
        for k, v in row.items():
            if k.startswith("batch_"):
                v["measured"] = doc["started"]
            target_row[k] = v
    old["setup"]["batches"] = sorted(set(old["setup"]["batches"]) | set(doc["setup"]["batches"]))
    old["merged_runs"] = runs
    old["limits"] = doc["limits"]      # the newest run's; each batch entry keeps its own roofline
    # the run-level CPU block: disturbed if any contributing run was
    old["cpu"] = dict(doc["cpu"], disturbed=any((r.get("cpu") or {}).get("disturbed") for r in runs))
    old["busy_processes_at_end"] = doc["busy_processes_at_end"]
    if doc.get("sampled"):
        old.setdefault("sampled", {}).update(doc["sampled"])
    old["process_isolation"] = doc.get("process_isolation")
    # the llama.cpp peer's per-row facts (GGUF file, how it was loaded, why it failed) follow the rows
    lc_new, lc_old = doc["setup"].get("llamacpp") or {}, old["setup"].setdefault("llamacpp", {})
    for key in ("types", "models"):
        lc_old.setdefault(key, {}).update(lc_new.get(key) or {})
    failed = {d: why for d, why in (lc_old.get("failed") or {}).items() if d not in doc["rows"]}
    failed.update(lc_new.get("failed") or {})
    lc_old.pop("failed", None)
    if failed:
        lc_old["failed"] = failed
    return old


def summarize_batch(runs: dict, cfg: dict, weight_bytes: int, kv_itemsize: int, B: int, prompt: int, new: int,
                    limits: dict, max_model_len: int, dtype: str, peer_dtypes: dict | None = None) -> dict:
    """Per peer: medians, the ratios (named with that peer's dtype), greedy agreement; the roofline."""
    e = runs["xlaserve"]
    peer_dtypes = peer_dtypes or {}
    out: dict[str, Any] = {"rounds": len(e), "clean_rounds": sum(x["clean"] for x in e),
                           "peer_dtype": PEER_DTYPE[dtype]}
    for peer in [k for k in runs if k != "xlaserve"]:
        h = runs[peer]
        pdt = peer_dtypes.get(peer, PEER_DTYPE[dtype])
        # ratios are always "how many times better xlaserve is" (>1 = xlaserve wins), and name the peer's dtype
        out["ratios_vs_" + peer] = {"peer_dtype": pdt}
        for key in ("prefill_s", "decode_tok_s", "e2e_s"):
            ps = C.paired_summary(e, h, key, 4 if key != "decode_tok_s" else 1)
            out.setdefault("xlaserve", {})[key] = ps["a_clean"] if ps["clean_rounds"] else ps["a"]
            out.setdefault(peer, {})[key] = ps["b_clean"] if ps["clean_rounds"] else ps["b"]
            r = ps["best"]
            if key != "decode_tok_s" and r:
                r = C.rnd(1 / r)
            out["ratios_vs_" + peer][key] = r
            out.setdefault("all_rounds", {})[f"{peer}.{key}"] = ps
        out[peer]["dtype"] = pdt
        out[peer]["ms_per_step"] = C.rnd(C.median(x["ms_per_step"] for x in h), 2)
        out[peer]["cpu_share_runs"] = [x["cpu"]["cpu_share_of_cores"] for x in h]
    x = out["xlaserve"]
    x["ms_per_step_p50"] = C.rnd(C.median(r.get("ms_per_step_p50") or float("nan") for r in e), 2)
    x["e2e_tok_s"] = C.rnd(C.median(r["e2e_tok_s"] for r in e), 1)
    x["errors"] = sum(r["errors"] for r in e)
    x["cpu_share_runs"] = [r["cpu"]["cpu_share_of_cores"] for r in e]
    x["others_share_runs"] = [r["cpu"]["others_share_of_cores"] for r in e]
    # correctness: engine greedy tokens vs HF (static) greedy tokens, same prompts
    for peer, key in (("hf_static", "greedy_match_vs_hf"), ("llamacpp", "greedy_match_vs_llamacpp")):
        h = runs.get(peer, [])
        if h:
            pm = [C.prefix_match(a, b) for r1, r2 in zip(e, h) for a, b in zip(r1["output_ids"], r2["output_ids"])]
            out[key] = {"first_token_equal": sum(p > 0 for p in pm), "sequences": len(pm),
                        "matching_prefix_len_median": C.median(pm), "of": new,
                        "peer_dtype": peer_dtypes.get(peer, PEER_DTYPE[dtype])}
    ps = 16
    pb_tokens = ps * next(b for b in _page_buckets(max_model_len // ps) if b * ps >= prompt + new)
    rl = roofline(cfg, weight_bytes, kv_itemsize, B, prompt, new, limits, compute_probe(dtype),
                  engine_kv_tokens=pb_tokens)
    out["roofline"] = rl
    out["roofline_fraction"] = {
        "xlaserve_decode": C.ratio(x["decode_tok_s"], rl.get("decode_tok_s")),
        "hf_static_decode": C.ratio(out.get("hf_static", {}).get("decode_tok_s"), rl.get("decode_tok_s")),
        "llamacpp_decode": C.ratio(out.get("llamacpp", {}).get("decode_tok_s"), rl.get("decode_tok_s")),
        "xlaserve_prefill": C.ratio(rl.get("prefill_s"), x["prefill_s"]),
    }
    return out


def _page_buckets(p_max: int) -> list[int]:
    """The engine's own page buckets, so the roofline counts the keys it really gathers."""
    from jax_engine.decode.runner import page_buckets

    return page_buckets(p_max)


def targets(rows: dict, batches: list[int]) -> dict:
    out = hf_targets(rows, batches)
    out.update(llamacpp_targets(rows, batches))
    return out


def llamacpp_targets(rows: dict, batches: list[int]) -> dict:
    """The issue's targets against llama.cpp, per row (equal bytes per weight): decode at batch 1
    >= 1.0x and at the largest batch >= 1.2x; prefill at both >= 1.0x."""
    out = {}
    for dtype, row in rows.items():
        if not isinstance(row, dict) or "error" in row:
            continue
        for B in sorted({min(batches), max(batches)}):
            r = row.get(f"batch_{B}", {}).get("ratios_vs_llamacpp")
            if not r:
                continue
            tag = f"{dtype}_b{B}_vs_llamacpp_{r.get('peer_dtype')}"
            out[f"{tag}_decode"] = C.target(r.get("decode_tok_s"), 1.0 if B == min(batches) else 1.2)
            out[f"{tag}_prefill"] = C.target(r.get("prefill_s"), 1.0)
    return out


def hf_targets(rows: dict, batches: list[int]) -> dict:
    f = rows.get("float32", {})
    if "error" in f or not f:
        return {"float32": "missing"}
    b1 = f.get(f"batch_{min(batches)}", {})
    bn = f.get(f"batch_{max(batches)}", {})

    def best_hf(row: dict, key: str, higher: bool) -> float | None:
        vals = [row.get(p, {}).get(key) for p in ("hf_static", "hf_dynamic")]
        vals = [v for v in vals if v is not None]
        return (max(vals) if higher else min(vals)) if vals else None

    return {
        "b1_decode_vs_hf_static": C.target(b1.get("ratios_vs_hf_static", {}).get("decode_tok_s"), 1.2),
        "b1_decode_roofline_fraction": C.target(b1.get("roofline_fraction", {}).get("xlaserve_decode"), 0.7),
        f"b{max(batches)}_decode_vs_best_hf": C.target(
            C.ratio(bn.get("xlaserve", {}).get("decode_tok_s"), best_hf(bn, "decode_tok_s", True)), 2.0),
        "b1_prefill_hf_over_engine": C.target(
            C.ratio(best_hf(b1, "prefill_s", False), b1.get("xlaserve", {}).get("prefill_s")), 1.0),
        f"b{max(batches)}_prefill_hf_over_engine": C.target(
            C.ratio(best_hf(bn, "prefill_s", False), bn.get("xlaserve", {}).get("prefill_s")), 1.0),
        "compilations_after_warmup": C.target(
            sum(r.get("compilations", {}).get("engine_after_warmup", 0) for r in rows.values() if isinstance(r, dict)),
            0, higher_is_better=False),
    }


def plots(rows: dict, batches: list[int], quick: bool, cpu: dict, setup: dict, name: str = NAME) -> list[str]:
    note = f"cpu share {cpu['cpu_share_of_cores']}, others {cpu['others_share_of_cores']}" + \
           (" (DISTURBED)" if cpu["disturbed"] else "")
    groups = [f"batch {B}" for B in batches]
    series: dict[str, list] = {}
    prefill: dict[str, list] = {}
    for dtype, row in rows.items():
        if "error" in row:
            continue
        series[f"xlaserve {dtype}"] = [row[f"batch_{B}"]["xlaserve"]["decode_tok_s"] for B in batches]
        prefill[f"xlaserve {dtype}"] = [C.rnd(row[f"batch_{B}"]["xlaserve"]["prefill_s"] * 1e3, 1) for B in batches]
        lc = [row[f"batch_{B}"].get("llamacpp") or {} for B in batches]
        if any(lc):
            label = f"llama.cpp {next(x['dtype'] for x in lc if x)}"
            series[label] = [x.get("decode_tok_s") for x in lc]
            prefill[label] = [C.rnd(x["prefill_s"] * 1e3, 1) if x.get("prefill_s") else None for x in lc]
    f = rows.get("float32")
    if f and "error" not in f:
        for peer, label in (("hf_static", "HF static cache"), ("hf_dynamic", "HF dynamic cache")):
            series[label] = [f[f"batch_{B}"].get(peer, {}).get("decode_tok_s") for B in batches]
            v = [f[f"batch_{B}"].get(peer, {}).get("prefill_s") for B in batches]
            prefill[label] = [C.rnd(x * 1e3, 1) if x else None for x in v]
        series["roofline, float32 row"] = [f[f"batch_{B}"]["roofline"]["decode_tok_s"] for B in batches]
    p1 = C.bar_plot(C.result_path(name, quick, "png"), f"random '{setup['model']}' Llama decode, CPU: tokens/s",
                    groups, series, "tokens / s (higher is better)", note)
    p2 = C.bar_plot(C.result_path(name + "_prefill", quick, "png"),
                    f"prefill ({setup['prompt_len']}-token prompts; batch B = all B prompts)",
                    groups, prefill, "ms (lower is better)", note)
    return [C.rel(p) for p in (p1, p2)]


if __name__ == "__main__":
    main()
