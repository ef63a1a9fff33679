"""The mixture-of-experts FFN's formulations on CPU (issue 19: "jax.lax.ragged_dot or a sort-by-expert
dispatch; measure"), at decode and prefill token counts, one layer, no engine.

Layer (default): one MoE layer of benchmarks/moe_vs_hf.py's Qwen3-MoE-shaped model: hidden 1024,
64 experts, top-8 routing (norm_topk_prob), expert intermediate 512, SwiGLU, float32, random
weights (N(0, 0.02)); 100.7 M expert parameters, 12.6 M of them active per token. T = 1 and 16
tokens (decode steps at batch 1 and 16) and T = 128 and 512 (prefill chunks).
--quick: a small layer (hidden 256, 16 experts, top-4, intermediate 128), T = 1, 16, 128.

Forms (jax_engine/models/moe.py, `moe_mlp(..., method=...)`, routing included, each jitted):
  ragged  pairs sorted by expert, two jax.lax.ragged_dot calls. XLA:CPU has no ragged-dot
          instruction: JAX lowers it (`_ragged_dot_general_impl`) to a masked [E, T*k, H] operand
          and one dense dot that also contracts the expert axis, so every expert multiplies every
          (token, expert) pair.
  sorted  sort-by-expert dispatch in blocks (the engine's form): only the used blocks run, each a
          plain dot with its expert's weights.
  dense   every expert on every token, then the routing-weighted sum.
  sorted_b{B}  the sorted form with B rows per block (the sweep behind moe.default_block).
  scan_slice / scan_stacked  the sorted form in a `lax.scan` over 3 such layers, as the model runs
          it (ms per layer): handed each layer's slice of the stacked weights (what the scan
          gives the layer body), or the stacked weights and the layer index
          (`moe_mlp(..., layer=li)`). XLA copies a sliced operand whole before the dispatch's
          fori_loop can read it (the whole layer's experts, every call); with the index the loop
          slices out only its block's expert.
Every dot above compiles to an XLA:CPU `__ynn_fusion` (YNNPACK GEMM); the results record the
optimized HLO's dot fusions per form as evidence.

Rounds: per T, every form once per round, the first form rotating (common.run_pairs), 3 rounds
(+ up to 2 more when another process disturbed one; quick: 2, no retries); a form's time in a
round is the median of up to 10 calls (as many as fit in ~0.5 s, at least 1) after one untimed
call (the form before it may leave the caches and allocator cold). Each form's output is compared with the sorted form's (max abs
difference; scan_stacked with scan_slice). A form's figure is the median of its own undisturbed
runs when it has at least --rounds of them, else of all its runs.

Time: ~3-4 min on 2 cores (ragged at T = 512 is ~825 GFLOP, ~6 s a call); --quick ~30 s.

Run:  python -m benchmarks.moe_dispatch [--quick] [--tokens 1,16,128,512] [--rounds 3] [--retries 2]
          [--blocks 1,2,4,8,16,32,64] [--quiet-wait S]
Writes benchmarks/results/moe_dispatch.json (moe_dispatch_quick.json in --quick).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C

NAME = "moe_dispatch"
LAYERS = {
    "qwen3moe-1b": {"hidden": 1024, "experts": 64, "top_k": 8, "intermediate": 512},   # moe_vs_hf's layer
    "small": {"hidden": 256, "experts": 16, "top_k": 4, "intermediate": 128},
}
FORMS = ("ragged", "sorted", "dense")
SCAN_FORMS = ("scan_slice", "scan_stacked")
SCAN_LAYERS = 3


def useful_gflop(T: int, layer: dict) -> float:
    """FLOPs a perfect grouped GEMM does: T*k pairs through gate_up (H x 2I) and down (I x H)."""
    return 2 * T * layer["top_k"] * layer["hidden"] * 3 * layer["intermediate"] / 1e9


def form_gflop(form: str, T: int, layer: dict) -> float:
    """What each form really multiplies (ragged on CPU: every expert x every pair)."""
    u = useful_gflop(T, layer)
    if form == "ragged":
        return u * layer["experts"]
    if form == "dense":
        return u * layer["experts"] / layer["top_k"]
    return u


def dot_fusions(hlo: str, limit: int = 4) -> list[str]:
    """The signatures of the optimized HLO's YNNPACK dot fusions (operand shapes -> result), most elements first."""
    import numpy as np

    sigs = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*%([\w.\-]+) \((.*)\) -> (\S+) \{", line)
        if m:
            params = ", ".join(re.findall(r"\w+\[[\d,]*\]", m.group(2)))
            sigs[m.group(1)] = f"({params}) -> {m.group(3)}"
    out: list[str] = []
    for line in hlo.splitlines():
        if "__ynn_fusion" in line and " fusion(" in line:
            m = re.search(r"calls=%([\w.\-]+)", line)
            sig = sigs.get(m.group(1)) if m else None
            if sig and sig not in out:
                out.append(sig)

    def size(s: str) -> int:
        return sum(int(np.prod([int(x) for x in d.split(",") if x])) for d in re.findall(r"\[([\d,]*)\]", s))

    return sorted(out, key=size, reverse=True)[:limit]


def main(argv: Sequence[str] | None = None) -> dict:
    C.engine_process()
    ap = argparse.ArgumentParser(prog="python -m benchmarks.moe_dispatch", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small layer, T = 1, 16, 128, 2 rounds (< 1 min)")
    ap.add_argument("--layer", choices=list(LAYERS), default=None, help="default qwen3moe-1b; quick: small")
    ap.add_argument("--tokens", default=None, help="token counts T (default 1,16,128,512; quick 1,16,128)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per T (default 3; quick 2)")
    ap.add_argument("--retries", type=int, default=None, help="extra rounds when one was disturbed (default 2; quick 0)")
    ap.add_argument("--blocks", default="1,2,4,8,16,32,64", help="block sizes of the sorted-form sweep ('' = none)")
    C.add_round_args(ap)
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    quick = a.quick
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_engine.models import moe

    layer_name = a.layer or ("small" if quick else "qwen3moe-1b")
    layer = LAYERS[layer_name]
    tokens = [int(x) for x in (a.tokens or ("1,16,128" if quick else "1,16,128,512")).split(",")]
    rounds = a.rounds or (2 if quick else 3)
    retries = a.retries if a.retries is not None else (0 if quick else 2)
    blocks = [int(x) for x in a.blocks.split(",") if x.strip()]
    doc = C.header(NAME, quick, sys.argv[1:] if argv is None else argv)
    doc["quiet_wait"] = C.wait_for_quiet(C.quiet_seconds(a))
    total = C.CpuWindow().start()

    H, E, k, inter = layer["hidden"], layer["experts"], layer["top_k"], layer["intermediate"]
    rng = np.random.default_rng(0)
    gate_up = jnp.asarray(rng.normal(0, 0.02, (E, H, 2, inter)).astype(np.float32))
    down = jnp.asarray(rng.normal(0, 0.02, (E, inter, H)).astype(np.float32))
    router = jnp.asarray(rng.normal(0, 0.02, (H, E)).astype(np.float32))
    act = jax.nn.silu

    Ls = SCAN_LAYERS
    stacked = (jnp.stack([router] * Ls), jnp.stack([gate_up] * Ls), jnp.stack([down] * Ls))

    def program(form: str):
        if form.startswith("sorted_b"):
            b = int(form[len("sorted_b"):])
            return jax.jit(lambda h, r, g, d: moe.experts_sorted(h, *moe.route(h, r, k, True), g, d, act, block=b))
        if form == "scan_slice":         # the layer's slice handed in by lax.scan (llama.py today)
            def f(h, r, g, d):
                return jax.lax.scan(lambda x, lw: (x + moe.moe_mlp(x, *lw, k, True, act, method="sorted"), None),
                                    h, (r, g, d))[0]
            return jax.jit(f)
        if form == "scan_stacked":       # the stacked weights and the layer index (moe_mlp(..., layer=li))
            def f(h, r, g, d):
                def body(c, lr):
                    x, li = c
                    return (x + moe.moe_mlp(x, lr, g, d, k, True, act, method="sorted", layer=li), li + 1), None
                return jax.lax.scan(body, (h, jnp.int32(0)), r)[0][0]
            return jax.jit(f)
        return jax.jit(lambda h, r, g, d: moe.moe_mlp(h, r, g, d, k, True, act, method=form))

    def args(form: str) -> tuple:
        return stacked if form.startswith("scan_") else (router, gate_up, down)

    results: dict[str, Any] = {}
    for T in tokens:
        h = jnp.asarray(rng.normal(0, 1, (T, H)).astype(np.float32))
        forms = list(FORMS) + [f"sorted_b{b}" for b in blocks] + list(SCAN_FORMS)
        progs, outs, compile_s, hlo = {}, {}, {}, {}
        for f in forms:
            t0 = time.perf_counter()
            progs[f] = program(f).lower(h, *args(f)).compile()
            compile_s[f] = C.rnd(time.perf_counter() - t0, 2)
            if f in FORMS:
                hlo[f] = dot_fusions(progs[f].as_text())
            outs[f] = np.asarray(progs[f](h, *args(f)))                    # warm-up call
        ref = outs["sorted"]
        per_call = {f: Ls if f.startswith("scan_") else 1 for f in forms}     # scan forms: ms per layer

        def side(f: str):
            def run() -> dict:
                with C.cpu_window() as w:
                    # one untimed call first: the form that ran before (ragged's GB-sized operands
                    # at large T) leaves the caches and the allocator cold for whoever comes next
                    t0 = time.perf_counter()
                    progs[f](h, *args(f)).block_until_ready()
                    first = time.perf_counter() - t0
                    times = []
                    n = max(1, min(10, int(0.5 / max(first, 1e-6))))
                    for _ in range(n):
                        t0 = time.perf_counter()
                        progs[f](h, *args(f)).block_until_ready()
                        times.append(time.perf_counter() - t0)
                ms = C.median(times) * 1e3 / per_call[f]
                return {"ms": ms, "calls": len(times), "cpu": w.result, "headline": f"{ms:.2f} ms"}
            return run

        C.log(f"T = {T}: {', '.join(forms)}")
        runs = C.run_pairs({f: side(f) for f in forms}, rounds, retries, label=f"T={T}", quiet_s=C.quiet_seconds(a))
        per: dict[str, Any] = {}
        for f in forms:
            rs = runs[f]
            # a form's own undisturbed runs when it has `rounds` of them, else all of its runs: with a
            # dozen forms per round, whole-round cleanliness leaves too few rounds for a median
            clean = [r for r in rs if not r["cpu"]["disturbed"]]
            use = clean if len(clean) >= rounds else rs
            per[f] = {"ms": C.rnd(C.median(r["ms"] for r in use), 3), "ms_all_rounds": [C.rnd(r["ms"], 3) for r in rs],
                      "disturbed_rounds": [bool(r["cpu"]["disturbed"]) for r in rs],
                      "calls_per_round": [r["calls"] for r in rs], "clean_rounds": len(clean), "rounds": len(rs),
                      "compile_s": compile_s[f]}
            other = outs["scan_slice"] if f == "scan_stacked" else None if f == "scan_slice" else ref
            if other is not None:
                per[f]["max_abs_diff_vs_" + ("scan_slice" if f == "scan_stacked" else "sorted")] = C.rnd(
                    float(np.max(np.abs(outs[f] - other))), 9)
            if f in FORMS:
                per[f]["gflop"] = C.rnd(form_gflop(f, T, layer), 3)
                per[f]["gflops_rate"] = C.rnd(form_gflop(f, T, layer) / (per[f]["ms"] / 1e3), 1) if per[f]["ms"] else None
                per[f]["hlo_dot_fusions"] = hlo[f]
        winner = min(FORMS, key=lambda f: per[f]["ms"] or float("inf"))
        best_block = min((f for f in forms if f.startswith("sorted_b")), key=lambda f: per[f]["ms"] or float("inf"),
                         default=None)
        results[str(T)] = {
            "forms": per, "winner": winner, "engine_choice": moe.choose_method(T, E, k),
            "engine_block": moe.default_block(T * k, E), "best_block": best_block,
            "sorted_vs_ragged_speedup": C.ratio(per["ragged"]["ms"], per["sorted"]["ms"], 1),
            "sorted_vs_dense_speedup": C.ratio(per["dense"]["ms"], per["sorted"]["ms"], 2),
            "useful_gflop": C.rnd(useful_gflop(T, layer), 4),
            "scan_slice_over_stacked": C.ratio(per["scan_slice"]["ms"], per["scan_stacked"]["ms"], 1),
        }
        C.log(f"T = {T}: " + ", ".join(f"{f} {per[f]['ms']:.2f} ms" for f in FORMS) + f"; winner {winner}")
    doc["setup"] = {
        "layer": layer_name, **layer, "dtype": "float32", "tokens": tokens, "rounds": rounds, "retries": retries,
        "blocks": blocks, "expert_params": E * 3 * H * inter, "active_expert_params_per_token": k * 3 * H * inter,
        "jax": jax.__version__, "backend": jax.default_backend(), "devices": len(jax.devices()),
        "ragged_dot_lowering": ("XLA:CPU has no ragged-dot instruction; JAX lowers ragged_dot with "
                                "_ragged_dot_general_impl: an [E, T*k, H] masked operand and one dense dot over it "
                                "(contracting the expert axis too), i.e. E x the useful FLOPs"),
        "experts_run_on": "XLA:CPU dots compiled to __ynn_fusion (YNNPACK GEMM) on the host cores",
    }
    doc["results"] = results
    doc["summary"] = {T: {"winner": r["winner"], **{f: r["forms"][f]["ms"] for f in FORMS},
                          "sorted_vs_ragged": r["sorted_vs_ragged_speedup"], "engine_choice": r["engine_choice"],
                          "engine_choice_is_winner": r["engine_choice"] == r["winner"]} for T, r in results.items()}
    doc["cpu"] = total.stop()
    doc["targets"] = {"engine_choice_is_winner": C.target(
        float(all(r["engine_choice"] == r["winner"] for r in results.values())), 1.0)}
    return C.finish(doc, NAME, quick)


# =============================================================================================
# README
# =============================================================================================
def render(d: dict, quick: bool) -> list[str]:
    """README lines for benchmarks/results/moe_dispatch.json: ms per call of each form per T."""
    st = d.get("setup") or {}
    res = d.get("results") or {}
    lines = [f"### Mixture of experts: the expert FFN's formulations on CPU, one layer ({C.cpu_line(d)})", "",
             C.source_line(NAME, quick, d), ""]
    if st:
        lines.append(
            f"One MoE layer ('{st.get('layer', '?')}': hidden {st.get('hidden')}, {st.get('experts')} experts, "
            f"top-{st.get('top_k')}, expert intermediate {st.get('intermediate')}, {st.get('dtype', 'float32')}), routing "
            "included, jitted, no engine. `ragged`: `jax.lax.ragged_dot`, which XLA:CPU cannot run as a grouped GEMM (JAX "
            "lowers it to one masked dense dot in which every expert multiplies every (token, expert) pair); `sorted`: "
            "the engine's sort-by-expert dispatch in blocks (only the used blocks, one YNNPACK GEMM pair each); `dense`: "
            "every expert on every token, then the routing-weighted sum. The last two columns run `sorted` in a "
            f"`lax.scan` over {SCAN_LAYERS} layers, as the model does (ms per layer): handed each layer's slice of the "
            "stacked weights (XLA copies the whole slice before the dispatch loop reads it) or the stacked weights and "
            "the layer index (only each block's expert is read). Forms alternate within each round; each figure is "
            "the median of the form's undisturbed rounds (of all its rounds when it has fewer than "
            f"{st.get('rounds', 3)} of them).")
    if res:
        lines += ["", "| tokens T | ragged ms | sorted ms (the engine's) | dense ms | sorted vs ragged | best block "
                      "(rows) | winner | in a layer scan: slice handed in, ms/layer | stacked + layer index, ms/layer |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for T in sorted(res, key=int):
            r = res[T]
            f = r.get("forms") or {}
            ms = {k: (f.get(k) or {}).get("ms") for k in FORMS + SCAN_FORMS}
            bb = (r.get("best_block") or "").replace("sorted_b", "") or "–"
            lines.append(f"| {T} | {C.fmt(ms['ragged'], '{:.2f}')} | {C.fmt(ms['sorted'], '{:.2f}')} | "
                         f"{C.fmt(ms['dense'], '{:.2f}')} | {C.fmt_ratio(r.get('sorted_vs_ragged_speedup'))} | "
                         f"{bb} (engine {r.get('engine_block', '–')}) | {r.get('winner', '–')} | "
                         f"{C.fmt(ms['scan_slice'], '{:.2f}')} | {C.fmt(ms['scan_stacked'], '{:.2f}')} |")
    return lines + [""]


if __name__ == "__main__":
    main()
