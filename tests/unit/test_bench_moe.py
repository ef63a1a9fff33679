"""The pure helpers, argument handling and README renderers of benchmarks/moe_vs_hf.py and
benchmarks/moe_dispatch.py, and their registration in `python -m benchmarks`.

No engine or peer runs here; the benchmarks themselves are `python -m benchmarks.moe_vs_hf [--quick]`
and `python -m benchmarks.moe_dispatch [--quick]`.
"""
from __future__ import annotations

import pytest

from benchmarks import __main__ as M
from benchmarks import moe_dispatch as MD
from benchmarks import moe_vs_hf as MH


def _row(text: str, start: str) -> list[str]:
    line = next(ln for ln in text.splitlines() if ln.startswith(start))
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _round(prefill_s: float, tok_s: float, ids: list[list[int]], clean: bool = True) -> dict:
    return {"prefill_s": prefill_s, "decode_tok_s": tok_s, "e2e_s": prefill_s + 1.0, "errors": 0, "output_ids": ids,
            "clean": clean, "cpu": {"cpu_share_of_cores": 0.98, "others_share_of_cores": 0.01, "disturbed": not clean}}


def _runs() -> dict:
    same, other = [[5, 6, 7, 8]] * 2, [[5, 6, 9, 9], [1, 2, 3, 4]]
    return {"xlaserve": [_round(0.10, 50.0, same), _round(0.12, 52.0, same), _round(0.50, 10.0, same, clean=False)],
            "transformers": [_round(0.30, 20.0, same), _round(0.36, 26.0, other), _round(0.90, 5.0, same, clean=False)]}


def _doc() -> dict:
    cfg = dict(MH.MODELS["qwen3moe-1b"])
    return {"setup": {"model": "qwen3moe-1b", "config": cfg, "params": MH.param_counts(cfg), "dtype": "float32",
                      "engine": {"experts_weights": MH.STACKED},
                      "peer": {"cache": "dynamic (generate's default)"}, "prompt_len": 128, "new_tokens": 4},
            "machine": {"cpu": "test cpu", "cores": 2}, "cpu": {"cpu_share_of_cores": 0.97, "others_share_of_cores": 0.02},
            "finished": "2026-01-01T00:00:00+0000", "batches": {"16": MH.summarize_batch(_runs(), 4),
                                                                "1": MH.summarize_batch(_runs(), 4)},
            "compilations": {"engine_after_warmup": 0, "during_timing": 0}}


def test_param_counts_of_the_benchmark_model_are_about_1b_total_and_0_2b_active():
    c = MH.param_counts(MH.MODELS["qwen3moe-1b"])
    assert 0.95e9 <= c["total"] <= 1.1e9 and 0.18e9 <= c["active"] <= 0.25e9
    assert c["active_without_input_embedding"] == c["active"] - 32000 * 1024
    assert c["experts"] == 9 * 64 * 3 * 1024 * 512 and c["active_experts"] == c["experts"] // 8
    # transformers 5 writes num_local_experts instead of num_experts
    cfg = {k: v for k, v in MH.MODELS["qwen3moe-tiny"].items() if k != "num_experts"} | {"num_local_experts": 16}
    assert MH.param_counts(cfg) == MH.param_counts(MH.MODELS["qwen3moe-tiny"])


def test_summarize_batch_medians_of_clean_rounds_ratios_and_greedy_agreement():
    s = MH.summarize_batch(_runs(), 4)
    assert (s["rounds"], s["clean_rounds"]) == (3, 2)
    assert s["xlaserve"]["decode_tok_s"] == 51.0 and s["transformers"]["decode_tok_s"] == 23.0
    assert s["xlaserve"]["prefill_ms"] == 110.0 and s["transformers"]["prefill_ms"] == 330.0
    assert s["ratios"]["decode_tok_s"] == pytest.approx(51 / 23, abs=1e-3)
    assert s["ratios"]["prefill_s"] == pytest.approx(3.0, abs=1e-2)          # > 1: xlaserve's prefill is shorter
    gm = s["greedy_match"]
    assert (gm["sequences"], gm["all_equal"], gm["first_token_equal"], gm["of"]) == (6, 4, 5, 4)


def test_render_table_heading_source_and_cells():
    text = "\n".join(MH.render(_doc(), quick=False))
    assert text.startswith("### Mixture of experts: a Qwen3-MoE-shaped model, xlaserve vs transformers")
    assert "_Source: `benchmarks/results/moe_vs_hf.json` (2026-01-01T00:00:00+0000). Host: test cpu, 2 cores" in text
    assert "(1.019 B parameters, 0.227 B active per token)" in text and "64 experts, top-8" in text
    assert "vocabulary 32,000" in text and "128-token random prompts, 4 new tokens" in text
    assert f"given {MH.STACKED}." in text
    lines = text.splitlines()
    assert lines.index(next(ln for ln in lines if ln.startswith("| 1 |"))) < lines.index(
        next(ln for ln in lines if ln.startswith("| 16 |")))                  # batches in numeric order
    assert _row(text, "| 16 |") == ["16", "110", "330", "**3.00×**", "51.0", "23.0", "**2.22×**", "4 of 6", "2 of 3"]
    assert "Engine compilations during the timed rounds: 0." in text
    assert "`benchmarks/results/moe_vs_hf_quick.json`" in "\n".join(MH.render(_doc(), quick=True))


@pytest.mark.parametrize("doc", [{}, {"setup": {}}, {"batches": {"1": {}}}])
def test_render_skips_missing_parts(doc):
    text = "\n".join(MH.render(doc, quick=True))
    assert text.startswith("### Mixture of experts") and "_Source:" in text
    assert ("| batch |" in text) == bool(doc.get("batches"))
    if doc.get("batches"):
        assert _row(text, "| 1 |") == ["1", "–", "–", "–", "–", "–", "–", "–", "– of –"]


def test_experts_call_names_this_tree():
    assert MH.experts_call() in (MH.STACKED, MH.SLICED)


def test_parse_args_defaults_quick_and_full():
    full = MH.parse_args([])
    assert (full.model, full.batches, full.prompt_len, full.new_tokens) == ("qwen3moe-1b", [1, 16], 128, 32)
    assert (full.rounds, full.retries, full.quiet_s) == (3, 2, 60.0)
    quick = MH.parse_args(["--quick"])
    assert (quick.model, quick.batches, quick.prompt_len, quick.new_tokens) == ("qwen3moe-tiny", [1, 4], 32, 16)
    assert (quick.rounds, quick.retries, quick.quiet_s) == (1, 0, 0.0)
    with pytest.raises(SystemExit):
        MH.parse_args(["--new-tokens", "1"])


def _dispatch_doc() -> dict:
    layer = MD.LAYERS["qwen3moe-1b"]
    res = {}
    for T, (r, s, d) in {"16": (800.0, 50.0, 170.0), "1": (500.0, 4.0, 27.0)}.items():
        forms = {"ragged": {"ms": r}, "sorted": {"ms": s}, "dense": {"ms": d}, "scan_slice": {"ms": 3 * s},
                 "scan_stacked": {"ms": s}}
        res[T] = {"forms": forms, "winner": "sorted", "best_block": "sorted_b4", "engine_block": 2,
                  "sorted_vs_ragged_speedup": round(r / s, 1)}
    return {"setup": {"layer": "qwen3moe-1b", **layer, "dtype": "float32"}, "results": res,
            "machine": {"cpu": "test cpu", "cores": 2}, "cpu": {"cpu_share_of_cores": 0.9, "others_share_of_cores": 0.1},
            "finished": "2026-01-01T00:00:00+0000"}


def test_dispatch_flops_and_render():
    layer = MD.LAYERS["qwen3moe-1b"]
    u = MD.useful_gflop(16, layer)
    assert u == pytest.approx(2 * 16 * 8 * 1024 * 3 * 512 / 1e9)
    assert MD.form_gflop("ragged", 16, layer) == pytest.approx(64 * u)
    assert MD.form_gflop("dense", 16, layer) == pytest.approx(8 * u)
    text = "\n".join(MD.render(_dispatch_doc(), quick=False))
    assert text.startswith("### Mixture of experts: the expert FFN's formulations on CPU")
    assert "`benchmarks/results/moe_dispatch.json`" in text and "hidden 1024, 64 experts, top-8" in text
    assert _row(text, "| 1 |") == ["1", "500.00", "4.00", "27.00", "**125.00×**", "4 (engine 2)", "sorted", "12.00", "4.00"]
    assert "`lax.scan` over 3 layers" in text
    assert [ln.split("|")[1].strip() for ln in text.splitlines() if ln.startswith("| 1") or ln.startswith("| 16")] == ["1", "16"]
    assert "| tokens T |" not in "\n".join(MD.render({}, quick=True))


def test_dot_fusions_reads_ynn_fusion_signatures():
    hlo = "\n".join([
        "%fused_computation.1 (param_0: f32[4,1024], param_1: f32[1024,1024]) -> f32[4,1024] {",
        "}",
        "%fused_computation.2 (param_0.1: f32[64,4096], param_1.1: f32[4096,256]) -> f32[64,256] {",
        "}",
        '  %ynn_fusion.1 = f32[4,1024]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_computation.1, '
        'backend_config={"fusion_config":{"kind":"__ynn_fusion"}}',
        '  %ynn_fusion.2 = f32[64,256]{1,0} fusion(%c, %d), kind=kCustom, calls=%fused_computation.2, '
        'backend_config={"fusion_config":{"kind":"__ynn_fusion"}}',
    ])
    assert MD.dot_fusions(hlo) == ["(f32[64,4096], f32[4096,256]) -> f32[64,256]",
                                   "(f32[4,1024], f32[1024,1024]) -> f32[4,1024]"]


def test_jobs_registered_and_rendered(monkeypatch):
    for job, mod in (("moe_vs_hf", MH), ("moe_dispatch", MD)):
        assert M.JOBS[job][0] == job and job in M.BENCHMARKS
        assert M.result_name(job, True) == M.result_name(job, False) == mod.NAME
    docs = {"moe_vs_hf": _doc(), "moe_dispatch": _dispatch_doc(), "parity": {"decoders": {}}}
    monkeypatch.setattr(M, "_load", lambda name, quick: docs.get(name))
    text = M.section(quick=True)
    i, j = (text.index(h) for h in ("### Mixture of experts: a Qwen3-MoE", "### Mixture of experts: the expert FFN"))
    assert i < j and "moe_vs_hf_quick.json" in text and "moe_dispatch_quick.json" in text
