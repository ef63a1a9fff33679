"""The request model of /v1/responses (OpenAI Responses API, stateless; responses.py serves it).

Strict like the chat models (`extra="forbid"`): a field this server does not implement is refused
with a 400 that names it. Fields OpenAI defines that only make sense with stored state
(`previous_response_id`, `conversation`, `store: true`, `background: true`, `include`, ...) are
declared so that /docs lists them and the refusal explains itself; the route accepts each only at
its neutral value (`responses._refuse_unsupported`).

`input` items and `tools` are plain objects here and are checked item by item by the route, so an
error names the exact key (`input[2].content[0].type`, `tools[1].type`) rather than a union member.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field

from frontends.http.openai_schema import _Strict

INPUT_DOC = (
    "text (one user message) or a list of input items: messages "
    "`{\"role\": \"user\"|\"system\"|\"developer\"|\"assistant\", \"content\": str | [{\"type\": \"input_text\""
    "|\"output_text\", \"text\"}], \"type\"?: \"message\"}`, `{\"type\": \"function_call\", \"call_id\", \"name\", "
    "\"arguments\"}` and `{\"type\": \"function_call_output\", \"call_id\", \"output\"}`"
)


class ResponsesTextFormat(_Strict):
    """`text.format`: text (no constraint), json_object (any JSON object) or json_schema (`schema`
    enforced, whatever `strict` says)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(None, description="json_schema: the schema's name (required by OpenAI; not used)")
    description: Optional[str] = Field(None, description="json_schema: accepted; not used")
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema",
                                              description="json_schema: the JSON Schema the output matches")
    strict: Optional[bool] = Field(None, description="accepted either way: the schema is always enforced")


class ResponsesText(_Strict):
    format: Optional[ResponsesTextFormat] = Field(None, description="the output format; default text")
    verbosity: Optional[Literal["low", "medium", "high"]] = Field(None, description="only medium (the default) "
                                                                                    "is supported")


class ResponsesStreamOptions(_Strict):
    include_obfuscation: Optional[bool] = Field(None, description="accepted either way; events are never padded")


class ResponsesRequest(_Strict):
    """POST /v1/responses. Stateless: nothing is stored, so nothing can be retrieved or continued."""

    model: Optional[str] = Field(None, description="served model name; omitted = the default generation model")
    input: Optional[Union[str, list[dict[str, Any]]]] = Field(None, description="required: " + INPUT_DOC)
    instructions: Optional[str] = Field(None, description="a system message placed before the input")
    max_output_tokens: Optional[int] = Field(None, ge=1, description="limit on generated tokens; reaching it "
                                                                     "makes the response incomplete")
    temperature: Optional[float] = Field(None, ge=0, le=2, description="0 = greedy; default 1")
    top_p: Optional[float] = Field(None, gt=0, le=1)
    text: Optional[ResponsesText] = None
    tools: Optional[list[dict[str, Any]]] = Field(
        None, description="function tools only: `{\"type\": \"function\", \"name\", \"description\"?, \"parameters\"?, "
                          "\"strict\"?}`")
    tool_choice: Optional[Union[str, dict[str, Any]]] = Field(
        None, description="\"none\", \"auto\" (default), \"required\" or `{\"type\": \"function\", \"name\"}`")
    parallel_tool_calls: Optional[bool] = Field(None, description="default true")
    stream: bool = False
    stream_options: Optional[ResponsesStreamOptions] = None
    metadata: Optional[dict[str, str]] = Field(None, description="echoed in the response; not stored")
    user: Optional[str] = Field(None, description="accepted for compatibility; not used")
    safety_identifier: Optional[str] = Field(None, description="accepted for compatibility; not used")
    prompt_cache_key: Optional[str] = Field(None, description="accepted; prefix caching is automatic")
    service_tier: Optional[str] = Field(None, description="only auto / default")
    truncation: Optional[Literal["auto", "disabled"]] = Field(None, description="only disabled (the default): "
                                                                                "a too long input is refused")
    # stateful or unimplemented: accepted only at the neutral value, refused by name otherwise
    store: Optional[bool] = Field(None, description="only false (or omitted): responses are never stored")
    previous_response_id: Optional[str] = Field(None, description="not supported (nothing is stored); send the "
                                                                  "whole conversation as input")
    conversation: Optional[Union[str, dict[str, Any]]] = Field(None, description="not supported (nothing is stored)")
    background: Optional[bool] = Field(None, description="only false")
    include: Optional[list[str]] = Field(None, description="only empty")
    reasoning: Optional[dict[str, Any]] = Field(None, description="not supported")
    max_tool_calls: Optional[int] = Field(None, description="not supported")
    top_logprobs: Optional[int] = Field(None, description="only 0")
    prompt: Optional[dict[str, Any]] = Field(None, description="not supported (no stored prompt templates)")
