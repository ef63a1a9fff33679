"""Run every benchmark and report, then regenerate the README's Performance section from the results.

  python -m benchmarks [--quick] [--only embed_vs_st,generate_vs_hf,...] [--readme-only]
  xlaserve bench       (the same)

Each job runs in its own process (a clean JAX state and compile counter; the torch peers run
in their own processes below that) and writes benchmarks/results/<name>.json and its PNGs.
Then the section between `<!-- perf:begin -->` and `<!-- perf:end -->` in README.md is
rewritten from those files only: start time, parity with transformers, the test suite, the
peer comparisons (transformers, sentence-transformers, and where the `bench` extra's libraries
are installed llama.cpp and ONNX Runtime, each ratio with the peer's dtype or GGUF type),
serving, the ragged step engine against the split engine it replaced, multi-LoRA decode, the
decode profile.
Every table names the results file it came from and the host it was measured on; nothing in
it is typed in. Nothing else in README.md is touched. Without the markers, or in --quick mode
(smoke numbers do not belong in the README), the section is printed instead, and always saved
as benchmarks/results/performance.md (performance_quick.md).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C
from benchmarks.constrained_decode import render as sec_constrained_decode
from benchmarks.lora_decode import render as sec_lora_decode
from benchmarks.moe_dispatch import render as sec_moe_dispatch
from benchmarks.moe_vs_hf import render as sec_moe_vs_hf
from benchmarks.spec_decode import render as sec_spec_decode
from benchmarks.spec_decode import render_small as sec_spec_decode_small

# job -> (module, extra args (quick), extra args (full), results file name (quick), (full))
JOBS: dict[str, tuple[str, list[str], list[str], str, str]] = {
    "embed_vs_st": ("embed_vs_st", [], [], "embed_vs_st", "embed_vs_st"),
    "generate_vs_hf": ("generate_vs_hf", [], [], "generate_vs_hf", "generate_vs_hf"),
    "serve_load": ("serve_load", [], [], "serve_load", "serve_load"),
    "ragged_step": ("ragged_step", [], [], "ragged_step", "ragged_step"),
    "grammar_mask": ("grammar_mask", [], [], "grammar_mask", "grammar_mask"),
    "constrained_decode": ("constrained_decode", [], [], "constrained_decode", "constrained_decode"),
    "lora_decode": ("lora_decode", [], [], "lora_decode", "lora_decode"),
    "spec_decode": ("spec_decode", [], [], "spec_decode", "spec_decode"),
    "spec_decode_small": ("spec_decode", ["--model", "small"], ["--model", "small"], "spec_decode_small_quick",
                          "spec_decode_small"),
    "moe_vs_hf": ("moe_vs_hf", [], [], "moe_vs_hf", "moe_vs_hf"),
    "moe_dispatch": ("moe_dispatch", [], [], "moe_dispatch", "moe_dispatch"),
    "profile_decode": ("profile_decode", [], [], "profile_decode", "profile_decode"),
    "profile_decode_batch": ("profile_decode", ["--batch", "4"], ["--batch", "16"],
                             "profile_decode_b4", "profile_decode_b16"),
    "start_time": ("start_time", [], [], "start_time", "start_time"),
    "parity": ("parity_report", [], [], "parity", "parity"),
    "tests": ("test_report", [], [], "tests", "tests"),
}
BENCHMARKS = list(JOBS)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- perf:begin -->", "<!-- perf:end -->"


def result_name(job: str, quick: bool) -> str:
    return JOBS[job][3] if quick else JOBS[job][4]


def run_one(job: str, quick: bool) -> dict:
    module, quick_args, full_args, _, _ = JOBS[job]
    cmd = [sys.executable, "-m", f"benchmarks.{module}"] + (["--quick"] + quick_args if quick else full_args)
    C.log(f"=== {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, check=False)   # stderr streams through
    out: dict[str, Any] = {"exit_code": p.returncode, "seconds": round(time.perf_counter() - t0, 1)}
    lines = [ln for ln in p.stdout.splitlines() if ln.strip().startswith("{")]
    if lines:
        try:
            doc = json.loads(lines[-1])
            out["targets"] = doc.get("targets")
            out["disturbed"] = (doc.get("cpu") or {}).get("disturbed")
        except json.JSONDecodeError:
            out["error"] = "unparseable output"
    return out


# =============================================================================================
# formatting helpers
# =============================================================================================
def _load(name: str, quick: bool) -> dict | None:
    path = C.result_path(name, quick)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


_f, _x, _met = C.fmt, C.fmt_ratio, C.fmt_met     # README cells (benchmarks/common.py)


def _ok(v: Any) -> str:
    return "–" if v is None else ("✅" if v else "❌")


_cpu, _src = C.cpu_line, C.source_line    # the heading's cpu share and the line under it (common.py)


def _plots(doc: dict) -> list[str]:
    return [f"![{os.path.basename(x)}]({x})" for x in doc.get("plots", [])]


# =============================================================================================
# one renderer per results file
# =============================================================================================
def sec_start_time(d: dict, quick: bool) -> list[str]:
    lines = [f"### Start time: `xlaserve serve` (default models) to a 200 from /ready ({_cpu(d)})", "",
             _src("start_time", quick, d), "",
             "| start | seconds to /ready (median) | runs | programs compiled at warmup | cache after |",
             "|---|---|---|---|---|"]
    for kind, what in (("cold", "cold: empty cache (fresh XDG_CACHE_HOME)"), ("warm", "warm: the cache the cold start filled")):
        s, runs = d.get(kind) or {}, (d.get("runs") or {}).get(kind) or []
        progs = ", ".join(f"{m} {v['programs']}" for m, v in (s.get("programs") or {}).items()) or "–"
        size = runs[-1]["cache_bytes_after"] / 2 ** 20 if runs else None
        failed = f" ({s['failed_runs']} failed: {next(r['error'] for r in runs if r.get('error'))})" \
            if s.get("failed_runs") else ""
        lines.append(f"| {what} | {_f(s.get('ready_s'))} | {', '.join(_f(x) for x in s.get('runs_s', []))}{failed} | "
                     f"{progs} | {_f(size, '{:.0f} MiB')} |")
    torch_note = "torch unimportable in the server (not an xlaserve dependency)" \
        if d["setup"].get("server_torch_blocked") else "torch importable in the server"
    return lines + ["", f"Measured from process spawn; {torch_note}.", ""]


def sec_parity(d: dict, quick: bool) -> list[str]:
    lines = ["### Parity with transformers (CPU, float32 unless noted)", "", _src("parity", quick, d), "",
             "| check | result | bound (asserted by the tests) | within |", "|---|---|---|---|"]
    for fam, r in d.get("decoders", {}).items():
        lines.append(f"| decoder `{fam}` ({r['matmul']} matmul, {r['attention_backend']} attention): prefill logits, "
                     f"prompts of {', '.join(map(str, r['prompt_lengths']))} tokens; {r['greedy_tokens']} greedy tokens "
                     f"of {r['greedy_sequences']} prompts decoded together | max abs {r['max_abs_logit_error']:.1e}; "
                     f"{r['greedy_sequences_equal']} of {r['greedy_sequences']} sequences identical to `generate` | "
                     f"≤ {r['bound']:g}; all identical | {_ok(r['ok'])} |")
    m = d.get("minilm")
    if m:
        lines.append(f"| all-MiniLM-L6-v2 vs sentence-transformers, {m['sentences']} texts (one truncated) | "
                     f"min cosine {m['min_cosine']:.8f}, max abs {m['max_abs']:.1e} | cosine ≥ "
                     f"{m['bound']['min_cosine']}, max abs < {m['bound']['max_abs']:g} | {_ok(m['ok'])} |")
    for name, e in (d.get("encoders") or {}).items():
        lines.append(f"| tiny random {name.replace('_', ' ')} vs transformers | max abs {e['max_abs']:.1e} | "
                     f"≤ {e['bound']:g} | {_ok(e['ok'])} |")
    for dtype, c in (d.get("converted") or {}).items():
        res = (f"max abs vs the HF folder {c['max_abs_vs_hf_folder']:.1e}" if "max_abs_vs_hf_folder" in c
               else f"max abs logit error vs transformers float32 {c['max_abs_vs_transformers']:.1e}")
        bound = c["bound"] if isinstance(c["bound"], str) else f"< {c['bound']:g}"
        lines.append(f"| `xlaserve convert` checkpoint, {dtype} | {res} | {bound} | {_ok(c['ok'])} |")
    for key, t in (d.get("tensor_parallel") or {}).items():
        if isinstance(t, dict):
            tp, rep = key.split("x")
            ok = t["max_abs_vs_tp1"] <= t["bound"] and t["greedy_equal_to_tp1"]
            lines.append(f"| TP {tp} × {rep} replica(s) on 4 forced host devices vs TP 1 | max abs "
                         f"{t['max_abs_vs_tp1']:.1e}; greedy tokens {'identical' if t['greedy_equal_to_tp1'] else 'DIFFER'}"
                         f" | ≤ {t['bound']:g}; identical | {_ok(ok)} |")
        else:
            lines.append(f"| tensor parallel ({key}) | error: {str(t)[:120]} | | ❌ |")
    return lines + [""]


def sec_tests(d: dict, quick: bool) -> list[str]:
    c = d.get("counts") or {}
    parts = [f"{c[k]} {k}" for k in ("passed", "failed", "errors", "skipped", "xfailed", "xpassed") if c.get(k)]
    commit = (d.get("git") or {}).get("commit") or "?"
    dirty = " with local changes" if (d.get("git") or {}).get("dirty") else ""
    return ["### Tests", "", _src("tests", quick, d), "",
            (f"`{d['setup']['command'].strip()}` ({d['setup']['cache']}): **{', '.join(parts) or 'no summary'}** "
            f"in {_f(d.get('wall_s'), '{:.0f}')} s wall ({_f((d.get('wall_s') or 0) / 60)} min; {_cpu(d)}), "
            f"commit `{commit[:10]}`{dirty}."), ""]


def ort_note(e: dict) -> str:
    """One sentence on the ONNX Runtime peer of an embed_vs_st result (or why it is absent)."""
    o = e["setup"].get("onnxruntime")
    if not o:
        return ""
    if "skipped" in o:
        return f"ONNX Runtime: not measured ({o['skipped']})."
    fused = ", ".join(f"{k} {v}" for k, v in ((o.get("export") or {}).get("fused_operators") or {}).items())
    chk = e.get("correctness_onnxruntime") or {}
    return (f"ONNX Runtime {o.get('onnxruntime', '?')} ({o.get('dtype', 'float32')}, own process, "
            f"{o.get('intra_op_threads', '?')} intra-op threads): torch.onnx.export, then onnxruntime's transformer "
            f"optimizer at O2 ({fused or 'fusions not recorded'}); {o.get('how', '')}; embeddings vs "
            f"sentence-transformers: min cosine {_f(chk.get('min_cosine'), '{:.7f}')} ({_ok(chk.get('ok'))}).")


def sec_embed(e: dict, quick: bool, name: str = "embed_vs_st") -> list[str]:
    r, t = e["results"], e.get("targets", {})
    how = e["setup"].get("how") or {}
    sizes = e["setup"]["batch_sizes"]
    has_ort = any("ort_sentences_per_s" in r.get(f"batch_{B}", {}) for B in sizes)
    title = "sentence-transformers and ONNX Runtime" if has_ort else "sentence-transformers"
    tag = "" if name == "embed_vs_st" else f" (`{name}`)"
    lines = [f"### Embeddings{tag}: all-MiniLM-L6-v2 vs {title} ({_cpu(e)})", "", _src(name, quick, e),
             "", (f"xlaserve: {how.get('xlaserve', '?')}; sentence-transformers: {how.get('sentence_transformers', '?')}; "
             f"batch 1: {how.get('batch_1', '?')}. {e['setup']['corpus_sentences']} sentences, "
             f"{e['setup']['tokens_per_sentence_mean']} tokens each on average. {ort_note(e)}").rstrip(), ""]
    if has_ort:
        lines += [("| batch | xlaserve sentences/s | ONNX Runtime | peer dtype | ratio | target | met | "
                   "sentence-transformers | peer dtype | ratio | target | met | clean rounds |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    else:
        lines += ["| batch | xlaserve sentences/s | sentence-transformers | peer dtype | ratio | target | met | clean rounds |",
                  "|---|---|---|---|---|---|---|---|"]
    for B in sizes:
        row = r.get(f"batch_{B}", {})
        tt = t.get(f"sentences_per_s_ratio_b{B}")
        rounds = row.get("all_rounds", {})
        st = (f"{_f(row.get('st_sentences_per_s'))} | {row.get('peer_dtype', e['setup'].get('peer_dtype', '?'))} | "
              f"{_x(row.get('ratio'))} | {'≥ 1.2×' if tt else '–'} | {_met(tt)}")
        if has_ort:
            to = t.get(f"sentences_per_s_ratio_b{B}_vs_onnxruntime")
            ort = (f"{_f(row.get('ort_sentences_per_s'))} | {row.get('ort_dtype', 'float32')} | "
                   f"{_x(row.get('ratio_vs_ort'))} | {'≥ 1.2×' if to else '–'} | {_met(to)}")
            lines.append(f"| {B} | {_f(row.get('xlaserve_sentences_per_s'))} | {ort} | {st} | "
                         f"{rounds.get('clean_rounds')} of {rounds.get('rounds')} |")
        else:
            lines.append(f"| {B} | {_f(row.get('xlaserve_sentences_per_s'))} | {st} | "
                         f"{rounds.get('clean_rounds')} of {rounds.get('rounds')} |")
    b1 = r.get("batch_1")
    if b1:
        lt = t.get("b1_latency_p50_ratio_engine_over_st")
        ort = ""
        if "ort_latency_ms" in b1:
            lo = t.get("b1_latency_p50_ratio_engine_over_onnxruntime")
            ort = (f", ONNX Runtime (float32) {_f(b1['ort_latency_ms'].get('p50'))} / "
                   f"{_f(b1['ort_latency_ms'].get('p99'))} ms (target: p50 no worse; {_met(lo)})")
        lines += ["", (f"Batch-1 latency p50 / p99: xlaserve {_f(b1['xlaserve_latency_ms'].get('p50'))} / "
                      f"{_f(b1['xlaserve_latency_ms'].get('p99'))} ms, sentence-transformers (float32) "
                      f"{_f(b1['st_latency_ms'].get('p50'))} / {_f(b1['st_latency_ms'].get('p99'))} ms "
                      f"(target: no worse; {_met(lt)}){ort}. Compilations after warmup: "
                      f"{e['compilations']['after_timing']['engine_after_warmup']}.")]
    return lines + ["", *_plots(e), ""]


def _gen_row(dtype: str, row: dict, B: int) -> str:
    b = row[f"batch_{B}"]
    x, rl, rv = b["xlaserve"], b["roofline"], b.get("ratios_vs_hf_static", {})
    return (f"| {dtype} | {b.get('peer_dtype', row.get('peer_dtype', '?'))} | {B} | "
            f"{_f((x.get('prefill_s') or 0) * 1e3, '{:.0f}')} | {_f(x.get('decode_tok_s'))} | "
            f"{_f(b.get('hf_static', {}).get('decode_tok_s'))} | {_f(b.get('hf_dynamic', {}).get('decode_tok_s'))} | "
            f"{_x(rv.get('decode_tok_s'))} | {_x(rv.get('prefill_s'))} | "
            f"{_f(rl.get('decode_tok_s'))} ({rl.get('bound', '?')}) | "
            f"{_f(b['roofline_fraction'].get('xlaserve_decode'), '{:.0%}')} | {b.get('clean_rounds')} of {b.get('rounds')} |")


def result_variants(job: str, quick: bool) -> list[str]:
    """Results names of `job`'s runs kept beside its default file (`--results-name`: another host
    class, e.g. generate_vs_hf_avx2), sorted. A name with "_before_" is an earlier run that the
    README's prose cites as a before-figure (e.g. embed_vs_st_avx2_before_encoder_fixes), not a
    table of its own."""
    suffix = "_quick.json" if quick else ".json"
    out = []
    for fn in sorted(os.listdir(C.RESULTS_DIR)):
        if not (fn.startswith(job + "_") and fn.endswith(suffix)) or "_before_" in fn:
            continue
        name = fn[: -len(suffix)]
        if name != job and (quick or not name.endswith("_quick")):
            out.append(name)
    return out


def sec_generate(g: dict, quick: bool, name: str = "generate_vs_hf") -> list[str]:
    s, lim = g["setup"], g.get("limits") or {}
    kv = sorted({r.get("kv_itemsize") for r in g["rows"].values() if isinstance(r, dict) and r.get("kv_itemsize")})
    lc = s.get("llamacpp") or {}
    peers = "llama.cpp and transformers `generate`" if lc and "skipped" not in lc else "transformers `generate`"
    tag = "" if name == "generate_vs_hf" else f" (`{name}`)"
    lines = [(f"### Generation{tag}: random '{s['model']}' Llama ({(s.get('params') or 0) / 1e6:.1f} M parameters) "
             f"vs {peers} ({_cpu(g)})"), "", _src(name, quick, g), "",
             (f"Prompt {s['prompt_len']} tokens, {s['new_tokens']} new tokens forced, greedy; transformers runs in its "
             f"own process in the dtype named in the row. Roofline = min(bandwidth, compute): read bandwidth "
             f"{_f(lim.get('torch_sum_gbps'))} GB/s (best of {lim.get('probes')} probes over "
             f"{lim.get('buffer_gib')} GiB), torch matmul fp32 {_f(lim.get('torch_matmul_fp32_gflops'))} / bf16 "
             f"{_f(lim.get('torch_matmul_bf16_gflops'))} GFLOP/s (bf16 for the bfloat16 row), KV itemsize "
             f"{'/'.join(map(str, kv)) or '?'} bytes (the engine's own KV dtype)."), "",
             ("| engine dtype | peer dtype | batch | prefill ms | decode tok/s | HF static tok/s | HF dynamic tok/s | "
             "decode vs HF static | prefill vs HF static | roofline tok/s (bound) | of roofline | clean rounds |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for dtype, row in g["rows"].items():
        if "error" in row:
            lines.append(f"| {dtype} | – | – | {row['error']} | | | | | | | | |")
            continue
        lines += [_gen_row(dtype, row, B) for B in s["batches"] if f"batch_{B}" in row]
    lines += sec_llamacpp(g)
    lines += ["", "| target | value | goal | met |", "|---|---|---|---|"]
    for k, t in (g.get("targets") or {}).items():
        if isinstance(t, dict):
            lines.append(f"| {k} | {_f(t.get('value'), '{:.3g}')} | {t.get('goal')} | {_met(t)} |")
    if g.get("sampled"):
        lines += ["", ("Sampled decode (engine only, float32; temperature 0.7, top_p 0.9, top_k 50 vs greedy, "
                      "alternating rounds of the same run):"), "",
                  "| model | vocabulary | batch | greedy tok/s | sampled tok/s | sampled / greedy | clean rounds |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in g["sampled"].items():
            ar = r.get("all_rounds", {})
            lines.append(f"| {name} | {r['vocab_size']:,} | {r['batch']} | {_f(r.get('greedy_decode_tok_s'))} | "
                         f"{_f(r.get('sampled_decode_tok_s'))} | {_f(r.get('ratio_sampled_over_greedy'), '{:.2f}')} | "
                         f"{ar.get('clean_rounds')} of {ar.get('rounds')} |")
    return lines + ["", *_plots(g), ""]


def llamacpp_note(lc: dict) -> str:
    """One sentence on the llama.cpp peer of a generate_vs_hf result."""
    ctxs = lc.get("contexts") or {}
    threads = next((c.get("n_threads") for c in ctxs.values()), lc.get("threads"))
    flags = [f.split(" = ")[0].strip() for f in (lc.get("system_info") or "").split("|") if f.strip().endswith("= 1")]
    return (f"llama.cpp: llama-cpp-python {lc.get('llama_cpp_python', '?')} in its own process, {threads} threads, "
            f"built with {' '.join(f for f in flags if f != 'CPU : SSE3') or '?'}; GGUF converted from the same HF "
            f"folder by llama.cpp's convert_hf_to_gguf.py; {lc.get('how', '')}.")


def sec_llamacpp(g: dict) -> list[str]:
    """The llama.cpp rows of a generate_vs_hf result: every engine row against its GGUF type."""
    lc = (g.get("setup") or {}).get("llamacpp")
    if not lc:
        return []
    if "skipped" in lc:
        return ["", f"llama.cpp: not measured ({lc['skipped']})."]
    lines = ["", llamacpp_note(lc), "",
             ("| engine dtype | llama.cpp type | batch | xlaserve decode tok/s | llama.cpp decode tok/s | decode ratio | "
              "xlaserve prefill ms | llama.cpp prefill ms | prefill ratio | goal (decode / prefill) | met | "
              "greedy tokens equal | clean rounds |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    batches = g["setup"]["batches"]
    tg = g.get("targets") or {}
    for dtype, row in g["rows"].items():
        if not isinstance(row, dict) or "error" in row:
            continue
        for B in batches:
            b = row.get(f"batch_{B}") or {}
            lp, r = b.get("llamacpp"), b.get("ratios_vs_llamacpp")
            if not lp or not r:
                continue
            x = b.get("xlaserve", {})
            tag = f"{dtype}_b{B}_vs_llamacpp_{r.get('peer_dtype')}"
            td, tp = tg.get(f"{tag}_decode"), tg.get(f"{tag}_prefill")
            goal = f"≥ {td['goal']:g}× / ≥ {tp['goal']:g}×" if td and tp else "–"
            met = f"{_met(td)} / {_met(tp)}" if td and tp else "–"
            gm = b.get("greedy_match_vs_llamacpp") or {}
            lines.append(f"| {dtype} | {r.get('peer_dtype')} | {B} | {_f(x.get('decode_tok_s'))} | "
                         f"{_f(lp.get('decode_tok_s'))} | {_x(r.get('decode_tok_s'))} | "
                         f"{_f((x.get('prefill_s') or 0) * 1e3, '{:.0f}')} | "
                         f"{_f((lp.get('prefill_s') or 0) * 1e3, '{:.0f}')} | {_x(r.get('prefill_s'))} | {goal} | {met} | "
                         f"{gm.get('first_token_equal', '–')} of {gm.get('sequences', '–')} first tokens | "
                         f"{b.get('clean_rounds')} of {b.get('rounds')} |")
    for dtype, why in (lc.get("failed") or {}).items():
        if (lc.get("models") or {}).get(dtype, {}).get("extra_bufts") is False:
            lines.append(f"\n{dtype}: llama.cpp's peer process crashed on this host with its default CPU weight "
                         f"layouts ({why.split(' (retried')[0]}); its columns are llama.cpp with its extra buffer "
                         "types (repacked / AMX layouts) off, as `--no-extra-bufts`.")
        else:
            lines.append(f"\n{dtype}: no llama.cpp columns, its peer process failed on this host ({why}).")
    return lines


def sec_serve(s: dict, quick: bool) -> list[str]:
    lines = [f"### Serving through `xlaserve serve` ({_cpu(s)})", "", _src("serve_load", quick, s), ""]
    if "embeddings" in s:
        em = s["embeddings"]
        lines.append(f"- Arctic `Encode` over gRPC, batches of {em['batch']} in corpus order: "
                     f"{_f(em['grpc_sentences_per_s'])} sentences/s vs sentence-transformers "
                     f"({em.get('peer_dtype', 'float32')}, own process, whole corpus in one `encode`) "
                     f"{_f(em['st_sentences_per_s'])} → {_x(em['ratio'])} (target ≥ 1.0×, "
                     f"{_met(s['targets'].get('grpc_encode_b32_vs_st'))}).")
    if "streams" in s:
        st = s["streams"]
        key = f"{st['streams']}_streams_grpc_over_engine_decode"
        lines.append(f"- {st['streams']} concurrent SGLang `Generate` streams: {_f(st['decode_tok_s']['grpc'])} tok/s "
                     f"vs the same engine in-process (float32 both) {_f(st['decode_tok_s']['engine_in_process'])} → "
                     f"{_f(st['decode_tok_s']['ratio_grpc_over_engine'], '{:.0%}')} (target ≥ 80 %, "
                     f"{_met(s['targets'].get(key))}); errors {st['errors']}.")
    end = s.get("compiles_after_warmup_end")
    if end is not None:
        lines.append(f"- Server compilations after warmup (/metrics): {end}.")
    if "poisson" in s:
        setup = s.get("setup") or {}
        how = ("the server restarted at its default token budget" if (s.get("server") or {}).get("cmd_poisson")
               else "the server above")
        lines += ["", (f"Poisson arrivals ({how}); prompt lengths {setup.get('prompt_tokens_range')}, "
                       f"outputs {setup.get('output_tokens_range')} tokens, drawn with seed {setup.get('seed')}; "
                       "ITL p99/p50 target ≤ 4× (the ragged-step issue):"), "",
                  ("| protocol | offered req/s, as sent (nominal) | completed req/s | output tok/s | "
                   "TTFT p50 / p99 ms | ITL p50 / p99 ms | ITL p99/p50 | errors | others' CPU share |"),
                  "|---|---|---|---|---|---|---|---|---|"]
        for proto, label in (("grpc", "gRPC SGLang"), ("http", "HTTP OpenAI chat")):
            for m in s["poisson"][proto]:
                nominal = m.get("nominal_rate_rps")
                lines.append(f"| {label} | {_f(m['offered_rate_rps'], '{:.2f}')}"
                             f"{f' ({nominal:g})' if nominal is not None else ''} | "
                             f"{_f(m.get('completed_rps'), '{:.2f}')} | {_f(m.get('output_tok_s'))} | "
                             f"{_f(m['ttft_ms'].get('p50'), '{:.0f}')} / {_f(m['ttft_ms'].get('p99'), '{:.0f}')} | "
                             f"{_f(m['itl_ms'].get('p50'))} / {_f(m['itl_ms'].get('p99'))} | "
                             f"{_spread(m['itl_ms'])} | {m['errors']} | "
                             f"{(m.get('cpu') or {}).get('others_share_of_cores')} |")
    return lines + ["", *_plots(s), ""]


def _spread(itl: dict) -> str:
    """ITL p99 / p50 with its mark against the ragged-step issue's 4x."""
    p50, p99 = itl.get("p50"), itl.get("p99")
    if not p50 or p99 is None:
        return "–"
    r = p99 / p50
    return f"{r:.1f}× {'✅' if r <= 4.0 else '❌'}"


# the ragged step issue's goals, for results files that lack their `targets` (ragged_step.py has the same)
RAGGED_GOALS = {"saturation": 1.3, "ttft": 1.2, "itl_spread": 4.0}


def _goal(d: dict, key: str, default: float) -> float:
    """A target's goal as the results file recorded it, else the issue's."""
    g = ((d.get("targets") or {}).get(key) or {}).get("goal")
    return default if g is None else g


def _pair(summary: dict, key: str) -> tuple[Any, Any, float | None]:
    """(ragged, split, ragged / split) of one pair_table entry; the ratio from the two medians when absent."""
    e = summary.get(key) or {}
    r, s = e.get("ragged"), e.get("split")
    ratio = e.get("ratio_ragged_over_split")
    if ratio is None and isinstance(r, (int, float)) and isinstance(s, (int, float)):
        ratio = C.ratio(r, s)
    return r, s, ratio


def _clean_rounds(summary: dict, rounds: dict | None = None) -> str:
    """'k of n' clean rounds of a compared scenario, from its summary (or its rounds)."""
    for e in summary.values():
        ar = (e or {}).get("all_rounds") if isinstance(e, dict) else None
        if ar and ar.get("rounds") is not None:
            return f"{ar.get('clean_rounds')} of {ar.get('rounds')}"
    runs = list((rounds or {}).get("ragged") or [])
    return f"{sum(1 for x in runs if x.get('clean'))} of {len(runs)}" if runs else "–"


def _tree_line(name: str, t: dict | None, split_commit: str | None) -> str:
    """Which code one side of the ragged step comparison was: its commit and any local engine changes."""
    t = t or {}
    if t.get("error") or not t.get("commit"):
        return f"{name}: {split_commit or '?'} ({t.get('error') or 'commit not recorded'})"
    ch, un = t.get("engine_files_changed") or [], t.get("engine_files_untracked") or []
    local = ""
    if ch or un:
        local = (f" + local changes to {len(ch)} engine file(s)" + (f" and {len(un)} untracked" if un else "")
                 + (f" (`git diff HEAD -- jax_engine` sha1 `{t['engine_diff_sha1']}`)" if t.get("engine_diff_sha1") else ""))
    asked = f" ({split_commit})" if split_commit and name == "split" else ""
    return f"{name}: commit `{t['commit'][:10]}`{asked}{local}"


def _sweep_programs(d: dict, budget: int) -> Any:
    """Ragged step programs compiled at load for one budget of the sweep (its own worker, or the comparison's)."""
    eng = d.get("engines") or {}
    e = eng.get(f"ragged-b{budget}@{budget}") or eng.get(f"ragged@{budget}") or {}
    return (e.get("counts") or {}).get("programs")


def sec_ragged_step(d: dict, quick: bool) -> list[str]:
    """ragged_step: the engine's one ragged step program ("ragged", this tree) against the engine it
    replaced ("split": a prefill program, then a decode+sample program per step), in-process."""
    st = d.get("setup") or {}
    name = result_name("ragged_step", quick)
    trees = st.get("trees") or {}
    lines = [f"### One ragged step program vs the split prefill + decode engine, in-process ({_cpu(d)})", "",
             _src(name, quick, d), ""]
    warm = {"aot": "every program compiled ahead of time", "lazy": "programs compiled on first use"}
    lines.append(
        f"Random '{st.get('model', '?')}' Llama, each engine in its own worker process (`Engine` directly, no server), "
        f"{st.get('prompt_len', '?')}-token prompts, {st.get('new_tokens', '?')} new tokens (greedy, ignore_eos), "
        f"token budget {st.get('budget', '?')}, up to {st.get('max_running', st.get('streams', '?'))} running requests, "
        f"shared persistent compile cache. Measured: "
        + "; ".join(_tree_line(n, trees.get(n), st.get("split_commit") if n == "split" else None)
                    for n in ("ragged", "split"))
        + f". Compile at start: ragged {warm.get(st.get('ragged_warmup'), st.get('ragged_warmup', '?'))}, split "
        f"{warm.get(st.get('split_warmup'), st.get('split_warmup', '?'))}. One untimed warm-up round per engine and "
        f"scenario; timed rounds alternate between the engines, first side rotating; medians (clean rounds when "
        f"there are any). Here ragged / split < 1 is better for times, > 1 for tokens/s.")
    sat = d.get("saturation")
    if sat:
        s = sat.get("summary") or {}
        r, sp, ratio = _pair(s, "completed_tok_s")
        t = C.target(ratio, _goal(d, "saturation_completed_tok_s_ragged_over_split", RAGGED_GOALS["saturation"]))
        clean = _clean_rounds(s, sat.get("rounds"))
        lines += ["", (f"| saturation: {st.get('streams', '?')} concurrent streams | ragged | split | ragged / split | "
                       "target | met | clean rounds |"), "|---|---|---|---|---|---|---|",
                  f"| completed tok/s (all output tokens / first submit to last token) | {_f(r)} | {_f(sp)} | "
                  f"{_x(ratio)} | ≥ {t['goal']:g}× | {_met(t)} | {clean} |"]
        for key, label, scale, fmt in (("decode_tok_s", "steady decode tok/s (every stream decoding)", 1, "{:.1f}"),
                                       ("prefill_s", "all prompts in (first submit to last first token), ms", 1e3,
                                        "{:.0f}"),
                                       ("ms_per_step_p50", "ms per step while decoding (p50)", 1, "{:.2f}")):
            if key in s:
                a, b, q = _pair(s, key)
                a, b = (x * scale if isinstance(x, (int, float)) else x for x in (a, b))
                lines.append(f"| {label} | {_f(a, fmt)} | {_f(b, fmt)} | {_x(q)} | – | – | {clean} |")
        bursts = [x.get("burst_steps") for x in (sat.get("rounds") or {}).get("ragged") or []]
        if any(isinstance(b, int) for b in bursts):
            lines.append(f"| steps at the burst budget (`--burst-batched-tokens`) per round | "
                         f"{', '.join(str(b) for b in bursts)} | – | – | – | – | – |")
        fl = sat.get("compute_floor") or {}
        if fl:
            lines += ["", (f"Compute floor: the workload is {fl['flops'] / 1e12:.2f} TFLOP (every token through every "
                           f"matrix, the LM head per drawn token, attention at each token's context); at torch's fp32 "
                           f"matmul rate on this host, {fl['matmul_gflops']:g} GFLOP/s (one probe in a peer process, "
                           f"this run), no engine completes it faster than {fl['floor_s']:.2f} s = "
                           f"{fl['max_completed_tok_s']:.1f} tok/s. Ragged reaches {fl['ragged_of_floor']:.0%} of that, "
                           f"split {fl['split_of_floor']:.0%}; the {RAGGED_GOALS['saturation']:g}× goal asks "
                           f"{fl['goal_tok_s']:.1f} tok/s = {fl['goal_tok_s'] / fl['max_completed_tok_s']:.0%} of it.")]
    pois = d.get("poisson") or {}
    if pois:
        tt, ti = RAGGED_GOALS["ttft"], RAGGED_GOALS["itl_spread"]
        lines += ["", (f"Poisson arrivals ({st.get('requests', '?')} requests per run, the same arrival times and "
                       "prompts for both engines): TTFT = submit to first token, ITL = gaps between one request's "
                       "consecutive tokens."), "",
                  ("| offered req/s, as sent (nominal) | TTFT p50 ms, ragged / split | ragged / split | target | met | "
                   "ITL p50 / p99 ms, ragged | ITL p99 / p50, ragged | target | met | ITL p50 / p99 ms, split | "
                   "ITL p99 / p50, split | output tok/s, ragged / split | errors | clean rounds |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for rate, p in sorted(pois.items(), key=lambda kv: float(kv[1].get("rate") or kv[0])):
            s = p.get("summary") or {}
            sent_r, sent_s, _ = _pair(s, "offered_rate_rps")
            sent = _f(sent_r, "{:.2f}") + ("" if sent_s in (None, sent_r) else f" / {_f(sent_s, '{:.2f}')}")
            tr, tsp, tratio = _pair(s, "ttft_p50_ms")
            t_ttft = C.target(tratio, _goal(d, f"poisson_{rate}_ttft_p50_ragged_over_split", tt), higher_is_better=False)
            sides = {}
            for side in ("ragged", "split"):
                p50, p99 = (s.get("itl_p50_ms") or {}).get(side), (s.get("itl_p99_ms") or {}).get(side)
                spread = (s.get("itl_p99_over_p50") or {}).get(side)
                sides[side] = (p50, p99, C.ratio(p99, p50) if spread is None else spread)
            t_itl = C.target(sides["ragged"][2], _goal(d, f"poisson_{rate}_itl_p99_over_p50_ragged", ti),
                             higher_is_better=False)
            out_r, out_s, _ = _pair(s, "output_tok_s")
            rounds = p.get("rounds") or {}
            errors = sum(x.get("errors", 0) for side in ("ragged", "split") for x in rounds.get(side) or [])
            lines.append(f"| {sent} ({float(p.get('rate') or rate):g}) | {_f(tr)} / {_f(tsp)} | {_x(tratio)} | "
                         f"≤ {t_ttft['goal']:g}× | {_met(t_ttft)} | {_f(sides['ragged'][0], '{:.2f}')} / "
                         f"{_f(sides['ragged'][1], '{:.2f}')} | {_f(sides['ragged'][2], '{:.2f}')} | "
                         f"≤ {t_itl['goal']:g}× | {_met(t_itl)} | {_f(sides['split'][0], '{:.2f}')} / "
                         f"{_f(sides['split'][1], '{:.2f}')} | {_f(sides['split'][2], '{:.2f}')} | "
                         f"{_f(out_r)} / {_f(out_s)} | {errors} | {_clean_rounds(s, rounds)} |")
    sweep = d.get("budget_sweep") or {}
    if sweep:
        default = st.get("budget")
        lines += ["", ("Token budget sweep (`--max-num-batched-tokens`), ragged engine only, one worker per budget, "
                       "Poisson arrivals as above; the default budget's points are the comparison's ragged medians."), "",
                  ("| budget | offered req/s, as sent (nominal) | TTFT p50 ms | ITL p50 ms | ITL p99 ms | ITL p99 / p50 | "
                   "output tok/s | errors | step programs (added in timed runs) |"),
                  "|---|---|---|---|---|---|---|---|---|"]
        rows = [(int(b), rate, m) for b, by_rate in sweep.items() for rate, m in (by_rate or {}).items()]
        for b, rate, m in sorted(rows, key=lambda x: (float(x[1]), x[0])):
            label = f"**{b}** (default)" if default is not None and b == int(default) else str(b)
            spread = m.get("itl_p99_over_p50")
            spread = C.ratio(m.get("itl_p99_ms"), m.get("itl_p50_ms")) if spread is None else spread
            added = sum((c or {}).get("programs", 0) for c in m.get("compiles") or [])
            progs = _sweep_programs(d, b)
            prog_txt = _f(progs, "{}") + ("" if "compiles" not in m else f" (+{added})")
            errors = m.get("errors")
            if errors is None and m.get("reused_from"):
                errors = "(above)"
            lines.append(f"| {label} | {_f(m.get('offered_rate_rps'), '{:.2f}')} ({float(rate):g}) | "
                         f"{_f(m.get('ttft_p50_ms'), '{:.2f}')} | {_f(m.get('itl_p50_ms'), '{:.2f}')} | "
                         f"{_f(m.get('itl_p99_ms'), '{:.2f}')} | {_f(spread, '{:.2f}')} | {_f(m.get('output_tok_s'))} | "
                         f"{_f(errors, '{}')} | {prog_txt} |")
    comp = d.get("compiles") or {}
    if comp:
        lines += ["", ("| engine | compile at start | programs at load | programs at the end | programs added in timed "
                       "runs | JAX compilations in timed runs | engine compilations after warmup |"),
                  "|---|---|---|---|---|---|---|"]
        for side in ("ragged", "split"):
            c = comp.get(side)
            if not c:
                continue
            added = c.get("timed_programs_added")
            mark = f" ({_met(C.target(added, 0, higher_is_better=False))} target 0)" if side == "ragged" else ""
            lines.append(f"| {side} | {c.get('warmup', '?')} | {_f(c.get('programs_at_load'), '{}')} | "
                         f"{_f(c.get('programs_end'), '{}')} | {_f(added, '{}')}{mark} | "
                         f"{_f(c.get('timed_jax_compiles'), '{}')} | {_f(c.get('engine_compilations_after_warmup'), '{}')} |")
        if (comp.get("split") or {}).get("warmup") == "lazy":
            lines += ["", ("The split engine compiled on first use here (`--split-warmup lazy`): a compile can land in "
                           "its timed rounds, and the count above says how many did.")]
    timed = [(sat or {}).get("rounds") or {}] + [p.get("rounds") or {} for p in pois.values()]
    errs = [x.get("errors", 0) for rounds in timed for side in ("ragged", "split") for x in rounds.get(side) or []]
    errs += [m.get("errors", 0) for by_rate in sweep.values() for m in (by_rate or {}).values() if "errors" in m]
    if errs:
        te = C.target(sum(errs), 0, higher_is_better=False)
        lines += ["", f"Errors in all timed runs: {te['value']} (target 0, {_met(te)})."]
    return lines + ["", *_plots(d), ""]


GRAMMAR_TOKENIZERS = {"demo": "demo generator", "v152k": "v152k, Qwen2-sized"}
GRAMMAR_LIBRARIES = ("llguidance", "xgrammar")
_WAYS = {"batch": "batch API", "serial": "one call per row"}


def _than(q: float | None) -> str:
    """' (llguidance slower)' / ' (llguidance faster)' for an llguidance / xgrammar time ratio."""
    return "" if q is None or q == 1 else f" (llguidance {'slower' if q > 1 else 'faster'})"


def _pq(s: dict, mode: str) -> str:
    """'p50 / p99' of one way's mask time per step."""
    return f"{_f(s.get(f'{mode}_mask_p50_us'))} / {_f(s.get(f'{mode}_mask_p99_us'))}"


def _grammar_choice(d: dict) -> str:
    """The sentence naming the server's grammar library and why: this run's figures at the largest
    vocabulary measured, the install weight, and the mask against a decode step where one is recorded."""
    st = d.get("setup") or {}
    lib = st.get("server_library") or "llguidance"
    toks = st.get("tokenizers") or {}
    parts = [f"**The server uses {lib}**" + (f": {st['server_reason']}." if st.get("server_reason") else ".")]
    keys = [k for k in (d.get("ratios") or {}) if k in (d.get("results") or {})]
    if keys:
        key = max(keys, key=lambda k: (toks.get(k) or {}).get("vocab_size") or 0)
        res, r = d["results"][key], d["ratios"][key]
        a, b = (res.get(x, {}).get("summary") or {} for x in GRAMMAR_LIBRARIES)
        vocab = (toks.get(key) or {}).get("vocab_size")
        best = r.get("best_mask_p50_us")
        best = C.ratio(a.get("best_mask_p50_us"), b.get("best_mask_p50_us")) if best is None else best
        parts.append(f"Measured here at {_f(vocab, '{:,}')} tokens, mask per step of {st.get('batch', 16)} rows, "
                     f"each library's faster way: llguidance {_f(a.get('best_mask_p50_us'))} µs "
                     f"({_WAYS.get(a.get('best_way'), '?')}) vs xgrammar {_f(b.get('best_mask_p50_us'))} µs "
                     f"({_WAYS.get(b.get('best_way'), '?')}): {_x(best)}{_than(best)}; batch APIs alone "
                     f"{_x(r.get('batch_mask_p50_us'))}{_than(r.get('batch_mask_p50_us'))}. Cold compile "
                     f"{_x(r.get('compile_ms'))}: {_f(a.get('compile_ms'), '{:.1f}')} vs {_f(b.get('compile_ms'), '{:.1f}')} ms.")
        ds = d.get("decode_step") or {}
        if ds.get("ms_per_step") and (toks.get(key) or {}).get("vocab_size") == 151936:
            share = [C.ratio(s.get("best_mask_p50_us"), ds["ms_per_step"] * 1e3 / 100) for s in (a, b)]
            parts.append(f"A sampled decode step of the '{ds.get('model')}' model at batch {ds.get('batch')} "
                         f"({ds.get('engine_dtype', 'float32')}) takes {_f(ds['ms_per_step'])} ms on this host "
                         f"(`{ds.get('source')}`, {str(ds.get('finished'))[:10]}): the mask is "
                         f"{_f(share[0], '{:.1f}')} % of it with llguidance, {_f(share[1], '{:.1f}')} % with xgrammar.")
    inst = d.get("install") or {}
    lg, xg = inst.get("llguidance") or {}, inst.get("xgrammar") or {}
    if lg.get("installed") or xg.get("installed"):
        extra = ", ".join(f"{n} {m:.0f}" for n, m in list((xg.get("beyond_base") or {}).items())[:4])
        deps = "no Python dependencies" if lg.get("requires") == [] else "requires " + ", ".join(lg.get("requires") or ["?"])
        parts.append(f"Install weight (as installed here): llguidance {_f(lg.get('own_mib'))} MiB, {deps}; "
                     + (f"xgrammar {_f(xg.get('own_mib'))} MiB but {_f(xg.get('beyond_base_mib'), '{:.0f}')} MiB beyond the "
                        f"base install with what it requires ({extra} MiB)." if xg.get("installed") else
                        "xgrammar not installed in this run."))
    return " ".join(parts)


def sec_grammar_mask(d: dict, quick: bool) -> list[str]:
    """grammar_mask: token-mask time per step at batch 16 for a nested JSON schema, llguidance vs
    xgrammar, each in its own worker process, on our tokenizers; the server's choice and why."""
    st = d.get("setup") or {}
    name = result_name("grammar_mask", quick)
    toks = st.get("tokenizers") or {}
    B = st.get("batch", 16)
    ws = {"compact": "compact, as the server asks for it (llguidance `whitespace_flexible: false`; xgrammar "
                     "`any_whitespace=False`, separators `,` `:`)",
          "flexible": "each library's default (free whitespace; documents compact, spaced and indented)"}.get(
        st.get("whitespace"), st.get("whitespace") or "?")
    lines = [f"### Grammar engine: token mask per step at batch {B}, llguidance vs xgrammar ({_cpu(d)})", "",
             _src(name, quick, d), "",
             (f"One nested JSON schema (depth 3: objects in objects, an array of objects holding an array, an enum, "
              f"bounded integers, patterned strings, required fields), {B} different valid documents for it tokenized "
              f"with each HF tokenizer and ending in EOS, every token first checked against the library's own mask. "
              f"JSON whitespace: {ws}. "
              f"A step computes the {B}-row bitmask (the figure below, for the whole batch), then consumes each row's "
              f"next token; a finished document starts a new request for the schema. {st.get('steps', '?')} steps per "
              f"pass, {st.get('threads', '?')} threads for both batch APIs (llguidance `fill_next_token_bitmask_par` "
              f"with an `LLExecutor`, xgrammar `BatchGrammarMatcher`); 'one call per row' is each library's serial "
              f"fill. Each library in its own worker process; rounds alternate, medians (clean rounds when any)."),
             "", ("| tokenizer (vocab) | library | mask µs/step, batch API (p50 / p99) | mask µs/step, one call per row "
                  "(p50 / p99) | consume µs/step (batch) | compile ms (cold) | schema to first mask, ms | "
                  "new request µs (seen schema) | tokenizer info ms | compiled grammar | allowed tokens per row | "
                  "clean rounds |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, by_lib in (d.get("results") or {}).items():
        t = toks.get(key) or {}
        label = f"{GRAMMAR_TOKENIZERS.get(key, key)} ({_f(t.get('vocab_size'), '{:,}')})"
        libs = [x for x in GRAMMAR_LIBRARIES if x in by_lib] + [x for x in by_lib if x not in GRAMMAR_LIBRARIES]
        for lib in libs:
            r = by_lib[lib] or {}
            shown = f"**{lib}** (server)" if lib == st.get("server_library") else lib
            if "skipped" in r:
                lines.append(f"| {label} | {shown} | not measured: {r['skipped']} |" + " |" * 9)
                continue
            s, load = r.get("summary") or {}, r.get("load") or {}
            mem, info_ms = load.get("memory_bytes"), (r.get("setup") or {}).get("tokenizer_info_ms")
            bad = load.get("rejected") or 0
            check = f" ❌ {bad} document token(s) rejected" if bad else ""
            lines.append(f"| {label} | {shown} | {_pq(s, 'batch')} | {_pq(s, 'serial')} | {_f(s.get('batch_consume_p50_us'))} | "
                         f"{_f(s.get('compile_ms'), '{:.2f}')} | {_f(s.get('first_mask_ms'), '{:.2f}')} | "
                         f"{_f(s.get('batch_new_request_p50_us'))} | {_f(info_ms, '{:.0f}')} | "
                         f"{_f(mem / 2 ** 10 if mem else None, '{:.0f} KiB')} | {_f(s.get('batch_allowed_mean'))}{check} | "
                         f"{s.get('clean_rounds', '–')} of {s.get('rounds', '–')} |")
    ratios = d.get("ratios") or {}
    if ratios:
        lines += ["", "llguidance / xgrammar (< 1: llguidance takes less): " + "; ".join(
            f"{GRAMMAR_TOKENIZERS.get(k, k)}: mask p50, each library's faster way {_x(r.get('best_mask_p50_us'))}; "
            f"batch API p50 {_x(r.get('batch_mask_p50_us'))}, p99 "
            f"{_x(r.get('batch_mask_p99_us'))}, one call per row p50 {_x(r.get('serial_mask_p50_us'))}, cold compile "
            f"{_x(r.get('compile_ms'))}" for k, r in ratios.items()) + "."]
    same = [s.get("ways_masks_identical") for by_lib in (d.get("results") or {}).values() for s in
            ((r or {}).get("summary") or {} for r in by_lib.values()) if s.get("ways_masks_identical") is not None]
    if same:
        lines += ["", f"Batch API and one call per row gave bit-identical masks in every round: {_ok(all(same))}."]
    lines += ["", _grammar_choice(d)]
    return lines + [""]


def sec_profile(p: dict, pb: dict | None, quick: bool) -> list[str]:
    cols = [p] + ([pb] if pb else [])
    names = ["profile_decode"] + ([result_name("profile_decode_batch", quick)] if pb else [])
    cpus = "; ".join("batch {}: {}".format(c["setup"].get("batch", 1), _cpu(c)) for c in cols)
    lines = [(f"### Where one decode step goes, '{p['setup']['model']}' model, {p['setup'].get('dtype', 'float32')}, "
             f"context {p['setup']['context']} ({cpus})"), ""]
    lines += [_src(n, quick, c) for n, c in zip(names, cols)]
    lines += ["", "Bandwidth floor = (weights + live KV at the engine's KV itemsize) / the read bandwidth of "
                  + "; ".join(f"batch {c['setup'].get('batch', 1)}: {c['setup'].get('bandwidth_probe', 'a torch probe')}"
                              for c in cols) + ".", "",
              "| layer | " + " | ".join("batch {}, ms (p50)".format(c["setup"].get("batch", 1)) for c in cols) + " |",
              "|---|" + "---|" * len(cols)]
    for k in p["breakdown_ms_p50"]:
        lines.append(f"| {k} | " + " | ".join(_f(c["breakdown_ms_p50"].get(k), "{:.2f}") for c in cols) + " |")
    return lines + [""]


def section(quick: bool) -> str:
    lines = ["## Performance", "",
             ("Every figure below is read from a results file a script wrote (`xlaserve bench`, or "
             "`python -m benchmarks`, runs them all and rewrites this section); each table names its file and "
             "the host it was measured on. Peers are measured again in the same run, in their own processes, "
             "configured as their users run them (alternating rounds, medians; clean rounds only when a run had "
             "any); every ratio names the peer's dtype. Ratios > 1 mean xlaserve is better."), ""]
    docs = {job: _load(result_name(job, quick), quick) for job in JOBS}
    for job, render in (("start_time", sec_start_time), ("embed_vs_st", sec_embed), ("generate_vs_hf", sec_generate),
                        ("serve_load", sec_serve), ("ragged_step", sec_ragged_step), ("grammar_mask", sec_grammar_mask),
                        ("constrained_decode", sec_constrained_decode), ("lora_decode", sec_lora_decode),
                        ("spec_decode", sec_spec_decode), ("spec_decode_small", sec_spec_decode_small),
                        ("moe_vs_hf", sec_moe_vs_hf), ("moe_dispatch", sec_moe_dispatch),
                        ("parity", sec_parity), ("tests", sec_tests)):
        if docs[job]:
            lines += render(docs[job], quick)
    for job, render in (("embed_vs_st", sec_embed), ("generate_vs_hf", sec_generate), ("spec_decode", sec_spec_decode)):
        for name in result_variants(job, quick):
            doc = _load(name, quick)
            if doc and doc.get("benchmark") == job:
                lines += render(doc, quick, name)
    if docs["profile_decode"]:
        lines += sec_profile(docs["profile_decode"], docs["profile_decode_batch"], quick)
    if len(lines) <= 3:
        lines.append("_No benchmark results yet: run `xlaserve bench`._")
    return "\n".join(lines).rstrip() + "\n"


def update_readme(text: str) -> str | None:
    """Replace the marked region of README.md; returns the path, or None without markers."""
    path = os.path.join(REPO, "README.md")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        readme = f.read()
    i, j = readme.find(BEGIN), readme.find(END)
    if i < 0 or j < i:
        return None
    new = readme[: i + len(BEGIN)] + "\n" + text + readme[j:]
    if new != readme:
        with open(path, "w") as f:
            f.write(new)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="xlaserve bench", description="Run the benchmarks; regenerate README Performance.")
    ap.add_argument("--quick", action="store_true", help="smoke mode: every job in its quick form")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    ap.add_argument("--readme-only", action="store_true", help="do not run; rebuild the section from results/")
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    names = [n.strip() for n in a.only.split(",")] if a.only else BENCHMARKS
    unknown = [n for n in names if n not in JOBS]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; choose from {BENCHMARKS}")
    summary: dict[str, Any] = {"mode": "quick" if a.quick else "full", "runs": {}}
    if not a.readme_only:
        for n in names:
            summary["runs"][n] = run_one(n, a.quick)
    text = section(a.quick)
    md = C.result_path("performance", a.quick, "md")
    with open(md, "w") as f:
        f.write(text)
    readme = None if a.quick else update_readme(text)
    summary["section"] = os.path.relpath(md, REPO)
    summary["readme_updated"] = bool(readme)
    if not readme:
        C.log("README.md has no perf markers (or quick mode): the section follows on stderr\n")
        C.log(text)
    print(json.dumps(summary), flush=True)
    return 0 if all(r.get("exit_code") == 0 for r in summary["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
