"""benchmarks/grammar_mask.py (llguidance vs xgrammar mask time) and its README renderer.

The pure helpers and the renderer run on fabricated numbers; the worker tests run each library's
worker in-process on the demo tokenizer for a few steps (xgrammar's skip where it is not
installed: it comes with the `bench` extra). The benchmark itself is
`python -m benchmarks.grammar_mask [--quick]`.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import __main__ as M
from benchmarks import grammar_mask as G


def test_documents_are_different_valid_and_in_schema_order():
    docs = G.make_documents(16)
    assert len(docs) == 16 and len({json.dumps(d) for d in docs}) == 16
    assert docs == G.make_documents(16) and docs != G.make_documents(16, seed=18)      # seeded
    order = list(G.SCHEMA["properties"])
    for d in docs:
        keys = list(d)
        assert keys == sorted(keys, key=order.index)                 # the schema's property order
        assert set(G.SCHEMA["required"]) <= set(d)
        for o in d["orders"]:
            assert list(o) == sorted(o, key=list(G.SCHEMA["properties"]["orders"]["items"]["properties"]).index)
    assert {len(d["orders"]) for d in docs} == {1, 2, 3, 4} and any("geo" in d["address"] for d in docs)
    texts = G.document_texts(16)
    assert [json.loads(t) for t in texts] == docs and texts == [G.render(d, "compact") for d in docs]   # the server's
    flexible = G.document_texts(16, whitespace="flexible")
    assert [json.loads(t) for t in flexible] == docs and flexible[0] == texts[0] and "\n  " in flexible[2]
    assert G.document_styles(4, "flexible") == ["compact", "spaced", "indent2", "compact"]
    with pytest.raises(ValueError):
        G.render(docs[0], "yaml")
    with pytest.raises(ValueError):
        G.document_styles(4, "pretty")


def test_compact_json_options_match_the_server():
    schema = json.dumps({"type": "object"})
    assert json.loads(G.llguidance_schema(schema, "compact")) == {"type": "object", "x-guidance": {"whitespace_flexible": False}}
    assert json.loads(G.llguidance_schema(schema, "flexible")) == {"type": "object"}
    own = json.dumps({"type": "object", "x-guidance": {"whitespace_flexible": True}})
    assert G.llguidance_schema(own, "compact") == own                    # the schema's own options win
    assert G.xgrammar_options("compact") == {"any_whitespace": False, "separators": (",", ":")}
    assert G.xgrammar_options("flexible") == {}
    try:
        from jax_engine.constrain import grammar as server
    except ImportError:
        return
    if hasattr(server, "_compact"):
        assert server._compact({"type": "object"}) == json.loads(G.llguidance_schema(schema, "compact"))


def test_documents_validate_against_the_schema():
    jsonschema = pytest.importorskip("jsonschema")
    for d in G.make_documents(16):
        jsonschema.validate(d, G.SCHEMA)


def test_token_allowed_and_allowed_counts_read_the_int32_bitmask():
    mask = np.zeros((3, 2), dtype=np.int32)
    mask[0, 0] = 1 << 5                                  # token 5
    mask[1, 0] = np.int32(-2 ** 31)                      # token 31: the sign bit
    mask[2, 1] = 0b101                                   # tokens 32 and 34
    assert G.token_allowed(mask, [5, 31, 34]).tolist() == [True, True, True]
    assert G.token_allowed(mask, [4, 30, 33]).tolist() == [False, False, False]
    assert G.allowed_counts(mask, 64).tolist() == [1, 1, 2]
    assert G.allowed_counts(mask, 33).tolist() == [1, 1, 1]      # bits past the vocabulary do not count
    full = np.full((1, 2), -1, dtype=np.int32)
    assert G.allowed_counts(full, 40).tolist() == [40]


def _round(mask_b: float, mask_s: float, compile_ms: float, clean: bool = True, sha: str = "ab") -> dict:
    modes = {"batch": {"mask_p50_us": mask_b, "mask_p99_us": mask_b * 3, "consume_p50_us": 10.0,
                       "new_request_p50_us": 50.0, "allowed_mean": 90.0, "rejected": 0, "mask_sha1": sha},
             "serial": {"mask_p50_us": mask_s, "mask_p99_us": mask_s * 2, "consume_p50_us": 8.0,
                        "new_request_p50_us": 40.0, "allowed_mean": 90.0, "rejected": 0, "mask_sha1": "ab"}}
    return {"compile": {"compile_ms": compile_ms, "first_mask_ms": compile_ms + 0.5}, "modes": modes, "clean": clean}


def test_pass_stats_summaries_and_ratios():
    st = G.pass_stats([100e-6, 200e-6, 300e-6], [10e-6, 10e-6, 10e-6], [])
    assert st["mask_p50_us"] == 200.0 and st["step_p50_us"] == 210.0 and st["consume_p50_us"] == 10.0
    assert st["new_request_p50_us"] is None and st["new_request_us"] == {"n": 0}
    assert (G.summarize_rounds([_round(100.0, 80.0, 2.0)])["best_way"], G.summarize_rounds([_round(70.0, 80.0, 2.0)])
            ["best_mask_p99_us"]) == ("serial", 210.0)
    rounds = [_round(100.0, 80.0, 2.0), _round(120.0, 90.0, 3.0), _round(900.0, 900.0, 50.0, clean=False)]
    s = G.summarize_rounds(rounds)
    assert s["batch_mask_p50_us"] == 110.0 and s["serial_mask_p50_us"] == 85.0 and s["compile_ms"] == 2.5
    assert s["batch_mask_p99_us"] == 330.0 and s["first_mask_ms"] == 3.0
    assert (s["rounds"], s["clean_rounds"], s["ways_masks_identical"]) == (3, 2, True)
    assert G.summarize_rounds([_round(1.0, 1.0, 1.0, sha="cd")])["ways_masks_identical"] is False
    r = G.compare(s, G.summarize_rounds([_round(55.0, 17.0, 25.0)]))
    assert r["batch_mask_p50_us"] == 2.0 and r["serial_mask_p50_us"] == 5.0 and r["compile_ms"] == 0.1
    assert r["best_mask_p50_us"] == 85.0 / 17.0                          # each library's faster way: serial both


def test_install_weight_names_what_each_library_adds():
    w = G.install_weight(base=["numpy"])
    assert w["base_requires"] == {"llguidance": False, "xgrammar": False}
    lg = w["llguidance"]
    assert lg["installed"] and lg["requires"] == [] and lg["beyond_base"] == {} and lg["own_mib"] > 0
    assert "llguidance" in G.base_requirements()                     # pyproject.toml's base install has it
    if w["xgrammar"].get("installed"):
        assert {"torch", "triton"} <= set(w["xgrammar"]["beyond_base"])
        assert w["xgrammar"]["beyond_base_mib"] > w["xgrammar"]["own_mib"]


def test_settings_defaults_quick_and_full():
    full = G.settings(G.parse_args([]))
    assert (full["rounds"], full["steps"], full["retries"], full["info_repeats"]) == (5, 600, 2, 3)
    assert full["libraries"] == list(G.LIBRARIES) and full["tokenizers"] == list(G.TOKENIZERS)
    quick = G.settings(G.parse_args(["--quick", "--libraries", "llguidance", "--tokenizers", "demo"]))
    assert (quick["rounds"], quick["steps"], quick["quiet_s"]) == (1, 200, 0.0)
    assert quick["libraries"] == ["llguidance"] and quick["tokenizers"] == ["demo"]
    with pytest.raises(SystemExit):
        G.settings(G.parse_args(["--libraries", "outlines"]))


# =============================================================================================
# the README renderer: benchmarks/__main__.py sec_grammar_mask
# =============================================================================================
def _row(text: str, start: str) -> str:
    rows = [ln for ln in text.splitlines() if ln.startswith(start)]
    assert len(rows) == 1, (start, text)
    return rows[0]


def _doc(lg_batch: float = 700.0, xg_batch: float = 200.0, xgrammar: bool = True) -> dict:
    def res(batch: float, serial: float, compile_ms: float, mem: int | None) -> dict:
        rounds = [_round(batch, serial, compile_ms)]
        load = {"rejected": 0, **({"memory_bytes": mem} if mem else {})}
        return {"setup": {"tokenizer_info_ms": 1400.0}, "load": load, "rounds": rounds,
                "summary": G.summarize_rounds(rounds)}

    results = {"v152k": {"llguidance": res(lg_batch, 780.0, 2.0, None)}}
    results["v152k"]["xgrammar"] = res(xg_batch, 85.0, 40.0, 1012108) if xgrammar else {"skipped": "not installed"}
    doc = {"machine": {"cpu": "test cpu", "cores": 2}, "cpu": {"cpu_share_of_cores": 0.5, "others_share_of_cores": 0.0},
           "finished": "2026-12-01T00:00:00", "results": results, "ratios": {},
           "setup": {"batch": 16, "steps": 600, "threads": 2, "server_library": "llguidance",
                     "server_reason": G.SERVER_REASON, "tokenizers": {"v152k": {"vocab_size": 151936}}},
           "install": {"llguidance": {"installed": True, "own_mib": 7.4, "requires": []},
                       "xgrammar": {"installed": True, "own_mib": 3.3, "beyond_base_mib": 1710.8,
                                    "beyond_base": {"triton": 994.4, "torch": 665.7}}},
           "decode_step": {"model": "small-v152k", "batch": 16, "ms_per_step": 80.0, "source": "x.json",
                           "finished": "2026-12-01"}}
    if xgrammar:
        doc["ratios"]["v152k"] = G.compare(results["v152k"]["llguidance"]["summary"], results["v152k"]["xgrammar"]["summary"])
    return doc


def test_sec_grammar_mask_table_ratio_and_choice_come_from_the_numbers():
    text = "\n".join(M.sec_grammar_mask(_doc(), quick=False))
    assert text.startswith("### Grammar engine: token mask per step at batch 16, llguidance vs xgrammar")
    assert "_Source: `benchmarks/results/grammar_mask.json`" in text and "Host: test cpu, 2 cores" in text
    cells = [c.strip() for c in _row(text, "| v152k, Qwen2-sized (151,936) | **llguidance** (server)").strip("|").split("|")]
    assert cells[2:] == ["700.0 / 2100.0", "780.0 / 1560.0", "10.0", "2.00", "2.50", "50.0", "1400", "–", "90.0", "1 of 1"]
    xg = _row(text, "| v152k, Qwen2-sized (151,936) | xgrammar |")
    assert "| 200.0 / 600.0 | 85.0 / 170.0 |" in xg and "| 988 KiB |" in xg and "| 40.00 |" in xg
    assert "faster way **8.23×**; batch API p50 **3.50×**" in text and "cold compile **0.05×**" in text
    choice = _row(text, "**The server uses llguidance**")
    assert ("each library's faster way: llguidance 700.0 µs (batch API) vs xgrammar 85.0 µs (one call per row): "
            "**8.23×** (llguidance slower); batch APIs alone **3.50×** (llguidance slower)") in choice
    assert "Cold compile **0.05×**: 2.0 vs 40.0 ms." in choice
    assert "no Python dependencies" in choice and "1711 MiB beyond" in choice and "triton 994, torch 666 MiB" in choice
    assert "takes 80.0 ms on this host" in choice and "0.9 % of it with llguidance, 0.1 % with xgrammar" in choice
    assert "bit-identical masks in every round: ✅" in text
    faster = _row("\n".join(M.sec_grammar_mask(_doc(lg_batch=40.0), quick=False)), "**The server uses llguidance**")
    assert "llguidance 40.0 µs (batch API) vs xgrammar 85.0 µs (one call per row): **0.47×** (llguidance faster)" in faster


def test_sec_grammar_mask_without_xgrammar_or_results():
    text = "\n".join(M.sec_grammar_mask(_doc(xgrammar=False), quick=True))
    assert "grammar_mask_quick.json" in text and "| xgrammar | not measured: not installed |" in text
    assert "llguidance / xgrammar" not in text and "Measured here" not in text
    assert "**The server uses llguidance**" in text
    bare = "\n".join(M.sec_grammar_mask({}, quick=True))
    assert bare.startswith("### Grammar engine") and "**The server uses llguidance**." in bare


def test_grammar_mask_job_is_registered_and_rendered_after_the_ragged_step():
    assert M.JOBS["grammar_mask"][0] == "grammar_mask" and "grammar_mask" in M.BENCHMARKS
    assert M.result_name("grammar_mask", True) == M.result_name("grammar_mask", False) == G.NAME
    docs = {"grammar_mask": _doc(), "parity": {"decoders": {}}}
    mp = pytest.MonkeyPatch()
    mp.setattr(M, "_load", lambda name, quick: docs.get(name))
    try:
        text = M.section(quick=True)
    finally:
        mp.undo()
    assert text.index("### Grammar engine") < text.index("### Parity")


def test_sec_grammar_mask_renders_the_results_file():
    doc = M._load(G.NAME, False)
    if doc is None:
        pytest.skip("no benchmarks/results/grammar_mask.json")
    text = "\n".join(M.sec_grammar_mask(doc, quick=False))
    assert "**The server uses llguidance**" in text and "| demo generator (512) | **llguidance** (server) |" in text


# =============================================================================================
# the workers, in-process, on the demo tokenizer (a few steps)
# =============================================================================================
@pytest.mark.parametrize("whitespace", G.WHITESPACE)
@pytest.mark.parametrize("lib", G.LIBRARIES)
def test_worker_checks_every_token_and_times_both_ways(lib, whitespace, demo_generator_path):
    if lib != "llguidance":
        pytest.importorskip(lib)
    texts = G.document_texts(4, whitespace=whitespace)
    trajs, info = G.trajectories(demo_generator_path, texts)
    assert info["decode_roundtrip"] and all(t[-1] == info["eos_id"] for t in trajs)
    w = G.WORKERS[lib](threads=1)
    assert w.cmd_hello()["library"] == lib
    setup = w.cmd_setup("demo", demo_generator_path, 512, repeats=1)
    assert setup["tokenizer_info_ms"] > 0 and setup["eos_token_id"] == info["eos_id"]
    load = w.cmd_load("demo", json.dumps(G.SCHEMA), trajs, warm_steps=5, whitespace=whitespace)
    assert load["rejected"] == 0 and load["tokens_checked"] == sum(len(t) for t in trajs)
    assert load["documents_ended"] == 4                              # every document reached EOS and stopped
    bad = w.cmd_load("demo", json.dumps(G.SCHEMA), [[info["eos_id"]]], warm_steps=0, whitespace=whitespace)
    assert bad["rejected"] == 1 and bad["documents_ended"] == 0        # EOS first: not a document
    if whitespace == "compact":                                           # a space where compact JSON has none
        spaced, _ = G.trajectories(demo_generator_path, [G.render(G.make_documents(1)[0], "spaced")])
        assert w.cmd_load("demo", json.dumps(G.SCHEMA), spaced, warm_steps=0)["rejected"] == 1
    w.cmd_load("demo", json.dumps(G.SCHEMA), trajs, warm_steps=0, whitespace=whitespace)
    r = w.cmd_round("demo", ["serial", "batch"], steps=min(len(t) for t in trajs) + 3)
    assert r["compile"]["compile_ms"] > 0 and r["compile"]["first_mask_allowed"] > 0
    b, s = r["modes"]["batch"], r["modes"]["serial"]
    assert b["rejected"] == s["rejected"] == 0 and b["requests"] == s["requests"] > 4     # a document ended: new request
    assert b["mask_sha1"] == s["mask_sha1"] and b["mask_p50_us"] > 0 and b["new_request_p50_us"] > 0
