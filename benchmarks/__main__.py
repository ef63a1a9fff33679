"""Run every benchmark and regenerate the README's Performance section.

  python -m benchmarks [--quick] [--only embed_vs_st,generate_vs_hf,...] [--readme-only]
  xlaserve bench       (the same)

Each benchmark runs in its own process (a clean JAX/torch state and compile counter) and
writes benchmarks/results/<name>.json and its PNGs. Then the section between
`<!-- perf:begin -->` and `<!-- perf:end -->` in README.md is rewritten from the result files
(a table and the plots); nothing else in README.md is touched. Without those markers, or in
--quick mode (smoke numbers do not belong in the README), the section is printed instead, and
always saved as benchmarks/results/performance.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C

BENCHMARKS = ["embed_vs_st", "generate_vs_hf", "serve_load", "profile_decode"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- perf:begin -->", "<!-- perf:end -->"


def run_one(name: str, quick: bool, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", f"benchmarks.{name}"] + (["--quick"] if quick else []) + extra
    C.log(f"=== {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)   # stderr streams through
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
# the README section
# =============================================================================================
def _load(name: str, quick: bool) -> Optional[dict]:
    path = C.result_path(name, quick)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    if x is None:
        return "–"
    try:
        return fmt.format(x)
    except (TypeError, ValueError):
        return str(x)


def _x(r: Any) -> str:
    return "–" if r is None else f"**{r:.2f}×**"


def _met(t: Optional[dict]) -> str:
    if not t or t.get("met") is None:
        return "–"
    return "✅" if t["met"] else "❌"


def _cpu(doc: dict) -> str:
    c = doc.get("cpu") or {}
    flag = " **(disturbed)**" if c.get("disturbed") else ""
    return f"cpu share {c.get('cpu_share_of_cores')}, others {c.get('others_share_of_cores')}{flag}"


def section(quick: bool) -> str:
    lines = ["## Performance", "",
             "Measured on this project's reference machine: 2 vCPUs, float32 unless noted, every peer "
             "measured again in the same run (alternating rounds, medians; clean rounds only when a run "
             "had any). Regenerate with `xlaserve bench` (or `python -m benchmarks`); numbers, raw rounds "
             "and CPU accounting are in `benchmarks/results/*.json`. Ratios > 1 mean xlaserve is better.",
             ""]
    e = _load("embed_vs_st", quick)
    g = _load("generate_vs_hf", quick)
    s = _load("serve_load", quick)
    p = _load("profile_decode", quick)
    if e:
        r, t = e["results"], e.get("targets", {})
        lines += [f"### Embeddings: all-MiniLM-L6-v2 vs sentence-transformers ({_cpu(e)})", "",
                  "| batch | xlaserve sentences/s | sentence-transformers | ratio | target | met | clean rounds |",
                  "|---|---|---|---|---|---|---|"]
        for B in e["setup"]["batch_sizes"]:
            row = r.get(f"batch_{B}", {})
            tt = t.get(f"sentences_per_s_ratio_b{B}")
            lines.append(f"| {B} | {_f(row.get('xlaserve_sentences_per_s'))} | {_f(row.get('st_sentences_per_s'))} | "
                         f"{_x(row.get('ratio'))} | {'≥ 1.2×' if tt else '–'} | {_met(tt)} | "
                         f"{row.get('all_rounds', {}).get('clean_rounds')} of {row.get('all_rounds', {}).get('rounds')} |")
        b1 = r.get("batch_1")
        if b1:
            lt = t.get("b1_latency_p50_ratio_engine_over_st")
            lines += ["", f"Batch-1 latency p50 / p99: xlaserve {_f(b1['xlaserve_latency_ms'].get('p50'))} / "
                          f"{_f(b1['xlaserve_latency_ms'].get('p99'))} ms, sentence-transformers "
                          f"{_f(b1['st_latency_ms'].get('p50'))} / {_f(b1['st_latency_ms'].get('p99'))} ms "
                          f"(target: no worse; {_met(lt)}). Compilations after warmup: "
                          f"{e['compilations']['after_timing']['engine_after_warmup']}."]
        lines += ["", *[f"![{os.path.basename(x)}]({x})" for x in e.get("plots", [])], ""]
    if g:
        lines += [f"### Generation: random '{g['setup']['model']}' Llama ({g['setup']['params'] / 1e6:.1f} M parameters) "
                  f"vs transformers `generate` ({_cpu(g)})", "",
                  f"Prompt {g['setup']['prompt_len']} tokens, {g['setup']['new_tokens']} new tokens forced, greedy. "
                  f"Read bandwidth{' (newest run)' if g.get('merged_runs') else ''}: {_f(g['limits'].get('torch_sum_gbps'))} GB/s "
                  f"(torch sum over {g['limits'].get('buffer_gib')} GiB); fp32 matmul "
                  f"{_f(g['limits'].get('torch_matmul_fp32_gflops'))} GFLOP/s.", "",
                  "| engine dtype | batch | prefill ms | decode tok/s | HF static tok/s | HF dynamic tok/s | "
                  "decode vs HF static | prefill vs HF static | roofline tok/s | of roofline | clean rounds |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for dtype, row in g["rows"].items():
            if "error" in row:
                lines.append(f"| {dtype} | – | {row['error']} | | | | | | | | |")
                continue
            for B in g["setup"]["batches"]:
                b = row[f"batch_{B}"]
                x = b["xlaserve"]
                lines.append(
                    f"| {dtype} | {B} | {_f((x.get('prefill_s') or 0) * 1e3, '{:.0f}')} | {_f(x.get('decode_tok_s'))} | "
                    f"{_f(b.get('hf_static', {}).get('decode_tok_s'))} | {_f(b.get('hf_dynamic', {}).get('decode_tok_s'))} | "
                    f"{_x(b.get('ratios_vs_hf_static', {}).get('decode_tok_s'))} | "
                    f"{_x(b.get('ratios_vs_hf_static', {}).get('prefill_s'))} | "
                    f"{_f(b['roofline'].get('decode_tok_s'))} | {_f(b['roofline_fraction'].get('xlaserve_decode'), '{:.0%}')} | "
                    f"{b.get('clean_rounds')} of {b.get('rounds')} |")
        lines += ["", "| target (float32) | value | goal | met |", "|---|---|---|---|"]
        for k, t in (g.get("targets") or {}).items():
            if isinstance(t, dict):
                lines.append(f"| {k} | {_f(t.get('value'), '{:.3g}')} | {t.get('goal')} | {_met(t)} |")
        lines += ["", *[f"![{os.path.basename(x)}]({x})" for x in g.get("plots", [])], ""]
    if s:
        lines += [f"### Serving through `xlaserve serve` ({_cpu(s)})", ""]
        if "embeddings" in s:
            em = s["embeddings"]
            lines.append(f"- Arctic `Encode` over gRPC, batches of {em['batch']}: {_f(em['grpc_sentences_per_s'])} "
                         f"sentences/s vs in-process sentence-transformers {_f(em['st_sentences_per_s'])} → "
                         f"{_x(em['ratio'])} (target ≥ 1.0×, {_met(s['targets'].get('grpc_encode_b32_vs_st'))}).")
        if "streams" in s:
            st = s["streams"]
            key = f"{st['streams']}_streams_grpc_over_engine_decode"
            lines.append(f"- {st['streams']} concurrent SGLang `Generate` streams: {_f(st['decode_tok_s']['grpc'])} tok/s "
                         f"vs the engine in-process {_f(st['decode_tok_s']['engine_in_process'])} → "
                         f"{_f(st['decode_tok_s']['ratio_grpc_over_engine'], '{:.0%}')} (target ≥ 80 %, "
                         f"{_met(s['targets'].get(key))}); errors {st['errors']}.")
        end = s.get("compiles_after_warmup_end")
        if end is not None:
            lines.append(f"- Server compilations after warmup (/metrics): {end}.")
        if "poisson" in s:
            lines += ["", "| protocol | offered req/s | completed req/s | output tok/s | TTFT p50 / p99 ms | "
                          "ITL p50 / p99 ms | errors | others' CPU share |", "|---|---|---|---|---|---|---|---|"]
            for proto, label in (("grpc", "gRPC SGLang"), ("http", "HTTP OpenAI chat")):
                for m in s["poisson"][proto]:
                    lines.append(f"| {label} | {m['offered_rate_rps']} | {_f(m.get('completed_rps'), '{:.2f}')} | "
                                 f"{_f(m.get('output_tok_s'))} | {_f(m['ttft_ms'].get('p50'), '{:.0f}')} / "
                                 f"{_f(m['ttft_ms'].get('p99'), '{:.0f}')} | {_f(m['itl_ms'].get('p50'))} / "
                                 f"{_f(m['itl_ms'].get('p99'))} | {m['errors']} | "
                                 f"{(m.get('cpu') or {}).get('others_share_of_cores')} |")
        lines += ["", *[f"![{os.path.basename(x)}]({x})" for x in s.get("plots", [])], ""]
    if p:
        p16 = _load("profile_decode_b16", quick)
        cols = [p] + ([p16] if p16 else [])
        cpus = "; ".join("batch %s: %s" % (c["setup"].get("batch", 1), _cpu(c)) for c in cols)
        lines += [f"### Where one decode step goes, '{p['setup']['model']}' model, float32, context "
                  f"{p['setup']['context']} ({cpus})",
                  "", "| layer | " + " | ".join("batch %s, ms (p50)" % c["setup"].get("batch", 1) for c in cols) + " |",
                  "|---|" + "---|" * len(cols)]
        for k in p["breakdown_ms_p50"]:
            lines.append(f"| {k} | " + " | ".join(_f(c["breakdown_ms_p50"].get(k), "{:.2f}") for c in cols) + " |")
        lines.append("")
    if len(lines) <= 6:
        lines.append("_No benchmark results yet: run `xlaserve bench`._")
    return "\n".join(lines).rstrip() + "\n"


def update_readme(text: str) -> Optional[str]:
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="xlaserve bench", description="Run the benchmarks; regenerate README Performance.")
    ap.add_argument("--quick", action="store_true", help="smoke mode: every benchmark in its quick form")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    ap.add_argument("--readme-only", action="store_true", help="do not run; rebuild the section from results/")
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    names = [n.strip() for n in a.only.split(",")] if a.only else BENCHMARKS
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; choose from {BENCHMARKS}")
    summary: dict[str, Any] = {"mode": "quick" if a.quick else "full", "runs": {}}
    if not a.readme_only:
        for n in names:
            summary["runs"][n] = run_one(n, a.quick, [])
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
