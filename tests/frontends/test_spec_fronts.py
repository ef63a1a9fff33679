"""Speculative decoding in the fronts and the CLI, against the fake engine (no model, no JAX):
SGLang `GetLoads` fills its `speculative` section (accept length and rate) only when the server
speculates, /metrics carries the per-model counters and histogram, and the CLI flags reach
EngineArgs (the engine itself: tests/engine/test_speculative.py)."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from frontends.grpc.gen.sglang import sglang_scheduler_pb2 as spb
from frontends.grpc.server import make_servicers
from frontends.http.app import create_app
from tests.helpers.fake_engine import FAKE_EMBED, FAKE_GEN, FakeEngine
from tests.helpers.protocol_clients import GrpcTransport, MirrorTransport
from tests.helpers.shared import start_grpc_server, stop_grpc_server

SGLANG = "sglang.grpc.scheduler.SglangScheduler"


def http_client(engine: FakeEngine) -> TestClient:
    return TestClient(create_app(engine, servicers=make_servicers(engine)))


@pytest.fixture(params=["grpc", "mirror"])
def transport(request, server_loop):
    engine = FakeEngine(speculative="suffix", num_speculative_tokens=4)
    if request.param == "grpc":
        import grpc

        srv = start_grpc_server(server_loop, engine)
        channel = grpc.insecure_channel(srv.target)
        yield GrpcTransport(channel)
        channel.close()
        stop_grpc_server(server_loop, srv)
    else:
        with http_client(engine) as client:
            yield MirrorTransport(client)


def test_sglang_get_loads_speculative_section(transport):
    for include in (["spec"], ["all"], []):
        resp, _ = transport.unary(SGLANG, "GetLoads", spb.GetLoadsRequest(include=include), spb.GetLoadsResponse)
        load = resp.loads[0]
        assert load.HasField("speculative"), include
        assert load.speculative.accept_length == pytest.approx(2.5)     # 1 + 60 accepted / 40 verifications
        assert load.speculative.accept_rate == pytest.approx(0.6)       # 60 of 100 guesses
    resp, _ = transport.unary(SGLANG, "GetLoads", spb.GetLoadsRequest(include=["core"]), spb.GetLoadsResponse)
    assert not resp.loads[0].HasField("speculative")


def test_sglang_get_loads_without_speculation_leaves_the_section_unset():
    with http_client(FakeEngine()) as client:
        r = client.post(f"/{SGLANG}/GetLoads", json={"include": ["spec"]})
        assert r.status_code == 200 and "speculative" not in r.json()["loads"][0]


def test_metrics_speculation_counters_and_histogram():
    with http_client(FakeEngine(speculative="ngram", num_speculative_tokens=4)) as client:
        text = client.get("/metrics").text
    m = f'model="{FAKE_GEN}"'
    assert f"xlaserve_spec_proposed_tokens_total{{{m}}} 100.0" in text
    assert f"xlaserve_spec_accepted_tokens_total{{{m}}} 60.0" in text
    assert f"xlaserve_spec_accept_rate{{{m}}} 0.6" in text
    assert f"xlaserve_spec_accept_length{{{m}}} 2.5" in text
    # cumulative buckets: 10 verifications accepted 0 guesses, 10 accepted 1, ...
    for le, n in (("0", 10), ("1", 20), ("2", 30), ("3", 40), ("4", 40), ("+Inf", 40)):
        assert f'xlaserve_spec_accepted_per_step_bucket{{le="{le}",{m}}} {n:.1f}' in text \
            or f'xlaserve_spec_accepted_per_step_bucket{{{m},le="{le}"}} {n:.1f}' in text, le
    assert f"xlaserve_spec_accepted_per_step_count{{{m}}} 40.0" in text
    assert f"xlaserve_spec_accepted_per_step_sum{{{m}}} 60.0" in text
    assert f'model="{FAKE_EMBED}"' not in "".join(ln for ln in text.splitlines() if ln.startswith("xlaserve_spec"))
    with http_client(FakeEngine()) as client:
        assert "xlaserve_spec_" not in client.get("/metrics").text


def test_cli_speculative_flags(tmp_path, monkeypatch):
    from frontends.cli import engine_args, parse_serve_args

    for var in ("XLASERVE_SPECULATIVE", "XLASERVE_NUM_SPECULATIVE_TOKENS"):
        monkeypatch.delenv(var, raising=False)
    model = tmp_path / "m"
    model.mkdir()
    args = engine_args(parse_serve_args(["--model", f"g={model}"]))
    assert (args.speculative, args.num_speculative_tokens) == ("off", 16)
    args = engine_args(parse_serve_args(["--model", f"g={model}", "--speculative", "suffix",
                                         "--num-speculative-tokens", "3"]))
    assert (args.speculative, args.num_speculative_tokens) == ("suffix", 3)
    monkeypatch.setenv("XLASERVE_SPECULATIVE", "ngram")
    assert engine_args(parse_serve_args(["--model", f"g={model}"])).speculative == "ngram"


@pytest.mark.parametrize("argv", [["--speculative", "eagle"], ["--num-speculative-tokens", "0"]])
def test_cli_speculative_errors(tmp_path, capsys, argv, monkeypatch):
    from frontends.cli import parse_serve_args

    monkeypatch.delenv("XLASERVE_SPECULATIVE", raising=False)
    model = tmp_path / "m"
    model.mkdir()
    with pytest.raises(SystemExit):
        parse_serve_args(["--model", f"g={model}"] + argv)
    assert argv[0] in capsys.readouterr().err
