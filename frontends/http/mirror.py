"""JSON mirror of every gRPC method: `POST /{package}.{Service}/{Method}`.

One generic route per method, generated from the service descriptors, calls the SAME servicer
objects as the gRPC server with a small stand-in for grpc.aio.ServicerContext. Bodies use the
proto3 JSON mapping (lowerCamelCase out, either spelling in, unknown fields rejected).
Server-streaming methods answer NDJSON, or Server-Sent Events with `Accept: text/event-stream`.
Errors: HTTP status from frontends/common/errors.py and a Connect-style body {"code", "message"}.
A unary reply's trailing metadata comes back as `trailer-<key>` headers (Connect's unary rule).
A client that goes away cancels the servicer call, which aborts the engine request.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from google.protobuf import descriptor_pool, json_format, message_factory

from frontends.common.access import AccessPolicy
from frontends.common.errors import HTTP_BY_GRPC, code_name, grpc_code

MAX_BODY_BYTES = 64 * 1024 * 1024


class MirrorAbort(Exception):
    """Raised by MirrorContext.abort, as grpc.aio's context.abort raises AbortError."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class _ClientGone(Exception):
    pass


class MirrorContext:
    """The parts of grpc.aio.ServicerContext that servicers use, over one HTTP request."""

    def __init__(self, headers: Any):
        self._metadata = tuple((k.lower(), v) for k, v in headers.items())
        self._code: Optional[grpc.StatusCode] = None
        self._details = ""
        self._trailing: tuple = ()
        self._cancelled = False
        self._callbacks: list[Callable[[Any], None]] = []

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: tuple = ()) -> None:
        if trailing_metadata:
            self._trailing = tuple(trailing_metadata)
        self._code, self._details = code, details
        raise MirrorAbort(code, details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> Optional[grpc.StatusCode]:
        return self._code

    def details(self) -> str:
        return self._details

    def set_trailing_metadata(self, metadata: tuple) -> None:
        self._trailing = tuple(metadata)

    def trailing_metadata(self) -> tuple:
        return self._trailing

    def invocation_metadata(self) -> tuple:
        return self._metadata

    async def send_initial_metadata(self, metadata: tuple) -> None:
        return None

    def peer(self) -> str:
        return "http"

    def time_remaining(self) -> Optional[float]:
        return None

    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return self._cancelled or self._code is not None

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self._callbacks.append(callback)

    def _finish(self, cancelled: bool = False) -> None:
        self._cancelled = self._cancelled or cancelled
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def retry_after(self) -> Optional[str]:
        return next((v for k, v in self._trailing if k == "retry-after"), None)


def add_mirror_routes(
    app: FastAPI,
    servicers: dict[str, Any],
    *,
    policy: Optional[AccessPolicy] = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> list[str]:
    """Register one POST route per RPC of every service in `servicers` (full service name ->
    servicer, as `make_servicers` returns). `policy` applies the gRPC front's admin gating and
    keys to the same methods here. Returns the registered paths."""
    policy = policy or AccessPolicy()
    paths = []
    pool = descriptor_pool.Default()
    for service_name, servicer in servicers.items():
        service = pool.FindServiceByName(service_name)
        for method in service.methods:
            path = f"/{service.full_name}/{method.name}"
            endpoint = _endpoint(path, method, getattr(servicer, method.name), policy, max_body_bytes)
            kind = "stream (NDJSON or SSE)" if method.server_streaming else "unary"
            app.add_api_route(
                path, endpoint, methods=["POST"], name=path, tags=[service.full_name],
                summary=f"{method.name}: {method.input_type.name} -> {method.output_type.name} ({kind})",
                openapi_extra={"requestBody": {"required": False, "content": {"application/json": {
                    "schema": {"type": "object", "description": f"{method.input_type.full_name}, proto3 JSON"}}}}},
                responses=_MIRROR_RESPONSES,
            )
            paths.append(path)
    return paths


_ERROR_SCHEMA = {"type": "object", "required": ["code", "message"],
                 "properties": {"code": {"type": "string"}, "message": {"type": "string"}}}
# Every status a mirror route can answer besides 200 (gRPC status -> HTTP as frontends/common/errors.py maps it).
_MIRROR_RESPONSES: dict[Any, dict[str, Any]] = {
    status: {"description": text, "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
    for status, text in (
        (400, "malformed JSON, unknown field, or INVALID_ARGUMENT / FAILED_PRECONDITION / OUT_OF_RANGE"),
        (401, "missing or wrong API key (UNAUTHENTICATED)"), (403, "admin operation not allowed (PERMISSION_DENIED)"),
        (404, "unknown model or request (NOT_FOUND)"), (408, "the request body did not arrive in time"),
        (409, "ALREADY_EXISTS / ABORTED"), (413, "request body too large"),
        (429, "queue full (RESOURCE_EXHAUSTED); see Retry-After"), (499, "the call was cancelled (CANCELLED)"),
        (500, "internal failure (INTERNAL / UNKNOWN / DATA_LOSS); no traceback"),
        (501, "method not implemented (UNIMPLEMENTED)"),
        (503, "starting, draining, or a worker is down (UNAVAILABLE)"), (504, "DEADLINE_EXCEEDED"),
    )
}


def _endpoint(path: str, method: Any, call: Callable[..., Any], policy: AccessPolicy,
              max_body_bytes: int) -> Callable[[Request], Awaitable[Response]]:
    request_cls = message_factory.GetMessageClass(method.input_type)

    async def endpoint(request: Request) -> Response:
        refusal = policy.check(path, request.headers.get("authorization"))
        if refusal is not None:
            return _error(grpc_code(refusal), refusal.message)
        body = await request.body()
        if len(body) > max_body_bytes:
            return _error(grpc.StatusCode.RESOURCE_EXHAUSTED, f"request body over {max_body_bytes} bytes", 413)
        try:
            message = _parse(body, request_cls)
        except ValueError as e:
            return _error(grpc.StatusCode.INVALID_ARGUMENT, f"bad {method.input_type.full_name} JSON: {e}")
        ctx = MirrorContext(request.headers)
        if method.server_streaming:
            try:
                messages = call(message, ctx)
            except Exception as e:  # the generated base servicer raises before streaming
                code = ctx.code() if ctx.code() not in (None, grpc.StatusCode.OK) else grpc.StatusCode.INTERNAL
                return _error(code, ctx.details() or f"internal error: {type(e).__name__}")
            return await _stream(messages, ctx, request)
        try:
            reply = await _until_disconnect(call(message, ctx), request)
        except _ClientGone:
            ctx._finish(cancelled=True)
            return Response(status_code=499)
        except MirrorAbort as e:
            return _error(e.code, e.details, retry_after=ctx.retry_after())
        except Exception as e:  # e.g. the generated base servicer: set_code(UNIMPLEMENTED) + raise
            if ctx.code() not in (None, grpc.StatusCode.OK):
                return _error(ctx.code(), ctx.details())
            return _error(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}")
        finally:
            ctx._finish()
        if ctx.code() not in (None, grpc.StatusCode.OK):
            return _error(ctx.code(), ctx.details())
        return Response(_json_line(reply), media_type="application/json", headers=_trailer_headers(ctx))

    return endpoint


def _parse(body: bytes, cls: Any) -> Any:
    """proto3 JSON -> message; every failure becomes a ValueError with a readable reason."""
    try:
        data = json.loads(body) if body.strip() else {}
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"the body must be a JSON object, got {type(data).__name__}")
    try:
        return json_format.ParseDict(data, cls(), ignore_unknown_fields=False)
    except (json_format.ParseError, RecursionError, TypeError, AttributeError) as e:
        raise ValueError(str(e).split("\n")[0]) from None


async def _stream(messages: AsyncIterator[Any], ctx: MirrorContext, request: Request) -> Response:
    """Wait for the first message (so early errors get a real HTTP status), then stream."""
    sse = "text/event-stream" in request.headers.get("accept", "")
    try:
        first = await _until_disconnect(messages.__anext__(), request)
    except StopAsyncIteration:
        first = None
    except _ClientGone:
        ctx._finish(cancelled=True)
        return Response(status_code=499)
    except MirrorAbort as e:
        ctx._finish()
        return _error(e.code, e.details, retry_after=ctx.retry_after())
    except Exception as e:
        ctx._finish()
        return _error(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}")

    async def body() -> AsyncIterator[str]:
        # Starlette cancels this iterator when the client disconnects; the CancelledError runs
        # through the servicer's stream into the engine's, which aborts the request.
        finished = False
        try:
            if first is not None:
                yield _frame(_json_line(first), sse)
                async for item in messages:
                    yield _frame(_json_line(item), sse)
            finished = True
        except MirrorAbort as e:
            finished = True
            yield _frame(json.dumps({"error": {"code": code_name(e.code), "message": e.details}}), sse, "error")
        except Exception as e:
            finished = True
            err = {"code": "internal", "message": f"internal error: {type(e).__name__}"}
            yield _frame(json.dumps({"error": err}), sse, "error")
        finally:
            ctx._finish(cancelled=not finished)
            await messages.aclose()

    media = "text/event-stream" if sse else "application/x-ndjson"
    return StreamingResponse(body(), media_type=media, headers={"Cache-Control": "no-cache"})


async def _until_disconnect(awaitable: Awaitable[Any], request: Request) -> Any:
    """Await `awaitable`, cancelling it (-> _ClientGone) if the HTTP client disconnects first."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        watch.cancel()
    if work.done():
        return work.result()
    work.cancel()
    try:
        await work
    except (asyncio.CancelledError, Exception):
        pass
    raise _ClientGone()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _json_line(message: Any) -> str:
    data = json_format.MessageToDict(message, preserving_proto_field_name=False)
    return json.dumps(data, separators=(",", ":"))


def _trailer_headers(ctx: MirrorContext) -> dict[str, str]:
    """A unary reply's trailing metadata as `trailer-<key>` headers (the Connect protocol's
    unary rule), e.g. AllSpark's `allspark-error` reason beside an in-band error status."""
    return {f"trailer-{key}": value for key, value in ctx.trailing_metadata() if isinstance(value, str)}


def _frame(line: str, sse: bool, event: Optional[str] = None) -> str:
    if not sse:
        return line + "\n"
    return (f"event: {event}\n" if event else "") + f"data: {line}\n\n"


def _error(code: grpc.StatusCode, message: str, status: Optional[int] = None,
           retry_after: Optional[str] = None) -> JSONResponse:
    headers = {"Retry-After": retry_after} if retry_after else None
    return JSONResponse({"code": code_name(code), "message": message},
                        status_code=status or HTTP_BY_GRPC.get(code, 500), headers=headers)
