"""The pure helpers, argument handling and README renderer of benchmarks/lora_decode.py, and the
adapter folders it writes (read back by PEFT and by the engine's loader).

No engine runs here; the benchmark itself is `python -m benchmarks.lora_decode [--quick]`.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import common as C
from benchmarks import lora_decode as D


def _round(tok_s: float, clean: bool = True, digests=None, **kw) -> dict:
    return {"decode_tok_s": tok_s, "full_batch_decode_tok_s": tok_s * 1.05, "ms_per_step_p50": 16000 / tok_s,
            "prefill_s": 2.0, "tokens_per_row": [128] * 16, "finish_reasons": {"length": 16}, "errors": 0,
            "row_digests": digests or [f"r{i}" for i in range(16)], "clean": clean, **kw}


def _runs(base: list[float], lora: list[float], off: list[float] | None = None) -> dict:
    runs = {"base": [_round(x) for x in base],
            "lora": [_round(x, digests=[f"r{i}" if i < 2 else f"l{i}" for i in range(16)]) for x in lora]}
    if off is not None:
        runs["base_lora_off"] = [_round(x) for x in off]
    return runs


def _doc(base: list[float], lora: list[float], off: list[float] | None = None, after_warmup: int = 0,
         load_compiles: int = 0) -> dict:
    runs = _runs(base, lora, off)
    kernels = [D.kernel_row(T, S, R, {"base": [0.002], "stacked": [0.0005 * S * R / 16], "gathered": [0.001 * S * R / 16]},
                            1e-6, 1000)
               for T in D.KERNEL_TOKENS for S in D.KERNEL_SLOTS for R in D.KERNEL_RANKS]
    doc = {"setup": {"model": "small", "dtype": "float32", "batch": 16, "prompt_len": 128, "new_tokens": 128,
                     "adapters": 4, "rank": 16, "max_loras": 4, "max_lora_rank": 16, "token_budget": 64},
           "machine": {"cpu": "test cpu", "cores": 2}, "cpu": {"cpu_share_of_cores": 0.97, "others_share_of_cores": 0.02},
           "finished": "2026-01-01T00:00:00+0000",
           "decode": {"rounds": runs, "summary": D.summarize_decode(runs),
                      "compilations": {"engine_after_warmup": after_warmup, "during_timing": after_warmup}},
           "load": {"rank": 16, "adapter_bytes": 11 * 2 ** 20, "first_load_ms": 900.0,
                    **D.summarize_loads([0.120, 0.100, 0.140], [0.050, 0.040, 0.060]),
                    "compilations": {"engine_after_warmup": load_compiles, "during_loads": load_compiles}},
           "kernels": {"model": "small", "dtype": "float32", "reps": 50, "rows": kernels}}
    doc["targets"] = D.targets(doc)
    return doc


def test_summarize_decode_medians_ratios_and_rows():
    s = D.summarize_decode(_runs([300.0, 310.0, 290.0], [270.0, 280.0, 260.0], [305.0, 300.0, 295.0]))
    dt = s["decode_tok_s"]
    assert (dt["base"], dt["lora"], dt["base_lora_off"]) == (300.0, 270.0, 300.0) and dt["from_clean_rounds"]
    assert dt["ratio_lora_over_base"] == pytest.approx(0.9)
    assert dt["ratio_base_over_base_lora_off"] == pytest.approx(1.0)
    assert dt["ratio_lora_over_base_lora_off"] == pytest.approx(0.9)
    assert set(dt["all_rounds"]) == {"lora/base", "base/base_lora_off", "lora/base_lora_off"}
    assert s["tokens_per_row_lora"] == {"min": 128, "median": 128, "max": 128, "rows": 48}
    assert s["errors_base"] == 0
    # round by round: 14 of 16 lora rows differ from base; base rows equal with LoRA on and off
    assert s["rows_lora_vs_base"] == {"rows": 48, "equal": 6, "differ": 42}
    assert s["rows_base_vs_base_lora_off"] == {"rows": 48, "equal": 48, "differ": 0}


def test_summarize_decode_without_the_lora_off_side_and_with_disturbed_rounds():
    runs = _runs([300.0, 100.0], [240.0, 50.0])
    runs["base"][1]["clean"] = runs["lora"][1]["clean"] = False
    s = D.summarize_decode(runs)
    dt = s["decode_tok_s"]
    assert dt["base"] == 300.0 and dt["lora"] == 240.0 and dt["ratio_lora_over_base"] == pytest.approx(0.8)
    assert "base_lora_off" not in dt and "ratio_base_over_base_lora_off" not in dt
    assert s["rows_base_vs_base_lora_off"] is None and s["rows_lora_vs_base"]["rows"] == 32


def test_targets_ratio_and_compilations():
    t = _doc([300.0], [210.0], [300.0], after_warmup=2, load_compiles=1)["targets"]
    assert t["decode_tok_s_lora_over_base"] == {"value": 0.7, "goal": 0.8, "met": False}
    assert t["compilations_after_warmup"] == {"value": 2, "goal": 0, "met": False}
    assert t["compilations_after_loads"] == {"value": 1, "goal": 0, "met": False}
    t = _doc([300.0], [240.0], [300.0])["targets"]
    assert t["decode_tok_s_lora_over_base"]["met"] is True          # the goal itself
    assert t["compilations_after_warmup"]["met"] is True and t["compilations_after_loads"]["met"] is True
    assert D.targets({}) == {}


def test_kernel_row_ratios():
    r = D.kernel_row(16, 4, 16, {"base": [0.002, 0.004, 0.003], "stacked": [0.0006], "gathered": [0.0012]}, 2e-7, 10)
    assert r["ms_p50"] == {"base": 3.0, "stacked": 0.6, "gathered": 1.2} and r["n"] == 1
    assert r["gathered_over_stacked"] == pytest.approx(2.0) and r["stacked_over_base"] == pytest.approx(0.2)
    assert r["gathered_over_base"] == pytest.approx(0.4) and r["max_abs_diff"] == 2e-7
    assert D.kernel_row(16, 4, 16, {"base": [], "stacked": [0.001], "gathered": [0.001]})["stacked_over_base"] is None


def test_summarize_loads():
    s = D.summarize_loads([0.1, 0.3, 0.2], [0.05])
    assert s["load_ms"]["p50"] == pytest.approx(200.0) and s["load_ms"]["n"] == 3
    assert s["host_read_ms"]["p50"] == pytest.approx(50.0)


def test_request_adapters_cycle_over_the_adapters():
    assert [D.request_adapter("lora", i, 4) for i in range(6)] == ["lora0", "lora1", "lora2", "lora3", "lora0", "lora1"]
    assert {D.request_adapter(s, i, 4) for s in ("base", "base_lora_off") for i in range(6)} == {None}
    assert D.digest([1, 2, 3]) == D.digest([1, 2, 3]) != D.digest([1, 2, 4])


def _row(text: str, start: str) -> list[str]:
    rows = [ln for ln in text.splitlines() if ln.startswith(start)]
    assert len(rows) == 1, (start, text)
    return [c.strip() for c in rows[0].strip("|").split("|")]


@pytest.mark.parametrize("base, lora, ratio, mark", [(300.0, 270.0, "**0.90×**", "✅"),
                                                     (300.0, 240.0, "**0.80×**", "✅"),      # the goal itself
                                                     (300.0, 210.0, "**0.70×**", "❌")])
def test_render_decode_table(base, lora, ratio, mark):
    text = "\n".join(D.render(_doc([base], [lora], [310.0]), quick=False))
    assert text.startswith("### Multi-LoRA: decode with 4 adapters in the batch")
    assert "_Source: `benchmarks/results/lora_decode.json` (2026-01-01T00:00:00+0000). Host: test cpu, 2 cores" in text
    assert "Random 'small' Llama (float32)" in text and "token budget 64" in text and "max_lora_rank 16" in text
    assert "4 PEFT adapters of rank 16" in text and "adapter i mod 4" in text
    assert _row(text, "| decode tok/s |") == ["decode tok/s", "310.0", f"{base:.1f}", f"{lora:.1f}", ratio, "≥ 0.8×",
                                              mark, f"**{base / 310.0:.2f}×**", "1 of 1"]
    assert _row(text, "| tokens per row")[1:4] == ["128 / 128 / 128"] * 3
    assert _row(text, "| ms per step (p50) |")[1] == f"{16000 / 310.0:.2f}"
    assert "Compilations after warmup: 0 (target 0, ✅); during the timed rounds 0." in text
    assert "differ from the same round's base row: 14 of 16; base rows identical with LoRA on and off: 16 of 16." in text


def test_render_load_and_kernel_tables_and_quick_source():
    doc = _doc([300.0], [280.0], None, after_warmup=1, load_compiles=1)
    text = "\n".join(D.render(doc, quick=True))
    assert "`benchmarks/results/lora_decode_quick.json`" in text
    assert "Compilations after warmup: 1 (target 0, ❌)" in text
    assert _row(text, "| decode tok/s |")[1] == "–" and _row(text, "| decode tok/s |")[7] == "–"   # no LoRA-off side
    assert ("Adapter load (`Engine.load_adapter_sync`, rank 16, 7 modules, 11.0 MiB of safetensors" in text
            and "p50 120.0 ms, max 140.0 ms (n 3; the first load, 900.0 ms, not counted)" in text
            and "host: p50 50.0 ms. Compilations after the loads: 1 (target 0, ❌)." in text)
    assert "| tokens T | slots | max rank | base ms | stacked ms | gathered ms |" in text and "median of 50 calls" in text
    for r in doc["kernels"]["rows"]:
        cells = _row(text, f"| {r['T']} | {r['slots']} | {r['rank']} |")
        S, R = r["slots"], r["rank"]
        assert cells[3:6] == ["2.000", f"{0.5 * S * R / 16:.3f}", f"{S * R / 16:.3f}"]
        assert cells[6] == "2.00×" and cells[7] == f"{100 * 0.25 * S * R / 16:.0f} %"


@pytest.mark.parametrize("doc", [{}, {"decode": {}, "load": {}, "kernels": {}},
                                 {"kernels": {"rows": [{"T": 16, "slots": 4, "rank": 16, "ms_p50": {"base": 1.0}}]}},
                                 {"load": {"load_ms": {"p50": 10.0}}},
                                 {"decode": {"summary": {"decode_tok_s": {"base": 10.0, "lora": 9.0}}}}])
def test_render_skips_missing_parts(doc):
    text = "\n".join(D.render(doc, quick=True))
    assert text.startswith("### Multi-LoRA") and "_Source:" in text
    assert ("| decode tok/s |" in text) == bool((doc.get("decode") or {}).get("summary"))
    assert ("Adapter load" in text) == bool((doc.get("load") or {}).get("load_ms"))
    assert ("| tokens T |" in text) == bool((doc.get("kernels") or {}).get("rows"))
    if "| decode tok/s |" in text:                       # no stored ratio: computed from the medians
        assert _row(text, "| decode tok/s |")[4:7] == ["**0.90×**", "≥ 0.8×", "✅"]


def test_parse_args_defaults_quick_and_full():
    full = D.parse_args([])
    assert (full.model, full.batch, full.prompt_len, full.new_tokens) == ("small", 16, 128, 128)
    assert (full.adapters, full.rank, full.rounds, full.retries, full.loads, full.kernel_reps) == (4, 16, 3, 2, 5, 50)
    assert full.quiet_s == 60.0 and full.phases == ["decode", "load", "kernels"] and not full.no_lora_off
    quick = D.parse_args(["--quick", "--phases", "kernels"])
    assert (quick.model, quick.batch, quick.prompt_len, quick.new_tokens) == ("tiny", 4, 32, 32)
    assert (quick.rounds, quick.retries, quick.loads, quick.kernel_reps, quick.quiet_s) == (2, 0, 3, 10, 0.0)
    assert quick.phases == ["kernels"]
    with pytest.raises(SystemExit):
        D.parse_args(["--phases", "decode,nope"])
    with pytest.raises(SystemExit):
        D.parse_args(["--rank", "0"])


def test_adapter_tensors_use_peft_names_and_shapes():
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
           "num_hidden_layers": 2}
    t = D.adapter_tensors(cfg, rank=8, seed=1)
    assert len(t) == 2 * 7 * 2
    assert t["base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"].shape == (8, 64)
    assert t["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"].shape == (32, 8)
    assert t["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (8, 128)
    assert t["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"].shape == (128, 8)
    assert all(v.dtype == np.float32 and np.abs(v).min() > 0 for v in t.values())   # B is not PEFT's zero init
    c = D.adapter_config(8, "/base")
    assert (c["peft_type"], c["r"], c["lora_alpha"], c["target_modules"]) == ("LORA", 8, 16.0, list(D.MODULES))


def test_written_adapter_reads_back_in_peft_and_the_engine(tmp_path):
    """The folder the benchmark writes is a PEFT adapter (PEFT loads every tensor as written) and the
    engine's loader lays it out as PEFT applies it (B scaled by lora_alpha / r)."""
    pytest.importorskip("peft")
    torch = pytest.importorskip("torch")
    from peft import PeftModel

    from jax_engine.lora.adapter import load_adapter
    from jax_engine.models.llama import LlamaConfig
    from tests.helpers import hf_models

    base = hf_models.build("llama3", str(tmp_path / "base"))
    with open(tmp_path / "base" / "config.json") as f:
        cfg = json.load(f)
    path = D.write_adapter(str(tmp_path / "ad"), cfg, str(tmp_path / "base"), rank=8, seed=3)
    want = D.adapter_tensors(cfg, rank=8, seed=3)
    prompt = torch.tensor([list(range(3, 20))])
    with torch.no_grad():
        before = base(prompt).logits
    peft_model = PeftModel.from_pretrained(base, path).eval()
    for layer in range(cfg["num_hidden_layers"]):
        for m, sub in D.MODULES.items():
            mod = getattr(getattr(peft_model.base_model.model.model.layers[layer], sub), m)
            for ab, lin in (("A", mod.lora_A["default"]), ("B", mod.lora_B["default"])):
                np.testing.assert_array_equal(lin.weight.detach().numpy(), want[D.tensor_name(layer, m, ab)])
    with torch.no_grad():
        assert (peft_model(prompt).logits - before).abs().max() > 1e-3, "the adapter must change the logits"

    ad = load_adapter("x", path, LlamaConfig.from_hf(cfg), 16, np.dtype(np.float32))
    assert ad.rank == 8 and ad.scaling == 2.0 and ad.target_modules == list(D.MODULES)
    np.testing.assert_allclose(ad.arrays["down_a"][1, :, :8], want[D.tensor_name(1, "down_proj", "A")].T)
    np.testing.assert_allclose(ad.arrays["down_b"][1, :8], want[D.tensor_name(1, "down_proj", "B")].T * 2.0)
    np.testing.assert_allclose(ad.arrays["qkv_a"][0, :, 0, :8], want[D.tensor_name(0, "q_proj", "A")].T)
    assert not ad.arrays["down_a"][:, :, 8:].any()                 # padded to the maximum rank with zeros


def test_render_the_quick_results_file():
    import os

    path = C.result_path(D.NAME, True)
    if not os.path.isfile(path):
        pytest.skip("no benchmarks/results/lora_decode_quick.json")
    with open(path) as f:
        doc = json.load(f)
    assert doc["mode"] == "quick"
    text = "\n".join(D.render(doc, quick=True))
    dt = ((doc.get("decode") or {}).get("summary") or {}).get("decode_tok_s")
    if dt and dt.get("ratio_lora_over_base") is not None:
        assert f"{dt['ratio_lora_over_base']:.2f}×" in _row(text, "| decode tok/s |")[4]
    assert len([ln for ln in text.splitlines() if ln.startswith("| 16 |") or ln.startswith("| 64 |")]) == \
        len((doc.get("kernels") or {}).get("rows") or [])
