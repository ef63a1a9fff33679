"""Issue 13 §3: no request field is silently dropped. Each field a front cannot honour is refused
with an error naming it; each one it accepts is shown to act. Real sockets, shared fixtures.

Covered here: SGLang `spaces_between_special_tokens` and Embed `texts`; the SGLang and AllSpark
fields that are refused (gRPC and JSON mirror); an unknown LoRA adapter (`lora_id`, `lora_name`)
is refused, never served by the base model; OpenAI `parallel_tool_calls`, unknown keys in
content parts, `max_tokens` with `max_completion_tokens`, `best_of`; gRPC metadata over 16 KiB.
"""
from __future__ import annotations

from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from google.protobuf import struct_pb2

from frontends.grpc.allspark import ERROR_TRAILER
from frontends.grpc.gen.allspark import allspark_service_pb2 as apb
from frontends.grpc.gen.sglang import sglang_scheduler_pb2 as spb
from frontends.grpc.gen.sglang import sglang_scheduler_pb2_grpc as spb_grpc
from frontends.grpc.server import MAX_METADATA_BYTES
from frontends.grpc.sglang import build_generate_request
from tests.helpers.protocol_clients import (
    ALLSPARK,
    SGLANG,
    AllSpark,
    GrpcTransport,
    MirrorTransport,
    Sglang,
    Transport,
)
from tests.helpers.shared import EMBED, GEN

CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module", params=["grpc", "mirror"])
def transport(request, grpc_channel, http) -> Transport:
    return GrpcTransport(grpc_channel) if request.param == "grpc" else MirrorTransport(http)


def _openai_error(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err["message"]


def _chat(http: httpx.Client, **body: Any) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": GEN, "messages": CHAT, "max_tokens": 2, **body})


# ============================================================================================
# SGLang spaces_between_special_tokens
# ============================================================================================
def test_sglang_spaces_between_special_tokens_is_honoured_as_sglang_does(tok, transport):
    """The flag only shapes the detokenized text stop strings are matched against, and SGLang
    passes it to `decode`, which fast (Rust) tokenizers ignore. So on this model both values match
    a stop string on the same text: the special token's own, with no spaces around it."""
    assert tok.is_fast
    p = Sglang(tok, transport, "sglang")
    pad, pad_text = tok.pad_token_id, tok.convert_ids_to_tokens(tok.pad_token_id)
    stop = f"{pad_text}{pad_text}"                 # would not match if spaces were inserted
    base = {"temperature": 0.0, "logit_bias": {pad: 100.0}, "skip_special_tokens": False, "stop": [stop]}
    for spaces in (True, False):
        out = p.one(**base, spaces_between_special_tokens=spaces)
        assert out.tokens == [pad, pad] and out.matched == stop, spaces


def test_sglang_spaces_between_special_tokens_reaches_decode(serving_engine, tok):
    """The field travels into the engine request and the detokenizer hands it to the tokenizer's
    `decode` (where a slow tokenizer would insert or drop the spaces), as SGLang does."""
    from jax_engine.decode.detokenizer import IncrementalDetokenizer

    info = serving_engine.model_info(GEN)
    for spaces in (True, False):
        sp = spb.SamplingParams(temperature=0.0, max_new_tokens=2, spaces_between_special_tokens=spaces)
        req, _ = build_generate_request(spb.GenerateRequest(
            request_id="sb", tokenized=spb.TokenizedInput(input_ids=[1, 2, 3]), sampling_params=sp), info)
        assert req.params.spaces_between_special_tokens is spaces

        seen: list[Any] = []

        class Recording:
            def decode(self, ids: list[int], **kw: Any) -> str:
                seen.append(kw.get("spaces_between_special_tokens"))
                return tok.decode(ids, **kw)

        detok = IncrementalDetokenizer(Recording(), [1, 2], False, [], False, req.params.spaces_between_special_tokens)
        detok.add(tok.pad_token_id)
        assert seen and set(seen) == {spaces}


# ============================================================================================
# SGLang Embed texts without is_cross_encoder: embedded
# ============================================================================================
def _embed(transport: Transport, req: spb.EmbedRequest) -> spb.EmbedComplete:
    resp, _ = transport.unary(SGLANG, "Embed", req, spb.EmbedResponse)
    return resp.complete


def test_sglang_embed_texts_are_embedded(serving_engine, transport):
    texts = ["a man is eating food", "the weather is nice today"]
    embed_tok = serving_engine.tokenizer(EMBED)
    by_ids = [np.asarray(_embed(transport, spb.EmbedRequest(
        request_id=f"ids-{i}", tokenized=spb.TokenizedInput(input_ids=embed_tok(t)["input_ids"]))).embedding)
        for i, t in enumerate(texts)]
    one = _embed(transport, spb.EmbedRequest(request_id="t1", texts=texts[:1]))
    np.testing.assert_allclose(one.embedding, by_ids[0], atol=1e-5)
    both = _embed(transport, spb.EmbedRequest(request_id="t2", texts=texts))
    assert [e.index for e in both.batch_embeddings] == [0, 1] and both.embedding_dim == 384
    for e, want in zip(both.batch_embeddings, by_ids):
        np.testing.assert_allclose(e.values, want, atol=1e-5)
    assert not np.allclose(by_ids[0], by_ids[1], atol=1e-3)


def test_sglang_embed_texts_with_token_ids_is_refused(grpc_channel):
    stub = spb_grpc.SglangSchedulerStub(grpc_channel)
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(spb.EmbedRequest(request_id="both", texts=["a"], tokenized=spb.TokenizedInput(input_ids=[101])))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "texts" in e.value.details()


# ============================================================================================
# SGLang and AllSpark fields the engine cannot honour: refused by name, over gRPC and the mirror
# ============================================================================================
SGLANG_REFUSED: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    # (field named in the error, GenerateRequest fields, SamplingParams fields)
    ("custom_params", {}, {"custom_params": struct_pb2.Struct(fields={"seed": struct_pb2.Value(number_value=1)})}),
    ("token_ids_logprob", {"token_ids_logprob": [5]}, {}),
    ("input_embeds", {"input_embeds": [0.5]}, {}),
    ("return_hidden_states", {"return_hidden_states": True}, {}),
    ("custom_logit_processor", {"custom_logit_processor": "x"}, {}),
    ("mm_inputs", {"mm_inputs": spb.MultimodalInputs(image_urls=["http://x/y.png"])}, {}),
    ("disaggregated_params", {"disaggregated_params": spb.DisaggregatedParams(bootstrap_host="h")}, {}),
]


@pytest.mark.parametrize("name,req_fields,sp_fields", SGLANG_REFUSED, ids=[c[0] for c in SGLANG_REFUSED])
def test_sglang_unsupported_fields_are_refused_by_name(tok, transport, name, req_fields, sp_fields):
    p = Sglang(tok, transport, "sglang")
    req = p.request({"temperature": 0.0, "max_tokens": 2}, **req_fields)
    for key, value in sp_fields.items():
        field = getattr(req.sampling_params, key)
        if hasattr(field, "CopyFrom"):
            field.CopyFrom(value)
        else:
            setattr(req.sampling_params, key, value)
    code, message = _stream_error(transport, req)
    assert code == "INVALID_ARGUMENT" and name in message, message


def _stream_error(transport: Transport, req: spb.GenerateRequest) -> tuple[str, str]:
    """(status code name, message) of a Generate call that must fail before streaming."""
    if isinstance(transport, GrpcTransport):
        with pytest.raises(grpc.RpcError) as e:
            transport.stream(SGLANG, "Generate", req, spb.GenerateResponse)
        return e.value.code().name, e.value.details()
    r = transport._post(SGLANG, "Generate", req)
    assert r.status_code == 400, r.text
    return r.json()["code"].upper(), r.json()["message"]


ALLSPARK_REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("num_beams", {"num_beams": 2}),
    ("num_return_sequences", {"num_return_sequences": 2}),
    ("no_repeat_ngram_size", {"no_repeat_ngram_size": 2}),
    ("bad_words_ids", {"bad_words_ids": apb.BadWordIds(ids=[apb.BadWordIds.Array(word=[5])])}),
    ("suppress_repetition_in_generation", {"suppress_repetition_in_generation": True}),
    ("top_k_arr", {"top_k_arr": [1]}),
    ("top_p_arr", {"top_p_arr": [0.5]}),
    ("seed_arr", {"seed_arr": [1]}),
    ("probe_only", {"probe_only": True}),
    ("length_penalty", {"length_penalty": float("nan")}),
]


@pytest.mark.parametrize("name,fields", ALLSPARK_REFUSED, ids=[c[0] for c in ALLSPARK_REFUSED])
def test_allspark_unsupported_fields_are_refused_by_name(tok, transport, name, fields):
    """In-band PARAM_ERROR (gRPC status OK, as upstream) with the reason in a trailer."""
    p = AllSpark(tok, transport, "allspark")
    cfg = p.config({"temperature": 0.0, "max_tokens": 2})
    for key, value in fields.items():
        target = getattr(cfg, key)
        if hasattr(target, "CopyFrom"):
            target.CopyFrom(value)
        elif hasattr(target, "update"):
            target.update(value)
        elif hasattr(target, "extend"):
            target.extend(value)
        else:
            setattr(cfg, key, value)
    resp, trailers = p.start(cfg)
    assert resp.as_status == apb.ALLSPARK_PARAM_ERROR and resp.uuid == cfg.uuid
    assert f"config.{name}" in trailers[ERROR_TRAILER], trailers
    status, _ = transport.unary(ALLSPARK, "GenerateStatus", apb.UUID(uuid=cfg.uuid), apb.GenerateRequestStatus)
    assert status.status == apb.Init                      # nothing was registered


def test_unknown_lora_adapter_is_refused_not_served_by_the_base_model(tok, transport):
    """lora_id / lora_name are honoured (tests/frontends/test_lora_fronts.py), so an adapter that
    is not loaded is NOT_FOUND (SGLang) or ALLSPARK_LORA_NOT_LOADED = 13 (AllSpark), by name."""
    req = Sglang(tok, transport, "sglang").request({"temperature": 0.0, "max_tokens": 2}, lora_id="no-such-adapter")
    if isinstance(transport, GrpcTransport):
        with pytest.raises(grpc.RpcError) as e:
            transport.stream(SGLANG, "Generate", req, spb.GenerateResponse)
        code, message = e.value.code().name, e.value.details()
    else:
        r = transport._post(SGLANG, "Generate", req)
        assert r.status_code == 404, r.text
        code, message = r.json()["code"].upper(), r.json()["message"]
    assert code == "NOT_FOUND" and "lora_id 'no-such-adapter'" in message, message
    p = AllSpark(tok, transport, "allspark")
    cfg = p.config({"temperature": 0.0, "max_tokens": 2})
    cfg.lora_name = "no-such-adapter"
    resp, trailers = p.start(cfg)
    assert resp.as_status == 13 and resp.uuid == cfg.uuid
    assert "config.lora_name 'no-such-adapter'" in trailers[ERROR_TRAILER], trailers
    status, _ = transport.unary(ALLSPARK, "GenerateStatus", apb.UUID(uuid=cfg.uuid), apb.GenerateRequestStatus)
    assert status.status == apb.Init                      # nothing was registered


def test_allspark_accepted_fields_without_effect_run_as_without_them(tok, transport):
    """length_penalty (beam search only, and num_beams > 1 is refused) is accepted, as upstream,
    and changes nothing: the greedy tokens are the same."""
    p = AllSpark(tok, transport, "allspark")
    plain = p.one(temperature=0.0)
    assert p.one(temperature=0.0, length_penalty=2.0).tokens == plain.tokens


# ============================================================================================
# OpenAI
# ============================================================================================
@pytest.mark.parametrize("value", [True, False])
def test_openai_parallel_tool_calls_is_refused_when_set(http, value):
    message = _openai_error(_chat(http, parallel_tool_calls=value), "parallel_tool_calls")
    assert "tools" in message
    assert _chat(http).status_code == 200


def test_official_openai_client_sends_no_parallel_tool_calls_by_default(http_url):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{http_url}/v1", api_key="none", max_retries=0)
    out = client.chat.completions.create(model=GEN, messages=CHAT, max_tokens=2, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError, match="parallel_tool_calls"):
        client.chat.completions.create(model=GEN, messages=CHAT, max_tokens=2, parallel_tool_calls=True)


@pytest.mark.parametrize("part,param", [
    ({"type": "text", "text": "hi", "foo": 1}, "messages[0].content[0].foo"),
    ({"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}, "messages[0].content[0].cache_control"),
    ({"type": "image_url", "image_url": {"url": "http://x/y.png"}}, "messages[0].content[0].type"),
])
def test_openai_unknown_keys_in_content_parts_are_refused(http, part, param):
    r = http.post("/v1/chat/completions", json={"model": GEN, "max_tokens": 2,
                                                "messages": [{"role": "user", "content": [part]}]})
    message = _openai_error(r, param)
    assert param.rsplit(".", 1)[1] in message
    ok = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert http.post("/v1/chat/completions", json={"model": GEN, "max_tokens": 2, "messages": ok}).status_code == 200


def test_openai_max_tokens_and_max_completion_tokens_must_agree(http):
    message = _openai_error(_chat(http, max_tokens=3, max_completion_tokens=5), "max_tokens")
    assert "max_completion_tokens" in message
    same = _chat(http, max_tokens=3, max_completion_tokens=3, temperature=0, ignore_eos=True)
    assert same.status_code == 200 and same.json()["usage"]["completion_tokens"] == 3


def test_openai_best_of_equal_to_n_returns_the_n_sequences(http):
    body = {"model": GEN, "prompt": "hello there", "max_tokens": 4, "seed": 9, "n": 2, "ignore_eos": True}
    plain = http.post("/v1/completions", json=body).json()
    best = http.post("/v1/completions", json={**body, "best_of": 2}).json()
    assert [c["text"] for c in best["choices"]] == [c["text"] for c in plain["choices"]]
    assert len(best["choices"]) == 2 and best["usage"] == plain["usage"]
    one = http.post("/v1/completions", json={**body, "n": 1, "best_of": 1}).json()
    assert len(one["choices"]) == 1
    assert "not supported" in _openai_error(http.post("/v1/completions", json={**body, "best_of": 3}), "best_of")
    assert "at least n" in _openai_error(http.post("/v1/completions", json={**body, "best_of": 1}), "best_of")


# ============================================================================================
# gRPC metadata over 16 KiB
# ============================================================================================
def test_grpc_metadata_over_16_kib_is_resource_exhausted(grpc_channel):
    """grpc core's own check (soft limit = hard limit = 16 KiB, so nothing in between is rejected
    at random): RESOURCE_EXHAUSTED "received metadata size exceeds hard limit (...vs. 16384)"."""
    assert MAX_METADATA_BYTES == 16 * 1024
    stub = spb_grpc.SglangSchedulerStub(grpc_channel)
    for _ in range(5):  # under the default soft limit (8 KiB), 8..16 KiB failed at random
        assert stub.HealthCheck(spb.HealthCheckRequest(), metadata=(("x-big", "m" * 15 * 1024),), timeout=10)
    for metadata in ((("x-big", "m" * 17 * 1024),), tuple((f"x-k{i}", "m" * 1024) for i in range(17))):
        with pytest.raises(grpc.RpcError) as e:
            stub.HealthCheck(spb.HealthCheckRequest(), metadata=metadata, timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "received metadata size exceeds hard limit" in e.value.details()
        assert "vs. 16384" in e.value.details()
    assert stub.HealthCheck(spb.HealthCheckRequest(), timeout=10).healthy
