"""xlaserve vs `transformers` on a Qwen3-MoE-shaped model with random weights (CPU, float32 both,
each in its own process): decode tok/s at batch 1 and 16 and prefill ms (issue 19).

Model 'qwen3moe-1b' (Qwen3MoeForCausalLM): vocabulary 32,000, hidden 1024, 9 layers, 16 query /
4 KV heads of 128, q/k RMSNorm, every layer sparse: 64 experts, top-8 routing with
norm_topk_prob, expert intermediate 512, untied LM head: 1.019 B parameters in all, 0.227 B active
per token (0.194 B without the input embedding, a lookup). Written once by transformers itself
(`Qwen3MoeForCausalLM(config)`, its own N(0, 0.02) init, seed 0, `save_pretrained` safetensors)
in a subprocess (this process runs the engine and has no torch) under the benchmark cache
(~/.cache/xlaserve/bench-models/), with generate_vs_hf's byte-level tokenizer padded to the
vocabulary. --quick: 'qwen3moe-tiny' (vocabulary 8000, hidden 256, 4 layers, 16 experts top-4,
intermediate 128).

Work: random 128-token prompts (quick 32), exactly 32 new tokens (quick 16), greedy, EOS ignored,
batch 1 and 16 (quick 1 and 4). Engine: generate_vs_hf.EngineSide's in-process `Engine` (float32,
max_running_requests 16, max_num_batched_tokens = batch x prompt (16 x 128) so a batch's prompts
prefill in one step, page size 16, prefix cache off; the experts run moe.py's sort-by-expert dispatch, attention
the server's CPU default). Peer: transformers `generate` (dynamic cache, as its users call it,
sdpa attention, torch on every core) in a benchmarks/peer_worker.py subprocess.

Rounds: per batch size xlaserve and transformers alternate, the first side rotating
(common.run_pairs), 3 rounds (+ up to 2 when another process disturbed one; quick: 1 round);
medians, clean rounds when any. Measures (generate_vs_hf's definitions): prefill ms = submit ->
every sequence has its first token (HF: generate() start -> first logits); decode tok/s = tokens
while every sequence decodes / that time (HF: batch x (steps - 1) / first -> last logits).
Greedy agreement: matching prefix of each sequence's tokens, engine vs transformers, same prompts.

Time (2 cores): the model is written once (~40 s, 4.1 GB). In a run transformers loads in ~20 s
and the engine loads and compiles in ~40 s (warm compile cache; ~2.5 min cold); whole runs took
3.5 min with the stacked-experts call and 9 min with llama.py handing moe.py each layer's slice
(batch-1 decode at ~2 tok/s then: moe_dispatch.py's scan_slice row). --quick: ~30-40 s
once its tiny model exists (10 s of engine warmup with a warm compile cache).

Run:  python -m benchmarks.moe_vs_hf [--quick] [--batches 1,16] [--prompt-len 128] [--new-tokens 32]
          [--rounds 3] [--retries 2] [--model-dir D] [--quiet-wait S]
Writes benchmarks/results/moe_vs_hf.json (moe_vs_hf_quick.json in --quick); `render(doc, quick)`
returns the README lines.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C

NAME = "moe_vs_hf"
_COMMON = {"rope_theta": 1000000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False,
           "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
           "initializer_range": 0.02}
MODELS = {
    "qwen3moe-1b": {**_COMMON, "vocab_size": 32000, "hidden_size": 1024, "num_hidden_layers": 9,
                    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 64,
                    "num_experts_per_tok": 8, "moe_intermediate_size": 512, "intermediate_size": 3072},
    "qwen3moe-tiny": {**_COMMON, "vocab_size": 8000, "hidden_size": 256, "num_hidden_layers": 4,
                      "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "num_experts": 16,
                      "num_experts_per_tok": 4, "moe_intermediate_size": 128, "intermediate_size": 512},
}
TOKENIZER_VOCAB = 512
SIDES = ("xlaserve", "transformers")
PEER_DTYPE = "float32"


def param_counts(cfg: dict) -> dict:
    """Total and per-token active parameters of a Qwen3-MoE config (every layer sparse)."""
    H, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    nh, kvh, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    E = cfg.get("num_experts") or cfg["num_local_experts"]          # transformers 5 saves num_local_experts
    k, inter = cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    attn = H * (nh + 2 * kvh) * D + nh * D * H + 2 * D          # q, k, v, o, q/k norms
    expert = 3 * H * inter
    norms = 2 * H
    per_layer_total = attn + E * expert + H * E + norms
    per_layer_active = attn + k * expert + H * E + norms
    embed = V * H
    head = 0 if cfg.get("tie_word_embeddings") else V * H
    total = L * per_layer_total + embed + head + H
    active = L * per_layer_active + embed + head + H
    return {"total": total, "active": active, "active_without_input_embedding": active - embed,
            "experts": L * E * expert, "active_experts": L * k * expert}


def cache_root() -> str:
    return C.bench_cache_root()


def ensure_model(name: str, root: str | None = None) -> str:
    """The random model folder, written once by transformers in a subprocess; returns its path."""
    path = os.path.join(root or cache_root(), f"{name}-v1")
    if os.path.isfile(os.path.join(path, "bench_model.json")):
        return path
    C.log(f"writing the random '{name}' Qwen3-MoE to {path} with transformers (once) ...")
    p = subprocess.run([sys.executable, "-m", "benchmarks.moe_vs_hf", "--write-model", name, path], cwd=C.REPO_ROOT,
                       stdout=subprocess.DEVNULL, check=False)
    if p.returncode != 0 or not os.path.isfile(os.path.join(path, "bench_model.json")):
        raise SystemExit(f"writing the '{name}' model failed (exit {p.returncode})")
    return path


def write_model(name: str, path: str) -> None:
    """(subprocess, torch allowed) Qwen3MoeForCausalLM with transformers' own init, seed 0, saved as
    safetensors, plus the demo tokenizer padded to the vocabulary."""
    import torch
    import transformers as tf

    from benchmarks.generate_vs_hf import pad_tokenizer
    from jax_engine.models.demo import write_tokenizer

    os.makedirs(path, exist_ok=True)
    spec = MODELS[name]
    ids = write_tokenizer(path, vocab_size=TOKENIZER_VOCAB)
    pad_tokenizer(path, spec["vocab_size"])
    cfg = tf.Qwen3MoeConfig(**spec, bos_token_id=ids["<|bos|>"], eos_token_id=ids["<|eos|>"], pad_token_id=ids["<|pad|>"])
    torch.manual_seed(0)
    model = tf.Qwen3MoeForCausalLM(cfg).eval()
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "bench_model.json"), "w") as f:
        json.dump({"model": name, "seed": 0, "random_weights": True, "params_torch": n, "tokenizer_vocab": TOKENIZER_VOCAB,
                   "note": "xlaserve benchmark model: RANDOM weights (transformers' init); the tokenizer is smaller "
                           "than the vocab"}, f)


# =============================================================================================
# measuring
# =============================================================================================
STACKED = "stacked weights + layer index (each block reads only its expert)"
SLICED = "the layer scan's per-layer slice (XLA copies every expert of the layer before the dispatch loop)"


def experts_call() -> str:
    """How jax_engine/models/decoder.py hands the experts to moe.moe_mlp in this tree (moe_dispatch.py's
    scan_slice / scan_stacked rows measure the difference)."""
    import inspect

    from jax_engine.models import decoder

    return STACKED if "layer=li" in inspect.getsource(decoder.CausalLM.__call__) else SLICED


def engine_side(cls, path: str, max_running: int, budget: int, max_model_len: int, pids: Sequence[int]):
    """generate_vs_hf.EngineSide (its generate() and timing) over an engine whose token budget is
    `budget` (EngineSide's own is max_running x 128: more token buckets to compile in --quick)."""
    import asyncio

    from jax_engine.config import ModelSpec

    eng = cls.__new__(cls)
    eng.name, eng.max_running, eng.pids = "bench", max_running, list(pids)
    eng.engine, eng.load_s = C.build_engine(
        [ModelSpec(name=eng.name, path=path, dtype="float32")], max_running_requests=max_running,
        max_num_batched_tokens=budget, max_model_len=max_model_len, page_size=16, enable_prefix_cache=False)
    eng.loop = asyncio.new_event_loop()
    return eng


def hf_round(peer, prompts: list[list[int]], new_tokens: int) -> dict:
    res = peer.timed("hf_generate", dtype=PEER_DTYPE, prompts=prompts, new_tokens=new_tokens, cache=None)
    res["headline"] = f"prefill {res['prefill_s'] * 1e3:.0f} ms, decode {res['decode_tok_s']:.1f} tok/s"
    return res


def summarize_batch(runs: dict[str, list[dict]], new_tokens: int) -> dict:
    """Medians per side (clean rounds when any), the ratios (> 1: xlaserve better), greedy agreement."""
    e, h = runs["xlaserve"], runs["transformers"]
    out: dict[str, Any] = {"rounds": len(e), "clean_rounds": sum(bool(r.get("clean")) for r in e)}
    for key, digits in (("prefill_s", 4), ("decode_tok_s", 1), ("e2e_s", 3)):
        ps = C.paired_summary(e, h, key, digits)
        clean = ps["clean_rounds"] > 0
        out.setdefault("xlaserve", {})[key] = ps["a_clean"] if clean else ps["a"]
        out.setdefault("transformers", {})[key] = ps["b_clean"] if clean else ps["b"]
        r = ps["best"]
        out.setdefault("ratios", {})[key] = r if key == "decode_tok_s" or not r else C.rnd(1 / r)
        out.setdefault("all_rounds", {})[key] = ps
    for side in SIDES:
        s = out[side]
        s["prefill_ms"] = C.rnd(s["prefill_s"] * 1e3, 1) if s.get("prefill_s") is not None else None
        s["cpu_share_runs"] = [r["cpu"]["cpu_share_of_cores"] for r in runs[side]]
    out["xlaserve"]["errors"] = sum(r.get("errors", 0) for r in e)
    pm = [C.prefix_match(a, b) for r1, r2 in zip(e, h) for a, b in zip(r1.get("output_ids") or [], r2.get("output_ids") or [])]
    out["greedy_match"] = {"sequences": len(pm), "all_equal": sum(p == new_tokens for p in pm),
                           "first_token_equal": sum(p > 0 for p in pm), "matching_prefix_median": C.median(pm) if pm else None,
                           "of": new_tokens}
    return out


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.moe_vs_hf", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny MoE, batch 1 and 4, 1 round (smoke test, < 1 min)")
    ap.add_argument("--model", choices=list(MODELS), default=None, help="default qwen3moe-1b; quick: qwen3moe-tiny")
    ap.add_argument("--batches", default=None, help="batch sizes (default 1,16; quick 1,4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128; quick 32")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 32; quick 16")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per batch size (default 3; quick 1)")
    ap.add_argument("--retries", type=int, default=None, help="extra rounds when one was disturbed (default 2; quick 0)")
    ap.add_argument("--model-dir", default=None, help="where the random model is cached")
    ap.add_argument("--write-model", nargs=2, metavar=("NAME", "PATH"), help=argparse.SUPPRESS)
    C.add_round_args(ap)
    a = ap.parse_args(list(argv))
    if a.write_model:
        return a
    q = a.quick
    a.model = a.model or ("qwen3moe-tiny" if q else "qwen3moe-1b")
    a.batches = [int(x) for x in (a.batches or ("1,4" if q else "1,16")).split(",")]
    a.prompt_len = a.prompt_len or (32 if q else 128)
    a.new_tokens = a.new_tokens or (16 if q else 32)
    a.rounds = a.rounds or (1 if q else 3)
    a.retries = a.retries if a.retries is not None else (0 if q else 2)
    a.quiet_s = C.quiet_seconds(a)
    if min(a.batches) < 1 or a.prompt_len < 1 or a.new_tokens < 2 or a.rounds < 1:
        ap.error("batches and --prompt-len must be >= 1, --new-tokens >= 2, --rounds >= 1")
    return a


def main(argv: Sequence[str] | None = None) -> dict | None:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if a.write_model:
        write_model(*a.write_model)
        return None
    C.engine_process()
    from benchmarks.generate_vs_hf import EngineSide, make_prompts, round_prompts
    from benchmarks.peer_worker import Peer

    quick = a.quick
    doc = C.header(NAME, quick, sys.argv[1:] if argv is None else argv)
    doc["quiet_wait"] = C.wait_for_quiet(a.quiet_s)
    path = ensure_model(a.model, a.model_dir)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    vocab = cfg["vocab_size"]
    max_running = max(a.batches)
    max_model_len = max(128, 1 << (a.prompt_len + a.new_tokens - 1).bit_length())
    total = C.CpuWindow().start()
    C.log("starting the transformers peer process ...")
    peer = Peer()
    total.pids = [peer.pid]
    probes = [peer.limits(0.5 if quick else 1.0, 3, matmul=False)]
    C.log(f"loading transformers ({PEER_DTYPE}) in the peer ...")
    hf_info = peer.call("hf_load", path=path, dtype=PEER_DTYPE)
    for B in a.batches:
        peer.call("hf_generate", dtype=PEER_DTYPE, prompts=make_prompts(B, a.prompt_len, vocab, 999), new_tokens=2,
                  cache=None)
    C.log("loading + warming the engine (float32) ...")
    gc.collect()
    budget = max_running * a.prompt_len
    eng = engine_side(EngineSide, path, max_running, budget, max_model_len, peer.window_pids)
    for B in a.batches:
        eng.generate(make_prompts(B, a.prompt_len, vocab, 998), 2)
    w = eng.engine.worker(eng.name)
    before = C.compile_counts(eng.engine)
    run = {"prompt_len": a.prompt_len}
    batches: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    for i, B in enumerate(a.batches):
        prompts_for = round_prompts(B, run, vocab, 1000 * B)
        sides = {"xlaserve": lambda: eng.generate(prompts_for("xlaserve"), a.new_tokens),
                 "transformers": lambda: hf_round(peer, prompts_for("transformers"), a.new_tokens)}
        runs = C.run_pairs(sides, a.rounds, a.retries, label=f"b{B}", first=i, quiet_s=a.quiet_s)
        raw[str(B)] = {s: [{k: v for k, v in r.items() if k != "output_ids"} for r in rs] for s, rs in runs.items()}
        batches[str(B)] = summarize_batch(runs, a.new_tokens)
    after = C.compile_counts(eng.engine)
    probes.append(peer.limits(0.5 if quick else 1.0, 3, matmul=False))
    doc["limits"] = C.combine_limits(probes)
    counts = param_counts(cfg)
    doc["setup"] = {
        "model": a.model, "model_dir": path, "architecture": "Qwen3MoeForCausalLM",
        "config": dict(MODELS[a.model]), "params": counts,
        "params_transformers": hf_info.get("params"), "dtype": "float32", "peer_dtype": PEER_DTYPE,
        "batches": a.batches, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "rounds": a.rounds,
        "retries": a.retries, "torch_threads": peer.hello.get("torch_threads"),
        "peer": {"process": "benchmarks/peer_worker.py subprocess", "cache": "dynamic (generate's default)",
                 "attention": "sdpa", "load_s": C.rnd(hf_info.get("load_s"), 2)},
        "engine_args": {"max_running_requests": max_running, "max_num_batched_tokens": budget,
                        "max_model_len": max_model_len, "page_size": 16, "enable_prefix_cache": False},
        "engine": {"load_and_warmup_s": C.rnd(eng.load_s, 1), "matmul": w.cfg.matmul,
                   "attention_backend": w.cfg.attention_backend, "experts": "jax_engine/models/moe.py sorted dispatch",
                   "experts_weights": experts_call()},
        "sampling": "greedy (temperature 0), EOS ignored, exactly new_tokens",
    }
    doc["batches"] = batches
    doc["raw_rounds"] = raw
    doc["compilations"] = {"engine_after_warmup": after["engine_after_warmup"],
                           "during_timing": after["engine_after_warmup"] - before["engine_after_warmup"]}
    doc["process_isolation"] = {"engine": C.isolation_report(C.ENGINE_BLOCKED), "peer": peer.isolation()}
    doc["cpu"] = total.stop()
    eng.close()
    peer.close()
    doc["busy_processes_at_end"] = C.busy_processes()
    doc["targets"] = {f"b{B}_decode_vs_hf": C.target(b["ratios"].get("decode_tok_s"), 1.0) for B, b in batches.items()}
    return C.finish(doc, NAME, quick)


# =============================================================================================
# README
# =============================================================================================
_f, _x = C.fmt, C.fmt_ratio


def _b(n: int | None) -> str:
    return "?" if not n else f"{n / 1e9:.3f} B" if n >= 1e8 else f"{n / 1e6:.1f} M"


def render(d: dict, quick: bool) -> list[str]:
    """README lines for benchmarks/results/moe_vs_hf.json: xlaserve vs transformers per batch size."""
    st = d.get("setup") or {}
    cf, pc = st.get("config") or {}, st.get("params") or {}
    lines = [f"### Mixture of experts: a Qwen3-MoE-shaped model, xlaserve vs transformers ({C.cpu_line(d)})", "",
             C.source_line(NAME, quick, d), ""]
    if cf:
        lines.append(
            f"Random '{st.get('model', '?')}' `Qwen3MoeForCausalLM` written by transformers ({_b(pc.get('total'))} parameters, "
            f"{_b(pc.get('active'))} active per token): hidden {cf.get('hidden_size')}, {cf.get('num_hidden_layers')} layers, "
            f"{cf.get('num_experts')} experts, top-{cf.get('num_experts_per_tok')}, expert intermediate "
            f"{cf.get('moe_intermediate_size')}, vocabulary {_f(cf.get('vocab_size'), '{:,}')}; {st.get('dtype', 'float32')} "
            f"on both sides (transformers `generate`, {(st.get('peer') or {}).get('cache', 'dynamic')} cache, in its own "
            f"process). {st.get('prompt_len', '?')}-token random prompts, {st.get('new_tokens', '?')} new tokens, greedy; "
            "rounds alternate, medians (clean rounds when any). Experts: `jax_engine/models/moe.py`'s sort-by-expert "
            "dispatch on XLA:CPU (YNNPACK GEMMs), given "
            f"{(st.get('engine') or {}).get('experts_weights') or 'the layer weights'}.")
    rows = d.get("batches") or {}
    if rows:
        lines += ["", "| batch | prefill ms, xlaserve | prefill ms, transformers | prefill vs transformers | "
                      "decode tok/s, xlaserve | decode tok/s, transformers | decode vs transformers | "
                      "greedy sequences equal | clean rounds |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for B in sorted(rows, key=int):
            r = rows[B]
            x, h = r.get("xlaserve") or {}, r.get("transformers") or {}
            rt, gm = r.get("ratios") or {}, r.get("greedy_match") or {}
            eq = f"{gm['all_equal']} of {gm['sequences']}" if gm.get("sequences") else "–"
            lines.append(f"| {B} | {_f(x.get('prefill_ms'), '{:.0f}')} | {_f(h.get('prefill_ms'), '{:.0f}')} | "
                         f"{_x(rt.get('prefill_s'))} | {_f(x.get('decode_tok_s'))} | {_f(h.get('decode_tok_s'))} | "
                         f"{_x(rt.get('decode_tok_s'))} | {eq} | {r.get('clean_rounds', '–')} of {r.get('rounds', '–')} |")
        comp = d.get("compilations") or {}
        if comp:
            lines += ["", f"Engine compilations during the timed rounds: {_f(comp.get('during_timing'), '{}')}."]
    return lines + [""]


if __name__ == "__main__":
    main()
