"""The fronts against `tests/helpers/fake_engine.FakeEngine`: no model, no JAX compile, seconds to run.

Also checks the contract itself: the real `Engine`, the fake and the metrics wrapper all
satisfy `jax_engine.api.EngineAPI`, member by member and signature by signature.
"""
from __future__ import annotations

import inspect
import time

import grpc
import numpy as np
import pytest
from fastapi.testclient import TestClient

from frontends.common.metrics import InstrumentedEngine, ServerMetrics
from frontends.grpc.gen.allspark import allspark_service_pb2 as apb
from frontends.grpc.gen.allspark import allspark_service_pb2_grpc as apb_grpc
from frontends.grpc.gen.arctic_inference import inference_pb2 as ipb
from frontends.grpc.gen.arctic_inference import inference_pb2_grpc as ipb_grpc
from frontends.grpc.gen.sglang import sglang_scheduler_pb2 as spb
from frontends.grpc.gen.sglang import sglang_scheduler_pb2_grpc as spb_grpc
from frontends.grpc.server import make_servicers
from frontends.http.app import create_app
from jax_engine.api import EngineAPI, Tokenizer
from tests.helpers.fake_engine import EMBED_DIM, FAKE_EMBED, FAKE_GEN, FakeEngine, FakeTokenizer
from tests.helpers.shared import start_grpc_server, stop_grpc_server

PROMPT = [1, 40, 41, 42]


def expected_tokens(prompt: list[int], n: int, index: int = 0) -> list[int]:
    return [prompt[-1] + 1 + index + k for k in range(n)]


# ============================================================================================
# the contract
# ============================================================================================
def _members(proto: type) -> set[str]:
    names = {n for n in vars(proto) if not n.startswith("_")}
    return names | set(getattr(proto, "__annotations__", {}))


def _check_satisfies(cls: type, instance: object) -> None:
    assert isinstance(instance, EngineAPI), cls
    for name in sorted(_members(EngineAPI)):
        assert hasattr(instance, name), f"{cls.__name__} lacks EngineAPI.{name}"
        want = inspect.getattr_static(EngineAPI, name, None)
        if want is None or isinstance(want, property):  # a data attribute or a property
            if isinstance(want, property):
                assert isinstance(inspect.getattr_static(cls, name, None), property), f"{cls.__name__}.{name}"
            continue
        have = inspect.getattr_static(cls, name)
        assert callable(have), f"{cls.__name__}.{name} is not a method"
        w, h = inspect.signature(want), inspect.signature(have)
        assert [(p.name, p.kind, p.default) for p in w.parameters.values()] == \
               [(p.name, p.kind, p.default) for p in h.parameters.values()], f"{cls.__name__}.{name}{h} != {w}"
        if inspect.iscoroutinefunction(want):
            assert inspect.iscoroutinefunction(have), f"{cls.__name__}.{name} must be async"
        else:
            assert not inspect.iscoroutinefunction(have), f"{cls.__name__}.{name} must not be a coroutine function"


def test_real_engine_satisfies_engine_api():
    from jax_engine.api import EngineArgs
    from jax_engine.engine import Engine

    typed: EngineAPI = Engine.__new__(Engine)  # a static checker verifies this assignment
    assert typed is not None
    engine = Engine(EngineArgs())  # no models: nothing is loaded or compiled
    _check_satisfies(Engine, engine)
    assert inspect.isasyncgenfunction(Engine.generate)


def test_fake_and_instrumented_engines_satisfy_engine_api():
    fake = FakeEngine()
    _check_satisfies(FakeEngine, fake)
    _check_satisfies(InstrumentedEngine, ServerMetrics(fake).instrument(fake))
    assert isinstance(FakeTokenizer(), Tokenizer)


def test_fronts_import_only_the_engine_contract():
    """A front imports jax_engine.api, .types and .errors, nothing else of the engine; HTTP and
    gRPC import each other only through frontends.common."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "frontends"
    allowed = {"jax_engine.api", "jax_engine.types", "jax_engine.errors"}
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        if "/gen/" in rel or rel == "frontends/cli.py":  # generated code; the CLI is the composition root
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "jax_engine"]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            for mod in mods:
                if mod.startswith("jax_engine") and mod != "jax_engine" and mod not in allowed:
                    bad.append(f"{rel}: {mod}")
                if rel.startswith("frontends/http/") and mod.startswith("frontends.grpc") \
                        and not mod.startswith("frontends.grpc.gen"):
                    bad.append(f"{rel}: {mod}")
                if rel.startswith("frontends/grpc/") and mod.startswith("frontends.http"):
                    bad.append(f"{rel}: {mod}")
                if rel.startswith("frontends/common/") and mod.startswith(("frontends.grpc", "frontends.http")):
                    bad.append(f"{rel}: {mod}")
                if rel.startswith("frontends/") and mod in ("jax", "jaxlib"):
                    bad.append(f"{rel}: {mod}")
    assert not bad, bad


# ============================================================================================
# gRPC: the three services on one in-process server
# ============================================================================================
@pytest.fixture(scope="module")
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def fake_grpc(server_loop, fake):
    metrics = ServerMetrics(fake)
    srv = start_grpc_server(server_loop, metrics.instrument(fake), enable_admin=True,
                            servicers=metrics.count_grpc(make_servicers(metrics.instrument(fake))))
    channel = grpc.insecure_channel(srv.target)
    yield channel, metrics
    channel.close()
    stop_grpc_server(server_loop, srv)


def test_sglang_generate_and_model_info(fake_grpc):
    channel, metrics = fake_grpc
    stub = spb_grpc.SglangSchedulerStub(channel)
    sp = spb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, n=1, max_new_tokens=5,
                            ignore_eos=True)
    msgs = list(stub.Generate(spb.GenerateRequest(request_id="fake-1", tokenized=spb.TokenizedInput(input_ids=PROMPT),
                                                  sampling_params=sp)))
    assert len(msgs) == 1 and msgs[0].WhichOneof("response") == "complete"
    c = msgs[0].complete
    assert list(c.output_ids) == expected_tokens(PROMPT, 5)
    assert c.finish_reason == "length" and c.prompt_tokens == len(PROMPT) and c.completion_tokens == 5
    info = stub.GetModelInfo(spb.GetModelInfoRequest())
    assert info.model_path == f"/fake/{FAKE_GEN}" and info.vocab_size == 512
    # counted as front="grpc" by the metrics wrapper (no __getattr__ proxy)
    text = metrics.exposition().decode()
    assert 'front="grpc",method="/sglang.grpc.scheduler.SglangScheduler/Generate",outcome="ok"' in text
    assert f'xlaserve_time_to_first_token_seconds_count{{model="{FAKE_GEN}"}} 1.0' in text


def test_sglang_refusal_is_a_status(fake_grpc):
    channel, _ = fake_grpc
    stub = spb_grpc.SglangSchedulerStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(spb.GenerateRequest(request_id="fake-2", tokenized=spb.TokenizedInput(input_ids=[1, 9999]))))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_arctic_encode_health_and_replicas(fake_grpc, fake):
    channel, _ = fake_grpc
    stub = ipb_grpc.InferenceServiceStub(channel)
    resp = stub.Encode(ipb.EncodeRequest(request_id="e1", model_name=FAKE_EMBED, n_prompts=2, prompts=["a b", "c"]))
    assert resp.error == "" and resp.n_prompts == 2 and resp.embedding_dim == EMBED_DIM
    rows = [np.frombuffer(b, "<f4") for b in resp.embedding_bytes_fp32]
    assert all(abs(float(np.linalg.norm(r)) - 1.0) < 1e-5 for r in rows) and not np.allclose(rows[0], rows[1])
    bad = stub.Encode(ipb.EncodeRequest(request_id="e2", model_name="nope", n_prompts=1, prompts=["a"]))
    assert "Expected model name" in bad.error
    assert stub.HealthCheck(ipb.HealthCheckRequest()).healthy
    replicas = stub.GetReplicaInfo(ipb.ReplicaInfoRequest())
    assert replicas.n_replicas == 1 and replicas.replica_infos[0].model_name == FAKE_EMBED


def test_allspark_start_get_and_version(fake_grpc):
    channel, _ = fake_grpc
    stub = apb_grpc.AllSparkStub(channel)
    t = apb.Tensor(name="input_ids", shape=apb.Tensor.Shape(dims=[1, len(PROMPT)]),
                   device_type=apb.DeviceType(dev_type=apb.CPU), data_type=apb.INT64, data_mode=apb.DENSE,
                   data=np.asarray(PROMPT, "<i8").tobytes())
    cfg = apb.GenerateConfig(do_sample=False, num_beams=1, num_return_sequences=1, temperature=1.0, top_k=50,
                             top_p=1.0, repetition_penalty=1.0, max_length=len(PROMPT) + 3, seed=1, uuid="as-1")
    started = stub.StartRequest(apb.StartRequestRequest(model_name=FAKE_GEN, inputs=apb.TensorMap(
        tensor_map={"input_ids": t}), config=cfg))
    assert started.as_status == apb.ALLSPARK_SUCCESS and started.uuid == "as-1"
    ids: list[int] = []
    deadline = time.monotonic() + 10
    while stub.GenerateStatus(apb.UUID(uuid="as-1")).status != apb.GenerateFinished and time.monotonic() < deadline:
        ids += list(stub.Get(apb.UUID(uuid="as-1")).ids_from_generate)
    assert ids == expected_tokens(PROMPT, 3)
    assert stub.ReleaseRequest(apb.StopRequestRequest(uuid="as-1")).as_status == apb.ALLSPARK_SUCCESS
    assert "/(GitSha1:" in stub.GetVersionFull(apb.Empty()).version_info
    # admin life cycle through the Protocol's async methods
    assert stub.StopModel(apb.ModelName(model_name=FAKE_GEN)).as_status == apb.ALLSPARK_SUCCESS
    assert stub.StartModel(apb.ModelName(model_name=FAKE_GEN)).as_status == apb.ALLSPARK_SUCCESS


# ============================================================================================
# HTTP: the FastAPI app (OpenAI routes, the JSON mirror, probes, metrics) in-process
# ============================================================================================
@pytest.fixture(scope="module")
def http_fake():
    engine = FakeEngine()
    app = create_app(engine, servicers=make_servicers(engine))
    with TestClient(app) as client:
        yield client, engine


def test_http_probes_models_and_draining(http_fake):
    client, engine = http_fake
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").status_code == 200
    names = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert names == [FAKE_GEN, FAKE_EMBED]
    assert client.get("/v1/models/nope").status_code == 404


def test_http_completions_chat_and_embeddings(http_fake):
    client, _ = http_fake
    r = client.post("/v1/completions", json={"model": FAKE_GEN, "prompt": PROMPT, "max_tokens": 3,
                                             "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["text"] == FakeTokenizer().decode(expected_tokens(PROMPT, 3))
    r = client.post("/v1/chat/completions", json={"model": FAKE_GEN, "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    r = client.post("/v1/embeddings", json={"model": FAKE_EMBED, "input": ["a", "b"]})
    assert r.status_code == 200, r.text
    assert [len(d["embedding"]) for d in r.json()["data"]] == [EMBED_DIM, EMBED_DIM]
    r = client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    text = client.get("/metrics").text
    assert 'front="http",method="/v1/completions",outcome="ok"' in text


def test_http_mirror_calls_the_grpc_servicers(http_fake):
    client, _ = http_fake
    r = client.post("/sglang.grpc.scheduler.SglangScheduler/GetModelInfo", json={})
    assert r.status_code == 200, r.text
    assert r.json()["modelPath"] == f"/fake/{FAKE_GEN}"
    r = client.post("/arctic_inference.InferenceService/HealthCheck", json={})
    assert r.status_code == 200 and r.json()["healthy"] is True
    # admin methods stay gated on the mirror by the shared AccessPolicy
    r = client.post("/allspark.allspark_service.AllSpark/StopModel", json={"modelName": FAKE_GEN})
    assert r.status_code == 403


def test_http_ready_is_503_while_draining():
    engine = FakeEngine()
    with TestClient(create_app(engine)) as client:
        engine.begin_drain()
        r = client.get("/ready")
        assert r.status_code == 503 and r.json() == {"status": "draining"}
        r = client.post("/v1/completions", json={"model": FAKE_GEN, "prompt": PROMPT})
        assert r.status_code == 503
