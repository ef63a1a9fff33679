"""The one grpc.aio server: Arctic + SGLang + AllSpark + grpc.health.v1 + reflection.

    server, addresses = build_grpc_server(engine, host="127.0.0.1", port=50051)
    await server.start(); ...; await mark_not_serving(server); await server.stop(grace)

Servicers are plain objects (`make_servicers`) so the HTTP JSON mirror calls the very same
methods. Access control (API key, admin gating) is `frontends.common.access.AccessPolicy`,
applied by the interceptor here and by the mirror.
"""
from __future__ import annotations

import asyncio
import inspect
import weakref
from typing import Any, Awaitable, Callable, Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer as _AioHealthServicer
from grpc_reflection.v1alpha import reflection

from frontends.common.access import HEALTH_SERVICE, AccessPolicy
from frontends.common.errors import grpc_code
from frontends.grpc import allspark, arctic, sglang
from frontends.grpc.gen.allspark import allspark_service_pb2, allspark_service_pb2_grpc
from frontends.grpc.gen.arctic_inference import inference_pb2, inference_pb2_grpc
from frontends.grpc.gen.sglang import sglang_scheduler_pb2, sglang_scheduler_pb2_grpc
from jax_engine.api import EngineAPI
from jax_engine.errors import EngineError

# full service name -> (pb2 module, add_*_to_server)
SERVICES: dict[str, tuple[Any, Callable[[Any, Any], None]]] = {
    arctic.SERVICE: (inference_pb2, inference_pb2_grpc.add_InferenceServiceServicer_to_server),
    sglang.SERVICE: (sglang_scheduler_pb2, sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server),
    allspark.SERVICE: (allspark_service_pb2, allspark_service_pb2_grpc.add_AllSparkServicer_to_server),
}


ShutdownHook = Callable[[], Optional[Awaitable[None]]]


def make_servicers(engine: EngineAPI, *, on_shutdown: Optional[ShutdownHook] = None) -> dict[str, Any]:
    """Full service name -> servicer, independent of any transport.

    `on_shutdown` runs (shortly after answering) when AllSpark ShutdownService is called.
    """
    return {
        arctic.SERVICE: arctic.ArcticServicer(engine),
        sglang.SERVICE: sglang.SglangServicer(engine),
        allspark.SERVICE: allspark.AllSparkServicer(engine, on_shutdown=on_shutdown),
    }


# ---------------------------------------------------------------------- access control
class _AuthInterceptor(grpc.aio.ServerInterceptor):
    """Applies AccessPolicy before any servicer code runs, and answers INVALID_ARGUMENT (not
    gRPC's default UNKNOWN) for request bytes that do not parse as the method's message."""

    def __init__(self, policy: AccessPolicy):
        self.policy = policy

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        auth = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                auth = value if isinstance(value, str) else value.decode("utf-8", "replace")
        refusal = self.policy.check(handler_call_details.method, auth)
        if refusal is None:
            return _checked_handler(handler)
        return _refusing_handler(handler, refusal)  # unknown methods too: no probing without a key


class _Undecodable:
    """Stands in for a request message whose bytes did not parse."""

    def __init__(self, reason: str):
        self.reason = reason


def _safe_deserializer(deserialize: Optional[Callable[[bytes], Any]]) -> Optional[Callable[[bytes], Any]]:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # DecodeError, invalid UTF-8 in a string field, recursion limit...
            return _Undecodable(str(e).splitlines()[0] if str(e) else type(e).__name__)
    return parse


def _checked_handler(handler: Optional[grpc.RpcMethodHandler]) -> Optional[grpc.RpcMethodHandler]:
    """`handler` with undecodable unary requests refused as INVALID_ARGUMENT before the servicer
    runs. Request-streaming methods (only server reflection here) are left as they are."""
    if handler is None or handler.request_streaming or handler.request_deserializer is None:
        return handler
    kw = dict(request_deserializer=_safe_deserializer(handler.request_deserializer),
              response_serializer=handler.response_serializer)
    if handler.unary_stream:
        inner_stream = handler.unary_stream

        async def stream(request, context):
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {request.reason}")
            result = inner_stream(request, context)
            if hasattr(result, "__aiter__"):
                async for item in result:
                    yield item
            else:  # pragma: no cover - a coroutine writing through context.write
                await result
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    inner = handler.unary_unary

    async def unary(request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {request.reason}")
        result = inner(request, context)
        return await result if inspect.isawaitable(result) else result
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


def _refusing_handler(handler: Optional[grpc.RpcMethodHandler], err: EngineError) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with `err`'s status."""
    async def refuse(request, context):
        await context.abort(grpc_code(err), err.message)

    async def refuse_stream(request, context):
        await context.abort(grpc_code(err), err.message)
        yield  # pragma: no cover - makes this an async generator

    if handler is None:
        return grpc.unary_unary_rpc_method_handler(refuse)
    kw = dict(request_deserializer=_safe_deserializer(handler.request_deserializer),
              response_serializer=handler.response_serializer)
    if handler.stream_stream:  # server reflection
        return grpc.stream_stream_rpc_method_handler(refuse_stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **kw)
    return grpc.unary_unary_rpc_method_handler(refuse, **kw)


# ---------------------------------------------------------------------- health
class EngineHealthServicer(_AioHealthServicer):
    """grpc.health.v1: SERVING while the engine is ready, NOT_SERVING before, when a worker
    dies, and for good once `mark_not_serving` is called (drain)."""

    def __init__(self, engine: EngineAPI, services: list[str]):
        super().__init__()
        self.engine = engine
        self.services = ["", *services]

    async def refresh(self) -> None:
        states = health_pb2.HealthCheckResponse
        status = states.SERVING if self.engine.ready() else states.NOT_SERVING
        for name in self.services:
            await self.set(name, status)

    async def Check(self, request, context):
        await self.refresh()
        return await super().Check(request, context)

    async def Watch(self, request, context):
        await self.refresh()
        watcher = asyncio.ensure_future(super().Watch(request, context))
        try:
            while not watcher.done():  # re-read engine readiness so watchers see changes
                await asyncio.wait({watcher}, timeout=1.0)
                await self.refresh()
        finally:
            watcher.cancel()


_HEALTH: "weakref.WeakKeyDictionary[Any, EngineHealthServicer]" = weakref.WeakKeyDictionary()


async def mark_not_serving(server: Any) -> None:
    """Flip grpc.health.v1 to NOT_SERVING for good (call when draining starts)."""
    health = _HEALTH.get(server)
    if health is not None:
        await health.enter_graceful_shutdown()


# ---------------------------------------------------------------------- the server
# HTTP/2 abuse bounds (rapid reset, stream and ping floods; tests/e2e/test_hardening.py row 22).
DEFAULT_MAX_CONCURRENT_STREAMS = 256     # per connection; more streams wait for a free one
KEEPALIVE_TIME_MS = 60_000               # the server pings idle transports to find dead clients...
KEEPALIVE_TIMEOUT_MS = 20_000            # ...and drops the connection (cancelling its calls) if no ack
MIN_CLIENT_PING_INTERVAL_MS = 10_000     # client pings more often than this are "bad pings"...
MAX_PING_STRIKES = 2                     # ...and after this many the connection gets GOAWAY
MAX_CONNECTION_IDLE_MS = 15 * 60_000     # idle connections are closed
MAX_CONNECTION_AGE_MS = 60 * 60_000      # every connection is recycled after an hour...
MAX_CONNECTION_AGE_GRACE_MS = 10 * 60_000  # ...with 10 minutes for its streams to finish
# Request metadata (HPACK size: name + value + 32 bytes per entry, pseudo-headers included) over
# this gets RESOURCE_EXHAUSTED "received metadata size exceeds hard limit (N vs. 16384)". The soft
# limit equals the hard one: between the two grpc core rejects at random (default soft 8 KiB).
MAX_METADATA_BYTES = 16 * 1024


def server_options(max_message_bytes: int,
                   max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS) -> list[tuple[str, int]]:
    """grpc.aio server channel arguments: message and metadata size limits plus the HTTP/2 abuse bounds."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.max_metadata_size", MAX_METADATA_BYTES),
        ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES),
        ("grpc.max_concurrent_streams", max_concurrent_streams),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
        ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
        ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
        ("grpc.max_connection_age_grace_ms", MAX_CONNECTION_AGE_GRACE_MS),
    ]


def build_grpc_server(
    engine: EngineAPI,
    *,
    host: str = "127.0.0.1",
    port: int = 50051,
    extra_listeners: Optional[list[str]] = None,
    max_message_bytes: int = 64 * 1024 * 1024,
    api_key: Optional[str] = None,
    admin_api_key: Optional[str] = None,
    enable_admin: bool = False,
    tls_cert: Optional[str] = None,
    tls_key: Optional[str] = None,
    tls_client_ca: Optional[str] = None,
    servicers: Optional[dict[str, Any]] = None,
    on_shutdown: Optional[ShutdownHook] = None,
    max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS,
) -> tuple[grpc.aio.Server, list[str]]:
    """Build (not start) the server. Returns it and the bound addresses, main listener first:
    "host:port" with the real port (port 0 picks one) and "unix:/path" as given.

    TLS (cert + key, optional client CA for mTLS) applies to TCP listeners; unix sockets are
    local and stay plaintext. ShutdownService stops this server unless `on_shutdown` is given.
    """
    policy = AccessPolicy(api_key=api_key, admin_api_key=admin_api_key, enable_admin=enable_admin)
    server = grpc.aio.server(
        interceptors=[_AuthInterceptor(policy)],
        options=server_options(max_message_bytes, max_concurrent_streams=max_concurrent_streams),
    )
    if servicers is None:
        async def default_shutdown() -> None:
            engine.begin_drain()
            await mark_not_serving(server)
            await server.stop(0.05)

        servicers = make_servicers(engine, on_shutdown=on_shutdown or default_shutdown)
    for name, (_, add) in SERVICES.items():
        add(servicers[name], server)
    health = EngineHealthServicer(engine, list(SERVICES))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    _HEALTH[server] = health
    names = [*SERVICES, HEALTH_SERVICE, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)

    creds = _credentials(tls_cert, tls_key, tls_client_ca)
    addresses = []
    for spec in [_join(host, port), *(extra_listeners or [])]:
        if spec.startswith("unix:"):
            server.add_insecure_port(spec)
            addresses.append(spec)
            continue
        bound = server.add_secure_port(spec, creds) if creds else server.add_insecure_port(spec)
        if not bound:
            raise OSError(f"could not bind gRPC listener {spec}")
        addresses.append(_join(spec.rsplit(":", 1)[0].strip("[]"), bound))
    return server, addresses


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _credentials(cert: Optional[str], key: Optional[str], client_ca: Optional[str]) -> Optional[grpc.ServerCredentials]:
    if not cert and not key:
        if client_ca:
            raise ValueError("tls_client_ca needs tls_cert and tls_key")
        return None
    if not (cert and key):
        raise ValueError("TLS needs both tls_cert and tls_key")
    with open(cert, "rb") as f:
        cert_bytes = f.read()
    with open(key, "rb") as f:
        key_bytes = f.read()
    ca = None
    if client_ca:
        with open(client_ca, "rb") as f:
            ca = f.read()
    return grpc.ssl_server_credentials([(key_bytes, cert_bytes)], root_certificates=ca,
                                       require_client_auth=ca is not None)
