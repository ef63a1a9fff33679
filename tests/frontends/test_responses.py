"""/v1/responses (OpenAI Responses API, stateless) with the official `openai` client, against the
full HTTP app over the shared warmed engine; the mid-stream error path on the fake engine.

Every test on the real engine also checks that nothing compiled after warmup.
"""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.helpers.shared import GEN, hold_requests_open, wait_for

openai = pytest.importorskip("openai")

CHAT = [{"role": "user", "content": "hello there"}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}


@pytest.fixture(scope="module")
def oai(http_url):
    return openai.OpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(autouse=True)
def no_compiles(request):
    if "oai" not in request.fixturenames and "http_url" not in request.fixturenames:
        yield
        return
    engine = request.getfixturevalue("serving_engine")
    before = engine.compilations_after_warmup()
    yield
    assert engine.compilations_after_warmup() == before


def _events(stream) -> list[Any]:
    return list(stream)


def _check_stream(events: list[Any]) -> Any:
    """The event order the official client expects; returns the final response."""
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"], types
    assert types[-1] in ("response.completed", "response.incomplete"), types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.id == events[0].response.id
    # every item opens and closes in order; text deltas sit inside their content part
    open_item = None
    texts: dict[str, str] = {}
    args: dict[str, str] = {}
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert open_item is None
            open_item = e.item.id
        elif e.type == "response.output_item.done":
            assert e.item.id == open_item
            open_item = None
        elif e.type == "response.output_text.delta":
            assert e.item_id == open_item
            texts[e.item_id] = texts.get(e.item_id, "") + e.delta
        elif e.type == "response.output_text.done":
            assert e.text == texts.get(e.item_id, "")
        elif e.type == "response.function_call_arguments.delta":
            args[e.item_id] = args.get(e.item_id, "") + e.delta
        elif e.type == "response.function_call_arguments.done":
            assert e.arguments == args[e.item_id]
    assert open_item is None
    for item in final.output:
        if item.type == "message":
            assert item.content[0].text == texts.get(item.id, "")
        else:
            assert item.arguments == args[item.id]
    return final


# ------------------------------------------------------------------------------------ plain text


def test_text_input(oai):
    r = oai.responses.create(model=GEN, input="hello there", max_output_tokens=4, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == GEN
    assert r.status in ("completed", "incomplete") and r.store is False
    assert isinstance(r.output_text, str)
    msg = r.output[0]
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 4
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.temperature == 0 and r.top_p == 1 and r.max_output_tokens == 4 and r.tools == []


def test_same_prompt_and_text_as_chat(oai):
    """instructions + message items render exactly like the equivalent chat request."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and now?"}]
    chat = oai.chat.completions.create(model=GEN, messages=messages, max_completion_tokens=6, temperature=0)
    r = oai.responses.create(
        model=GEN, instructions="be brief", max_output_tokens=6, temperature=0,
        input=[{"role": "user", "content": "hi"},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "and now?"}]}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content
    assert r.instructions == "be brief"
    # the developer role is a system message, as on the chat route
    dev = oai.responses.create(model=GEN, max_output_tokens=6, temperature=0,
                               input=[{"role": "developer", "content": "be brief"}] + messages[1:])
    assert dev.output_text == r.output_text


def test_max_output_tokens_makes_it_incomplete(oai):
    r = oai.responses.create(model=GEN, input="the quick brown fox", max_output_tokens=2, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2 and r.output[0].status == "incomplete"


def test_stream_matches_the_plain_response(oai):
    plain = oai.responses.create(model=GEN, input="hello there", max_output_tokens=6, temperature=0)
    events = _events(oai.responses.create(model=GEN, input="hello there", max_output_tokens=6, temperature=0,
                                          stream=True))
    types = [e.type for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    tail = [t for t in types if t != "response.output_text.delta"][4:]
    assert tail == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                    f"response.{plain.status}"]
    final = _check_stream(events)
    assert final.output_text == plain.output_text and final.status == plain.status
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text


def test_stream_helper_accumulates(oai):
    """The client's `responses.stream` helper checks item identities and rebuilds the response."""
    with oai.responses.stream(model=GEN, input="hello there", max_output_tokens=5, temperature=0) as stream:
        events = list(stream)
        # the helper gives a final response only for response.completed (as for OpenAI's own)
        final = stream.get_final_response() if events[-1].type == "response.completed" else events[-1].response
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(deltas) == final.output_text and final.output[0].type == "message"


# ------------------------------------------------------------------------------------ structured output


def test_text_format_json_schema(oai):
    jsonschema = pytest.importorskip("jsonschema")
    for stream in (False, True):
        kwargs = dict(model=GEN, input="is it ok?", max_output_tokens=32, temperature=0,
                      text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}})
        if stream:
            r = _check_stream(_events(oai.responses.create(stream=True, **kwargs)))
        else:
            r = oai.responses.create(**kwargs)
        assert r.status == "completed", r.output_text
        jsonschema.validate(json.loads(r.output_text), SCHEMA)
        assert r.text.format.type == "json_schema" and r.text.format.name == "answer"
    r = oai.responses.create(model=GEN, input="an object", max_output_tokens=48, temperature=0,
                             text={"format": {"type": "json_object"}})
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)
    else:
        assert r.output_text.startswith("{")


# ------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("kwargs, param", [
    (dict(store=True), "store"),
    (dict(previous_response_id="resp_123"), "previous_response_id"),
    (dict(conversation="conv_1"), "conversation"),
    (dict(background=True), "background"),
    (dict(include=["message.output_text.logprobs"]), "include"),
    (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
    (dict(extra_body={"frobnicate": 1}), "frobnicate"),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input[0].type"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input[0].content[0].type"),
    (dict(input=[{"role": "tool", "content": "x"}]), "input[0].role"),
    (dict(max_output_tokens=10**6), "max_output_tokens"),
    (dict(text={"format": {"type": "json_schema", "name": "x"}}), "text.format.schema"),
    (dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}), "text.format"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "name": "nope"}), "tool_choice.name"),
])
def test_refused_by_name(oai, kwargs, param):
    kwargs.setdefault("input", "hi")
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=GEN, max_output_tokens=kwargs.pop("max_output_tokens", 2), **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert param.split("[")[0].split(".")[0] in e.value.body["message"]


def test_store_false_is_accepted(oai):
    r = oai.responses.create(model=GEN, input="hi", store=False, max_output_tokens=2, metadata={"k": "v"})
    assert r.store is False and r.metadata == {"k": "v"}


def test_unknown_model_is_404(oai):
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="missing", input="hi")


def test_stream_disconnect_aborts_the_request(http_url, serving_engine, monkeypatch):
    # the request must still be running when the hang-up is seen: the Responses API samples at
    # temperature 1 and has no ignore_eos (hold_requests_open: why)
    hold_requests_open(serving_engine, GEN, monkeypatch)
    before = serving_engine.counters.snapshot()

    def settled() -> bool:
        snap = serving_engine.counters.snapshot()
        in_flight = snap["accepted"] - snap["completed"] - snap["errored"] - snap["cancelled"]
        return snap["cancelled"] > before["cancelled"] and in_flight == 0

    with httpx.Client(base_url=http_url, timeout=60) as c:
        with c.stream("POST", "/v1/responses", json={"input": "hello", "max_output_tokens": 240, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and "output_text.delta" in line:
                    break  # one delta, then hang up
    assert wait_for(settled, 20), serving_engine.counters.snapshot()


# ------------------------------------------------------------------------------------ mid-stream error (fake engine)


def test_error_mid_stream_sends_error_then_failed():
    from fastapi.testclient import TestClient

    from frontends.http.app import create_app
    from jax_engine.types import GenerateOutput
    from tests.helpers.fake_engine import FakeEngine

    class Failing(FakeEngine):
        async def generate(self, req):  # one token, then the engine fails
            yield GenerateOutput(request_id=req.request_id, new_token_ids=[80], new_text="M", prompt_tokens=3,
                                 completion_tokens=1)
            yield GenerateOutput(request_id=req.request_id, finished=True, finish_reason="error",
                                 error="the model step failed", error_kind="internal", prompt_tokens=3,
                                 completion_tokens=1)

    with TestClient(create_app(Failing())) as client:
        r = client.post("/v1/responses", json={"input": "hi", "stream": True})
        assert r.status_code == 200
        frames = [f for f in r.text.split("\n\n") if f]
        kinds = [f.split("\n")[0].removeprefix("event: ") for f in frames]
        data = [json.loads(f.split("\n")[1].removeprefix("data: ")) for f in frames]
        assert [d["type"] for d in data] == kinds
        assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta", "error", "response.failed"]
        assert data[-2]["message"] == "the model step failed" and data[-2]["code"] == "internal"
        assert data[-1]["response"]["status"] == "failed" and data[-1]["response"]["error"]["code"] == "server_error"
        r = client.post("/v1/responses", json={"input": "hi"})
        assert r.status_code == 500 and r.json()["error"]["message"] == "the model step failed"


# ------------------------------------------------------------------------------------ function tools (real engine)


def _calls(r) -> list[Any]:
    return [i for i in r.output if i.type == "function_call"]


def test_tool_choice_required(oai):
    r = oai.responses.create(model=GEN, input="weather in Oslo?", tools=[WEATHER, TIME], tool_choice="required",
                             parallel_tool_calls=False, max_output_tokens=64, temperature=0)
    assert r.status == "completed", r.output
    (call,) = _calls(r)
    assert call.name in ("get_weather", "get_time") and call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments), dict) and call.status == "completed"
    assert r.tool_choice == "required" and r.parallel_tool_calls is False
    assert [t.name for t in r.tools] == ["get_weather", "get_time"]


def test_tool_choice_named_streamed_and_not(oai):
    jsonschema = pytest.importorskip("jsonschema")
    kwargs = dict(model=GEN, input="weather in Oslo?", tools=[WEATHER, TIME], max_output_tokens=64, temperature=0,
                  tool_choice={"type": "function", "name": "get_weather"})
    r = oai.responses.create(**kwargs)
    (call,) = _calls(r)
    assert call.name == "get_weather" and r.output_text == ""
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = _events(oai.responses.create(stream=True, **kwargs))
    final = _check_stream(events)
    (streamed,) = _calls(final)
    assert streamed.arguments == call.arguments and streamed.name == "get_weather"
    types = [e.type for e in events]
    assert types[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert "response.function_call_arguments.delta" in types and "response.output_text.delta" not in types
    # the conversation continues with the call and its output as input items (as the client returns them)
    follow = oai.responses.create(model=GEN, max_output_tokens=4, temperature=0, tools=[WEATHER], tool_choice="none",
                                  input=[{"role": "user", "content": "weather in Oslo?"}, *r.output,
                                         {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert [i.type for i in follow.output] == ["message"] and follow.usage.input_tokens > r.usage.input_tokens


def test_tool_choice_auto_needs_a_server_parser(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=GEN, input="hi", tools=[WEATHER], max_output_tokens=2)
    assert e.value.body["param"] == "tools" and "--tool-call-parser" in e.value.body["message"]
    r = oai.responses.create(model=GEN, input="hi", tools=[WEATHER], tool_choice="none", max_output_tokens=2)
    assert not _calls(r) and r.tool_choice == "none"


# ------------------------------------------------------------------------------------ parsers (canned answers)


def _canned_client(answer: str, **parsers):
    from fastapi.testclient import TestClient

    from frontends.http.app import create_app
    from jax_engine.types import GenerateOutput
    from tests.helpers.fake_engine import FakeEngine, FakeTokenizer

    class Tokenizer(FakeTokenizer):
        def apply_chat_template(self, conversation, tokenize=True, add_generation_prompt=False, **kwargs):
            self.seen = {"messages": conversation, **kwargs}
            return super().apply_chat_template([dict(m, content=m["content"] or "") for m in conversation],
                                               tokenize, add_generation_prompt)

    class Canned(FakeEngine):
        def __init__(self):
            super().__init__()
            self._tokenizer = Tokenizer()

        async def generate(self, req):
            pieces = [answer[i:i + 3] for i in range(0, len(answer), 3)]
            for k, p in enumerate(pieces):
                last = k == len(pieces) - 1
                yield GenerateOutput(request_id=req.request_id, new_token_ids=[3], new_text=p, finished=last,
                                     finish_reason="stop" if last else None, prompt_tokens=4, completion_tokens=k + 1)

    engine = Canned()
    return TestClient(create_app(engine, **parsers)), engine


def _sse_events(client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ")]


def _strip_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]


def test_auto_tool_calls_and_reasoning_become_items():
    answer = ('<think>the user wants weather</think>Let me check.<tool_call>{"name": "get_weather", "arguments": '
              '{"city": "Oslo"}}</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    client, engine = _canned_client(answer, tool_call_parser="hermes", reasoning_parser="qwen3")
    body = {"input": [{"role": "user", "content": "weather?"}], "tools": [WEATHER, TIME]}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    out = r.json()["output"]
    assert [i["type"] for i in out] == ["reasoning", "message", "function_call", "function_call"]
    assert out[0]["content"] == [{"type": "reasoning_text", "text": "the user wants weather"}]
    assert out[1]["content"][0]["text"] == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in out[2:]] == [("get_weather", {"city": "Oslo"}),
                                                                         ("get_time", {})]
    # the chat template saw the tools in chat's shape
    assert [t["function"]["name"] for t in engine._tokenizer.seen["tools"]] == ["get_weather", "get_time"]
    events = _sse_events(client, body)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call", "function_call"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "the user wants weather"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Let me check."
    assert _strip_ids(events[-1]["response"]["output"]) == _strip_ids(out)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == events[-1]["response"]["output"]
    # strict validation with the client's own models (the client itself only constructs them)
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    Response.model_validate(r.json())
    adapter = TypeAdapter(ResponseStreamEvent)
    for e in events:
        adapter.validate_python(e)


def test_input_items_render_as_chat_tool_turns():
    client, engine = _canned_client("ok", tool_call_parser="hermes")
    body = {"instructions": "be brief", "tools": [WEATHER], "input": [
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]}]}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    msgs = engine._tokenizer.seen["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool"]
    assert msgs[2]["reasoning_content"] == "hmm"
    assert [c["function"]["arguments"] for c in msgs[2]["tool_calls"]] == [{"city": "Oslo"}, {"city": "Rome"}]
    assert [(m["tool_call_id"], m["content"]) for m in msgs[3:]] == [("call_1", "sunny"), ("call_2", "rain")]
    bad = dict(body, input=[{"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{oops"}])
    r = client.post("/v1/responses", json=bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].arguments"
