"""What the test files share, in one place: model names, polling, the server loop that hosts
grpc.aio and uvicorn, starting and stopping servers, the `xlaserve` command line, holding an
engine's requests open for disconnect tests (`hold_requests_open`), and the XLA flags that make
the multi-device subprocesses compile fast (`fast_compile_xla_flags`).

Nothing here imports the engine at module level (the front imports sit inside the functions that
start servers), so unit tests may import it without loading JAX.
"""
from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

GEN = "gen"        # the random-weight demo decoder
EMBED = "minilm"   # sentence-transformers/all-MiniLM-L6-v2
HTTP_API_KEY = "test-http-key"
HTTP_SMALL_BODY_LIMIT = 4096
# `xlaserve serve` flags equal to the shared test engine's, so warm compilation-cache entries are reused
ENGINE_FLAGS = ["--max-running-requests", "8", "--max-num-batched-tokens", "128", "--page-size", "16",
                "--num-pages", "128", "--max-model-len", "256"]


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll until `predicate()` holds (True) or the timeout passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def hold_requests_open(engine: Any, model: str, monkeypatch: Any, step_s: float = 0.005) -> None:
    """Make `model`'s requests last: its schedulers see no EOS and every step takes >= `step_s`,
    so a 240-token request runs >= 1.2 s however fast the host, and a test that hangs up early
    finds it still running (a sampled request could otherwise draw EOS and complete first)."""
    for sched in engine.worker(model).replicas:
        monkeypatch.setattr(sched, "eos_ids", set())
        runner = sched.runner
        step = runner.step

        def slow_step(*a: Any, _step: Callable[..., Any] = step, **k: Any) -> Any:
            time.sleep(step_s)
            return _step(*a, **k)
        monkeypatch.setattr(runner, "step", slow_step)


def fast_compile_xla_flags(extra: str = "") -> str:
    """XLA_FLAGS for a subprocess that compiles much and runs little (the multi-device tests: a
    dozen engines of tiny models, a few dozen tokens each): LLVM at level 0 instead of the suite's
    1 (conftest.py), plus `extra`. The demo engine's load and warmup, alternating runs on a 2-vCPU
    Zen 3: 15.7-21.1 s at level 0 against 24.1-34.5 s at level 1 (and 25.0-34.1 s at 2), its 200
    greedy tokens identical but 3x slower to decode (2.6-2.8 s against 0.4-0.9 s)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_backend_optimization_level")]
    return " ".join(flags + ["--xla_backend_optimization_level=0"] + extra.split())


def xlaserve() -> list[str]:
    script = Path(sys.executable).parent / "xlaserve"
    return [str(script)] if script.exists() else [sys.executable, "-m", "frontends.cli"]


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
