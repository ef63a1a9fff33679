"""xlaserve's engine vs `transformers` generate on a random 'small' Llama (CPU, same process).

Model 'small': vocab 32000, hidden 768, 12 layers, 12 heads, 4 KV heads, intermediate 2048,
float32, untied lm_head (124.7 M parameters), random weights written once with numpy into a
cache folder. Its tokenizer is the demo byte-level BPE (512 tokens: the trainer cannot learn
32000 merges from the demo text) padded up to the model's vocabulary with merges of existing
tokens, so every id the model can produce decodes to text (the HTTP streams in serve_load.py
need that); this benchmark itself feeds token ids only.

Work: a random prompt of 128 tokens, exactly 128 new tokens (greedy; EOS ignored), batch 1 and
batch 16. Peers: `model.generate` with `cache_implementation="static"` and with the default
(dynamic) cache, sdpa attention, torch using every core.

Engine settings (EngineArgs), and why:
  max_running_requests=16     the batch-16 case runs as 16 concurrent requests, one decode row each
  max_num_batched_tokens=2048 = 16 x 128: one scheduler step may prefill all 16 prompts, so
                              decoding then runs with all 16 rows, like HF's batched prefill
                              (prefill still runs one sequence per program call)
  max_model_len=512           128 + 128 tokens fit with room; keeps the page-bucket list short
  page_size=16                the engine default; 512 / 16 = 32 pages per sequence at most
  enable_prefix_cache=False   HF has none, and repeated prompts must not skip prefill
The engine's requests are greedy (temperature 0) with ignore_eos, max_new_tokens=128.

Measures (all times from this process's clock):
  prefill_s    HF: generate() start -> first logits. Engine: submit -> the moment every
               sequence has its first token (batch 1: time to first token).
  decode_tok_s HF: batch x 127 / (last logits - first logits). Engine: tokens that arrive while
               all sequences are decoding (after the last first-token, up to the first finish)
               / that time; for batch 1 the same formula as HF.
  e2e_s        whole generate() call / submit -> last token of the last request.
Roofline: read bandwidth measured in this run (torch sum over 2 GiB, all cores) / bytes each
decode step must read (the engine's weight bytes except the embedding table, plus the KV of
every row at the average context). Prefill roofline: linear + attention FLOPs / torch fp32
matmul rate measured in this run.

Rows: float32 (targets), bfloat16 and int8 weight-only (no targets yet) against HF float32.

Run:  python -m benchmarks.generate_vs_hf [--quick] [--repeats N] [--dtypes float32,bfloat16,int8]
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import time
from typing import Any, Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C

NAME = "generate_vs_hf"

MODELS = {
    # the issue's 'small' model
    "small": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048),
    # quick mode: same family and code paths, a fraction of the work
    "tiny": dict(vocab_size=8000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048),
}
TOKENIZER_VOCAB = 512


def cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "xlaserve", "bench-models")


def ensure_model(name: str, root: Optional[str] = None) -> str:
    """Write the random model folder once (config, safetensors, tokenizer); returns its path."""
    from jax_engine.demo_model import llama_config, write_random_llama, write_tokenizer

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
# the two sides
# =============================================================================================
class HFSide:
    def __init__(self, path: str):
        import torch
        from transformers import LlamaForCausalLM

        self.threads = C.set_torch_threads()
        t0 = time.perf_counter()
        self.model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        self.model.eval()
        self.load_s = time.perf_counter() - t0

    def generate(self, prompts: list[list[int]], new_tokens: int, cache: Optional[str]) -> dict:
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList

        stamps: list[float] = []

        class Stamp(LogitsProcessor):
            def __call__(self, input_ids, scores):
                stamps.append(time.perf_counter())
                return scores

        ids = torch.tensor(prompts, dtype=torch.long)
        kw: dict[str, Any] = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  logits_processor=LogitsProcessorList([Stamp()]), pad_token_id=0, eos_token_id=2)
        if cache:
            kw["cache_implementation"] = cache
        with C.cpu_window() as w, torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
            t1 = time.perf_counter()
        B, T = ids.shape
        res = {"prefill_s": stamps[0] - t0, "decode_tok_s": B * (len(stamps) - 1) / (stamps[-1] - stamps[0]),
               "e2e_s": t1 - t0, "steps": len(stamps), "cpu": w.result,
               "output_ids": out[:, T:].tolist()}
        res["ms_per_step"] = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1) * 1e3
        res["headline"] = f"prefill {res['prefill_s'] * 1e3:.0f} ms, decode {res['decode_tok_s']:.1f} tok/s"
        return res


class EngineSide:
    def __init__(self, path: str, dtype: str, quantize: str, max_running: int, max_model_len: int):
        from jax_engine.config import ModelSpec

        self.name = "bench"
        spec = ModelSpec(name=self.name, path=path, dtype=dtype, quantize=quantize)
        self.engine, self.load_s = C.build_engine(
            [spec], max_running_requests=max_running, max_num_batched_tokens=max_running * 128,
            max_model_len=max_model_len, page_size=16, enable_prefix_cache=False)
        self.max_running = max_running
        self.loop = asyncio.new_event_loop()

    def runner(self):
        return self.engine._worker(self.name).replicas[0].runner

    def weight_bytes(self) -> dict:
        """Bytes of the parameters a decode step reads (all but the embedding table) and in all."""
        import jax

        params = self.runner().params
        total = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
        embed = sum(x.nbytes for x in jax.tree_util.tree_leaves(params.get("embed", {})))
        return {"per_decode_step": int(total - embed), "all": int(total), "embedding": int(embed)}

    def generate(self, prompts: list[list[int]], new_tokens: int) -> dict:
        with C.cpu_window() as w:
            res = self.loop.run_until_complete(self._generate(prompts, new_tokens))
        res["cpu"] = w.result
        res["headline"] = f"prefill {res['prefill_s'] * 1e3:.0f} ms, decode {res['decode_tok_s']:.1f} tok/s"
        return res

    async def _generate(self, prompts: list[list[int]], new_tokens: int) -> dict:
        return await engine_requests(self.engine, prompts, new_tokens)

    def close(self) -> None:
        self.engine.shutdown()
        self.loop.close()


async def engine_requests(engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """Submit every prompt at once as a greedy, ignore-EOS request; time every streamed token."""
    from jax_engine.types import GenerateRequest, SamplingParams

    async def one(p: list[int]) -> dict:
        events: list[tuple[float, int]] = []
        ids: list[int] = []
        reason = None
        params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
        async for out in engine.generate(GenerateRequest(request_id="", prompt_ids=list(p), params=params)):
            if out.new_token_ids:
                events.append((time.perf_counter(), len(out.new_token_ids)))
                ids += out.new_token_ids
            if out.finished:
                reason = out.finish_reason
        return {"events": events, "ids": ids, "finish_reason": reason}

    t0 = time.perf_counter()
    reqs = await asyncio.gather(*[one(p) for p in prompts])
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
def roofline(cfg: dict, weight_bytes: int, kv_itemsize: int, batch: int, prompt: int, new: int,
             bw_gbps: float, matmul_gflops: Optional[float], engine_kv_tokens: Optional[int] = None) -> dict:
    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    nh, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = H // nh
    ctx = prompt + new / 2                     # average context length over the decode
    kv_per_token = L * 2 * kvh * hd * kv_itemsize
    kv = batch * ctx * kv_per_token
    step_bytes = weight_bytes + kv
    out = {
        "bandwidth_gbps": bw_gbps, "weight_bytes_per_step": weight_bytes, "kv_bytes_per_step": int(kv),
        "decode_ms_per_step": C.rnd(step_bytes / (bw_gbps * 1e9) * 1e3, 2),
        "decode_tok_s": C.rnd(batch * bw_gbps * 1e9 / step_bytes, 1),
    }
    if engine_kv_tokens:
        # the reference attention gathers whole page buckets, not just the live context
        out["engine_kv_bytes_read_per_step"] = int(batch * engine_kv_tokens * kv_per_token)
    if matmul_gflops:
        I, V = cfg["intermediate_size"], cfg["vocab_size"]
        linear_params = L * (H * (nh + 2 * kvh) * hd + nh * hd * H + 3 * H * I)
        T = prompt
        flops = batch * (2 * linear_params * T + L * 2 * 2 * nh * hd * T * T / 2 + 2 * H * V)
        out["prefill_gflop"] = C.rnd(flops / 1e9, 2)
        out["prefill_s"] = C.rnd(flops / (matmul_gflops * 1e9), 4)
    return out


def prefix_match(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# =============================================================================================
# main
# =============================================================================================
def main(argv: Optional[Sequence[str]] = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.generate_vs_hf", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, short runs (smoke test, < 2 min)")
    ap.add_argument("--model", choices=list(MODELS), default=None, help="default small; quick: tiny")
    ap.add_argument("--repeats", type=int, default=None, help="rounds per comparison (default 3; quick 1)")
    ap.add_argument("--retries", type=int, default=None, help="extra rounds when a round was disturbed (default 2)")
    ap.add_argument("--dtypes", default=None,
                    help="engine rows, int8 = float32 + int8 weights (default float32,bfloat16,int8; quick float32)")
    ap.add_argument("--batches", default=None, help="batch sizes (default 1,16; quick 1,4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128; quick 64")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128; quick 32")
    ap.add_argument("--bandwidth-gib", type=float, default=None, help="probe buffer (default 2; quick 0.5)")
    ap.add_argument("--model-dir", default=None, help="where the random model is cached")
    ap.add_argument("--merge", action="store_true",
                    help="merge this run's rows into the previous results file (re-measure disturbed parts)")
    C.add_round_args(ap)
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    quick = a.quick
    quiet_s = C.quiet_seconds(a)
    model_name = a.model or ("tiny" if quick else "small")
    repeats = a.repeats or (1 if quick else 3)
    retries = a.retries if a.retries is not None else (0 if quick else 2)
    batches = [int(x) for x in (a.batches or ("1,4" if quick else "1,16")).split(",")]
    prompt_len = a.prompt_len or (64 if quick else 128)
    new_tokens = a.new_tokens or (32 if quick else 128)
    dtypes = [d.strip() for d in (a.dtypes or ("float32" if quick else "float32,bfloat16,int8")).split(",") if d.strip()]
    max_running = max(batches)
    # the issue's 512 for the real runs; quick mode keeps the bucket lists (and warmup) short
    max_model_len = max(128 if quick else 512, 2 ** (prompt_len + new_tokens - 1).bit_length())

    doc = C.header(NAME, quick, sys.argv[1:] if argv is None else argv)
    doc["quiet_wait"] = C.wait_for_quiet(0 if quick else 60)
    total = C.CpuWindow().start()
    path = ensure_model(model_name, a.model_dir)
    cfg = json.load(open(os.path.join(path, "config.json")))
    C.log("measuring machine limits ...")
    limits = C.measure_limits(gib=a.bandwidth_gib or (0.5 if quick else 2.0), repeats=3 if quick else 5,
                              matmul=True, jax_too=not quick)
    doc["limits"] = limits
    C.log(json.dumps({k: v for k, v in limits.items() if k != "cpu"}))

    C.log("loading HF transformers model ...")
    hf = HFSide(path)
    doc["setup"] = {
        "model": model_name, "config": {k: cfg[k] for k in MODELS[model_name]}, "params": sum(
            p.numel() for p in hf.model.parameters()), "model_dir": path,
        "prompt_len": prompt_len, "new_tokens": new_tokens, "batches": batches, "repeats": repeats,
        "retries": retries, "torch_threads": hf.threads, "hf_load_s": C.rnd(hf.load_s, 2),
        "engine_args": {"max_running_requests": max_running, "max_num_batched_tokens": max_running * 128,
                        "max_model_len": max_model_len, "page_size": 16, "enable_prefix_cache": False},
        "sampling": "greedy (temperature 0), ignore_eos, max_new_tokens = new_tokens",
    }
    vocab = cfg["vocab_size"]
    # warm HF's paths (first generate() builds caches / sdpa kernels)
    for B in batches:
        for cache in ("static", None):
            hf.generate(make_prompts(B, prompt_len, vocab, 999), 4, cache)

    rows: dict[str, Any] = {}
    for dtype in dtypes:
        quant = "int8" if dtype == "int8" else "none"
        eng_dtype = "float32" if dtype == "int8" else dtype
        C.log(f"loading + warming the engine ({dtype}) ...")
        gc.collect()
        try:
            eng = EngineSide(path, eng_dtype, quant, max_running, max_model_len)
        except Exception as e:  # report and carry on with the other rows
            C.log(f"engine {dtype} failed to load: {e!r}")
            rows[dtype] = {"error": f"load failed: {e!r}"}
            continue
        wb = eng.weight_bytes()
        kv_itemsize = 2 if eng_dtype == "bfloat16" else 4
        # warm the engine's serving path once per batch size (programs are already compiled)
        for B in batches:
            eng.generate(make_prompts(B, prompt_len, vocab, 998), 4)
        before = C.compile_counts(eng.engine)
        row: dict[str, Any] = {"engine_load_and_warmup_s": C.rnd(eng.load_s, 1), "weight_bytes": wb,
                               "quantize": quant, "engine_dtype": eng_dtype}
        for B in batches:
            calls: dict[str, int] = {}

            def prompts_for(side: str, B: int = B) -> list[list[int]]:
                # run_pairs calls each side once per round, so the k-th call of every side gets
                # the same prompts (round k), and every round gets new ones
                calls[side] = calls.get(side, 0) + 1
                return make_prompts(B, prompt_len, vocab, 1000 * B + calls[side])

            sides = {"xlaserve": lambda: eng.generate(prompts_for("xlaserve"), new_tokens),
                     "hf_static": lambda: hf.generate(prompts_for("hf_static"), new_tokens, "static")}
            if dtype == "float32":
                sides["hf_dynamic"] = lambda: hf.generate(prompts_for("hf_dynamic"), new_tokens, None)
            runs = C.run_pairs(sides, repeats, retries, label=f"{dtype} b{B}", first=batches.index(B),
                               quiet_s=quiet_s)
            row[f"batch_{B}"] = summarize_batch(runs, cfg, wb["per_decode_step"], kv_itemsize, B, prompt_len,
                                                new_tokens, limits, max_model_len)
        after = C.compile_counts(eng.engine)
        row["compilations"] = {"engine_after_warmup": after["engine_after_warmup"],
                               "during_timing": after["engine_after_warmup"] - before["engine_after_warmup"],
                               "jax_during_timing": after["jax_process_total"] - before["jax_process_total"]}
        rows[dtype] = row
        eng.close()
        del eng
        gc.collect()

    doc["rows"] = rows
    doc["cpu"] = total.stop()
    doc["busy_processes_at_end"] = C.busy_processes()
    if a.merge:
        doc = merge_into_previous(doc, quick)
        batches = doc["setup"]["batches"]
    doc["targets"] = targets(doc["rows"], batches)
    if not a.no_plot:
        doc["plots"] = plots(doc["rows"], batches, quick, doc["cpu"], doc["setup"])
    return C.finish(doc, NAME, quick)


def merge_into_previous(doc: dict, quick: bool) -> dict:
    """Put this run's (dtype, batch) entries into the previous result file's rows.

    For re-measuring the parts of a long run that other processes disturbed. Every batch
    entry carries its own roofline (with the bandwidth of the run that measured it), and the
    merged document lists every run that contributed."""
    path = C.result_path(NAME, quick)
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
    return old


def summarize_batch(runs: dict, cfg: dict, weight_bytes: int, kv_itemsize: int, B: int, prompt: int, new: int,
                    limits: dict, max_model_len: int) -> dict:
    e = runs["xlaserve"]
    out: dict[str, Any] = {"rounds": len(e), "clean_rounds": sum(x["clean"] for x in e)}
    for peer in [k for k in runs if k != "xlaserve"]:
        h = runs[peer]
        for key in ("prefill_s", "decode_tok_s", "e2e_s"):
            ps = C.paired_summary(e, h, key, 4 if key != "decode_tok_s" else 1)
            out.setdefault("xlaserve", {})[key] = ps["a_clean"] if ps["clean_rounds"] else ps["a"]
            out.setdefault(peer, {})[key] = ps["b_clean"] if ps["clean_rounds"] else ps["b"]
            # ratios are always "how many times better xlaserve is" (>1 = xlaserve wins)
            r = ps["best"]
            if key != "decode_tok_s" and r:
                r = C.rnd(1 / r)
            out.setdefault("ratios_vs_" + peer, {})[key] = r
            out.setdefault("all_rounds", {})[f"{peer}.{key}"] = ps
        out[peer]["ms_per_step"] = C.rnd(C.median(x["ms_per_step"] for x in h), 2)
        out[peer]["cpu_share_runs"] = [x["cpu"]["cpu_share_of_cores"] for x in h]
    x = out["xlaserve"]
    x["ms_per_step_p50"] = C.rnd(C.median(r.get("ms_per_step_p50") or float("nan") for r in e), 2)
    x["e2e_tok_s"] = C.rnd(C.median(r["e2e_tok_s"] for r in e), 1)
    x["errors"] = sum(r["errors"] for r in e)
    x["cpu_share_runs"] = [r["cpu"]["cpu_share_of_cores"] for r in e]
    x["others_share_runs"] = [r["cpu"]["others_share_of_cores"] for r in e]
    # correctness: engine greedy tokens vs HF (static) greedy tokens, same prompts
    h = runs.get("hf_static", [])
    if h:
        pm = [prefix_match(a, b) for r1, r2 in zip(e, h) for a, b in zip(r1["output_ids"], r2["output_ids"])]
        out["greedy_match_vs_hf"] = {"first_token_equal": sum(p > 0 for p in pm), "sequences": len(pm),
                                     "matching_prefix_len_median": C.median(pm), "of": new}
    bw = limits["torch_sum_gbps"]
    ps = 16
    pb_tokens = ps * next(b for b in _page_buckets(max_model_len // ps) if b * ps >= prompt + new)
    rl = roofline(cfg, weight_bytes, kv_itemsize, B, prompt, new, bw, limits.get("torch_matmul_fp32_gflops"),
                  engine_kv_tokens=pb_tokens)
    out["roofline"] = rl
    out["roofline_fraction"] = {
        "xlaserve_decode": C.ratio(x["decode_tok_s"], rl["decode_tok_s"]),
        "hf_static_decode": C.ratio(out.get("hf_static", {}).get("decode_tok_s"), rl["decode_tok_s"]),
        "xlaserve_prefill": C.ratio(rl.get("prefill_s"), x["prefill_s"]),
    }
    return out


def _page_buckets(p_max: int) -> list[int]:
    """The engine's own page buckets, so the roofline counts the keys it really gathers."""
    from jax_engine.runner import page_buckets

    return page_buckets(p_max)


def targets(rows: dict, batches: list[int]) -> dict:
    f = rows.get("float32", {})
    if "error" in f or not f:
        return {"float32": "missing"}
    b1 = f.get(f"batch_{min(batches)}", {})
    bn = f.get(f"batch_{max(batches)}", {})

    def best_hf(row: dict, key: str, higher: bool) -> Optional[float]:
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


def plots(rows: dict, batches: list[int], quick: bool, cpu: dict, setup: dict) -> list[str]:
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
    f = rows.get("float32")
    if f and "error" not in f:
        for peer, label in (("hf_static", "HF static cache"), ("hf_dynamic", "HF dynamic cache")):
            series[label] = [f[f"batch_{B}"].get(peer, {}).get("decode_tok_s") for B in batches]
            v = [f[f"batch_{B}"].get(peer, {}).get("prefill_s") for B in batches]
            prefill[label] = [C.rnd(x * 1e3, 1) if x else None for x in v]
        series["bandwidth roofline (fp32)"] = [f[f"batch_{B}"]["roofline"]["decode_tok_s"] for B in batches]
    p1 = C.bar_plot(C.result_path(NAME, quick, "png"), f"random '{setup['model']}' Llama decode, CPU: tokens/s",
                    groups, series, "tokens / s (higher is better)", note)
    p2 = C.bar_plot(C.result_path(NAME + "_prefill", quick, "png"),
                    f"prefill ({setup['prompt_len']}-token prompts; batch B = all B prompts)",
                    groups, prefill, "ms (lower is better)", note)
    return [C.rel(p) for p in (p1, p2)]


if __name__ == "__main__":
    main()
