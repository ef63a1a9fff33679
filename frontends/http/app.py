"""The HTTP front: one FastAPI app over the shared engine.

Routes: `/health`, `/ready`, `/metrics` (Prometheus), `/docs` + `/openapi.json`, the
OpenAI-compatible `/v1/...` routes (frontends/http/openai.py), with --enable-admin vLLM's
LoRA load / unload routes (frontends/http/lora_admin.py) and, when servicers are given,
the JSON mirror of every gRPC method (frontends/http/mirror.py).

Cross-cutting concerns are plain ASGI middleware, outermost first:
request metrics -> bearer auth (sees the raw path, so `//v1/...` or `%2F` tricks are checked
like any other path; only the literal `/health` is exempt) -> body-size limit (413, also for
chunked bodies) -> FastAPI. Errors of every kind end in one of two JSON shapes: the OpenAI
envelope under `/v1`, `frontends.common.errors.error_body` elsewhere; the status always comes
from `frontends.common.errors`. Metrics (`ServerMetrics`) and the access policy of the mirror are
shared with the gRPC front through `frontends.common`.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import math
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from frontends.common.access import AccessPolicy
from frontends.common.errors import HTTP_BY_GRPC, code_name, error_body, error_message, http_status, retry_after_s
from frontends.common.metrics import ServerMetrics
from frontends.common.version import package_version
from frontends.http.lora_admin import add_lora_admin_routes
from frontends.http.mirror import add_mirror_routes
from frontends.http.openai import router as openai_router
from frontends.http.openai_schema import field_error, openai_error_body
from frontends.http.reasoning import check_reasoning_parser
from frontends.http.responses import router as responses_router
from frontends.http.retrieval import TEI_PATHS, tei_error_body
from frontends.http.retrieval import router as retrieval_router
from frontends.http.tokenize import router as tokenize_router
from frontends.http.tool_calls import check_tool_call_parser
from jax_engine.api import EngineAPI
from jax_engine.errors import EngineError, Unauthenticated

log = logging.getLogger("xlaserve.http")

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
# An HTTP request head, and then its body, must each arrive within this (slowloris -> 408);
# the head's limit is enforced by frontends/http/transport.py, the body's by BodyLimitMiddleware.
DEFAULT_HTTP_READ_TIMEOUT_S = 60.0

# Probes and the scrape itself are not counted as requests.
_UNCOUNTED_PATHS = ("/health", "/ready", "/metrics")


# ----------------------------------------------------------------------------- error responses


def _is_openai_path(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def error_response(path: str, err: BaseException, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    """The one JSON error response of this app; status and code come from frontends.common.errors."""
    status = http_status(err)
    hdrs = dict(headers or {})
    retry = retry_after_s(err)
    if retry is not None:
        hdrs["Retry-After"] = str(max(1, math.ceil(retry)))
    if _is_openai_path(path):
        body = openai_error_body(status, error_message(err), param=getattr(err, "param", None),
                                 code=error_body(err)["code"])
    elif path in TEI_PATHS:  # TEI's own routes answer TEI's error body
        body = tei_error_body(status, error_message(err), err)
    else:
        body = error_body(err)
    return JSONResponse(body, status_code=status, headers=hdrs)


# Code names (as error_body spells them) for statuses HTTP_BY_GRPC does not cover, or covers
# with a less fitting first match (500 -> "unknown").
_CODE_FOR_STATUS = {405: "unimplemented", 408: "deadline_exceeded", 413: "resource_exhausted", 431: "resource_exhausted",
                    500: "internal"}


def _plain_error(path: str, status: int, message: str, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    """Error response for failures that are HTTP-level, not engine errors (404 route, 413, ...)."""
    if _is_openai_path(path):
        body = openai_error_body(status, message, code=_http_code(status))
    elif path in TEI_PATHS:
        body = tei_error_body(status, message)
    else:
        body = {"code": _http_code(status), "message": message}
    return JSONResponse(body, status_code=status, headers=headers)


def _http_code(status: int) -> str:
    if status in _CODE_FOR_STATUS:
        return _CODE_FOR_STATUS[status]
    for code, http in HTTP_BY_GRPC.items():
        if http == status:
            return code_name(code)
    return "unknown"


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    """(message, param) naming the first offending field, in `a.b[0].c` notation."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "JSON decode error")
        return f"request body is not valid JSON: {detail}", None
    param = ""
    for p in loc:
        if isinstance(p, int):
            param += f"[{p}]"
        else:
            param += ("." if param else "") + str(p)
    kind = first.get("type", "")
    if not param:
        if kind == "missing":
            return "request body is required (a JSON object)", None
        return f"request body must be a JSON object: {first.get('msg', 'invalid')}", None
    if kind == "extra_forbidden":
        msg = f"unsupported field {param!r}: this server does not implement it"
    elif kind == "missing":
        msg = f"{param} is required"
    else:
        msg = f"{param}: {first.get('msg', 'invalid value')}"
    more = len(errors) - 1
    if more:
        msg += f" (and {more} more error{'s' if more > 1 else ''})"
    return msg, param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(request.url.path, field_error(param, message))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _plain_error(request.url.path, exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error serving %s", request.url.path)
        return error_response(request.url.path, exc)


# ----------------------------------------------------------------------------- middleware


class RequestMetricsMiddleware:
    """Counts every request (except probes and scrapes) by route template and outcome."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in _UNCOUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            method = getattr(route, "path", None) or "unmatched"
            # Streams set their outcome (their status is 200 before they fail or are cut off).
            outcome = scope.get("state", {}).get("outcome") or ("ok" if status < 400 else _http_code(status))
            self.metrics.observe_request("http", method, outcome)


def _raw_path(scope) -> bytes:
    raw = scope.get("raw_path")
    if raw is None:
        return scope["path"].encode("utf-8", "surrogateescape")
    return raw.split(b"?", 1)[0]


class BearerAuthMiddleware:
    """`Authorization: Bearer KEY` on every route but `/health` (constant-time compare against
    each accepted key: the API key, and the admin key, which the gRPC front accepts too).

    The exemption is decided on both the decoded and the raw path, so only a request that is
    literally `/health` skips the check; any spelling trick simply needs the key.
    """

    def __init__(self, app, keys: list[str]) -> None:
        self.app = app
        self.keys = [k.encode("utf-8") for k in keys]

    def _authorized(self, scope) -> bool:
        values = [v for k, v in scope.get("headers", []) if k.lower() == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, token = values[0].strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        # Compare against every key (no early exit) so timing says nothing about which matched.
        matches = [hmac.compare_digest(token, k) for k in self.keys]
        return any(matches)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        exempt = scope["path"] == "/health" and _raw_path(scope) == b"/health"
        if exempt or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        response = error_response(scope["path"], Unauthenticated("missing or invalid API key "
                                                                  "(send 'Authorization: Bearer KEY')"),
                                  headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class BodyLimitMiddleware:
    """413 for request bodies over `limit` bytes, declared (Content-Length) or streamed (chunked);
    408 for a body that has not fully arrived within `timeout_s` seconds (slowloris).

    The body is read here, up to the limit, and replayed to the app; later `receive()` calls go
    to the server again, so disconnect detection downstream still works.
    """

    def __init__(self, app, limit: int, timeout_s: float = DEFAULT_HTTP_READ_TIMEOUT_S) -> None:
        self.app = app
        self.limit = limit
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
                if size < 0:
                    raise ValueError
            except ValueError:
                await _plain_error(scope["path"], 400, "invalid Content-Length header")(scope, receive, send)
                return
            if size > self.limit:
                await self._too_large(scope, receive, send)
                return
            if size == 0:
                await self.app(scope, receive, send)
                return
        elif b"transfer-encoding" not in headers:
            await self.app(scope, receive, send)
            return

        chunks: list[bytes] = []
        total = 0
        first: dict[str, Any]
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                await _plain_error(scope["path"], 408, f"the request body did not arrive within {self.timeout_s:g}s",
                                   headers={"Connection": "close"})(scope, receive, send)
                return
            if message["type"] != "http.request":
                first = message  # disconnect while uploading: let the app see it
                break
            body = message.get("body", b"")
            total += len(body)
            if total > self.limit:
                await self._too_large(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send) -> None:
        await _plain_error(scope["path"], 413, f"request body exceeds the limit of {self.limit} bytes",
                           headers={"Connection": "close"})(scope, receive, send)


# ----------------------------------------------------------------------------- the app


def create_app(engine: EngineAPI, *, api_key: Optional[str] = None, servicers: Optional[dict[str, Any]] = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, admin_api_key: Optional[str] = None,
               enable_admin: bool = False, metrics: Optional[ServerMetrics] = None,
               body_timeout_s: float = DEFAULT_HTTP_READ_TIMEOUT_S, tool_call_parser: Optional[str] = None,
               reasoning_parser: Optional[str] = None) -> FastAPI:
    """The HTTP front over `engine`.

    `servicers` (the composition root builds them with `frontends.grpc.server.make_servicers`)
    adds the JSON mirror routes, with
    the same admin gating as the gRPC front (`enable_admin`, `admin_api_key`). `metrics` lets
    a caller share one ServerMetrics (and its instrumented engine) with the gRPC front.
    `tool_call_parser` / `reasoning_parser` (--tool-call-parser / --reasoning-parser) parse chat
    answers into tool_calls / reasoning_content (frontends/http/tool_calls.py, reasoning.py).
    """
    app = FastAPI(
        title="xlaserve",
        version=package_version(),
        description="LLM inference server: OpenAI-compatible routes, a JSON mirror of the gRPC "
                    "services, health, readiness and Prometheus metrics.",
    )
    app.state.metrics = metrics or ServerMetrics(engine)
    app.state.tool_call_parser = check_tool_call_parser(tool_call_parser)
    app.state.reasoning_parser = check_reasoning_parser(reasoning_parser)
    engine = app.state.engine = app.state.metrics.instrument(engine)

    @app.get("/health", tags=["server"], responses={503: {"description": "a model worker died"}})
    async def health() -> JSONResponse:
        """200 while the process serves (also during warmup); 503 if a model worker died."""
        if engine.healthy():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy"}, status_code=503)

    @app.get("/ready", tags=["server"], responses={503: {"description": "starting, draining or unhealthy"}})
    async def ready() -> JSONResponse:
        """200 once every model is loaded and warm; 503 before that and while draining."""
        if engine.ready():
            return JSONResponse({"status": "ready"})
        if engine.draining:
            state = "draining"
        elif not engine.healthy():
            state = "unhealthy"
        else:
            state = "starting"
        return JSONResponse({"status": state}, status_code=503)

    for path, probe in (("/health", health), ("/ready", ready)):  # HEAD for load balancers, undocumented
        app.add_api_route(path, probe, methods=["HEAD"], include_in_schema=False)

    @app.get("/metrics", tags=["server"], response_class=Response)
    async def metrics_route() -> Response:
        """Prometheus text exposition."""
        return Response(app.state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(openai_router)
    app.include_router(responses_router)
    app.include_router(retrieval_router)
    app.include_router(tokenize_router)
    if enable_admin:  # run-time LoRA loading reads client-named files: an admin operation
        add_lora_admin_routes(app, api_key=api_key, admin_api_key=admin_api_key)
    if servicers:
        policy = AccessPolicy(api_key=api_key, admin_api_key=admin_api_key, enable_admin=enable_admin)
        add_mirror_routes(app, servicers, policy=policy, max_body_bytes=max_body_bytes)

    _install_error_handlers(app)
    _document_400_not_422(app)
    # add_middleware wraps: the last added runs first.
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes, timeout_s=body_timeout_s)
    if api_key:
        app.add_middleware(BearerAuthMiddleware, keys=[k for k in (api_key, admin_api_key) if k])
    app.add_middleware(RequestMetricsMiddleware, metrics=app.state.metrics)
    return app


def _document_400_not_422(app: FastAPI) -> None:
    """Validation failures answer 400 here; make the OpenAPI document say so."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        schema = generate()
        for ops in schema.get("paths", {}).values():
            for op in ops.values():
                responses = op.get("responses") if isinstance(op, dict) else None
                if responses and "422" in responses:
                    moved = responses.pop("422")
                    moved["description"] = "malformed body or invalid field"
                    responses.setdefault("400", moved)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
