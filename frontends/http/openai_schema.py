"""The OpenAI wire schema: the error envelope and the strict request models of /v1/completions,
/v1/chat/completions and /v1/embeddings (openai.py serves them).

Strict (`extra="forbid"`): a field we do not implement is refused with a 400 that names it
instead of being dropped; fields OpenAI defines that we accept only at their neutral value are
declared here and checked by the routes.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from jax_engine.errors import InvalidRequest

# ----------------------------------------------------------------------------- error envelope

# OpenAI's `error.type` per HTTP status (the engine-error -> status mapping lives in
# frontends/common/errors.py; this only names the status the way OpenAI clients expect).
_ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


def openai_error_body(status: int, message: str, *, param: Optional[str] = None,
                      code: Optional[str] = None) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}` as OpenAI returns it."""
    return {"error": {"message": message, "type": _ERROR_TYPE.get(status, "internal_error"
                                                                  if status >= 500 else "invalid_request_error"),
                      "param": param, "code": code}}


def field_error(param: Optional[str], message: str) -> InvalidRequest:
    """InvalidRequest that also carries the OpenAI `param` (the offending field)."""
    err = InvalidRequest(message)
    err.param = param  # type: ignore[attr-defined]
    return err


# ----------------------------------------------------------------------------- request models


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaSpec(_Strict):
    """OpenAI `response_format.json_schema`."""

    name: str = Field(..., description="the schema's name (required by OpenAI; not used otherwise)")
    description: Optional[str] = Field(None, description="accepted; not used")
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema", description="the JSON Schema the output matches")
    strict: Optional[bool] = Field(None, description="accepted either way: the schema is always enforced")


class ResponseFormat(_Strict):
    """OpenAI `response_format`: text (no constraint), json_object (any JSON object) or
    json_schema (`json_schema.schema` enforced, whatever `strict` says)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaSpec] = Field(None, description="required with type json_schema, only then")


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object,
    structural_tag. The options that tune vLLM's JSON grammar are accepted only at their neutral
    value (the engine's grammar library has no such knobs); disable_fallback is accepted either
    way (there is one grammar backend, so nothing falls back)."""

    json_: Optional[Union[dict[str, Any], str]] = Field(None, alias="json",
                                                        description="a JSON Schema: an object, or its JSON text")
    regex: Optional[str] = Field(None, description="a regular expression the whole output matches")
    choice: Optional[list[str]] = Field(None, description="the output is exactly one of these strings")
    grammar: Optional[str] = Field(None, description="an EBNF / GBNF grammar (`root ::= ...`)")
    json_object: Optional[bool] = Field(None, description="true: any JSON object")
    structural_tag: Optional[str] = Field(None, description="a structural tag (JSON text: structures and triggers)")
    disable_fallback: Optional[bool] = None
    disable_any_whitespace: Optional[bool] = Field(
        None, description="JSON output is compact (no whitespace between tokens) unless this is explicitly false")
    disable_additional_properties: Optional[bool] = Field(
        None, description="only false is accepted (set additionalProperties in the schema)")
    whitespace_pattern: Optional[str] = Field(None, description="not supported: leave unset")

    @field_validator("json_", mode="before")
    @classmethod
    def _json_shape(cls, value: Any) -> Any:
        # Checked here so that the error names `structured_outputs.json`, not a union member.
        if value is not None and not isinstance(value, (dict, str)):
            raise ValueError("must be a JSON Schema object or its JSON text (a string)")
        return value


class SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[str] = Field(None, description="served model name; omitted = the default generation model")
    n: int = Field(1, ge=1, description="sequences per prompt")
    temperature: Optional[float] = Field(None, ge=0, le=2, description="0 = greedy; default 1")
    top_p: Optional[float] = Field(None, gt=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: Optional[dict[str, float]] = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**64,
                                description="int64 as in OpenAI (negatives are read as two's complement, "
                                            "seed mod 2^64) or any unsigned 64-bit value")
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = Field(None, description="accepted for compatibility; not used")
    # vLLM / SGLang extensions
    top_k: Optional[int] = Field(None, ge=-1, description="0 or -1 = off")
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured generation: at most one of the two may set a constraint
    response_format: Optional[ResponseFormat] = Field(None, description="OpenAI output format (also on completions, "
                                                                        "as in vLLM)")
    structured_outputs: Optional[StructuredOutputs] = Field(None, description="vLLM's structured outputs")


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=1, description="OpenAI default 16; null = up to the context")
    logprobs: Optional[int] = Field(None, ge=0, description="top-N alternatives per token")
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class TextPart(BaseModel):
    """A content part. Extra keys are kept (not forbidden) so that a non-text part is refused by
    its `type` first; `_message_text` then refuses any unknown key of a text part by name."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None


class ToolCallFunction(_Strict):
    name: str = Field(..., description="the function called")
    arguments: str = Field(..., description="its arguments: a JSON object as text")


class MessageToolCall(_Strict):
    """A tool call of an earlier assistant message (as the server returned it)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class FunctionDefinition(_Strict):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$", description="letters, digits, _ and -; at most 64")
    description: Optional[str] = Field(None, description="shown to the model through the chat template")
    parameters: Optional[dict[str, Any]] = Field(None, description="JSON Schema of the arguments (default: an "
                                                                   "object with any properties)")
    strict: Optional[bool] = Field(None, description="accepted either way: the schema is enforced under "
                                                     "tool_choice required / named, never under auto")


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """Force a call of this function (its arguments generated under its schema)."""

    type: Literal["function"]
    function: NamedToolFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[MessageToolCall]] = Field(None, description="assistant messages: the calls it made")
    tool_call_id: Optional[str] = Field(None, description="tool messages: the call this answers")
    reasoning_content: Optional[str] = Field(None, description="assistant messages: their reasoning, passed to the "
                                                               "chat template (which may drop it)")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = Field(None, ge=1, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0)
    tools: Optional[list[ChatTool]] = Field(None, description="functions the model may call; the chat template "
                                                               "gets them")
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = Field(
        None, description='none: no calls; auto (default with tools): parsed by the server\'s --tool-call-parser; '
                          'required / named: generated under a constraint, so the calls always parse')
    parallel_tool_calls: Optional[bool] = Field(None, description="false: at most one call (only with tools)")
    chat_template_kwargs: Optional[dict[str, Any]] = Field(
        None, description="extra chat template variables; allowed keys: enable_thinking, thinking (booleans)")
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    modalities: Optional[list[str]] = None


class EmbeddingRequest(_Strict):
    input: Union[str, list[str], list[int], list[list[int]]]
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1)
    user: Optional[str] = Field(None, description="accepted for compatibility; not used")
