"""POST /v1/responses: the OpenAI Responses API, stateless, on the chat-completions machinery.

The request becomes a chat: `instructions` a system message, `input` text one user message or its
items the messages (`function_call` items an assistant turn's tool calls, `function_call_output`
items tool messages, `reasoning` items the next assistant turn's reasoning_content), rendered by
the model's chat template (`openai._render_chat`, tools included). `max_output_tokens`,
`temperature`, `top_p` and `text.format` (the same `Constraint` as chat's `response_format`) set
the sampling. `tools` (Responses' flat function shape) and `tool_choice` go through the chat
route's tool handling (tool_calls.py: `plan_tools`, the required / named constraint, the
server's --tool-call-parser for auto), and the answer through the chat route's parser
(`ChatOutput`: --reasoning-parser, then tool calls), so its pieces become output items:
`reasoning`, `message` (output_text) and `function_call`.

Nothing is stored. `store: true`, `previous_response_id`, `conversation`, `background: true`, a
non-empty `include`, built-in tools and the other stateful or unimplemented fields are refused
with a 400 naming the field; an omitted `store` is accepted (OpenAI's default is true, but the
official client only sends it when the caller sets it) and the response says `"store": false`.

Streams are SSE with OpenAI's event names (`event:` line + `data:` JSON carrying `type` and
`sequence_number`): response.created, response.in_progress, then per output item
response.output_item.added ... response.output_item.done (message: content_part.added,
output_text.delta*, output_text.done, content_part.done; function_call:
function_call_arguments.delta*, function_call_arguments.done; reasoning: reasoning_text.delta*,
reasoning_text.done), then response.completed or response.incomplete (max_output_tokens). An
engine error mid-stream sends `error` and then `response.failed`. A client that disconnects
aborts the engine request, as on the chat route.
"""
from __future__ import annotations

import asyncio
import copy
import json
import re
import time
import uuid
from types import SimpleNamespace
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from frontends.common.errors import code_name, error_message, grpc_code
from frontends.http.openai import (
    _ERROR_RESPONSES,
    _SSE_HEADERS,
    _chat_chars,
    _Choice,
    _ClientGone,
    _engine,
    _error_from_event,
    _Generation,
    _gone,
    _make_request,
    _openai_field_error,
    _render_chat,
    _resolve_generate,
    _set_outcome,
    _shielded_close,
    _sse,
    _unless_disconnected,
)
from frontends.http.openai_schema import ChatMessage, field_error
from frontends.http.reasoning import prompt_opens_thinking
from frontends.http.responses_schema import ResponsesRequest, ResponsesTextFormat
from frontends.http.tool_calls import ChatOutput, chat_tool_constraint, plan_tools
from jax_engine.api import TOKENIZE_INLINE_CHARS, EngineAPI
from jax_engine.errors import EngineError, InvalidRequest, Overloaded
from jax_engine.types import Constraint, ModelInfo, SamplingParams

router = APIRouter(prefix="/v1", tags=["OpenAI-compatible"])

# Engine field name -> the Responses name (engine errors are reworded with these).
_RENAMES = {"max_new_tokens": "max_output_tokens", "prompt_ids": "input", "prompt": "input", "messages": "input"}


def _hex() -> str:
    return uuid.uuid4().hex


# ----------------------------------------------------------------------------- request checks


def _refuse_unsupported(body: ResponsesRequest) -> None:
    """400 naming each field accepted only at its neutral value, when it is not."""
    stateless = "this server is stateless (nothing is stored)"
    if body.store:
        raise field_error("store", f"store=true is not supported: {stateless}; omit store or send false")
    if body.previous_response_id is not None:
        raise field_error("previous_response_id", f"previous_response_id is not supported: {stateless}; "
                                                  "send the whole conversation as input")
    if body.conversation is not None:
        raise field_error("conversation", f"conversation is not supported: {stateless}")
    if body.background:
        raise field_error("background", "background=true is not supported: responses are generated "
                                        "while the request is open")
    if body.include:
        raise field_error("include", f"include={body.include!r} is not supported by this server (only empty)")
    if body.prompt is not None:
        raise field_error("prompt", "prompt (a stored prompt template) is not supported by this server")
    if body.reasoning:
        raise field_error("reasoning", "reasoning options are not supported by this server")
    if body.max_tool_calls is not None:
        raise field_error("max_tool_calls", "max_tool_calls is not supported by this server")
    if body.top_logprobs:
        raise field_error("top_logprobs", "top_logprobs is not supported on /v1/responses by this server")
    if body.truncation == "auto":
        raise field_error("truncation", "truncation='auto' is not supported: an input longer than the context "
                                        "is refused (truncation 'disabled')")
    if body.service_tier not in (None, "auto", "default"):
        raise field_error("service_tier", f"service_tier={body.service_tier!r} is not supported by this server")
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise field_error("text.verbosity", f"text.verbosity={body.text.verbosity!r} is not supported (only medium)")
    if body.stream_options is not None and not body.stream:
        raise field_error("stream_options", "stream_options is only allowed when stream is true")
    if body.input is None:
        raise field_error("input", "input is required (text, or a list of input items)")


def _max_output_tokens(engine: EngineAPI, body: ResponsesRequest) -> Optional[int]:
    limit = engine.args.max_new_tokens_limit
    if body.max_output_tokens is not None and body.max_output_tokens > limit:
        raise field_error("max_output_tokens", f"max_output_tokens must be at most {limit} "
                                               f"(got {body.max_output_tokens})")
    return body.max_output_tokens


def _text_constraint(fmt: Optional[ResponsesTextFormat]) -> Optional[Constraint]:
    """`text.format` -> the engine constraint, as chat's `response_format` (`openai._response_format_constraint`)."""
    if fmt is None or fmt.type == "text":
        extra = [k for k in ("name", "schema_", "strict", "description") if fmt is not None and getattr(fmt, k) is not None]
        if extra:
            key = "schema" if extra[0] == "schema_" else extra[0]
            raise field_error(f"text.format.{key}", f"text.format.{key} is only allowed with type json_schema")
        return None
    if fmt.type == "json_object":
        if fmt.schema_ is not None:
            raise field_error("text.format.schema", "text.format.schema is only allowed with type json_schema")
        return Constraint(kind="json_object")
    if fmt.name is None:
        raise field_error("text.format.name", "text.format.name is required with type json_schema")
    if fmt.schema_ is None:
        raise field_error("text.format.schema", "text.format.schema is required with type json_schema: "
                                                "the JSON Schema the output must match")
    return Constraint(kind="json_schema", spec=json.dumps(fmt.schema_))


# ----------------------------------------------------------------------------- input -> chat messages

_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")


def _unknown_key(item: dict[str, Any], allowed: tuple[str, ...], where: str, what: str) -> None:
    for key in item:
        if key not in allowed:
            raise field_error(f"{where}.{key}", f"{where}.{key}: unknown key in {what} "
                                                f"(allowed: {', '.join(allowed)})")


def _string(item: dict[str, Any], key: str, where: str, *, required: bool = True) -> Optional[str]:
    value = item.get(key)
    if value is None:
        if required:
            raise field_error(f"{where}.{key}", f"{where}.{key} is required")
        return None
    if not isinstance(value, str):
        raise field_error(f"{where}.{key}", f"{where}.{key} must be a string")
    return value


def _parts_text(content: Any, where: str) -> str:
    """A content value (a string, or a list of text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise field_error(where, f"{where} must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise field_error(at, f"{at} must be an object")
        kind = part.get("type")
        if kind not in _TEXT_PARTS:
            raise field_error(f"{at}.type", f"content part type {kind!r} is not supported (input_text or output_text)")
        allowed = ("type", "text") if kind == "input_text" else ("type", "text", "annotations", "logprobs")
        _unknown_key(part, allowed, at, f"an {kind} part")
        texts.append(_string(part, "text", at))
    return "".join(texts)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """The text of a reasoning input item (an earlier response's output passed back)."""
    _unknown_key(item, ("type", "id", "summary", "content", "encrypted_content", "status"), where, "a reasoning item")
    if item.get("encrypted_content") is not None:
        raise field_error(f"{where}.encrypted_content", "encrypted reasoning is not supported by this server")
    content = item.get("content") or []
    if not isinstance(content, list):
        raise field_error(f"{where}.content", f"{where}.content must be a list of reasoning_text parts")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict) or part.get("type") != "reasoning_text":
            raise field_error(f"{at}.type", f"{at} must be a reasoning_text part")
        _unknown_key(part, ("type", "text"), at, "a reasoning_text part")
        texts.append(_string(part, "text", at))
    return "".join(texts)


def _input_messages(body: ResponsesRequest) -> list[ChatMessage]:
    """`instructions` + `input` as chat messages (validated here, so each error names its input item).
    Consecutive function_call items are one assistant turn (parallel calls); a reasoning item goes
    to the next assistant turn as its `reasoning_content`."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        if not body.input:
            raise field_error("input", "input is an empty string")
        messages.append({"role": "user", "content": body.input})
        return [ChatMessage.model_validate(m) for m in messages]
    items = body.input or []
    if not items:
        raise field_error("input", "input must not be empty")
    reasoning: Optional[str] = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        last = messages[-1] if messages else None
        if kind == "message":
            _unknown_key(item, ("type", "role", "content", "id", "status", "phase"), where, "a message item")
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise field_error(f"{where}.role", f"{where}.role must be one of {', '.join(_MESSAGE_ROLES)} "
                                                   f"(got {role!r})")
            if "content" not in item:
                raise field_error(f"{where}.content", f"{where}.content is required")
            msg: dict[str, Any] = {"role": role, "content": _parts_text(item["content"], f"{where}.content")}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            messages.append(msg)
        elif kind == "function_call":
            _unknown_key(item, ("type", "call_id", "name", "arguments", "id", "status"), where, "a function_call item")
            arguments = _string(item, "arguments", where)
            try:
                json.loads(arguments or "{}")
            except ValueError:
                raise field_error(f"{where}.arguments", f"{where}.arguments must be JSON text") from None
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": arguments}}
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)   # the calls of one assistant turn
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                messages.append(msg)
        elif kind == "function_call_output":
            _unknown_key(item, ("type", "call_id", "output", "id", "status"), where, "a function_call_output item")
            call_id = _string(item, "call_id", where)
            if "output" not in item:
                raise field_error(f"{where}.output", f"{where}.output is required")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _parts_text(item["output"], f"{where}.output")})
        elif kind == "reasoning":
            reasoning = (reasoning or "") + _reasoning_text(item, where)
        elif kind is None:
            raise field_error(f"{where}.type", f"{where} needs a type (or a role, for a message)")
        else:
            raise field_error(f"{where}.type", f"input item type {kind!r} is not supported by this stateless server "
                                               "(message, function_call, function_call_output, reasoning)")
    return [ChatMessage.model_validate(m) for m in messages]


# ----------------------------------------------------------------------------- tools

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")   # as chat's FunctionDefinition.name


def _chat_tools(body: ResponsesRequest) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the tools in chat's shape, as the response echoes them); anything but a function tool is refused."""
    chat: list[dict[str, Any]] = []
    echo: list[dict[str, Any]] = []
    for i, tool in enumerate(body.tools or []):
        where = f"tools[{i}]"
        kind = tool.get("type")
        if kind != "function":
            raise field_error(f"{where}.type", f"tool type {kind!r} is not supported: only function tools "
                                               "(built-in tools run on OpenAI's side)")
        _unknown_key(tool, ("type", "name", "description", "parameters", "strict"), where, "a function tool")
        name = _string(tool, "name", where) or ""
        if not _TOOL_NAME.match(name):
            raise field_error(f"{where}.name", f"{where}.name must be 1 to 64 letters, digits, _ or -")
        if any(t["function"]["name"] == name for t in chat):
            raise field_error(f"{where}.name", f"tool name {name!r} appears twice")
        params = tool.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise field_error(f"{where}.parameters", f"{where}.parameters must be a JSON Schema object")
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise field_error(f"{where}.strict", f"{where}.strict must be a boolean")
        description = _string(tool, "description", where, required=False)
        fn: dict[str, Any] = {"name": name}
        if description is not None:
            fn["description"] = description
        if params is not None:
            fn["parameters"] = params
        chat.append({"type": "function", "function": fn})
        echo.append({"type": "function", "name": name, "description": description, "parameters": params,
                     "strict": True if strict is None else strict})
    return chat, echo


def _tool_choice(body: ResponsesRequest) -> tuple[Any, Any]:
    """(the choice as the response echoes it, as the chat route takes it)."""
    choice = body.tool_choice
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise field_error("tool_choice", f"tool_choice {choice!r} is not supported (none, auto, required, "
                                             "or {\"type\": \"function\", \"name\": ...})")
        return choice, choice
    if choice.get("type") != "function":
        raise field_error("tool_choice.type", f"tool_choice type {choice.get('type')!r} is not supported "
                                              "(only function)")
    _unknown_key(choice, ("type", "name"), "tool_choice", "a function tool choice")
    name = _string(choice, "name", "tool_choice")
    if not any(t.get("name") == name for t in body.tools or []):
        raise field_error("tool_choice.name", f"tool_choice names {name!r}, which is not a function in tools")
    return {"type": "function", "name": name}, {"type": "function", "function": {"name": name}}


# ----------------------------------------------------------------------------- the request, planned


class _Plan:
    """What one validated request asks for, and the fixed fields of its response object."""

    def __init__(self, body: ResponsesRequest, info: ModelInfo, params: SamplingParams, *,
                 tools_echo: list[dict[str, Any]], choice_echo: Any, output: Callable[[], ChatOutput],
                 adapter: Optional[str] = None):
        self.rid = "resp_" + _hex()
        self.created = int(time.time())
        self.body, self.info, self.params, self.output = body, info, params, output
        self.adapter = adapter    # a LoRA adapter named by `model` (info is its base model)
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        text_format: dict[str, Any] = {"type": "text"}
        if fmt is not None:
            text_format = {k: v for k, v in fmt.model_dump(by_alias=True).items() if v is not None}
        self.fixed: dict[str, Any] = {
            "id": self.rid, "object": "response", "created_at": self.created, "model": adapter or info.name,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": None, "store": False, "background": False,
            "service_tier": "default", "temperature": params.temperature, "top_p": params.top_p,
            "text": {"format": text_format, "verbosity": "medium"}, "tool_choice": choice_echo,
            "tools": tools_echo, "truncation": "disabled", "top_logprobs": 0, "user": body.user,
            "safety_identifier": body.safety_identifier, "prompt_cache_key": body.prompt_cache_key,
        }

    def response(self, status: str, output: list[dict[str, Any]], choice: Optional[_Choice] = None,
                 error: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        out = dict(self.fixed)
        out.update(status=status, output=output, error=error, usage=None, incomplete_details=None)
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if status in ("completed", "incomplete"):
            out["completed_at"] = int(time.time())
        if choice is not None and status != "in_progress":
            out["usage"] = {"input_tokens": choice.prompt_tokens, "output_tokens": choice.completion_tokens,
                            "total_tokens": choice.prompt_tokens + choice.completion_tokens,
                            "input_tokens_details": {"cached_tokens": choice.cached_tokens, "cache_write_tokens": 0},
                            "output_tokens_details": {"reasoning_tokens": 0}}
        return out


def _status(finish_reason: Optional[str]) -> str:
    """The response status of a finished generation ("length": max_output_tokens or the context;
    "abort": the engine gave up on it, e.g. while draining)."""
    return {"length": "incomplete", "abort": "failed"}.get(finish_reason or "", "completed")


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _Items:
    """The output items of one answer, built from the chat parser's deltas (`ChatOutput.step`:
    reasoning_content, content, tool_calls) and the stream events that build them. The unstreamed
    response runs the same code over the whole answer, so both agree."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: Optional[dict[str, Any]] = None
        self.events: list[tuple[str, dict[str, Any]]] = []   # (type, fields) not yet sent

    def _emit(self, kind: str, **fields: Any) -> None:
        self.events.append((kind, fields))

    def _start(self, item: dict[str, Any]) -> dict[str, Any]:
        self.close("completed")
        self.open = item
        self.items.append(item)
        self._emit("response.output_item.added", output_index=len(self.items) - 1, item=copy.deepcopy(item))
        return item

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def feed(self, delta: dict[str, Any]) -> None:
        reasoning = delta.get("reasoning_content")
        if reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                self._start({"type": "reasoning", "id": "rs_" + _hex(), "summary": [],
                             "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"})
            self.open["content"][0]["text"] += reasoning  # type: ignore[index]
            self._emit("response.reasoning_text.delta", **self._where(), content_index=0, delta=reasoning)
        content = delta.get("content")
        if content:
            self._open_message()
            self.open["content"][0]["text"] += content  # type: ignore[index]
            self._emit("response.output_text.delta", **self._where(), content_index=0, delta=content, logprobs=[])
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if "id" in call:
                self._start({"type": "function_call", "id": "fc_" + _hex(), "call_id": call["id"], "name": fn["name"],
                             "arguments": "", "status": "in_progress"})
            args = fn.get("arguments")
            if args and self.open is not None and self.open["type"] == "function_call":
                self.open["arguments"] += args
                self._emit("response.function_call_arguments.delta", **self._where(), delta=args)

    def _open_message(self) -> None:
        if self.open is None or self.open["type"] != "message":
            self._start({"type": "message", "id": "msg_" + _hex(), "role": "assistant", "status": "in_progress",
                         "content": []})
            self.open["content"].append(_text_part(""))  # type: ignore[index]
            self._emit("response.content_part.added", **self._where(), content_index=0, part=_text_part(""))

    def close(self, status: str) -> None:
        """Finish the open item (`status`: completed, or incomplete for the last one of a cut answer)."""
        item = self.open
        if item is None:
            return
        where = self._where()
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            self._emit("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            self._emit("response.content_part.done", **where, content_index=0, part=part)
        elif item["type"] == "reasoning":
            self._emit("response.reasoning_text.done", **where, content_index=0, text=item["content"][0]["text"])
        else:
            self._emit("response.function_call_arguments.done", **where, arguments=item["arguments"])
        self._emit("response.output_item.done", output_index=where["output_index"], item=item)
        self.open = None

    def finish(self, status: str) -> None:
        """The answer ended; a response always has a message or a call (an empty answer: an empty message)."""
        if not any(i["type"] in ("message", "function_call") for i in self.items):
            self._open_message()
        self.close("incomplete" if status == "incomplete" else "completed")

    def take(self) -> list[tuple[str, dict[str, Any]]]:
        out, self.events = self.events, []
        return out


# ----------------------------------------------------------------------------- the route


async def _plan(request: Request, engine: EngineAPI, body: ResponsesRequest) -> tuple[_Plan, list[int]]:
    _refuse_unsupported(body)
    info, adapter = _resolve_generate(engine, body.model)
    max_tokens = _max_output_tokens(engine, body)
    messages = _input_messages(body)
    chat_tools, tools_echo = _chat_tools(body)
    choice_echo, chat_choice = _tool_choice(body)
    # the chat route's tool handling, on the request in chat's shape
    as_chat = SimpleNamespace(tools=chat_tools, tool_choice=chat_choice, parallel_tool_calls=body.parallel_tool_calls)
    state = request.app.state
    tools = plan_tools(as_chat, getattr(state, "tool_call_parser", None))
    reasoning = getattr(state, "reasoning_parser", None)
    constraint = _text_constraint(body.text.format if body.text is not None else None)
    forced = chat_tool_constraint(as_chat)
    if forced is not None:
        if constraint is not None:
            raise field_error("text.format", "text.format and tool_choice (required or a named function) both "
                                             "constrain the output; send only one of them")
        constraint = forced
    params = SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                            top_p=1.0 if body.top_p is None else body.top_p, max_new_tokens=max_tokens,
                            constraint=constraint, skip_special_tokens=tools.parser != "mistral")
    tokenizer = engine.tokenizer(info.name, "generate")
    try:
        if _chat_chars(messages) > TOKENIZE_INLINE_CHARS:
            prompt_ids = await asyncio.to_thread(_render_chat, tokenizer, messages, info, tools)
        else:
            prompt_ids = _render_chat(tokenizer, messages, info, tools)
    except InvalidRequest as e:
        raise _input_error(e) from None
    opened = reasoning is not None and prompt_opens_thinking(tokenizer.decode(prompt_ids[-16:]))
    # mistral's [TOOL_CALLS] marker is a special token: kept in the text, and so is the EOS, dropped again
    eos = [tokenizer.decode([t]) for t in info.eos_token_ids] if not params.skip_special_tokens else []

    def output() -> ChatOutput:
        return ChatOutput(plan=tools, reasoning_parser=reasoning, prompt_opened=opened, drop_suffixes=eos)

    return _Plan(body, info, params, tools_echo=tools_echo, choice_echo=choice_echo, output=output,
                 adapter=adapter), prompt_ids


def _input_error(err: InvalidRequest) -> InvalidRequest:
    """An error of the chat rendering, renamed: the chat's `messages` are this request's `input`."""
    param = getattr(err, "param", None)
    message = err.message.replace("messages", "input")
    if param and param.startswith("messages"):
        return field_error("input", message)
    return field_error(param, message) if param else err


def _constraint_field(plan: _Plan) -> Optional[str]:
    if plan.params.constraint is None:
        return None
    text = plan.body.text
    if text is not None and text.format is not None and text.format.type != "text":
        return "text.format"
    return "tools"


@router.post("/responses", responses={**_ERROR_RESPONSES, 200: {
    "description": "a response object, or with stream=true an SSE stream of response events",
    "content": {"application/json": {}, "text/event-stream": {}}}})
async def create_response(request: Request, body: ResponsesRequest) -> Response:
    """OpenAI Responses API, stateless (nothing is stored; `previous_response_id` is refused)."""
    engine = _engine(request)
    plan, prompt_ids = await _plan(request, engine, body)
    req = _make_request(plan.rid, 0, 1, prompt_ids, plan.params, plan.info.name, plan.adapter)
    gen = _Generation(engine, [req], 1)

    async def start() -> None:
        try:
            await gen.start()
        except InvalidRequest as e:  # the engine names its own fields; say them the Responses way
            raise _openai_field_error(e, _RENAMES, _constraint_field(plan)) from None

    if not body.stream:
        async def collect() -> dict[str, Any]:
            await start()
            choice = _Choice(0)
            try:
                async for _, ev in gen.events():
                    choice.absorb(ev)
                    if ev.finish_reason == "error":
                        raise _error_from_event(ev)
            finally:
                await gen.aclose()
            items = _Items()
            items.feed(plan.output().step("".join(choice.text), final=True))
            status = _status(choice.finish_reason)
            items.finish(status)
            return plan.response(status, items.items, choice, error=_aborted(status))

        try:
            return JSONResponse(await _unless_disconnected(request, collect()))
        except _ClientGone:
            return _gone()

    # Admission errors become a plain HTTP error before the stream starts, as on the chat route.
    try:
        await _unless_disconnected(request, start())
    except _ClientGone:
        return _gone()
    return StreamingResponse(_stream(request, plan, gen), media_type="text/event-stream", headers=_SSE_HEADERS)


def _aborted(status: str) -> Optional[dict[str, Any]]:
    return {"code": "server_error", "message": "the generation was aborted"} if status == "failed" else None


# ----------------------------------------------------------------------------- streaming


class _Events:
    """Numbered SSE frames: `event: <type>` and `data: <json with type and sequence_number>`."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\n".encode() + _sse(data)


def _failure(err: EngineError) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the `error` event's fields, the failed response's `error`) of an engine error."""
    code = code_name(grpc_code(err))
    event = {"code": code, "message": error_message(err), "param": getattr(err, "param", None)}
    kind = "rate_limit_exceeded" if isinstance(err, Overloaded) else \
        "invalid_prompt" if isinstance(err, InvalidRequest) else "server_error"
    return event, {"code": kind, "message": error_message(err)}


async def _stream(request: Request, plan: _Plan, gen: _Generation) -> AsyncIterator[bytes]:
    """The event stream: the answer goes through the chat route's parser (`ChatOutput`) as it
    arrives, so text streams delta by delta while a possible tool call is held back until it parses."""
    ev = _Events()
    choice = _Choice(0)
    items = _Items()
    output = plan.output()
    try:
        yield ev("response.created", response=plan.response("in_progress", []))
        yield ev("response.in_progress", response=plan.response("in_progress", []))
        async for _, out in gen.events():
            choice.absorb(out)
            if out.finish_reason == "error":
                err = _error_from_event(out)
                _set_outcome(request, code_name(grpc_code(err)))
                fields, failed = _failure(err)
                yield ev("error", **fields)
                yield ev("response.failed", response=plan.response("failed", items.items, choice, error=failed))
                return
            if out.new_text or out.finished:
                items.feed(output.step(out.new_text, final=out.finished))
            for kind, fields in items.take():
                yield ev(kind, **fields)
        status = _status(choice.finish_reason)
        items.finish(status)
        for kind, fields in items.take():
            yield ev(kind, **fields)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        yield ev(kind, response=plan.response(status, items.items, choice, error=_aborted(status)))
    finally:
        if not gen.complete and getattr(request.state, "outcome", None) is None:
            _set_outcome(request, "cancelled")
        await _shielded_close(gen)
