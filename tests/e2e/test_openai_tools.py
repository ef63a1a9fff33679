"""Tool calling and reasoning end to end: the official `openai` client against a real
`xlaserve serve --tool-call-parser hermes --reasoning-parser qwen3` process.

The model is the tiny random-weight demo decoder (so its compiled programs come from the
shared compilation cache) with a Qwen3-style chat template written here: tools rendered into the
system prompt, assistant `tool_calls` as `<tool_call>` blocks, `tool` messages as
`<tool_response>`, and the `enable_thinking` switch. Random weights answer nonsense, so:
- `required` and named choices must give parseable calls for every seed (the constraint makes
  them so), streamed and not;
- `auto` is driven by a structured-outputs constraint that makes the model write a hermes tool
  call (an ordinary API feature, no test hook), which the hermes parser must find;
- the reasoning split is driven the same way: a regex answer with a `<think>` block.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from tests.helpers.shared import ENGINE_FLAGS, wait_for, xlaserve

openai = pytest.importorskip("openai")

MODEL = "qwen-tools"
SEEDS = range(20)
ID = re.compile(r"^call_[0-9a-f]{24}$")

QWEN3_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\nCall one with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.content %}{{- message.content }}{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' + (tool_call.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}},
           "required": ["city"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                        "b": {"type": "boolean"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
USER = [{"role": "user", "content": "weather?"}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from jax_engine.models.demo import build_demo_generator

    path = build_demo_generator(str(tmp_path_factory.mktemp("models") / MODEL))
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(QWEN3_TEMPLATE)
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("chat_template", None)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    """`xlaserve serve` with the parsers, on free ports; yields its HTTP URL."""
    user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    env = {**os.environ, "XLASERVE_PROGRESS": "0", "XLASERVE_TOOL_CALL_PARSER": "hermes"}  # env mirror, too
    cmd = xlaserve() + ["serve", "--model", f"{MODEL}={model_dir}", "--grpc-port", "0", "--http-port", "0",
                        "--reasoning-parser", "qwen3",
                        "--compile-cache-dir", os.path.join(user_cache, "xlaserve", "jax_cache"),
                        *ENGINE_FLAGS, "--max-model-len", "1024"]  # tools in the prompt: ~500 tokens
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(raw.decode(errors="replace")) for raw in proc.stdout],
                     daemon=True).start()

    def url():
        m = next((re.search(r"HTTP listening on (http://\S+)", ln) for ln in list(lines)
                  if "HTTP listening on" in ln), None)
        return m.group(1) if m else None

    try:
        assert wait_for(lambda: url() or proc.poll() is not None, 180), "".join(lines[-40:])
        assert proc.poll() is None, "".join(lines[-40:])
        with httpx.Client(base_url=url(), timeout=10) as c:
            assert wait_for(lambda: c.get("/ready").status_code == 200, 300, 0.25), "".join(lines[-40:])
        yield url()
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


def _check_calls(calls, forced: str) -> None:
    assert calls, "no tool calls"
    for c in calls:
        assert ID.match(c.id) and c.type == "function"
        if forced != "required":
            assert c.function.name == forced
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def _streamed(client, **kw):
    """(content, tool calls as (id, name, arguments), finish_reason) assembled from the chunks."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    c["id"], c["name"] = tc.id, tc.function.name
                c["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", "get_weather", "add"])
def test_forced_choices_parse_for_every_seed(client, choice):
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice=tool_choice, max_tokens=120, temperature=1.0)

    def one(seed: int) -> None:
        out = client.chat.completions.create(seed=seed, **kw)
        ch = out.choices[0]
        # random weights may keep appending calls to the "required" array until max_tokens: the
        # complete ones are returned, and finish_reason says "length"; a named function's answer
        # finishes with "stop", as OpenAI and vLLM report it
        want = "tool_calls" if choice == "required" else "stop"
        assert ch.finish_reason == want or (choice == "required" and ch.finish_reason == "length"), (seed, ch)
        assert ch.message.content is None
        _check_calls(ch.message.tool_calls, choice)
        content, calls, finish = _streamed(client, seed=seed, **kw)
        assert finish == ch.finish_reason and content == ""
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
               [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls], seed
        assert all(ID.match(c["id"]) for c in calls)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, SEEDS))


def test_parallel_tool_calls_false_gives_one_call(client):
    for seed in SEEDS:
        out = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=False, max_tokens=120, seed=seed)
        assert out.choices[0].finish_reason == "tool_calls"
        assert len(out.choices[0].message.tool_calls) == 1
        _check_calls(out.choices[0].message.tool_calls, "required")


def test_auto_parses_a_hermes_call(client):
    extra = {"structured_outputs": {"choice": [HERMES_CALL]}}
    out = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=80, extra_body=extra)
    ch = out.choices[0]
    assert ch.finish_reason == "tool_calls" and not ch.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls] == \
           [("get_weather", {"city": "Lima"})]
    content, calls, finish = _streamed(client, model=MODEL, messages=USER, tools=TOOLS, max_tokens=80,
                                       extra_body=extra)
    assert finish == "tool_calls" and not content.strip()
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Lima"})]
    # plain text stays content; tool_choice "none" parses nothing
    plain = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=20,
                                           extra_body={"structured_outputs": {"choice": ["It is sunny."]}})
    assert plain.choices[0].message.content == "It is sunny." and not plain.choices[0].message.tool_calls
    none = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=80,
                                          extra_body=extra)
    assert none.choices[0].message.content == HERMES_CALL and not none.choices[0].message.tool_calls


def test_tool_message_round_trips(client, model_dir):
    from transformers import AutoTokenizer

    first = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=120, seed=3,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg = first.choices[0].message
    call = msg.tool_calls[0]
    messages = USER + [msg, {"role": "tool", "tool_call_id": call.id, "content": "20 C"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4,
                                            extra_body={"ignore_eos": True})
    assert second.choices[0].finish_reason == "length"
    # the server rendered the conversation as the template does with HF's tool-use format
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "20 C"}]
    text = tok.apply_chat_template(hf, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\n20 C\n</tool_response>" in text and '<tool_call>\n{"name": "get_weather"' in text
    assert second.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


def test_reasoning_split_on_a_qwen3_template(client, server):
    answer = r"<think>[a-z ]{3,20}</think>\n\n[A-Z][a-z]{2,10}\."
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=60,
              extra_body={"structured_outputs": {"regex": answer}, "chat_template_kwargs": {"enable_thinking": True}})
    for seed in range(3):
        msg = client.chat.completions.create(seed=seed, **kw).choices[0].message
        reasoning = msg.model_extra["reasoning_content"]
        assert re.fullmatch(r"[a-z ]{3,20}", reasoning) and re.fullmatch(r"[A-Z][a-z]{2,10}\.", msg.content), msg
        streamed_reasoning, streamed_content = "", ""
        for chunk in client.chat.completions.create(stream=True, seed=seed, **kw):
            delta = chunk.choices[0].delta
            streamed_reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            streamed_content += delta.content or ""
        assert (streamed_reasoning, streamed_content) == (reasoning, msg.content)
    # enable_thinking=false: the template closes an empty think block in the prompt; the answer is content
    on = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1)
    off = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    assert off.choices[0].message.model_extra["reasoning_content"] is None
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs.tokenize"):
        client.chat.completions.create(model=MODEL, messages=USER, extra_body={"chat_template_kwargs": {"tokenize": 1}})


def test_a_tool_schema_the_engine_cannot_compile_is_a_400_naming_tools(client):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(unclosed"}}, "required": ["x"]}}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, tools=bad, tool_choice="required", max_tokens=8)
    assert e.value.body["param"] == "tools", e.value.body
