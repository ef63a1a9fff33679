"""Who may call what: the one access policy the gRPC interceptor and the HTTP JSON mirror apply."""
from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Optional

from jax_engine.errors import EngineError, PermissionDenied, Unauthenticated

HEALTH_SERVICE = "grpc.health.v1.Health"
ALLSPARK_SERVICE = "allspark.allspark_service.AllSpark"
# AllSpark's life-cycle and file-reading RPCs: refused unless admin is enabled.
ALLSPARK_ADMIN_METHODS = frozenset({
    "BuildModelFromConfigStruct", "ReloadModelToDeviceMemory", "UnloadModelFromDeviceMemory",
    "StartModel", "StopModel", "ReleaseModel", "ShutdownService", "GetFileInformation",
})
ADMIN_METHODS = frozenset(f"/{ALLSPARK_SERVICE}/{m}" for m in ALLSPARK_ADMIN_METHODS)


@dataclass(frozen=True)
class AccessPolicy:
    """Who may call what. With `api_key` every call needs `Bearer KEY`; admin methods are
    refused unless `enable_admin`, and with `admin_api_key` need that key. Health is open."""

    api_key: Optional[str] = None
    admin_api_key: Optional[str] = None
    enable_admin: bool = False

    def check(self, method: str, authorization: Optional[str], admin: Optional[bool] = None) -> Optional[EngineError]:
        """`method` is "/package.Service/Method" (or an HTTP admin route's path with admin=True);
        returns the refusal, or None to allow."""
        if method.startswith(f"/{HEALTH_SERVICE}/"):
            return None
        token = _bearer(authorization)
        is_admin_key = self.admin_api_key is not None and _same(token, self.admin_api_key)
        if method in ADMIN_METHODS if admin is None else admin:
            if not self.enable_admin:
                return PermissionDenied(f"{method} is an admin operation; start the server with --enable-admin")
            if self.admin_api_key is not None:
                if is_admin_key:
                    return None
                if self.api_key is not None and _same(token, self.api_key):
                    return PermissionDenied(f"{method} needs the admin API key")
                return Unauthenticated(f"{method} needs 'authorization: Bearer <admin key>'")
        if self.api_key is not None and not (_same(token, self.api_key) or is_admin_key):
            return Unauthenticated("missing or invalid API key ('authorization: Bearer <key>')")
        return None


def _bearer(value: Optional[str]) -> Optional[str]:
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _same(token: Optional[str], key: str) -> bool:
    return token is not None and hmac.compare_digest(token.encode(), key.encode())
