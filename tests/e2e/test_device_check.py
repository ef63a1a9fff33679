"""benchmarks/device_check.sh --dry-run: the GPU device check's code paths on CPU with tiny shapes
(prepare -> parity float32 / bfloat16 -> generate bench -> `xlaserve serve` under a short load),
ending in one JSON summary line that is also written to $OUT/device_check.json.

It compiles much and runs little (six tiny parity engines, a bench engine, a server), so the
script's dry run sets LLVM to level 0 in place of the caller's level (the suite's 1, conftest.py):
alone on a 2-vCPU Zen 3 the run took 91 s this way, 127-162 s at level 1 and 216 s at XLA's
default flags. The test runs it with the suite's flags, as a developer's shell would."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/<layer>/ -> repo


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("device_check")
    out_dir = tmp / "out"
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out_dir))
    p = subprocess.run(["bash", os.path.join(REPO, "benchmarks", "device_check.sh"), "--dry-run",
                        "--work", str(tmp / "work")], cwd=REPO, env=env, capture_output=True, text=True, timeout=660)
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    assert lines, f"no output (rc {p.returncode}):\n{p.stderr[-3000:]}"
    return p, json.loads(lines[-1]), out_dir


def test_dry_run_passes_and_writes_one_summary(dry_run):
    p, doc, out_dir = dry_run
    assert p.returncode == 0 and doc["ok"] is True, f"{json.dumps(doc)[:3000]}\n{p.stderr[-3000:]}"
    assert doc["device_check"] == 1 and doc["mode"] == "dry_run" and doc["errors"] == []
    assert doc["device"]["platform"] == "cpu"
    # the script's level 0 replaced the suite's level 1; the suite's other flags pass through
    flags = doc["device"]["xla_flags"].split()
    assert [f for f in flags if "optimization_level" in f] == ["--xla_backend_optimization_level=0"]
    assert "--xla_cpu_use_fusion_emitters=false" in flags
    saved = (out_dir / "device_check.json").read_text().strip()
    assert json.loads(saved) == doc


def test_parity_fields(dry_run):
    doc = dry_run[1]["parity"]
    assert doc["ok"] and doc["prompts"] == 4 and doc["new_tokens"] == 32
    f32, bf16 = doc["float32"], doc["bfloat16"]
    assert f32["engine_dtype"] == f32["kv_dtype"] == "float32"
    assert bf16["engine_dtype"] == "bfloat16" and bf16["kv_dtype"] == "float32"   # CPU: KV stays float32 (backend.kv_dtype)
    assert f32["logits_max_abs_err"] <= 1e-4          # CPU float32: summation order only
    assert f32["logits_max_abs_err"] <= f32["tol"] < bf16["tol"]
    assert bf16["logits_max_abs_err"] <= bf16["tol"]
    for r in (f32, bf16):
        assert r["prompt_logprobs_max_abs_err"] is not None and r["greedy"]["of"] == 4 and r["greedy"]["ok"]
    assert f32["greedy"]["exact"] == 4
    # the new families (Gemma 2: soft-caps and windows; Qwen3-MoE: experts) on the same checks
    fams = doc["families"]
    assert set(fams) == {"gemma2", "qwen3_moe"}
    for fam, r in fams.items():
        assert r["ok"] and r["model"] == fam, fam
        assert r["float32"]["logits_max_abs_err"] <= 1e-4 and r["bfloat16"]["logits_max_abs_err"] <= r["bfloat16"]["tol"]


def test_bench_fields(dry_run):
    b = dry_run[1]["bench"]
    assert b["ok"] and b["model"]["random_weights"] and b["model"]["params"] > 0
    assert b["dtype"] == "float32"                     # --dtype auto on CPU
    assert b["programs"] > 0 and b["warmup_s"] >= 0 and b["compilations_after_warmup"] == 0
    assert b["weight_bytes"]["per_decode_step"] > 0 and b["measured_read_tbps"] > 0
    assert set(b["batches"]) == {"1", "2"}
    for row in b["batches"].values():
        assert row["errors"] == 0
        for k in ("decode_tok_s", "step_ms", "ttft_ms", "itl_ms_p50", "itl_ms_p99", "bytes_per_step",
                  "bw_util", "bw_util_gathered_kv", "roofline_decode_tok_s"):
            assert row[k] is not None and row[k] >= 0, k
        assert row["bytes_per_step"] > b["weight_bytes"]["per_decode_step"]


def test_serve_fields(dry_run):
    s = dry_run[1]["serve"]
    assert s["ok"] and s["exit_code"] == 0 and s["served_dtype"] == "float32"
    assert s["ready_s"] > 0 and s["compiles_after_warmup_end"] == 0
    g, h = s["grpc_streams"], s["http_poisson"]
    assert g["errors"] == 0 and g["decode_tok_s"] > 0 and g["itl_ms"]["n"] > 0
    assert h["errors"] == 0 and h["requests"] == 3 and h["output_tok_s"] > 0 and h["ttft_ms"]["n"] == 3


def test_headline(dry_run):
    h = dry_run[1]["headline"]
    for k in ("parity_float32_err", "parity_bfloat16_err", "b1_tok_s", "b1_bw_util", "b1_ttft_ms", "b1_itl_ms",
              "serve_grpc_tok_s", "serve_http_ttft_ms_p50"):
        assert k in h, k
