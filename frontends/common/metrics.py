"""Prometheus metrics of one server, shared by both fronts.

`ServerMetrics` owns the registry: request counts (observed by each front: the HTTP middleware,
and `count_grpc` around the gRPC servicers), token latencies (observed by `InstrumentedEngine`
on every generate stream, whichever front opened it) and engine gauges read at scrape time.
"""
from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, AsyncGenerator, Callable, Iterable, Optional

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from frontends.common.errors import code_name
from jax_engine.api import EngineAPI, EngineArgs, ModelSpec, RequestCounters, Tokenizer
from jax_engine.types import (
    AdapterInfo,
    EmbedOutput,
    EmbedRequest,
    GenerateOutput,
    GenerateRequest,
    ModelInfo,
    ModelStats,
    SpecStats,
)

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """Prometheus metrics of one app, in their own registry (several apps may share a process).

    Request counts and latency histograms are observed by the fronts; engine gauges and token
    counters are read from `engine.stats()` at scrape time, so they cover every front.
    """

    def __init__(self, engine: EngineAPI) -> None:
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

    def instrument(self, engine: EngineAPI) -> "InstrumentedEngine":
        """`engine` with token latencies observed here; give it to every front."""
        if isinstance(engine, InstrumentedEngine):
            return engine
        return InstrumentedEngine(engine, self)

    def count_grpc(self, servicers: dict[str, Any]) -> dict[str, Any]:
        """Servicers whose calls are counted as front="grpc" (for the gRPC server, not the mirror)."""
        return {name: CountedServicer(s, name, self) for name, s in servicers.items()}


class InstrumentedEngine:
    """An `EngineAPI` that observes time-to-first-token and inter-token latency on every
    generate stream, whichever front opened it. Every other member is passed through, one by one."""

    def __init__(self, engine: EngineAPI, metrics: ServerMetrics) -> None:
        self._engine = engine
        self._metrics = metrics

    # ------------------------------------------------------------ observed
    async def generate(self, req: GenerateRequest) -> AsyncGenerator[GenerateOutput, None]:
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

    # ------------------------------------------------------------ passed through
    @property
    def args(self) -> EngineArgs:
        return self._engine.args

    @property
    def counters(self) -> RequestCounters:
        return self._engine.counters

    @property
    def start_time(self) -> float:
        return self._engine.start_time

    @property
    def compile_cache_dir(self) -> str:
        return self._engine.compile_cache_dir

    @property
    def draining(self) -> bool:
        return self._engine.draining

    def ready(self) -> bool:
        return self._engine.ready()

    def healthy(self) -> bool:
        return self._engine.healthy()

    def models(self) -> list[ModelInfo]:
        return self._engine.models()

    def model_info(self, name: Optional[str] = None, task: Optional[str] = None) -> ModelInfo:
        return self._engine.model_info(name, task)

    def default_model(self, task: str) -> Optional[str]:
        return self._engine.default_model(task)

    def tokenizer(self, name: Optional[str] = None, task: Optional[str] = None) -> Tokenizer:
        return self._engine.tokenizer(name, task)

    def stats(self, name: Optional[str] = None) -> ModelStats:
        return self._engine.stats(name)

    def adapters(self, model: Optional[str] = None) -> list[AdapterInfo]:
        return self._engine.adapters(model)

    async def load_adapter(self, name: str, path: str, model: Optional[str] = None) -> AdapterInfo:
        return await self._engine.load_adapter(name, path, model)

    async def unload_adapter(self, name: str) -> None:
        await self._engine.unload_adapter(name)

    async def embed(self, req: EmbedRequest) -> EmbedOutput:
        return await self._engine.embed(req)

    def abort(self, request_id: str) -> bool:
        return self._engine.abort(request_id)

    def load_all(self, progress: bool = True, warmup: bool = True) -> None:
        self._engine.load_all(progress=progress, warmup=warmup)

    async def load_model(self, spec: ModelSpec) -> ModelInfo:
        return await self._engine.load_model(spec)

    async def start_model(self, name: str) -> None:
        await self._engine.start_model(name)

    async def stop_model(self, name: str) -> None:
        await self._engine.stop_model(name)

    async def release_model(self, name: str) -> None:
        await self._engine.release_model(name)

    def begin_drain(self) -> None:
        self._engine.begin_drain()

    def fail_in_flight(self, message: str) -> int:
        return self._engine.fail_in_flight(message)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._engine.shutdown(timeout)


class CountedServicer:
    """A servicer's RPC methods (its CamelCase attributes), each async one wrapped so the call
    is counted as front="grpc" by its final status. Built once from the servicer's methods."""

    def __init__(self, inner: Any, service: str, metrics: ServerMetrics) -> None:
        self.inner = inner
        for name in dir(inner):
            attr = getattr(inner, name)
            if name[:1].isupper() and callable(attr):
                setattr(self, name, _counted(attr, f"/{service}/{name}", metrics.observe_request))


def _grpc_outcome(context: Any, exc: Optional[BaseException]) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    code = context.code() if hasattr(context, "code") else None
    if code is not None and code != grpc.StatusCode.OK:
        return code_name(code)
    return "ok" if exc is None else "internal"


def _counted(method: Callable[..., Any], path: str, record: Callable[[str, str, str], None]) -> Callable[..., Any]:
    """`method` (an aio unary or server-streaming handler) counted by outcome; other shapes as they are."""
    if inspect.isasyncgenfunction(method):
        async def streaming(request, context):
            exc = None
            try:
                async for reply in method(request, context):
                    yield reply
            except BaseException as e:
                exc = e
                raise
            finally:
                record("grpc", path, _grpc_outcome(context, exc))
        return streaming
    if not inspect.iscoroutinefunction(method):
        return method  # not an aio handler shape we can wrap; served uncounted

    async def unary(request, context):
        exc = None
        try:
            return await method(request, context)
        except BaseException as e:
            exc = e
            raise
        finally:
            record("grpc", path, _grpc_outcome(context, exc))
    return unary


class _SpecFamilies:
    """Speculative decoding per model (only models served with --speculative appear)."""

    def __init__(self) -> None:
        self.models = 0
        self.proposed = CounterMetricFamily("xlaserve_spec_proposed_tokens", "Speculative guesses verified",
                                            labels=["model"])
        self.accepted = CounterMetricFamily("xlaserve_spec_accepted_tokens", "Speculative guesses accepted",
                                            labels=["model"])
        self.rate = GaugeMetricFamily("xlaserve_spec_accept_rate", "Accepted / proposed speculative guesses",
                                      labels=["model"])
        self.length = GaugeMetricFamily("xlaserve_spec_accept_length",
                                        "Tokens a speculating row emits per step (accepted guesses + 1)",
                                        labels=["model"])
        self.hist = HistogramMetricFamily("xlaserve_spec_accepted_per_step",
                                          "Guesses accepted per row verification", labels=["model"])

    def add(self, model: str, st: SpecStats) -> None:
        self.models += 1
        self.proposed.add_metric([model], float(st.proposed_tokens))
        self.accepted.add_metric([model], float(st.accepted_tokens))
        self.rate.add_metric([model], st.accept_rate)
        self.length.add_metric([model], st.accept_length)
        cum, buckets = 0, []
        for a, n in enumerate(st.accepted_histogram):
            cum += n
            buckets.append((str(a), float(cum)))
        buckets.append(("+Inf", float(cum)))
        total = sum(a * n for a, n in enumerate(st.accepted_histogram))
        self.hist.add_metric([model], buckets, float(total))

    def families(self) -> Iterable:
        return [self.proposed, self.accepted, self.rate, self.length, self.hist]


class _EngineCollector:
    """Engine state read at scrape time."""

    def __init__(self, engine: EngineAPI) -> None:
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
            "grammar_queue": ("Requests waiting for their grammar (structured output) to compile", "grammar_queue"),
            "lora_slots_used": ("LoRA adapter slots holding an adapter", "lora_slots_used"),
            "lora_slots_total": ("LoRA adapter slots (--max-loras; 0 without LoRA)", "lora_slots_total"),
        }
        counters = {
            "prompt_tokens": ("Prompt tokens processed", "total_prompt_tokens"),
            "generation_tokens": ("Tokens generated", "total_generated_tokens"),
            "prefix_cache_hit_tokens": ("Prompt tokens served from the prefix cache", "prefix_cache_hit_tokens"),
            "compilations_after_warmup": ("XLA compilations after warmup (should stay 0)",
                                          "compilations_after_warmup"),
            "burst_steps": ("Ragged steps over the latency budget, at the burst budget (--burst-batched-tokens: a "
                            "backlog of prompts waited, or nothing decoded)", "burst_steps"),
        }
        g_fam = {k: GaugeMetricFamily(f"xlaserve_{k}", doc, labels=["model"]) for k, (doc, _) in gauges.items()}
        c_fam = {k: CounterMetricFamily(f"xlaserve_{k}", doc, labels=["model"]) for k, (doc, _) in counters.items()}
        spec = _SpecFamilies()
        routes = GaugeMetricFamily("xlaserve_cpu_matmul_path",
                                   "1 for the path (kernel or xla) serving each decoder or encoder matrix and row class",
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
            if st.spec is not None:
                spec.add(info.name, st.spec)
        yield from g_fam.values()
        yield from c_fam.values()
        yield routes
        if spec.models:
            yield from spec.families()
        engine_req = CounterMetricFamily("xlaserve_engine_requests",
                                         "Engine requests: accepted, and each terminal outcome", labels=["outcome"])
        for outcome, value in e.counters.snapshot().items():
            engine_req.add_metric([outcome], float(value))
        yield engine_req
        ready = GaugeMetricFamily("xlaserve_ready", "1 when every model is warm and the server is not draining")
        ready.add_metric([], 1.0 if e.ready() else 0.0)
        yield ready
