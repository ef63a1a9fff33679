"""LoRA adapters in every front and the CLI, against the fake engine (tests/helpers/fake_engine.py):
no model, no JAX. Each test checks a front's mapping: which engine calls and requests it makes
(`FakeEngine.generate_requests` / `adapter_calls`) and what the client sees.

SGLang `lora_id`, AllSpark `lora_name` (unknown: status 13, ALLSPARK_LORA_NOT_LOADED) and
`lora_names` / `is_lora_cfg` at build, Arctic `lora_config`, OpenAI `model` = an adapter name
(/v1/completions, /v1/chat/completions, /v1/responses, /v1/models), vLLM's load / unload routes
(admin only), the JSON mirror, the SGLang `GetLoads` lora section, /metrics and the CLI flags.
"""
from __future__ import annotations

import asyncio
import json
import os

import grpc
import numpy as np
import pytest
from fastapi.testclient import TestClient
from google.protobuf import json_format

from frontends.grpc.gen.allspark import allspark_service_pb2 as apb
from frontends.grpc.gen.arctic_inference import inference_pb2 as ipb
from frontends.grpc.gen.sglang import sglang_scheduler_pb2 as spb
from frontends.grpc.server import make_servicers
from frontends.http.app import create_app
from jax_engine.types import AdapterInfo
from tests.helpers.fake_engine import FAKE_EMBED, FAKE_GEN, FakeEngine
from tests.helpers.protocol_clients import GrpcTransport, MirrorTransport
from tests.helpers.shared import start_grpc_server, stop_grpc_server

SGLANG = "sglang.grpc.scheduler.SglangScheduler"
ALLSPARK = "allspark.allspark_service.AllSpark"
ARCTIC = "arctic_inference.InferenceService"
PROMPT = [1, 40, 41, 42]
LORA_NOT_LOADED = 13
ERROR_TRAILER = "allspark-error"


# ============================================================================================
# adapters on disk (PEFT folders: only adapter_config.json matters to the fake) and engines
# ============================================================================================
def peft_folder(root: str, name: str, rank: int = 8) -> str:
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": ["q_proj", "v_proj"]}, f)
    return path


@pytest.fixture()
def root(tmp_path) -> str:
    """--model-root holding adapters ad-b and ad-c (rank 8) and ad-big (rank 128)."""
    r = tmp_path / "model_root"
    r.mkdir()
    for name in ("ad-b", "ad-c"):
        peft_folder(str(r), name)
    peft_folder(str(r), "ad-big", rank=128)
    (r / "not-peft").mkdir()
    return str(r)


@pytest.fixture()
def engine(root, tmp_path) -> FakeEngine:
    """LoRA on, three slots, adapter ad-a loaded at start (--lora ad-a=PATH)."""
    start = peft_folder(str(tmp_path / "start"), "ad-a")
    return FakeEngine(model_root=root, enable_lora=True, loras=[("ad-a", start)], max_loras=3)


def http_client(engine: FakeEngine, **kw) -> TestClient:
    return TestClient(create_app(engine, servicers=make_servicers(engine), **kw))


@pytest.fixture()
def transport(request, engine, server_loop):
    """The same servicers over gRPC or over the JSON mirror."""
    if request.param == "grpc":
        srv = start_grpc_server(server_loop, engine, enable_admin=True)
        channel = grpc.insecure_channel(srv.target)
        yield GrpcTransport(channel)
        channel.close()
        stop_grpc_server(server_loop, srv)
    else:
        with http_client(engine, enable_admin=True) as client:
            yield MirrorTransport(client)


both = pytest.mark.parametrize("transport", ["grpc", "mirror"], indirect=True)


# ============================================================================================
# SGLang: lora_id, GetLoads lora section
# ============================================================================================
def sglang_request(rid: str, **kw) -> spb.GenerateRequest:
    sp = spb.SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    return spb.GenerateRequest(request_id=rid, tokenized=spb.TokenizedInput(input_ids=PROMPT), sampling_params=sp,
                               **kw)


@both
def test_sglang_lora_id_reaches_the_engine_as_adapter(transport, engine):
    msgs = transport.stream(SGLANG, "Generate", sglang_request("l-1", lora_id="ad-a"), spb.GenerateResponse)
    assert msgs[-1].complete.completion_tokens == 3
    req = engine.generate_requests[-1]
    assert req.adapter == "ad-a" and req.model == FAKE_GEN
    transport.stream(SGLANG, "Generate", sglang_request("l-2"), spb.GenerateResponse)
    assert engine.generate_requests[-1].adapter is None and engine.generate_requests[-1].model is None


def test_sglang_unknown_lora_id_is_not_found(engine, server_loop):
    srv = start_grpc_server(server_loop, engine)
    try:
        with grpc.insecure_channel(srv.target) as ch:
            call = ch.unary_stream(f"/{SGLANG}/Generate", request_serializer=spb.GenerateRequest.SerializeToString,
                                   response_deserializer=spb.GenerateResponse.FromString)
            with pytest.raises(grpc.RpcError) as e:
                list(call(sglang_request("l-3", lora_id="nope"), timeout=30))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert "lora_id 'nope'" in e.value.details() and "ad-a" in e.value.details()
    finally:
        stop_grpc_server(server_loop, srv)
    # over the mirror: 404 with the same message
    with http_client(engine) as client:
        body = json_format.MessageToDict(sglang_request("l-4", lora_id="nope"))
        r = client.post(f"/{SGLANG}/Generate", json=body)
        assert r.status_code == 404 and r.json()["code"] == "not_found" and "lora_id" in r.json()["message"]


def test_sglang_embed_carries_no_lora_id():
    """Only GenerateRequest names an adapter; Embed has no such field in the seed proto."""
    assert "lora_id" in spb.GenerateRequest.DESCRIPTOR.fields_by_name
    assert not [f for f in spb.EmbedRequest.DESCRIPTOR.fields_by_name if "lora" in f]


@both
def test_sglang_get_loads_lora_section(transport, engine):
    asyncio.run(engine.load_adapter("ad-b", os.path.join(engine.args.model_root, "ad-b")))
    for include in (["lora"], ["all"], []):
        resp, _ = transport.unary(SGLANG, "GetLoads", spb.GetLoadsRequest(include=include), spb.GetLoadsResponse)
        load = resp.loads[0]
        assert load.HasField("lora"), include
        assert (load.lora.slots_used, load.lora.slots_total) == (2, 3)
        assert load.lora.utilization == pytest.approx(2 / 3)
        assert not load.HasField("speculative")             # "spec": no speculative decoding
    resp, _ = transport.unary(SGLANG, "GetLoads", spb.GetLoadsRequest(include=["core", "queues"]),
                              spb.GetLoadsResponse)
    assert not resp.loads[0].HasField("lora")


def test_sglang_get_loads_without_lora_leaves_the_section_unset(server_loop):
    with http_client(FakeEngine()) as client:
        r = client.post(f"/{SGLANG}/GetLoads", json={"include": ["lora"]})
        assert r.status_code == 200 and "lora" not in r.json()["loads"][0]


# ============================================================================================
# AllSpark: lora_name per request, lora_names / is_lora_cfg at build
# ============================================================================================
def allspark_start(uid: str, model: str = FAKE_GEN, **cfg) -> apb.StartRequestRequest:
    t = apb.Tensor(name="tensor", shape=apb.Tensor.Shape(dims=[1, len(PROMPT)]),
                   device_type=apb.DeviceType(dev_type=apb.CPU), data_type=apb.INT64, data_mode=apb.DENSE,
                   data=np.asarray(PROMPT, "<i8").tobytes())
    config = apb.GenerateConfig(do_sample=False, early_stopping=True, max_length=len(PROMPT) + 3, uuid=uid, **cfg)
    return apb.StartRequestRequest(model_name=model, inputs=apb.TensorMap(tensor_map={"input_ids": t}), config=config)


@both
def test_allspark_lora_name_reaches_the_engine(transport, engine):
    resp, _ = transport.unary(ALLSPARK, "StartRequest", allspark_start("as-l1", lora_name="ad-a"),
                              apb.StartRequestResponse)
    assert resp.as_status == apb.ALLSPARK_SUCCESS and resp.uuid == "as-l1"
    req = engine.generate_requests[-1]
    assert req.adapter == "ad-a" and req.model == FAKE_GEN
    transport.unary(ALLSPARK, "SyncRequest", apb.StopRequestRequest(uuid="as-l1"), apb.StartRequestResponse)
    got, _ = transport.unary(ALLSPARK, "GetNoWait", apb.UUID(uuid="as-l1"), apb.GeneratedElements)
    assert len(got.ids_from_generate) == 3
    transport.unary(ALLSPARK, "ReleaseRequest", apb.StopRequestRequest(uuid="as-l1"), apb.StartRequestResponse)


@both
def test_allspark_unknown_lora_name_is_lora_not_loaded(transport, engine):
    before = len(engine.generate_requests)
    resp, trailers = transport.unary(ALLSPARK, "StartRequest", allspark_start("as-l2", lora_name="nope"),
                                     apb.StartRequestResponse)
    assert resp.as_status == LORA_NOT_LOADED and resp.uuid == "as-l2"
    assert "config.lora_name 'nope'" in trailers[ERROR_TRAILER]
    assert len(engine.generate_requests) == before                       # refused before the engine
    status, _ = transport.unary(ALLSPARK, "GenerateStatus", apb.UUID(uuid="as-l2"), apb.GenerateRequestStatus)
    assert status.status == apb.Init                            # not registered


def test_allspark_lora_name_unloaded_before_admission_is_lora_not_loaded(server_loop):
    """The adapter is listed, but the engine no longer knows it when the request arrives."""
    class Racing(FakeEngine):
        def adapters(self, model=None):
            return [AdapterInfo(name="ghost", model=FAKE_GEN, path="/x", rank=8, alpha=16.0)]

    engine = Racing(enable_lora=True)
    with http_client(engine) as client:
        body = json_format.MessageToDict(allspark_start("as-l3", lora_name="ghost"))
        r = client.post(f"/{ALLSPARK}/StartRequest", json=body)
        assert r.status_code == 200 and r.json()["asStatus"] == LORA_NOT_LOADED
        assert "config.lora_name 'ghost'" in r.headers["trailer-allspark-error"]
    assert engine.generate_requests[-1].adapter == "ghost"       # the engine's NotFound, mapped to 13


def build(name: str, **kw) -> apb.ModelStructConfig:
    return apb.ModelStructConfig(model_name=name, model_path=f"/fake/{name}", compute_unit="CPU:0",
                                 matmul_precision="highest", **kw)


@both
def test_allspark_build_loads_lora_names_from_the_model_root(transport, engine, root):
    resp, _ = transport.unary(ALLSPARK, "BuildModelFromConfigStruct",
                              build("gen-b", lora_names=apb.LoraNames(names=["ad-b", "ad-c"])), apb.AsStatus)
    assert resp.as_status == apb.ALLSPARK_SUCCESS
    assert ("load_adapter", "ad-b", os.path.join(root, "ad-b"), "gen-b") in engine.adapter_calls
    assert sorted(a.name for a in engine.adapters("gen-b")) == ["ad-b", "ad-c"]
    # is_lora_cfg with LoRA enabled: accepted
    resp, _ = transport.unary(ALLSPARK, "BuildModelFromConfigStruct", build("gen-c", is_lora_cfg=True), apb.AsStatus)
    assert resp.as_status == apb.ALLSPARK_SUCCESS


@both
@pytest.mark.parametrize("names,needle", [
    (["missing"], "not a folder under --model-root"),
    (["not-peft"], "adapter_config.json"),
    (["ad-big"], "--max-lora-rank"),
    (["ad-a"], "loaded on model 'fake-gen'"),
    (["../ad-b"], "not an adapter name"),
    (["ad-b", "ad-b"], "twice"),
    (["ad-b", "missing"], "missing"),
], ids=["missing", "not-peft", "rank", "other-model", "path", "twice", "second-fails"])
def test_allspark_build_lora_names_failures_are_param_error(transport, engine, names, needle):
    resp, trailers = transport.unary(ALLSPARK, "BuildModelFromConfigStruct",
                                     build("gen-x", lora_names=apb.LoraNames(names=names)), apb.AsStatus)
    assert resp.as_status == apb.ALLSPARK_PARAM_ERROR
    assert "lora_names" in trailers[ERROR_TRAILER] and needle in trailers[ERROR_TRAILER], trailers
    assert "gen-x" not in [m.name for m in engine.models()]      # the build failed as a whole
    assert [a.name for a in engine.adapters()] == ["ad-a"]        # nothing left loaded


@pytest.mark.parametrize("kw,field", [(dict(is_lora_cfg=True), "is_lora_cfg"),
                                      (dict(lora_names=apb.LoraNames(names=["ad-b"])), "lora_names")])
def test_allspark_build_lora_without_lora_enabled_names_the_flag(kw, field, root):
    engine = FakeEngine(model_root=root)
    with http_client(engine, enable_admin=True) as client:
        r = client.post(f"/{ALLSPARK}/BuildModelFromConfigStruct", json=json_format.MessageToDict(build("g", **kw)))
        assert r.status_code == 200 and r.json()["asStatus"] == "ALLSPARK_PARAM_ERROR"
        reason = r.headers["trailer-allspark-error"]
        assert reason.startswith(field) and "--enable-lora" in reason
    assert "g" not in [m.name for m in engine.models()] and not engine.adapter_calls


# ============================================================================================
# Arctic: lora_config (the seed's Encode has no per-request LoRA field)
# ============================================================================================
def test_arctic_lora_config(engine):
    assert not [f for f in ipb.EncodeRequest.DESCRIPTOR.fields_by_name if "lora" in f]
    with http_client(FakeEngine()) as client:
        infos = client.post(f"/{ARCTIC}/GetReplicaInfo", json={}).json()["replicaInfos"]
        assert [i["loraConfig"] for i in infos] == ["None"]
    with http_client(engine) as client:
        infos = client.post(f"/{ARCTIC}/GetReplicaInfo", json={}).json()["replicaInfos"]
        assert infos[0]["modelName"] == FAKE_EMBED
        assert infos[0]["loraConfig"] == "LoRAConfig(max_loras=3, max_lora_rank=64, adapters=[ad-a])"


# ============================================================================================
# OpenAI: model = an adapter name, /v1/models, the admin load / unload routes
# ============================================================================================
def test_openai_model_names_an_adapter(engine):
    with http_client(engine) as client:
        r = client.post("/v1/completions", json={"model": "ad-a", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "ad-a"
        assert (engine.generate_requests[-1].model, engine.generate_requests[-1].adapter) == (FAKE_GEN, "ad-a")
        r = client.post("/v1/chat/completions", json={"model": "ad-a", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "ad-a"
        assert (engine.generate_requests[-1].model, engine.generate_requests[-1].adapter) == (FAKE_GEN, "ad-a")
        # the prompt went through the base model's chat template
        assert engine.generate_requests[-1].prompt_ids == engine.tokenizer(FAKE_GEN).apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True)
        r = client.post("/v1/responses", json={"model": "ad-a", "input": "hi", "max_output_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "ad-a"
        assert (engine.generate_requests[-1].model, engine.generate_requests[-1].adapter) == (FAKE_GEN, "ad-a")
        r = client.post("/v1/completions", json={"model": FAKE_GEN, "prompt": PROMPT, "max_tokens": 1})
        assert r.status_code == 200 and engine.generate_requests[-1].adapter is None
        for route, body in (("/v1/completions", {"prompt": "x"}), ("/v1/responses", {"input": "x"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            r = client.post(route, json={**body, "model": "no-such-adapter"})
            assert r.status_code == 404 and r.json()["error"]["param"] == "model", route


def test_tokenize_with_an_adapter_name_uses_its_base_tokenizer(engine):
    with http_client(engine) as client:
        via_adapter = client.post("/tokenize", json={"model": "ad-a", "prompt": "hello there"})
        via_base = client.post("/tokenize", json={"model": FAKE_GEN, "prompt": "hello there"})
        assert via_adapter.status_code == 200, via_adapter.text
        assert via_adapter.json()["tokens"] == via_base.json()["tokens"] and via_adapter.json()["count"] > 0
        r = client.post("/detokenize", json={"model": "ad-a", "tokens": via_base.json()["tokens"]})
        assert r.status_code == 200 and r.json()["prompt"] == client.post(
            "/detokenize", json={"model": FAKE_GEN, "tokens": via_base.json()["tokens"]}).json()["prompt"]
        assert client.post("/tokenize", json={"model": "no-such-adapter", "prompt": "x"}).status_code == 404


def test_openai_models_lists_adapters_with_parent(engine):
    with http_client(engine) as client:
        cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
        assert list(cards) == [FAKE_GEN, FAKE_EMBED, "ad-a"]
        assert cards["ad-a"]["parent"] == FAKE_GEN and cards["ad-a"]["root"] == engine.adapters()[0].path
        assert cards["ad-a"]["object"] == "model" and cards["ad-a"]["task"] == "generate"
        assert cards[FAKE_GEN]["parent"] is None and cards[FAKE_GEN]["root"] == f"/fake/{FAKE_GEN}"
        one = client.get("/v1/models/ad-a")
        assert one.status_code == 200 and one.json() == cards["ad-a"]


def test_lora_admin_routes_absent_without_enable_admin(engine, root):
    with http_client(engine) as client:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            r = client.post(path, json={"lora_name": "ad-b", "lora_path": os.path.join(root, "ad-b")})
            assert r.status_code == 404, path
            assert path not in client.get("/openapi.json").json()["paths"]
    assert not engine.adapter_calls


def test_lora_admin_load_use_unload(engine, root):
    with http_client(engine, enable_admin=True) as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "ad-b", "lora_path": os.path.join(root, "ad-b")})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'ad-b' added successfully."
        assert r.headers["content-type"].startswith("text/plain")
        assert engine.adapter_calls[-1] == ("load_adapter", "ad-b", os.path.join(root, "ad-b"), None)
        assert "ad-b" in [c["id"] for c in client.get("/v1/models").json()["data"]]
        r = client.post("/v1/completions", json={"model": "ad-b", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200 and engine.generate_requests[-1].adapter == "ad-b"
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "ad-b", "lora_path": os.path.join(root, "ad-b")})
        assert r.status_code == 409 and r.json()["error"]["param"] == "lora_name"
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "ad-b", "lora_int_id": 2})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'ad-b' removed successfully."
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "ad-b"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = client.post("/v1/completions", json={"model": "ad-b", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 404
        assert "ad-b" not in [c["id"] for c in client.get("/v1/models").json()["data"]]
        assert "/v1/load_lora_adapter" in client.get("/openapi.json").json()["paths"]


@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/load_lora_adapter", {"lora_path": "x"}, 400, "lora_name is required"),
    ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path is required"),
    ("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "ROOT/ad-b"}, 400, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "ROOT/ad-b", "bogus": 1}, 400, "bogus"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "ROOT/ad-b", "load_inplace": True}, 400,
     "load_inplace"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}, 403, "outside --model-root"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "ROOT/not-peft"}, 400, "adapter_config.json"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "ROOT/ad-big"}, 400, "--max-lora-rank"),
    ("/v1/unload_lora_adapter", {}, 400, "lora_name is required"),
    ("/v1/unload_lora_adapter", {"lora_name": "never"}, 404, "never"),
], ids=["no-name", "no-path", "empty-name", "unknown-field", "inplace", "outside-root", "not-peft", "rank",
        "unload-no-name", "unload-unknown"])
def test_lora_admin_errors(engine, root, path, body, status, needle):
    body = {k: v.replace("ROOT", root) if isinstance(v, str) else v for k, v in body.items()}
    with http_client(engine, enable_admin=True) as client:
        r = client.post(path, json=body)
        assert r.status_code == status, r.text
        assert needle in r.json()["error"]["message"], r.json()


def test_lora_admin_slots_and_disabled_lora(engine, root):
    with http_client(engine, enable_admin=True) as client:
        for name in ("ad-b", "ad-c"):
            r = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": os.path.join(root, name)})
            assert r.status_code == 200, r.text
        peft_folder(root, "ad-d")
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "ad-d", "lora_path": os.path.join(root, "ad-d")})
        assert r.status_code == 429 and "Retry-After" in r.headers          # all 3 slots used
    with http_client(FakeEngine(model_root=root), enable_admin=True) as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": os.path.join(root, "ad-b")})
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]


@pytest.mark.parametrize("keys,token,status", [
    (dict(api_key="user", admin_api_key="admin"), None, 401),
    (dict(api_key="user", admin_api_key="admin"), "user", 403),
    (dict(api_key="user", admin_api_key="admin"), "wrong", 401),
    (dict(api_key="user", admin_api_key="admin"), "admin", 200),
    (dict(admin_api_key="admin"), None, 401),
    (dict(admin_api_key="admin"), "admin", 200),
    (dict(api_key="user"), None, 401),
    (dict(api_key="user"), "user", 200),
], ids=["both-none", "both-user", "both-wrong", "both-admin", "admin-none", "admin-admin", "user-none", "user-user"])
def test_lora_admin_keys_as_other_admin_operations(engine, root, keys, token, status):
    headers = {"authorization": f"Bearer {token}"} if token else {}
    with http_client(engine, enable_admin=True, **keys) as client:
        r = client.post("/v1/load_lora_adapter", headers=headers,
                        json={"lora_name": "ad-b", "lora_path": os.path.join(root, "ad-b")})
        assert r.status_code == status, r.text
        # the AllSpark admin RPCs on the mirror answer the same for the same key
        m = client.post(f"/{ALLSPARK}/StopModel", headers=headers, json={"modelName": "none"})
        assert m.status_code == status, m.text
        if status != 200:
            assert not engine.adapter_calls
            r = client.post("/v1/unload_lora_adapter", headers=headers, json={"lora_name": "ad-a"})
            assert r.status_code == status and [a.name for a in engine.adapters()] == ["ad-a"]


# ============================================================================================
# /metrics
# ============================================================================================
def test_metrics_lora_slots(engine):
    with http_client(engine) as client:
        text = client.get("/metrics").text
    assert f'xlaserve_lora_slots_used{{model="{FAKE_GEN}"}} 1.0' in text
    assert f'xlaserve_lora_slots_total{{model="{FAKE_GEN}"}} 3.0' in text
    assert f'xlaserve_lora_slots_total{{model="{FAKE_EMBED}"}} 0.0' in text


# ============================================================================================
# the CLI
# ============================================================================================
@pytest.fixture()
def dirs(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    return str(model), peft_folder(str(tmp_path), "a"), peft_folder(str(tmp_path), "b")


def test_cli_lora_flags(dirs, monkeypatch):
    from frontends.cli import engine_args, parse_serve_args

    for var in ("XLASERVE_LORA", "XLASERVE_ENABLE_LORA", "XLASERVE_MAX_LORAS", "XLASERVE_MAX_LORA_RANK"):
        monkeypatch.delenv(var, raising=False)
    model, a, b = dirs
    args = engine_args(parse_serve_args(["--model", f"g={model}"]))
    assert (args.enable_lora, args.loras, args.max_loras, args.max_lora_rank) == (False, [], 8, 64)
    args = engine_args(parse_serve_args(["--model", f"g={model}", "--enable-lora"]))
    assert args.enable_lora and args.loras == []
    args = engine_args(parse_serve_args(["--model", f"g={model}", "--lora", f"a={a}", "--lora", f" b = {b} ",
                                         "--max-loras", "4", "--max-lora-rank", "16"]))
    assert args.enable_lora and args.loras == [("a", a), ("b", b)]        # --lora implies --enable-lora
    assert (args.max_loras, args.max_lora_rank) == (4, 16)
    monkeypatch.setenv("XLASERVE_LORA", f"a={a},b={b}")
    monkeypatch.setenv("XLASERVE_MAX_LORA_RANK", "32")
    args = engine_args(parse_serve_args(["--model", f"g={model}"]))
    assert args.loras == [("a", a), ("b", b)] and args.max_lora_rank == 32
    monkeypatch.delenv("XLASERVE_LORA")
    monkeypatch.setenv("XLASERVE_ENABLE_LORA", "1")
    assert engine_args(parse_serve_args(["--model", f"g={model}"])).enable_lora


@pytest.mark.parametrize("argv,needle", [
    (["--lora", "no-equals-sign"], "expected NAME=PATH"),
    (["--lora", "=PATH_A"], "expected NAME=PATH"),
    (["--lora", "a="], "expected NAME=PATH"),
    (["--lora", "a=/no/such/dir"], "is not a directory"),
    (["--lora", "a=MODEL"], "no adapter_config.json"),
    (["--lora", "a=PATH_A", "--lora", "a=PATH_B"], "used twice"),
    (["--lora", "g=PATH_A"], "already a model name"),
    (["--lora", "a=PATH_A", "--lora", "b=PATH_B", "--max-loras", "1"], "--max-loras 1"),
    (["--max-loras", "0"], "--max-loras"),
    (["--max-lora-rank", "x"], "--max-lora-rank"),
], ids=["syntax", "no-name", "no-path", "missing-dir", "not-peft", "twice", "model-name", "too-many", "zero-slots",
        "rank-not-int"])
def test_cli_lora_errors(dirs, capsys, argv, needle, monkeypatch):
    from frontends.cli import parse_serve_args

    monkeypatch.delenv("XLASERVE_LORA", raising=False)
    model, a, b = dirs
    argv = [x.replace("PATH_A", a).replace("PATH_B", b).replace("MODEL", model) for x in argv]
    with pytest.raises(SystemExit) as e:
        parse_serve_args(["--model", f"g={model}", *argv])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err
