"""--burst-batched-tokens / --burst-min-prompts on the command line and the burst-step counter
in /metrics (the scheduler's behaviour is tested in tests/engine/test_scheduler.py)."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from frontends.http.app import create_app
from tests.helpers.fake_engine import FAKE_GEN, FakeEngine


def test_cli_burst_flags(tmp_path, monkeypatch):
    from frontends.cli import engine_args, parse_serve_args

    for var in ("XLASERVE_BURST_BATCHED_TOKENS", "XLASERVE_BURST_MIN_PROMPTS", "XLASERVE_ITL_P99_RATIO"):
        monkeypatch.delenv(var, raising=False)
    model = tmp_path / "m"
    model.mkdir()
    args = engine_args(parse_serve_args(["--model", f"g={model}"]))
    assert (args.burst_batched_tokens, args.burst_min_prompts) == (None, 4)      # None: the platform's default
    assert args.itl_p99_ratio == 4.0
    assert engine_args(parse_serve_args(["--model", f"g={model}", "--itl-p99-ratio", "0"])).itl_p99_ratio == 0
    assert engine_args(parse_serve_args(["--model", f"g={model}", "--itl-p99-ratio", "2.5"])).itl_p99_ratio == 2.5
    args = engine_args(parse_serve_args(["--model", f"g={model}", "--burst-batched-tokens", "0",
                                         "--burst-min-prompts", "2"]))
    assert (args.burst_batched_tokens, args.burst_min_prompts) == (0, 2)
    monkeypatch.setenv("XLASERVE_BURST_BATCHED_TOKENS", "512")
    assert engine_args(parse_serve_args(["--model", f"g={model}"])).burst_batched_tokens == 512


@pytest.mark.parametrize("argv", [["--burst-batched-tokens", "-1"], ["--burst-min-prompts", "0"],
                                  ["--itl-p99-ratio", "1"], ["--itl-p99-ratio", "-2"], ["--itl-p99-ratio", "inf"]])
def test_cli_burst_errors(tmp_path, argv, monkeypatch):
    from frontends.cli import parse_serve_args

    monkeypatch.delenv("XLASERVE_BURST_BATCHED_TOKENS", raising=False)
    model = tmp_path / "m"
    model.mkdir()
    with pytest.raises(SystemExit):
        parse_serve_args(["--model", f"g={model}"] + argv)


def test_burst_steps_counter_in_metrics():
    with TestClient(create_app(FakeEngine())) as client:
        text = client.get("/metrics").text
    assert f'xlaserve_burst_steps_total{{model="{FAKE_GEN}"}} 0.0' in text
