"""The HTTP app around the routes: probes, metrics, docs, auth, body limits, error shapes."""
from __future__ import annotations

import re
import socket
from urllib.parse import urlsplit

import grpc
import httpx
import pytest

from frontends.grpc.gen.arctic_inference import inference_pb2, inference_pb2_grpc
from tests.helpers.shared import GEN, HTTP_API_KEY, HTTP_SMALL_BODY_LIMIT, start_grpc_server, stop_grpc_server

AUTH = {"Authorization": f"Bearer {HTTP_API_KEY}"}
MIRROR_HEALTH = "/arctic_inference.InferenceService/HealthCheck"


@pytest.fixture(scope="module")
def secured(secured_http_url):
    with httpx.Client(base_url=secured_http_url, timeout=60) as c:
        yield c


def raw_request(url: str, request_line: str, headers: dict[str, str] | None = None, body: bytes = b"") -> int:
    """Send one HTTP/1.1 request with an exact, unnormalised path; returns the status code."""
    parts = urlsplit(url)
    head = [request_line, f"Host: {parts.hostname}", "Connection: close"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body:
        head.append(f"Content-Length: {len(body)}")
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as s:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1])


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if not m:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


# ---------------------------------------------------------------------------------- probes
def test_health_and_ready_on_a_warm_engine(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json() == {"status": "ready"}


def test_ready_is_503_before_loading_and_while_draining(server_loop):
    """A real Engine with nothing loaded yet, as during warmup; then draining."""
    from frontends.http.app import create_app
    from jax_engine.config import EngineArgs
    from jax_engine.engine import Engine

    engine = Engine(EngineArgs(models=[]))
    app = create_app(engine)

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            out = [await c.get("/health"), await c.get("/ready"),
                   await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}),
                   await c.post("/v1/embeddings", json={"input": "x"})]
            engine.begin_drain()
            out += [await c.get("/ready"), await c.post("/v1/completions", json={"prompt": "x"})]
            return out

    health, ready, chat, emb, draining, refused = server_loop.run(run())
    assert health.status_code == 200
    assert ready.status_code == 503 and ready.json() == {"status": "starting"}
    for r in (chat, emb, refused):
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
    assert draining.status_code == 503 and draining.json() == {"status": "draining"}
    assert "draining" in refused.json()["error"]["message"]


# ---------------------------------------------------------------------------------- metrics
REQUIRED_METRICS = [
    "xlaserve_requests_total", "xlaserve_prompt_tokens_total", "xlaserve_generation_tokens_total",
    "xlaserve_time_to_first_token_seconds_bucket", "xlaserve_inter_token_latency_seconds_bucket",
    "xlaserve_running_requests", "xlaserve_waiting_requests", "xlaserve_kv_pages_used", "xlaserve_kv_pages_total",
    "xlaserve_prefix_cache_hit_tokens_total", "xlaserve_compilations_after_warmup_total",
]


def test_metrics_names_present_and_values_move(client):
    client.post("/v1/completions", json={"prompt": "warm", "max_tokens": 2})
    before = client.get("/metrics")
    assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain")
    r = client.post("/v1/completions", json={"prompt": "the quick brown fox", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    client.post("/v1/completions", json={"prompt": "hi", "n": 0})
    after = client.get("/metrics").text
    for name in REQUIRED_METRICS:
        assert re.search(rf"^{name}[{{ ]", after, re.M), name
    b = before.text
    req = dict(front="http", method="/v1/completions")
    assert metric(after, "xlaserve_requests_total", **req, outcome="ok") == metric(
        b, "xlaserve_requests_total", **req, outcome="ok") + 1
    assert metric(after, "xlaserve_requests_total", **req, outcome="invalid_argument") >= 1
    assert metric(after, "xlaserve_generation_tokens_total", model=GEN) >= metric(
        b, "xlaserve_generation_tokens_total", model=GEN) + 5
    assert metric(after, "xlaserve_prompt_tokens_total", model=GEN) > metric(b, "xlaserve_prompt_tokens_total",
                                                                              model=GEN)
    assert metric(after, "xlaserve_time_to_first_token_seconds_count", model=GEN) == metric(
        b, "xlaserve_time_to_first_token_seconds_count", model=GEN) + 1
    assert metric(after, "xlaserve_inter_token_latency_seconds_count", model=GEN) >= metric(
        b, "xlaserve_inter_token_latency_seconds_count", model=GEN) + 4
    assert metric(after, "xlaserve_kv_pages_total", model=GEN) > 0
    assert metric(after, "xlaserve_compilations_after_warmup_total", model=GEN) == 0
    # the measured --cpu-matmul choice: one path per decoder matrix and row class, every row covered
    routes = re.findall(rf'^xlaserve_cpu_matmul_path{{model="{GEN}",path="(\w+)",shape_class="([^"]+)",weight="(\w+)"}} 1\.0$',
                        after, re.M)
    assert {w for _, _, w in routes} == {"qkv", "o", "gate_up", "down", "lm_head"}, routes
    assert {p for p, _, _ in routes} <= {"kernel", "xla", "blas"}
    # probes and scrapes are not counted as requests
    assert metric(after, "xlaserve_requests_total", method="/metrics") == 0


def test_grpc_calls_are_counted_with_front_grpc(server_loop, serving_engine):
    from frontends.grpc.server import make_servicers
    from frontends.http.app import ServerMetrics

    metrics = ServerMetrics(serving_engine)
    srv = start_grpc_server(server_loop, metrics.instrument(serving_engine),
                            servicers=metrics.count_grpc(make_servicers(serving_engine)))
    try:
        with grpc.insecure_channel(srv.target) as ch:
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            assert stub.HealthCheck(inference_pb2.HealthCheckRequest()).healthy
    finally:
        stop_grpc_server(server_loop, srv)
    text = metrics.exposition().decode()
    assert metric(text, "xlaserve_requests_total", front="grpc",
                  method="/arctic_inference.InferenceService/HealthCheck", outcome="ok") == 1


# ---------------------------------------------------------------------------------- docs
def test_docs_and_openapi_document_400_not_422(client):
    assert client.get("/docs").status_code == 200
    spec = client.get("/openapi.json").json()
    paths = spec["paths"]
    for p in ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/health", "/ready",
              "/metrics", MIRROR_HEALTH, "/sglang.grpc.scheduler.SglangScheduler/Generate"):
        assert p in paths, p
    codes = {code for ops in paths.values() for op in ops.values() for code in op.get("responses", {})}
    assert "422" not in codes and "400" in codes


# ---------------------------------------------------------------------------------- errors
def test_unknown_routes_use_the_right_error_shape(client):
    r = client.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = client.get("/nothing-here")
    assert r.status_code == 404 and r.json()["code"] == "not_found" and r.json()["message"]
    r = client.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_wrong_content_type_and_non_json_body_are_400(client):
    r = client.post("/v1/completions", content=b"prompt=hi", headers={"content-type": "text/plain"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/completions", content=b"", headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_mirror_routes_are_served(client):
    r = client.post(MIRROR_HEALTH, json={})
    assert r.status_code == 200 and r.json()["healthy"] is True


# ---------------------------------------------------------------------------------- auth
def test_api_key_guards_every_route_but_health(secured):
    assert secured.get("/health").status_code == 200
    for method, path in (("GET", "/ready"), ("GET", "/metrics"), ("GET", "/docs"), ("GET", "/openapi.json"),
                         ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", MIRROR_HEALTH)):
        r = secured.request(method, path, json={} if method == "POST" else None)
        assert r.status_code == 401, (path, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        body = r.json()
        if path.startswith("/v1/"):
            assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == "unauthenticated"
        else:
            assert body["code"] == "unauthenticated" and body["message"]
    for path in ("/ready", "/metrics", "/v1/models"):
        assert secured.get(path, headers=AUTH).status_code == 200
    assert secured.post(MIRROR_HEALTH, json={}, headers=AUTH).status_code == 200


@pytest.mark.parametrize("value", [
    None, "", f"Basic {HTTP_API_KEY}", f"Bearer {HTTP_API_KEY.upper()}", f"Bearer {HTTP_API_KEY}x",
    f"Bearer {HTTP_API_KEY[:-1]}", "Bearer", f"{HTTP_API_KEY}",
])
def test_missing_or_wrong_keys_are_401(secured, value):
    headers = {} if value is None else {"Authorization": value}
    assert secured.get("/v1/models", headers=headers).status_code == 401


def test_bearer_scheme_is_case_insensitive_but_the_key_is_not(secured):
    assert secured.get("/v1/models", headers={"Authorization": f"bearer {HTTP_API_KEY}"}).status_code == 200


@pytest.mark.parametrize("path", [
    "//v1/models", "/v1//models", "/%761/models", "/v1%2Fmodels", "/v1/../v1/models", "/health/../v1/models",
    "/./v1/models", "/health/", "/%68ealth", "/HEALTH", "/health%2F..%2Fv1%2Fmodels",
])
def test_path_tricks_still_need_the_key(secured_http_url, path):
    assert raw_request(secured_http_url, f"GET {path} HTTP/1.1") == 401
    assert raw_request(secured_http_url, "GET /health HTTP/1.1") == 200


# ---------------------------------------------------------------------------------- body limit
def test_body_over_the_limit_is_413(secured_http_url, secured):
    big = b'{"prompt": "' + b"a" * (HTTP_SMALL_BODY_LIMIT + 10) + b'"}'
    r = secured.post("/v1/completions", content=big, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "resource_exhausted"

    def chunks():
        for _ in range(10):
            yield b"a" * 1024

    r = secured.post("/v1/completions", content=chunks(), headers={**AUTH, "content-type": "application/json"})
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert r.status_code == 413
    r = secured.post(MIRROR_HEALTH, content=big, headers=AUTH)
    assert r.status_code == 413 and r.json()["code"] == "resource_exhausted"
    # under the limit, chunked bodies are replayed intact
    r = secured.post("/v1/completions", content=iter([b'{"prompt": "hi", ', b'"max_tokens": 1}']),
                     headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert raw_request(secured_http_url, "POST /v1/completions HTTP/1.1",
                       {**AUTH, "Content-Length": "abc"}) == 400
