"""Hardening (issue #7): the bad-input checklist of reliability_security.md §6, limits, auth,
drain, fault containment and accounting, through the real servers on the shared engine.

Each row test checks the exact status (or the in-band error of Arctic `error` / AllSpark
`as_status`), that the message names the field (and the limit), and that a normal request
succeeds right after on the same server. Rows covered elsewhere say where, in their docstring.
Row 10 (structured output) is covered by tests/engine/test_constraints.py (compile limits) and
tests/frontends/test_constraints_fronts.py (every front's fields and refusals). Rows 11-12 (client
chat templates, media URLs) do not apply: those features are refused by name
(tests/frontends/test_http_openai.py, test_grpc_sglang.py, test_grpc_allspark.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from frontends.grpc.allspark import ADMIN_METHODS
from frontends.grpc.gen.allspark import allspark_service_pb2 as apb
from frontends.grpc.gen.allspark import allspark_service_pb2_grpc as apb_grpc
from frontends.grpc.gen.arctic_inference import inference_pb2 as ipb
from frontends.grpc.gen.arctic_inference import inference_pb2_grpc as ipb_grpc
from frontends.grpc.gen.sglang import sglang_scheduler_pb2 as spb
from frontends.grpc.gen.sglang import sglang_scheduler_pb2_grpc as spb_grpc
from frontends.grpc.server import make_servicers
from tests.helpers.shared import EMBED, GEN, start_grpc_server, stop_grpc_server, wait_for

PROMPT = [1, 40, 41, 42, 43, 44, 45, 46]
CHAT = [{"role": "user", "content": "hello there"}]
SGL = "/sglang.grpc.scheduler.SglangScheduler"
ASP = "/allspark.allspark_service.AllSpark"
ARC = "/arctic_inference.InferenceService"


# =============================================================================================
# helpers
# =============================================================================================
@pytest.fixture(scope="module")
def http(client):
    return client


@pytest.fixture(scope="module")
def sgl(grpc_channel):
    return spb_grpc.SglangSchedulerStub(grpc_channel)


@pytest.fixture(scope="module")
def arc(grpc_channel):
    return ipb_grpc.InferenceServiceStub(grpc_channel)


@pytest.fixture(scope="module")
def asp(grpc_channel):
    return apb_grpc.AllSparkStub(grpc_channel)


@contextlib.contextmanager
def limits(engine, **values):
    """Change engine limits for a moment (workers and fronts read them per request)."""
    saved = {k: getattr(engine.args, k) for k in values}
    for k, v in values.items():
        setattr(engine.args, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(engine.args, k, v)


def in_flight(engine) -> int:
    c = engine.counters.snapshot()
    return c["accepted"] - c["completed"] - c["errored"] - c["cancelled"]


def settled(engine, timeout: float = 30.0) -> bool:
    """Nothing in flight, running or holding KV pages."""
    return wait_for(lambda: in_flight(engine) == 0 and engine.stats(GEN).running_requests == 0
                    and engine.stats(GEN).waiting_requests == 0 and engine.stats(GEN).pages_used == 0, timeout)


def http_error(r: httpx.Response, status: int, *needles: str, param: str | None = None) -> dict:
    """The OpenAI envelope with `status`; the message contains every needle (field, numbers)."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert "Traceback" not in err["message"]
    for n in needles:
        assert n in err["message"], (n, err)
    if param is not None:
        assert err["param"] == param, err
    return err


def grpc_error(call, code: grpc.StatusCode, *needles: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        out = call()
        if hasattr(out, "__iter__") and not isinstance(out, (bytes, str)):
            list(out)
    assert e.value.code() == code, (e.value.code(), e.value.details())
    for n in needles:
        assert n in (e.value.details() or ""), (n, e.value.details())
    assert "Traceback" not in (e.value.details() or "")
    return e.value


def greedy(max_new: int = 4, **kw) -> spb.SamplingParams:
    base = dict(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, n=1, max_new_tokens=max_new,
                ignore_eos=True)
    base.update(kw)
    return spb.SamplingParams(**base)


def gen_req(rid: str = "", prompt=PROMPT, stream: bool = False, sp=None, **kw) -> spb.GenerateRequest:
    return spb.GenerateRequest(request_id=rid, tokenized=spb.TokenizedInput(input_ids=prompt),
                               sampling_params=sp if sp is not None else greedy(), stream=stream, **kw)


def ok_http(client: httpx.Client) -> None:
    # ignore_eos: the random demo model samples its EOS now and then (a CI run ended one after 1 token)
    r = client.post("/v1/completions", json={"prompt": "a normal request", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def ok_grpc(channel) -> None:
    replies = list(spb_grpc.SglangSchedulerStub(channel).Generate(gen_req("normal-after"), timeout=30))
    assert replies[-1].complete.completion_tokens == 4


def as_tensor(ids=PROMPT, dtype=apb.INT64, dims=None, data=None) -> apb.TensorMap:
    t = apb.Tensor(name="input_ids", shape=apb.Tensor.Shape(dims=dims if dims is not None else [1, len(ids)]),
                   device_type=apb.DeviceType(dev_type=apb.CPU), data_type=dtype, data_mode=apb.DENSE,
                   data=np.asarray(ids, "<i8").tobytes() if data is None else data)
    return apb.TensorMap(tensor_map={"input_ids": t})


def as_start(stub, uuid: str, inputs=None, prompt=PROMPT, new_tokens: int = 4, **cfg) -> apb.StartRequestResponse:
    base = dict(do_sample=False, num_beams=1, num_return_sequences=1, temperature=1.0, top_k=50, top_p=1.0,
                repetition_penalty=1.0, max_length=len(prompt) + new_tokens, seed=1, uuid=uuid)
    base.update(cfg)
    return stub.StartRequest(apb.StartRequestRequest(model_name=GEN, inputs=inputs or as_tensor(prompt),
                                                     config=apb.GenerateConfig(**base)))


def as_finish(stub, uuid: str, timeout: float = 60.0) -> int:
    """Poll like the C++ client until terminal; returns the final status. Releases the request."""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            status = stub.GenerateStatus(apb.UUID(uuid=uuid)).status
            if status in (apb.GenerateFinished, apb.GenerateInterrupted):
                return status
            stub.Get(apb.UUID(uuid=uuid), timeout=30)
        raise AssertionError(f"{uuid} did not finish")
    finally:
        stub.ReleaseRequest(apb.StopRequestRequest(uuid=uuid))


@contextlib.contextmanager
def fault(engine, program: str | None, times: int = 1, delay_s: float = 0.0):
    """Through the runner's fault_hook: the next `times` runs of `program` ("step", the ragged step;
    "draw...", its sampling; "set_slot", admission) raise, and every step first sleeps `delay_s`
    (keeps requests live long enough for a test to act on them, however fast the engine is)."""
    runner = engine.worker(GEN).replicas[0].runner
    left = {"n": times if program else 0}

    def hook(name: str) -> None:
        if program and name.startswith(program) and left["n"] > 0:
            left["n"] -= 1
            raise RuntimeError(f"injected {program} fault")
        if delay_s and name.startswith("step"):
            time.sleep(delay_s)

    previous = runner.fault_hook
    runner.fault_hook = hook
    try:
        yield left
    finally:
        runner.fault_hook = previous


def slow(engine, delay_s: float = 0.02):
    """Steps take at least `delay_s` (200 tokens >= 4 s at the default)."""
    return fault(engine, None, 0, delay_s)


def raw_http(url: str, data: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes, return everything the server answers until it closes."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not chunk:
                break
            out += chunk
    return out


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1 ") else -1


def first_string_field_bytes(message_cls, payload: bytes) -> bytes:
    """A wire-format message whose first string field holds `payload` (e.g. invalid UTF-8)."""
    field = next(f for f in message_cls.DESCRIPTOR.fields if f.type == f.TYPE_STRING)
    return bytes([(field.number << 3) | 2, len(payload)]) + payload


# =============================================================================================
# a hardened HTTP server: `xlaserve serve`'s uvicorn protocol and small limits
# =============================================================================================
SMALL_BODY = 4096
READ_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def hardened_url(server_loop, serving_engine):
    """The full app with a 4 KiB body limit and 1 s head/body read timeouts, served like the CLI
    serves it (frontends/http/transport.py protocol)."""
    import uvicorn

    from frontends.http.app import create_app
    from frontends.http.transport import hardened_h11_protocol

    app = create_app(serving_engine, servicers=make_servicers(serving_engine), max_body_bytes=SMALL_BODY,
                     body_timeout_s=READ_TIMEOUT_S)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                           http=hardened_h11_protocol(READ_TIMEOUT_S)))
    holder = {}

    async def start():
        holder["task"] = asyncio.ensure_future(server.serve(sockets=[sock]))

    server_loop.run(start())
    assert wait_for(lambda: server.started, 20)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    wait_for(lambda: holder["task"].done(), 10)
    sock.close()


# =============================================================================================
# §6 row 1: malformed JSON / protobuf, wrong content type, invalid UTF-8, NUL, unknown enum
# =============================================================================================
def test_row01_malformed_http_bodies_are_400(http):
    cases = [
        ("/v1/completions", b'{"prompt": ', "application/json", "not valid JSON"),
        ("/v1/completions", b'{"prompt": "\xff\xfe"}', "application/json", "pars"),          # invalid UTF-8
        ("/v1/completions", b'{"prompt": "a\x00b"}', "application/json", "JSON"),            # raw NUL
        ("/v1/completions", b'{"prompt": "x", "max_tokens": "many"}', "application/json", "max_tokens"),
        ("/v1/completions", b'prompt=x', "application/x-www-form-urlencoded", ""),          # wrong content type
        ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', "application/json",
         "messages[0].role"),                                                                # unknown enum
        ("/v1/embeddings", b'{"input": "x", "encoding_format": "int4"}', "application/json", "encoding_format"),
    ]
    for route, body, ctype, needle in cases:
        http_error(http.post(route, content=body, headers={"content-type": ctype}), 400, needle)
    # an escaped NUL is just text
    assert http.post("/v1/completions", json={"prompt": "a\u0000b", "max_tokens": 1}).status_code == 200
    # the JSON mirror: bad JSON, an unknown enum name, invalid UTF-8 -> 400 {"code", "message"}
    for body, needle in ((b'{"inferType": "Telepathy"}', "inferType"), (b"{\xff}", "JSON"),
                         (b'{"modelName": 7}', "modelName")):
        r = http.post(f"{ASP}/StartRequest", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["code"] == "invalid_argument" and needle in r.json()["message"], r.text
    ok_http(http)


def test_row01_malformed_protobuf_is_invalid_argument(grpc_channel, asp):
    targets = [(f"{SGL}/Generate", spb.GenerateRequest, True), (f"{SGL}/Embed", spb.EmbedRequest, False),
               (f"{ARC}/Encode", ipb.EncodeRequest, False), (f"{ASP}/StartRequest", apb.StartRequestRequest, False),
               (f"{ASP}/GetModelInformation", apb.ModelName, False)]
    for path, cls, streaming in targets:
        full = cls.DESCRIPTOR.full_name
        for payload in (b"\xff\xff\xff\xff", b"\x0a\x10abc",                     # corrupt / truncated
                        first_string_field_bytes(cls, b"\xff\xfe\xfd")):         # a string that is not UTF-8
            call = grpc_channel.unary_stream(path) if streaming else grpc_channel.unary_unary(path)
            grpc_error(lambda: call(payload, timeout=10), grpc.StatusCode.INVALID_ARGUMENT,
                       "malformed request message", full)
    # an unknown enum number parses (proto3 enums are open) and is refused in-band by name
    resp = asp.StartRequest(apb.StartRequestRequest(model_name=GEN, infer_type=77, inputs=as_tensor(),
                                                    config=apb.GenerateConfig(uuid="enum-77", max_length=12)))
    assert resp.as_status == apb.ALLSPARK_PARAM_ERROR
    ok_grpc(grpc_channel)


# =============================================================================================
# row 2: body over the limit (declared and chunked), oversized head, message over the gRPC limit
# =============================================================================================
def test_row02_http_body_and_head_limits(hardened_url):
    big = b'{"prompt": "' + b"a" * (SMALL_BODY + 1) + b'"}'
    with httpx.Client(base_url=hardened_url, timeout=30) as c:
        http_error(c.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413,
                   f"limit of {SMALL_BODY} bytes")
        chunked = c.post("/v1/completions", content=iter([b"a" * 1024] * 6), headers={"content-type": "application/json"})
        assert chunked.request.headers["transfer-encoding"] == "chunked"
        http_error(chunked, 413, str(SMALL_BODY))
        r = c.post(f"{SGL}/GetModelInfo", content=big)
        assert r.status_code == 413 and r.json()["code"] == "resource_exhausted"
        # a head over h11's 16 KiB bound: one huge header, or very many small ones -> 431
        assert c.get("/health", headers={"x-big": "b" * 20000}).status_code == 431
        many = {f"x-h{i}": "v" * 60 for i in range(400)}
        assert c.get("/health", headers=many).status_code == 431
        ok_http(c)


def test_row02_grpc_message_and_metadata_limits(server_loop, serving_engine):
    """Messages over max_receive_message_length and metadata over gRPC's bound: RESOURCE_EXHAUSTED."""
    srv = start_grpc_server(server_loop, serving_engine, max_message_bytes=2048)
    try:
        with grpc.insecure_channel(srv.target) as ch:
            stub = ipb_grpc.InferenceServiceStub(ch)
            e = grpc_error(lambda: stub.Encode(ipb.EncodeRequest(n_prompts=1, prompts=["x" * 4096]), timeout=10),
                           grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert "4" in e.details() and "2048" in e.details()  # received size vs. the limit
            grpc_error(lambda: stub.HealthCheck(ipb.HealthCheckRequest(), metadata=(("x-big", "m" * 20000),),
                                                timeout=10), grpc.StatusCode.RESOURCE_EXHAUSTED, "metadata")
            ok_grpc(ch)
    finally:
        stop_grpc_server(server_loop, srv)


# =============================================================================================
# row 3: empty prompt, zero token ids, n_prompts=0, empty batch
# =============================================================================================
def test_row03_empty_inputs(http, sgl, arc, asp, grpc_channel):
    http_error(http.post("/v1/completions", json={"prompt": ""}), 400, "prompt", param="prompt")
    http_error(http.post("/v1/completions", json={"prompt": []}), 400, "prompt", param="prompt")
    http_error(http.post("/v1/completions", json={"prompt": ["ok", ""]}), 400, "prompt[1]", param="prompt")
    http_error(http.post("/v1/chat/completions", json={"messages": []}), 400, "messages", param="messages")
    http_error(http.post("/v1/embeddings", json={"input": []}), 400, "input", param="input")
    grpc_error(lambda: sgl.Generate(gen_req(prompt=[])), grpc.StatusCode.INVALID_ARGUMENT, "tokenized.input_ids")
    grpc_error(lambda: sgl.Generate(spb.GenerateRequest(request_id="no-tok")), grpc.StatusCode.INVALID_ARGUMENT,
               "tokenized")
    grpc_error(lambda: sgl.Embed(spb.EmbedRequest(tokenized=spb.TokenizedInput())), grpc.StatusCode.INVALID_ARGUMENT,
               "tokenized.input_ids")
    # Arctic: n_prompts=0 is an empty success (service_semantics.md §1), an empty prompt an in-band error
    assert arc.Encode(ipb.EncodeRequest(request_id="z", n_prompts=0, model_name=EMBED)).error == ""
    assert "empty" in arc.Encode(ipb.EncodeRequest(request_id="e", n_prompts=1, prompts=[""], model_name=EMBED)).error
    assert "empty" in arc.Encode(ipb.EncodeRequest(request_id="e2", n_prompts=1, token_id_bytes_i32=[b""],
                                                   model_name=EMBED)).error
    # AllSpark: seq_len 0 is EXCEED_LIMIT (as upstream: seq_len <= 0)
    assert as_start(asp, "empty-0", inputs=as_tensor([])).as_status == apb.ALLSPARK_EXCEED_LIMIT_ERROR
    r = http.post(f"{SGL}/Generate", json={"tokenized": {"inputIds": []}})
    assert r.status_code == 400 and "tokenized.input_ids" in r.json()["message"]
    ok_http(http)
    ok_grpc(grpc_channel)


# =============================================================================================
# row 4: prompt over the input limit, prompt + max_new over the context
# =============================================================================================
def test_row04_prompt_and_context_limits(http, sgl, arc, asp, grpc_channel, serving_engine):
    ctx = serving_engine.model_info(GEN).max_model_len          # 256 in the shared engine
    http_error(http.post("/v1/completions", json={"prompt": [5] * 300, "max_tokens": 1}), 400,
               "300", str(ctx - 1), param="prompt")
    err = http_error(http.post("/v1/completions", json={"prompt": [5] * 200, "max_tokens": 100}), 400,
                     "200", "100", str(ctx), param="max_tokens")
    assert "max_tokens" in err["message"] and "max_new_tokens" not in err["message"]
    http_error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 400}]}),
               400, str(ctx - 1), param="messages")
    with limits(serving_engine, max_prompt_tokens=10):              # --max-prompt-tokens
        http_error(http.post("/v1/completions", json={"prompt": [5] * 20, "max_tokens": 1}), 400,
                   "20", "limit of 10", param="prompt")
        grpc_error(lambda: sgl.Generate(gen_req(prompt=[5] * 20)), grpc.StatusCode.INVALID_ARGUMENT,
                   "prompt", "20", "limit of 10")
    grpc_error(lambda: sgl.Generate(gen_req(prompt=[5] * 300)), grpc.StatusCode.INVALID_ARGUMENT,
               "tokenized.input_ids", "300", str(ctx - 1))
    assert as_start(asp, "long-1", prompt=[5] * 300).as_status == apb.ALLSPARK_EXCEED_LIMIT_ERROR
    assert as_start(asp, "long-2", max_length=10_000).as_status == apb.ALLSPARK_EXCEED_LIMIT_ERROR
    too_long = np.full(600, 1000, "<i4").tobytes()
    resp = arc.Encode(ipb.EncodeRequest(request_id="a", n_prompts=1, token_id_bytes_i32=[too_long], model_name=EMBED))
    assert "600" in resp.error and "maximum" in resp.error
    ok_http(http)
    ok_grpc(grpc_channel)


# =============================================================================================
# row 5: max_tokens <= 0 / 2^31 / 2^63, n 0 / 10^6, logprobs over the cap
# =============================================================================================
def test_row05_numeric_limits(http, sgl, asp, grpc_channel, serving_engine):
    a = serving_engine.args
    for value in (0, -1):
        http_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": value}), 400, "max_tokens",
                   param="max_tokens")
    for value in (2**31, 2**63):
        http_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": value}), 400, "max_tokens",
                   str(a.max_new_tokens_limit), param="max_tokens")
    http_error(http.post("/v1/completions", json={"prompt": "x", "n": 0}), 400, "n", param="n")
    # n = 10^6 on 256 prompts (vLLM GHSA-3mwp-wvh9-7528): refused before anything is allocated per choice
    t0 = time.monotonic()
    http_error(http.post("/v1/completions", json={"prompt": ["p"] * 256, "n": 10**6}), 400,
               "n must be at most", str(a.max_n), param="n")
    assert time.monotonic() - t0 < 2.0
    http_error(http.post("/v1/completions", json={"prompt": "x", "logprobs": 50}), 400,
               str(a.max_top_logprobs), param="logprobs")
    http_error(http.post("/v1/chat/completions", json={"messages": CHAT, "logprobs": True, "top_logprobs": 50}),
               400, str(a.max_top_logprobs), param="top_logprobs")
    grpc_error(lambda: sgl.Generate(gen_req(sp=greedy(0))), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens")
    grpc_error(lambda: sgl.Generate(gen_req(sp=greedy(-5))), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens")
    grpc_error(lambda: sgl.Generate(gen_req(sp=greedy(n=10**6))), grpc.StatusCode.INVALID_ARGUMENT,
               "n", str(a.max_n))
    grpc_error(lambda: sgl.Generate(gen_req(return_logprob=True, top_logprobs_num=10**6)),
               grpc.StatusCode.INVALID_ARGUMENT, "top_logprobs", str(a.max_top_logprobs))
    grpc_error(lambda: sgl.Generate(gen_req(return_logprob=True, top_logprobs_num=-1)),
               grpc.StatusCode.INVALID_ARGUMENT, "top_logprobs_num")
    assert as_start(asp, "n-huge", num_return_sequences=10**6).as_status == apb.ALLSPARK_PARAM_ERROR
    assert as_start(asp, "len-huge", max_length=2**31 - 1).as_status == apb.ALLSPARK_EXCEED_LIMIT_ERROR
    ok_http(http)
    ok_grpc(grpc_channel)


# =============================================================================================
# row 6: token ids < 0 or >= vocab
# =============================================================================================
def test_row06_token_ids_out_of_vocabulary(http, sgl, arc, asp, grpc_channel, serving_engine):
    vocab = serving_engine.model_info(GEN).vocab_size
    for bad in (-1, vocab, 2**31 - 1):
        http_error(http.post("/v1/completions", json={"prompt": [1, bad]}), 400, str(bad), param="prompt")
    grpc_error(lambda: sgl.Generate(gen_req(prompt=[1, vocab])), grpc.StatusCode.INVALID_ARGUMENT,
               "prompt_ids", str(vocab), "out of range")
    grpc_error(lambda: sgl.Generate(gen_req(sp=greedy(stop_token_ids=[vocab + 5]))), grpc.StatusCode.INVALID_ARGUMENT,
               "stop_token_ids", str(vocab + 5))
    grpc_error(lambda: sgl.Embed(spb.EmbedRequest(tokenized=spb.TokenizedInput(input_ids=[101, 10**6]))),
               grpc.StatusCode.INVALID_ARGUMENT, "1000000", "vocabulary")
    resp = arc.Encode(ipb.EncodeRequest(request_id="v", n_prompts=1, model_name=EMBED,
                                        token_id_bytes_i32=[np.array([101, -7], "<i4").tobytes()]))
    assert "-7" in resp.error and "vocabulary" in resp.error
    assert as_start(asp, "oov", prompt=[1, vocab + 1]).as_status == apb.ALLSPARK_PARAM_ERROR
    ok_http(http)
    ok_grpc(grpc_channel)


# =============================================================================================
# row 7: Arctic Encode shapes and batch bounds
# =============================================================================================
def test_row07_arctic_encode_shapes_and_bounds(arc, serving_engine):
    def enc(**kw):
        return arc.Encode(ipb.EncodeRequest(request_id="r7", model_name=EMBED, **kw), timeout=60)

    assert "multiple of 4" in enc(n_prompts=1, token_id_bytes_i32=[b"\x01\x00\x00\x00\x02"]).error
    assert "Expected 3 prompts, got 2" in enc(n_prompts=3, prompts=["a", "b"]).error
    both = enc(n_prompts=1, prompts=["ignored"], token_id_bytes_i32=[np.array([101, 102], "<i4").tobytes()])
    assert both.error == "" and both.n_prompts == 1              # token ids win (service_semantics §1)
    limit = serving_engine.args.max_embed_inputs
    over = enc(n_prompts=limit + 1, prompts=["x"] * (limit + 1))
    assert str(limit + 1) in over.error and str(limit) in over.error and "max_embed_inputs" in over.error
    # many long inputs: several times the encoder's token budget per batch, still answered in full
    budget = serving_engine.args.embed_max_batch_tokens
    texts = [" ".join(["token"] * 120) + f" {i}" for i in range(40)]
    assert 40 * 120 > 3 * budget
    t0 = time.monotonic()
    resp = enc(n_prompts=len(texts), prompts=texts)
    assert resp.error == "" and len(resp.embedding_bytes_fp32) == len(texts), resp.error
    assert time.monotonic() - t0 < 30
    assert enc(n_prompts=1, prompts=["a normal request"]).error == ""


# =============================================================================================
# row 8: AllSpark tensors
# =============================================================================================
@pytest.mark.parametrize("inputs,needle", [
    (as_tensor(data=b"\x00" * 13), "bytes"),                                      # len(data) != prod(dims) * 8
    (as_tensor(dims=[1, -8]), "shape"),                                           # negative dim
    (as_tensor(dims=[1, 2**31 - 1]), "bytes"),                                    # int32 max: x8 overflows int32
    (as_tensor(dims=[2**31 - 1, 2**31 - 1]), "shape"),                            # product overflows int32
    (as_tensor(dims=[]), "shape"),
    (as_tensor(dtype=99), "data_type"),                                           # unknown dtype
    (as_tensor(dtype=apb.FLOAT32), "data_type"),
], ids=["bytes", "negative", "int32-overflow", "int64-overflow", "no-dims", "bad-dtype", "float"])
def test_row08_allspark_tensor_validation(asp, inputs, needle, serving_engine):
    from frontends.grpc import allspark

    resp = as_start(asp, "t8", inputs=inputs)
    assert resp.as_status == apb.ALLSPARK_PARAM_ERROR and resp.uuid == "t8"
    assert asp.GenerateStatus(apb.UUID(uuid="t8")).status == apb.Init    # nothing was registered
    # AS_STATUS is the only error channel on the wire; the refusal's text names the field
    with pytest.raises(allspark._Refused) as e:
        allspark.input_ids_from_proto(inputs, serving_engine.model_info(GEN))
    assert "input_ids" in str(e.value) and needle in str(e.value)
    assert as_start(asp, "t8-ok").as_status == apb.ALLSPARK_SUCCESS
    assert as_finish(asp, "t8-ok") == apb.GenerateFinished


# =============================================================================================
# row 9: NaN / inf / out-of-range sampling values, top_k < -1, stop strings
# =============================================================================================
def test_row09_sampling_values_and_stop_strings(http, sgl, asp, grpc_channel, serving_engine):
    a = serving_engine.args
    for raw, field in ((b'{"prompt": "x", "temperature": NaN}', "temperature"),
                       (b'{"prompt": "x", "top_p": Infinity}', "top_p"),
                       (b'{"prompt": "x", "presence_penalty": -Infinity}', "presence_penalty")):
        http_error(http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), 400, field)
    for body, field in (({"temperature": 3}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"),
                        ({"frequency_penalty": 9}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
                        ({"min_p": 2}, "min_p")):
        http_error(http.post("/v1/completions", json={"prompt": "x", **body}), 400, field, param=field)
    http_error(http.post("/v1/completions", json={"prompt": "x", "stop": ["s"] * (a.max_stop_strings + 1)}), 400,
               "stop", str(a.max_stop_strings))
    for stop in ("", "z" * (a.max_stop_string_len + 1)):
        http_error(http.post("/v1/completions", json={"prompt": "x", "stop": [stop]}), 400,
                   "stop", str(a.max_stop_string_len))
    nan, inf = float("nan"), float("inf")
    for sp, field in ((greedy(temperature=nan), "temperature"), (greedy(temperature=inf), "temperature"),
                      (greedy(top_p=inf), "top_p"), (greedy(top_p=nan), "top_p"), (greedy(min_p=nan), "min_p"),
                      (greedy(repetition_penalty=nan), "repetition_penalty"),
                      (greedy(repetition_penalty=inf), "repetition_penalty"),
                      (greedy(frequency_penalty=nan), "frequency_penalty"),
                      (greedy(presence_penalty=-inf), "presence_penalty"), (greedy(top_k=-2), "top_k"),
                      (greedy(stop=["s"] * (a.max_stop_strings + 1)), "stop"), (greedy(stop=[""]), "stop"),
                      (greedy(stop=["z" * (a.max_stop_string_len + 1)]), "stop")):
        grpc_error(lambda: sgl.Generate(gen_req(sp=sp)), grpc.StatusCode.INVALID_ARGUMENT, field)
    assert as_start(asp, "nan-t", do_sample=True, temperature=nan).as_status == apb.ALLSPARK_PARAM_ERROR
    assert as_start(asp, "nan-p", top_p=nan).as_status == apb.ALLSPARK_PARAM_ERROR
    assert as_start(asp, "inf-rp", repetition_penalty=inf).as_status == apb.ALLSPARK_PARAM_ERROR
    assert as_start(asp, "top-p", top_p=1.5).as_status == apb.ALLSPARK_PARAM_ERROR
    ok_http(http)
    ok_grpc(grpc_channel)


# =============================================================================================
# row 13: duplicate active ids, unknown ids, double abort
# =============================================================================================
def test_row13_duplicate_unknown_and_repeated_ids(sgl, arc, asp, grpc_channel, serving_engine):
    with slow(serving_engine):
        first = sgl.Generate(gen_req("dup-1", stream=True, sp=greedy(200)))
        assert next(first).WhichOneof("response") == "chunk"
        grpc_error(lambda: sgl.Generate(gen_req("dup-1")), grpc.StatusCode.ALREADY_EXISTS, "request_id", "dup-1")
        assert sgl.Abort(spb.AbortRequest(request_id="dup-1")).success
        assert sgl.Abort(spb.AbortRequest(request_id="dup-1")).success        # idempotent
        assert list(first)[-1].complete.finish_reason == "abort"
    assert sgl.Abort(spb.AbortRequest(request_id="never-was")).success
    assert arc.Abort(ipb.AbortRequest(request_id="never-was")).success
    assert as_start(asp, "dup-as", new_tokens=40).as_status == apb.ALLSPARK_SUCCESS
    assert as_start(asp, "dup-as").as_status == apb.ALLSPARK_PARAM_ERROR      # uuid in use
    assert as_finish(asp, "dup-as") == apb.GenerateFinished
    for call in (asp.StopRequest, asp.ReleaseRequest, asp.SyncRequest):
        assert call(apb.StopRequestRequest(uuid="never-was")).as_status == apb.ALLSPARK_ILLEGAL_REQUEST_ID
    assert asp.GenerateStatus(apb.UUID(uuid="never-was")).status == apb.Init
    assert settled(serving_engine)
    ok_grpc(grpc_channel)


# =============================================================================================
# row 14: unknown model or LoRA; model paths from the network
# =============================================================================================
def test_row14_unknown_models_lora_and_paths(http, sgl, asp, arc, grpc_channel, model_root, demo_generator_path,
                                             tmp_path):
    for route, body in (("/v1/completions", {"prompt": "x"}), ("/v1/embeddings", {"input": "x"}),
                        ("/v1/chat/completions", {"messages": CHAT})):
        http_error(http.post(route, json={**body, "model": "no-such"}), 404, "no-such", param="model")
    http_error(http.get("/v1/models/no-such"), 404, "no-such")
    grpc_error(lambda: sgl.Generate(gen_req(lora_id="adapter-1")), grpc.StatusCode.NOT_FOUND, "lora_id")
    assert "no-such" in arc.Encode(ipb.EncodeRequest(request_id="m", n_prompts=1, prompts=["x"],
                                                     model_name="no-such")).error
    assert asp.StartRequest(apb.StartRequestRequest(model_name="no-such", inputs=as_tensor(),
                                                    config=apb.GenerateConfig(uuid="m", max_length=12))
                            ).as_status == apb.ALLSPARK_PARAM_ERROR
    # model paths: only under --model-root, after resolving '..' and symlinks
    outside = tmp_path / "outside-model"
    shutil.copytree(demo_generator_path, outside)
    link = Path(model_root) / "sneaky-link"
    if not link.exists():
        link.symlink_to(outside)
    for path in (os.path.join(model_root, "..", outside.parent.name, outside.name), str(outside),
                 f"file://{outside}", "http://169.254.169.254/latest/meta-data", str(link)):
        cfg = apb.ModelStructConfig(model_name="escape", model_path=path)
        assert asp.BuildModelFromConfigStruct(cfg).as_status == apb.ALLSPARK_INVALID_CALL_ERROR, path  # denied
        info = asp.GetFileInformation(apb.FileInformationRequest(model_path=path))
        assert info.create_version_graph == "" and info.create_version_param == ""
    served = sgl.GetServerInfo(spb.GetServerInfoRequest()).server_args["served_models"]
    assert "escape" not in list(served)
    ok_http(http)
    ok_grpc(grpc_channel)


# =============================================================================================
# row 15: missing, wrong and case-altered keys; path tricks  (row 16: admin needs the admin key)
# =============================================================================================
@pytest.fixture(scope="module")
def keyed_grpc(server_loop, serving_engine):
    srv = start_grpc_server(server_loop, serving_engine, api_key="User-Key-15", admin_api_key="Admin-Key-16",
                            enable_admin=True, servicers=make_servicers(serving_engine, on_shutdown=lambda: None))
    yield srv
    stop_grpc_server(server_loop, srv)


def _md(value):
    return (("authorization", value),) if value is not None else None


def test_row15_keys_are_checked_first_and_exactly(keyed_grpc):
    """HTTP: tests/frontends/test_http_app.py (test_missing_or_wrong_keys_are_401, test_path_tricks_still_need_the_key)."""
    with grpc.insecure_channel(keyed_grpc.target) as ch:
        stub = spb_grpc.SglangSchedulerStub(ch)
        for value in (None, "", "Bearer", "Bearer user-key-15", "Bearer USER-KEY-15", "Bearer User-Key-15x",
                      "Basic User-Key-15", "User-Key-15", "Bearer  "):
            grpc_error(lambda: stub.GetModelInfo(spb.GetModelInfoRequest(), metadata=_md(value), timeout=10),
                       grpc.StatusCode.UNAUTHENTICATED)
        # undecodable bytes without a key: UNAUTHENTICATED, not INVALID_ARGUMENT (auth runs first)
        grpc_error(lambda: ch.unary_unary(f"{SGL}/GetModelInfo")(b"\xff\xff", timeout=10),
                   grpc.StatusCode.UNAUTHENTICATED)
        # health stays open (liveness), everything else answers with the key
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert stub.GetModelInfo(spb.GetModelInfoRequest(), metadata=_md("bearer User-Key-15"), timeout=10).vocab_size
        replies = list(stub.Generate(gen_req("keyed"), metadata=_md("Bearer User-Key-15"), timeout=30))
        assert replies[-1].complete.completion_tokens == 4


@pytest.mark.parametrize("method", sorted(ADMIN_METHODS))
def test_row16_user_key_cannot_call_admin_rpcs(keyed_grpc, method):
    """Also: tests/frontends/test_grpc_server.py (admin refused unless enabled), tests/frontends/test_mirror.py (the mirror)."""
    from google.protobuf import message_factory

    desc = apb.DESCRIPTOR.services_by_name["AllSpark"].methods_by_name[method]
    request = message_factory.GetMessageClass(desc.input_type)(model_name=GEN) if "model_name" in \
        desc.input_type.fields_by_name else message_factory.GetMessageClass(desc.input_type)()
    with grpc.insecure_channel(keyed_grpc.target) as ch:
        call = ch.unary_unary(f"{ASP}/{method}")
        grpc_error(lambda: call(request.SerializeToString(), metadata=_md("Bearer User-Key-15"), timeout=10),
                   grpc.StatusCode.PERMISSION_DENIED, method, "admin")
        grpc_error(lambda: call(request.SerializeToString(), timeout=10), grpc.StatusCode.UNAUTHENTICATED)
        # the user key still works for ordinary calls
        stub = apb_grpc.AllSparkStub(ch)
        assert stub.GetRankId(apb.Empty(), metadata=_md("Bearer User-Key-15"), timeout=10).rank_id == 0


# =============================================================================================
# row 17: a burst at 3x capacity
# =============================================================================================
def test_row17_burst_is_refused_at_once_never_hangs(http_url, grpc_channel, serving_engine):
    running = serving_engine.args.max_running_requests          # 8 rows
    waiting = 4
    capacity = running + waiting
    body = {"prompt": "burst", "max_tokens": 24, "ignore_eos": True}

    def http_call(i):
        t0 = time.monotonic()
        with httpx.Client(base_url=http_url, timeout=120) as c:
            r = c.post("/v1/completions", json={**body, "stream": i % 2 == 0})
            return ("http", r.status_code, r.headers.get("retry-after"), time.monotonic() - t0, r.text[:300])

    def grpc_call(i):
        t0 = time.monotonic()
        try:
            list(spb_grpc.SglangSchedulerStub(grpc_channel).Generate(gen_req(f"burst-{i}", sp=greedy(24)), timeout=120))
            return ("grpc", 200, None, time.monotonic() - t0, "")
        except grpc.RpcError as e:
            retry = dict(e.trailing_metadata() or ()).get("retry-after")
            code = 429 if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else e.code().name
            return ("grpc", code, retry, time.monotonic() - t0, e.details())

    with limits(serving_engine, max_waiting_requests=waiting), slow(serving_engine), \
            ThreadPoolExecutor(3 * capacity) as pool:
        futures = [pool.submit(http_call if i % 2 else grpc_call, i) for i in range(3 * capacity)]
        results = [f.result(timeout=180) for f in futures]          # never a hang
    statuses = [r[1] for r in results]
    assert set(statuses) <= {200, 429}, results
    refused = [r for r in results if r[1] == 429]
    # the first `waiting` arrivals always fit the queue; how many more are admitted depends on how
    # fast the scheduler moves waiting requests into its 8 rows while the burst arrives (a 2-core
    # CI host admitted 5 of 36 once), so only that floor is a guarantee
    assert refused and statuses.count(200) >= waiting, statuses
    for front, _, retry, took, text in refused:
        assert retry is not None and int(retry) >= 1, (front, retry)
        assert took < 5.0, (front, took)                          # refused at once, not after a wait
        assert "waiting queue is full" in text and str(waiting) in text
    assert {r[0] for r in refused} == {"http", "grpc"}
    assert settled(serving_engine)
    with httpx.Client(base_url=http_url, timeout=60) as c:
        ok_http(c)


# =============================================================================================
# row 18: client cancel mid-prefill and mid-stream, client crash
# =============================================================================================
def test_row18_cancel_mid_prefill_and_client_crash(sgl, http_url, serving_engine, grpc_channel):
    """Mid-stream cancels: tests/frontends/test_grpc_sglang.py, test_http_openai.py, test_mirror.py."""
    before = serving_engine.counters.snapshot()
    with slow(serving_engine):
        # a 200-token prompt takes two prefill chunks (128-token budget); cancel as soon as it is accepted
        call = sgl.Generate(gen_req("prefill-cancel", prompt=[7] * 200, sp=greedy(50), stream=True))
        assert wait_for(lambda: serving_engine.counters.snapshot()["accepted"] > before["accepted"], 20, 0.001)
        call.cancel()
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.CANCELLED
        # a client that crashes mid-stream: TCP reset after the first bytes
        parts = urlsplit(http_url)
        payload = json.dumps({"prompt": "crash", "max_tokens": 200, "ignore_eos": True, "stream": True}).encode()
        s = socket.create_connection((parts.hostname, parts.port), timeout=20)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        assert s.recv(200).startswith(b"HTTP/1.1 200")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()                                                      # RST, no FIN
        assert settled(serving_engine)
    after = serving_engine.counters.snapshot()
    assert after["cancelled"] - before["cancelled"] == 2 and after["completed"] == before["completed"]
    ok_grpc(grpc_channel)


# =============================================================================================
# row 19: tiny grpc-timeout, slowloris head and body
# =============================================================================================
def test_row19_tiny_deadline_aborts_the_request(sgl, serving_engine, grpc_channel):
    before = serving_engine.counters.snapshot()
    with slow(serving_engine):
        grpc_error(lambda: list(sgl.Generate(gen_req("deadline-0", sp=greedy(200), stream=True), timeout=0.001)),
                   grpc.StatusCode.DEADLINE_EXCEEDED)
        call = sgl.Generate(gen_req("deadline-1", sp=greedy(200), stream=True), timeout=0.6)
        grpc_error(lambda: list(call), grpc.StatusCode.DEADLINE_EXCEEDED)
        assert settled(serving_engine)
    after = serving_engine.counters.snapshot()
    assert after["accepted"] > before["accepted"]                  # the second one reached the engine...
    assert after["completed"] == before["completed"]               # ...and was cancelled, not finished
    assert after["cancelled"] - before["cancelled"] == after["accepted"] - before["accepted"]
    ok_grpc(grpc_channel)


def test_row19_slowloris_head_and_body_get_408(hardened_url):
    parts = urlsplit(hardened_url)
    # a body that never arrives in full
    t0 = time.monotonic()
    raw = raw_http(hardened_url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    assert status_of(raw) == 408 and b"did not arrive within" in raw and time.monotonic() - t0 < 5
    # a head that trickles in, byte by byte
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as s:
        t0 = time.monotonic()
        answer = b""
        for ch in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"y" * 100:
            try:
                s.sendall(bytes([ch]))
            except OSError:
                break
            time.sleep(0.05)
            s.settimeout(0.001)
            try:
                answer += s.recv(1024)
            except (socket.timeout, BlockingIOError):
                pass
            except OSError:
                break
            if answer:
                break
        s.settimeout(5)
        try:
            answer += s.recv(1024)
        except OSError:
            pass
    assert status_of(answer) == 408, answer
    assert time.monotonic() - t0 < 4
    # a connection that sends nothing at all is closed too
    raw = raw_http(hardened_url, b"")
    assert raw == b"" or status_of(raw) == 408
    with httpx.Client(base_url=hardened_url, timeout=30) as c:
        ok_http(c)


# =============================================================================================
# row 20: drain (SIGTERM) -- 8 live streams finish: tests/e2e/test_cli_e2e.py; here: the deadline
# =============================================================================================
def test_row20_fail_in_flight_ends_each_front_with_an_explicit_error(http_url, grpc_channel, asp, serving_engine,
                                                                     server_loop):
    """What the drain does at its deadline (engine.fail_in_flight), seen through every front."""
    result: dict = {}

    def http_stream():
        with httpx.Client(base_url=http_url, timeout=60) as c:
            with c.stream("POST", "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 240,
                                                                "ignore_eos": True, "stream": True}) as r:
                result["http"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    def grpc_stream():
        try:
            list(spb_grpc.SglangSchedulerStub(grpc_channel).Generate(gen_req("drain-g", sp=greedy(240), stream=True),
                                                                  timeout=60))
            result["grpc"] = "OK"
        except grpc.RpcError as e:
            result["grpc"] = (e.code(), e.details())

    with slow(serving_engine):
        threads = [threading.Thread(target=http_stream), threading.Thread(target=grpc_stream)]
        for t in threads:
            t.start()
        assert as_start(asp, "drain-as", new_tokens=240).as_status == apb.ALLSPARK_SUCCESS
        assert wait_for(lambda: serving_engine.stats(GEN).running_requests == 3, 30)
        assert server_loop.run(_fail_in_flight(serving_engine)) == 3
        for t in threads:
            t.join(60)
        assert as_finish(asp, "drain-as") == apb.GenerateInterrupted
    assert result["grpc"][0] == grpc.StatusCode.UNAVAILABLE and "drain" in result["grpc"][1]
    events = result["http"]
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2][6:])["error"]
    assert err["code"] == "unavailable" and "drain" in err["message"]
    assert settled(serving_engine)
    ok_grpc(grpc_channel)


async def _fail_in_flight(engine):
    return engine.fail_in_flight("the server is shutting down: the request did not finish within the drain "
                                 "timeout (0s)")


def test_row20_drain_deadline_ends_streams_with_an_error_then_exits_zero(demo_generator_path, tmp_path):
    """`xlaserve serve --drain-timeout 0.1`: streams that cannot finish in time end with an explicit
    error (SSE error event with code "unavailable", gRPC UNAVAILABLE), never a silent close; the
    process exits 0. Four n=8 requests queue behind each other's 8 rows, so some are still in
    flight at the deadline however fast the engine is."""
    import re

    from tests.helpers.shared import ENGINE_FLAGS, xlaserve

    env = dict(os.environ, XLASERVE_PROGRESS="0")
    user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    cmd = xlaserve() + ["serve", "--model", f"{GEN}={demo_generator_path}", "--grpc-port", "0", "--http-port", "0",
                        "--drain-timeout", "0.1", "--compile-cache-dir",
                        os.path.join(user_cache, "xlaserve", "jax_cache"), *ENGINE_FLAGS]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(x.decode(errors="replace")) for x in proc.stdout],
                     daemon=True).start()

    def find(pat):
        return next((m for m in (re.search(pat, x) for x in list(lines)) if m), None)

    results: dict = {}
    try:
        assert wait_for(lambda: find(r"ready in") or proc.poll() is not None, 180), "".join(lines[-40:])
        http_url = find(r"HTTP listening on (http://\S+)").group(1)
        grpc_addr = find(r"gRPC listening on (\S+)").group(1).rstrip(",")

        def http_stream(i: int) -> None:
            with httpx.Client(base_url=http_url, timeout=60) as c:
                with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 250, "n": 8,
                                                               "ignore_eos": True, "stream": True}) as r:
                    events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            last = json.loads(events[-2])
            results[f"http-{i}"] = (("error", last["error"]["code"], last["error"]["message"]) if "error" in last
                                    else ("finished", events[-1]))

        def grpc_stream(i: int) -> None:
            with grpc.insecure_channel(grpc_addr) as ch:
                try:
                    replies = list(spb_grpc.SglangSchedulerStub(ch).Generate(
                        gen_req(f"d{i}", sp=greedy(240, n=8), stream=True), timeout=60))
                    results[f"grpc-{i}"] = ("finished", replies[-1].complete.finish_reason)
                except grpc.RpcError as e:
                    results[f"grpc-{i}"] = ("error", e.code().name.lower(), e.details())

        threads = [threading.Thread(target=f, args=(i,)) for i in range(2) for f in (http_stream, grpc_stream)]
        for t in threads:
            t.start()
        with httpx.Client(base_url=http_url, timeout=10) as c:
            accepted = 'xlaserve_engine_requests_total{outcome="accepted"} 4.0'
            assert wait_for(lambda: accepted in c.get("/metrics").text, 60)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log = "".join(lines[-40:])
    assert code == 0, log
    assert len(results) == 4, (results, log)
    errors = [r for r in results.values() if r[0] == "error"]
    assert len(errors) >= 2, results                       # at least the requests queued last
    for r in results.values():
        assert r in (("finished", "data: [DONE]"), ("finished", "length")) or (
            r[0] == "error" and r[1] == "unavailable" and "drain timeout (0.1s)" in r[2]), r
    left = find(r"stopping with (\d+) request\(s\) still in flight; they end with an error")
    assert left and int(left.group(1)) == len(errors), log


# =============================================================================================
# row 21: an exception in a model step; a worker that is gone
# =============================================================================================
def test_row21_fault_in_one_step_fails_only_its_requests_on_every_front(http_url, grpc_channel, asp, serving_engine):
    sgl = spb_grpc.SglangSchedulerStub(grpc_channel)
    before = serving_engine.counters.snapshot()
    # (a) a fault in the ragged step that prefills a new prompt fails every request of that step:
    # the prompt and the two streams decoding beside it; the server goes on serving
    sched = serving_engine.worker(GEN).replicas[0]
    runner = sched.runner
    with fault(serving_engine, "step", times=0, delay_s=0.02):
        a = sgl.Generate(gen_req("bystander-a", sp=greedy(60), stream=True))
        b = sgl.Generate(gen_req("bystander-b", sp=greedy(60), stream=True))
        next(a), next(b)
        armed = {"n": 1}
        previous = runner.fault_hook

        def prefill_step_fault(name: str) -> None:
            if name.startswith("step") and sched.prefilling and armed["n"]:      # the new prompt is in this step
                armed["n"] = 0
                raise RuntimeError("injected step fault")
            previous(name)

        runner.fault_hook = prefill_step_fault
        try:
            with httpx.Client(base_url=http_url, timeout=60) as c:
                r = c.post("/v1/completions", json={"prompt": [1, 2, 3, 4, 5], "max_tokens": 5})
        finally:
            runner.fault_hook = previous
        assert armed["n"] == 0
    err = http_error(r, 500, "model step failed", "injected step fault")
    assert err["code"] == "internal" and err["type"] == "internal_error"
    for stream in (a, b):
        with pytest.raises(grpc.RpcError) as e:
            list(stream)
        assert e.value.code() == grpc.StatusCode.INTERNAL and "injected step fault" in e.value.details()
    ok_grpc(grpc_channel)
    # (b) a fault in a decode-only step: every request of that step fails, each front in its own way
    result: dict = {}

    def http_stream():
        with httpx.Client(base_url=http_url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 200, "ignore_eos": True,
                                                           "stream": True}) as r:
                result["http"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    def mirror_stream():
        with httpx.Client(base_url=http_url, timeout=60) as c:
            body = {"requestId": "fault-m", "stream": True, "tokenized": {"inputIds": PROMPT},
                    "samplingParams": {"temperature": 0, "maxNewTokens": 200, "ignoreEos": True}}
            result["mirror"] = c.post(f"{SGL}/Generate", json=body).text.splitlines()

    def grpc_stream():
        try:
            list(sgl.Generate(gen_req("fault-g", sp=greedy(200), stream=True), timeout=60))
            result["grpc"] = "OK"
        except grpc.RpcError as e:
            result["grpc"] = (e.code(), e.details())

    # 0.05 s a step: 200 tokens take >= 10 s, so no stream can finish before the last of the four
    # is admitted, however loaded the machine (at 0.02 s one did once, in a full run)
    with slow(serving_engine, 0.05):
        threads = [threading.Thread(target=f) for f in (http_stream, mirror_stream, grpc_stream)]
        for t in threads:
            t.start()
        assert as_start(asp, "fault-as", new_tokens=200).as_status == apb.ALLSPARK_SUCCESS
        assert wait_for(lambda: serving_engine.stats(GEN).running_requests == 4, 30)
        # two whole steps more (8 tokens), none prefilling: every stream has its first token, so the
        # fault lands mid-stream on every front (a mirror stream whose first message is the error
        # answers a plain HTTP 500 instead, by design: under a loaded CI run the fault once came first)
        g0 = serving_engine.stats(GEN).total_generated_tokens
        assert wait_for(lambda: serving_engine.stats(GEN).total_generated_tokens >= g0 + 8 and not sched.prefilling, 30)
        with fault(serving_engine, "step", delay_s=0.02) as left:
            assert wait_for(lambda: left["n"] == 0, 30)
            for t in threads:
                t.join(60)
            as_status = as_finish(asp, "fault-as")
    assert as_status == apb.GenerateInterrupted
    assert result["grpc"][0] == grpc.StatusCode.INTERNAL and "injected step fault" in result["grpc"][1]
    assert "Traceback" not in result["grpc"][1]
    assert json.loads(result["http"][-2][6:])["error"]["code"] == "internal" and result["http"][-1] == "data: [DONE]"
    assert json.loads(result["mirror"][-1])["error"]["code"] == "internal"
    assert settled(serving_engine) and serving_engine.healthy()
    after = serving_engine.counters.snapshot()
    delta = {k: after[k] - before[k] for k in after}
    assert delta["errored"] == 7 and delta["completed"] == 1, delta   # (a) 3 in the step, (b) 4; ok_grpc in (a)
    ok_grpc(grpc_channel)
    with httpx.Client(base_url=http_url, timeout=60) as c:
        ok_http(c)


def test_row21_worker_gone_turns_unhealthy_and_refuses_new_requests(http_url, grpc_channel, asp, arc, serving_engine):
    """A dead scheduler (device lost): /health 503, gRPC health NOT_SERVING, new requests UNAVAILABLE."""
    sched = serving_engine.worker(GEN).replicas[0]
    health = health_pb2_grpc.HealthStub(grpc_channel)
    sgl = spb_grpc.SglangSchedulerStub(grpc_channel)
    sched.failed = "RuntimeError('device lost (simulated)')"
    try:
        with httpx.Client(base_url=http_url, timeout=30) as c:
            assert c.get("/health").status_code == 503 and c.get("/health").json()["status"] == "unhealthy"
            assert c.get("/ready").status_code == 503
            http_error(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 503)
            r = c.post(f"{SGL}/Generate", json={"tokenized": {"inputIds": PROMPT}})
            assert r.status_code == 503 and "not alive" in r.json()["message"]
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not sgl.HealthCheck(spb.HealthCheckRequest()).healthy
        assert not arc.HealthCheck(ipb.HealthCheckRequest()).healthy
        grpc_error(lambda: sgl.Generate(gen_req("gone")), grpc.StatusCode.UNAVAILABLE, "gen", "not alive")
        assert as_start(asp, "gone-as").as_status == apb.ALLSPARK_REQUEST_DENIED
    finally:
        sched.failed = None
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    ok_grpc(grpc_channel)


# =============================================================================================
# row 22: HTTP/2 abuse bounds on the gRPC server
# =============================================================================================
def test_row22_grpc_server_options_bound_streams_pings_and_connection_age(monkeypatch, serving_engine, server_loop):
    import frontends.grpc.server as server_mod

    seen = {}
    real = grpc.aio.server

    def capture(*args, **kwargs):
        seen.update(dict(kwargs.get("options") or ()))
        return real(*args, **kwargs)

    monkeypatch.setattr(grpc.aio, "server", capture)

    async def build():  # grpc.aio wants a running loop; the server is built, never started
        return server_mod.build_grpc_server(serving_engine, port=0, max_message_bytes=1234)

    server_loop.run(build())
    assert seen["grpc.max_concurrent_streams"] == server_mod.DEFAULT_MAX_CONCURRENT_STREAMS
    assert 0 < seen["grpc.max_concurrent_streams"] <= 1024
    assert seen["grpc.max_receive_message_length"] == seen["grpc.max_send_message_length"] == 1234
    assert seen["grpc.http2.max_ping_strikes"] >= 1
    assert seen["grpc.http2.min_recv_ping_interval_without_data_ms"] >= 1000
    assert 0 < seen["grpc.keepalive_time_ms"] and 0 < seen["grpc.keepalive_timeout_ms"]
    assert seen["grpc.max_connection_age_ms"] > 0 and seen["grpc.max_connection_age_grace_ms"] > 0
    assert seen["grpc.max_connection_idle_ms"] > 0


def test_row22_streams_beyond_the_bound_wait_for_a_free_one(server_loop, serving_engine):
    srv = start_grpc_server(server_loop, serving_engine, max_concurrent_streams=1)
    try:
        with grpc.insecure_channel(srv.target) as ch, slow(serving_engine):
            stub = spb_grpc.SglangSchedulerStub(ch)
            before = serving_engine.counters.snapshot()["accepted"]
            first = stub.Generate(gen_req("s1", sp=greedy(40), stream=True), timeout=60)
            next(first)
            second = stub.Generate(gen_req("s2", sp=greedy(4), stream=True), timeout=60)
            time.sleep(0.3)
            assert serving_engine.counters.snapshot()["accepted"] == before + 1   # s2 waits at the HTTP/2 level
            list(first)
            assert list(second)[-1].complete.completion_tokens == 4
    finally:
        stop_grpc_server(server_loop, srv)


# =============================================================================================
# issue #7 item 1: every limit is a flag with a default
# =============================================================================================
def test_limit_flags_reach_the_engine():
    from frontends.cli import engine_args, parse_serve_args
    from jax_engine.config import EngineArgs

    d = EngineArgs()
    assert (d.max_new_tokens_limit, d.max_n, d.max_top_logprobs, d.max_stop_strings, d.max_stop_string_len,
            d.max_embed_inputs, d.max_waiting_requests) == (4096, 8, 5, 16, 256, 256, 256)
    flags = {"--max-prompt-tokens": 100, "--max-new-tokens-limit": 64, "--max-n": 3, "--max-top-logprobs": 2,
             "--max-stop-strings": 4, "--max-stop-string-len": 32, "--max-embed-inputs": 7,
             "--max-waiting-requests": 9, "--max-model-len": 512}
    argv = [a for k, v in flags.items() for a in (k, str(v))] + ["--max-message-bytes", "1000",
                                                                  "--http-read-timeout", "5", "--model",
                                                                  f"g={os.path.dirname(__file__)}"]
    ns = parse_serve_args(argv)
    args = engine_args(ns)
    for flag, value in flags.items():
        assert getattr(args, flag[2:].replace("-", "_")) == value, flag
    assert ns.max_message_bytes == 1000 and ns.http_read_timeout == 5.0


# =============================================================================================
# issue #7 item 2: mTLS
# =============================================================================================
def test_mtls_requires_a_client_certificate(server_loop, serving_engine, tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available")

    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp_path)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=test-ca")
    for name, san in (("server", "subjectAltName=DNS:localhost,IP:127.0.0.1"), ("client", "subjectAltName=DNS:client")):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        (tmp_path / f"{name}.ext").write_text(san + "\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext")
    read = lambda n: (tmp_path / n).read_bytes()  # noqa: E731
    srv = start_grpc_server(server_loop, serving_engine, tls_cert=str(tmp_path / "server.pem"),
                            tls_key=str(tmp_path / "server.key"), tls_client_ca=str(tmp_path / "ca.pem"))
    try:
        anonymous = grpc.ssl_channel_credentials(root_certificates=read("ca.pem"))
        with grpc.secure_channel(srv.target, anonymous) as ch:
            with pytest.raises(grpc.RpcError) as e:
                apb_grpc.AllSparkStub(ch).GetRankId(apb.Empty(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        mutual = grpc.ssl_channel_credentials(root_certificates=read("ca.pem"), private_key=read("client.key"),
                                              certificate_chain=read("client.pem"))
        with grpc.secure_channel(srv.target, mutual) as ch:
            assert apb_grpc.AllSparkStub(ch).GetRankId(apb.Empty(), timeout=10).rank_id == 0
    finally:
        stop_grpc_server(server_loop, srv)


# =============================================================================================
# issue #7 item 5: accounting balances after a mixed run
# =============================================================================================
def test_accounting_balances_after_a_mixed_run(http_url, grpc_channel, asp, arc, serving_engine):
    sgl = spb_grpc.SglangSchedulerStub(grpc_channel)
    before = serving_engine.counters.snapshot()

    def completed_http():
        with httpx.Client(base_url=http_url, timeout=60) as c:
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "n": 2}).status_code == 200
            assert c.post("/v1/embeddings", json={"input": ["a", "b"]}).status_code == 200
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}).status_code == 400  # not accepted

    def cancelled_http():
        with httpx.Client(base_url=http_url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 200, "ignore_eos": True,
                                                           "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        break

    def cancelled_grpc():
        call = sgl.Generate(gen_req("acct-cancel", sp=greedy(200), stream=True))
        next(call)
        call.cancel()

    def completed_grpc():
        assert list(sgl.Generate(gen_req("acct-ok")))[-1].complete.finish_reason == "length"
        assert arc.Encode(ipb.EncodeRequest(request_id="acct", n_prompts=1, prompts=["x"], model_name=EMBED)).error == ""
        assert as_start(asp, "acct-as") .as_status == apb.ALLSPARK_SUCCESS
        assert as_finish(asp, "acct-as") == apb.GenerateFinished
        assert as_start(asp, "acct-stop", new_tokens=200).as_status == apb.ALLSPARK_SUCCESS
        assert asp.StopRequest(apb.StopRequestRequest(uuid="acct-stop")).as_status == apb.ALLSPARK_SUCCESS
        asp.ReleaseRequest(apb.StopRequestRequest(uuid="acct-stop"))

    def errored():
        with fault(serving_engine, "step"):
            with httpx.Client(base_url=http_url, timeout=60) as c:
                assert c.post("/v1/completions", json={"prompt": [9, 9, 9], "max_tokens": 2}).status_code == 500

    errored()
    with ThreadPoolExecutor(4) as pool, slow(serving_engine, 0.005):
        for f in [pool.submit(fn) for fn in (completed_http, cancelled_http, cancelled_grpc, completed_grpc)]:
            f.result(120)
    assert settled(serving_engine)
    after = serving_engine.counters.snapshot()
    delta = {k: after[k] - before[k] for k in after}
    assert delta["accepted"] == delta["completed"] + delta["errored"] + delta["cancelled"], delta
    assert delta["errored"] == 1 and delta["cancelled"] == 3 and delta["completed"] >= 5, delta
    assert after["accepted"] == after["completed"] + after["errored"] + after["cancelled"]
    with httpx.Client(base_url=http_url, timeout=30) as c:
        text = c.get("/metrics").text
    for outcome in ("accepted", "completed", "errored", "cancelled"):
        assert f'xlaserve_engine_requests_total{{outcome="{outcome}"}} {float(after[outcome])}' in text


# =============================================================================================
# the event loop keeps serving while a huge text prompt is tokenized
# =============================================================================================
def test_long_text_prompt_does_not_block_the_event_loop(http_url):
    prompt = "lorem ipsum dolor sit amet " * 120_000          # ~3 MB of text, well within the body limit
    result: dict = {}

    def big():
        with httpx.Client(base_url=http_url, timeout=120) as c:
            result["r"] = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})

    t = threading.Thread(target=big)
    t.start()
    worst = 0.0
    with httpx.Client(base_url=http_url, timeout=30) as c:
        while t.is_alive():
            t0 = time.monotonic()
            assert c.get("/health").status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.05)
    t.join()
    http_error(result["r"], 400, "exceeds the limit", param="prompt")
    assert worst < 1.0, f"/health took {worst:.2f}s while the prompt was tokenized"
