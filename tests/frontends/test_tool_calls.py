"""Tool calling and reasoning on the chat route, without a model: the parsers on canned answers,
streaming assembly, tool choice -> constraint, refusals, and what the chat template receives.

The route-level tests run the real app over `FakeEngine` whose generator answers a canned text
(the only place a forced answer is used: it tests the parsers, not the model).
"""
from __future__ import annotations

import json
import re
from typing import Any, AsyncGenerator, Optional

import pytest
from fastapi.testclient import TestClient

from frontends.http.app import create_app
from frontends.http.reasoning import ReasoningSplitter, prompt_opens_thinking, split_reasoning, template_kwargs
from frontends.http.tool_calls import (
    ChatOutput,
    ToolPlan,
    forced_of,
    function_tools,
    parse_tool_calls,
    plan_tools,
    tool_choice_constraint,
)
from jax_engine.errors import InvalidRequest
from jax_engine.types import FunctionTool, GenerateOutput, GenerateRequest
from tests.helpers.fake_engine import FAKE_GEN, FakeEngine, FakeTokenizer

ID = re.compile(r"^call_[0-9a-f]{24}$")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
             "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
USER = [{"role": "user", "content": "weather in Oslo?"}]


def _calls(calls) -> list[tuple[str, Any]]:
    for c in calls:
        assert ID.match(c.id), c.id
    return [(c.name, json.loads(c.arguments)) for c in calls]


# ============================================================================================
# parsers on canned answers
# ============================================================================================
HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "add", "parameters": {"a": 1}}'
MISTRAL = 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "add", "arguments": {}}]'


@pytest.mark.parametrize("parser,text,content,calls", [
    ("hermes", HERMES, "Let me check.", [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})]),
    ("hermes", "no tools here", "no tools here", []),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}}', "", [("add", {"a": 1})]),  # unclosed at EOS
    ("hermes", "<tool_call>not json</tool_call> tail", "<tool_call>not json</tool_call> tail", []),
    ("hermes", '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3}"}</tool_call>', "", [("add", {"a": 3})]),
    ("llama3_json", LLAMA, "", [("get_weather", {"city": "Oslo"}), ("add", {"a": 1})]),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}}', "", [("add", {"a": 1})]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", "It is sunny.", "It is sunny.", []),
    ("llama3_json", '{"name": "f", "parameters": {"s": "a;b"}}', "", [("f", {"s": "a;b"})]),
    ("mistral", MISTRAL, "Sure.", [("get_weather", {"city": "Oslo"}), ("add", {})]),
    ("mistral", "[TOOL_CALLS] [broken", "[TOOL_CALLS] [broken", []),
    ("mistral", "plain answer", "plain answer", []),
])
def test_auto_parsers(parser, text, content, calls):
    got_content, got = parse_tool_calls(text, parser, None)
    assert got_content.strip() == content and _calls(got) == calls


def test_forced_outputs_parse_without_a_parser():
    content, calls = parse_tool_calls('[{"name": "add", "parameters": {"a": 1}}, {"name": "get_weather", '
                                      '"parameters": {"city": "x"}}]', None, "required")
    assert content == "" and _calls(calls) == [("add", {"a": 1}), ("get_weather", {"city": "x"})]
    content, calls = parse_tool_calls('{"city": "Oslo"}', None, "get_weather")
    assert content == "" and _calls(calls) == [("get_weather", {"city": "Oslo"})]
    # cut off before the first call was complete: the raw text stays content
    assert parse_tool_calls('[{"name": "ad', None, "required") == ('[{"name": "ad', [])


def _stream(out: ChatOutput, text: str, step: int) -> list[dict[str, Any]]:
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    return [out.step(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]


def _assemble(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """What an OpenAI client builds from the deltas."""
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert tc["type"] == "function" and c["id"] is None
                c["id"], c["name"] = tc["id"], tc["function"]["name"]
            c["arguments"] += tc["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return {"content": content, "reasoning": reasoning, "calls": [calls[i] for i in sorted(calls)]}


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
@pytest.mark.parametrize("parser,text,forced,reasoning", [
    ("hermes", "<think>hmm, weather</think>\n\n" + HERMES, None, "qwen3"),
    ("hermes", "plain <tool_call answer", None, None),
    ("llama3_json", LLAMA, None, None),
    ("llama3_json", "It is sunny.", None, "deepseek_r1"),
    ("mistral", MISTRAL, None, None),
    (None, '[{"name": "add", "parameters": {"a": 1}}, {"name": "add", "parameters": {"a": 2}}]', "required", "qwen3"),
    (None, '{"city": "Oslo"}', "get_weather", "deepseek_r1"),
])
def test_streamed_deltas_assemble_to_the_unstreamed_message(parser, text, forced, reasoning, step):
    plan = ToolPlan(parser=parser, forced=forced)
    msg = ChatOutput(plan=plan, reasoning_parser=reasoning).message(text)
    got = _assemble(_stream(ChatOutput(plan=plan, reasoning_parser=reasoning), text, step))
    want_calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"]] == want_calls
    assert got["content"].strip() == (msg["content"] or "").strip()
    assert (got["reasoning"] or None) == msg.get("reasoning_content")
    if reasoning and forced is None:
        assert "reasoning_content" in msg


def test_plain_content_streams_and_only_a_possible_call_is_held():
    out = ChatOutput(plan=ToolPlan(parser="hermes"))
    assert out.step("Hello ") == {"content": "Hello"}          # trailing whitespace waits for more text
    assert out.step("world <tool") == {"content": " world"}
    assert out.step('_call>{"name": "add", ') == {}
    d = out.step('"arguments": {}}</tool_call>')
    assert d["tool_calls"][0]["function"] == {"name": "add", "arguments": "{}"} and d["tool_calls"][0]["index"] == 0
    assert out.step("", final=True) == {}


def test_named_function_streams_argument_fragments():
    out = ChatOutput(plan=ToolPlan(forced="add"))
    first = out.step('{"a"')
    assert first["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    assert first["tool_calls"][1] == {"index": 0, "function": {"arguments": '{"a"'}}
    assert out.step(": 1}", final=True) == {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}
    assert out.calls[0].arguments == '{"a": 1}'


def test_parallel_tool_calls_false_keeps_the_first_call():
    msg = ChatOutput(plan=ToolPlan(parser="hermes", parallel=False)).message(HERMES)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]


# ============================================================================================
# reasoning
# ============================================================================================
@pytest.mark.parametrize("parser,text,opened,want", [
    ("qwen3", "<think>\nplan\n</think>\n\nanswer", False, ("\nplan\n", "answer")),
    ("qwen3", "answer only", False, (None, "answer only")),
    ("qwen3", "plan</think>answer", True, ("plan", "answer")),
    ("qwen3", "<think>cut off", False, ("cut off", "")),
    ("deepseek_r1", "plan</think>answer", False, ("plan", "answer")),
    ("deepseek_r1", "<think>plan</think>answer", False, ("plan", "answer")),
    ("deepseek_r1", "all reasoning", False, ("all reasoning", "")),
])
def test_reasoning_split(parser, text, opened, want):
    assert split_reasoning(text, parser, opened) == want
    s = ReasoningSplitter(parser, opened)
    pieces = [s.feed(ch) for ch in text] + [s.finish()]
    assert ("".join(p[0] for p in pieces) or None, "".join(p[1] for p in pieces)) == want


def test_prompt_opens_thinking():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_chat_template_kwargs_allowlist():
    assert template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}
    assert template_kwargs(None) == {}
    for bad, key in [({"tokenize": True}, "chat_template_kwargs.tokenize"),
                     ({"enable_thinking": "no"}, "chat_template_kwargs.enable_thinking"),
                     ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt")]:
        with pytest.raises(InvalidRequest) as e:
            template_kwargs(bad)
        assert e.value.param == key and key in e.value.message


# ============================================================================================
# tool choice -> constraint, refusals
# ============================================================================================
def test_tool_choice_constraint_mapping():
    tools = function_tools(TOOLS)
    assert tools[1] == FunctionTool("add", TOOLS[1]["function"]["parameters"])
    assert function_tools([{"type": "function", "function": {"name": "f"}}])[0].parameters["type"] == "object"
    assert tool_choice_constraint(tools, "auto", True) is None and tool_choice_constraint(tools, "none", True) is None
    req = json.loads(tool_choice_constraint(tools, "required", True).spec)
    assert req["type"] == "array" and req["minItems"] == 1 and "maxItems" not in req
    assert json.loads(tool_choice_constraint(tools, "required", False).spec)["maxItems"] == 1
    named = tool_choice_constraint(tools, {"type": "function", "function": {"name": "get_weather"}}, True)
    assert json.loads(named.spec) == WEATHER
    with pytest.raises(InvalidRequest) as e:
        tool_choice_constraint(tools, {"type": "function", "function": {"name": "nope"}}, True)
    assert e.value.param == "tool_choice" and "not among the tools" in e.value.message
    with pytest.raises(InvalidRequest) as e:
        tool_choice_constraint(tools + tools[:1], "required", True)
    assert e.value.param == "tools"
    assert forced_of("required") == "required" and forced_of({"type": "function", "function": {"name": "f"}}) == "f"
    assert forced_of("auto") is None and forced_of(None) is None


class _Body:
    def __init__(self, tools=None, tool_choice=None, parallel_tool_calls=None):
        self.tools, self.tool_choice, self.parallel_tool_calls = tools, tool_choice, parallel_tool_calls


@pytest.mark.parametrize("body,parser,param,text", [
    (_Body(TOOLS), None, "tools", "--tool-call-parser"),
    (_Body(TOOLS, "auto"), None, "tool_choice", "--tool-call-parser"),
    (_Body(None, "required"), "hermes", "tool_choice", "at least one tool"),
    (_Body(None, None, True), "hermes", "parallel_tool_calls", "tools"),
])
def test_plan_refusals(body, parser, param, text):
    with pytest.raises(InvalidRequest) as e:
        plan_tools(body, parser)
    assert e.value.param == param and text in e.value.message


def test_plans():
    assert not plan_tools(_Body(), None).active
    assert plan_tools(_Body(TOOLS, "none"), None).template_tools == TOOLS  # tools still reach the template
    assert not plan_tools(_Body(TOOLS, "none"), "hermes").active
    assert plan_tools(_Body(TOOLS), "hermes").parser == "hermes"
    p = plan_tools(_Body(TOOLS, "required", False), None)
    assert (p.forced, p.parallel, p.parser) == ("required", False, None)
    assert plan_tools(_Body(TOOLS, {"type": "function", "function": {"name": "add"}}), None).forced == "add"


# ============================================================================================
# the route over a canned answer
# ============================================================================================
class TemplateTokenizer(FakeTokenizer):
    """Records what the chat template gets."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def apply_chat_template(self, conversation, tokenize=True, add_generation_prompt=False, **kw):
        self.seen.append({"messages": conversation, **kw})
        text = "".join(f"{m['role']}: {m['content']}\n" for m in conversation)
        if add_generation_prompt:
            text += "assistant: " + ("<think>\n" if kw.get("enable_thinking") == "prompt" else "")
        return self.encode(text, add_special_tokens=False) if tokenize else text


class CannedEngine(FakeEngine):
    """Answers every request with `self.answer`, a few characters per event."""

    def __init__(self) -> None:
        super().__init__()
        self._tokenizer = TemplateTokenizer()
        self.answer = ""
        self.reason = "stop"
        self.requests: list[GenerateRequest] = []

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[GenerateOutput, None]:
        self.requests.append(req)
        pieces = [self.answer[i:i + 3] for i in range(0, len(self.answer), 3)] or [""]
        for k, p in enumerate(pieces):
            last = k == len(pieces) - 1
            yield GenerateOutput(request_id=req.request_id, new_token_ids=[3], new_text=p, finished=last,
                                 finish_reason=self.reason if last else None, prompt_tokens=4, completion_tokens=k + 1)


@pytest.fixture
def canned():
    return CannedEngine()


def _client(engine, tool_call_parser: Optional[str] = None, reasoning_parser: Optional[str] = None) -> TestClient:
    return TestClient(create_app(engine, tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser))


def _sse(client: TestClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


@pytest.mark.parametrize("parser,answer,content", [
    ("hermes", HERMES, "Let me check."),
    ("llama3_json", LLAMA, None),
    ("mistral", MISTRAL, "Sure."),
])
def test_route_auto_per_parser(canned, parser, answer, content):
    canned.answer = answer
    client = _client(canned, tool_call_parser=parser)
    r = client.post("/v1/chat/completions", json={"model": FAKE_GEN, "messages": USER, "tools": TOOLS})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == content
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert all(ID.match(c["id"]) and c["type"] == "function" for c in calls)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert canned._tokenizer.seen[-1]["tools"] == TOOLS
    assert canned.requests[-1].params.constraint is None
    assert canned.requests[-1].params.skip_special_tokens == (parser != "mistral")
    chunks = _sse(client, {"model": FAKE_GEN, "messages": USER, "tools": TOOLS})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    got = _assemble(deltas[1:])
    assert [c["name"] for c in got["calls"]] == ["get_weather", "add"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # no parsed call: the plain answer and "stop"
    canned.answer = "It is sunny."
    choice = client.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS}).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny."} and choice["finish_reason"] == "stop"


def test_route_forced_choices_set_the_constraint(canned):
    client = _client(canned)  # no parser needed
    canned.answer = '[{"name": "add", "parameters": {"a": 1, "b": 2}}]'
    r = client.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "tool_choice": "required",
                                                  "parallel_tool_calls": False})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "add"
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    c = canned.requests[-1].params.constraint
    assert c.kind == "json_schema" and json.loads(c.spec)["maxItems"] == 1
    canned.answer = '{"city": "Oslo"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "tool_choice": named})
    msg = r.json()["choices"][0]["message"]
    assert r.json()["choices"][0]["finish_reason"] == "stop"      # a named function: "stop", as OpenAI
    assert msg["content"] is None and msg["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                            "arguments": '{"city": "Oslo"}'}
    assert json.loads(canned.requests[-1].params.constraint.spec) == WEATHER
    # a truncated named call: as generated, finish_reason "length"
    canned.answer, canned.reason = '{"city": "Os', "length"
    choice = client.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS,
                                                       "tool_choice": named}).json()["choices"][0]
    assert choice["finish_reason"] == "length"


def test_route_tool_choice_none_keeps_tools_in_the_template_and_parses_nothing(canned):
    canned.answer = HERMES
    r = _client(canned, "hermes").post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS,
                                                                      "tool_choice": "none"})
    msg = r.json()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": HERMES} and canned._tokenizer.seen[-1]["tools"] == TOOLS


@pytest.mark.parametrize("extra,param", [
    ({"tools": TOOLS}, "tools"),                                                   # auto without a parser
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),                                  # no tools
    ({"parallel_tool_calls": True}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"},
     "tools[0].function.name"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
])
def test_route_refusals_name_the_field(canned, extra, param):
    r = _client(canned).post("/v1/chat/completions", json={"messages": USER, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param or param in err["message"], err


def test_tool_and_assistant_messages_reach_the_template(canned):
    canned.answer = "It is 20 degrees in Oslo."
    call = {"id": "call_" + "a" * 24, "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "look it up"},
                       {"role": "tool", "tool_call_id": call["id"], "content": "20 C"}]
    for parser, want_id in [("hermes", call["id"]), ("mistral", "a" * 9)]:
        r = _client(canned, parser).post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS})
        assert r.status_code == 200, r.text
        seen = canned._tokenizer.seen[-1]["messages"]
        assert seen[1]["tool_calls"] == [{"id": want_id, "type": "function",
                                          "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]
        assert seen[1]["reasoning_content"] == "look it up"
        assert seen[2] == {"role": "tool", "content": "20 C", "tool_call_id": want_id}
    for bad, param in [
        ({"role": "tool", "content": "x"}, "messages[1].tool_call_id"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[1].tool_call_id"),
        ({"role": "user", "content": "x", "tool_calls": [call]}, "messages[1].tool_calls"),
        ({"role": "assistant", "tool_calls": [{**call, "function": {"name": "f", "arguments": "{nope"}}]},
         "messages[1].tool_calls[0].function.arguments"),
    ]:
        r = _client(canned).post("/v1/chat/completions", json={"messages": USER + [bad]})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_route_reasoning(canned):
    client = _client(canned, reasoning_parser="qwen3")
    canned.answer = "<think>the user wants a greeting</think>\n\nHello!"
    r = client.post("/v1/chat/completions", json={"messages": USER, "chat_template_kwargs": {"enable_thinking": True}})
    msg = r.json()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "Hello!", "reasoning_content": "the user wants a greeting"}
    assert canned._tokenizer.seen[-1]["enable_thinking"] is True
    chunks = _sse(client, {"messages": USER})
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "the user wants a greeting"
    assert "".join(d.get("content", "") for d in deltas) == "Hello!"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # without the parser the think block is plain content
    plain = _client(canned).post("/v1/chat/completions", json={"messages": USER}).json()["choices"][0]["message"]
    assert plain == {"role": "assistant", "content": canned.answer}


def test_unknown_parser_names_are_refused_at_startup(canned):
    with pytest.raises(ValueError, match="tool call parser"):
        create_app(canned, tool_call_parser="pythonic")
    with pytest.raises(ValueError, match="reasoning parser"):
        create_app(canned, reasoning_parser="r2")


def test_mistral_keeps_special_tokens_and_drops_the_eos_text(canned):
    canned.answer = MISTRAL + "<eos>"
    canned._models[FAKE_GEN].eos_token_ids = [2]
    canned._tokenizer.decode = lambda ids: "<eos>" if ids == [2] else FakeTokenizer.decode(canned._tokenizer, ids)
    client = _client(canned, "mistral")
    choice = client.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS}).json()["choices"][0]
    assert choice["message"]["content"] == "Sure." and len(choice["message"]["tool_calls"]) == 2
    assert canned.requests[-1].params.skip_special_tokens is False
    canned.answer = "plain<eos>"
    assert client.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS}).json()[
        "choices"][0]["message"]["content"] == "plain"


def test_new_fields_are_documented(canned):
    schemas = create_app(canned).openapi()["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs"} <= set(chat)
    assert {"ChatTool", "FunctionDefinition", "NamedToolChoice", "MessageToolCall"} <= set(schemas)
    assert {"tool_calls", "tool_call_id", "reasoning_content"} <= set(schemas["ChatMessage"]["properties"])
