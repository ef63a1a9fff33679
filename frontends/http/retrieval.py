"""Retrieval routes over the served cross-encoders: `/rerank` (Text Embeddings Inference's shape),
`/v1/rerank` (vLLM's, which is Jina's / Cohere's) and `/v1/score` (vLLM's).

Each (query, document) pair runs through the cross-encoder as one `EmbedRequest.pairs` input
and its single logit becomes the score. Only single-label cross-encoders rank (num_labels 1, as
in TEI and vLLM); any other model is refused with a 400 naming it. Scores:

* `/v1/rerank`, `/v1/score`: sigmoid of the logit, what vLLM and sentence-transformers'
  `CrossEncoder.predict` return for a one-label model by default.
* `/rerank`: sigmoid unless `raw_scores` is true (then the logit), as TEI.

Pairs longer than the model's context are cut (longest first, the engine's truncation) on the
/v1 routes, as /v1/embeddings does here; TEI's `/rerank` cuts only with `truncate: true` and
otherwise refuses the pair, as TEI does.

Errors: the OpenAI envelope under /v1 (frontends/http/app.py); on `/rerank` TEI's own body
`{"error": message, "error_type": "Validation" | "Empty" | "Overloaded" | "Unhealthy" | "Backend"}`
(`tei_error_body`, which app.py uses for the paths in TEI_PATHS) so TEI clients read the
message where they look for it. HTTP statuses stay this server's (400 for a bad field, 429,
503, ...), not TEI's (which answers 413 for validation errors and 424 for a wrong model type).
"""
from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal, Optional, Union

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from frontends.http.openai import _ERROR_RESPONSES, _ClientGone, _engine, _gone, _resolve, _unless_disconnected
from frontends.http.openai_schema import _Strict, field_error
from jax_engine.api import EngineAPI
from jax_engine.errors import InvalidRequest, NotFound
from jax_engine.types import EmbedRequest, ModelInfo

# ----------------------------------------------------------------------------- TEI error body

TEI_PATHS = ("/rerank",)

_TEI_ERROR_TYPE = {429: "Overloaded", 503: "Unhealthy"}


def tei_error_body(status: int, message: str, err: Optional[BaseException] = None) -> dict[str, Any]:
    """TEI's `{"error", "error_type"}`: Validation for a bad request, Empty for empty `texts`
    (as TEI), Overloaded (429), Unhealthy (503), Backend for other server-side failures."""
    kind = getattr(err, "tei_error_type", None) if err is not None else None
    if kind is None:
        kind = _TEI_ERROR_TYPE.get(status, "Backend" if status >= 500 else "Validation")
    return {"error": message, "error_type": kind}


# ----------------------------------------------------------------------------- request / response models


class TeiRerankRequest(_Strict):
    """Text Embeddings Inference's `/rerank` body."""

    query: str = Field(..., description="the query every text is scored against")
    texts: list[str] = Field(..., description="the texts to rank")
    truncate: Optional[bool] = Field(False, description="cut (query, text) pairs longer than the model's context, "
                                                        "longest first; false or null: such a pair is refused")
    truncation_direction: Literal["Right", "right", "Left", "left"] = Field(
        "Right", description="which end truncation cuts: only Right is supported (Left is refused with truncate)")
    raw_scores: bool = Field(False, description="true: the raw logit; false: its sigmoid")
    return_text: bool = Field(False, description="echo each text in its result")
    model: Optional[str] = Field(None, description="xlaserve extension: which served cross-encoder (TEI serves one); "
                                                   "omitted = the first one")


class TeiRank(BaseModel):
    index: int = Field(..., description="position of the text in `texts`")
    text: Optional[str] = Field(None, description="the text, with return_text only (absent otherwise)")
    score: float


class RerankRequest(_Strict):
    """vLLM's `/v1/rerank` body (Jina / Cohere shape)."""

    model: Optional[str] = Field(None, description="served cross-encoder; omitted = the first one")
    query: str = Field(..., description="the query every document is scored against")
    documents: list[str] = Field(..., description="the documents to rank")
    top_n: int = Field(0, ge=0, description="return the best top_n documents; 0 = all")


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int = Field(..., description="position of the document in `documents`")
    document: RerankDocument
    relevance_score: float = Field(..., description="sigmoid of the cross-encoder's logit")


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult] = Field(..., description="best first")


class ScoreRequest(_Strict):
    """vLLM's `/v1/score` body. Pairing: text_1 a string or a one-element list is scored
    against every text_2 (1:1, 1:N); two lists of the same length pair element-wise (N:N)."""

    model: Optional[str] = Field(None, description="served cross-encoder; omitted = the first one")
    text_1: Union[str, list[str]] = Field(..., description="the query (or queries, N:N)")
    text_2: Union[str, list[str]] = Field(..., description="the document(s)")


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float = Field(..., description="sigmoid of the cross-encoder's logit")


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData] = Field(..., description="in pair order")
    usage: ScoreUsage


# ----------------------------------------------------------------------------- shared scoring


def _cross_encoder(engine: EngineAPI, name: Optional[str], route: str) -> ModelInfo:
    """The single-label cross-encoder `name` (or the first one served); 400 naming any other model."""
    if not name and engine.ready() and engine.default_model("classify") is None:
        err = NotFound(f"{route} needs a cross-encoder (a sequence-classification model) and none is served")
        err.param = "model"  # type: ignore[attr-defined]
        raise err
    info = _resolve(engine, name, "classify")
    if info.task != "classify":
        raise field_error("model", f"model {info.name!r} is not a cross-encoder (it is a {info.task} model); "
                                   f"{route} needs a sequence-classification model with one label")
    labels = len(info.id2label)
    if labels != 1:
        raise field_error("model", f"model {info.name!r} has {labels} labels; {route} needs a cross-encoder "
                                   "with exactly one (a relevance logit)")
    return info


def _check_pairs(engine: EngineAPI, count: int, field: str, tei: bool = False) -> None:
    if count == 0:
        err = field_error(field, f"{'`texts` cannot be empty' if tei else f'{field} must not be empty'}")
        err.tei_error_type = "Empty"  # type: ignore[attr-defined]
        raise err
    limit = engine.args.max_embed_inputs
    if count > limit:
        raise field_error(field, f"at most {limit} {field} per request (got {count})")


def _check_text(text: str, where: str) -> None:
    if not text:
        raise field_error(where, f"{where} is an empty string")


async def _pair_logits(request: Request, engine: EngineAPI, info: ModelInfo, pairs: list[tuple[str, str]],
                       *, truncate: bool, names: tuple[str, str]) -> Union[tuple[np.ndarray, int], Response]:
    """(one logit per pair, prompt tokens), or the 499 response when the client left.
    `names` say how the request calls pair members, for the engine's messages about `pairs[i]`."""
    req = EmbedRequest(request_id="score-" + uuid.uuid4().hex, pairs=pairs, model=info.name, truncate=truncate)
    try:
        out = await _unless_disconnected(request, engine.embed(req))
    except _ClientGone:
        return _gone()
    except InvalidRequest as e:
        m = re.match(r"pairs\[(\d+)\]", e.message)
        if m is None:
            raise
        i = int(m.group(1))
        where = names[1] + f"[{i}]" if names[0] == "query" else f"{names[0]}[{i}] / {names[1]}[{i}]"
        raise field_error(names[1], where + e.message[m.end():]) from None
    if out.scores is None or np.asarray(out.scores).ndim != 2 or np.asarray(out.scores).shape[1] != 1:
        raise field_error("model", f"model {info.name!r} did not return one relevance logit per pair")
    return np.asarray(out.scores, dtype=np.float64)[:, 0], out.prompt_tokens


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free form of 1 / (1 + exp(-x))


def _best_first(scores: np.ndarray) -> list[int]:
    """Indices by score, highest first; equal scores keep input order."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))


# ----------------------------------------------------------------------------- routes

router = APIRouter(tags=["retrieval"])

_TEI_RESPONSES: dict[Union[int, str], dict[str, Any]] = {
    status: {"description": d["description"] + " (TEI body: {\"error\", \"error_type\"})"}
    for status, d in _ERROR_RESPONSES.items()
}


@router.post("/rerank", response_model=list[TeiRank], response_model_exclude_none=True, responses=_TEI_RESPONSES)
async def tei_rerank(request: Request, body: TeiRerankRequest) -> Response:
    """Text Embeddings Inference's rerank: `texts` scored against `query` by the cross-encoder,
    best first. Errors answer TEI's `{"error", "error_type"}`."""
    engine = _engine(request)
    info = _cross_encoder(engine, body.model, "/rerank")
    _check_pairs(engine, len(body.texts), "texts", tei=True)
    _check_text(body.query, "query")
    for i, t in enumerate(body.texts):
        _check_text(t, f"texts[{i}]")
    truncate = bool(body.truncate)
    if truncate and body.truncation_direction.lower() == "left":
        raise field_error("truncation_direction", "truncation_direction Left is not supported (pairs are cut "
                                                  "longest first, from the right); send Right or truncate false")
    got = await _pair_logits(request, engine, info, [(body.query, t) for t in body.texts], truncate=truncate,
                             names=("query", "texts"))
    if isinstance(got, Response):
        return got
    logits, _ = got
    scores = logits if body.raw_scores else _sigmoid(logits)
    ranks = []
    for i in _best_first(scores):
        item: dict[str, Any] = {"index": i}
        if body.return_text:
            item["text"] = body.texts[i]
        item["score"] = float(scores[i])
        ranks.append(item)
    return JSONResponse(ranks)


@router.post("/v1/rerank", response_model=RerankResponse, responses=_ERROR_RESPONSES)
async def rerank(request: Request, body: RerankRequest) -> Response:
    """vLLM's rerank (the Jina / Cohere shape): `documents` scored against `query`, best first,
    the first `top_n` of them (0 = all)."""
    engine = _engine(request)
    info = _cross_encoder(engine, body.model, "/v1/rerank")
    _check_pairs(engine, len(body.documents), "documents")
    _check_text(body.query, "query")
    for i, t in enumerate(body.documents):
        _check_text(t, f"documents[{i}]")
    got = await _pair_logits(request, engine, info, [(body.query, d) for d in body.documents], truncate=True,
                             names=("query", "documents"))
    if isinstance(got, Response):
        return got
    logits, tokens = got
    scores = _sigmoid(logits)
    order = _best_first(scores)
    if body.top_n:
        order = order[:body.top_n]
    results = [{"index": i, "document": {"text": body.documents[i]}, "relevance_score": float(scores[i])}
               for i in order]
    return JSONResponse({"id": "rerank-" + uuid.uuid4().hex, "model": info.name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results})


@router.post("/v1/score", response_model=ScoreResponse, responses=_ERROR_RESPONSES)
async def score(request: Request, body: ScoreRequest) -> Response:
    """vLLM's score: text_1 against text_2, paired 1:1, 1:N (one text_1, a list of text_2) or
    N:N (two lists of the same length); one score per pair, in pair order."""
    engine = _engine(request)
    info = _cross_encoder(engine, body.model, "/v1/score")
    t1 = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
    t2 = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
    if not t1:
        raise field_error("text_1", "text_1 must not be empty")
    _check_pairs(engine, len(t2), "text_2")
    if len(t1) > 1 and len(t1) != len(t2):
        raise field_error("text_1", f"text_1 and text_2 must pair 1:1, 1:N or N:N (got {len(t1)}:{len(t2)})")
    for name, texts, single in (("text_1", t1, isinstance(body.text_1, str)), ("text_2", t2, isinstance(body.text_2, str))):
        for i, t in enumerate(texts):
            _check_text(t, name if single else f"{name}[{i}]")
    if len(t1) == 1:
        t1 = t1 * len(t2)
    got = await _pair_logits(request, engine, info, list(zip(t1, t2)), truncate=True, names=("text_1", "text_2"))
    if isinstance(got, Response):
        return got
    logits, tokens = got
    scores = _sigmoid(logits)
    data = [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)]
    return JSONResponse({"id": "score-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()),
                         "model": info.name, "data": data,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}})
