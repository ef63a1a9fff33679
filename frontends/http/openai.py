"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions, /v1/embeddings.

LoRA: `model` may name a loaded adapter (`_resolve_generate`, shared with /v1/responses): the
request runs on the adapter's base model, with that model's tokenizer and chat template, and the
answer's `model` is the adapter's name. /v1/models lists adapters with `parent` and `root`, as
vLLM does; loading and unloading them at run time: lora_admin.py.

The request models (openai_schema.py) are strict: a field we do not implement is refused with a
400 that names it. Fields OpenAI defines that we only accept at their neutral value (`echo`,
`suffix`, `best_of`, ...) are declared so the client may send the
neutral value, and anything else is refused by `_refuse_unsupported`.

Structured generation: OpenAI `response_format` and vLLM's `structured_outputs` (both routes)
become one `Constraint` on the engine request (`_output_constraint`); the engine compiles it and
refuses a grammar it cannot compile, which is a 400 naming the field it came from.

Tool calling and reasoning (chat): tool_calls.py and reasoning.py; the route only wires them in
(`plan_tools`, the template arguments of `_render_chat`, `ChatOutput` behind `_Shape`).

Every route reads the engine from `request.app.state.engine` (several apps may live in one
process). Engine errors propagate to the app's exception handlers, which format them with
`openai_error_body`.
"""
from __future__ import annotations

import asyncio
import base64
import json
import math
import re
import time
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator, Callable, Optional, Union

import anyio
import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from frontends.common.errors import code_name, error_message, grpc_code, http_status
from frontends.http.openai_schema import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    EmbeddingRequest,
    ResponseFormat,
    SamplingFields,
    StructuredOutputs,
    field_error,
    openai_error_body,
)
from frontends.http.reasoning import prompt_opens_thinking, template_kwargs
from frontends.http.tool_calls import ChatOutput, ToolPlan, chat_tool_constraint, plan_tools, template_message
from frontends.http.tool_calls import finish_reason as tool_finish_reason
from jax_engine.api import TOKENIZE_INLINE_CHARS, EngineAPI, Tokenizer
from jax_engine.errors import (
    AlreadyExists,
    EngineError,
    Internal,
    InvalidRequest,
    NotFound,
    Overloaded,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from jax_engine.types import (
    AdapterInfo,
    Constraint,
    EmbedRequest,
    GenerateOutput,
    GenerateRequest,
    ModelInfo,
    SamplingParams,
)

# ----------------------------------------------------------------------------- helpers

_LOGPROB_FLOOR = -9999.0  # JSON has no -inf


def _finite(x: float) -> float:
    return x if math.isfinite(x) else _LOGPROB_FLOOR


def _engine(request: Request) -> EngineAPI:
    return request.app.state.engine


def _check_serving(engine: EngineAPI) -> None:
    # Before load_all finishes the engine has no models, so resolving a name would say 404;
    # the truthful answer for starting / draining / failed workers is 503.
    if not engine.ready():
        if engine.draining:
            raise Unavailable("server is draining; not accepting new requests")
        raise Unavailable("server is not ready (models are loading or a worker failed)")


def _resolve(engine: EngineAPI, name: Optional[str], task: str) -> ModelInfo:
    _check_serving(engine)
    try:
        return engine.model_info(name or None, task)
    except EngineError as e:
        e.param = "model"  # type: ignore[attr-defined]
        raise


def _resolve_generate(engine: EngineAPI, name: Optional[str]) -> tuple[ModelInfo, Optional[str]]:
    """`model` of a generation request (completions, chat, responses): a served model, or the
    name of a loaded LoRA adapter, which runs on its base model (that model's tokenizer and chat
    template). Returns (the model, the adapter or None); unknown names are 404 (param `model`)."""
    _check_serving(engine)
    adapter = _adapter_named(engine, name)
    if adapter is not None:
        if adapter.state != "loaded":
            err = NotFound(f"LoRA adapter {name!r} is being unloaded")
            err.param = "model"  # type: ignore[attr-defined]
            raise err
        return _resolve(engine, adapter.model, "generate"), name
    return _resolve(engine, name, "generate"), None


def _adapter_named(engine: EngineAPI, name: Optional[str]) -> Optional[AdapterInfo]:
    """The loaded LoRA adapter called `name` when no served model is (model names win)."""
    if not name or any(m.name == name for m in engine.models()):
        return None
    return next((a for a in engine.adapters() if a.name == name), None)


def _set_outcome(request: Request, outcome: str) -> None:
    request.state.outcome = outcome


def _refuse_unsupported(body: BaseModel) -> None:
    """400 for OpenAI fields we accept only at their neutral value."""
    neutral = {
        "echo": (False,),
        "suffix": (None, ""),
        "store": (None, False),
        "metadata": (None, {}),
        "service_tier": (None, "auto", "default"),
        "modalities": (None, ["text"]),
    }
    for name, allowed in neutral.items():
        if name in type(body).model_fields and getattr(body, name) not in allowed:
            raise field_error(name, f"{name}={getattr(body, name)!r} is not supported by this server")
    if isinstance(body, CompletionRequest):
        _check_best_of(body)
    if isinstance(body, ChatCompletionRequest):  # the tool fields: plan_tools (tool_calls.py)
        _check_max_tokens_pair(body)
    if body.stream_options is not None and not body.stream:
        raise field_error("stream_options", "stream_options is only allowed when stream is true")


def _check_best_of(body: CompletionRequest) -> None:
    """OpenAI's best_of generates best_of candidates and returns the n with the highest mean
    logprob, so best_of == n returns every candidate: exactly n sequences, which is what runs.
    best_of < n is invalid (as in OpenAI); best_of > n (candidate ranking) is not implemented."""
    if body.best_of is None or body.best_of == body.n:
        return
    if body.best_of < body.n:
        raise field_error("best_of", f"best_of must be at least n (got best_of={body.best_of}, n={body.n})")
    raise field_error("best_of", f"best_of > n is not supported (got best_of={body.best_of}, n={body.n}): "
                                 "candidates are not ranked; use n")


def _check_max_tokens_pair(body: ChatCompletionRequest) -> None:
    """max_tokens is OpenAI's deprecated alias of max_completion_tokens: both may be sent only
    with the same value (no silent choice between two different limits)."""
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise field_error("max_tokens", f"max_tokens ({body.max_tokens}) and max_completion_tokens "
                                        f"({body.max_completion_tokens}) differ; send only max_completion_tokens")


def _sampling_params(engine: EngineAPI, body: SamplingFields, *, max_tokens: Optional[int],
                     logprobs: bool, top_logprobs: int, top_logprobs_field: str) -> SamplingParams:
    # The engine validates every limit again (n, stop strings, stop ids, ...) and names those
    # fields itself; checked here are the fields whose OpenAI names differ from the engine's.
    args = engine.args
    if body.n > args.max_n:  # before anything is allocated per choice (vLLM GHSA-3mwp-wvh9-7528)
        raise field_error("n", f"n must be at most {args.max_n} (got {body.n})")
    if top_logprobs > args.max_top_logprobs:
        raise field_error(top_logprobs_field,
                          f"{top_logprobs_field} must be at most {args.max_top_logprobs} (got {top_logprobs})")
    if max_tokens is not None and max_tokens > args.max_new_tokens_limit:
        raise field_error("max_tokens",
                          f"max_tokens must be at most {args.max_new_tokens_limit} (got {max_tokens})")
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            tid = int(key)
        except ValueError:
            raise field_error("logit_bias", f"logit_bias key {key!r} is not a token id") from None
        if not -100 <= value <= 100:
            raise field_error("logit_bias", f"logit_bias values must lie in [-100, 100] (got {value})")
        bias[tid] = value
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        max_new_tokens=max_tokens,
        min_new_tokens=body.min_tokens,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logit_bias=bias,
        seed=None if body.seed is None else body.seed % 2**64,  # two's complement: -1 -> 2^64 - 1
        n=body.n,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        constraint=_output_constraint(body),
    )


# vLLM structured_outputs keys that set a constraint -> the engine's Constraint kind
_STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf",
                     "json_object": "json_object", "structural_tag": "structural_tag"}


def _structured_keys(so: StructuredOutputs) -> list[str]:
    """The constraint keys a structured_outputs object sets (`json` is the `json_` attribute)."""
    return [k for k in _STRUCTURED_KINDS if getattr(so, "json_" if k == "json" else k) is not None]


def _output_constraint(body: SamplingFields) -> Optional[Constraint]:
    """The engine constraint of `response_format` / `structured_outputs`, or None (free text).
    A malformed one is a 400 naming its field; two constraints at once, a 400 naming both."""
    found: list[tuple[str, Constraint]] = []
    if body.response_format is not None:
        c = _response_format_constraint(body.response_format)
        if c is not None:
            found.append(("response_format", c))
    if body.structured_outputs is not None:
        found.append(_structured_outputs_constraint(body.structured_outputs))
    tools = chat_tool_constraint(body)  # tool_choice required / named (chat only)
    if tools is not None:
        found.append(("tool_choice", tools))
    if len(found) > 1:
        (first, _), (second, _) = found
        raise field_error(second, f"{first} and {second} both constrain the output; send only one of them")
    return found[0][1] if found else None


def _response_format_constraint(rf: ResponseFormat) -> Optional[Constraint]:
    """text: none; json_object: any JSON object; json_schema: the schema, enforced whether
    `strict` is true or false (a constrained decoder has no cheaper "best effort" mode)."""
    if rf.type != "json_schema":
        if rf.json_schema is not None:
            raise field_error("response_format.json_schema",
                              f"response_format.json_schema is only allowed with type json_schema (type is {rf.type!r})")
        return None if rf.type == "text" else Constraint(kind="json_object")
    if rf.json_schema is None:
        raise field_error("response_format.json_schema", "response_format.json_schema is required with type json_schema")
    if rf.json_schema.schema_ is None:
        raise field_error("response_format.json_schema.schema",
                          "response_format.json_schema.schema is required: the JSON Schema the output must match")
    return Constraint(kind="json_schema", spec=json.dumps(rf.json_schema.schema_))


def _structured_outputs_constraint(so: StructuredOutputs) -> tuple[str, Constraint]:
    """(`structured_outputs.<key>`, its constraint) for the one key set."""
    if so.whitespace_pattern is not None:
        raise field_error("structured_outputs.whitespace_pattern",
                          "structured_outputs.whitespace_pattern is not supported by this server")
    if so.disable_additional_properties:
        raise field_error("structured_outputs.disable_additional_properties",
                          "structured_outputs.disable_additional_properties=true is not supported by this server "
                          "(set additionalProperties in the schema)")
    # JSON is compact unless the request asks for vLLM's default of any whitespace (false, explicitly)
    any_ws = so.disable_any_whitespace is False
    keys = _structured_keys(so)
    if len(keys) != 1:
        got = " and ".join(f"structured_outputs.{k}" for k in keys) if keys else "none"
        raise field_error("structured_outputs", "structured_outputs must set exactly one of "
                                                f"{', '.join(_STRUCTURED_KINDS)} (got {got})")
    key = keys[0]
    where = f"structured_outputs.{key}"
    kind = _STRUCTURED_KINDS[key]
    if key == "json_object":
        if so.json_object is not True:
            raise field_error(where, f"{where} must be true when given (false sets no constraint; omit it)")
        return where, Constraint(kind=kind, any_whitespace=any_ws)
    if key == "choice":
        return where, Constraint(kind=kind, choices=list(so.choice or []))
    value = so.json_ if key == "json" else getattr(so, key)
    return where, Constraint(kind=kind, spec=json.dumps(value) if isinstance(value, dict) else value, any_whitespace=any_ws)


def _constraint_field(body: SamplingFields) -> Optional[str]:
    """The request field an (already validated) output constraint came from, for error messages."""
    if body.structured_outputs is not None:
        return f"structured_outputs.{_structured_keys(body.structured_outputs)[0]}"
    if chat_tool_constraint(body) is not None:
        return "tools"
    if body.response_format is not None and body.response_format.type != "text":
        return "response_format"
    return None


def _check_token_ids(ids: list[int], vocab_size: int, field: str) -> None:
    if not ids:
        raise field_error(field, f"{field} must not be empty")
    for t in ids:
        if not 0 <= t < vocab_size:
            raise field_error(field, f"{field} has token id {t} outside the vocabulary (size {vocab_size})")


_ERRORS_BY_KIND = {cls.kind: cls for cls in (InvalidRequest, NotFound, AlreadyExists, Overloaded, Unavailable,
                                              Internal, PermissionDenied, Unauthenticated)}


def _error_from_event(ev: GenerateOutput) -> EngineError:
    """Rebuild the typed engine error a stream ended with (finish_reason "error")."""
    return _ERRORS_BY_KIND.get(ev.error_kind or "internal", Internal)(ev.error or "generation failed")


class _ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, coro):
    """Run `coro`; cancel it (which closes engine streams, i.e. aborts) if the client leaves."""
    work = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if work in done:
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    raise _ClientGone()


def _gone() -> Response:
    return Response(status_code=499)  # nobody reads it; the status marks the request cancelled


# ----------------------------------------------------------------------------- generation


class _Generation:
    """The engine streams of one HTTP request (one per prompt), merged.

    `start()` submits every prompt and waits for each stream's first event, so admission
    errors (overload, bad input) surface before any HTTP response starts. Latency metrics are
    observed by the instrumented engine (frontends/http/app.py), not here.
    Choice index = prompt index * n + sequence index.
    """

    _END = object()

    def __init__(self, engine: EngineAPI, reqs: list[GenerateRequest], n: int):
        self.engine = engine
        self.reqs = reqs
        self.n = n
        self._gens: list = []
        self._firsts: list = []
        self._tasks: list[asyncio.Task] = []
        self.finished_choices = 0

    async def start(self) -> None:
        self._gens = [self.engine.generate(r) for r in self.reqs]

        async def first(gen):
            try:
                return await gen.__anext__()
            except StopAsyncIteration:
                return self._END

        results = await asyncio.gather(*(first(g) for g in self._gens), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.aclose()
            raise next((e for e in errors if isinstance(e, EngineError)), errors[0])
        self._firsts = list(results)

    async def events(self) -> AsyncIterator[tuple[int, GenerateOutput]]:
        """(choice index, event) pairs."""
        async for p, ev in self._merged():
            if ev.finished:
                self.finished_choices += 1
            yield p * self.n + ev.index, ev

    @property
    def complete(self) -> bool:
        return self.finished_choices >= len(self.reqs) * self.n

    async def _merged(self) -> AsyncIterator[tuple[int, GenerateOutput]]:
        live = [i for i, f in enumerate(self._firsts) if f is not self._END]
        for i in live:
            yield i, self._firsts[i]
        if len(self._gens) == 1:
            if live:
                async for ev in self._gens[0]:
                    yield 0, ev
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for ev in self._gens[i]:
                    queue.put_nowait((i, ev))
                queue.put_nowait((i, self._END))
            except Exception as e:  # delivered to the consumer
                queue.put_nowait((i, e))

        self._tasks = [asyncio.ensure_future(pump(i)) for i in live]
        remaining = len(live)
        while remaining:
            i, item = await queue.get()
            if item is self._END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item

    async def aclose(self) -> None:
        """Abort whatever is still running (closing an engine stream aborts its request)."""
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for g in self._gens:
            try:
                await g.aclose()
            except Exception:  # already finished or failed: nothing left to abort
                pass


class _TokenText:
    """Per-request cache of single-token strings for logprobs output."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        s = self.cache.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid])
            self.cache[tid] = s
        return s


class _Choice:
    """What one sequence (choice) has produced so far."""

    def __init__(self, index: int):
        self.index = index
        self.text: list[str] = []
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[Union[int, str]] = None
        self.completion_tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        # completions-style logprobs
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top_logprobs: list[dict[str, float]] = []
        self.text_offset: list[int] = []
        self.chars = 0
        # chat-style logprobs
        self.content: list[dict[str, Any]] = []

    def absorb(self, ev: GenerateOutput) -> None:
        self.text.append(ev.new_text)
        self.completion_tokens = max(self.completion_tokens, ev.completion_tokens)
        self.prompt_tokens = max(self.prompt_tokens, ev.prompt_tokens)
        self.cached_tokens = max(self.cached_tokens, ev.cached_tokens)
        if ev.finished:
            self.finish_reason = ev.finish_reason
            self.stop_reason = ev.matched_stop


def _finish_reason(reason: Optional[str]) -> Optional[str]:
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(reason or "", reason)


def _completion_logprobs(ev: GenerateOutput, choice: _Choice, text_of: _TokenText, top_n: int) -> dict[str, Any]:
    """OpenAI legacy logprobs for the tokens of one event (appended to `choice` as well)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, lp in zip(ev.new_token_ids, ev.logprobs or []):
        s = text_of(tid)
        top = {text_of(t): _finite(v) for t, v in lp.top[:top_n]}
        top.setdefault(s, _finite(lp.logprob))
        out["tokens"].append(s)
        out["token_logprobs"].append(_finite(lp.logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(choice.chars)
        choice.chars += len(s)
    choice.tokens += out["tokens"]
    choice.token_logprobs += out["token_logprobs"]
    choice.top_logprobs += out["top_logprobs"]
    choice.text_offset += out["text_offset"]
    return out


def _chat_logprobs(ev: GenerateOutput, choice: _Choice, text_of: _TokenText, top_n: int) -> list[dict[str, Any]]:
    def entry(tid: int, lp: float) -> dict[str, Any]:
        s = text_of(tid)
        return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode("utf-8"))}

    out = []
    for tid, lp in zip(ev.new_token_ids, ev.logprobs or []):
        e = entry(tid, lp.logprob)
        e["top_logprobs"] = [entry(t, v) for t, v in lp.top[:top_n]]
        out.append(e)
    choice.content += out
    return out


def _usage(choices: list[_Choice], n: int) -> dict[str, Any]:
    # Prompt tokens count once per prompt, not once per sampled sequence.
    prompt = sum(c.prompt_tokens for c in choices[::n])
    cached = sum(c.cached_tokens for c in choices[::n])
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# Characters that str.splitlines() (and clients built on it, httpx's iter_lines among them) take
# for line breaks although SSE does not; json.dumps(ensure_ascii=False) leaves them raw, so a
# generated U+2028 split one event in two for such a client. Escaped, the JSON is the same value.
_LINE_BREAKS = {"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def _sse(obj: Any) -> bytes:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    for ch, esc in _LINE_BREAKS.items():
        text = text.replace(ch, esc)
    return b"data: " + text.encode() + b"\n\n"


# ----------------------------------------------------------------------------- routes

router = APIRouter(prefix="/v1", tags=["OpenAI-compatible"])

_ERROR_RESPONSES: dict[Union[int, str], dict[str, Any]] = {
    400: {"description": "malformed or unsupported request (names the field)"},
    401: {"description": "missing or wrong API key"},
    404: {"description": "unknown model"},
    408: {"description": "the request body did not arrive in time"},
    413: {"description": "request body too large"},
    429: {"description": "queue full; see Retry-After"},
    500: {"description": "internal failure (e.g. a failed model step); no traceback"},
    503: {"description": "starting, draining, or the model's worker is down"},
}


def _model_card(info: ModelInfo, created: int) -> dict[str, Any]:
    random = info.random_weights
    return {
        "id": info.name,
        "object": "model",
        "created": created,
        "owned_by": "xlaserve-demo-random-weights" if random else "xlaserve",
        "root": info.path,
        "parent": None,            # vLLM's shape: a LoRA adapter names its base model here
        "task": info.task,
        "architecture": info.architecture,
        "max_model_len": info.max_model_len,
        "random_weights": random,
        "ready": info.ready,
    }


def _adapter_card(adapter: AdapterInfo, base: Optional[ModelInfo], created: int) -> dict[str, Any]:
    """A loaded LoRA adapter as vLLM lists it: `parent` = its base model, `root` = its folder."""
    return {
        "id": adapter.name,
        "object": "model",
        "created": created,
        "owned_by": "xlaserve",
        "root": adapter.path,
        "parent": adapter.model,
        "task": "generate",
        "architecture": base.architecture if base else "",
        "max_model_len": base.max_model_len if base else 0,
        "random_weights": bool(base and base.random_weights),
        "ready": bool(base and base.ready),
    }


def _cards(engine: EngineAPI) -> list[dict[str, Any]]:
    """Every model, then every loaded adapter (those being unloaded take no new requests)."""
    created = int(engine.start_time)
    infos = engine.models()
    by_name = {i.name: i for i in infos}
    cards = [_model_card(i, created) for i in infos]
    cards += [_adapter_card(a, by_name.get(a.model), created) for a in engine.adapters() if a.state == "loaded"]
    return cards


@router.get("/models", responses=_ERROR_RESPONSES)
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": _cards(_engine(request))}


@router.get("/models/{model_id:path}", responses=_ERROR_RESPONSES)
async def retrieve_model(request: Request, model_id: str) -> dict[str, Any]:
    for card in _cards(_engine(request)):
        if card["id"] == model_id:
            return card
    err = NotFound(f"model {model_id!r} is not served")
    err.param = "model"  # type: ignore[attr-defined]
    raise err


@router.post("/completions", responses=_ERROR_RESPONSES)
async def create_completion(request: Request, body: CompletionRequest) -> Response:
    engine = _engine(request)
    _refuse_unsupported(body)
    info, adapter = _resolve_generate(engine, body.model)
    prompts: list[Union[str, list[int]]]
    p = body.prompt
    if isinstance(p, str):
        prompts = [p]
    elif p and isinstance(p[0], int):
        prompts = [list(p)]  # type: ignore[arg-type]
    else:
        prompts = list(p)  # type: ignore[arg-type]
    if not prompts:
        raise field_error("prompt", "prompt must not be empty")
    if len(prompts) > engine.args.max_embed_inputs:
        raise field_error("prompt", f"at most {engine.args.max_embed_inputs} prompts per request (got {len(prompts)})")
    for i, pr in enumerate(prompts):
        if isinstance(pr, str):
            if not pr:
                raise field_error("prompt", f"prompt[{i}] is empty" if len(prompts) > 1 else "prompt is empty")
        else:
            _check_token_ids(pr, info.vocab_size, "prompt")
    top_n = body.logprobs or 0
    params = _sampling_params(engine, body, max_tokens=body.max_tokens, logprobs=body.logprobs is not None,
                              top_logprobs=top_n, top_logprobs_field="logprobs")
    rid = "cmpl-" + uuid.uuid4().hex
    reqs = [_make_request(rid, i, len(prompts), pr, params, info.name, adapter) for i, pr in enumerate(prompts)]
    shape = _Shape(chat=False, text_of=_TokenText(engine.tokenizer(info.name, "generate")),
                   logprobs=params.logprobs, top_n=top_n)
    return await _respond(request, engine, reqs, body, shape, rid=rid, model=adapter or info.name)


@router.post("/chat/completions", responses=_ERROR_RESPONSES)
async def create_chat_completion(request: Request, body: ChatCompletionRequest) -> Response:
    engine = _engine(request)
    _refuse_unsupported(body)
    info, adapter = _resolve_generate(engine, body.model)
    tokenizer = engine.tokenizer(info.name, "generate")
    state = request.app.state
    plan = plan_tools(body, getattr(state, "tool_call_parser", None))
    reasoning = getattr(state, "reasoning_parser", None)
    render = (tokenizer, body.messages, info, plan, template_kwargs(body.chat_template_kwargs))
    if _chat_chars(body.messages) > TOKENIZE_INLINE_CHARS:
        # rendering and tokenizing a long conversation takes a while: off the event loop
        prompt_ids = await asyncio.to_thread(_render_chat, *render)
    else:
        prompt_ids = _render_chat(*render)
    if body.top_logprobs is not None and not body.logprobs:
        raise field_error("top_logprobs", "top_logprobs requires logprobs to be true")
    top_n = body.top_logprobs or 0
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = _sampling_params(engine, body, max_tokens=max_tokens, logprobs=body.logprobs,
                              top_logprobs=top_n, top_logprobs_field="top_logprobs")
    output = None
    if plan.active or reasoning:  # the answer is parsed into reasoning_content / tool_calls (tool_calls.py)
        # mistral's [TOOL_CALLS] marker is a special token: kept in the text, and so is the EOS, dropped again
        params.skip_special_tokens &= plan.parser != "mistral"
        eos = [tokenizer.decode([t]) for t in info.eos_token_ids] if not params.skip_special_tokens else []
        opened = reasoning is not None and prompt_opens_thinking(tokenizer.decode(prompt_ids[-16:]))

        def output() -> ChatOutput:
            return ChatOutput(plan=plan, reasoning_parser=reasoning, prompt_opened=opened, drop_suffixes=eos)
    rid = "chatcmpl-" + uuid.uuid4().hex
    reqs = [_make_request(rid, 0, 1, prompt_ids, params, info.name, adapter)]
    shape = _Shape(chat=True, text_of=_TokenText(tokenizer), logprobs=params.logprobs, top_n=top_n, output=output)
    return await _respond(request, engine, reqs, body, shape, rid=rid, model=adapter or info.name)


class _Shape:
    """What differs between /v1/completions and /v1/chat/completions output."""

    def __init__(self, *, chat: bool, text_of: _TokenText, logprobs: bool, top_n: int,
                 output: Optional[Callable[[], ChatOutput]] = None):
        self.chat, self.text_of, self.logprobs, self.top_n = chat, text_of, logprobs, top_n
        self.output = output              # chat answers parsed into reasoning / tool calls
        self._outputs: dict[int, ChatOutput] = {}
        self.final_object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def add_logprobs(self, ev: GenerateOutput, choice: _Choice) -> Any:
        """This event's logprobs in the route's format (also accumulated on `choice`)."""
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": _chat_logprobs(ev, choice, self.text_of, self.top_n)}
        return _completion_logprobs(ev, choice, self.text_of, self.top_n)

    def prelude(self, choice: _Choice) -> Optional[dict[str, Any]]:
        """Chat streams announce the assistant role first, as OpenAI does."""
        if not self.chat:
            return None
        return {"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def delta(self, ev: GenerateOutput, choice: _Choice, logprobs: Any) -> Optional[dict[str, Any]]:
        """This event's chunk item; None when a parsed chat answer holds all of it back."""
        item: dict[str, Any] = {"index": choice.index}
        finish = _finish_reason(choice.finish_reason)
        if self.output is not None:
            out = self._outputs.get(choice.index)
            if out is None:
                out = self._outputs[choice.index] = self.output()
            item["delta"] = out.step(ev.new_text, final=ev.finished)
            if not (item["delta"] or ev.finished or logprobs is not None):
                return None
            finish = tool_finish_reason(finish, out.finishes_with_calls)
        elif self.chat:
            item["delta"] = {"content": ev.new_text} if ev.new_text or not ev.finished else {}
        else:
            item["text"] = ev.new_text
        item["logprobs"] = logprobs
        item["finish_reason"] = finish if ev.finished else None
        if ev.finished:
            item["stop_reason"] = choice.stop_reason
        return item

    def final(self, c: _Choice) -> dict[str, Any]:
        item: dict[str, Any] = {"index": c.index}
        finish = _finish_reason(c.finish_reason)
        if self.output is not None:
            out = self.output()
            item["message"] = out.message("".join(c.text))
            finish = tool_finish_reason(finish, out.finishes_with_calls)
        elif self.chat:
            item["message"] = {"role": "assistant", "content": "".join(c.text)}
        if self.chat:
            item["logprobs"] = {"content": c.content} if self.logprobs else None
        else:
            item["text"] = "".join(c.text)
            item["logprobs"] = ({"tokens": c.tokens, "token_logprobs": c.token_logprobs,
                                 "top_logprobs": c.top_logprobs, "text_offset": c.text_offset}
                                if self.logprobs else None)
        item["finish_reason"] = finish
        item["stop_reason"] = c.stop_reason
        return item


def _engine_field_names(body: SamplingFields) -> dict[str, str]:
    """Engine field name -> the name this route's request uses for it."""
    if isinstance(body, ChatCompletionRequest):
        max_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        return {"max_new_tokens": max_name, "min_new_tokens": "min_tokens", "prompt_ids": "messages",
                "prompt": "messages"}
    return {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "top_logprobs": "logprobs",
            "prompt_ids": "prompt"}


def _openai_field_error(err: InvalidRequest, renames: dict[str, str],
                        constraint_field: Optional[str] = None) -> InvalidRequest:
    """`err` with `param` set from its leading "field:" and the engine's field names replaced.
    The engine names a constraint by kind ("constraint.regex: why"); `constraint_field` is the
    request field it came from (`_constraint_field`)."""
    field, sep, rest = err.message.partition(":")
    if sep and constraint_field is not None and field.split(".")[0] == "constraint":
        return field_error(constraint_field, f"{constraint_field}:{rest}")
    if not sep or not field.isidentifier():
        return err
    message = err.message
    for engine_name, name in sorted(renames.items(), key=lambda kv: -len(kv[0])):
        message = re.sub(rf"\b{engine_name}\b", name, message)
    return field_error(renames.get(field, field), message)


async def _respond(request: Request, engine: EngineAPI, reqs: list[GenerateRequest], body: SamplingFields, shape: _Shape,
                   *, rid: str, model: str) -> Response:
    """Run the generation and answer as one JSON body or as an SSE stream."""
    gen = _Generation(engine, reqs, body.n)
    renames = _engine_field_names(body)

    async def start() -> None:
        try:
            await gen.start()
        except InvalidRequest as e:  # the engine names its own fields; say them the OpenAI way
            raise _openai_field_error(e, renames, _constraint_field(body)) from None

    created = int(time.time())
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    choices = [_Choice(i) for i in range(len(reqs) * body.n)]

    def envelope(obj: str, items: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": rid, "object": obj, "created": created, "model": model, "choices": items}

    if not body.stream:
        async def collect() -> dict[str, Any]:
            await start()
            try:
                async for idx, ev in gen.events():
                    choices[idx].absorb(ev)
                    if ev.finish_reason == "error":
                        raise _error_from_event(ev)
                    shape.add_logprobs(ev, choices[idx])
            finally:
                await gen.aclose()
            out = envelope(shape.final_object, [shape.final(c) for c in choices])
            out["usage"] = _usage(choices, body.n)
            return out

        try:
            return JSONResponse(await _unless_disconnected(request, collect()))
        except _ClientGone:
            return _gone()

    # Admission errors become a plain HTTP error before the stream starts; a client that leaves
    # while its prompt is prefilled aborts it here already.
    try:
        await _unless_disconnected(request, start())
    except _ClientGone:
        return _gone()

    def chunk(items: list[dict[str, Any]], usage: Any = None) -> bytes:
        c = envelope(shape.chunk_object, items)
        if include_usage:
            c["usage"] = usage
        return _sse(c)

    async def stream() -> AsyncIterator[bytes]:
        try:
            for c in choices:
                first = shape.prelude(c)
                if first is not None:
                    yield chunk([first])
            async for idx, ev in gen.events():
                c = choices[idx]
                c.absorb(ev)
                if ev.finish_reason == "error":
                    err = _error_from_event(ev)
                    _set_outcome(request, code_name(grpc_code(err)))
                    yield _sse(_stream_error(err))
                    break
                logprobs = shape.add_logprobs(ev, c)
                if ev.new_text or ev.finished or logprobs is not None:
                    item = shape.delta(ev, c, logprobs)
                    if item is not None:
                        yield chunk([item])
            else:
                if include_usage:
                    yield chunk([], _usage(choices, body.n))
            yield b"data: [DONE]\n\n"
        finally:
            if not gen.complete and getattr(request.state, "outcome", None) is None:
                _set_outcome(request, "cancelled")
            await _shielded_close(gen)

    return StreamingResponse(stream(), media_type="text/event-stream", headers=_SSE_HEADERS)


@router.post("/embeddings", responses=_ERROR_RESPONSES)
async def create_embeddings(request: Request, body: EmbeddingRequest):
    engine = _engine(request)
    info = _resolve(engine, body.model, "embed")
    inp = body.input
    texts: Optional[list[str]] = None
    token_ids: Optional[list[list[int]]] = None
    if isinstance(inp, str):
        texts = [inp]
    elif inp and isinstance(inp[0], int):
        token_ids = [list(inp)]  # type: ignore[arg-type]
    elif inp and isinstance(inp[0], list):
        token_ids = [list(x) for x in inp]  # type: ignore[union-attr]
    else:
        texts = list(inp)  # type: ignore[arg-type]
    count = len(texts if texts is not None else token_ids or [])
    if count == 0:
        raise field_error("input", "input must not be empty")
    if count > engine.args.max_embed_inputs:
        raise field_error("input", f"at most {engine.args.max_embed_inputs} inputs per request (got {count})")
    for i, t in enumerate(texts or []):
        if not t:
            raise field_error("input", f"input[{i}] is an empty string" if count > 1 else "input is an empty string")
    for ids in token_ids or []:
        _check_token_ids(ids, info.vocab_size, "input")
    dim = info.embedding_dim or info.hidden_size
    matryoshka = body.dimensions is not None and body.dimensions != dim and body.dimensions in info.matryoshka_dimensions
    if body.dimensions is not None and dim and body.dimensions != dim and not matryoshka:
        raise field_error("dimensions", _dimensions_refusal(info, dim, body.dimensions))
    req = EmbedRequest(request_id="embd-" + uuid.uuid4().hex, texts=texts, token_ids=token_ids, model=info.name,
                       dimensions=body.dimensions if matryoshka else None)
    try:
        out = await _unless_disconnected(request, engine.embed(req))
    except _ClientGone:
        return _gone()
    if out.embeddings is None:
        raise field_error("model", f"model {info.name!r} does not produce embeddings")
    vectors = np.asarray(out.embeddings, dtype=np.float32)
    if body.dimensions is not None and vectors.shape[1] != body.dimensions:
        raise field_error("dimensions", f"model {info.name!r} produces {vectors.shape[1]}-dimensional embeddings")
    data = []
    for i, v in enumerate(vectors):
        emb: Any = (base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
                    if body.encoding_format == "base64" else v.tolist())
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return JSONResponse({"object": "list", "data": data, "model": info.name,
                         "usage": {"prompt_tokens": out.prompt_tokens, "total_tokens": out.prompt_tokens}})


def _dimensions_refusal(info: ModelInfo, dim: int, asked: int) -> str:
    """Why `dimensions` cannot be served: the model's Matryoshka sizes, or that it has none."""
    sizes = info.matryoshka_dimensions
    if not sizes:
        return (f"model {info.name!r} produces {dim}-dimensional embeddings; dimensions={asked} (reduction) is not "
                "supported: its config.json declares no Matryoshka dimensions")
    listed = f"1 to {dim}" if sizes == list(range(1, dim + 1)) else ", ".join(map(str, sorted({*sizes, dim})))
    return f"model {info.name!r} (Matryoshka) supports dimensions {listed}; got {asked}"


# ----------------------------------------------------------------------------- small pieces

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _stream_error(err: EngineError) -> dict[str, Any]:
    return openai_error_body(http_status(err), error_message(err), code=code_name(grpc_code(err)))


async def _shielded_close(gen: _Generation) -> None:
    # The stream may be closing because its task was cancelled (client gone); the aborts must
    # still happen, so shield the cleanup from that cancellation.
    with anyio.CancelScope(shield=True):
        await gen.aclose()


def _make_request(rid: str, i: int, count: int, prompt: Union[str, list[int]], params: SamplingParams,
                  model: str, adapter: Optional[str] = None) -> GenerateRequest:
    req = GenerateRequest(request_id=rid if count == 1 else f"{rid}-{i}", params=replace(params), model=model,
                          adapter=adapter)
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_ids = prompt
    return req


def _chat_chars(messages: list[ChatMessage]) -> int:
    total = 0
    for m in messages:
        if isinstance(m.content, str):
            total += len(m.content)
        elif m.content:
            total += sum(len(p.text or "") for p in m.content)
    return total


def _message_text(m: ChatMessage, i: int) -> str:
    """A message's content as one string: text parts joined; any other part type, a text part
    without text, or an unknown key in a part is refused naming it."""
    if not isinstance(m.content, list):
        return m.content or ""
    parts = []
    for j, part in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        if part.type != "text" or part.text is None:
            raise field_error(f"{where}.type", f"content part type {part.type!r} is not supported (text only)")
        unknown = next(iter(part.model_extra or {}), None)
        if unknown is not None:
            raise field_error(f"{where}.{unknown}", f"{where}.{unknown}: unknown key in a text content part "
                                                    "(a text part has only 'type' and 'text')")
        parts.append(part.text)
    return "".join(parts)


def _render_chat(tokenizer: Tokenizer, messages: list[ChatMessage], info: ModelInfo, tools: Optional[ToolPlan] = None,
                 template_kwargs: Optional[dict[str, Any]] = None) -> list[int]:
    """Messages -> prompt token ids through the model's own chat template (which also gets the
    request's tools and allowed `chat_template_kwargs`)."""
    if not messages:
        raise field_error("messages", "messages must not be empty")
    if not getattr(tokenizer, "chat_template", None):
        raise field_error("messages", f"model {info.name!r} has no chat template; use /v1/completions")
    rendered: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        rendered.append(template_message(m, i, _message_text(m, i), tools.server_parser if tools else None))
    extra = dict(template_kwargs or {})
    if tools is not None and tools.template_tools:
        extra["tools"] = tools.template_tools
    try:
        text = tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True, **extra)
    except Exception as e:  # jinja TemplateError from the template's own raise_exception
        raise field_error("messages", f"the chat template rejected the messages: {e}") from None
    # The template writes any BOS itself; adding special tokens again would double it.
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise field_error("messages", "the rendered chat prompt is empty")
    return list(ids)
