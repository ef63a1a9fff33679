"""The shared grpc.aio server: health, reflection, listeners, keys, admin gating, TLS."""
from __future__ import annotations

import os
import shutil
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from frontends.grpc.gen.allspark import allspark_service_pb2 as apb
from frontends.grpc.gen.allspark import allspark_service_pb2_grpc as apb_grpc
from frontends.grpc.gen.arctic_inference import inference_pb2 as ipb
from frontends.grpc.gen.arctic_inference import inference_pb2_grpc as ipb_grpc
from frontends.grpc.gen.sglang import sglang_scheduler_pb2 as spb
from frontends.grpc.gen.sglang import sglang_scheduler_pb2_grpc as spb_grpc
from frontends.grpc.server import mark_not_serving
from tests.helpers.shared import GEN, start_grpc_server, stop_grpc_server

SERVICES = ["arctic_inference.InferenceService", "sglang.grpc.scheduler.SglangScheduler",
            "allspark.allspark_service.AllSpark"]


def test_health_serving_per_service(grpc_channel):
    stub = health_pb2_grpc.HealthStub(grpc_channel)
    for name in ["", *SERVICES]:
        assert stub.Check(health_pb2.HealthCheckRequest(service=name)).status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as e:
        stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_watch_streams_status(grpc_channel):
    stream = health_pb2_grpc.HealthStub(grpc_channel).Watch(health_pb2.HealthCheckRequest(service=""))
    assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
    stream.cancel()


def test_unknown_method_needs_the_key_too(keyed_server):
    with grpc.insecure_channel(keyed_server.target) as ch:
        call = ch.unary_unary("/sglang.grpc.scheduler.SglangScheduler/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as e:
            call(b"")
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            call(b"", metadata=_md("user-key"))
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_reflection_needs_the_key(keyed_server):
    with grpc.insecure_channel(keyed_server.target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as e:
            list(stub.ServerReflectionInfo(iter([req])))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert list(stub.ServerReflectionInfo(iter([req]), metadata=_md("user-key")))


def test_health_follows_engine_and_drain(server_loop, serving_engine, monkeypatch):
    srv = start_grpc_server(server_loop, serving_engine)
    try:
        with grpc.insecure_channel(srv.target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            monkeypatch.setattr(serving_engine, "_draining", True)
            assert stub.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            monkeypatch.setattr(serving_engine, "_draining", False)
            assert stub.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
            server_loop.run(mark_not_serving(srv.server))
            assert stub.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        stop_grpc_server(server_loop, srv)


def test_reflection_lists_every_service(grpc_channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(grpc_channel)
    replies = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in replies[0].list_services_response.service}
    assert set(SERVICES) | {"grpc.health.v1.Health"} <= names
    req = reflection_pb2.ServerReflectionRequest(file_containing_symbol="sglang.grpc.scheduler.SglangScheduler")
    reply = list(stub.ServerReflectionInfo(iter([req])))[0]
    assert reply.file_descriptor_response.file_descriptor_proto


def test_unix_socket_listener(grpc_server, unix_socket_path):
    assert f"unix:{unix_socket_path}" in grpc_server.addresses
    with grpc.insecure_channel(f"unix:{unix_socket_path}") as ch:
        assert apb_grpc.AllSparkStub(ch).GetRankId(apb.Empty()).rank_id == 0
        assert spb_grpc.SglangSchedulerStub(ch).HealthCheck(spb.HealthCheckRequest()).healthy


def test_gen_http_get_is_not_a_2xx(grpc_server):
    """The SGLang router classifies a worker as HTTP if GET /health answers 2xx."""
    import httpx

    try:
        r = httpx.get(f"http://{grpc_server.target}/health", timeout=3)
        assert not r.is_success
    except httpx.HTTPError:
        pass


def test_message_size_limit(server_loop, serving_engine):
    srv = start_grpc_server(server_loop, serving_engine, max_message_bytes=1024)
    try:
        with grpc.insecure_channel(srv.target) as ch:
            stub = ipb_grpc.InferenceServiceStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                stub.Encode(ipb.EncodeRequest(n_prompts=1, prompts=["x" * 4096]))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        stop_grpc_server(server_loop, srv)


# ---------------------------------------------------------------------- keys and admin
@pytest.fixture(scope="module")
def keyed_server(server_loop, serving_engine):
    srv = start_grpc_server(server_loop, serving_engine, api_key="user-key", admin_api_key="admin-key",
                            enable_admin=True)
    yield srv
    stop_grpc_server(server_loop, srv)


def _md(key):
    return (("authorization", f"Bearer {key}"),) if key else None


@pytest.mark.parametrize("key,code", [
    (None, grpc.StatusCode.UNAUTHENTICATED), ("wrong", grpc.StatusCode.UNAUTHENTICATED),
    ("user-key", None), ("admin-key", None),
])
def test_api_key_on_every_service(keyed_server, key, code):
    with grpc.insecure_channel(keyed_server.target) as ch:
        calls = [
            lambda: ipb_grpc.InferenceServiceStub(ch).HealthCheck(ipb.HealthCheckRequest(), metadata=_md(key)),
            lambda: spb_grpc.SglangSchedulerStub(ch).GetModelInfo(spb.GetModelInfoRequest(), metadata=_md(key)),
            lambda: list(spb_grpc.SglangSchedulerStub(ch).Generate(
                spb.GenerateRequest(request_id="k", tokenized=spb.TokenizedInput(input_ids=[1, 2]),
                                    sampling_params=spb.SamplingParams(max_new_tokens=1)), metadata=_md(key))),
            lambda: apb_grpc.AllSparkStub(ch).GetVersionFull(apb.Empty(), metadata=_md(key)),
        ]
        for call in calls:
            if code is None:
                call()
            else:
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == code
        # health stays open without a key
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_admin_needs_admin_key(keyed_server):
    with grpc.insecure_channel(keyed_server.target) as ch:
        stub = apb_grpc.AllSparkStub(ch)
        req = apb.ModelName(model_name=GEN)
        with pytest.raises(grpc.RpcError) as e:
            stub.StartModel(req, metadata=_md("user-key"))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as e:
            stub.StartModel(req)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.StartModel(req, metadata=_md("admin-key")).as_status == apb.ALLSPARK_SUCCESS  # already running


@pytest.mark.parametrize("method", ["BuildModelFromConfigStruct", "ReloadModelToDeviceMemory",
                                    "UnloadModelFromDeviceMemory", "StartModel", "StopModel", "ReleaseModel",
                                    "ShutdownService", "GetFileInformation"])
def test_admin_refused_unless_enabled(server_loop, serving_engine, method, admin_disabled_server):
    with grpc.insecure_channel(admin_disabled_server.target) as ch:
        stub = apb_grpc.AllSparkStub(ch)
        desc = apb.DESCRIPTOR.services_by_name["AllSpark"].methods_by_name[method]
        from google.protobuf import message_factory

        request = message_factory.GetMessageClass(desc.input_type)()
        with pytest.raises(grpc.RpcError) as e:
            getattr(stub, method)(request)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert stub.GetRankNums(apb.Empty()).rank_id == 1  # non-admin calls still work


@pytest.fixture(scope="module")
def admin_disabled_server(server_loop, serving_engine):
    srv = start_grpc_server(server_loop, serving_engine)
    yield srv
    stop_grpc_server(server_loop, srv)


# ---------------------------------------------------------------------- TLS
@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = str(d / "cert.pem"), str(d / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def test_tls_listener(server_loop, serving_engine, tls_files):
    cert, key = tls_files
    srv = start_grpc_server(server_loop, serving_engine, tls_cert=cert, tls_key=key)
    try:
        with open(cert, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        with grpc.secure_channel(srv.target, creds) as ch:
            assert apb_grpc.AllSparkStub(ch).GetRankId(apb.Empty(), timeout=10).rank_id == 0
        with grpc.insecure_channel(srv.target) as ch:
            with pytest.raises(grpc.RpcError):
                apb_grpc.AllSparkStub(ch).GetRankId(apb.Empty(), timeout=3)
    finally:
        stop_grpc_server(server_loop, srv)
    assert os.path.exists(cert)
