"""The engine: the served models, request admission and accounting, behind one async interface.

The engine owns one worker per served model: a `GenerateWorker` (scheduler thread + paged KV
cache, jax_engine/decode/worker.py) for decoders, an `EmbedWorker` for encoders. Workers run
on their own threads; results cross back to the asyncio loop only through
`loop.call_soon_threadsafe` (generated tokens batched per loop: handoff.py), so nothing else is
shared between threads.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
import weakref
from typing import TYPE_CHECKING, AsyncIterator, Callable, Optional, TypeVar, Union

from jax_engine import heap
from jax_engine.config import EngineArgs, ModelSpec, ResolvedSpec, resolve
from jax_engine.errors import (
    AlreadyExists,
    EngineError,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    Unavailable,
    Unimplemented,
)
from jax_engine.handoff import LoopHandoff
from jax_engine.types import (
    TOKENIZE_INLINE_CHARS,
    AdapterInfo,
    Constraint,
    EmbedOutput,
    EmbedRequest,
    GenerateOutput,
    GenerateRequest,
    ModelInfo,
    ModelStats,
)

if TYPE_CHECKING:  # annotations only: the workers load heavy modules (jax, transformers)
    from jax_engine.constrain.compiler import CompiledGrammar
    from jax_engine.decode.runner import ModelRunner
    from jax_engine.decode.worker import GenerateWorker
    from jax_engine.encode.worker import EmbedWorker
    from jax_engine.executor.multihost import StepChannel

    Worker = Union[GenerateWorker, EmbedWorker]



class Counters:
    """Request accounting: every accepted request ends in exactly one terminal outcome."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.accepted = 0
        self.completed = 0
        self.errored = 0
        self.cancelled = 0

    def add(self, field: str) -> None:
        with self._lock:
            setattr(self, field, getattr(self, field) + 1)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "accepted": self.accepted,
                "completed": self.completed,
                "errored": self.errored,
                "cancelled": self.cancelled,
            }


T = TypeVar("T")


class Engine:
    """Models, requests and stats. Construct, then `load_all()` (blocking), then serve.

    `channel`: the multi-host step channel (jax_engine/executor/multihost.py) when this process is one of
    several in a slice; the entry point that joined the slice passes it in.
    """

    def __init__(self, args: EngineArgs, channel: Optional["StepChannel"] = None):
        self.args = args
        self.channel = channel
        self._workers: dict[str, "Worker"] = {}
        self._lock = threading.Lock()
        self._adapter_lock = threading.Lock()
        self._draining = False
        self._loaded = False
        self.counters = Counters()
        self.start_time = time.time()
        # in-flight requests by id -> callable(message) that ends them with an explicit error
        self._inflight: dict[int, object] = {}
        self._inflight_ids = iter(range(1, 1 << 62))
        self._handoffs: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopHandoff]" = weakref.WeakKeyDictionary()
        from jax_engine.executor.compilation import enable_persistent_cache, install_compile_listener  # heavy: jax

        install_compile_listener()
        self.compile_cache_dir = enable_persistent_cache(args.compile_cache_dir)
        if args.cpu_matmul != "xla" and args.models:
            from jax_engine.executor import backend
            from jax_engine.kernels import cpu as cpu_kernels

            if backend.platform() == "cpu":
                cpu_kernels.build_in_background()

    # ---------------------------------------------------------------- lifecycle

    def _handoff(self, loop: asyncio.AbstractEventLoop) -> LoopHandoff:
        """The loop's batched hand-off (one per loop; created on the loop's own thread)."""
        h = self._handoffs.get(loop)
        if h is None:
            h = self._handoffs[loop] = LoopHandoff(loop)
        return h
    def load_all(self, progress: bool = True, warmup: bool = True) -> None:
        """Load, warm up and start every model in `args.models` (blocking).

        warmup=False compiles programs on first use instead (tests that only need a few shapes).
        """
        for spec in self.args.models:
            self.load_model_sync(spec, progress=progress, warmup=warmup)
            self.start_model_sync(spec.name)
        for name, path in self.args.loras:       # --lora NAME=PATH: onto the default generation model
            self.load_adapter_sync(name, path)
        self._loaded = True

    def load_model_sync(self, spec: ModelSpec, progress: bool = True, warmup: bool = True) -> ModelInfo:
        if spec.name in self._workers:
            raise InvalidRequest(f"model {spec.name!r} is already loaded")
        worker = _make_worker(resolve(spec, self.args), self.args, self.channel)
        if warmup:
            worker.warmup(progress=progress)
        with self._lock:
            self._workers[spec.name] = worker
        heap.refreeze()
        return worker.info

    def start_model_sync(self, name: str) -> None:
        w = self._worker(name)
        w.start()
        w.info.state = "running"
        w.info.ready = True

    def stop_model_sync(self, name: str, timeout: float = 30.0) -> None:
        w = self._worker(name)
        w.info.ready = False
        w.info.state = "stopped"
        w.stop(timeout)

    def release_model_sync(self, name: str) -> None:
        w = self._worker(name)
        if w.info.state == "running":
            self.stop_model_sync(name)
        with self._lock:
            del self._workers[name]
        heap.refreeze()

    async def load_model(self, spec: ModelSpec) -> ModelInfo:
        if self.args.model_root is None:
            raise PermissionDenied("loading models over the network needs --model-root")
        _check_under_root(spec.path, self.args.model_root)
        if self.channel is not None:
            raise Unimplemented("loading models at run time is not supported with more than one process: "
                              "the other processes load their models at start-up (restart the slice with --model)")
        return await asyncio.to_thread(self.load_model_sync, spec, False)

    async def start_model(self, name: str) -> None:
        await asyncio.to_thread(self.start_model_sync, name)

    async def stop_model(self, name: str) -> None:
        await asyncio.to_thread(self.stop_model_sync, name)

    async def release_model(self, name: str) -> None:
        await asyncio.to_thread(self.release_model_sync, name)

    def begin_drain(self) -> None:
        """Refuse new requests from now on; in-flight ones continue."""
        self._draining = True

    def fail_in_flight(self, message: str) -> int:
        """End every in-flight request now with an explicit Unavailable error (drain deadline);
        returns how many were ended. Fronts report it as UNAVAILABLE / 503 / GenerateInterrupted.
        Call on the event loop that serves the requests."""
        enders = list(self._inflight.values())
        for end in enders:
            end(message)
        return len(enders)

    def shutdown(self, timeout: float = 5.0) -> None:
        for name in list(self._workers):
            try:
                self._workers[name].stop(timeout)
            except Exception:
                pass

    # ---------------------------------------------------------------- state
    def ready(self) -> bool:
        return self._loaded and not self._draining and self.healthy()

    def healthy(self) -> bool:
        return all(w.alive() for w in self._workers.values() if w.info.state == "running")

    @property
    def draining(self) -> bool:
        return self._draining

    def models(self) -> list[ModelInfo]:
        return [w.info for w in self._workers.values()]

    def model_info(self, name: Optional[str] = None, task: Optional[str] = None) -> ModelInfo:
        return self._resolve(name, task).info

    def default_model(self, task: str) -> Optional[str]:
        for n, w in self._workers.items():
            if _task_matches(w.info.task, task):
                return n
        return None

    def tokenizer(self, name: Optional[str] = None, task: Optional[str] = None):
        """The model's HF tokenizer (fronts use it for text, chat templates, Arctic prompts)."""
        return self._resolve(name, task).tokenizer

    def stats(self, name: Optional[str] = None) -> ModelStats:
        return self._resolve(name, None).stats()

    # ---------------------------------------------------------------- LoRA adapters
    def adapters(self, model: Optional[str] = None) -> list[AdapterInfo]:
        workers = [self._worker(model)] if model else list(self._workers.values())
        return [a for w in workers if w.info.task == "generate" for a in w.adapters()]

    def load_adapter_sync(self, name: str, path: str, model: Optional[str] = None) -> AdapterInfo:
        """Load a PEFT adapter onto `model` (default: the default generation model); any local path."""
        target = model or self.default_model("generate")
        if target is None:
            raise NotFound("no generation model is served to load a LoRA adapter onto")
        worker = self._worker(target)
        if worker.info.task != "generate":
            raise InvalidRequest(f"model {target!r} is an {worker.info.task} model; LoRA adapters apply to generation models")
        with self._adapter_lock:    # names are engine-wide: one adapter name, one base model
            if name in self._workers:
                raise InvalidRequest(f"lora_name {name!r} is the name of a served model")
            if any(a.name == name for a in self.adapters()):
                raise AlreadyExists(f"LoRA adapter {name!r} is already loaded")
            return worker.load_adapter(name, path)

    async def load_adapter(self, name: str, path: str, model: Optional[str] = None) -> AdapterInfo:
        """Network-supplied adapter path: must lie under --model-root."""
        if self.args.model_root is None:
            raise PermissionDenied("loading LoRA adapters over the network needs --model-root")
        _check_under_root(path, self.args.model_root, "lora_path")
        return await asyncio.get_running_loop().run_in_executor(None, self.load_adapter_sync, name, path, model)

    async def unload_adapter(self, name: str) -> None:
        for w in list(self._workers.values()):
            if w.info.task == "generate" and any(a.name == name for a in w.adapters()):
                w.unload_adapter(name)
                return
        raise NotFound(f"LoRA adapter {name!r} is not loaded")

    def worker(self, name: str) -> "Worker":
        """The worker serving model `name` (NotFound if none)."""
        return self._worker(name)

    def decoder_runners(self) -> dict[str, "ModelRunner"]:
        """Every decoder replica's ModelRunner, by "<model>/<replica>" (unwrapped: a multi-host
        follower replays process 0's calls on these)."""
        runners: dict[str, "ModelRunner"] = {}
        for w in self._workers.values():
            runners.update(getattr(w, "local_runners", {}))
        return runners

    def compilations_after_warmup(self) -> int:
        return sum(w.stats().compilations_after_warmup for w in self._workers.values())

    # ---------------------------------------------------------------- requests
    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Stream outputs of all `n` sequences; errors before the first event raise EngineError.

        Closing the iterator early (client gone) aborts the request.
        """
        self._admit()
        worker = self._resolve(req.model, "generate")
        _check_alive(worker, req.model or worker.info.name)
        if not req.request_id:
            req.request_id = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        handoff = self._handoff(loop)

        def sink(out: GenerateOutput) -> None:
            handoff.post(queue.put_nowait, out)

        grammar = None
        if req.params.constraint is not None:
            grammar = await self._compiled(worker, req.params.constraint)
        # raises InvalidRequest / Overloaded
        handle = await _submit(req.prompt is None or len(req.prompt) <= TOKENIZE_INLINE_CHARS,
                               lambda: worker.submit_generate(req, sink, grammar), worker.abort)
        self.counters.add("accepted")
        token = next(self._inflight_ids)
        self._inflight[token] = lambda message: queue.put_nowait(Unavailable(message))
        reasons: list[str] = []
        done: set[int] = set()
        try:
            while len(reasons) < req.params.n:
                out = await queue.get()
                if isinstance(out, Unavailable):   # fail_in_flight: end the unfinished sequences
                    worker.abort(handle)
                    for i in range(req.params.n):
                        if i not in done:
                            done.add(i)
                            reasons.append("error")
                            yield GenerateOutput(request_id=req.request_id, index=i, finished=True,
                                                 finish_reason="error", error=out.message,
                                                 error_kind=out.kind)
                    break
                if out.finished:
                    done.add(out.index)
                    reasons.append(out.finish_reason or "stop")
                yield out
        finally:
            self._inflight.pop(token, None)
            if len(reasons) < req.params.n:
                worker.abort(handle)           # the consumer left early
            self.counters.add(_outcome(reasons, req.params.n))

    async def _compiled(self, worker: "GenerateWorker", c: Constraint) -> "CompiledGrammar":
        """Wait (in the model's grammar queue) for the constraint's grammar; InvalidRequest when it
        cannot be compiled or takes longer than --grammar-compile-timeout."""
        fut = worker.compile_constraint(c)
        limit = self.args.grammar_compile_timeout_s
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout=limit)
        except asyncio.TimeoutError:
            raise InvalidRequest(f"constraint.{c.kind}: the grammar did not compile within {limit:g} s "
                                 "(--grammar-compile-timeout)") from None

    async def embed(self, req: EmbedRequest) -> EmbedOutput:
        self._admit()
        worker = self._resolve(req.model, "embed")
        _check_alive(worker, req.model or worker.info.name)
        if not req.request_id:
            req.request_id = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def done(result) -> None:
            def _set() -> None:
                if not fut.done():
                    fut.set_result(result)

            loop.call_soon_threadsafe(_set)

        # raises InvalidRequest / Overloaded
        await _submit(_embed_chars(req) <= TOKENIZE_INLINE_CHARS, lambda: worker.submit_embed(req, done),
                      lambda _: worker.abort(req.request_id))
        self.counters.add("accepted")
        token = next(self._inflight_ids)

        def end(message: str) -> None:
            if not fut.done():
                worker.abort(req.request_id)
                fut.set_result(Unavailable(message))

        self._inflight[token] = end
        try:
            result = await fut
        except asyncio.CancelledError:
            worker.abort(req.request_id)
            self.counters.add("cancelled")
            raise
        finally:
            self._inflight.pop(token, None)
        if result is None:
            self.counters.add("cancelled")
            raise Unavailable(f"request {req.request_id!r} was aborted")
        if isinstance(result, EngineError):
            self.counters.add("errored")
            raise result
        self.counters.add("completed")
        return result

    def abort(self, request_id: str) -> bool:
        """Abort `request_id` (and its n>1 sequences) wherever it runs; True if it was found."""
        found = False
        for w in list(self._workers.values()):
            found = w.abort(request_id) or found
        return found

    # ---------------------------------------------------------------- helpers
    def _admit(self) -> None:
        if self._draining:
            raise Unavailable("server is draining; not accepting new requests")
        if not self._loaded:
            raise Unavailable("server is starting; models are not ready yet")

    def _worker(self, name: str):
        w = self._workers.get(name)
        if w is None:
            raise NotFound(f"model {name!r} is not served (served: {sorted(self._workers)})")
        return w

    def _resolve(self, name: Optional[str], task: Optional[str]):
        if name:
            w = self._worker(name)
            if task == "generate" and w.info.task != "generate":
                raise InvalidRequest(f"model {name!r} is an {w.info.task} model, not a generation model")
            if task == "embed" and w.info.task not in ("embed", "classify", "generate"):
                raise InvalidRequest(f"model {name!r} cannot embed")
            if w.info.state != "running":
                raise Unavailable(f"model {name!r} is not running (state {w.info.state})")
            return w
        default = self.default_model(task or "generate") if task else next(iter(self._workers), None)
        if default is None:
            raise NotFound(f"no {task or ''} model is served".replace("  ", " "))
        return self._resolve(default, task)


def _outcome(reasons: list[str], n: int) -> str:
    """The one terminal outcome of a request from its sequences' finish reasons."""
    if "error" in reasons:
        return "errored"
    if len(reasons) < n or "abort" in reasons:
        return "cancelled"
    return "completed"


async def _submit(inline: bool, submit: Callable[[], T], abort: Callable[[T], object]) -> T:
    """submit() (validate, tokenize, queue) on the event loop when `inline`, else on an executor
    thread so a long text's tokenization does not stall the loop (a few sentences tokenize in tens
    of microseconds, less than the executor's two thread hops). If the consumer leaves while it
    runs there, abort(its result) once it is queued."""
    if inline:
        return submit()
    submitting = asyncio.get_running_loop().run_in_executor(None, submit)
    try:
        return await asyncio.shield(submitting)
    except asyncio.CancelledError:
        submitting.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or abort(f.result()))
        raise


def _embed_chars(req: EmbedRequest) -> int:
    """An embed request's input size for the inline-tokenization rule: characters, a token id or
    a malformed item (which the worker refuses) counting one."""
    def size(x: object) -> int:
        return len(x) if isinstance(x, (str, list, tuple)) else 1

    items = [*(req.texts or ()), *(req.token_ids or ())]
    items += [x for p in req.pairs or () for x in (p if isinstance(p, (list, tuple)) else (p,))]
    return sum(size(x) for x in items)


def _check_alive(worker, name: str) -> None:
    """A worker whose thread died (or whose device is gone) takes no new requests."""
    if not worker.alive():
        raise Unavailable(f"model {name!r} is unavailable: its worker is not alive (device lost or crashed)")


def _task_matches(model_task: str, wanted: str) -> bool:
    if wanted == "embed":
        return model_task in ("embed", "classify")
    return model_task == wanted


def _check_under_root(path: str, root: str, what: str = "model path") -> None:
    real = os.path.realpath(path)
    real_root = os.path.realpath(root)
    if os.path.commonpath([real, real_root]) != real_root:
        raise PermissionDenied(f"{what} {path!r} is outside --model-root")


def _make_worker(spec: ResolvedSpec, args: EngineArgs, channel: Optional["StepChannel"]) -> "Worker":
    if spec.task == "generate":
        from jax_engine.decode.worker import GenerateWorker  # heavy: jax, transformers

        return GenerateWorker(spec, args, channel)
    from jax_engine.encode.worker import EmbedWorker  # heavy: jax, transformers

    return EmbedWorker(spec, args)
