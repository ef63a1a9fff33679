"""Pure helpers of benchmarks/ragged_step.py: round order, metrics, medians, targets, result shape.

No engine runs here; the benchmark itself is `python -m benchmarks.ragged_step [--quick]`.
"""
from __future__ import annotations

import pytest

from benchmarks import ragged_step as R


def test_alternation_rotates_the_first_side_every_round():
    assert R.alternation(["ragged", "split"], 4) == [["ragged", "split"], ["split", "ragged"],
                                                     ["ragged", "split"], ["split", "ragged"]]
    assert R.alternation(["a", "b", "c"], 3, first=1) == [["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert R.alternation(["only"], 2) == [["only"], ["only"]]
    assert R.alternation(["a", "b"], 0) == []


def test_itl_gaps_are_consecutive_event_differences():
    assert R.itl_gaps([(1.0, 1), (1.5, 1), (1.75, 2)]) == pytest.approx([0.5, 0.25])
    assert R.itl_gaps([(1.0, 1)]) == [] and R.itl_gaps([]) == []


def _rec(t_send: float, first: float, gap: float, n: int, error=None) -> dict:
    events = [(first + i * gap, 1) for i in range(n)]
    return {"t_send": t_send, "events": events, "ids": list(range(n)), "error": error, "t_end": events[-1][0]}


def test_poisson_metrics_ttft_itl_and_rates():
    recs = [_rec(0.0, 0.2, 0.05, 4), _rec(1.0, 1.4, 0.05, 4), _rec(2.0, 2.3, 0.10, 4)]
    m = R.poisson_metrics(recs, rate=1.0, new_tokens=4)
    assert m["errors"] == 0 and m["requests"] == 3 and m["output_tokens"] == 12
    assert m["offered_rate_rps"] == pytest.approx(1.0)                   # 2 gaps over 2 s
    assert m["ttft_p50_ms"] == pytest.approx(300.0)                      # TTFTs 200, 400, 300 ms
    assert m["itl_p50_ms"] == pytest.approx(50.0)                        # six gaps of 50 ms, three of 100
    assert m["itl_p99_ms"] == pytest.approx(100.0)
    assert m["itl_p99_over_p50"] == pytest.approx(2.0)
    assert m["duration_s"] == pytest.approx(2.6)                         # first send -> last token (2.3 + 3 x 0.1)
    assert m["output_tok_s"] == pytest.approx(12 / 2.6, abs=0.1)
    assert set(R.POISSON_KEYS) <= set(m)


def test_poisson_metrics_counts_short_or_failed_requests_as_errors():
    recs = [_rec(0.0, 0.2, 0.05, 4), _rec(0.5, 0.7, 0.05, 3), _rec(1.0, 1.2, 0.05, 4, error="boom")]
    m = R.poisson_metrics(recs, rate=2.0, new_tokens=4)
    assert m["errors"] == 2 and m["ttft_ms"]["n"] == 1
    assert "boom" in m["error_samples"] and "3 tokens" in m["error_samples"]


def test_saturation_metrics_completed_and_steady_decode():
    recs = []
    for i in range(4):      # first tokens at 1.0..1.3 s, then one token every 0.1 s, 5 tokens each
        ev = [(1.0 + 0.1 * i + 0.1 * k, 1) for k in range(5)]
        recs.append({"events": ev, "ids": [0] * 5, "finish_reason": "length"})
    m = R.saturation_metrics(0.0, recs, 5)
    assert "output_ids" not in m and m["streams"] == 4 and m["errors"] == 0
    assert m["completed_tok_s"] == pytest.approx(20 / 1.7)               # last token at 1.7 s
    assert m["prefill_s"] == pytest.approx(1.3) and m["ttft_first_s"] == pytest.approx(1.0)
    assert m["decode_tok_s"] > 0
    assert set(R.SATURATION_KEYS) <= set(m)


def test_compile_delta_and_median_of_prefers_clean_runs():
    assert R.compile_delta({"programs": 20, "jax_compiles": 3, "engine_after_warmup": 0},
                           {"programs": 22, "jax_compiles": 5, "engine_after_warmup": 0}) == \
        {"programs": 2, "jax_compiles": 2, "engine_after_warmup": 0}
    runs = [{"x": 1.0, "clean": True}, {"x": 3.0, "clean": True}, {"x": 100.0, "clean": False}]
    assert R.median_of(runs, "x") == 2.0
    assert R.median_of([{"x": 1.0, "clean": False}, {"x": 5.0, "clean": False}], "x") == 3.0
    assert R.median_of([{"y": 1.0}], "x") is None


def _run(**kw) -> dict:
    return {"clean": True, "errors": 0, "compiles": {"programs": 0, "jax_compiles": 0}, **kw}


def _doc() -> dict:
    """A results document shaped as main() builds it (two rounds per side, one rate)."""
    sat = {"ragged": [_run(completed_tok_s=400.0, decode_tok_s=500.0), _run(completed_tok_s=420.0, decode_tok_s=520.0)],
           "split": [_run(completed_tok_s=300.0, decode_tok_s=450.0), _run(completed_tok_s=300.0, decode_tok_s=450.0)]}
    keys = dict(offered_rate_rps=1.0, ttft_p99_ms=300.0, itl_p50_ms=20.0, itl_p99_ms=90.0, output_tok_s=100.0,
                duration_s=20.0)
    pois = {"ragged": [_run(**keys, ttft_p50_ms=150.0, itl_p99_over_p50=4.5), _run(**keys, ttft_p50_ms=150.0,
                                                                                  itl_p99_over_p50=3.5)],
            "split": [_run(**keys, ttft_p50_ms=140.0, itl_p99_over_p50=9.0),
                      _run(**keys, ttft_p50_ms=120.0, itl_p99_over_p50=9.0, compiles={"programs": 1})]}
    return {"setup": {"streams": 32}, "machine": {"cpu": "test cpu", "cores": 2},
            "saturation": {"rounds": sat, "summary": R.pair_table(sat["ragged"], sat["split"], ["completed_tok_s",
                                                                                                  "decode_tok_s"])},
            "poisson": {"1": {"rate": 1.0, "rounds": pois, "summary": R.pair_table(pois["ragged"], pois["split"],
                                                                                  R.POISSON_KEYS)}},
            "compiles": {"ragged": {"timed_programs_added": 0}},
            "budget_sweep": {"512": {"1": {k: 1.0 for k in R.POISSON_KEYS}},
                             "64": {"1": {**{k: 2.0 for k in R.POISSON_KEYS}, "errors": 1}}}}


def test_pair_table_medians_and_ratio():
    s = _doc()["saturation"]["summary"]["completed_tok_s"]
    assert s["ragged"] == 410.0 and s["split"] == 300.0 and s["from_clean_rounds"]
    assert s["ratio_ragged_over_split"] == pytest.approx(410 / 300, abs=1e-3)


def test_targets_check_the_issue_goals():
    doc = _doc()
    t = R.targets(doc)
    assert t["saturation_completed_tok_s_ragged_over_split"]["met"] is True          # 1.37 >= 1.3
    assert t["poisson_1_itl_p99_over_p50_ragged"] == {"value": 4.0, "goal": 4.0, "met": True}
    ttft = t["poisson_1_ttft_p50_ragged_over_split"]                                  # 150 / 130 = 1.154 <= 1.2
    assert ttft["value"] == pytest.approx(150 / 130, abs=1e-3) and ttft["met"] is True
    assert t["ragged_programs_added_in_timed_runs"]["met"] is True
    assert t["errors"]["value"] == 1 and t["errors"]["met"] is False                  # the sweep's error counts


def test_timed_runs_and_compile_summary():
    doc = _doc()
    assert len(R.timed_runs(doc, "ragged")) == 4 and len(R.timed_runs(doc, "split")) == 4
    load = {"warmup": "lazy", "counts": {"programs": 0}}
    c = R.compile_summary(load, {"programs": 40, "engine_after_warmup": 0}, R.timed_runs(doc, "split"))
    assert c == {"warmup": "lazy", "programs_at_load": 0, "programs_end": 40, "engine_compilations_after_warmup": 0,
                 "timed_programs_added": 1, "timed_jax_compiles": 0}


def test_sweep_rows_are_sorted_by_rate_then_budget():
    rows = R.sweep_rows({"512": {"1": {"itl_p99_ms": 5.0}, "2": {"itl_p99_ms": 6.0}}, "64": {"1": {"itl_p99_ms": 9.0}}})
    assert [(r["rate"], r["budget"]) for r in rows] == [(1.0, 64), (1.0, 512), (2.0, 512)]
    assert rows[0]["itl_p99_ms"] == 9.0 and rows[0]["ttft_p50_ms"] is None


def test_report_lines_name_the_host_and_the_ratios():
    doc = _doc()
    doc["targets"] = R.targets(doc)
    text = "\n".join(R.report_lines(doc))
    assert text.startswith("Host: test cpu, 2 cores")
    assert "saturation (32 streams)" in text and "poisson 1 req/s" in text and "budget    64 at 1 req/s" in text


def test_settings_defaults_quick_and_full():
    full = R.settings(R.parse_args([]))
    assert full["model"] == "small" and full["streams"] == 32 and full["budget"] == 64 and full["split_budget"] == 512
    assert full["rates"] == [0.5, 1.0, 2.0] and full["budgets"] == [64, 96, 128, 256, 512]
    assert full["sweep_rates"] == [1.0, 2.0] and full["prompt_len"] == 128 and full["new_tokens"] == 128
    assert full["max_model_len"] == 512 and full["split_commit"] == "fa23e3a" and full["split_warmup"] == "aot"
    quick = R.settings(R.parse_args(["--quick", "--rates", "1,4"]))
    assert quick["model"] == "tiny" and quick["rounds"] == 1 and quick["rates"] == [1.0, 4.0]
    assert quick["split_warmup"] == "lazy" and full["seed"] == quick["seed"] == 8
    assert quick["prompt_len"] + quick["new_tokens"] <= quick["max_model_len"]
    with pytest.raises(SystemExit):
        R.settings(R.parse_args(["--phases", "saturation,nope"]))


def test_rate_key():
    assert R.rate_key(0.5) == "0.5" and R.rate_key(2.0) == "2" and R.rate_key(1) == "1"


@pytest.mark.parametrize("n", [6, 20])
def test_default_seed_sends_the_named_rate(n):
    seed = R.settings(R.parse_args([]))["seed"]
    for rate in (0.5, 1.0, 2.0):
        t = R.arrival_times(n, rate, seed)
        assert (n - 1) / t[-1] == pytest.approx(rate, rel=0.02)


# =============================================================================================
# the README renderer: benchmarks/__main__.py sec_ragged_step
# =============================================================================================
from benchmarks import __main__ as M  # noqa: E402


def _row(text: str, start: str) -> str:
    """The one table row (or line) of a rendered section that starts with `start`."""
    rows = [ln for ln in text.splitlines() if ln.startswith(start)]
    assert len(rows) == 1, (start, text)
    return rows[0]


def _sat_doc(ragged: float, split: float) -> dict:
    sat = {"ragged": [_run(completed_tok_s=ragged, decode_tok_s=500.0)],
           "split": [_run(completed_tok_s=split, decode_tok_s=400.0)]}
    return {"setup": {"streams": 32}, "saturation": {"rounds": sat, "summary": R.pair_table(
        sat["ragged"], sat["split"], ["completed_tok_s", "decode_tok_s"])}}


@pytest.mark.parametrize("ragged, split, ratio, mark", [(450.0, 300.0, "**1.50×**", "✅"),
                                                        (330.0, 300.0, "**1.10×**", "❌"),
                                                        (390.0, 300.0, "**1.30×**", "✅")])     # the goal itself
def test_sec_ragged_step_saturation_ratio_and_mark_come_from_the_numbers(ragged, split, ratio, mark):
    text = "\n".join(M.sec_ragged_step(_sat_doc(ragged, split), quick=False))
    row = _row(text, "| completed tok/s")
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:7] == [f"{ragged:.1f}", f"{split:.1f}", ratio, "≥ 1.3×", mark, "1 of 1"]
    assert "| saturation: 32 concurrent streams |" in text
    assert "**1.25×**" in _row(text, "| steady decode tok/s")                 # 500 / 400, no target
    assert "Poisson" not in text and "budget sweep" not in text            # phases absent: skipped


def test_sec_ragged_step_ratio_without_a_stored_ratio_and_the_recorded_goal():
    doc = {"saturation": {"summary": {"completed_tok_s": {"ragged": 450.0, "split": 300.0}}}}
    row = _row("\n".join(M.sec_ragged_step(doc, quick=True)), "| completed tok/s")
    assert "**1.50×**" in row and "≥ 1.3×" in row and "✅" in row and row.endswith("| – |")    # no rounds known
    doc["targets"] = {"saturation_completed_tok_s_ragged_over_split": {"value": 1.5, "goal": 1.6, "met": False}}
    row = _row("\n".join(M.sec_ragged_step(doc, quick=True)), "| completed tok/s")
    assert "≥ 1.6×" in row and "❌" in row and "✅" not in row
    doc["saturation"]["summary"]["completed_tok_s"]["split"] = None          # nothing to divide: no mark
    row = _row("\n".join(M.sec_ragged_step(doc, quick=True)), "| completed tok/s")
    assert "| – | ≥ 1.6× | – |" in row


def _pois_doc(ttft_ragged: float, ttft_split: float, spread_ragged: float) -> dict:
    keys = dict(offered_rate_rps=0.49, ttft_p99_ms=300.0, itl_p50_ms=20.0, itl_p99_ms=90.0, output_tok_s=100.0,
                duration_s=20.0)
    runs = {"ragged": [_run(**keys, ttft_p50_ms=ttft_ragged, itl_p99_over_p50=spread_ragged)],
            "split": [_run(**{**keys, "itl_p50_ms": 25.0, "itl_p99_ms": 250.0, "output_tok_s": 90.0},
                           ttft_p50_ms=ttft_split, itl_p99_over_p50=10.0, errors=2)]}
    return {"setup": {"requests": 20}, "poisson": {"0.5": {"rate": 0.5, "rounds": runs, "summary": R.pair_table(
        runs["ragged"], runs["split"], R.POISSON_KEYS)}}}


@pytest.mark.parametrize("ttft, spread, ttft_mark, itl_mark", [((150.0, 130.0), 3.5, "✅", "✅"),
                                                               ((160.0, 130.0), 4.5, "❌", "❌"),
                                                               ((100.0, 130.0), 4.0, "✅", "✅")])
def test_sec_ragged_step_poisson_row(ttft, spread, ttft_mark, itl_mark):
    text = "\n".join(M.sec_ragged_step(_pois_doc(*ttft, spread), quick=False))
    cells = [c.strip() for c in _row(text, "| 0.49 (0.5)").strip("|").split("|")]
    ratio = f"**{ttft[0] / ttft[1]:.2f}×**"
    assert cells == ["0.49 (0.5)", f"{ttft[0]:.1f} / {ttft[1]:.1f}", ratio, "≤ 1.2×", ttft_mark,
                     "20.00 / 90.00", f"{spread:.2f}", "≤ 4×", itl_mark,          # ragged ITL, its spread and goal
                     "25.00 / 250.00", "10.00",                                   # split, for contrast
                     "100.0 / 90.0", "2", "1 of 1"]
    assert "saturation:" not in text and "Errors in all timed runs: 2 (target 0, ❌)." in text


def test_sec_ragged_step_itl_spread_from_p99_and_p50_when_not_recorded():
    doc = {"poisson": {"1": {"rate": 1.0, "summary": {"itl_p50_ms": {"ragged": 10.0, "split": 10.0},
                                                      "itl_p99_ms": {"ragged": 50.0, "split": 20.0}}}}}
    row = _row("\n".join(M.sec_ragged_step(doc, quick=False)), "| – (1)")
    assert "| 5.00 | ≤ 4× | ❌ |" in row and "| 2.00 |" in row
    assert "| – / – | – | ≤ 1.2× | – |" in row                                # no TTFT: no ratio, no mark


def test_sec_ragged_step_budget_sweep_compiles_and_commits():
    doc = _doc()
    doc["setup"] = {"budget": 512, "split_commit": "fa23e3a", "split_warmup": "aot", "ragged_warmup": "aot",
                    "trees": {"ragged": {"commit": "a" * 40, "engine_files_changed": ["jax_engine/x.py"],
                                         "engine_files_untracked": [], "engine_diff_sha1": "0123456789ab"},
                              "split": {"commit": "f" * 40, "engine_files_changed": [], "engine_diff_sha1": None}}}
    doc["budget_sweep"]["512"]["1"]["reused_from"] = "poisson comparison"
    doc["budget_sweep"]["64"]["1"]["compiles"] = [{"programs": 3}]
    doc["engines"] = {"ragged@512": {"counts": {"programs": 30}}, "ragged-b64@64": {"counts": {"programs": 22}}}
    doc["compiles"] = {"ragged": {"warmup": "aot", "programs_at_load": 30, "programs_end": 32, "timed_programs_added": 2,
                                  "timed_jax_compiles": 2, "engine_compilations_after_warmup": 0},
                       "split": {"warmup": "aot", "programs_at_load": 140, "programs_end": 140,
                                 "timed_programs_added": 0, "timed_jax_compiles": 0,
                                 "engine_compilations_after_warmup": 0}}
    doc["plots"] = ["benchmarks/results/ragged_step_budget.png"]
    text = "\n".join(M.sec_ragged_step(doc, quick=False))
    assert "_Source: `benchmarks/results/ragged_step.json`" in text and "Host: test cpu, 2 cores" in text
    assert "ragged: commit `aaaaaaaaaa` + local changes to 1 engine file(s)" in text and "`0123456789ab`" in text
    assert "split: commit `ffffffffff` (fa23e3a)" in text
    sweep = [ln for ln in text.splitlines() if ln.startswith(("| 64 ", "| **512** (default)"))]
    assert [ln.split("|")[1].strip() for ln in sweep] == ["64", "**512** (default)"]    # sorted by rate, budget
    assert sweep[0].split("|")[3:10] == [" 2.00 ", " 2.00 ", " 2.00 ", " 2.00 ", " 2.0 ", " 1 ", " 22 (+3) "]
    assert sweep[1].rstrip().endswith("| (above) | 30 |")
    assert "| ragged | aot | 30 | 32 | 2 (❌ target 0) | 2 | 0 |" in text
    assert "| split | aot | 140 | 140 | 0 | 0 | 0 |" in text and "--split-warmup lazy" not in text
    assert "![ragged_step_budget.png](benchmarks/results/ragged_step_budget.png)" in text


@pytest.mark.parametrize("doc", [{}, {"setup": {}, "poisson": {}, "budget_sweep": {}, "compiles": {}},
                                 {"budget_sweep": {"128": {"2": {"ttft_p50_ms": 5.0}}}},
                                 {"compiles": {"split": {"warmup": "lazy", "timed_programs_added": 1}}}])
def test_sec_ragged_step_skips_missing_phases(doc):
    text = "\n".join(M.sec_ragged_step(doc, quick=True))
    assert text.startswith("### One ragged step program vs the split") and "_Source:" in text
    assert ("| completed tok/s" in text) is False and ("| budget |" in text) == bool(doc.get("budget_sweep"))
    assert ("| engine | compile at start" in text) == bool(doc.get("compiles"))


def test_ragged_step_job_is_registered_and_rendered_after_serving(monkeypatch):
    assert M.JOBS["ragged_step"][0] == "ragged_step" and "ragged_step" in M.BENCHMARKS
    assert M.result_name("ragged_step", True) == M.result_name("ragged_step", False) == R.NAME
    jobs = list(M.JOBS)
    assert jobs.index("serve_load") < jobs.index("ragged_step")
    docs = {"serve_load": {"targets": {}}, "ragged_step": _sat_doc(450.0, 300.0),
            "parity": {"decoders": {}}, "tests": {"setup": {"command": "pytest", "cache": "warm"}}}
    monkeypatch.setattr(M, "_load", lambda name, quick: docs.get(name))
    text = M.section(quick=True)
    i, j, k = (text.index(h) for h in ("### Serving through", "### One ragged step program", "### Parity"))
    assert i < j < k and "ragged_step_quick.json" in text


def test_sec_ragged_step_renders_the_quick_results_file():
    path = M.C.result_path(R.NAME, True)
    if not M.os.path.isfile(path):
        pytest.skip("no benchmarks/results/ragged_step_quick.json")
    doc = M._load(R.NAME, True)
    text = "\n".join(M.sec_ragged_step(doc, quick=True))
    s = doc["saturation"]["summary"]["completed_tok_s"]
    want = "✅" if s["ratio_ragged_over_split"] >= R.SATURATION_GOAL else "❌"
    assert f"**{s['ratio_ragged_over_split']:.2f}×** | ≥ 1.3× | {want}" in _row(text, "| completed tok/s")
    for rate in doc["poisson"]:
        assert f"({float(rate):g}) |" in text
    assert all(f"![{M.os.path.basename(p)}]({p})" in text for p in doc["plots"])


def test_start_time_program_counts_follow_the_ragged_log_line():
    """The decode worker's warmup line now names ragged step buckets; start_time still reads the
    per-model count, and sec_start_time lists whatever models and counts it found."""
    from benchmarks.start_time import parse_programs

    log = ("INFO xlaserve-demo-random: 28 programs compiled in 9.5s (ragged step: token buckets [1, 2, 4], "
           "page buckets [8])\ncompile all-MiniLM-L6-v2: 100%|##########| 45/45 [00:03<00:00, 12.27prog/s]\n")
    progs = parse_programs(log)
    assert progs == {"xlaserve-demo-random": {"programs": 28, "warmup_s": 9.5}, "all-MiniLM-L6-v2": {"programs": 45}}
    doc = {"setup": {"server_torch_blocked": True}, "cold": {"ready_s": 30.0, "runs_s": [30.0], "programs": progs},
           "runs": {"cold": [{"ready_s": 30.0, "cache_bytes_after": 2 ** 20}]}}
    text = "\n".join(M.sec_start_time(doc, quick=True))
    row = _row(text, "| cold: empty cache")
    assert "xlaserve-demo-random 28" in row and "all-MiniLM-L6-v2 45" in row


def test_saturation_flops_and_compute_floor():
    """Hand-counted: H 4, 1 layer, 2 heads of 2 (1 KV head), I 8, V 10; 2 streams, 3-token
    prompts, 2 new tokens: 4 fed tokens each, contexts 1..4."""
    from benchmarks.ragged_step import compute_floor, saturation_flops

    cfg = {"hidden_size": 4, "num_hidden_layers": 1, "vocab_size": 10, "num_attention_heads": 2,
           "num_key_value_heads": 1, "intermediate_size": 8}
    layer = 4 * (2 + 2) * 2 + 2 * 2 * 4 + 3 * 4 * 8           # qkv + o + gate/up/down weights
    want = 2 * (2 * layer * 4 + 2 * 10 * 4 * 2 + 4 * 2 * 2 * (1 + 2 + 3 + 4))
    assert saturation_flops(cfg, streams=2, prompt_len=3, new_tokens=2) == want
    fl = compute_floor(want, 1e-6, streams=2, new_tokens=2)   # 1000 FLOP/s
    assert fl["floor_s"] == round(want / 1e3, 3) and fl["max_completed_tok_s"] == round(4 / (want / 1e3), 1)
    assert compute_floor(want, None, 2, 2) == {}
