"""OpenAI-compatible routes over a real socket against the real engine (tiny demo Llama + MiniLM)."""
from __future__ import annotations

import base64
import contextlib
import json
import threading

import httpx
import numpy as np
import pytest

from tests.helpers.engines import engine_greedy
from tests.helpers.shared import EMBED, GEN, HTTP_API_KEY, hold_requests_open, wait_for

PROMPT_IDS = [1, 40, 41, 42, 43, 44, 45, 46]
CHAT = [{"role": "user", "content": "hello world"}]


def sse_events(response: httpx.Response) -> list:
    """`data:` payloads of an SSE response, parsed; the literal "[DONE]" kept as a string."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_error(r: httpx.Response, status: int, param: str | None = None, text: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param or param in err["message"], err
    if text is not None:
        assert text in err["message"], err
    return err


# ---------------------------------------------------------------------------------- models
def test_models_lists_every_model_and_labels_the_demo_as_random(client):
    r = client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    cards = {m["id"]: m for m in body["data"]}
    assert set(cards) == {GEN, EMBED}
    assert cards[GEN]["owned_by"] == "xlaserve-demo-random-weights" and cards[GEN]["random_weights"] is True
    assert cards[EMBED]["owned_by"] == "xlaserve" and cards[EMBED]["random_weights"] is False
    assert all(m["object"] == "model" for m in cards.values())
    assert client.get(f"/v1/models/{EMBED}").json()["id"] == EMBED
    assert_error(client.get("/v1/models/nope"), 404, "model")


# ---------------------------------------------------------------------------------- completions
def test_completion_greedy_equals_engine_and_reports_usage(client, server_loop, serving_engine):
    expected = engine_greedy(server_loop, serving_engine, PROMPT_IDS, 6)
    r = client.post("/v1/completions", json={"model": GEN, "prompt": PROMPT_IDS, "max_tokens": 6,
                                             "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == GEN and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    tok = serving_engine.tokenizer(GEN)
    assert choice["text"] == tok.decode(expected, skip_special_tokens=True)
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    assert body["usage"]["prompt_tokens"] == len(PROMPT_IDS)
    assert body["usage"]["completion_tokens"] == 6
    assert body["usage"]["total_tokens"] == len(PROMPT_IDS) + 6
    assert "cached_tokens" in body["usage"]["prompt_tokens_details"]


def test_completion_stream_matches_non_stream(client):
    req = {"prompt": "the quick brown fox", "max_tokens": 7, "temperature": 0, "ignore_eos": True}
    whole = client.post("/v1/completions", json=req).json()
    with client.stream("POST", "/v1/completions",
                       json={**req, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == whole["choices"][0]["text"]
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finals == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 7
    assert all(c["usage"] is None for c in chunks[:-1])


def test_completion_batch_of_token_prompts_with_n(client):
    prompts = [PROMPT_IDS, PROMPT_IDS[:5]]
    r = client.post("/v1/completions", json={"prompt": prompts, "n": 2, "max_tokens": 3, "ignore_eos": True,
                                             "seed": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    # prompt tokens count once per prompt, completion tokens once per sequence
    assert body["usage"]["prompt_tokens"] == len(PROMPT_IDS) + 5
    assert body["usage"]["completion_tokens"] == 4 * 3


def test_completion_logprobs(client):
    r = client.post("/v1/completions", json={"prompt": PROMPT_IDS, "max_tokens": 4, "temperature": 0,
                                             "ignore_eos": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 4
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert 2 <= len(top) <= 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the best
    assert lp["text_offset"] == sorted(lp["text_offset"])


def test_completion_stop_token_ids_and_stop_reason(client, server_loop, serving_engine):
    greedy = engine_greedy(server_loop, serving_engine, PROMPT_IDS, 6)
    stop_id = greedy[3]
    r = client.post("/v1/completions", json={"prompt": PROMPT_IDS, "max_tokens": 6, "temperature": 0,
                                             "stop_token_ids": [stop_id]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id
    assert r.json()["usage"]["completion_tokens"] <= 4


def test_seed_makes_sampling_reproducible(client):
    req = {"prompt": "hello", "max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 1234,
           "ignore_eos": True, "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
           "min_p": 0.01, "logit_bias": {"45": 5.0}, "min_tokens": 2, "skip_special_tokens": True}
    a = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    b = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    assert a == b


# ---------------------------------------------------------------------------------- chat
def test_chat_non_stream_uses_the_chat_template(client, server_loop, serving_engine):
    tok = serving_engine.tokenizer(GEN)
    ids = tok.encode(tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    expected = engine_greedy(server_loop, serving_engine, ids, 5)
    r = client.post("/v1/chat/completions", json={"model": GEN, "messages": CHAT, "max_completion_tokens": 5,
                                                  "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": tok.decode(expected, skip_special_tokens=True)}
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 5


def test_chat_stream_role_first_then_content_then_done(client):
    req = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    whole = client.post("/v1/chat/completions", json=req).json()["choices"][0]["message"]["content"]
    with client.stream("POST", "/v1/chat/completions", json={**req, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:]) == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in chunks[0]


def test_chat_logprobs_and_n(client):
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "n": 2, "logprobs": True,
                                                  "top_logprobs": 2, "ignore_eos": True, "seed": 5})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for c in choices:
        content = c["logprobs"]["content"]
        assert len(content) == 3
        for entry in content:
            assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
            assert len(entry["top_logprobs"]) == 2
            assert entry["bytes"] == list(entry["token"].encode())


def test_chat_content_parts_and_developer_role(client):
    msgs = [{"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}]
    assert client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}).status_code == 200
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://169.254.169.254/"}}]}]
    assert_error(client.post("/v1/chat/completions", json={"messages": image}), 400, "messages[0].content[0].type")


# ---------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("route,field,value", [
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "tool_choice", "required"),
    ("/v1/chat/completions", "response_format", {"type": "xml"}),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "audio", {"voice": "alloy"}),
    ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "chat_template", "{{ 'x' }}"),
    ("/v1/completions", "best_of", 3),
    ("/v1/completions", "echo", True),
    ("/v1/completions", "suffix", "tail"),
    ("/v1/completions", "guided_json", {"type": "object"}),
])
def test_unsupported_fields_are_refused_by_name(client, route, field, value):
    body = {"messages": CHAT} if "chat" in route else {"prompt": "hi"}
    assert_error(client.post(route, json={**body, field: value, "max_tokens": 2}), 400, field)


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2**63}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 10**6}, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -5}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 100}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**6]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**6]}, "prompt"),
    ("/v1/completions", {"prompt": [1, -1]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 20}, "top_logprobs"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": ["a", ""]}, "input"),
    ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "a", "dimensions": 100}, "dimensions"),
    ("/v1/embeddings", {"input": [[1, 2], [10**7]]}, "input"),
])
def test_bad_fields_are_400_naming_the_field(client, route, body, param):
    assert_error(client.post(route, json=body), 400, param)


def test_nan_and_malformed_json_are_400(client):
    for raw in (b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "top_p": Infinity}', b'{"prompt": ',
                b'[1, 2]', b'"just a string"', b'\xff\xfe{}'):
        r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert_error(r, 400)


def test_prompt_over_the_context_is_400_quoting_the_limit(client):
    r = client.post("/v1/completions", json={"prompt": [5] * 300, "max_tokens": 1})
    err = assert_error(r, 400)
    assert "300" in err["message"] and "255" in err["message"]


def test_unknown_model_is_404(client):
    for route, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT}),
                        ("/v1/embeddings", {"input": "hi"})):
        assert_error(client.post(route, json={**body, "model": "no-such-model"}), 404, "model")


def test_embedding_model_cannot_generate(client):
    assert_error(client.post("/v1/completions", json={"prompt": "hi", "model": EMBED}), 400)


@contextlib.contextmanager
def queue_bound(engine, n: int):
    """Shrink the engine's waiting-queue bound for a moment (the workers read it per request)."""
    saved = engine.args.max_waiting_requests
    engine.args.max_waiting_requests = n
    try:
        yield
    finally:
        engine.args.max_waiting_requests = saved


def test_full_queue_is_429_with_retry_after(client, serving_engine):
    with queue_bound(serving_engine, 0):
        r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
        rs = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
    for resp in (r, rs):
        err = assert_error(resp, 429)
        assert err["type"] == "rate_limit_error"
        assert int(resp.headers["retry-after"]) >= 1
    # and the server is fine afterwards
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


# ---------------------------------------------------------------------------------- embeddings
def test_embeddings_every_input_shape_and_both_encodings(client, serving_engine):
    texts = ["a man is eating food.", "the weather is nice today."]
    r = client.post("/v1/embeddings", json={"model": EMBED, "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == EMBED
    assert [d["index"] for d in body["data"]] == [0, 1] and all(d["object"] == "embedding" for d in body["data"])
    vecs = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    assert vecs.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-4)  # MiniLM normalizes
    assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"]

    b64 = client.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64", "dimensions": 384}).json()
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in b64["data"]])
    np.testing.assert_allclose(decoded, vecs, atol=1e-6)

    single = client.post("/v1/embeddings", json={"input": texts[0]}).json()
    np.testing.assert_allclose(single["data"][0]["embedding"], vecs[0], atol=1e-5)

    ids = serving_engine.tokenizer(EMBED)(texts[0])["input_ids"]
    by_ids = client.post("/v1/embeddings", json={"input": ids}).json()
    np.testing.assert_allclose(by_ids["data"][0]["embedding"], vecs[0], atol=1e-4)
    by_id_lists = client.post("/v1/embeddings", json={"input": [ids, ids[:4]]}).json()
    assert len(by_id_lists["data"]) == 2


# ---------------------------------------------------------------------------------- disconnects
def _settled(engine, before: dict) -> bool:
    snap = engine.counters.snapshot()
    in_flight = snap["accepted"] - snap["completed"] - snap["errored"] - snap["cancelled"]
    return snap["cancelled"] > before["cancelled"] and in_flight == 0 and engine.stats(GEN).running_requests == 0


def test_stream_client_disconnect_aborts_the_request(http_url, serving_engine):
    before = serving_engine.counters.snapshot()
    with httpx.Client(base_url=http_url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "hello", "max_tokens": 240, "ignore_eos": True,
                                                       "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # one chunk, then hang up
    assert wait_for(lambda: _settled(serving_engine, before), 20), serving_engine.counters.snapshot()


def test_non_stream_client_disconnect_aborts_the_request(http_url, serving_engine, monkeypatch):
    # the request is still running when the client gives up at 0.3 s (hold_requests_open)
    hold_requests_open(serving_engine, GEN, monkeypatch)
    before = serving_engine.counters.snapshot()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{http_url}/v1/completions", json={"prompt": "hello", "max_tokens": 240, "ignore_eos": True},
                   timeout=0.3)
    assert wait_for(lambda: _settled(serving_engine, before), 20), serving_engine.counters.snapshot()


# ---------------------------------------------------------------------------------- official client
@pytest.fixture(scope="module")
def oai(http_url):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0)


def test_openai_client_chat_and_stream(oai):
    out = oai.chat.completions.create(model=GEN, messages=CHAT, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    stream = oai.chat.completions.create(model=GEN, messages=CHAT, max_tokens=4, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 4


def test_openai_client_completions_and_stream(oai):
    out = oai.completions.create(model=GEN, prompt="hello", max_tokens=4, temperature=0, logprobs=1,
                                 extra_body={"ignore_eos": True})
    assert len(out.choices[0].logprobs.tokens) == 4
    text = "".join(c.choices[0].text for c in oai.completions.create(
        model=GEN, prompt="hello", max_tokens=4, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert text == out.choices[0].text


def test_openai_client_embeddings_and_models(oai):
    res = oai.embeddings.create(model=EMBED, input=["hello", "world"])  # the client asks for base64
    assert len(res.data) == 2 and len(res.data[0].embedding) == 384
    assert {m.id for m in oai.models.list()} == {GEN, EMBED}


def test_openai_client_error_classes(oai, secured_http_url):
    import openai

    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=GEN, messages=CHAT, tools=[{"type": "function",
                                                                       "function": {"name": "f"}}])
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="missing", messages=CHAT)
    bad_key = openai.OpenAI(base_url=f"{secured_http_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    good_key = openai.OpenAI(base_url=f"{secured_http_url}/v1", api_key=HTTP_API_KEY, max_retries=0)
    assert {m.id for m in good_key.models.list()} == {GEN, EMBED}


def test_concurrent_streams_do_not_disturb_each_other(http_url):
    results: dict[int, str] = {}

    def run(i: int) -> None:
        with httpx.Client(base_url=http_url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": PROMPT_IDS, "max_tokens": 5, "temperature": 0,
                                                           "ignore_eos": True, "stream": True}) as r:
                results[i] = "".join(e["choices"][0]["text"] for e in sse_events(r)[:-1] if e["choices"])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 4 and len(set(results.values())) == 1


def test_sse_events_survive_clients_that_split_on_unicode_line_breaks():
    """Generated text may hold U+2028 / U+2029 / U+0085, which str.splitlines() (httpx's
    iter_lines) treats as line breaks although SSE does not: they go out escaped, one event per
    line for every client, and the JSON still decodes to the same text."""
    from frontends.http.openai import _sse

    text = "a\u2028b\u0085c\u2029d é\n"
    frame = _sse({"choices": [{"delta": {"content": text}}]}).decode()
    lines = [ln for ln in frame.splitlines() if ln]        # the event, then SSE's blank separator
    assert lines == [frame.split("\n")[0]] and frame.endswith("\n\n")
    assert json.loads(lines[0][len("data: "):])["choices"][0]["delta"]["content"] == text
