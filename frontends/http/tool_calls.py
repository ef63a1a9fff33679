"""Tool calling for the OpenAI fronts: tool choice -> constraint, the answer -> `tool_calls`.

`tool_choice` (as OpenAI sends it):
- "none": the chat template still gets the tools (vLLM's default), the answer is plain content;
- "auto" (the default when tools are given): free generation, parsed by the server's
  `--tool-call-parser`; without one the request is refused (400), as in vLLM;
- "required" / a named function: generation under the structured-generation constraint of
  `jax_engine.api.tool_constraint` (vLLM's shapes: a JSON array of {"name", "parameters"}, or the
  named function's arguments object), so the calls always parse; no parser needed.

Parsers (`--tool-call-parser`), for "auto":
- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks; text outside them is content;
- `llama3_json` (Llama 3.1+): the whole answer is `{"name": ..., "parameters": {...}}` (several
  separated by `;`), optionally after `<|python_tag|>`; anything else is content;
- `mistral`: content, then `[TOOL_CALLS]` and a JSON array of {"name", "arguments"}.
A block that does not parse as a call stays content, as in vLLM.

Streaming: one parser object per choice is fed the text as it arrives (`ChatOutput`), and the
unstreamed answer is the same object fed the whole text, so both agree. Plain content streams;
text that may be the start of a tool call is held back. A hermes call is sent when its block
closes, a llama3_json / mistral call list when the answer ends, a "required" call as soon as its
array item is complete, and the named function's arguments as they are generated. Each call is
one `delta.tool_calls` entry `{"index", "id", "type": "function", "function": {"name",
"arguments"}}` (arguments whole, or "" then fragments for a named function), as OpenAI sends them.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

from frontends.http.openai_schema import field_error
from frontends.http.reasoning import ReasoningSplitter, partial_suffix
from jax_engine.api import tool_constraint
from jax_engine.errors import InvalidRequest
from jax_engine.types import Constraint, FunctionTool

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


def check_tool_call_parser(name: Optional[str]) -> Optional[str]:
    if name is not None and name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r} (known: {', '.join(TOOL_CALL_PARSERS)})")
    return name


@dataclass
class ToolCall:
    id: str            # "call_<24 hex>"
    name: str
    arguments: str     # JSON text

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# ----------------------------------------------------------------------------- request side


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def choice_of(tool_choice: Any) -> tuple[str, Optional[str]]:
    """("none" | "auto" | "required" | "function", the function's name or None)."""
    if tool_choice is None or isinstance(tool_choice, str):
        return tool_choice or "auto", None
    fn = _get(tool_choice, "function")
    name = _get(fn, "name") if fn is not None else None
    if _get(tool_choice, "type") != "function" or not isinstance(name, str):
        raise field_error("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                                         '{"type": "function", "function": {"name": ...}}')
    return "function", name


def function_tools(tools: Any) -> list[FunctionTool]:
    """OpenAI `tools` (pydantic models or dicts) -> the engine's FunctionTool list."""
    out = []
    for t in tools or []:
        fn = _get(t, "function")
        params = _get(fn, "parameters")
        out.append(FunctionTool(_get(fn, "name"), params if params is not None else
                                {"type": "object", "properties": {}}))
    return out


def tool_choice_constraint(tools: list[FunctionTool], tool_choice: Any, parallel: bool) -> Optional[Constraint]:
    """The generation constraint `tool_choice` asks for over `tools` (None for none / auto);
    a 400 naming `tools` or `tool_choice` when they do not fit together."""
    kind, name = choice_of(tool_choice)
    try:
        return tool_constraint(tools, kind, function=name, parallel=parallel)
    except InvalidRequest as e:
        field = e.message.partition(":")[0]
        raise field_error(field if field in ("tools", "tool_choice") else "tool_choice", e.message) from None


def forced_of(tool_choice: Any) -> Optional[str]:
    """`forced` for parse_tool_calls: "required", the named function, or None."""
    kind, name = choice_of(tool_choice)
    return "required" if kind == "required" else name


def chat_tool_constraint(body: Any) -> Optional[Constraint]:
    """The tool constraint of a chat request (None when it forces no call)."""
    tools = getattr(body, "tools", None)
    choice = getattr(body, "tool_choice", None)
    if not tools and choice_of(choice)[0] in ("none", "auto"):
        return None
    return tool_choice_constraint(function_tools(tools), choice, getattr(body, "parallel_tool_calls", None) is not False)


@dataclass
class ToolPlan:
    """What a chat request does with tools: `template_tools` go into the chat template; the answer
    is parsed with `parser` (auto), or is the output of the constraint (`forced`)."""

    template_tools: Optional[list[dict[str, Any]]] = None
    parser: Optional[str] = None
    server_parser: Optional[str] = None   # the server's --tool-call-parser (its id format in templates)
    forced: Optional[str] = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.parser is not None or self.forced is not None


def plan_tools(body: Any, parser: Optional[str]) -> ToolPlan:
    """Check the tool fields of a chat request against the server's parser; 400 naming the field."""
    tools = getattr(body, "tools", None) or []
    choice = getattr(body, "tool_choice", None)
    parallel = getattr(body, "parallel_tool_calls", None)
    if not tools:
        if parallel is not None:
            # as OpenAI: only together with tools (the official client sends it only when set)
            raise field_error("parallel_tool_calls", "parallel_tool_calls is only allowed with tools")
        kind, _ = choice_of(choice)
        if kind in ("none", "auto"):
            return ToolPlan(server_parser=parser)
        raise field_error("tool_choice", f"tool_choice {kind!r} needs at least one tool in tools")
    kind, name = choice_of(choice)
    plan = ToolPlan(template_tools=[_tool_dict(t) for t in tools], parallel=parallel is not False,
                    server_parser=parser)
    if kind == "auto":
        if parser is None:
            raise field_error("tool_choice" if choice is not None else "tools",
                              'tool_choice "auto" (the default with tools) needs a server started with '
                              f"--tool-call-parser ({', '.join(TOOL_CALL_PARSERS)}); tool_choice \"required\" "
                              'or a named function work without one')
        plan.parser = parser
    elif kind == "required":
        plan.forced = "required"
    elif kind == "function":
        plan.forced = name
    return plan


def _tool_dict(t: Any) -> dict[str, Any]:
    if isinstance(t, dict):
        return t
    return t.model_dump(exclude_none=True, by_alias=True)


def template_message(m: Any, i: int, content: str, parser: Optional[str] = None) -> dict[str, Any]:
    """A chat message as the chat template sees it (HF's tool-use format): assistant `tool_calls`
    with their arguments as objects, `tool` messages with their `tool_call_id`. Mistral templates
    need 9-character ids: with that parser the ids are cut to their last 9 characters, as vLLM does."""
    msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
    if m.name is not None:
        msg["name"] = m.name
    cut = (lambda s: s[-9:]) if parser == "mistral" else (lambda s: s)
    if m.tool_calls:
        if m.role != "assistant":
            raise field_error(f"messages[{i}].tool_calls", "only assistant messages carry tool_calls")
        calls = []
        for j, tc in enumerate(m.tool_calls):
            args: Any = tc.function.arguments
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise field_error(f"messages[{i}].tool_calls[{j}].function.arguments",
                                  "tool call arguments must be JSON text") from None
            calls.append({"id": cut(tc.id), "type": "function",
                          "function": {"name": tc.function.name, "arguments": args}})
        msg["tool_calls"] = calls
    if m.role == "tool":
        if m.tool_call_id is None:
            raise field_error(f"messages[{i}].tool_call_id", "a tool message needs the tool_call_id it answers")
        msg["tool_call_id"] = cut(m.tool_call_id)
    elif m.tool_call_id is not None:
        raise field_error(f"messages[{i}].tool_call_id", "only tool messages carry tool_call_id")
    reasoning = getattr(m, "reasoning_content", None)
    if reasoning is not None:
        if m.role != "assistant":
            raise field_error(f"messages[{i}].reasoning_content", "only assistant messages carry reasoning_content")
        msg["reasoning_content"] = reasoning
    return msg


# ----------------------------------------------------------------------------- answer side

# parser events: ("content", text) | ("call", ToolCall) | ("args", fragment of the last call's arguments)
Event = tuple[str, Union[str, ToolCall]]


def _call_from(obj: Any) -> Optional[ToolCall]:
    """{"name", "arguments" | "parameters"} -> a ToolCall; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _calls_from_json(text: str, *, list_ok: bool, separator: Optional[str] = None) -> Optional[list[ToolCall]]:
    """Every call in `text` (one object, a list of them when `list_ok`, or objects joined by
    `separator`), or None unless all of it is calls."""
    parts = [p for p in text.split(separator)] if separator else [text]
    calls: list[ToolCall] = []
    for part in parts:
        try:
            value = json.loads(part)
        except ValueError:
            if separator:   # the separator may occur inside a string: try the whole text once
                return _calls_from_json(text, list_ok=list_ok)
            return None
        items = value if list_ok and isinstance(value, list) else [value]
        for item in items:
            call = _call_from(item)
            if call is None:
                return None
            calls.append(call)
    return calls or None


class _Hermes:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.buf = ""
        self.inside = False
        self.ws = ""           # whitespace held back (dropped next to a call and at the end)
        self.after_call = False

    def _content(self, text: str, out: list[Event]) -> None:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        body = text.rstrip()
        if body:
            out.append(("content", self.ws + body))
            self.ws = ""
        self.ws += text[len(body):]

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while True:
            if not self.inside:
                idx = self.buf.find(self.START)
                if idx < 0:
                    hold = partial_suffix(self.buf, self.START)
                    self._content(self.buf[:len(self.buf) - hold], out)
                    self.buf = self.buf[len(self.buf) - hold:]
                    return out
                self._content(self.buf[:idx], out)
                self.buf, self.inside, self.ws = self.buf[idx + len(self.START):], True, ""
            idx = self.buf.find(self.END)
            if idx < 0:
                return out
            block, self.buf, self.inside = self.buf[:idx], self.buf[idx + len(self.END):], False
            calls = _calls_from_json(block.strip(), list_ok=False)
            if calls:
                out += [("call", c) for c in calls]
                self.after_call = True
            else:
                self._content(self.START + block + self.END, out)

    def finish(self) -> list[Event]:
        out: list[Event] = []
        rest, self.buf = self.buf, ""
        if self.inside:   # an unclosed last block (a model may end at EOS without the tag)
            calls = _calls_from_json(rest.strip(), list_ok=False)
            if calls:
                return [("call", c) for c in calls]
            rest = self.START + rest
        self._content(rest, out)
        return out


class _WholeAnswer:
    """llama3_json / mistral: content until a marker (llama3_json: the answer's start), then held
    to the end and parsed as a whole; if it is not all calls, it is content after all."""

    def __init__(self, parser: str):
        self.parser = parser
        self.buf = ""
        self.started = False   # llama3_json: decided whether the answer is a call
        self.holding = False

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        if self.holding:
            return []
        if self.parser == "llama3_json":
            stripped = self.buf.lstrip()
            tag = "<|python_tag|>"
            if not stripped or (len(stripped) < len(tag) and tag.startswith(stripped)):
                return []
            self.holding = stripped.startswith(tag) or stripped.startswith("{")
            if self.holding:
                return []
            out, self.buf = self.buf, ""
            return [("content", out)]
        tag = "[TOOL_CALLS]"
        idx = self.buf.find(tag)
        if idx >= 0:
            out, self.buf, self.holding = self.buf[:idx], self.buf[idx:], True
            return [("content", out.rstrip())] if out.strip() else []
        hold = partial_suffix(self.buf, tag)
        out, self.buf = self.buf[:len(self.buf) - hold], self.buf[len(self.buf) - hold:]
        return [("content", out)] if out else []

    def finish(self) -> list[Event]:
        rest, self.buf = self.buf, ""
        if self.holding:
            if self.parser == "llama3_json":
                calls = _calls_from_json(rest.strip().removeprefix("<|python_tag|>").strip(), list_ok=False,
                                         separator=";")
            else:
                calls = _calls_from_json(rest.strip().removeprefix("[TOOL_CALLS]").strip(), list_ok=True)
            if calls:
                return [("call", c) for c in calls]
        return [("content", rest)] if rest else []


class _Required:
    """Output of the "required" constraint: a JSON array of {"name", "parameters"}; each call is
    sent as soon as its array item is complete."""

    def __init__(self) -> None:
        self.buf = ""
        self.pos = 0
        self.depth = 0
        self.in_str = self.esc = False
        self.start = -1
        self.calls = 0

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        for i in range(self.pos, len(self.buf)):
            ch = self.buf[i]
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
                if self.depth == 2 and ch == "{":
                    self.start = i
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 1 and ch == "}" and self.start >= 0:
                    try:
                        call = _call_from(json.loads(self.buf[self.start:i + 1]))
                    except ValueError:
                        call = None
                    if call is not None:
                        out.append(("call", call))
                        self.calls += 1
                    self.start = -1
        self.pos = len(self.buf)
        return out

    def finish(self) -> list[Event]:
        # Cut off before the first call was complete (length): the raw text is all there is.
        return [] if self.calls else ([("content", self.buf)] if self.buf else [])


class _Named:
    """Output of a named function's constraint: the arguments object, streamed as it comes."""

    def __init__(self, name: str):
        self.call: Optional[ToolCall] = None
        self.name = name

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self.call is None:
            self.call = ToolCall(new_call_id(), self.name, "")
            out.append(("call", self.call))
        if text:
            out.append(("args", text))
        return out

    def finish(self) -> list[Event]:
        return self.feed("")


def _parser_for(parser: Optional[str], forced: Optional[str]):
    if forced == "required":
        return _Required()
    if forced is not None:
        return _Named(forced)
    if parser == "hermes":
        return _Hermes()
    if parser in ("llama3_json", "mistral"):
        return _WholeAnswer(parser)
    if parser is None:
        return None
    raise ValueError(f"unknown tool call parser {parser!r}")


def parse_tool_calls(text: str, parser: str, forced: Optional[str]) -> tuple[str, list[ToolCall]]:
    """(remaining content, calls) of a whole answer. `forced`: None for auto, "required" or the
    named function's name for output produced under the tool constraint."""
    p = _parser_for(parser, forced)
    if p is None:
        return text, []
    events = p.feed(text) + p.finish()
    content = "".join(e[1] for e in events if e[0] == "content")  # type: ignore[misc]
    calls: list[ToolCall] = []
    for kind, value in events:
        if kind == "call":
            calls.append(value)  # type: ignore[arg-type]
        elif kind == "args":
            calls[-1].arguments += value  # type: ignore[operator]
    return content, calls


class ChatOutput:
    """One chat choice's answer: reasoning split first (unless a tool call is forced: the
    constraint holds from the first token, so there is no reasoning), then tool calls. `step`
    returns the OpenAI `delta` fields of what became known; `message` builds the unstreamed
    message the same way."""

    def __init__(self, *, plan: Optional[ToolPlan] = None, reasoning_parser: Optional[str] = None,
                 prompt_opened: bool = False, drop_suffixes: Optional[list[str]] = None):
        plan = self.plan = plan or ToolPlan()
        self.drop_suffixes = [s for s in drop_suffixes or [] if s]   # e.g. EOS text, kept with special tokens
        self.reasoning = reasoning_parser
        self.splitter = (ReasoningSplitter(reasoning_parser, prompt_opened)
                         if reasoning_parser and plan.forced is None else None)
        self.tools = _parser_for(plan.parser, plan.forced)
        self.parallel = plan.parallel or plan.forced is not None
        self.calls: list[ToolCall] = []
        self._dropped = False    # a further call after the first, with parallel_tool_calls false

    @property
    def called(self) -> bool:
        return bool(self.calls)

    @property
    def finishes_with_calls(self) -> bool:
        """finish_reason "tool_calls": calls parsed (auto) or forced by "required"; a named
        function's answer finishes with "stop", as OpenAI and vLLM report it."""
        return bool(self.calls) and self.plan.forced in (None, "required")

    def _delta(self, reasoning: str, content: str, final: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        events: list[Event] = []
        if self.tools is None:
            if content:
                events.append(("content", content))
        else:
            if content:
                events += self.tools.feed(content)
            if final:
                events += self.tools.finish()
        text, tool_deltas = "", []
        for kind, value in events:
            if kind == "content":
                text += value  # type: ignore[operator]
            elif kind == "call":
                if self.calls and not self.parallel:
                    self._dropped = True
                    continue
                self.calls.append(value)  # type: ignore[arg-type]
                tool_deltas.append({"index": len(self.calls) - 1, **value.openai()})  # type: ignore[union-attr]
            elif not self._dropped:
                self.calls[-1].arguments += value  # type: ignore[operator]
                tool_deltas.append({"index": len(self.calls) - 1, "function": {"arguments": value}})
        if text:
            delta["content"] = text
        if tool_deltas:
            delta["tool_calls"] = tool_deltas
        return delta

    def step(self, text: str, final: bool = False) -> dict[str, Any]:
        """The delta fields of `text`, the answer's next piece (`final`: and its end)."""
        if final:
            for suffix in self.drop_suffixes:
                if text.endswith(suffix):
                    text = text[:-len(suffix)]
                    break
        reasoning, content = self.splitter.feed(text) if self.splitter is not None else ("", text)
        if final and self.splitter is not None:
            more_reasoning, more_content = self.splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return self._delta(reasoning, content, final)

    def message(self, text: str) -> dict[str, Any]:
        """The whole answer as an OpenAI assistant message."""
        delta = self.step(text, final=True)
        content = delta.get("content", "")
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.calls:
            msg["content"] = content.strip() or None
            msg["tool_calls"] = [c.openai() for c in self.calls]
        if self.reasoning:
            msg["reasoning_content"] = delta.get("reasoning_content")
        return msg


def finish_reason(reason: Optional[str], called: bool) -> Optional[str]:
    """"tool_calls" for an answer that ended normally with calls; otherwise unchanged."""
    return "tool_calls" if called and reason == "stop" else reason
