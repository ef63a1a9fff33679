"""The llama.cpp and ONNX Runtime peers of the benchmarks: pure logic only.

Dtype mapping, context shapes, converter extraction, pooling, summaries, targets and the README
rendering. Nothing is built, converted or timed here; the two tests that look at the installed
libraries skip cleanly where the `bench` extra is not installed.
"""
from __future__ import annotations

import inspect
import io
import json
import os
import tarfile

import numpy as np
import pytest

from benchmarks import __main__ as M
from benchmarks import generate_vs_hf as G
from benchmarks import gguf as GG
from benchmarks import peer_worker
from benchmarks.llamacpp_peer import context_shape
from benchmarks.ort_peer import OrtWorker


# ------------------------------------------------------------------------------- dtype mapping
def test_llama_type_per_engine_dtype():
    assert GG.llama_type("float32", set()) == "F32"
    assert GG.llama_type("int8", set()) == GG.llama_type("bfloat16+int8", set()) == GG.llama_type("w8a8", set()) == "Q8_0"
    assert GG.llama_type("bfloat16", {"avx512f", "avx512_bf16"}) == "BF16"
    assert GG.llama_type("bfloat16", {"avx512f"}) == "F16"
    assert GG.llama_type("bfloat16", {"avx512_bf16"}, half="f16") == "F16"
    assert GG.llama_type("bfloat16", set(), half="bf16") == "BF16"
    assert set(GG.OUTTYPES) == {"F32", "F16", "BF16", "Q8_0"} and GG.OUTTYPES["Q8_0"] == "q8_0"
    with pytest.raises(ValueError):
        GG.llama_type("float16", set())


def test_context_shape_fits_the_whole_prefill_in_one_ubatch():
    s16 = context_shape(16, 128, 128)
    assert s16 == {"n_seq_max": 16, "n_ctx": 16 * 256, "n_batch": 2048, "n_ubatch": 2048}
    s1 = context_shape(1, 128, 128)
    assert s1["n_seq_max"] == 1 and s1["n_ctx"] == 256 and s1["n_batch"] == s1["n_ubatch"] == 512
    assert context_shape(4, 64, 300)["n_ctx"] == 4 * 512        # per sequence: rounded up to 256


# ------------------------------------------------------------------------------- converter files
def _fake_sdist(path: str) -> None:
    files = {"vendor/llama.cpp/convert_hf_to_gguf.py": "print('convert')\n",
             "vendor/llama.cpp/conversion/__init__.py": "",
             "vendor/llama.cpp/gguf-py/gguf/__init__.py": "",
             "vendor/llama.cpp/LICENSE": "MIT\n",
             "vendor/llama.cpp/src/llama.cpp": "// not wanted\n",
             "vendor/llama.cpp/gguf-py/pyproject.toml": "# not wanted\n",
             "llama_cpp/__init__.py": "# not wanted\n"}
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llama_cpp_python-9.9.9/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_extract_converter_keeps_only_the_converter(tmp_path):
    sdist = str(tmp_path / "llama_cpp_python-9.9.9.tar.gz")
    _fake_sdist(sdist)
    dest = str(tmp_path / "cache" / "llama.cpp-9.9.9")
    GG.extract_converter(sdist, dest)
    got = sorted(os.path.relpath(os.path.join(d, f), dest) for d, _, fs in os.walk(dest) for f in fs)
    assert got == ["LICENSE", "SOURCE.json", "conversion/__init__.py", "convert_hf_to_gguf.py",
                   "gguf-py/gguf/__init__.py"]
    # and converter_dir uses it without downloading anything
    assert GG.converter_dir(str(tmp_path / "cache"), "9.9.9") == dest


def test_gguf_path_names_the_folder_and_type(tmp_path):
    p = GG.gguf_path("/x/small-llama-v2/", "Q8_0", str(tmp_path))
    assert p == os.path.join(str(tmp_path), "gguf", "small-llama-v2-Q8_0.gguf")


# ------------------------------------------------------------------------------- ONNX Runtime side
class _Enc:
    def __init__(self, ids, mask):
        self.ids, self.attention_mask = ids, mask


class _Tok:
    def encode_batch(self, texts):
        n = max(len(t.split()) for t in texts)
        return [_Enc([1] * len(t.split()) + [0] * (n - len(t.split())),
                     [1] * len(t.split()) + [0] * (n - len(t.split()))) for t in texts]


class _Sess:
    """Hidden state h[b, t, :] = (t + 1) * [1, 2, 3]: easy to pool by hand."""

    def run(self, _names, feeds):
        B, T = feeds["input_ids"].shape
        return [np.arange(1, T + 1, dtype=np.float32)[None, :, None] * np.array([1, 2, 3], np.float32)[None, None]
                * np.ones((B, 1, 1), np.float32)]


def test_ort_mean_pooling_ignores_padding_and_normalizes():
    w = OrtWorker()
    w.tok, w.sess, w.input_names = _Tok(), _Sess(), ["input_ids", "attention_mask"]
    emb = w._encode(["a b c", "a"])
    # row 0: mean of t=1..3 -> 2 * [1,2,3]; row 1: only t=1 -> [1,2,3]; both normalise to the same unit vector
    unit = np.array([1, 2, 3]) / np.linalg.norm([1, 2, 3])
    np.testing.assert_allclose(emb, [unit, unit], rtol=1e-6)


def test_peer_protocol_serves_another_worker_class():
    out = io.StringIO()
    cmds = [{"cmd": "set_texts", "key": "k", "texts": ["x"]}, {"cmd": "quit"}]
    peer_worker.serve(io.StringIO("".join(json.dumps(c) + "\n" for c in cmds)), out, OrtWorker)
    assert json.loads(out.getvalue().splitlines()[0]) == {"ok": True, "result": {"n": 1}}


# ------------------------------------------------------------------------------- summaries and targets
def _round(prefill, decode, ids, clean=True):
    return {"prefill_s": prefill, "decode_tok_s": decode, "e2e_s": prefill + 1, "ms_per_step": 10.0,
            "ms_per_step_p50": 10.0, "e2e_tok_s": decode, "errors": 0, "output_ids": ids, "clean": clean,
            "cpu": {"cpu_share_of_cores": 1.0, "others_share_of_cores": 0.0}}


def _batch_runs():
    return {"xlaserve": [_round(0.2, 50.0, [[1, 2, 3]]), _round(0.2, 52.0, [[1, 2, 3]])],
            "llamacpp": [_round(0.1, 100.0, [[1, 2, 4]]), _round(0.1, 104.0, [[1, 9, 9]])],
            "hf_static": [_round(0.4, 25.0, [[1, 2, 3]]), _round(0.4, 26.0, [[1, 2, 3]])]}


def test_summarize_batch_names_each_peers_dtype(monkeypatch):
    monkeypatch.setattr(G, "_page_buckets", lambda p_max: [1, 2, 4, 8, 16, 32])
    limits = {"torch_sum_gbps": 30.0, "torch_matmul_fp32_gflops": 200.0, "probes": 1}
    b = G.summarize_batch(_batch_runs(), dict(G.MODELS["tiny"]), 10_000_000, 4, 1, 128, 3, limits, 512, "int8",
                          {"hf_static": "float32", "llamacpp": "Q8_0"})
    assert b["ratios_vs_llamacpp"]["peer_dtype"] == "Q8_0" and b["llamacpp"]["dtype"] == "Q8_0"
    assert b["ratios_vs_hf_static"]["peer_dtype"] == "float32"
    assert b["ratios_vs_llamacpp"]["decode_tok_s"] == pytest.approx(51 / 102, abs=1e-3)
    assert b["ratios_vs_llamacpp"]["prefill_s"] == pytest.approx(0.5, abs=1e-3)    # > 1 would mean xlaserve wins
    assert b["ratios_vs_hf_static"]["prefill_s"] == pytest.approx(2.0, abs=1e-3)
    assert b["greedy_match_vs_llamacpp"]["first_token_equal"] == 2
    assert b["greedy_match_vs_llamacpp"]["peer_dtype"] == "Q8_0"
    assert "llamacpp_decode" in b["roofline_fraction"]


def test_llamacpp_targets_per_row_and_batch():
    rows = {"float32": {"batch_1": {"ratios_vs_llamacpp": {"peer_dtype": "F32", "decode_tok_s": 1.1, "prefill_s": 0.9}},
                        "batch_16": {"ratios_vs_llamacpp": {"peer_dtype": "F32", "decode_tok_s": 1.1, "prefill_s": 1.0}}},
            "int8": {"error": "load failed"}}
    t = G.llamacpp_targets(rows, [1, 16])
    assert t["float32_b1_vs_llamacpp_F32_decode"]["met"] is True
    assert t["float32_b1_vs_llamacpp_F32_prefill"]["met"] is False
    assert t["float32_b16_vs_llamacpp_F32_decode"] == {"value": 1.1, "goal": 1.2, "met": False}
    assert not any(k.startswith("int8") for k in t)


# ------------------------------------------------------------------------------- README rendering
def _gen_doc() -> dict:
    row = {"batch_1": {"xlaserve": {"decode_tok_s": 50.0, "prefill_s": 0.2}, "llamacpp": {"decode_tok_s": 100.0,
                       "prefill_s": 0.1, "dtype": "Q8_0"},
                       "ratios_vs_llamacpp": {"peer_dtype": "Q8_0", "decode_tok_s": 0.5, "prefill_s": 0.5},
                       "greedy_match_vs_llamacpp": {"first_token_equal": 1, "sequences": 1},
                       "clean_rounds": 3, "rounds": 3}}
    return {"setup": {"batches": [1], "llamacpp": {"llama_cpp_python": "0.3.36", "threads": 2,
                                                   "system_info": "CPU : SSE3 = 1 | AVX512 = 1 | AVX512_BF16 = 1 |",
                                                   "contexts": {"1": {"n_threads": 2}}, "how": "low-level API"}},
            "rows": {"int8": row}, "targets": G.llamacpp_targets({"int8": row}, [1])}


def test_readme_renders_llamacpp_rows_with_type_and_ratio():
    text = "\n".join(M.sec_llamacpp(_gen_doc()))
    assert "llama-cpp-python 0.3.36" in text and "2 threads" in text and "AVX512_BF16" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("| int8 |"))
    for part in ("| Q8_0 |", "| 50.0 |", "| 100.0 |", "**0.50×**", "| 200 |", "| 100 |", "❌ / ❌", "3 of 3"):
        assert part in line, (part, line)
    skipped = M.sec_llamacpp({"setup": {"llamacpp": {"skipped": "llama-cpp-python not installed"}}, "rows": {}})
    assert any("not measured (llama-cpp-python not installed)" in ln for ln in skipped)
    assert M.sec_llamacpp({"setup": {}, "rows": {}}) == []       # results from before the llama.cpp peer
    doc = _gen_doc()
    doc["setup"]["llamacpp"]["failed"] = {"bfloat16+int8": "Q8_0: peer worker exited with -11 during 'generate'"}
    text = "\n".join(M.sec_llamacpp(doc))
    assert "bfloat16+int8: no llama.cpp columns, its peer process failed on this host (Q8_0: peer worker exited with -11" in text


def test_a_crashing_llamacpp_peer_is_retried_without_extra_buffer_types_then_costs_only_its_row(monkeypatch):
    """generate_vs_hf: a llama.cpp peer that dies loading one GGUF type is replaced and tried once
    more with llama.cpp's extra buffer types off; if that works the row keeps its columns (and says
    how it was measured), if not the row goes on without them and later rows get a fresh peer."""
    from benchmarks import generate_vs_hf as GV
    from benchmarks.peer_worker import PeerError

    class FakePeer:
        def __init__(self, crash_with_extra, crash_without=False):
            self.crash = {True: crash_with_extra, False: crash_without}
            self.extra, self.closed, self.pid = True, False, id(self)

        def call(self, cmd, **kw):
            if cmd == "load":
                self.extra = kw.get("extra_bufts", True)
                return {"params": 1, "contexts": {}}
            if cmd == "generate" and self.crash[self.extra]:
                raise PeerError("llama.cpp worker exited with -11 during 'generate'")
            return {}

        def close(self):
            self.closed = True

    monkeypatch.setattr(GV.G, "ensure_gguf", lambda path, t: f"{path}/{t}.gguf")
    run = {"batches": [1], "prompt_len": 4, "new_tokens": 2}
    # the AMX Xeon's case: default layouts crash, extra buffer types off works
    loaded, failed = {}, {}
    crashing, retry = FakePeer(crash_with_extra=True), FakePeer(crash_with_extra=True)
    peer, ok = GV.load_llamacpp_row(crashing, "int8", "/m", "Q8_0", run, 32, loaded, failed, restart=lambda r: (retry, None))
    assert ok and peer is retry and crashing.closed and loaded["int8"]["extra_bufts"] is False
    assert failed["int8"].startswith("Q8_0: llama.cpp worker exited with -11") and "retried" in failed["int8"]
    # crashing either way: no columns for this row, a fresh peer for the next
    loaded, failed = {}, {}
    peers = iter([FakePeer(True, True), FakePeer(False)])
    peer, ok = GV.load_llamacpp_row(FakePeer(True, True), "int8", "/m", "Q8_0", run, 32, loaded, failed,
                                    restart=lambda r: (next(peers), None))
    assert not ok and "int8" not in loaded and "with extra buffer types off" in failed["int8"]
    peer, ok = GV.load_llamacpp_row(peer, "float32", "/m", "F32", run, 32, loaded, failed)
    assert ok and loaded["float32"]["gguf_type"] == "F32" and loaded["float32"]["extra_bufts"] is True


def _embed_doc(with_ort: bool) -> dict:
    def row(B):
        r = {"xlaserve_sentences_per_s": 100.0, "st_sentences_per_s": 50.0, "ratio": 2.0, "peer_dtype": "float32",
             "all_rounds": {"clean_rounds": 2, "rounds": 2}}
        if with_ort:
            r.update({"ort_sentences_per_s": 80.0, "ratio_vs_ort": 1.25, "ort_dtype": "float32"})
        if B == 1:
            r.update({"xlaserve_latency_ms": {"p50": 10.0, "p99": 20.0}, "st_latency_ms": {"p50": 30.0, "p99": 40.0}})
            if with_ort:
                r["ort_latency_ms"] = {"p50": 12.0, "p99": 25.0}
        return r
    setup = {"batch_sizes": [1, 32], "corpus_sentences": 10, "tokens_per_sentence_mean": 9.0, "how": {}}
    if with_ort:
        setup["onnxruntime"] = {"onnxruntime": "1.32.0", "dtype": "float32", "intra_op_threads": 2,
                                "export": {"fused_operators": {"Attention": 6}}, "how": "corpus order"}
    return {"setup": setup, "results": {"batch_1": row(1), "batch_32": row(32)},
            "targets": {"sentences_per_s_ratio_b32_vs_onnxruntime": {"value": 1.25, "goal": 1.2, "met": True}},
            "correctness_onnxruntime": {"min_cosine": 0.9999999, "ok": True},
            "compilations": {"after_timing": {"engine_after_warmup": 0}}, "cpu": {}}


def test_readme_renders_onnxruntime_columns():
    text = "\n".join(M.sec_embed(_embed_doc(True), quick=True))
    assert "ONNX Runtime 1.32.0 (float32" in text and "Attention 6" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("| 32 |"))
    assert "| 80.0 | float32 | **1.25×** | ≥ 1.2× | ✅ |" in line and "| 50.0 | float32 | **2.00×** |" in line
    assert "ONNX Runtime (float32) 12.0 / 25.0 ms" in text
    old = "\n".join(M.sec_embed(_embed_doc(False), quick=True))       # results without the ORT peer
    assert "ONNX Runtime" not in old and "| 32 | 100.0 | 50.0 | float32 | **2.00×** |" in old


# ------------------------------------------------------------------------------- installed libraries
def test_llama_cpp_has_the_low_level_calls_the_peer_uses():
    llama_cpp = pytest.importorskip("llama_cpp")
    for name in ("llama_backend_init", "llama_model_load_from_file", "llama_init_from_model", "llama_batch_init",
                 "llama_decode", "llama_get_logits", "llama_memory_clear", "llama_get_memory", "llama_vocab_n_tokens"):
        assert hasattr(llama_cpp, name), name
    fields = {f for f, _ in llama_cpp.llama_batch._fields_}
    assert {"token", "pos", "n_seq_id", "seq_id", "logits"} <= fields
    cp = {f for f, _ in llama_cpp.llama_context_params._fields_}
    assert set(context_shape(1, 1, 1)) | {"n_threads", "n_threads_batch"} <= cp


def test_onnxruntime_optimizer_takes_the_o2_arguments():
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from onnxruntime.transformers.optimizer import optimize_model

    params = inspect.signature(optimize_model).parameters
    assert {"model_type", "num_heads", "hidden_size", "opt_level", "use_gpu"} <= set(params)


def test_a_second_hosts_results_render_beside_the_default(tmp_path, monkeypatch):
    # --results-name keeps another host class's run (e.g. without AVX-512) in its own file; the
    # README section shows each generate_vs_hf*.json, embed_vs_st*.json and spec_decode*.json with
    # its source line, quick files only in quick mode (spec_decode_small, a job of its own, is told
    # apart by its results' "benchmark" field)
    from benchmarks import common as C
    from benchmarks import embed_vs_st as E
    from benchmarks import spec_decode as S

    monkeypatch.setattr(C, "RESULTS_DIR", str(tmp_path))
    for name in ("generate_vs_hf_avx2.json", "generate_vs_hf_avx2_quick.json", "generate_vs_hf_quick.json",
                 "generate_vs_hf.json", "generate_vs_hf_prefill.png", "spec_decode.json", "embed_vs_st.json",
                 "embed_vs_st_avx2.json", "embed_vs_st_quick.json", "embed_vs_st_avx2_latency.png",
                 "embed_vs_st_avx2_before_encoder_fixes.json",      # an earlier run the prose cites: no table
                 "spec_decode_avx2.json", "spec_decode_small.json", "spec_decode_avx2_before_suffix_order.json"):
        (tmp_path / name).write_text("{}")
    assert M.result_variants("generate_vs_hf", quick=False) == ["generate_vs_hf_avx2"]
    assert M.result_variants("generate_vs_hf", quick=True) == ["generate_vs_hf_avx2"]
    assert M.result_variants("embed_vs_st", quick=False) == ["embed_vs_st_avx2"]
    assert M.result_variants("spec_decode", quick=False) == ["spec_decode_avx2", "spec_decode_small"]
    rendered = []
    monkeypatch.setattr(M, "_load", lambda name, quick: ({"benchmark": name.split("_avx2")[0]}
                                                         if name.startswith(("generate_vs_hf", "embed_vs_st", "spec_decode"))
                                                         else None))
    monkeypatch.setattr(M, "sec_generate", lambda doc, quick, name="generate_vs_hf": rendered.append(name) or [f"## {name}"])
    monkeypatch.setattr(M, "sec_embed", lambda doc, quick, name="embed_vs_st": rendered.append(name) or [f"## {name}"])
    monkeypatch.setattr(M, "sec_spec_decode", lambda doc, quick, name="spec_decode": rendered.append(name) or [f"## {name}"])
    monkeypatch.setattr(M, "sec_spec_decode_small", lambda doc, quick: rendered.append("small") or ["## small"])
    text = M.section(quick=False)
    assert rendered == ["embed_vs_st", "generate_vs_hf", "spec_decode", "small", "embed_vs_st_avx2",
                        "generate_vs_hf_avx2", "spec_decode_avx2"]
    assert "## generate_vs_hf_avx2" in text and "## embed_vs_st_avx2" in text and "## spec_decode_avx2" in text
    for bench in (E, G, S):                  # the benchmarks' option writing such a file
        assert '"--results-name"' in inspect.getsource(bench.main)
