"""`xlaserve` command line: option parsing, and `xlaserve serve` end to end as a subprocess.

The end-to-end part starts the real server with no --model (the bundled MiniLM + the demo
generator, built fresh under a temporary XDG_CACHE_HOME), waits for /ready, calls one RPC of
every gRPC service and one route of every HTTP kind, then sends SIGTERM during 8 live streams
(HTTP and gRPC) and expects all 8 to finish, then exit code 0. Its engine flags equal the shared test engine's, so warm JAX
compilation-cache entries are reused.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
from pathlib import Path

import grpc
import httpx
import pytest

from frontends.cli import DEFAULT_MODEL_NAMES, parse_serve_args
from tests.helpers.shared import ENGINE_FLAGS, wait_for, xlaserve

EMBED_NAME, DEMO_NAME = DEFAULT_MODEL_NAMES


# ---------------------------------------------------------------------------------- parsing
def test_env_vars_set_every_kind_of_option(monkeypatch, tmp_path):
    gen = tmp_path / "g"
    gen.mkdir()
    monkeypatch.setenv("XLASERVE_HTTP_PORT", "9001")
    monkeypatch.setenv("XLASERVE_MAX_WAITING_REQUESTS", "7")
    monkeypatch.setenv("XLASERVE_ENABLE_ADMIN", "true")
    monkeypatch.setenv("XLASERVE_ENABLE_PREFIX_CACHE", "0")
    monkeypatch.setenv("XLASERVE_MODEL", f"a={gen},b={gen}")
    monkeypatch.setenv("XLASERVE_GRPC_LISTEN", "unix:/tmp/x.sock, 127.0.0.1:0")
    monkeypatch.setenv("XLASERVE_API_KEY", "k")
    ns = parse_serve_args([])
    assert (ns.http_port, ns.max_waiting_requests, ns.enable_admin, ns.enable_prefix_cache) == (9001, 7, True, False)
    assert [s.name for s in ns.model_specs] == ["a", "b"] and ns.api_key == "k"
    assert ns.grpc_listen == ["unix:/tmp/x.sock", "127.0.0.1:0"]
    # the command line wins over the environment
    ns = parse_serve_args(["--http-port", "9002", "--enable-prefix-cache", "--model", f"c={gen}"])
    assert (ns.http_port, ns.enable_prefix_cache, [s.name for s in ns.model_specs]) == (9002, True, ["c"])
    monkeypatch.setenv("XLASERVE_DTYPE", "float64")
    with pytest.raises(SystemExit):
        parse_serve_args([])


def test_defaults_follow_interface_md(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for k in [k for k in os.environ if k.startswith("XLASERVE_") and k != "XLASERVE_PROGRESS"]:
        monkeypatch.delenv(k)
    ns = parse_serve_args([])
    assert (ns.host, ns.grpc_port, ns.http_port, ns.drain_timeout, ns.log_level) == ("127.0.0.1", 50051, 8000,
                                                                                     30.0, "info")
    assert (ns.dtype, ns.quantize, ns.tp, ns.replicas, ns.page_size, ns.enable_prefix_cache) == ("auto", "none", 1,
                                                                                                1, 16, True)
    assert [(s.name, s.random_weights) for s in ns.model_specs] == [(EMBED_NAME, False), (DEMO_NAME, True)]
    assert ns.model_specs[1].path.startswith(str(tmp_path))  # the demo generator is built in the user cache


def test_model_flag_forms_and_errors(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert parse_serve_args(["--model", str(folder)]).model_specs[0].name == "my-model"
    assert parse_serve_args(["--model", f"x={folder}"]).model_specs[0].path == str(folder)
    for bad in ([f"x={tmp_path / 'missing'}"], [f"x={folder}", f"x={folder}"], [f"={folder}"]):
        with pytest.raises(SystemExit):
            parse_serve_args([a for m in bad for a in ("--model", m)])
    with pytest.raises(SystemExit):
        parse_serve_args(["--tls-cert", "c.pem"])


def test_version_and_usage():
    out = subprocess.run(xlaserve() + ["--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and re.match(r"xlaserve \d", out.stdout)
    out = subprocess.run(xlaserve(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "serve" in out.stdout and "convert" in out.stdout


# ---------------------------------------------------------------------------------- end to end
class ServerProcess:
    def __init__(self, tmp: Path):
        env = dict(os.environ)
        # a fresh demo model, but the user's compilation cache (same shapes as the test engine's)
        user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        env["XDG_CACHE_HOME"] = str(tmp)
        env["XLASERVE_PROGRESS"] = "0"
        cmd = xlaserve() + ["serve", "--grpc-port", "0", "--http-port", "0", "--log-level", "info",
                            "--compile-cache-dir", os.path.join(user_cache, "xlaserve", "jax_cache"), *ENGINE_FLAGS]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.http = self.grpc = None
        self.health_during_warmup = self.ready_during_warmup = None

    def _read(self) -> None:
        for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip())

    def log(self) -> str:
        return "\n".join(self.lines[-60:])

    def find(self, pattern: str):
        for line in list(self.lines):
            m = re.search(pattern, line)
            if m:
                return m
        return None

    def start(self) -> None:
        assert wait_for(lambda: self.find(r"HTTP listening on (http://\S+)") or self.proc.poll() is not None, 120), \
            self.log()
        assert self.proc.poll() is None, self.log()
        self.http = self.find(r"HTTP listening on (http://\S+)").group(1)
        self.grpc = self.find(r"gRPC listening on (\S+)").group(1).rstrip(",")
        with httpx.Client(base_url=self.http, timeout=10) as c:
            self.health_during_warmup = c.get("/health").status_code
            self.ready_during_warmup = c.get("/ready").status_code
            assert wait_for(lambda: c.get("/ready").status_code == 200, 240, 0.25), self.log()
        # /ready turns 200 when the engine is warm; the event loop logs the models and "ready in"
        # a moment later (after the loader thread freezes the heap), so wait for that line too
        assert wait_for(lambda: self.find(r"ready in [\d.]+s") is not None, 60, 0.1), self.log()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("xdg"))
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


def test_warmup_then_ready_and_startup_log(server):
    assert server.health_during_warmup == 200
    assert server.ready_during_warmup in (503, 200)  # 503 unless warmup already finished
    assert server.find(rf"model {DEMO_NAME}: LlamaForCausalLM .*parameters, dtype float32.*devices cpu:0, mesh")
    assert server.find(rf"model {EMBED_NAME}: BertModel")
    assert server.find("RANDOM weights")
    assert server.find(r"programs compiled .*token buckets \[")  # the ragged step's buckets
    assert server.find(r"ready in [\d.]+s")


def test_one_rpc_of_every_grpc_service(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    from frontends.grpc.gen.allspark import allspark_service_pb2 as as_pb
    from frontends.grpc.gen.allspark import allspark_service_pb2_grpc as as_grpc
    from frontends.grpc.gen.arctic_inference import inference_pb2 as ar_pb
    from frontends.grpc.gen.arctic_inference import inference_pb2_grpc as ar_grpc
    from frontends.grpc.gen.sglang import sglang_scheduler_pb2 as sg_pb
    from frontends.grpc.gen.sglang import sglang_scheduler_pb2_grpc as sg_grpc

    with grpc.insecure_channel(server.grpc) as ch:
        enc = ar_grpc.InferenceServiceStub(ch).Encode(
            ar_pb.EncodeRequest(request_id="e2e", n_prompts=1, prompts=["hello"], model_name=EMBED_NAME), timeout=30)
        assert enc.error == "" and enc.embedding_dim == 384 and len(enc.embedding_bytes_fp32[0]) == 4 * 384

        sp = sg_pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, n=1,
                                  max_new_tokens=3, ignore_eos=True)
        replies = list(sg_grpc.SglangSchedulerStub(ch).Generate(sg_pb.GenerateRequest(
            request_id="e2e-gen", tokenized=sg_pb.TokenizedInput(input_ids=[1, 40, 41, 42]), sampling_params=sp),
            timeout=30))
        assert replies[-1].WhichOneof("response") == "complete"
        assert len(replies[-1].complete.output_ids) == 3

        stat = as_grpc.AllSparkStub(ch).GetAsEngineStat(as_pb.ModelName(model_name=DEMO_NAME), timeout=30)
        assert stat.total_span > 0

        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING

        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
        assert {"arctic_inference.InferenceService", "sglang.grpc.scheduler.SglangScheduler",
                "allspark.allspark_service.AllSpark", "grpc.health.v1.Health"} <= services


def test_one_route_of_every_http_kind(server):
    with httpx.Client(base_url=server.http, timeout=60) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/docs").status_code == 200
        assert "/v1/chat/completions" in c.get("/openapi.json").json()["paths"]
        models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert models[DEMO_NAME]["owned_by"] == "xlaserve-demo-random-weights" and EMBED_NAME in models
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 3, "ignore_eos": True})
        assert chat.status_code == 200 and chat.json()["model"] == DEMO_NAME  # the default generator
        comp = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "stream": True})
        assert comp.status_code == 200 and comp.text.rstrip().endswith("data: [DONE]")
        emb = c.post("/v1/embeddings", json={"input": ["hello"]})
        assert emb.status_code == 200 and len(emb.json()["data"][0]["embedding"]) == 384
        mirror = c.post("/sglang.grpc.scheduler.SglangScheduler/GetModelInfo", json={})
        assert mirror.status_code == 200 and mirror.json()
        metrics = c.get("/metrics").text
        assert 'xlaserve_requests_total{front="grpc"' in metrics  # the gRPC calls above were counted
        assert re.search(rf'xlaserve_generation_tokens_total{{model="{DEMO_NAME}"}} [1-9]', metrics)


def test_sigterm_drains_in_flight_streams_then_exits_zero(server):
    """SIGTERM during 8 live streams (4 HTTP SSE, 4 SGLang gRPC): readiness and health flip at
    once, new requests get 503, and all 8 streams finish normally before the process exits 0."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from frontends.grpc.gen.sglang import sglang_scheduler_pb2 as sg_pb
    from frontends.grpc.gen.sglang import sglang_scheduler_pb2_grpc as sg_grpc

    streams = 8
    started = threading.Barrier(streams + 1, timeout=120)
    results: dict = {}

    def http_stream(i: int) -> None:
        try:
            with httpx.Client(base_url=server.http, timeout=120) as c:
                with c.stream("POST", "/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 240,
                        "ignore_eos": True, "stream": True}) as r:
                    events, first = [], True
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            if first and '"content":"' in line and '"content":""' not in line:
                                first = False
                                started.wait()
                    finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"]
                                if c["finish_reason"]]
                    results[f"http-{i}"] = (events[-1], finishes)
        except Exception as e:  # reported by the assertions below
            results[f"http-{i}"] = repr(e)
            started.abort()

    def grpc_stream(i: int) -> None:
        sp = sg_pb.SamplingParams(temperature=0.0, max_new_tokens=240, ignore_eos=True)
        try:
            with grpc.insecure_channel(server.grpc) as ch:
                replies = []
                for msg in sg_grpc.SglangSchedulerStub(ch).Generate(sg_pb.GenerateRequest(
                        request_id=f"drain-{i}", tokenized=sg_pb.TokenizedInput(input_ids=[1, 40 + i, 41]),
                        sampling_params=sp, stream=True), timeout=120):
                    replies.append(msg)
                    if len(replies) == 1:
                        started.wait()
                done = replies[-1].complete
                results[f"grpc-{i}"] = ("complete", [done.finish_reason], done.completion_tokens)
        except Exception as e:
            results[f"grpc-{i}"] = repr(e)
            started.abort()

    threads = [threading.Thread(target=http_stream if i < 4 else grpc_stream, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    started.wait()  # every stream has produced output
    server.proc.send_signal(signal.SIGTERM)
    assert wait_for(lambda: server.find("draining"), 10), server.log()
    with httpx.Client(base_url=server.http, timeout=10) as c:
        ready = c.get("/ready")
        refused = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    with grpc.insecure_channel(server.grpc) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        with pytest.raises(grpc.RpcError) as refused_grpc:
            list(sg_grpc.SglangSchedulerStub(ch).Generate(sg_pb.GenerateRequest(
                request_id="too-late", tokenized=sg_pb.TokenizedInput(input_ids=[1, 2, 3])), timeout=10))
    for t in threads:
        t.join(120)
    code = server.proc.wait(60)
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    assert refused.status_code == 503
    assert refused_grpc.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused_grpc.value.details()
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert len(results) == streams, results
    for name, outcome in results.items():  # every in-flight stream finished normally
        assert isinstance(outcome, tuple), (name, outcome)
        if name.startswith("http"):
            assert outcome == ("[DONE]", ["length"]), (name, outcome)
        else:
            assert outcome == ("complete", ["length"], 240), (name, outcome)
    assert server.find(r"drain: 8 request\(s\) in flight"), server.log()  # SIGTERM came during all 8
    assert code == 0, server.log()
    assert server.find(r"xlaserve: stopped")
