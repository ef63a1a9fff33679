"""`/tokenize` and `/detokenize` in vLLM's shapes, with any served model's own tokenizer.

* tokenize a prompt: `{"model", "prompt", "add_special_tokens": true}`;
  or chat messages: `{"model", "messages", "add_generation_prompt": true, "continue_final_message": false,
  "add_special_tokens": false}`, rendered exactly as /v1/chat/completions renders them (openai.py
  `_render_chat`: same message checks, same chat template);
  -> `{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` with `return_token_strs`, else null).
* detokenize: `{"model", "tokens"}` -> `{"prompt"}` (special tokens kept, as vLLM).

`model` omitted = the default generation model (else the first served model). Errors answer
`{"code", "message"}` like every non-/v1 route (frontends/http/app.py).
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from frontends.http.openai import (
    _ERROR_RESPONSES,
    _adapter_named,
    _chat_chars,
    _check_serving,
    _engine,
    _render_chat,
    _resolve,
)
from frontends.http.openai_schema import ChatMessage, _Strict, field_error
from jax_engine.api import TOKENIZE_INLINE_CHARS, EngineAPI, Tokenizer
from jax_engine.types import ModelInfo

# Longer id lists are decoded on a worker thread, not on the event loop.
_DECODE_INLINE_TOKENS = 4096


class TokenizeRequest(_Strict):
    """vLLM's tokenize request: exactly one of `prompt` and `messages`."""

    model: Optional[str] = Field(None, description="served model name; omitted = the default generation model")
    prompt: Optional[str] = Field(None, description="text to tokenize")
    messages: Optional[list[ChatMessage]] = Field(None, description="chat messages, rendered by the model's chat "
                                                                    "template as /v1/chat/completions renders them")
    add_special_tokens: Optional[bool] = Field(None, description="add the tokenizer's special tokens (BOS, ...); "
                                                                 "default true for prompt, false for messages "
                                                                 "(the template writes them)")
    add_generation_prompt: Optional[bool] = Field(None, description="messages only: end with the assistant turn's "
                                                                    "opening; default true")
    continue_final_message: Optional[bool] = Field(None, description="messages only: leave the final message open "
                                                                     "for continuation; default false")
    return_token_strs: bool = Field(False, description="also return each token's string (the tokenizer's pieces)")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = Field(None, description="with return_token_strs only")


class DetokenizeRequest(_Strict):
    model: Optional[str] = Field(None, description="served model name; omitted = the default generation model")
    tokens: list[int] = Field(..., description="token ids, each inside the model's vocabulary")


class DetokenizeResponse(BaseModel):
    prompt: str


class _TemplateFlags:
    """The model's tokenizer as `_render_chat` sees it, with this request's template flags: the
    chat route always asks for the generation prompt and no special tokens, /tokenize lets the
    client choose (vLLM's add_generation_prompt, continue_final_message, add_special_tokens)."""

    def __init__(self, tokenizer: Tokenizer, *, add_generation_prompt: bool, continue_final_message: bool,
                 add_special_tokens: bool):
        self._tok = tokenizer
        self._generation_prompt = add_generation_prompt
        self._continue = continue_final_message
        self._special = add_special_tokens
        self.chat_template = getattr(tokenizer, "chat_template", None)

    def apply_chat_template(self, conversation: list[dict[str, Any]], tokenize: bool = True,
                            add_generation_prompt: bool = False, **kwargs: Any) -> Any:
        if self._continue:
            kwargs["continue_final_message"] = True
        return self._tok.apply_chat_template(conversation, tokenize=tokenize,
                                             add_generation_prompt=self._generation_prompt, **kwargs)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=self._special)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


def _model(engine: EngineAPI, name: Optional[str]) -> ModelInfo:
    """A served model, or a LoRA adapter's base model (its tokenizer is the base model's)."""
    _check_serving(engine)
    adapter = _adapter_named(engine, name)
    return _resolve(engine, adapter.model if adapter is not None else name or engine.default_model("generate"), None)


def _token_strs(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is not None:
        return [s if s is not None else "" for s in convert(ids)]
    return [tokenizer.decode([t]) for t in ids]


router = APIRouter(tags=["tokenizer"])


@router.post("/tokenize", response_model=TokenizeResponse, responses=_ERROR_RESPONSES)
async def tokenize(request: Request, body: TokenizeRequest) -> JSONResponse:
    """Token ids of a prompt, or of chat messages rendered by the model's chat template."""
    engine = _engine(request)
    if (body.prompt is None) == (body.messages is None):
        raise field_error("prompt", "send exactly one of prompt and messages")
    info = _model(engine, body.model)
    tokenizer = engine.tokenizer(info.name)
    if body.prompt is not None:
        for name in ("add_generation_prompt", "continue_final_message"):
            if getattr(body, name) is not None:
                raise field_error(name, f"{name} applies to messages only")
        special = True if body.add_special_tokens is None else body.add_special_tokens
        prompt = body.prompt
        if len(prompt) > TOKENIZE_INLINE_CHARS:
            ids = await asyncio.to_thread(tokenizer.encode, prompt, add_special_tokens=special)
        else:
            ids = tokenizer.encode(prompt, add_special_tokens=special)
        ids = list(ids)
    else:
        generation = True if body.add_generation_prompt is None else body.add_generation_prompt
        final = bool(body.continue_final_message)
        if generation and final:
            raise field_error("continue_final_message", "continue_final_message and add_generation_prompt cannot both "
                                                        "be true (set add_generation_prompt false)")
        flagged = _TemplateFlags(tokenizer, add_generation_prompt=generation, continue_final_message=final,
                                 add_special_tokens=bool(body.add_special_tokens))
        messages = body.messages or []
        if _chat_chars(messages) > TOKENIZE_INLINE_CHARS:
            ids = await asyncio.to_thread(_render_chat, flagged, messages, info)
        else:
            ids = _render_chat(flagged, messages, info)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids, "token_strs": None}
    if body.return_token_strs:
        out["token_strs"] = _token_strs(tokenizer, ids)
    return JSONResponse(out)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_ERROR_RESPONSES)
async def detokenize(request: Request, body: DetokenizeRequest) -> JSONResponse:
    """The text of token ids (special tokens included)."""
    engine = _engine(request)
    info = _model(engine, body.model)
    for i, t in enumerate(body.tokens):
        if not 0 <= t < info.vocab_size:
            raise field_error("tokens", f"tokens[{i}] = {t} is outside the vocabulary [0, {info.vocab_size})")
    tokenizer = engine.tokenizer(info.name)
    ids = list(body.tokens)
    if len(ids) > _DECODE_INLINE_TOKENS:
        text = await asyncio.to_thread(tokenizer.decode, ids)
    else:
        text = tokenizer.decode(ids)
    return JSONResponse({"prompt": text})
