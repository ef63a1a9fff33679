"""The HTTP front: one FastAPI app over the shared engine.

Routes: `/health`, `/ready`, `/metrics` (Prometheus), `/docs` + `/openapi.json`, the
OpenAI-compatible `/v1/...` routes (frontends/http/openai.py) and, when servicers are given,
the JSON mirror of every gRPC method (frontends/http/mirror.py).

Cross-cutting concerns are plain ASGI middleware, outermost first:
request metrics -> bearer auth (sees the raw path, so `//v1/...` or `%2F` tricks are checked
like any other path; only the literal `/health` is exempt) -> body-size limit (413, also for
chunked bodies) -> FastAPI. Errors of every kind end in one of two JSON shapes: the OpenAI
envelope under `/v1`, `frontends.errors.error_body` elsewhere; the status always comes from
`frontends.errors`.
"""
from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import math
import time
from typing import Any, Iterable, Optional

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from frontends.errors import HTTP_BY_GRPC, code_name, error_body, error_message, http_status, retry_after_s
from frontends.http.openai import field_error, openai_error_body, router as openai_router
from jax_engine.errors import EngineError, Unauthenticated

log = logging.getLogger("xlaserve.http")

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
# An HTTP request head, and then its body, must each arrive within this (slowloris -> 408);
# the head's limit is enforced by frontends/http/transport.py, the body's by BodyLimitMiddleware.
DEFAULT_HTTP_READ_TIMEOUT_S = 60.0

# Probes and the scrape itself are not counted as requests.
_UNCOUNTED_PATHS = ("/health", "/ready", "/metrics")


# ----------------------------------------------------------------------------- metrics

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """Prometheus metrics of one app, in their own registry (several apps may share a process).

    Request counts and latency histograms are observed by the fronts; engine gauges and token
    counters are read from `engine.stats()` at scrape time, so they cover every front.
    """

    def __init__(self, engine) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("xlaserve_requests", "Requests by front, method and outcome",
                                ["front", "method", "outcome"], registry=self.registry)
        self.ttft = Histogram("xlaserve_time_to_first_token_seconds", "Time from request to first token",
                              ["model"], buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("xlaserve_inter_token_latency_seconds", "Time between tokens of one sequence",
                             ["model"], buckets=_ITL_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(engine))

    def observe_request(self, front: str, method: str, outcome: str) -> None:
        self.requests.labels(front, method, outcome).inc()

    def observe_ttft(self, model: str, seconds: float) -> None:
        self.ttft.labels(model).observe(seconds)

    def observe_itl(self, model: str, seconds: float) -> None:
        self.itl.labels(model).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def instrument(self, engine) -> "InstrumentedEngine":
        """`engine` with token latencies observed here; give it to every front."""
        if isinstance(engine, InstrumentedEngine):
            return engine
        return InstrumentedEngine(engine, self)

    def count_grpc(self, servicers: dict[str, Any]) -> dict[str, Any]:
        """Servicers whose calls are counted as front="grpc" (for the gRPC server, not the mirror)."""
        return {name: _CountedServicer(s, name, self) for name, s in servicers.items()}


class InstrumentedEngine:
    """The engine's own interface, with time-to-first-token and inter-token latency observed
    on every generate stream, whichever front opened it. Everything else is delegated."""

    def __init__(self, engine, metrics: ServerMetrics) -> None:
        self._engine = engine
        self._metrics = metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, req):
        model = req.model or self._engine.default_model("generate") or "unknown"
        t0 = time.monotonic()
        last: dict[int, float] = {}
        stream = self._engine.generate(req)
        try:
            async for ev in stream:
                if ev.new_token_ids:
                    now = time.monotonic()
                    prev = last.get(ev.index)
                    if prev is None:
                        self._metrics.observe_ttft(model, now - t0)
                    else:
                        self._metrics.observe_itl(model, (now - prev) / len(ev.new_token_ids))
                    last[ev.index] = now
                yield ev
        finally:
            await stream.aclose()  # closing early aborts the request, as with the bare engine


class _CountedServicer:
    """Delegates to a servicer; each RPC (CamelCase attribute) is counted by its final status."""

    def __init__(self, inner, service: str, metrics: ServerMetrics) -> None:
        self._inner, self._service, self._metrics = inner, service, metrics

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not (callable(attr) and name[:1].isupper()):
            return attr
        method = f"/{self._service}/{name}"
        record = self._metrics.observe_request

        def outcome(context, exc: Optional[BaseException]) -> str:
            if isinstance(exc, asyncio.CancelledError):
                return "cancelled"
            code = context.code() if hasattr(context, "code") else None
            if code is not None and code != grpc.StatusCode.OK:
                return code_name(code)
            return "ok" if exc is None else "internal"

        if not (inspect.isasyncgenfunction(attr) or inspect.iscoroutinefunction(attr)):
            return attr  # not an aio handler shape we can wrap; served uncounted
        if inspect.isasyncgenfunction(attr):
            async def streaming(request, context):
                exc = None
                try:
                    async for reply in attr(request, context):
                        yield reply
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    record("grpc", method, outcome(context, exc))
            return streaming

        async def unary(request, context):
            exc = None
            try:
                return await attr(request, context)
            except BaseException as e:
                exc = e
                raise
            finally:
                record("grpc", method, outcome(context, exc))
        return unary


class _EngineCollector:
    """Engine state read at scrape time."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        e = self.engine
        gauges = {
            "running_requests": ("Requests being decoded or prefilled", "running_requests"),
            "waiting_requests": ("Requests queued for admission", "waiting_requests"),
            "kv_pages_used": ("KV-cache pages in use", "pages_used"),
            "kv_pages_total": ("KV-cache pages in the pool", "pages_total"),
        }
        counters = {
            "prompt_tokens": ("Prompt tokens processed", "total_prompt_tokens"),
            "generation_tokens": ("Tokens generated", "total_generated_tokens"),
            "prefix_cache_hit_tokens": ("Prompt tokens served from the prefix cache", "prefix_cache_hit_tokens"),
            "compilations_after_warmup": ("XLA compilations after warmup (should stay 0)",
                                          "compilations_after_warmup"),
        }
        g_fam = {k: GaugeMetricFamily(f"xlaserve_{k}", doc, labels=["model"]) for k, (doc, _) in gauges.items()}
        c_fam = {k: CounterMetricFamily(f"xlaserve_{k}", doc, labels=["model"]) for k, (doc, _) in counters.items()}
        routes = GaugeMetricFamily("xlaserve_cpu_matmul_path",
                                   "1 for the path (kernel or xla) serving each decoder matrix and row class",
                                   labels=["model", "weight", "shape_class", "path"])
        for info in list(e.models()):
            try:
                st = e.stats(info.name)
            except Exception:  # a stopped model has no stats; skip it rather than fail the scrape
                continue
            for k, (_, attr) in gauges.items():
                g_fam[k].add_metric([info.name], float(getattr(st, attr, 0) or 0))
            for k, (_, attr) in counters.items():
                c_fam[k].add_metric([info.name], float(getattr(st, attr, 0) or 0))
            for r in st.matmul_routes:
                routes.add_metric([info.name, r.weight, r.shape_class, r.path], 1.0)
        yield from g_fam.values()
        yield from c_fam.values()
        yield routes
        engine_req = CounterMetricFamily("xlaserve_engine_requests",
                                         "Engine requests: accepted, and each terminal outcome", labels=["outcome"])
        for outcome, value in e.counters.snapshot().items():
            engine_req.add_metric([outcome], float(value))
        yield engine_req
        ready = GaugeMetricFamily("xlaserve_ready", "1 when every model is warm and the server is not draining")
        ready.add_metric([], 1.0 if e.ready() else 0.0)
        yield ready


# ----------------------------------------------------------------------------- error responses


def _is_openai_path(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def error_response(path: str, err: BaseException, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    """The one JSON error response of this app; status and code come from frontends.errors."""
    status = http_status(err)
    hdrs = dict(headers or {})
    retry = retry_after_s(err)
    if retry is not None:
        hdrs["Retry-After"] = str(max(1, math.ceil(retry)))
    if _is_openai_path(path):
        body = openai_error_body(status, error_message(err), param=getattr(err, "param", None),
                                 code=error_body(err)["code"])
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


def package_version() -> str:
    try:
        from importlib.metadata import version

        return version("xlaserve")
    except Exception:
        return "0+unknown"


def create_app(engine, *, api_key: Optional[str] = None, servicers: Optional[dict] = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, admin_api_key: Optional[str] = None,
               enable_admin: bool = False, metrics: Optional[ServerMetrics] = None,
               body_timeout_s: float = DEFAULT_HTTP_READ_TIMEOUT_S) -> FastAPI:
    """The HTTP front over `engine`.

    `servicers` (from `frontends.grpc.server.make_servicers`) adds the JSON mirror routes, with
    the same admin gating as the gRPC front (`enable_admin`, `admin_api_key`). `metrics` lets
    a caller share one ServerMetrics (and its instrumented engine) with the gRPC front.
    """
    app = FastAPI(
        title="xlaserve",
        version=package_version(),
        description="LLM inference server: OpenAI-compatible routes, a JSON mirror of the gRPC "
                    "services, health, readiness and Prometheus metrics.",
    )
    app.state.metrics = metrics or ServerMetrics(engine)
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
    if servicers:
        from frontends.grpc.server import AccessPolicy
        from frontends.http.mirror import add_mirror_routes

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
