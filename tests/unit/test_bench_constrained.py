"""Pure helpers and the README renderer of benchmarks/constrained_decode.py.

No engine runs here; the benchmark itself is `python -m benchmarks.constrained_decode [--quick]`.
"""
from __future__ import annotations

import json

import pytest

from benchmarks import common as C
from benchmarks import constrained_decode as D


def _req(first: float, gap: float, n: int, reason: str = "length") -> dict:
    return {"events": [(first + k * gap, 1) for k in range(n)], "ids": [7] * n, "finish_reason": reason}


def test_decode_metrics_window_from_the_last_first_token():
    # first tokens at 1, 1.125, 1.25, 1.375 s, then one token every 0.125 s (exact in binary);
    # the last row stops early (its grammar is complete)
    reqs = [_req(1.0 + 0.125 * i, 0.125, 5) for i in range(3)] + [_req(1.375, 0.125, 3, "stop")]
    m = D.decode_metrics(0.0, reqs, 5)
    assert m["tokens_per_row"] == [5, 5, 5, 3] and m["tokens"] == 18
    assert (m["tokens_per_row_min"], m["tokens_per_row_median"], m["tokens_per_row_max"]) == (3, 5.0, 5)
    assert m["rows_at_max_new_tokens"] == 3 and m["finish_reasons"] == {"length": 3, "stop": 1} and m["errors"] == 0
    assert m["prefill_s"] == pytest.approx(1.375) and m["e2e_s"] == pytest.approx(1.75)
    # after 1.375 s up to the last token (1.75 s): rows 0..3 bring 1, 2, 3 and 2 tokens
    assert m["decode_window_tokens"] == 8 and m["decode_tok_s"] == pytest.approx(8 / 0.375, rel=1e-3)
    # up to the first row to finish (row 0 at 1.5 s): one token from each of the four rows
    assert m["full_batch_window_tokens"] == 4 and m["full_batch_decode_tok_s"] == pytest.approx(4 / 0.125, rel=1e-3)
    assert m["ms_per_step_p50"] == pytest.approx(125.0)
    assert m["window"] == pytest.approx((1.375, 1.75))


def test_decode_metrics_counts_errors_and_survives_no_tokens():
    m = D.decode_metrics(0.0, [_req(1.0, 0.1, 2), {"events": [], "ids": [], "finish_reason": "error"}], 2)
    assert m["errors"] == 1 and m["tokens_per_row_min"] == 0
    empty = D.decode_metrics(0.0, [{"events": [], "ids": [], "finish_reason": "error"}], 2)
    assert empty["decode_tok_s"] is None and empty["ms_per_step_p50"] is None and empty["errors"] == 1


def test_mask_metrics_keep_the_calls_inside_the_window():
    calls = [(0.5, 0.010, 2)] + [(1.0 + 0.1 * k, 0.001 * (k + 1), 4) for k in range(4)]      # 1, 2, 3, 4 ms
    consumes = [(0.5, 0.5)] + [(1.0 + 0.1 * k, 0.0002) for k in range(8)]
    m = D.mask_metrics(calls, consumes, (1.0, 1.35))
    assert m["mask_calls"] == 4 and m["mask_rows_p50"] == 4
    assert m["mask_ms_per_step_p50"] == pytest.approx(2.5) and m["mask_ms_per_step_mean"] == pytest.approx(2.5)
    assert m["consume_calls"] == 4 and m["consume_ms_per_step_mean"] == pytest.approx(0.2)
    assert D.mask_metrics(calls, consumes, (5.0, 6.0)) == {"mask_calls": 0}
    assert D.mask_metrics(calls, consumes, None)["mask_calls"] == 5


def _round(tok_s: float, clean: bool = True, **kw) -> dict:
    return {"decode_tok_s": tok_s, "full_batch_decode_tok_s": tok_s * 1.05, "ms_per_step_p50": 16000 / tok_s,
            "prefill_s": 2.0, "tokens_per_row": [128] * 16, "finish_reasons": {"length": 16}, "errors": 0,
            "clean": clean, **kw}


def _runs(free: list[float], con: list[float]) -> dict:
    mask = dict(mask_ms_per_step_p50=1.5, mask_ms_per_step_p99=3.0, mask_ms_per_step_mean=1.6,
                consume_ms_per_step_mean=0.1, mask_rows_p50=16)
    return {"free": [_round(x) for x in free], "constrained": [_round(x, **mask) for x in con]}


def _doc(free: list[float], con: list[float], after_warmup: int = 0) -> dict:
    runs = _runs(free, con)
    doc = {"setup": {"model": "small-v152k", "vocab_size": 151936, "batch": 16, "prompt_len": 128, "new_tokens": 128,
                     "token_budget": 64},
           "machine": {"cpu": "test cpu", "cores": 2}, "cpu": {"cpu_share_of_cores": 0.97, "others_share_of_cores": 0.02},
           "finished": "2026-01-01T00:00:00+0000",
           "decode": {"rounds": runs, "summary": D.summarize_decode(runs),
                      "compilations": {"engine_after_warmup": after_warmup, "during_timing": after_warmup}},
           "compile": {"n": 100, "vocab_size": 151936, "tokenizer_build_s": 1.5,
                       "cases": {name: {"kind": kind, "bytes": 1000 + i, "ms": C.summarize([0.001 * (i + 1), 0.002], 1e3)}
                                 for i, (name, (kind, _)) in enumerate(D.COMPILE_CASES.items())}}}
    doc["targets"] = D.targets(doc)
    return doc


def test_summarize_decode_medians_ratio_and_rows():
    s = D.summarize_decode(_runs([300.0, 310.0, 290.0], [270.0, 280.0, 260.0]))
    dt = s["decode_tok_s"]
    assert dt["free"] == 300.0 and dt["constrained"] == 270.0 and dt["from_clean_rounds"]
    assert dt["ratio_constrained_over_free"] == pytest.approx(0.9)
    assert s["mask_ms_per_step_p50"] == 1.5 and s["mask_rows_p50"] == 16
    assert s["tokens_per_row_constrained"] == {"min": 128, "median": 128, "max": 128, "rows": 48}
    assert s["finish_reasons_free"] == {"length": 48} and s["errors_constrained"] == 0


def test_targets_ratio_and_compilations():
    t = _doc([300.0], [240.0], after_warmup=2)["targets"]
    assert t["decode_tok_s_constrained_over_free"] == {"value": 0.8, "goal": 0.85, "met": False}
    assert t["compilations_after_warmup"] == {"value": 2, "goal": 0, "met": False}
    t = _doc([300.0], [255.0])["targets"]
    assert t["decode_tok_s_constrained_over_free"]["met"] is True and t["compilations_after_warmup"]["met"] is True
    assert D.targets({}) == {}


def _row(text: str, start: str) -> list[str]:
    rows = [ln for ln in text.splitlines() if ln.startswith(start)]
    assert len(rows) == 1, (start, text)
    return [c.strip() for c in rows[0].strip("|").split("|")]


@pytest.mark.parametrize("free, con, ratio, mark", [(300.0, 270.0, "**0.90×**", "✅"),
                                                    (300.0, 255.0, "**0.85×**", "✅"),      # the goal itself
                                                    (300.0, 240.0, "**0.80×**", "❌")])
def test_render_decode_table(free, con, ratio, mark):
    text = "\n".join(D.render(_doc([free], [con]), quick=False))
    assert text.startswith("### Structured generation")
    assert "_Source: `benchmarks/results/constrained_decode.json` (2026-01-01T00:00:00+0000). Host: test cpu, 2 cores" in text
    assert "'small-v152k' Llama (vocabulary 151,936" in text and "token budget 64" in text
    assert _row(text, "| decode tok/s |") == ["decode tok/s", f"{free:.1f}", f"{con:.1f}", ratio, "≥ 0.85×", mark, "1 of 1"]
    assert _row(text, "| tokens per row")[1:3] == ["128 / 128 / 128", "128 / 128 / 128"]
    mask = _row(text, "| grammar mask ms per step")
    assert mask[2].startswith("1.500 / 3.000 (") and "% of a step)" in mask[2]
    assert "Compilations after warmup: 0 (target 0, ✅); during the timed rounds 0" in text
    assert "Constrained rows finished: length 16." in text


def test_render_compile_table_and_quick_source():
    doc = _doc([300.0], [280.0], after_warmup=1)
    text = "\n".join(D.render(doc, quick=True))
    assert "`benchmarks/results/constrained_decode_quick.json`" in text
    assert "Compilations after warmup: 1 (target 0, ❌)" in text
    assert "| grammar | kind | bytes | p50 ms | p99 ms | max ms | n |" in text and "100 distinct texts" in text
    for i, (name, (kind, _)) in enumerate(D.COMPILE_CASES.items()):
        cells = _row(text, f"| {name} |")
        ms = doc["compile"]["cases"][name]["ms"]
        assert cells[1:3] == [kind, f"{1000 + i:,}"] and cells[3] == f"{ms['p50']:.2f}" and cells[4] == f"{ms['p99']:.2f}"
        assert cells[6] == "2"
    assert "1.50 s (median of 6)" in text


@pytest.mark.parametrize("doc", [{}, {"decode": {}, "compile": {}},
                                 {"compile": {"cases": {"x": {"kind": "regex", "ms": {"p50": 1.0}}}}},
                                 {"decode": {"summary": {"decode_tok_s": {"free": 10.0, "constrained": 9.0}}}}])
def test_render_skips_missing_parts(doc):
    text = "\n".join(D.render(doc, quick=True))
    assert text.startswith("### Structured generation") and "_Source:" in text
    assert ("| decode tok/s |" in text) == bool((doc.get("decode") or {}).get("summary"))
    assert ("| grammar | kind |" in text) == bool((doc.get("compile") or {}).get("cases"))
    if "| decode tok/s |" in text:                       # no stored ratio: computed from the medians
        assert _row(text, "| decode tok/s |")[3:6] == ["**0.90×**", "≥ 0.85×", "✅"]


def test_compile_cases_give_distinct_valid_grammars():
    from jax_engine.constrain import grammar

    for name in D.COMPILE_CASES:
        texts = {D.constraint_for(name, i).spec for i in (None, -1, 0, 1)}
        assert len(texts) == 4, name                          # every index misses the compiler's cache
        assert grammar.to_grammar(D.constraint_for(name, 3))  # llguidance accepts the text
    nested = D.constraint_for("nested JSON schema (the decode workload)", None)
    assert json.loads(nested.spec) == D.nested_schema()
    items = D.nested_schema()["properties"]["items"]
    assert items["type"] == "array" and "maxItems" not in items and items["items"]["type"] == "object"
    tool = D.constraint_for('tool call, tool_choice "required", 3 tools', 2)
    assert tool.kind == "json_schema" and "get_weather_2" in tool.spec


def test_parse_args_defaults_quick_and_full():
    full = D.parse_args([])
    assert (full.model, full.batch, full.prompt_len, full.new_tokens) == ("small-v152k", 16, 128, 128)
    assert full.rounds == 3 and full.retries == 2 and full.compile_n == 100 and full.quiet_s == 60.0
    assert full.phases == ["decode", "compile"]
    quick = D.parse_args(["--quick", "--phases", "compile"])
    assert (quick.model, quick.batch, quick.new_tokens, quick.rounds, quick.quiet_s) == ("tiny-v152k", 4, 32, 2, 0.0)
    assert quick.phases == ["compile"]
    with pytest.raises(SystemExit):
        D.parse_args(["--phases", "decode,nope"])


def test_render_the_quick_results_file():
    import os

    path = C.result_path(D.NAME, True)
    if not os.path.isfile(path):
        pytest.skip("no benchmarks/results/constrained_decode_quick.json")
    with open(path) as f:
        doc = json.load(f)
    assert doc["mode"] == "quick"
    text = "\n".join(D.render(doc, quick=True))
    dt = doc["decode"]["summary"]["decode_tok_s"]
    assert f"{dt['ratio_constrained_over_free']:.2f}×" in _row(text, "| decode tok/s |")[3]
    assert all(f"| {name} |" in text for name in doc["compile"]["cases"])
