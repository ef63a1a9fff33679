"""Pure helpers of the benchmark scripts: parsing, rooflines, rates, limits, the peer protocol.

Nothing here times anything or starts an engine; the benchmarks themselves are run by
`python -m benchmarks` (see benchmarks/README.md).
"""
from __future__ import annotations

import io
import json
import sys

import pytest

from benchmarks import common as C
from benchmarks import generate_vs_hf as G
from benchmarks import peer_worker
from benchmarks.serve_load import sent_rate
from benchmarks.start_time import parse_programs
from benchmarks.test_report import parse_summary, summary_line


@pytest.mark.parametrize("line, want", [
    ("1 failed, 378 passed, 2 skipped, 3 warnings in 567.89s (0:09:27)",
     {"failed": 1, "passed": 378, "skipped": 2, "warnings": 3, "errors": 0, "pytest_seconds": 567.89}),
    ("===== 4 passed in 0.08s =====", {"passed": 4, "failed": 0, "pytest_seconds": 0.08}),
    ("2 passed, 1 error, 1 xfailed in 3.10s", {"passed": 2, "errors": 1, "xfailed": 1}),
])
def test_parse_pytest_summary(line, want):
    got = parse_summary(line)
    for k, v in want.items():
        assert got[k] == v, (k, got)


def test_summary_line_is_the_last_count_line():
    out = "....\nsome test said 3 passed in a log line\n==== short test summary ====\n5 passed, 1 skipped in 2.00s\n"
    assert summary_line(out) == "5 passed, 1 skipped in 2.00s"
    assert summary_line("no summary here\n") is None


def test_sent_rate_counts_gaps_between_first_and_last_send():
    recs = [{"t_send": t} for t in (10.0, 10.5, 11.0, 12.0)]
    assert sent_rate(recs) == pytest.approx(3 / 2.0)
    assert sent_rate([{"t_send": 1.0}]) is None


def test_combine_limits_takes_the_best_probe():
    probes = [{"torch_sum_gbps": 30.0, "torch_matmul_fp32_gflops": 150.0, "buffer_gib": 2.0, "cpu": {}},
              {"torch_sum_gbps": 33.5, "torch_matmul_fp32_gflops": 140.0, "buffer_gib": 2.0, "cpu": {}}]
    lim = C.combine_limits(probes)
    assert lim["probes"] == 2 and lim["torch_sum_gbps"] == 33.5 and lim["torch_matmul_fp32_gflops"] == 150.0
    assert lim["torch_sum_gbps_per_probe"] == [30.0, 33.5] and len(lim["probe_runs"]) == 2
    assert "torch_matmul_bf16_gflops" not in lim


def _cfg() -> dict:
    return dict(G.MODELS["small"])


def test_roofline_is_the_lower_of_bandwidth_and_compute():
    cfg = _cfg()
    wb = 400_000_000
    limits = {"torch_sum_gbps": 30.0, "torch_matmul_fp32_gflops": 200.0, "probes": 3}
    b1 = G.roofline(cfg, wb, 4, 1, 128, 128, limits, "torch_matmul_fp32_gflops")
    b16 = G.roofline(cfg, wb, 4, 16, 128, 128, limits, "torch_matmul_fp32_gflops")
    assert b1["bound"] == "bandwidth" and b1["decode_tok_s"] == b1["bandwidth_tok_s"]
    assert b16["bound"] == "compute" and b16["decode_tok_s"] == b16["compute_tok_s"] < b16["bandwidth_tok_s"]
    # FLOPs per step: 2 per matmul parameter per row, plus attention
    assert b16["decode_gflop_per_step"] > 16 * 2 * G.matmul_params(cfg) / 1e9
    # the KV itemsize counts: float32 KV reads twice the bytes of bfloat16 KV
    half = G.roofline(cfg, wb, 2, 16, 128, 128, limits, "torch_matmul_fp32_gflops")
    assert half["kv_bytes_per_step"] * 2 == b16["kv_bytes_per_step"]


def test_roofline_without_matmul_probe_is_bandwidth_only():
    rl = G.roofline(_cfg(), 400_000_000, 4, 16, 128, 128, {"torch_sum_gbps": 30.0}, "torch_matmul_bf16_gflops")
    assert rl["bound"] == "bandwidth" and rl["compute_tok_s"] is None and "prefill_s" not in rl


def test_compute_probe_and_peer_dtype_per_row():
    assert G.compute_probe("bfloat16") == G.compute_probe("bfloat16+int8") == "torch_matmul_bf16_gflops"
    assert G.compute_probe("int8") == G.compute_probe("float32") == "torch_matmul_fp32_gflops"
    assert G.PEER_DTYPE == {"float32": "float32", "bfloat16": "bfloat16", "int8": "float32", "bfloat16+int8": "bfloat16",
                            "w8a8": "float32"}
    assert G.MODELS["small-v152k"]["vocab_size"] == 151936


def test_parse_programs_from_the_server_log():
    log = ("INFO xlaserve-demo-random: 41 programs compiled in 12.3s (tokens [16], batch [1])\n"
           "compile all-MiniLM-L6-v2:  98%|#########8| 44/45 [00:03<00:00]\r"
           "compile all-MiniLM-L6-v2: 100%|##########| 45/45 [00:03<00:00, 12.27prog/s]\n"
           "INFO other line\nINFO bench: 7 programs compiled in 0.5s (...)\n")
    assert parse_programs(log) == {"xlaserve-demo-random": {"programs": 41, "warmup_s": 12.3},
                                   "all-MiniLM-L6-v2": {"programs": 45},
                                   "bench": {"programs": 7, "warmup_s": 0.5}}


def test_host_line_names_cpu_flags_l2_and_bandwidth():
    m = {"cpu": "Some CPU", "cores": 2, "caches": {"L2": "2048K"}, "isa": ["avx2", "avx512f"],
         "isa_absent": ["amx_bf16"]}
    line = C.host_line(m, {"torch_sum_gbps": 24.44, "probes": 3})
    for part in ("Some CPU", "2 cores", "L2 2048K", "avx2 avx512f", "no amx_bf16", "24.4 GB/s", "best of 3"):
        assert part in line, line
    assert "not measured" in C.host_line(m, None)


def test_block_modules_makes_an_import_fail_and_is_reported():
    name = "xlaserve_bench_blocked_module_for_test"
    try:
        C.block_modules([name])
        with pytest.raises(ImportError):
            __import__(name)
        rep = C.isolation_report([name])
        assert rep[f"{name}_loaded"] is False and rep["blocked"] == [name]
    finally:
        sys.modules.pop(name, None)


def test_peer_worker_protocol_replies_one_line_per_command():
    cmds = [{"cmd": "set_texts", "key": "a", "texts": ["x", "y"]}, {"cmd": "no_such_command"}, {"cmd": "quit"},
            {"cmd": "set_texts", "key": "never", "texts": []}]
    out = io.StringIO()
    peer_worker.serve(io.StringIO("".join(json.dumps(c) + "\n" for c in cmds)), out)
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert replies[0] == {"ok": True, "result": {"n": 2}}
    assert replies[1]["ok"] is False and "no_such_command" in replies[1]["error"]
    assert replies[2] == {"ok": True, "result": {}} and len(replies) == 3     # nothing after quit


def test_matmul_probe_shrinks_where_the_dtype_is_slow():
    # the compute probe's size follows one small call's rate: a dtype the CPU has no instructions
    # for (torch bfloat16 without AVX512_BF16 / AMX: ~1 GFLOP/s) would take minutes at 4096
    torch = pytest.importorskip("torch")
    assert peer_worker._matmul_size(4096, torch.float32, budget_s=1e9) == 4096
    assert peer_worker._matmul_size(4096, torch.float32, budget_s=0.0) == 512
