"""Structured generation (issue 17) at the fronts, against a recording FakeEngine: no model, seconds.

For every front (SGLang and AllSpark over gRPC and over the JSON mirror, OpenAI chat and
completions over HTTP): each protocol field reaches the engine as the right `Constraint`, a
malformed one is refused naming the field, and the engine's refusal of a grammar it cannot
compile becomes INVALID_ARGUMENT / 400 / PARAM_ERROR naming the protocol's field. Also SGLang
GetLoads `queues.grammar` and the `xlaserve_grammar_queue` gauge.

The fake compiles "off the event loop" as the real engine does (the refusal comes loop turns
after `generate` starts), which is what AllSpark's StartRequest must wait for.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncGenerator, Optional

import grpc
import numpy as np
import pytest
from fastapi.testclient import TestClient

from frontends.grpc.allspark import ERROR_TRAILER
from frontends.grpc.gen.allspark import allspark_service_pb2 as apb
from frontends.grpc.gen.allspark import allspark_service_pb2_grpc as apb_grpc
from frontends.grpc.gen.sglang import sglang_scheduler_pb2 as spb
from frontends.grpc.gen.sglang import sglang_scheduler_pb2_grpc as spb_grpc
from frontends.grpc.server import make_servicers
from frontends.http.app import create_app
from jax_engine.errors import InvalidRequest
from jax_engine.types import Constraint, GenerateOutput, GenerateRequest, ModelStats
from tests.helpers.fake_engine import FAKE_GEN, FakeEngine
from tests.helpers.shared import start_grpc_server, stop_grpc_server

PROMPT = [1, 40, 41, 42]
BAD = "<<does-not-compile>>"   # a spec containing this is refused by the fake's "compiler"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SCHEMA_TEXT = json.dumps(SCHEMA)
SGL = "/sglang.grpc.scheduler.SglangScheduler"
ASP = "/allspark.allspark_service.AllSpark"


class ConstraintEngine(FakeEngine):
    """FakeEngine that records every GenerateRequest and, for a constrained one, "compiles" over
    a few loop turns first and refuses a spec containing BAD the way the engine does
    (InvalidRequest "constraint.<kind>: ..." before the first event)."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[GenerateRequest] = []
        self.grammar_queue = 0

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[GenerateOutput, None]:
        self.requests.append(req)
        c = req.params.constraint
        if c is not None:
            for _ in range(5):
                await asyncio.sleep(0.002)
            if BAD in c.spec or BAD in c.choices:
                raise InvalidRequest(f"constraint.{c.kind}: does not compile (fake compiler)")
        async for ev in super().generate(req):
            yield ev

    def stats(self, name: Optional[str] = None) -> ModelStats:
        st = super().stats(name)
        st.grammar_queue = self.grammar_queue
        return st

    def last(self) -> Optional[Constraint]:
        return self.requests[-1].params.constraint


@pytest.fixture(scope="module")
def engine() -> ConstraintEngine:
    return ConstraintEngine()


@pytest.fixture(scope="module")
def channel(server_loop, engine):
    srv = start_grpc_server(server_loop, engine)
    ch = grpc.insecure_channel(srv.target)
    yield ch
    ch.close()
    stop_grpc_server(server_loop, srv)


@pytest.fixture(scope="module")
def http(engine):
    with TestClient(create_app(engine, servicers=make_servicers(engine))) as client:
        yield client


# ============================================================================================
# SGLang: the SamplingParams `constraint` oneof
# ============================================================================================
SGLANG_CASES = [  # (oneof member, its camelCase JSON name, spec, engine kind)
    ("regex", "regex", r"[a-z]+\d", "regex"),
    ("json_schema", "jsonSchema", SCHEMA_TEXT, "json_schema"),
    ("ebnf_grammar", "ebnfGrammar", 'root ::= "yes" | "no"', "ebnf"),
    ("structural_tag", "structuralTag",
     json.dumps({"structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f>"]}),
     "structural_tag"),
]


def _sglang_request(rid: str, **constraint: str) -> spb.GenerateRequest:
    return spb.GenerateRequest(request_id=rid, tokenized=spb.TokenizedInput(input_ids=PROMPT),
                               sampling_params=spb.SamplingParams(temperature=0.0, max_new_tokens=2, **constraint))


def _sglang_body(rid: str, **constraint: Any) -> dict[str, Any]:
    return {"requestId": rid, "tokenized": {"inputIds": PROMPT},
            "samplingParams": {"temperature": 0, "maxNewTokens": 2, **constraint}}


@pytest.mark.parametrize("member,json_name,spec,kind", SGLANG_CASES, ids=[c[0] for c in SGLANG_CASES])
def test_sglang_constraint_reaches_the_engine(engine, channel, http, member, json_name, spec, kind):
    stub = spb_grpc.SglangSchedulerStub(channel)
    msgs = list(stub.Generate(_sglang_request(f"sg-{member}", **{member: spec})))
    assert msgs[-1].complete.completion_tokens == 2
    assert engine.last() == Constraint(kind=kind, spec=spec)
    r = http.post(f"{SGL}/Generate", json=_sglang_body(f"sgm-{member}", **{json_name: spec}))
    assert r.status_code == 200, r.text
    assert engine.last() == Constraint(kind=kind, spec=spec)


def test_sglang_no_constraint_is_free_text(engine, channel):
    list(spb_grpc.SglangSchedulerStub(channel).Generate(_sglang_request("sg-free")))
    assert engine.last() is None


@pytest.mark.parametrize("member,json_name,spec,kind", SGLANG_CASES, ids=[c[0] for c in SGLANG_CASES])
def test_sglang_grammar_the_engine_refuses_is_invalid_argument(engine, channel, http, member, json_name, spec, kind):
    stub = spb_grpc.SglangSchedulerStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(_sglang_request(f"sg-bad-{member}", **{member: BAD})))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(f"sampling_params.{member}: does not compile"), e.value.details()
    assert engine.last() == Constraint(kind=kind, spec=BAD)
    for stream in (False, True):
        r = http.post(f"{SGL}/Generate", json={**_sglang_body(f"sgm-bad-{member}", **{json_name: BAD}),
                                               "stream": stream})
        assert r.status_code == 400, r.text
        assert r.json()["code"] == "invalid_argument"
        assert r.json()["message"].startswith(f"sampling_params.{member}:"), r.json()


@pytest.mark.parametrize("constraint,needle", [
    ({"regex": 5}, "regex"),
    ({"jsonSchema": {"type": "object"}}, "jsonSchema"),   # the proto field is the schema's text
    ({"regex": "a", "ebnfGrammar": "root ::= 'a'"}, "constraint"),
])
def test_sglang_mirror_malformed_constraint_is_400_naming_it(http, constraint, needle):
    r = http.post(f"{SGL}/Generate", json=_sglang_body("sgm-shape", **constraint))
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "invalid_argument" and needle in r.json()["message"], r.json()


def test_sglang_get_loads_reports_the_grammar_queue(engine, channel, http):
    stub = spb_grpc.SglangSchedulerStub(channel)
    engine.grammar_queue = 3
    try:
        for include in (["queues"], ["all"], []):
            load = stub.GetLoads(spb.GetLoadsRequest(include=include)).loads[0]
            assert load.HasField("queues") and load.queues.grammar == 3, include
        assert not stub.GetLoads(spb.GetLoadsRequest(include=["core"])).loads[0].HasField("queues")
        r = http.post(f"{SGL}/GetLoads", json={"include": ["queues"]})
        assert r.status_code == 200 and r.json()["loads"][0]["queues"]["grammar"] == 3
    finally:
        engine.grammar_queue = 0


def test_metrics_grammar_queue_gauge(engine, http):
    engine.grammar_queue = 2
    try:
        text = http.get("/metrics").text
    finally:
        engine.grammar_queue = 0
    assert "# TYPE xlaserve_grammar_queue gauge" in text
    assert f'xlaserve_grammar_queue{{model="{FAKE_GEN}"}} 2.0' in text


# ============================================================================================
# AllSpark: GenerateConfig.response_format
# ============================================================================================
def _inputs() -> apb.TensorMap:
    t = apb.Tensor(name="input_ids", shape=apb.Tensor.Shape(dims=[1, len(PROMPT)]),
                   device_type=apb.DeviceType(dev_type=apb.CPU), data_type=apb.INT64, data_mode=apb.DENSE,
                   data=np.asarray(PROMPT, "<i8").tobytes())
    return apb.TensorMap(tensor_map={"input_ids": t})


def _allspark_start(channel, uid: str, response_format: dict[str, str], **cfg: Any):
    """StartRequest over gRPC: (response, trailing metadata as a dict)."""
    stub = apb_grpc.AllSparkStub(channel)
    config = apb.GenerateConfig(do_sample=False, max_length=len(PROMPT) + 3, uuid=uid,
                                response_format=response_format, **cfg)
    resp, call = stub.StartRequest.with_call(apb.StartRequestRequest(model_name=FAKE_GEN, inputs=_inputs(),
                                                                     config=config))
    return resp, dict(call.trailing_metadata() or ())


def _allspark_drain(channel, uid: str) -> list[int]:
    stub = apb_grpc.AllSparkStub(channel)
    ids: list[int] = []
    deadline = time.monotonic() + 10
    while stub.GenerateStatus(apb.UUID(uuid=uid)).status != apb.GenerateFinished:
        assert time.monotonic() < deadline, "request did not finish"
        ids += list(stub.Get(apb.UUID(uuid=uid)).ids_from_generate)
    stub.ReleaseRequest(apb.StopRequestRequest(uuid=uid))
    return ids


def _allspark_mirror_start(http, uid: str, response_format: Any) -> Any:
    import base64

    inputs = {"tensorMap": {"input_ids": {"shape": {"dims": [1, len(PROMPT)]}, "dataType": "INT64",
                                          "data": base64.b64encode(np.asarray(PROMPT, "<i8").tobytes()).decode()}}}
    return http.post(f"{ASP}/StartRequest", json={"modelName": FAKE_GEN, "inputs": inputs, "config": {
        "uuid": uid, "maxLength": len(PROMPT) + 3, "responseFormat": response_format}})


ALLSPARK_CASES = [  # (response_format, the engine's constraint)
    ({"type": "json_object"}, Constraint(kind="json_object")),
    ({"type": "json_object", "json_schema": SCHEMA_TEXT}, Constraint(kind="json_schema", spec=SCHEMA_TEXT)),
    ({"type": "json_object", "json_schema": ""}, Constraint(kind="json_object")),   # empty = none, as upstream
    ({}, None),
    ({"type": "text"}, None),                                                         # OpenAI's free text
]


@pytest.mark.parametrize("rf,want", ALLSPARK_CASES, ids=["json_object", "json_schema", "empty-schema", "absent", "text"])
def test_allspark_response_format_reaches_the_engine(engine, channel, http, rf, want):
    uid = f"as-{len(engine.requests)}"
    resp, _ = _allspark_start(channel, uid, rf)
    assert resp.as_status == apb.ALLSPARK_SUCCESS and resp.uuid == uid
    assert engine.last() == want
    assert _allspark_drain(channel, uid) == [PROMPT[-1] + 1 + k for k in range(3)]
    r = _allspark_mirror_start(http, uid + "-m", rf)
    assert r.status_code == 200 and r.json() == {"uuid": uid + "-m"}, r.text
    assert engine.last() == want
    http.post(f"{ASP}/SyncRequest", json={"uuid": uid + "-m"})
    http.post(f"{ASP}/ReleaseRequest", json={"uuid": uid + "-m"})


def test_allspark_vocab_is_accepted_without_effect(engine, channel):
    resp, _ = _allspark_start(channel, "as-vocab", {"type": "json_object"}, vocab={"a": 3, "b": 4},
                              vocab_type=apb.VOCAB_TYPE_BPE)
    assert resp.as_status == apb.ALLSPARK_SUCCESS
    assert engine.last() == Constraint(kind="json_object")
    _allspark_drain(channel, "as-vocab")


@pytest.mark.parametrize("rf,needle", [
    ({"type": "xml"}, "config.response_format.type 'xml'"),
    ({"type": "json_schema", "json_schema": SCHEMA_TEXT}, "config.response_format.type 'json_schema'"),
    ({"json_schema": SCHEMA_TEXT}, "config.response_format.type is required"),
    ({"type": "json_object", "schema": SCHEMA_TEXT}, "config.response_format has unknown key 'schema'"),
    ({"type": "json_object", "json_schema": BAD}, "config.response_format.json_schema: does not compile"),
    ({"type": "json_object", "json_schema": f'{{"x": "{BAD}"}}'},
     "config.response_format.json_schema: does not compile"),
], ids=["type-text", "type-json_schema", "no-type", "unknown-key", "bad-schema", "bad-schema-json"])
def test_allspark_bad_response_format_is_param_error(engine, channel, http, rf, needle):
    """In-band PARAM_ERROR naming the key, the request not registered. A schema the engine cannot
    compile is refused the same way although the refusal comes loop turns after generation starts."""
    before = len(engine.requests)
    resp, trailers = _allspark_start(channel, "as-bad", rf)
    assert resp.as_status == apb.ALLSPARK_PARAM_ERROR and resp.uuid == "as-bad"
    assert needle in trailers[ERROR_TRAILER], trailers
    stub = apb_grpc.AllSparkStub(channel)
    assert stub.GenerateStatus(apb.UUID(uuid="as-bad")).status == apb.Init   # nothing was registered
    r = _allspark_mirror_start(http, "as-bad-m", rf)
    assert r.status_code == 200 and r.json()["asStatus"] == "ALLSPARK_PARAM_ERROR", r.text
    assert needle in r.headers[f"trailer-{ERROR_TRAILER}"]
    reached = len(engine.requests) - before
    assert reached == (2 if BAD in rf.get("json_schema", "") else 0)   # shape errors never reach the engine


def test_allspark_mirror_non_string_map_value_is_400(http):
    r = _allspark_mirror_start(http, "as-shape", {"type": 5})
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "invalid_argument" and "responseFormat" in r.json()["message"], r.json()


# ============================================================================================
# OpenAI: response_format and structured_outputs on chat and completions
# ============================================================================================
ROUTES = ["/v1/chat/completions", "/v1/completions"]


def _openai(http, route: str, **fields: Any):
    body: dict[str, Any] = {"model": FAKE_GEN, "max_tokens": 2, **fields}
    if "chat" in route:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    return http.post(route, json=body)


def _error(r, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    return err["message"]


OPENAI_CASES = [  # (request fields, the engine's constraint)
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, Constraint(kind="json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     Constraint(kind="json_schema", spec=json.dumps(SCHEMA))),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": False,
                                                                 "description": "d"}}},
     Constraint(kind="json_schema", spec=json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": SCHEMA}}, Constraint(kind="json_schema", spec=json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": SCHEMA_TEXT}}, Constraint(kind="json_schema", spec=SCHEMA_TEXT)),
    ({"structured_outputs": {"regex": r"\d+"}}, Constraint(kind="regex", spec=r"\d+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, Constraint(kind="choice", choices=["yes", "no"])),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, Constraint(kind="ebnf", spec='root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, Constraint(kind="json_object")),
    ({"structured_outputs": {"structural_tag": '{"structures": [], "triggers": []}'}},
     Constraint(kind="structural_tag", spec='{"structures": [], "triggers": []}')),
    ({"structured_outputs": {"regex": "a", "disable_fallback": True, "disable_any_whitespace": False,
                             "disable_additional_properties": False}}, Constraint(kind="regex", spec="a", any_whitespace=True)),
    ({"response_format": {"type": "text"}, "structured_outputs": {"regex": "a"}}, Constraint(kind="regex", spec="a")),
    ({}, None),
]
OPENAI_IDS = ["rf-text", "rf-json_object", "rf-json_schema-strict", "rf-json_schema-not-strict", "so-json-object",
              "so-json-text", "so-regex", "so-choice", "so-grammar", "so-json_object", "so-structural_tag",
              "so-neutral-options", "rf-text-and-so", "none"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("fields,want", OPENAI_CASES, ids=OPENAI_IDS)
def test_openai_constraint_reaches_the_engine(engine, http, route, fields, want):
    r = _openai(http, route, **fields)
    assert r.status_code == 200, r.text
    got = engine.last()
    if want is not None and want.kind == "json_schema":   # same schema, whatever the JSON spacing
        assert got is not None and got.kind == "json_schema" and json.loads(got.spec) == json.loads(want.spec)
    else:
        assert got == want


def test_openai_every_prompt_and_choice_gets_the_constraint(engine, http):
    before = len(engine.requests)
    r = http.post("/v1/completions", json={"model": FAKE_GEN, "prompt": ["a", "b"], "n": 2, "max_tokens": 2,
                                           "structured_outputs": {"regex": "x+"}})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    assert [q.params.constraint for q in engine.requests[before:]] == [Constraint(kind="regex", spec="x+")] * 2


MALFORMED = [  # (request fields, the param the 400 names, a piece of its message)
    ({"response_format": "json_object"}, "response_format", "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"response_format": {}}, "response_format.type", "required"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     "response_format.json_schema.schema", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA_TEXT}}},
     "response_format.json_schema.schema", "dictionary"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": "x"}}},
     "response_format.json_schema.strict", "bool"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "a", "schema": SCHEMA}}},
     "response_format.json_schema", "only allowed with type json_schema"),
    ({"response_format": {"type": "json_object", "extra": 1}}, "response_format.extra", "unsupported field"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "structured_outputs.regex and structured_outputs.choice"),
    ({"structured_outputs": {"json": 5}}, "structured_outputs.json", "JSON Schema object or its JSON text"),
    ({"structured_outputs": {"json": [1]}}, "structured_outputs.json", "JSON Schema object or its JSON text"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "string"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice", "list"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice[1]", "string"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object", "must be true"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "not supported"),
    ({"structured_outputs": {"regex": "a", "disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties", "not supported"),
    ({"structured_outputs": {"backend": "xgrammar"}}, "structured_outputs.backend", "unsupported field"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex",
     "response_format and structured_outputs.regex"),
    ({"guided_json": SCHEMA}, "guided_json", "unsupported field"),     # removed from vLLM; not an alias here
    ({"guided_regex": "a"}, "guided_regex", "unsupported field"),
]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("fields,param,needle", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_openai_malformed_constraint_is_400_naming_the_field(engine, http, route, fields, param, needle):
    before = len(engine.requests)
    message = _error(_openai(http, route, **fields), param)
    assert needle in message, message
    assert len(engine.requests) == before   # refused before the engine


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fields,param", [
    ({"structured_outputs": {"regex": BAD}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["ok", BAD]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": {"title": BAD}}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"title": BAD}}}},
     "response_format"),
], ids=["regex", "choice", "json", "response_format"])
def test_openai_grammar_the_engine_refuses_is_400_naming_the_field(engine, http, route, stream, fields, param):
    message = _error(_openai(http, route, stream=stream, **fields), param)
    assert message.startswith(f"{param}: does not compile"), message
    assert engine.last() is not None


def test_openai_schema_documents_the_fields(http):
    spec = http.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for model in ("ChatCompletionRequest", "CompletionRequest"):
        props = schemas[model]["properties"]
        assert "response_format" in props and "structured_outputs" in props, model
        assert not any(k.startswith("guided_") for k in props), model
    assert set(schemas["ResponseFormat"]["properties"]) == {"type", "json_schema"}
    assert {"name", "schema", "strict"} <= set(schemas["JsonSchemaSpec"]["properties"])
    assert {"json", "regex", "choice", "grammar", "json_object", "structural_tag"} <= \
        set(schemas["StructuredOutputs"]["properties"])


def test_openai_disable_any_whitespace_false_asks_for_free_whitespace(engine, http):
    """JSON is compact by default (and with disable_any_whitespace true); an explicit false, vLLM's
    default, is honoured as any whitespace between tokens."""
    want = {None: False, True: False, False: True}
    for flag, flexible in want.items():
        so = {"json": {"type": "object"}} | ({} if flag is None else {"disable_any_whitespace": flag})
        r = http.post("/v1/completions", json={"model": FAKE_GEN, "prompt": "x", "max_tokens": 2, "structured_outputs": so})
        assert r.status_code == 200, r.text
        assert engine.last() == Constraint(kind="json_schema", spec='{"type": "object"}', any_whitespace=flexible)
