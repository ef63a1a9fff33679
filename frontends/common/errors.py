"""The one mapping from engine errors to protocol errors.

Every front (gRPC servicers, the JSON mirror, the HTTP/OpenAI app) imports from here, so a
given failure reads the same everywhere: gRPC status code, HTTP status, a Connect-style JSON
body, and the AllSpark in-band `AS_STATUS` value.
"""
from __future__ import annotations

from typing import Any, Optional

import grpc

from jax_engine import errors as engine_errors
from jax_engine.errors import EngineError, Overloaded

# EngineError.kind -> (gRPC status, HTTP status)
_BY_KIND: dict[str, tuple[grpc.StatusCode, int]] = {
    "invalid_request": (grpc.StatusCode.INVALID_ARGUMENT, 400),
    "not_found": (grpc.StatusCode.NOT_FOUND, 404),
    "already_exists": (grpc.StatusCode.ALREADY_EXISTS, 409),
    "overloaded": (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    "unavailable": (grpc.StatusCode.UNAVAILABLE, 503),
    "unimplemented": (grpc.StatusCode.UNIMPLEMENTED, 501),
    "unauthenticated": (grpc.StatusCode.UNAUTHENTICATED, 401),
    "permission_denied": (grpc.StatusCode.PERMISSION_DENIED, 403),
    "internal": (grpc.StatusCode.INTERNAL, 500),
}

# gRPC status -> HTTP status, as the Connect protocol maps them (used by the JSON mirror when a
# servicer aborts with a code that did not come from an EngineError, e.g. UNIMPLEMENTED).
HTTP_BY_GRPC: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
    grpc.StatusCode.UNAUTHENTICATED: 401,
}

# EngineError.kind -> AllSpark AS_STATUS number (allspark_service.proto). Unknown kinds and
# non-engine exceptions become UNKNOWN_ERROR (1); OSError becomes IO_ERROR (3).
AS_STATUS_BY_KIND: dict[str, int] = {
    "invalid_request": 2,      # ALLSPARK_PARAM_ERROR
    "not_found": 2,            # ALLSPARK_PARAM_ERROR (upstream: unknown model)
    "already_exists": 8,       # ALLSPARK_INVALID_CALL_ERROR
    "overloaded": 7,           # ALLSPARK_EXCEED_LIMIT_ERROR
    "unavailable": 12,         # ALLSPARK_REQUEST_DENIED (model stopped / draining)
    "unimplemented": 8,        # ALLSPARK_INVALID_CALL_ERROR
    "permission_denied": 8,    # ALLSPARK_INVALID_CALL_ERROR
    "unauthenticated": 8,
    "internal": 5,             # ALLSPARK_RUNTIME_ERROR
}


def engine_error(kind: Optional[str], message: str) -> EngineError:
    """Rebuild a typed error from a stream event's `error_kind` (unknown kinds -> Internal)."""
    for cls in (engine_errors.InvalidRequest, engine_errors.NotFound, engine_errors.AlreadyExists,
                engine_errors.Overloaded, engine_errors.Unavailable, engine_errors.PermissionDenied,
                engine_errors.Unauthenticated, engine_errors.Unimplemented):
        if cls.kind == kind:
            return cls(message)
    return engine_errors.Internal(message)


def grpc_code(err: BaseException) -> grpc.StatusCode:
    """gRPC status for an engine error (INTERNAL for anything else)."""
    kind = getattr(err, "kind", "internal") if isinstance(err, EngineError) else "internal"
    return _BY_KIND.get(kind, _BY_KIND["internal"])[0]


def http_status(err: BaseException) -> int:
    """HTTP status for an engine error (500 for anything else)."""
    return HTTP_BY_GRPC[grpc_code(err)]


def code_name(code: grpc.StatusCode) -> str:
    """Connect-style lower-case code name: StatusCode.INVALID_ARGUMENT -> "invalid_argument"."""
    return code.name.lower()


def error_message(err: BaseException) -> str:
    """The text users see; non-engine exceptions do not leak their traceback or internals."""
    if isinstance(err, EngineError):
        return err.message
    return f"internal error: {type(err).__name__}"


def error_body(err: BaseException) -> dict[str, Any]:
    """JSON error body shared by the HTTP fronts: {"code": "invalid_argument", "message": ...}."""
    return {"code": code_name(grpc_code(err)), "message": error_message(err)}


def retry_after_s(err: BaseException) -> Optional[float]:
    """Seconds for a Retry-After header / `retry-after` trailer, for overload errors only."""
    return err.retry_after_s if isinstance(err, Overloaded) else None


def as_status(err: BaseException) -> int:
    """AllSpark in-band status number for an exception raised while serving a call."""
    if isinstance(err, EngineError):
        return AS_STATUS_BY_KIND.get(err.kind, 1)
    if isinstance(err, OSError):
        return 3  # ALLSPARK_IO_ERROR
    return 1  # ALLSPARK_UNKNOWN_ERROR


async def abort_with(context: Any, err: BaseException) -> None:
    """End the current RPC with the mapped status (raises, like ServicerContext.abort).

    Overload adds a `retry-after` trailer so gRPC clients get the same hint as HTTP ones.
    """
    retry = retry_after_s(err)
    if retry is not None:
        context.set_trailing_metadata((("retry-after", str(max(1, round(retry)))),))
    await context.abort(grpc_code(err), error_message(err))
