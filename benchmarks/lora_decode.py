"""Multi-LoRA: batch decode with 4 different adapters in the batch against the base model, the
LoRA term's two formulations at the model's shapes, and adapter load time.

The issue's target (issue 18): batch-16 decode with 4 different adapters (rank 16) in the batch
>= 0.8x the base model's tok/s on the 'small' model; adapter load time; the LoRA term "gathered
per-row A/B, or grouped by slot; measure both on CPU".

Adapters: 4 PEFT LoRA folders (adapter_config.json + adapter_model.safetensors, PEFT's tensor
names `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] / `lora_B.weight`
[out, r]) of rank 16, lora_alpha 32, on all 7 modules (q/k/v/o/gate/up/down), written with numpy
(no torch in this process): A ~ N(0, 1/in), B ~ N(0, 0.02^2), seed = adapter index (PEFT's own
init leaves B = 0, which would add nothing). Written once per model under the benchmark cache
(~/.cache/xlaserve/bench-models/lora/); tests/unit/test_bench_lora.py checks that PEFT and the
engine's loader read them as written.

Decode (phase `decode`; one process, torch blocked, no server in between):
  model    the random 'small' Llama of benchmarks/generate_vs_hf.py (vocabulary 32,000, hidden
           768, 12 layers, float32, the CPU default dtype); --quick: 'tiny'.
  engines  two in-process `Engine`s, both alive for the whole phase:
           LoRA on:  EngineArgs(models=[ModelSpec("bench", <model>)], enable_lora=True,
                     max_loras=4, max_lora_rank=16, loras=[(lora0, ...), ..., (lora3, ...)], ...)
           LoRA off: the same without LoRA.
           Both: max_running_requests=B, max_model_len=512, page_size=16, enable_prefix_cache=False;
           the server's CPU defaults otherwise (token budget 64, CPU matmul path, the server's
           persistent compile cache, programs compiled ahead of time). The prefix cache is off as
           in the other benchmarks: every side of a round gets the same prompts.
  sides    base:          B requests without an adapter, on the LoRA-on engine (the step skips
                          the LoRA term when no row has an adapter)
           lora:          the same B requests, request i under adapter i % 4 (every step mixes
                          the 4 adapters)
           base_lora_off: the same B requests on the LoRA-off engine (what enabling LoRA costs
                          base-model traffic)
  workload B = 16 concurrent requests (quick 4), a 128-token random prompt each (quick 32),
           greedy (temperature 0), ignore_eos, max_new_tokens 128 (quick 32): generate_vs_hf's
           choices.
  rounds   one untimed warm-up round per side (8 new tokens); then the three sides alternate, the
           first side rotating (common.run_pairs), 3 rounds each (+ up to 2 more when others
           disturbed a round; quick: 2 rounds, no retries); medians, clean rounds when any.
  figures  decode tok/s = tokens that arrive after the last first token / (last first token ->
           last token), constrained_decode.decode_metrics's definition; full-batch decode tok/s =
           the same up to the first row that finishes; ms per step = median gap between
           consecutive tokens of a row while every row decodes. Ratios lora / base (the target,
           0.8) and base / base_lora_off. Compilations after warmup: each engine's own counter
           (target 0). Greedy rows are compared by a digest of their tokens: lora rows that differ
           from the base row of the same round (the adapters change the output), base rows equal
           to base_lora_off's.

Adapter load (phase `load`, on the LoRA-on engine, idle, after the decode rounds): one adapter is
unloaded to free a slot, then a fifth rank-16 adapter folder is loaded with
`engine.load_adapter_sync(name, path)` and unloaded, 1 + N times (N = 5, quick 3); the wall time
of each load after the first (the files are then in the page cache), p50. Also timed alone, N
times: jax_engine.lora.adapter.load_adapter (the host part: read the safetensors, check, lay out,
pad to the maximum rank). Compilations after the loads (target 0).

The LoRA term's two formulations (phase `kernels`, no engine): one decoder layer's four matrices
(qkv, o, gate_up, down) at the model's shapes, float32, jitted, for T = 16 tokens (a decode step
of batch 16) and T = 64 (a prefill-sized step), S = 4 and 8 slots, maximum rank R = 16 and 64;
token t's slot is t % S + 1 (every token under an adapter):
  stacked   the engine's form, jax_engine/models/lora.py: every slot's A as one GEMM
            (x @ A_all [T, S, R]), masked by the token's one-hot slot, then one GEMM with B_all
  gathered  per token its own slot's A [in, R] and B [R, out] gathered (A[slot_t]) and a
            batched matmul
  base      the layer's four base matmuls (XLA einsum, jax_engine/models/llama.SPECS) at T, for
            scale: "the LoRA term = x % of the base matmuls" (the engine's CPU matmul path may
            route a base matrix to its own kernel; the LoRA term is always an XLA einsum)
The three forms are called in turn, N times each (N = 50, quick 10) after 3 untimed calls;
median ms per call. The two LoRA forms' outputs are compared (max abs difference).

Time (2 cores, 'small', compile cache warm): two engines load + warm ~1-2 min (an empty compile
cache adds the ahead-of-time compiles, a few minutes); a round ~9-11 s per side (2048 prompt
tokens through a 64-token budget, then 128 steps at batch 16); 1 warm-up + 3 rounds x 3 sides
~2 min, plus up to 60 s before the start and before each round waiting for a quiet machine;
loads a few seconds; kernels (8 shapes x 3 forms, 53 calls each, plus their compiles) ~1 min.
About 5-9 minutes in all. --quick (tiny, batch 4, 32-token prompts, 32 new tokens, 2 rounds,
3 loads, 10 kernel calls) is a smoke test of every path: ~1-2 minutes (66 s on 2 shared cores).

Run:  python -m benchmarks.lora_decode [--quick] [--model small] [--batch 16] [--prompt-len 128]
          [--new-tokens 128] [--adapters 4] [--rank 16] [--rounds 3] [--retries 2] [--loads 5]
          [--kernel-reps 50] [--phases decode,load,kernels] [--quiet-wait S]
Writes benchmarks/results/lora_decode.json (lora_decode_quick.json in --quick);
`render(doc, quick)` returns the README lines.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C

NAME = "lora_decode"
MODEL_NAME = "bench"
GOAL_RATIO = 0.8             # decode tok/s with adapters / base, at least
PHASES = ("decode", "load", "kernels")
SIDES = ("base", "lora", "base_lora_off")
LORA_ALPHA_PER_RANK = 2.0    # lora_alpha = 2 r (scaling 2), a common choice
B_STD = 0.02
# PEFT module names -> the HF submodule that holds them
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
KERNEL_TOKENS = (16, 64)
KERNEL_SLOTS = (4, 8)
KERNEL_RANKS = (16, 64)
KERNEL_FORMS = ("base", "stacked", "gathered")


# =============================================================================================
# the adapters (numpy only: no torch in the engine's process)
# =============================================================================================
def module_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adapted module for an HF decoder config."""
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    D = cfg.get("head_dim") or H // nh
    kvh = cfg.get("num_key_value_heads") or nh
    inter = cfg["intermediate_size"]
    return {"q_proj": (H, nh * D), "k_proj": (H, kvh * D), "v_proj": (H, kvh * D), "o_proj": (nh * D, H),
            "gate_proj": (H, inter), "up_proj": (H, inter), "down_proj": (inter, H)}


def tensor_name(layer: int, module: str, ab: str) -> str:
    """PEFT's saved name of one LoRA matrix (ab: "A" or "B")."""
    return f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}.lora_{ab}.weight"


def adapter_config(rank: int, base_path: str, targets: Sequence[str] = tuple(MODULES)) -> dict:
    """adapter_config.json as PEFT writes it for a plain LoRA (the fields PEFT and the engine read)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path,
            "r": rank, "lora_alpha": LORA_ALPHA_PER_RANK * rank, "lora_dropout": 0.0,
            "target_modules": list(targets), "bias": "none", "use_rslora": False, "use_dora": False,
            "fan_in_fan_out": False, "modules_to_save": None, "init_lora_weights": True, "inference_mode": True}


def adapter_tensors(cfg: dict, rank: int, seed: int, targets: Sequence[str] = tuple(MODULES)) -> dict:
    """Random non-zero lora_A [r, in] ~ N(0, 1/in) and lora_B [out, r] ~ N(0, B_STD^2), float32."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shapes = module_shapes(cfg)
    out = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m in targets:
            fin, fout = shapes[m]
            out[tensor_name(layer, m, "A")] = (rng.standard_normal((rank, fin), np.float32) / np.sqrt(fin)).astype(np.float32)
            out[tensor_name(layer, m, "B")] = (rng.standard_normal((fout, rank), np.float32) * B_STD).astype(np.float32)
    return out


def write_adapter(path: str, cfg: dict, base_path: str, rank: int, seed: int,
                  targets: Sequence[str] = tuple(MODULES)) -> str:
    """A PEFT LoRA folder at `path` (adapter_config.json + adapter_model.safetensors); returns path."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    save_file(adapter_tensors(cfg, rank, seed, targets), os.path.join(path, "adapter_model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(adapter_config(rank, base_path, targets), f, indent=2)
    return path


def ensure_adapters(model: str, model_path: str, n: int, rank: int, root: str | None = None) -> list[str]:
    """Adapter folders 0..n-1 for the model (written once; seed = index); returns their paths."""
    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    base = os.path.join(root or C.bench_cache_root(), "lora")
    paths = []
    for i in range(n):
        path = os.path.join(base, f"{model}-r{rank}-s{i}")
        marker = os.path.join(path, "bench_adapter.json")
        if not os.path.isfile(marker):
            C.log(f"writing the random rank-{rank} adapter {i} for '{model}' to {path} (once) ...")
            write_adapter(path, cfg, model_path, rank, seed=i)
            with open(marker, "w") as f:
                json.dump({"model": model, "rank": rank, "seed": i, "random_weights": True}, f)
        paths.append(path)
    return paths


def adapter_name(i: int) -> str:
    return f"lora{i}"


def request_adapter(side: str, i: int, n_adapters: int) -> str | None:
    """The adapter request i runs under on a side: lora -> adapter i % n, otherwise none."""
    return adapter_name(i % n_adapters) if side == "lora" else None


def digest(ids: Sequence[int]) -> str:
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:12]


# =============================================================================================
# pure helpers (tests/unit/test_bench_lora.py)
# =============================================================================================
def side_value(runs: list[dict], key: str, digits: int = 2) -> tuple[float | None, bool]:
    """(median of `key` over clean rounds when there are any, else over all; from clean rounds)."""
    clean = [r for r in runs if r.get("clean")]
    use = clean or runs
    return C.rnd(C.median(r[key] for r in use if r.get(key) is not None), digits), bool(clean)


def summarize_decode(runs: dict[str, list[dict]]) -> dict:
    """Medians per side and the ratios lora / base, base / base_lora_off, lora / base_lora_off,
    from the rounds of run_pairs; token agreement between sides, round by round."""
    out: dict[str, Any] = {}
    pairs = (("lora", "base"), ("base", "base_lora_off"), ("lora", "base_lora_off"))
    for key in ("decode_tok_s", "full_batch_decode_tok_s", "ms_per_step_p50", "prefill_s"):
        row: dict[str, Any] = {}
        for side in SIDES:
            if side in runs:
                row[side], clean = side_value(runs[side], key, 3)
                row["from_clean_rounds"] = clean
        row["all_rounds"] = {}
        for a, b in pairs:
            if a in runs and b in runs:
                ps = C.paired_summary(runs[a], runs[b], key, 3)
                row[f"ratio_{a}_over_{b}"] = ps["best"]
                row["all_rounds"][f"{a}/{b}"] = ps
        out[key] = row
    for side, rs in runs.items():
        lens = [n for r in rs for n in r.get("tokens_per_row", [])]
        out[f"tokens_per_row_{side}"] = ({"min": min(lens), "median": C.median(lens), "max": max(lens), "rows": len(lens)}
                                         if lens else None)
        out[f"errors_{side}"] = sum(r.get("errors", 0) for r in rs)

    def agree(a: str, b: str) -> dict | None:
        if a not in runs or b not in runs:
            return None
        same = rows = 0
        for ra, rb in zip(runs[a], runs[b]):
            for x, y in zip(ra.get("row_digests") or [], rb.get("row_digests") or []):
                rows += 1
                same += x == y
        return {"rows": rows, "equal": same, "differ": rows - same}
    out["rows_lora_vs_base"] = agree("lora", "base")
    out["rows_base_vs_base_lora_off"] = agree("base", "base_lora_off")
    return out


def summarize_loads(load_s: Sequence[float], host_s: Sequence[float]) -> dict:
    return {"load_ms": C.summarize(list(load_s), 1e3, 2), "host_read_ms": C.summarize(list(host_s), 1e3, 2)}


def kernel_row(T: int, slots: int, rank: int, times_s: dict[str, list[float]], max_abs_diff: float | None = None,
               bank_bytes: int | None = None) -> dict:
    """One shape's figures: median ms per form and the ratios gathered / stacked and LoRA / base."""
    ms = {f: C.rnd(C.median(v) * 1e3, 4) if v else None for f, v in times_s.items()}
    return {"T": T, "slots": slots, "rank": rank, "ms_p50": ms, "n": min((len(v) for v in times_s.values()), default=0),
            "gathered_over_stacked": C.ratio(ms.get("gathered"), ms.get("stacked")),
            "stacked_over_base": C.ratio(ms.get("stacked"), ms.get("base")),
            "gathered_over_base": C.ratio(ms.get("gathered"), ms.get("base")),
            "max_abs_diff": max_abs_diff, "bank_bytes_per_layer": bank_bytes}


def targets(doc: dict) -> dict:
    t: dict[str, Any] = {}
    dec = doc.get("decode") or {}
    dt = (dec.get("summary") or {}).get("decode_tok_s") or {}
    if dt.get("ratio_lora_over_base") is not None or ("lora" in dt and "base" in dt):
        r = dt.get("ratio_lora_over_base")
        t["decode_tok_s_lora_over_base"] = C.target(r if r is not None else C.ratio(dt.get("lora"), dt.get("base")),
                                                    GOAL_RATIO)
    comp = dec.get("compilations")
    if comp:
        t["compilations_after_warmup"] = C.target(comp.get("engine_after_warmup"), 0, higher_is_better=False)
    lc = (doc.get("load") or {}).get("compilations")
    if lc:
        t["compilations_after_loads"] = C.target(lc.get("engine_after_warmup"), 0, higher_is_better=False)
    return t


# =============================================================================================
# the README section
# =============================================================================================
_f, _x, _met, _rows = C.fmt, C.fmt_ratio, C.fmt_met, C.fmt_spread     # README cells (benchmarks/common.py)


def _pct(r: float | None) -> str:
    return "–" if r is None else f"{100 * r:.0f} %"


def render(d: dict, quick: bool) -> list[str]:
    """README lines for benchmarks/results/lora_decode.json: decode with adapters vs base (the 0.8×
    target), adapter load time, and the LoRA term stacked vs gathered."""
    st = d.get("setup") or {}
    n_ad, rank = st.get("adapters", "?"), st.get("rank", "?")
    lines = [f"### Multi-LoRA: decode with {n_ad} adapters in the batch vs the base model, in-process "
             f"({C.cpu_line(d)})", "", C.source_line(NAME, quick, d), ""]
    dec = d.get("decode") or {}
    tg = d.get("targets") or {}
    if dec:
        s = dec.get("summary") or {}
        B, P, N = st.get("batch", "?"), st.get("prompt_len", "?"), st.get("new_tokens", "?")
        lines.append(
            f"Random '{st.get('model', '?')}' Llama ({st.get('dtype', 'float32')}), in-process `Engine`s with the server's "
            f"CPU defaults (token budget {st.get('token_budget', '?')}, prefix cache off): one with LoRA on "
            f"(max_loras {st.get('max_loras', n_ad)}, max_lora_rank {st.get('max_lora_rank', rank)}, {n_ad} PEFT adapters of "
            f"rank {rank} on q/k/v/o/gate/up/down with random non-zero A and B), one with LoRA off. {B} concurrent "
            f"requests, {P}-token random prompts, {N} new tokens, greedy, EOS ignored; with adapters, request i runs under "
            f"adapter i mod {n_ad}. The three sides alternate; medians (clean rounds when there are any). Decode tok/s = "
            "tokens after the last first token / (last first token to last token).")
        dt = s.get("decode_tok_s") or {}
        ratio = dt.get("ratio_lora_over_base")
        if ratio is None:
            ratio = C.ratio(dt.get("lora"), dt.get("base"))
        goal = (tg.get("decode_tok_s_lora_over_base") or {}).get("goal", GOAL_RATIO)
        t = C.target(ratio, goal)
        ps = (dt.get("all_rounds") or {}).get("lora/base") or {}
        clean = f"{ps['clean_rounds']} of {ps['rounds']}" if ps.get("rounds") else "–"
        lines += ["", f"| batch {B}, {P}-token prompts, {N} new tokens | base, LoRA off | base, LoRA on | "
                      f"{n_ad} adapters | adapters / base | target | met | base LoRA on / off | clean rounds |",
                  "|---|---|---|---|---|---|---|---|---|",
                  f"| decode tok/s | {_f(dt.get('base_lora_off'))} | {_f(dt.get('base'))} | {_f(dt.get('lora'))} | "
                  f"{_x(ratio)} | ≥ {goal:g}× | {_met(t)} | {_x(dt.get('ratio_base_over_base_lora_off'))} | {clean} |"]
        fb = s.get("full_batch_decode_tok_s") or {}
        if fb:
            lines.append(f"| decode tok/s while every row decodes | {_f(fb.get('base_lora_off'))} | {_f(fb.get('base'))} | "
                         f"{_f(fb.get('lora'))} | {_x(fb.get('ratio_lora_over_base'))} | – | – | "
                         f"{_x(fb.get('ratio_base_over_base_lora_off'))} | {clean} |")
        sp = s.get("ms_per_step_p50") or {}
        if sp:
            lines.append(f"| ms per step (p50) | {_f(sp.get('base_lora_off'), '{:.2f}')} | {_f(sp.get('base'), '{:.2f}')} | "
                         f"{_f(sp.get('lora'), '{:.2f}')} | {_x(sp.get('ratio_lora_over_base'))} | – | – | "
                         f"{_x(sp.get('ratio_base_over_base_lora_off'))} | {clean} |")
        lines.append(f"| tokens per row, min / median / max | {_rows(s.get('tokens_per_row_base_lora_off'))} | "
                     f"{_rows(s.get('tokens_per_row_base'))} | {_rows(s.get('tokens_per_row_lora'))} | – | – | – | – | {clean} |")
        comp = dec.get("compilations") or {}
        tc = tg.get("compilations_after_warmup") or C.target(comp.get("engine_after_warmup"), 0, higher_is_better=False)
        note = f"Compilations after warmup: {_f(comp.get('engine_after_warmup'), '{}')} (target 0, {_met(tc)}); " \
               f"during the timed rounds {_f(comp.get('during_timing'), '{}')}."
        lb, bb = s.get("rows_lora_vs_base"), s.get("rows_base_vs_base_lora_off")
        if lb:
            note += f" Rows whose greedy tokens differ from the same round's base row: {lb['differ']} of {lb['rows']}"
        if bb:
            note += f"; base rows identical with LoRA on and off: {bb['equal']} of {bb['rows']}"
        lines += ["", note + ("." if lb or bb else "")]
    ld = d.get("load") or {}
    if ld.get("load_ms"):
        lm, hm = ld.get("load_ms") or {}, ld.get("host_read_ms") or {}
        lc = ld.get("compilations") or {}
        tl = tg.get("compilations_after_loads") or C.target(lc.get("engine_after_warmup"), 0, higher_is_better=False)
        size = ld.get("adapter_bytes")
        lines += ["", (f"Adapter load (`Engine.load_adapter_sync`, rank {ld.get('rank', rank)}, 7 modules, "
                       f"{_f(size / 2 ** 20 if size else None, '{:.1f}')} MiB of safetensors, into a free slot of the idle "
                       f"engine; files in the page cache): p50 {_f(lm.get('p50'), '{:.1f}')} ms, max "
                       f"{_f(lm.get('max'), '{:.1f}')} ms (n {_f(lm.get('n'), '{}')}; the first load, "
                       f"{_f(ld.get('first_load_ms'), '{:.1f}')} ms, not counted); of which reading, checking and laying "
                       f"it out on the host: p50 {_f(hm.get('p50'), '{:.1f}')} ms. Compilations after the loads: "
                       f"{_f(lc.get('engine_after_warmup'), '{}')} (target 0, {_met(tl)}).")]
    kr = d.get("kernels") or {}
    rows = kr.get("rows") or []
    if rows:
        lines += ["", (f"The LoRA term of one layer's four matrices (qkv, o, gate_up, down) at '{kr.get('model', '?')}' "
                       f"shapes, {kr.get('dtype', 'float32')}, jitted, median of {kr.get('reps', '?')} calls: **stacked** "
                       "(the engine's form: every slot's A in one GEMM, masked by the token's one-hot slot, then B) vs "
                       "**gathered** (each token's own A and B gathered, then a batched matmul); every token under an "
                       "adapter. Base = the layer's four base matmuls as XLA einsums at the same T."), "",
                  "| tokens T | slots | max rank | base ms | stacked ms | gathered ms | gathered / stacked | "
                  "stacked / base | gathered / base |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            ms = r.get("ms_p50") or {}
            lines.append(f"| {r.get('T')} | {r.get('slots')} | {r.get('rank')} | {_f(ms.get('base'), '{:.3f}')} | "
                         f"{_f(ms.get('stacked'), '{:.3f}')} | {_f(ms.get('gathered'), '{:.3f}')} | "
                         f"{_f(r.get('gathered_over_stacked'), '{:.2f}×')} | {_pct(r.get('stacked_over_base'))} | "
                         f"{_pct(r.get('gathered_over_base'))} |")
    return lines + [""]


# =============================================================================================
# decode
# =============================================================================================
async def run_requests(engine, prompts: list[list[int]], new_tokens: int,
                       adapters: Sequence[str | None]) -> tuple[float, list[dict]]:
    """Submit every prompt at once, greedy, ignoring EOS; request i under adapters[i]."""
    from jax_engine.types import GenerateRequest, SamplingParams

    async def one(i: int, p: list[int]) -> dict:
        events: list[tuple[float, int]] = []
        ids: list[int] = []
        reason = error = None
        params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
        req = GenerateRequest(request_id="", prompt_ids=list(p), params=params, adapter=adapters[i])
        async for out in engine.generate(req):
            if out.new_token_ids:
                events.append((time.perf_counter(), len(out.new_token_ids)))
                ids += out.new_token_ids
            if out.finished:
                reason, error = out.finish_reason, out.error
        return {"events": events, "ids": ids, "finish_reason": reason, "error": error}

    t0 = time.perf_counter()
    reqs = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    return t0, list(reqs)


class Bench:
    """The two engines (LoRA on, with the adapters loaded; LoRA off) and one event loop."""

    def __init__(self, path: str, batch: int, max_model_len: int, adapters: list[str], rank: int,
                 with_off: bool = True) -> None:
        from jax_engine.config import ModelSpec

        common = dict(max_running_requests=batch, max_model_len=max_model_len, page_size=16, enable_prefix_cache=False)
        self.n_adapters = len(adapters)
        C.log(f"loading + warming the LoRA-on engine ({len(adapters)} adapters, max rank {rank}) ...")
        self.lora, self.lora_load_s = C.build_engine(
            [ModelSpec(name=MODEL_NAME, path=path)], progress=False, enable_lora=True, max_loras=len(adapters),
            max_lora_rank=rank, loras=[(adapter_name(i), p) for i, p in enumerate(adapters)], **common)
        self.off, self.off_load_s = None, None
        if with_off:
            C.log("loading + warming the LoRA-off engine ...")
            self.off, self.off_load_s = C.build_engine([ModelSpec(name=MODEL_NAME, path=path)], progress=False, **common)
        self.loop = asyncio.new_event_loop()

    def engine_for(self, side: str):
        return self.off if side == "base_lora_off" else self.lora

    def round(self, side: str, prompts: list[list[int]], new_tokens: int) -> dict:
        from benchmarks.constrained_decode import decode_metrics

        adapters = [request_adapter(side, i, self.n_adapters) for i in range(len(prompts))]
        with C.cpu_window() as w:
            t0, reqs = self.loop.run_until_complete(run_requests(self.engine_for(side), prompts, new_tokens, adapters))
        res = decode_metrics(t0, reqs, new_tokens)
        res.pop("window", None)
        res["row_digests"] = [digest(r["ids"]) for r in reqs]
        res["adapters"] = adapters
        errs = sorted({str(r["error"]) for r in reqs if r.get("error")})
        if errs:
            res["error_samples"] = errs[:3]
        res["cpu"] = w.result
        res["headline"] = (f"decode {_f(res.get('decode_tok_s'))} tok/s, step {_f(res.get('ms_per_step_p50'), '{:.1f}')} ms, "
                           f"tokens/row {res['tokens_per_row_min']}-{res['tokens_per_row_max']}")
        return res

    def compilations(self) -> dict:
        out = {"lora_on": C.compile_counts(self.lora)}
        if self.off is not None:
            out["lora_off"] = C.compile_counts(self.off)
        return out

    def close(self) -> None:
        for e in (self.lora, self.off):
            if e is not None:
                e.shutdown()
        self.loop.close()


def _after_warmup(counts: dict) -> int:
    return sum(v["engine_after_warmup"] for v in counts.values())


def measure_decode(bench: Bench, vocab: int, a) -> dict:
    from benchmarks import generate_vs_hf as G

    B, P, N = a.batch, a.prompt_len, a.new_tokens
    runner = bench.lora.worker(MODEL_NAME).replicas[0].runner
    sides = [s for s in SIDES if s != "base_lora_off" or bench.off is not None]
    t0 = time.perf_counter()
    warm = {s: bench.round(s, G.make_prompts(B, P, vocab, 990 + k), min(8, N)) for k, s in enumerate(sides)}
    warm_s = time.perf_counter() - t0
    before = bench.compilations()
    prompts_for = G.round_prompts(B, {"prompt_len": P}, vocab, 5000)
    runs = C.run_pairs({s: (lambda s=s: bench.round(s, prompts_for(s), N)) for s in sides}, a.rounds, a.retries,
                       label=f"b{B}", quiet_s=a.quiet_s)
    after = bench.compilations()
    return {"engine_load_and_warmup_s": {"lora_on": C.rnd(bench.lora_load_s, 1), "lora_off": C.rnd(bench.off_load_s, 1)},
            "warmup_rounds_s": C.rnd(warm_s, 1),
            "warmup_rounds": {k: {kk: v.get(kk) for kk in ("tokens_per_row_max", "finish_reasons", "errors")}
                              for k, v in warm.items()},
            "runner": {"max_tokens": getattr(runner, "max_tokens", None),
                       "num_pages": getattr(getattr(runner, "rc", None), "num_pages", None)},
            "compilations": {"engine_after_warmup": _after_warmup(after),
                             "during_timing": _after_warmup(after) - _after_warmup(before),
                             "per_engine": after,
                             "jax_during_timing": after["lora_on"]["jax_process_total"] - before["lora_on"]["jax_process_total"]},
            "rounds": runs, "summary": summarize_decode(runs)}


# =============================================================================================
# adapter load
# =============================================================================================
def measure_load(bench: Bench, path: str, n: int, rank: int) -> dict:
    """Free a slot, then load + unload `path` 1 + n times on the idle LoRA-on engine."""
    import numpy as np

    from jax_engine.lora.adapter import load_adapter

    eng, loop = bench.lora, bench.loop
    worker = eng.worker(MODEL_NAME)
    freed = adapter_name(bench.n_adapters - 1)
    loop.run_until_complete(eng.unload_adapter(freed))
    before = C.compile_counts(eng)
    times: list[float] = []
    with C.cpu_window() as w:
        for k in range(n + 1):
            name = f"load{k}"
            t = time.perf_counter()
            info = eng.load_adapter_sync(name, path)
            times.append(time.perf_counter() - t)
            loop.run_until_complete(eng.unload_adapter(name))
        host: list[float] = []
        for _ in range(n):
            t = time.perf_counter()
            load_adapter("x", path, worker.cfg, worker.args.max_lora_rank, np.dtype(worker.dtype))
            host.append(time.perf_counter() - t)
    after = C.compile_counts(eng)
    out = {"rank": info.rank, "target_modules": list(info.target_modules), "path": path,
           "adapter_bytes": os.path.getsize(os.path.join(path, "adapter_model.safetensors")),
           "first_load_ms": C.rnd(times[0] * 1e3, 2), "loads_ms": [C.rnd(x * 1e3, 2) for x in times],
           **summarize_loads(times[1:], host), "freed_slot_of": freed,
           "compilations": {"engine_after_warmup": after["engine_after_warmup"],
                            "during_loads": after["engine_after_warmup"] - before["engine_after_warmup"],
                            "jax_during_loads": after["jax_process_total"] - before["jax_process_total"]},
           "cpu": w.result}
    C.log(f"adapter load p50 {out['load_ms'].get('p50')} ms (host read {out['host_read_ms'].get('p50')} ms), "
          f"compilations {out['compilations']['during_loads']}")
    return out


# =============================================================================================
# the LoRA term: stacked (the engine's) vs gathered
# =============================================================================================
def gathered_terms(h, a, act, lb: dict, slot, group: int):
    """Each token's own slot's A and B gathered (A: [in, T, R], B: [T, R, out]), then batched
    matmuls; slot 0 (the base model) adds nothing. Same outputs as models/lora.py's four terms.
    `lb` is one layer's bank slice (jax_engine/lora/bank.py: the slot axis before R in an A,
    first in a B)."""
    import jax.numpy as jnp

    idx = jnp.maximum(slot - 1, 0)
    on = (slot > 0).astype(h.dtype)
    f32 = jnp.float32

    def xa_of(spec, x, arr):
        xa = jnp.einsum(spec, x, jnp.take(arr, idx, axis=arr.ndim - 2), preferred_element_type=f32)
        return (xa * on.reshape((-1,) + (1,) * (xa.ndim - 1))).astype(x.dtype)

    def b_of(spec, xa, arr):
        return jnp.einsum(spec, xa, arr[idx], preferred_element_type=f32)

    xa = xa_of("th,hctr->tcr", h, lb["qkv_a"])                                # [T, 3, R]
    q = b_of("tr,trkgd->tkgd", xa[:, 0], lb["q_b"])
    k, v = b_of("tr,trkd->tkd", xa[:, 1], lb["k_b"]), b_of("tr,trkd->tkd", xa[:, 2], lb["v_b"])
    qkv = jnp.concatenate([q, k[:, :, None], v[:, :, None]], axis=2)
    o = b_of("tr,trh->th", xa_of("tkgd,kgdtr->tr", a, lb["o_a"]), lb["o_b"])
    xg = xa_of("th,hctr->tcr", h, lb["gu_a"])
    gu = jnp.stack([b_of("tr,tri->ti", xg[:, 0], lb["gate_b"]), b_of("tr,tri->ti", xg[:, 1], lb["up_b"])], axis=1)
    down = b_of("tr,trh->th", xa_of("ti,itr->tr", act, lb["down_a"]), lb["down_b"])
    return qkv, o, gu, down


def stacked_terms(h, a, act, lb: dict, slot, group: int):
    """The engine's LoRA term for the four matrices (jax_engine/models/lora.py)."""
    from jax_engine.models import lora as L

    slots, rank = lb["down_a"].shape[-2:]
    m = L.token_mask(slot, slots, rank, h.dtype)
    return (L.qkv_delta(h, lb, m), L.o_delta(a, lb, m), L.gate_up_delta(h, lb, m), L.down_delta(act, lb, m))


def base_matmuls(h, a, act, w: dict):
    """The layer's four base matmuls as the XLA path runs them (models/llama.linear, SPECS)."""
    from jax_engine.models.llama import SPECS, linear

    return (linear(h[None], w["qkv"], SPECS["qkv"]), linear(a[None], w["o"], SPECS["o"]),
            linear(h[None], w["gate_up"], SPECS["gate_up"]), linear(act[None], w["down"], SPECS["down"]))


def kernel_inputs(cfg, T: int, slots: int, rank: int, seed: int = 0) -> dict:
    """Random activations, one layer's bank slice [S, ...] and base weights at the config's shapes."""
    import jax.numpy as jnp
    import numpy as np

    from jax_engine.lora.bank import bank_shapes

    rng = np.random.default_rng(seed)
    H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    kvh = cfg.num_kv_heads * cfg.kv_repeat
    G = cfg.num_heads // kvh

    def rand(*shape, scale=1.0):
        return jnp.asarray((rng.standard_normal(shape, np.float32) * scale).astype(np.float32))

    lb = {k: rand(*s[1:], scale=0.05) for k, s in bank_shapes(cfg, slots, rank).items()}   # one layer
    w = {"qkv": rand(H, kvh, G + 2, D, scale=0.02), "o": rand(kvh, G, D, H, scale=0.02),
         "gate_up": rand(H, 2, I, scale=0.02), "down": rand(I, H, scale=0.02)}
    return {"h": rand(T, H), "a": rand(T, kvh, G, D), "act": rand(T, I), "lb": lb, "w": w,
            "slot": jnp.asarray((np.arange(T) % slots + 1).astype(np.int32)), "group": G,
            "bank_bytes": int(sum(v.nbytes for v in lb.values()))}


def time_kernels(cfg, T: int, slots: int, rank: int, reps: int) -> dict:
    import functools

    import jax
    import numpy as np

    x = kernel_inputs(cfg, T, slots, rank)
    G = x["group"]
    fns = {"base": (jax.jit(base_matmuls), (x["h"], x["a"], x["act"], x["w"])),
           "stacked": (jax.jit(functools.partial(stacked_terms, group=G)), (x["h"], x["a"], x["act"], x["lb"], x["slot"])),
           "gathered": (jax.jit(functools.partial(gathered_terms, group=G)), (x["h"], x["a"], x["act"], x["lb"], x["slot"]))}
    outs = {}
    for form, (fn, args) in fns.items():
        for _ in range(3):
            outs[form] = jax.block_until_ready(fn(*args))
    diff = max(float(np.abs(np.asarray(s) - np.asarray(g)).max()) for s, g in zip(outs["stacked"], outs["gathered"]))
    times: dict[str, list[float]] = {f: [] for f in KERNEL_FORMS}
    for _ in range(reps):
        for form in KERNEL_FORMS:                       # in turn, so a disturbance hits every form
            fn, args = fns[form]
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[form].append(time.perf_counter() - t)
    return kernel_row(T, slots, rank, times, C.rnd(diff, 7), x["bank_bytes"])


def measure_kernels(path: str, model: str, reps: int) -> dict:
    from jax_engine.models.llama import LlamaConfig

    with open(os.path.join(path, "config.json")) as f:
        cfg = LlamaConfig.from_hf(json.load(f))
    rows = []
    with C.cpu_window() as w:
        for T in KERNEL_TOKENS:
            for S in KERNEL_SLOTS:
                for R in KERNEL_RANKS:
                    r = time_kernels(cfg, T, S, R, reps)
                    ms = r["ms_p50"]
                    C.log(f"LoRA term T {T} S {S} R {R}: base {ms['base']} ms, stacked {ms['stacked']} ms, "
                          f"gathered {ms['gathered']} ms (gathered/stacked {r['gathered_over_stacked']}, "
                          f"max abs diff {r['max_abs_diff']})")
                    rows.append(r)
    return {"model": model, "dtype": "float32", "reps": reps, "warmup_calls": 3,
            "shapes": {"hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size, "heads": cfg.num_heads,
                       "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim},
            "rows": rows, "cpu": w.result}


# =============================================================================================
# driver
# =============================================================================================
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from benchmarks import generate_vs_hf as G

    ap = argparse.ArgumentParser(prog="python -m benchmarks.lora_decode", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny, batch 4, short rounds (smoke test)")
    ap.add_argument("--model", choices=list(G.MODELS), default=None, help="default small; quick: tiny")
    ap.add_argument("--model-dir", default=None, help="where the random model and adapters are cached")
    ap.add_argument("--batch", type=int, default=None, help="concurrent requests (default 16; quick 4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128; quick 32")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128; quick 32")
    ap.add_argument("--adapters", type=int, default=4, help="adapters in the batch = max_loras (default 4)")
    ap.add_argument("--rank", type=int, default=16, help="adapter rank = max_lora_rank (default 16)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per side (default 3; quick 2)")
    ap.add_argument("--retries", type=int, default=None, help="extra rounds when one was disturbed (default 2; quick 0)")
    ap.add_argument("--loads", type=int, default=None, help="timed adapter loads (default 5; quick 3)")
    ap.add_argument("--kernel-reps", type=int, default=None, help="calls per form and shape (default 50; quick 10)")
    ap.add_argument("--no-lora-off", action="store_true", help="skip the LoRA-off engine (side base_lora_off)")
    ap.add_argument("--phases", default=",".join(PHASES), help="decode,load,kernels (default all)")
    ap.add_argument("--quiet-wait", type=float, default=None,
                    help="seconds to wait before each round for other processes to go quiet (default 60; quick 0)")
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    q = a.quick
    a.model = a.model or ("tiny" if q else "small")
    a.batch = a.batch or (4 if q else 16)
    a.prompt_len = a.prompt_len or (32 if q else 128)
    a.new_tokens = a.new_tokens or (32 if q else 128)
    a.rounds = a.rounds or (2 if q else 3)
    a.retries = a.retries if a.retries is not None else (0 if q else 2)
    a.loads = a.loads or (3 if q else 5)
    a.kernel_reps = a.kernel_reps or (10 if q else 50)
    a.quiet_s = C.quiet_seconds(a)
    a.phases = [p.strip() for p in a.phases.split(",") if p.strip()]
    bad = [p for p in a.phases if p not in PHASES]
    if bad:
        ap.error(f"unknown phase(s) {', '.join(bad)}; expected {', '.join(PHASES)}")
    if a.adapters < 1 or a.rank < 1:
        ap.error("--adapters and --rank must be >= 1")
    return a


def main(argv: Sequence[str] | None = None) -> dict:
    C.engine_process()
    from benchmarks import generate_vs_hf as G

    a = parse_args(argv)
    doc = C.header(NAME, a.quick, sys.argv[1:] if argv is None else argv)
    doc["quiet_wait"] = C.wait_for_quiet(0 if a.quick else 60)
    total = C.CpuWindow().start()
    path = G.ensure_model(a.model, a.model_dir)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    engine_phases = [p for p in a.phases if p in ("decode", "load")]
    # adapters 0..n-1 go into the batch; adapter n is the one the load phase loads
    paths = ensure_adapters(a.model, path, a.adapters + 1, a.rank, a.model_dir) if engine_phases else []
    B, P, N = a.batch, a.prompt_len, a.new_tokens
    max_model_len = max(128 if a.quick else 512, 2 ** (P + N - 1).bit_length())
    doc["setup"] = {"model": a.model, "model_dir": path, "vocab_size": cfg["vocab_size"], "dtype": "float32",
                    "config": {k: cfg[k] for k in G.MODELS[a.model]},
                    "batch": B, "prompt_len": P, "new_tokens": N, "adapters": a.adapters, "rank": a.rank,
                    "max_loras": a.adapters, "max_lora_rank": a.rank, "rounds": a.rounds, "retries": a.retries,
                    "loads": a.loads, "kernel_reps": a.kernel_reps, "phases": a.phases,
                    "adapter_paths": paths, "adapter_init": f"A ~ N(0, 1/in), B ~ N(0, {B_STD}^2), "
                                                            f"lora_alpha {LORA_ALPHA_PER_RANK:g} r, all 7 modules",
                    "sampling": "greedy (temperature 0), max_new_tokens = new_tokens, ignore_eos",
                    "sides": {"base": "no adapter, LoRA-on engine", "lora": f"request i under adapter i % {a.adapters}",
                              "base_lora_off": "no adapter, LoRA-off engine"},
                    "engine_args": {"max_running_requests": B, "page_size": 16, "enable_prefix_cache": False,
                                    "max_model_len": max_model_len, "enable_lora": True, "max_loras": a.adapters,
                                    "max_lora_rank": a.rank, "max_num_batched_tokens": "server default",
                                    "compile_cache_dir": "server default"}}
    if engine_phases:
        bench = Bench(path, B, max_model_len, paths[:a.adapters], a.rank,
                      with_off="decode" in a.phases and not a.no_lora_off)
        try:
            if "decode" in a.phases:
                doc["decode"] = measure_decode(bench, cfg["vocab_size"], a)
                doc["setup"]["token_budget"] = doc["decode"]["runner"]["max_tokens"]
            if "load" in a.phases:
                C.log(f"adapter load time ({a.loads} loads) ...")
                doc["load"] = measure_load(bench, paths[a.adapters], a.loads, a.rank)
        finally:
            bench.close()
    if "kernels" in a.phases:
        C.log(f"LoRA term, stacked vs gathered ({a.kernel_reps} calls per form and shape) ...")
        doc["kernels"] = measure_kernels(path, a.model, a.kernel_reps)
    doc["process_isolation"] = {"engine": C.isolation_report(C.ENGINE_BLOCKED)}
    doc["cpu"] = total.stop()
    doc["busy_processes_at_end"] = C.busy_processes()
    doc["targets"] = targets(doc)
    s = (doc.get("decode") or {}).get("summary") or {}
    if s:
        dt = s["decode_tok_s"]
        C.log(f"decode tok/s base (LoRA off) {dt.get('base_lora_off')}, base {dt.get('base')}, "
              f"{a.adapters} adapters {dt.get('lora')}, ratio {dt.get('ratio_lora_over_base')} (target {GOAL_RATIO})")
    return C.finish(doc, NAME, a.quick)


if __name__ == "__main__":
    main()
