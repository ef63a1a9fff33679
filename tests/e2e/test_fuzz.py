"""Bounded fuzzing (issue #7, reliability_security.md §5/§6): seconds, deterministic seeds.

* schemathesis against the HTTP app's own OpenAPI document, in-process over ASGI: positive and
  negative bodies for every operation; no 5xx, and every response conforms to the document
  (documented status, content type, body schema).
* protobuf fuzzing of every RPC of the three gRPC services: messages built by hypothesis from
  the descriptors, then the same messages byte-mutated, sent as raw bytes over a real socket. No
  call may end INTERNAL or UNKNOWN, and the server keeps answering: a normal request succeeds
  right after.

The shared engine's limits are lowered while fuzzing (few new tokens, small n and batches) so a
generated request that happens to be valid costs milliseconds, not seconds.
"""
from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import httpx
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from frontends.grpc.gen.sglang import sglang_scheduler_pb2 as spb
from frontends.grpc.gen.sglang import sglang_scheduler_pb2_grpc as spb_grpc
from frontends.grpc.server import SERVICES, make_servicers
from tests.helpers.shared import EMBED, GEN, start_grpc_server, stop_grpc_server, wait_for

FORBIDDEN = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
# AllSpark Get / SyncRequest block until a started request moves; a short deadline ends them.
CALL_TIMEOUT_S = 5.0


@contextlib.contextmanager
def small_limits(engine):
    """Keep fuzzed-but-valid requests cheap: <= 4 new tokens, n <= 2, <= 3 inputs per request."""
    a = engine.args
    saved = (a.max_new_tokens_limit, a.max_n, a.max_embed_inputs)
    a.max_new_tokens_limit, a.max_n, a.max_embed_inputs = 4, 2, 3
    try:
        yield
    finally:
        a.max_new_tokens_limit, a.max_n, a.max_embed_inputs = saved


def fuzz_settings(n: int):
    return settings(max_examples=n, deadline=None, database=None, derandomize=True, print_blob=True,
                    suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate, Phase.shrink])


# =============================================================================================
# schemathesis over the OpenAPI document
# =============================================================================================
def test_openapi_schemathesis_no_5xx_and_conforming(http_app, serving_engine):
    import schemathesis
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance, status_code_conformance

    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    schema = schemathesis.openapi.from_asgi("/openapi.json", http_app)
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 4 + 4 + 33  # probes + metrics, /v1 routes, one mirror route per RPC
    failures: list[str] = []
    statuses: dict[int, int] = {}
    started = time.monotonic()
    with small_limits(serving_engine):
        for op in operations:
            # the /v1 routes carry the rich schemas; mirror bodies are free-form objects
            examples = 40 if op.path.startswith("/v1/") else 10
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                @fuzz_settings(examples)
                @given(case=op.as_strategy(generation_mode=mode))
                def run(case) -> None:
                    response = case.call()
                    statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                    try:
                        case.validate_response(response, checks=checks)
                    except BaseException as e:  # schemathesis' FailureGroup is a BaseExceptionGroup
                        if isinstance(e, (KeyboardInterrupt, SystemExit)):
                            raise
                        failures.append(f"{op.label} [{mode.value}] -> {response.status_code}: {str(e)[:800]}")

                try:
                    run()
                except Unsatisfiable:
                    pass  # nothing to negate (an operation without parameters or body)
    elapsed = time.monotonic() - started
    assert not failures, "\n\n".join(failures[:5])
    assert not any(s >= 500 for s in statuses), statuses
    assert statuses.get(200, 0) > 20 and statuses.get(400, 0) > 100, statuses  # both kinds really ran
    assert elapsed < 120, f"schemathesis took {elapsed:.0f}s"
    # the app is fine afterwards
    async def normal():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=http_app), base_url="http://t") as c:
            return await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})

    assert asyncio.run(normal()).status_code == 200


# =============================================================================================
# protobuf fuzzing of every RPC
# =============================================================================================
_INT_RANGES = {
    FD.TYPE_INT32: (-2**31, 2**31 - 1), FD.TYPE_SINT32: (-2**31, 2**31 - 1), FD.TYPE_SFIXED32: (-2**31, 2**31 - 1),
    FD.TYPE_INT64: (-2**63, 2**63 - 1), FD.TYPE_SINT64: (-2**63, 2**63 - 1), FD.TYPE_SFIXED64: (-2**63, 2**63 - 1),
    FD.TYPE_UINT32: (0, 2**32 - 1), FD.TYPE_FIXED32: (0, 2**32 - 1),
    FD.TYPE_UINT64: (0, 2**64 - 1), FD.TYPE_FIXED64: (0, 2**64 - 1),
}
# strings that reach deeper than random text: served model names are left out on purpose (an
# admin call must not stop or release the shared engine's models)
_WORDS = ["", "x", "fuzz-model", "../../etc", "/etc/passwd", "http://169.254.169.254/", "a" * 300, "\x00",
          "all", "core", "memory", "json_object", "Generate", "0", "-1", "\u2603"]


def _scalar(field) -> st.SearchStrategy:
    t = field.type
    if t in _INT_RANGES:
        lo, hi = _INT_RANGES[t]
        # mostly small values (token ids, lengths), sometimes the extremes
        return st.one_of(st.integers(max(lo, -2), min(hi, 300)), st.integers(lo, hi), st.sampled_from([lo, hi]))
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
        width = 32 if t == FD.TYPE_FLOAT else 64
        return st.one_of(st.sampled_from([0.0, 0.5, 1.0, -1.0, 2.0]), st.floats(width=width))
    if t == FD.TYPE_STRING:
        return st.one_of(st.sampled_from(_WORDS), st.text(max_size=24))
    if t == FD.TYPE_BYTES:
        packed = st.lists(st.integers(-3, 400), max_size=12).map(
            lambda xs: b"".join(int(x).to_bytes(4, "little", signed=True) for x in xs))
        return st.one_of(st.binary(max_size=48), packed)
    if t == FD.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-3, 1000))
    raise AssertionError(f"unhandled field type {t}")


def message_strategy(descriptor, depth: int = 0) -> st.SearchStrategy:
    """Messages of `descriptor`: any subset of fields set, nested messages to depth 3."""
    cls = message_factory.GetMessageClass(descriptor)
    parts = {}
    for f in descriptor.fields:
        if f.type == FD.TYPE_MESSAGE:
            if depth >= 3:
                continue
            if f.message_type.GetOptions().map_entry:
                key_f, value_f = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
                value = (message_strategy(value_f.message_type, depth + 1) if value_f.type == FD.TYPE_MESSAGE
                         else _scalar(value_f))
                parts[f.name] = st.dictionaries(_scalar(key_f), value, max_size=3)
                continue
            one = message_strategy(f.message_type, depth + 1)
        else:
            one = _scalar(f)
        is_repeated = getattr(f, "is_repeated", None)
        repeated = is_repeated if isinstance(is_repeated, bool) else f.label == FD.LABEL_REPEATED
        parts[f.name] = st.lists(one, max_size=5) if repeated else one

    def build(values: dict) -> object:
        msg = cls()
        for name, v in values.items():
            f = descriptor.fields_by_name[name]
            try:
                if isinstance(v, dict):
                    target = getattr(msg, name)
                    for k, item in v.items():
                        if f.message_type.fields_by_name["value"].type == FD.TYPE_MESSAGE:
                            target[k].CopyFrom(item)
                        else:
                            target[k] = item
                elif isinstance(v, list):
                    if f.type == FD.TYPE_MESSAGE:
                        for item in v:
                            getattr(msg, name).add().CopyFrom(item)
                    else:
                        getattr(msg, name).extend(v)
                elif f.type == FD.TYPE_MESSAGE:
                    getattr(msg, name).CopyFrom(v)
                else:
                    setattr(msg, name, v)
            except (ValueError, TypeError):
                pass  # a value the field's type refuses (e.g. an out-of-range float32): leave it unset
        return msg

    return st.fixed_dictionaries({}, optional=parts).map(build)


@st.composite
def mutated(draw, base: st.SearchStrategy) -> bytes:
    """A serialized message with a few byte-level mutations (flip, insert, delete, truncate, splice)."""
    data = bytearray(draw(base).SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "dup", "random"]))
        pos = draw(st.integers(0, len(data)))
        if op == "flip" and data:
            i = min(pos, len(data) - 1)
            data[i] ^= draw(st.integers(1, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[pos:pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[pos:]
        elif op == "dup" and data:
            data[pos:pos] = data[max(0, pos - 8):pos]
        elif op == "random":
            data = bytearray(draw(st.binary(max_size=64)))
    return bytes(data)


def _methods():
    pool = descriptor_pool.Default()
    for service in SERVICES:
        for m in pool.FindServiceByName(service).methods:
            yield f"/{service}/{m.name}", m


METHODS = list(_methods())
ADMIN_MODEL_METHODS = {"ReloadModelToDeviceMemory", "UnloadModelFromDeviceMemory", "StartModel", "StopModel",
                       "ReleaseModel", "BuildModelFromConfigStruct"}


@pytest.fixture(scope="module")
def fuzz_server(server_loop, serving_engine):
    """Admin enabled (so the admin RPCs' own code is fuzzed too), ShutdownService a no-op."""
    servicers = make_servicers(serving_engine, on_shutdown=lambda: None)
    srv = start_grpc_server(server_loop, serving_engine, enable_admin=True, servicers=servicers)
    yield srv
    stop_grpc_server(server_loop, srv)


def _call(channel, path: str, method, payload: bytes):
    """Send raw request bytes; the final status code (OK included)."""
    try:
        if method.server_streaming:
            for _ in channel.unary_stream(path)(payload, timeout=CALL_TIMEOUT_S):
                pass
        else:
            channel.unary_unary(path)(payload, timeout=CALL_TIMEOUT_S)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details()


def _touches_served_model(method, payload: bytes) -> bool:
    """True for an admin lifecycle call that would act on one of the shared engine's models."""
    if method.name not in ADMIN_MODEL_METHODS:
        return False
    try:
        msg = message_factory.GetMessageClass(method.input_type).FromString(payload)
    except Exception:
        return False
    return getattr(msg, "model_name", None) in (GEN, EMBED)


def _normal_generate_works(channel) -> None:
    sp = spb.SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    replies = list(spb_grpc.SglangSchedulerStub(channel).Generate(spb.GenerateRequest(
        request_id="after-fuzz", tokenized=spb.TokenizedInput(input_ids=[1, 40, 41]), sampling_params=sp),
        timeout=30))
    assert replies[-1].complete.completion_tokens == 2


@pytest.mark.parametrize("kind", ["built", "mutated"])
def test_protobuf_fuzz_every_rpc(fuzz_server, serving_engine, kind):
    bad: list[str] = []
    seen: dict[str, int] = {}
    started = time.monotonic()
    with small_limits(serving_engine), grpc.insecure_channel(fuzz_server.target) as channel:
        for path, method in METHODS:
            base = message_strategy(method.input_type)
            payloads = base.map(lambda m: m.SerializeToString()) if kind == "built" else mutated(base)

            @fuzz_settings(25)
            @given(payload=payloads)
            def run(payload: bytes) -> None:
                if _touches_served_model(method, payload):
                    return
                code, details = _call(channel, path, method, payload)
                seen[code.name] = seen.get(code.name, 0) + 1
                if code in FORBIDDEN or "Traceback" in details:
                    bad.append(f"{path} {payload!r:.200} -> {code.name}: {details[:300]}")

            run()
        elapsed = time.monotonic() - started
        assert not bad, "\n".join(bad[:10])
        _normal_generate_works(channel)
    assert wait_for(lambda: serving_engine.stats(GEN).running_requests == 0, 30)
    assert serving_engine.healthy() and serving_engine.stats(GEN).pages_used == 0
    assert elapsed < 120, f"protobuf fuzzing took {elapsed:.0f}s"
    if kind == "mutated":
        assert seen.get("INVALID_ARGUMENT", 0) > 0, seen  # undecodable bytes answer INVALID_ARGUMENT


def test_fuzzed_messages_through_the_json_mirror(http_url, serving_engine):
    """The same hypothesis messages as proto3 JSON to the mirror: never a 5xx."""
    bad: list[str] = []
    with small_limits(serving_engine), httpx.Client(base_url=http_url, timeout=CALL_TIMEOUT_S + 5) as client:
        for path, method in METHODS:
            @fuzz_settings(6)
            @given(msg=message_strategy(method.input_type))
            def run(msg) -> None:
                try:
                    body = json_format.MessageToDict(msg)
                except json_format.SerializeToJsonError:
                    return  # no JSON form (e.g. a Timestamp out of range): nothing to send
                try:
                    r = client.post(path, json=body)
                except httpx.ReadTimeout:
                    return  # a blocking Get / Sync on a live request
                if r.status_code >= 500 and r.status_code != 503:
                    bad.append(f"{path} {body!r:.200} -> {r.status_code}: {r.text[:300]}")

            run()
        assert not bad, "\n".join(bad[:10])
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
