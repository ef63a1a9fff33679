"""Typed engine errors. Each front maps them to its protocol in one place (frontends/errors.py)."""
from __future__ import annotations


class EngineError(Exception):
    """Base class; `kind` is the stable name fronts switch on."""

    kind = "internal"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidRequest(EngineError):
    """Bad input. The message names the field and, for limits, the limit."""

    kind = "invalid_request"


class NotFound(EngineError):
    kind = "not_found"


class AlreadyExists(EngineError):
    kind = "already_exists"


class Overloaded(EngineError):
    """Queue full: refuse at once, with a hint for Retry-After."""

    kind = "overloaded"

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(EngineError):
    """Not ready, draining, or the model is stopped."""

    kind = "unavailable"


class Unimplemented(EngineError):
    """A valid request this deployment cannot carry out (e.g. run-time loading on a multi-host slice)."""

    kind = "unimplemented"


class Internal(EngineError):
    kind = "internal"


class PermissionDenied(EngineError):
    kind = "permission_denied"


class Unauthenticated(EngineError):
    kind = "unauthenticated"
