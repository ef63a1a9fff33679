"""The HTTP JSON mirror (`POST /{package}.{Service}/{Method}`) over a real uvicorn socket."""
from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from frontends.grpc.gen.sglang import sglang_scheduler_pb2 as spb
from frontends.grpc.gen.sglang import sglang_scheduler_pb2_grpc as spb_grpc
from frontends.grpc.server import AccessPolicy, make_servicers
from frontends.http.mirror import add_mirror_routes
from tests.helpers.shared import EMBED, GEN, wait_for

SGL = "/sglang.grpc.scheduler.SglangScheduler"
ARC = "/arctic_inference.InferenceService"
ASP = "/allspark.allspark_service.AllSpark"
PROMPT = [1, 70, 71, 72, 73, 74, 75]


@pytest.fixture(scope="module")
def http(mirror_url):
    with httpx.Client(base_url=mirror_url, timeout=30) as client:
        yield client


def generate_body(rid: str, stream: bool, max_new: int = 6) -> dict:
    return {"requestId": rid, "tokenized": {"inputIds": PROMPT}, "stream": stream,
            "samplingParams": {"temperature": 0, "topP": 1, "topK": -1, "repetitionPenalty": 1, "n": 1,
                               "maxNewTokens": max_new, "ignoreEos": True}}


def test_every_rpc_has_a_route(serving_engine):
    app = FastAPI()
    paths = add_mirror_routes(app, make_servicers(serving_engine))
    assert len(paths) == 4 + 7 + 22
    assert f"{SGL}/Generate" in paths and f"{ASP}/GetNoWait" in paths and f"{ARC}/Encode" in paths


def test_unary_calls_lower_camel_case(http):
    r = http.post(f"{SGL}/GetModelInfo", json={})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    info = r.json()
    assert info["servedModelName"] == GEN and info["isGeneration"] is True and "maxContextLength" in info
    assert http.post(f"{ARC}/HealthCheck", content=b"").json() == {"healthy": True}
    v = http.post(f"{ASP}/GetVersionFull", json={}).json()["versionInfo"]
    assert "/(GitSha1:" in v
    loads = http.post(f"{SGL}/GetLoads", json={"include": ["core"]}).json()
    assert loads["dpRankCount"] == 1


def test_encode_bytes_in_base64(http):
    ids = np.array([101, 7592, 2088, 102], dtype="<i4").tobytes()
    r = http.post(f"{ARC}/Encode", json={"requestId": "m1", "nPrompts": 1, "modelName": EMBED,
                                          "tokenIdBytesI32": [base64.b64encode(ids).decode()]})
    body = r.json()
    assert r.status_code == 200 and body["embeddingDim"] == 384
    vec = np.frombuffer(base64.b64decode(body["embeddingBytesFp32"][0]), dtype="<f4")
    assert vec.shape == (384,)
    bad = http.post(f"{ARC}/Encode", json={"requestId": "m2", "nPrompts": 2, "prompts": ["x"]}).json()
    assert bad["error"] == "Expected 2 prompts, got 1"  # in-band, as on gRPC


def test_snake_case_input_and_allspark_flow(http):
    ids = np.array([1, 80, 81, 82], dtype="<i8").tobytes()
    start = {"model_name": GEN, "inputs": {"tensor_map": {"input_ids": {
        "shape": {"dims": [1, 4]}, "data_type": "INT64", "data": base64.b64encode(ids).decode()}}},
        "config": {"uuid": "mirror-1", "max_length": 9, "do_sample": False}}
    r = http.post(f"{ASP}/StartRequest", json=start).json()
    assert r == {"uuid": "mirror-1"}  # ALLSPARK_SUCCESS is the zero value, omitted
    assert http.post(f"{ASP}/SyncRequest", json={"uuid": "mirror-1"}).json()["uuid"] == "mirror-1"
    got = http.post(f"{ASP}/Get", json={"uuid": "mirror-1"}).json()
    assert len(got["idsFromGenerate"]) == 5 and all(isinstance(i, str) for i in got["idsFromGenerate"])  # int64
    assert http.post(f"{ASP}/GenerateStatus", json={"uuid": "mirror-1"}).json()["status"] == "GenerateFinished"
    http.post(f"{ASP}/ReleaseRequest", json={"uuid": "mirror-1"})


@pytest.mark.parametrize("body,needle", [
    (b"{not json", "JSON"), (b'{"bogusField": 1}', "bogusField"), (b'{"requestId": 5}', "requestId"),
    (b"[1, 2]", "JSON"),
    (b"\xff\xfe", "JSON"),
])
def test_malformed_json_is_400(http, body, needle):
    r = http.post(f"{SGL}/Generate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["code"] == "invalid_argument" and needle in r.json()["message"]


def test_servicer_errors_map_to_http(http):
    r = http.post(f"{SGL}/Generate", json={"requestId": "x", "customLogitProcessor": "a", "tokenized": {"inputIds": [1]}})
    assert r.status_code == 400 and r.json() == {"code": "invalid_argument",
                                                 "message": "custom_logit_processor is not supported by this server"}
    r = http.post(f"{SGL}/Generate", json={"requestId": "x", "loraId": "a", "tokenized": {"inputIds": [1]}})
    assert r.status_code == 404 and r.json()["code"] == "not_found" and "lora_id 'a'" in r.json()["message"]
    r = http.post(f"{SGL}/GetLoads", json={"include": ["nope"]})
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"


def test_ndjson_stream_matches_grpc_tokens(http, grpc_channel):
    r = http.post(f"{SGL}/Generate", json=generate_body("nd-1", stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(x) for x in r.text.splitlines() if x]
    assert "complete" in lines[-1] and all("chunk" in x for x in lines[:-1])
    mirror_tokens = [t for x in lines[:-1] for t in x["chunk"]["tokenIds"]]
    stub = spb_grpc.SglangSchedulerStub(grpc_channel)
    req = spb.GenerateRequest()
    from google.protobuf import json_format

    json_format.ParseDict(generate_body("nd-grpc", stream=False), req)
    grpc_tokens = list(list(stub.Generate(req))[-1].complete.output_ids)
    assert mirror_tokens == grpc_tokens and len(grpc_tokens) == 6
    non_stream = http.post(f"{SGL}/Generate", json=generate_body("nd-2", stream=False)).text.splitlines()
    assert len(non_stream) == 1 and json.loads(non_stream[0])["complete"]["outputIds"] == grpc_tokens


def test_sse_stream(http):
    r = http.post(f"{SGL}/Generate", json=generate_body("sse-1", stream=True),
                  headers={"accept": "text/event-stream"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events)
    last = json.loads(events[-1][len("data: "):])
    assert last["complete"]["finishReason"] == "length"
    assert len(events) == 7


def test_stream_error_before_first_message_is_http_error(http):
    body = generate_body("sse-bad", stream=True)
    body["tokenized"]["inputIds"] = []
    r = http.post(f"{SGL}/Generate", json=body, headers={"accept": "text/event-stream"})
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"


def test_client_disconnect_aborts_stream(mirror_url, serving_engine):
    baseline = serving_engine.stats(GEN).pages_used
    before = serving_engine.counters.snapshot()
    with httpx.Client(base_url=mirror_url, timeout=30) as client:
        with client.stream("POST", f"{SGL}/Generate", json=generate_body("gone-1", True, max_new=240)) as r:
            it = r.iter_lines()
            first = json.loads(next(it))
            assert "chunk" in first
            assert serving_engine.stats(GEN).pages_used > baseline
    # leaving the block closes the connection mid-stream
    assert wait_for(lambda: serving_engine.stats(GEN).pages_used == baseline, 15)
    assert wait_for(lambda: serving_engine.stats(GEN).running_requests == 0, 15)
    after = serving_engine.counters.snapshot()
    assert after["cancelled"] == before["cancelled"] + 1 and after["completed"] == before["completed"]


def test_admin_gating_and_keys_apply_to_the_mirror(serving_engine):
    app = FastAPI()
    add_mirror_routes(app, make_servicers(serving_engine), policy=AccessPolicy(api_key="k"))
    with TestClient(app) as client:
        r = client.post(f"{ASP}/GetRankId", json={})
        assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
        ok = client.post(f"{ASP}/GetRankId", json={}, headers={"authorization": "Bearer k"})
        assert ok.status_code == 200
        r = client.post(f"{ASP}/StopModel", json={"modelName": GEN}, headers={"authorization": "Bearer k"})
        assert r.status_code == 403 and r.json()["code"] == "permission_denied"
    assert serving_engine.model_info(GEN).state == "running"


def test_unimplemented_method_is_501(serving_engine):
    from frontends.grpc.gen.arctic_inference import inference_pb2_grpc

    servicers = make_servicers(serving_engine)
    servicers["arctic_inference.InferenceService"] = inference_pb2_grpc.InferenceServiceServicer()  # base class
    app = FastAPI()
    add_mirror_routes(app, servicers)
    with TestClient(app) as client:
        r = client.post(f"{ARC}/HealthCheck", json={})
        assert r.status_code == 501 and r.json()["code"] == "unimplemented"
