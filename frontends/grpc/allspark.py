"""`allspark.allspark_service.AllSpark`: DashInfer's model life cycle and polled generation.

Contract: protos/ (allspark) and tests/frontends/test_grpc_allspark.py. Every failure is reported in `as_status` with
gRPC status OK (the real client turns any non-OK status into UNKNOWN_ERROR). Requests are
keyed by the client's `config.uuid`; a background task per request moves engine events into
a per-request token queue that Get / GetNoWait drain. Everything is an asyncio await, so a
blocked Get never holds a thread and never starves other RPCs.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import uuid as uuidlib
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Awaitable, Callable, Optional

import numpy as np

from frontends.common.access import ALLSPARK_ADMIN_METHODS, ALLSPARK_SERVICE
from frontends.common.errors import as_status, error_message
from frontends.common.version import GIT_SHA, version_string
from frontends.grpc.gen.allspark import allspark_service_pb2 as pb
from frontends.grpc.gen.allspark import allspark_service_pb2_grpc as pb_grpc
from jax_engine.api import EngineAPI, ModelSpec, device_memory
from jax_engine.errors import EngineError, InvalidRequest, NotFound
from jax_engine.types import Constraint, GenerateOutput, GenerateRequest, ModelInfo, SamplingParams

SERVICE = ALLSPARK_SERVICE
log = logging.getLogger("xlaserve.allspark")
# Lifecycle and file-reading RPCs: refused unless admin is enabled (frontends/common/access.py).
ADMIN_METHODS = ALLSPARK_ADMIN_METHODS
MATMUL_PRECISIONS = ("", "highest", "high", "medium")
SUCCESS = pb.ALLSPARK_SUCCESS
PARAM_ERROR = pb.ALLSPARK_PARAM_ERROR
EXCEED_LIMIT = pb.ALLSPARK_EXCEED_LIMIT_ERROR
INVALID_CALL = pb.ALLSPARK_INVALID_CALL_ERROR
ILLEGAL_ID = pb.ALLSPARK_ILLEGAL_REQUEST_ID
DENIED = pb.ALLSPARK_REQUEST_DENIED
# ALLSPARK_LORA_NOT_LOADED: a commented-out (retired) line of the proto enum, so sent as the raw
# number (proto3 enums are open); upstream's engine sends 23 (ALLSPARK_LORA_NOT_FOUND) instead.
LORA_NOT_LOADED = getattr(pb, "ALLSPARK_LORA_NOT_LOADED", 13)
STOP_WAIT_S = 30.0


# ---------------------------------------------------------------------- request state
class _Refused(Exception):
    """A StartRequest validation failure carrying its AS_STATUS."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class _Request:
    uuid: str
    model: str
    engine_id: str
    stop_words: list[list[int]] = field(default_factory=list)  # multi-token ones (single → engine)
    ids: list[int] = field(default_factory=list)
    fetched: int = 0
    done: bool = False            # the engine (or a stop word) has ended it
    final: int = pb.GenerateFinished
    stop_requested: bool = False
    task: Optional[asyncio.Task] = None
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    def status(self) -> int:
        """Reported status: terminal only once every token has been fetched (safe for old clients)."""
        if self.fetched < len(self.ids):
            return pb.Generating
        if self.done:
            return self.final
        return pb.Generating if self.ids else pb.Init

    async def wait(self, predicate: Callable[[], bool]) -> None:
        async with self.changed:
            await self.changed.wait_for(predicate)

    async def update(self, new_ids: list[int], final: Optional[int]) -> None:
        async with self.changed:
            if not self.done:
                self.ids.extend(new_ids)
                if final is not None:
                    self.done, self.final = True, final
            self.changed.notify_all()


# ---------------------------------------------------------------------- servicer
class AllSparkServicer(pb_grpc.AllSparkServicer):
    def __init__(self, engine: EngineAPI, on_shutdown: Optional[Callable[[], Optional[Awaitable[None]]]] = None):
        self.engine = engine
        self.on_shutdown = on_shutdown
        self.requests: dict[str, _Request] = {}

    # ------------------------------------------------------------ model life cycle (admin)
    async def BuildModelFromConfigStruct(self, request: pb.ModelStructConfig, context: Any) -> pb.AsStatus:
        """Builds the model, then attaches `lora_names` (see `_attach_adapters`); a failure there
        releases the model again, so the build succeeds or fails as a whole. The reason of a
        failure travels in the `allspark-error` trailer."""
        try:
            spec = model_spec_from_proto(request)
            lora_names = lora_names_from_proto(request, self.engine.args)
            await self.engine.load_model(spec)
        except NotFound as e:  # the model folder does not exist
            return _status(context, pb.ALLSPARK_IO_ERROR, e.message)
        except Exception as e:
            return _status(context, as_status(e), error_message(e))
        if lora_names:
            try:
                await self._attach_adapters(spec.name, lora_names)
            except Exception as e:
                try:
                    await self.engine.release_model(spec.name)
                except Exception:
                    log.warning("could not release model %s after its adapters failed", spec.name, exc_info=True)
                return _status(context, PARAM_ERROR, f"lora_names: {error_message(e)}")
        return pb.AsStatus(as_status=SUCCESS)

    async def ReloadModelToDeviceMemory(self, request: pb.ModelName, context: Any) -> pb.AsStatus:
        # The shipped client never sends this; weights stay on the device while a model is built.
        return pb.AsStatus(as_status=SUCCESS if self._known(request.model_name) else PARAM_ERROR)

    async def UnloadModelFromDeviceMemory(self, request: pb.ModelName, context: Any) -> pb.AsStatus:
        return pb.AsStatus(as_status=SUCCESS if self._known(request.model_name) else PARAM_ERROR)

    async def StartModel(self, request: pb.ModelName, context: Any) -> pb.AsStatus:
        info = self._info(request.model_name)
        if info is None:
            return pb.AsStatus(as_status=PARAM_ERROR)
        try:
            if info.state != "running":
                await self.engine.start_model(request.model_name)
        except Exception as e:
            return pb.AsStatus(as_status=as_status(e))
        return pb.AsStatus(as_status=SUCCESS)

    async def StopModel(self, request: pb.ModelName, context: Any) -> pb.AsStatus:
        info = self._info(request.model_name)
        if info is None:
            return pb.AsStatus(as_status=PARAM_ERROR)
        try:
            if info.state == "running":
                await self.engine.stop_model(request.model_name)
        except Exception as e:
            return pb.AsStatus(as_status=as_status(e))
        return pb.AsStatus(as_status=SUCCESS)

    async def ReleaseModel(self, request: pb.ModelName, context: Any) -> pb.AsStatus:
        try:
            await self.engine.release_model(request.model_name)
        except Exception as e:
            return pb.AsStatus(as_status=as_status(e))
        for st in [r for r in self.requests.values() if r.model == request.model_name]:
            await self._forget(st)
        return pb.AsStatus(as_status=SUCCESS)

    async def ShutdownService(self, request: pb.Empty, context: Any) -> pb.AsStatus:
        """Answers first, then stops the server ~100 ms later (as upstream)."""
        if self.on_shutdown is not None:
            asyncio.get_running_loop().call_later(0.1, lambda: asyncio.ensure_future(_maybe_await(self.on_shutdown)))
        return pb.AsStatus(as_status=SUCCESS)

    # ------------------------------------------------------------ information
    async def GetModelInformation(self, request: pb.ModelName, context: Any) -> pb.ModelInfo:
        info = self._info(request.model_name)
        if info is None:
            return pb.ModelInfo(model_info="")
        return pb.ModelInfo(model_info=json.dumps(dataclasses.asdict(info), default=str, sort_keys=True))

    async def GetFileInformation(self, request: pb.FileInformationRequest, context: Any) -> pb.FileInformationResponse:
        """Version stamped in an HF folder's config.json; empty strings on any bad path."""
        created = _config_version(request.model_path, self.engine.args.model_root)
        return pb.FileInformationResponse(create_version_graph=created, create_version_param=created,
                                          current_version_engine=version_string())

    async def GetAsEngineStat(self, request: pb.ModelName, context: Any) -> pb.AsEngineStat:
        """Spans are KV pages here (cache_span_size = page size)."""
        try:
            s = self.engine.stats(request.model_name or None)
        except EngineError:
            return pb.AsEngineStat(model_name=request.model_name)
        hits, misses = s.prefix_cache_hit_tokens, s.prefix_cache_miss_tokens
        looked_up = hits + misses
        total_mem, used_mem = device_memory()
        return pb.AsEngineStat(
            model_name=request.model_name or s.name,
            total_span=s.pages_total, used_span=s.pages_used, free_span=s.pages_free,
            free_token=s.pages_free * s.page_size, span_size=s.page_size,
            pendding_request=s.waiting_requests, running_request=s.running_requests,
            total_device_memory_pool_size=total_mem, used_device_memory_pool_size=used_mem,
            total_generated_token=s.total_generated_tokens, total_prefill_token=s.total_prompt_tokens,
            generate_token_persec=s.decode_tokens_per_s, process_token_persec=s.prefill_tokens_per_s,
            prefix_cache_hit_token=hits, prefix_cache_miss_token=misses,
            prefix_cache_hit_rate=hits / looked_up if looked_up else 0.0,
            prefix_cache_miss_rate=misses / looked_up if looked_up else 0.0,
        )

    async def GetVersionFull(self, request: pb.Empty, context: Any) -> pb.VersionInfo:
        return pb.VersionInfo(version_info=f"{version_string()}/(GitSha1:{GIT_SHA})")

    async def GetOpProfilingInfo(self, request: pb.ModelName, context: Any) -> pb.OpProfilingInfo:
        return pb.OpProfilingInfo(op_profiling_info="")  # no per-op profiler in this engine

    async def GetRankId(self, request: pb.Empty, context: Any) -> pb.RankId:
        return pb.RankId(rank_id=0)

    async def GetRankNums(self, request: pb.Empty, context: Any) -> pb.RankId:
        gens = [m for m in self.engine.models() if m.task == "generate"]
        return pb.RankId(rank_id=max((max(1, m.replicas) for m in gens), default=0))

    # ------------------------------------------------------------ requests
    async def StartRequest(self, request: pb.StartRequestRequest, context: Any) -> pb.StartRequestResponse:
        uid = request.config.uuid or uuidlib.uuid4().hex
        try:
            st, req = self._prepare(request, uid)
        except _Refused as e:
            return _refusal(context, uid, e.status, str(e))
        except EngineError as e:
            return _refusal(context, uid, as_status(e), e.message)
        self.requests[uid] = st  # reserve the uuid before yielding to the loop
        refused: list[BaseException] = []
        settled = asyncio.Event()
        st.task = asyncio.create_task(self._consume(st, self.engine.generate(req), refused, settled))
        if req.params.constraint is None:
            # One loop turn lets the task run the engine's synchronous admission (validate + queue);
            # a refusal there is this call's answer, anything later makes the request Interrupted.
            await asyncio.sleep(0)
        else:
            # The engine compiles a grammar off the event loop before admitting the request, so a
            # grammar it cannot compile is refused loop turns later: wait for that verdict (the
            # first event, or the refusal), as upstream builds its JSON parser inside StartRequest.
            try:
                await settled.wait()
            except asyncio.CancelledError:  # the caller left: it never learns the uuid, so drop it
                self.requests.pop(uid, None)
                st.task.cancel()
                raise
        if refused:
            self.requests.pop(uid, None)
            err = refused[0]
            message = err.message if isinstance(err, EngineError) else f"internal error: {type(err).__name__}"
            status = as_status(err)
            if req.adapter and isinstance(err, NotFound):  # unloaded since _prepare looked
                status, message = LORA_NOT_LOADED, f"config.lora_name {req.adapter!r}: {message}"
            return _refusal(context, uid, status, _constraint_message(message, req))
        return pb.StartRequestResponse(as_status=SUCCESS, uuid=uid)

    async def StopRequest(self, request: pb.StopRequestRequest, context: Any) -> pb.StartRequestResponse:
        st = self.requests.get(request.uuid)
        if st is None:
            return pb.StartRequestResponse(as_status=ILLEGAL_ID, uuid=request.uuid)
        await self._stop(st)
        return pb.StartRequestResponse(as_status=SUCCESS, uuid=request.uuid)

    async def ReleaseRequest(self, request: pb.StopRequestRequest, context: Any) -> pb.StartRequestResponse:
        st = self.requests.get(request.uuid)
        if st is None:
            return pb.StartRequestResponse(as_status=ILLEGAL_ID, uuid=request.uuid)
        await self._forget(st)
        return pb.StartRequestResponse(as_status=SUCCESS, uuid=request.uuid)

    async def SyncRequest(self, request: pb.StopRequestRequest, context: Any) -> pb.StartRequestResponse:
        """Wait until the request (empty uuid: every request of the model, or all) has ended."""
        if request.uuid:
            st = self.requests.get(request.uuid)
            if st is None:
                return pb.StartRequestResponse(as_status=ILLEGAL_ID, uuid=request.uuid)
            await st.wait(lambda: st.done)
        else:
            for st in list(self.requests.values()):
                if not request.model_name or st.model == request.model_name:
                    await st.wait(lambda st=st: st.done)
        return pb.StartRequestResponse(as_status=SUCCESS, uuid=request.uuid)

    async def GenerateStatus(self, request: pb.UUID, context: Any) -> pb.GenerateRequestStatus:
        st = self.requests.get(request.uuid)
        return pb.GenerateRequestStatus(status=st.status() if st else pb.Init)

    async def GeneratedLength(self, request: pb.UUID, context: Any) -> pb.GenerateLen:
        st = self.requests.get(request.uuid)
        return pb.GenerateLen(len=len(st.ids) if st else 0)

    async def Get(self, request: pb.UUID, context: Any) -> pb.GeneratedElements:
        """Blocks until at least one new token or the end; returns only the new ids."""
        st = self.requests.get(request.uuid)
        if st is not None:
            await st.wait(lambda: st.fetched < len(st.ids) or st.done)
        return _take(st)

    async def GetNoWait(self, request: pb.UUID, context: Any) -> pb.GeneratedElements:
        return _take(self.requests.get(request.uuid))

    # ------------------------------------------------------------ helpers
    async def _attach_adapters(self, model: str, names: list[str]) -> None:
        """Each name must be an adapter already loaded onto `model`, or a PEFT folder of that name
        directly under --model-root, which is loaded onto `model`. On a failure the adapters
        loaded here are unloaded again."""
        loaded_here: list[str] = []
        try:
            for name in names:
                existing = next((a for a in self.engine.adapters() if a.name == name), None)
                if existing is not None:
                    if existing.model != model:
                        raise InvalidRequest(f"adapter {name!r} is loaded on model {existing.model!r}, not {model!r}")
                    continue
                root = self.engine.args.model_root
                if root is None:
                    raise InvalidRequest(f"adapter {name!r} is not loaded, and loading one needs --model-root")
                path = os.path.join(root, name)
                if not os.path.isdir(path):
                    raise InvalidRequest(f"adapter {name!r} is not loaded and is not a folder under --model-root")
                await self.engine.load_adapter(name, path, model=model)
                loaded_here.append(name)
        except Exception:
            for name in loaded_here:
                try:
                    await self.engine.unload_adapter(name)
                except Exception:
                    log.warning("could not unload adapter %s after a failed build", name, exc_info=True)
            raise

    def _adapter(self, name: str, info: ModelInfo) -> Optional[str]:
        """config.lora_name: None, or an adapter loaded on `info`'s model (else LORA_NOT_LOADED)."""
        if not name:
            return None
        adapter = next((a for a in self.engine.adapters(info.name) if a.name == name), None)
        if adapter is None:
            raise _Refused(LORA_NOT_LOADED, f"config.lora_name {name!r} is not loaded on model {info.name!r}")
        if adapter.state != "loaded":
            raise _Refused(LORA_NOT_LOADED, f"config.lora_name {name!r} is being unloaded")
        return name

    def _known(self, name: str) -> bool:
        return self._info(name) is not None

    def _info(self, name: str) -> Optional[ModelInfo]:
        """A model's info whatever its state (engine.model_info refuses stopped models)."""
        return next((m for m in self.engine.models() if m.name == name), None)

    def _prepare(self, request: pb.StartRequestRequest, uid: str) -> tuple[_Request, GenerateRequest]:
        if uid in self.requests:
            raise _Refused(PARAM_ERROR, f"config.uuid {uid!r} is already in use")
        info = self._generation_model(request.model_name)
        if request.infer_type != pb.Generate:
            raise _Refused(PARAM_ERROR, "infer_type: only Generate is supported")
        if request.mm_type != pb.TextInput:
            raise _Refused(PARAM_ERROR, "mm_type: only TextInput is supported")
        ids = input_ids_from_proto(request.inputs, info)
        params, stop_words = sampling_from_config(request.config, len(ids), info)
        adapter = self._adapter(request.config.lora_name, info)
        st = _Request(uuid=uid, model=info.name, engine_id=f"allspark:{uid}", stop_words=stop_words)
        req = GenerateRequest(request_id=st.engine_id, prompt_ids=ids, params=params, model=info.name, adapter=adapter)
        return st, req

    def _generation_model(self, name: str) -> ModelInfo:
        info = self._info(name or self.engine.default_model("generate") or "")
        if info is None:
            raise _Refused(PARAM_ERROR, f"model {name!r} is not served")
        if info.task != "generate":
            raise _Refused(INVALID_CALL, f"model {info.name!r} is not a generation model")
        if info.state != "running":
            raise _Refused(DENIED, f"model {info.name!r} is not running (state {info.state})")
        return info

    async def _consume(self, st: _Request, outputs: AsyncGenerator[GenerateOutput, None], refused: list[BaseException],
                       settled: asyncio.Event) -> None:
        """Move engine events into the request's queue until it ends. `settled` is set once the
        engine has admitted the request (its first event) or refused it (`refused` holds why)."""
        started = False
        try:
            async for out in outputs:
                if not started:
                    started = True
                    settled.set()
                new = list(out.new_token_ids)
                cut = _stop_word_end(st.ids, new, st.stop_words)
                if cut is not None:
                    await st.update(new[:cut], pb.GenerateFinished)
                    return  # closing the stream below aborts the engine request, freeing its pages
                end = _final_status(out.finish_reason, st.stop_requested) if out.finished else None
                await st.update(new, end)
        except Exception as e:  # refused at admission, or an engine failure mid-way
            if not started:
                refused.append(e)
        finally:
            settled.set()
            await outputs.aclose()
            if not st.done:
                await st.update([], pb.GenerateFinished if st.stop_requested else pb.GenerateInterrupted)

    async def _stop(self, st: _Request) -> None:
        if st.done:
            return
        st.stop_requested = True
        self.engine.abort(st.engine_id)
        try:
            await asyncio.wait_for(st.wait(lambda: st.done), STOP_WAIT_S)
        except asyncio.TimeoutError:
            await st.update([], pb.GenerateFinished)

    async def _forget(self, st: _Request) -> None:
        self.requests.pop(st.uuid, None)
        if st.task is not None and not st.task.done():
            st.stop_requested = True
            st.task.cancel()  # closing the event stream aborts the engine request
            try:
                await st.task
            except (asyncio.CancelledError, Exception):
                pass
        await st.update([], pb.GenerateFinished)  # wake anything still blocked in Get/Sync


# ---------------------------------------------------------------------- conversions
def model_spec_from_proto(c: pb.ModelStructConfig) -> ModelSpec:
    """ModelStructConfig -> ModelSpec. Fields with no meaning here are ignored on purpose:
    weights_path (an HF folder holds its weights), compute_unit / num_threads / swap_threshold /
    text_graph / cache_mode / prefill_mode (placement and kernels are JAX's),
    cache_span_num_init / _grow (the page pool is sized from memory). is_lora_cfg and
    lora_names: `lora_names_from_proto`.
    matmul_precision is validated and advisory: float32 matmuls already run at "highest" and the
    engine's dtype decides the rest (JAX precision is process-global, not per model)."""
    if not c.model_name:
        raise InvalidRequest("model_name is required")
    if not c.model_path:
        raise InvalidRequest("model_path is required (an HF model folder under --model-root)")
    if c.matmul_precision.lower() not in MATMUL_PRECISIONS:
        raise InvalidRequest(f"matmul_precision must be one of highest, high, medium; got {c.matmul_precision!r}")
    for name in ("engine_max_length", "engine_max_batch", "cache_span_size", "prefix_cache_ttl"):
        if getattr(c, name) < 0:
            raise InvalidRequest(f"{name} must be >= 0, got {getattr(c, name)}")
    return ModelSpec(
        name=c.model_name,
        path=c.model_path,
        max_model_len=c.engine_max_length or None,
        max_running_requests=c.engine_max_batch or None,
        page_size=c.cache_span_size or None,
        enable_prefix_cache=c.enable_prefix_cache,
        prefix_cache_ttl_s=float(c.prefix_cache_ttl),
    )


def lora_names_from_proto(c: pb.ModelStructConfig, args: Any) -> list[str]:
    """The adapters to attach after the build (`lora_names`), checked before anything is built.
    `is_lora_cfg` (ignored upstream) and `lora_names` both need LoRA enabled on this server; a
    name is an adapter name, which is also a folder name directly under --model-root."""
    enabled = args.enable_lora or bool(args.loras)
    if c.is_lora_cfg and not enabled:
        raise InvalidRequest("is_lora_cfg: LoRA is not enabled on this server; start it with --enable-lora "
                             "(or --lora NAME=PATH)")
    names = list(c.lora_names.names)
    if not names:
        return []
    if not enabled:
        raise InvalidRequest("lora_names: LoRA is not enabled on this server; start it with --enable-lora "
                             "(or --lora NAME=PATH)")
    for name in names:
        if not name or name in (".", "..") or any(ch in name for ch in "/\\\0"):
            raise InvalidRequest(f"lora_names: {name!r} is not an adapter name (a folder name directly under "
                                 "--model-root)")
    if len(set(names)) != len(names):
        raise InvalidRequest("lora_names: a name appears twice")
    if len(names) > args.max_loras:
        raise InvalidRequest(f"lora_names: {len(names)} adapters do not fit in --max-loras {args.max_loras} slots")
    return names


def input_ids_from_proto(inputs: pb.TensorMap, info: ModelInfo) -> list[int]:
    """inputs["input_ids"]: INT64, DENSE, shape [1, L], packed little-endian int64."""
    if "input_ids" not in inputs.tensor_map:
        raise _Refused(PARAM_ERROR, "inputs must contain the tensor 'input_ids'")
    t = inputs.tensor_map["input_ids"]
    if t.data_type != pb.INT64:
        got = pb.DATA_TYPE.Name(t.data_type) if t.data_type in pb.DATA_TYPE.values() else t.data_type
        raise _Refused(PARAM_ERROR, f"input_ids.data_type must be INT64, got {got}")
    if t.data_mode != pb.DENSE:
        raise _Refused(PARAM_ERROR, "input_ids.data_mode must be DENSE")
    dims = list(t.shape.dims)
    if len(dims) != 2 or dims[0] != 1 or dims[1] < 0:
        raise _Refused(PARAM_ERROR, f"input_ids.shape must be [1, seq_len], got {dims}")
    if len(t.data) != 8 * dims[1]:
        raise _Refused(PARAM_ERROR,
                       f"input_ids.data has {len(t.data)} bytes; shape {dims} of int64 needs {8 * dims[1]}")
    if dims[1] == 0:
        raise _Refused(EXCEED_LIMIT, "input_ids is empty (seq_len must be > 0)")
    if dims[1] >= info.max_model_len:
        raise _Refused(EXCEED_LIMIT,
                       f"seq_len {dims[1]} leaves no room to generate (engine_max_length {info.max_model_len})")
    ids = np.frombuffer(t.data, dtype="<i8")
    bad = ids[(ids < 0) | (ids >= info.vocab_size)]
    if bad.size:
        raise _Refused(PARAM_ERROR, f"input_ids has id {int(bad[0])} outside the vocabulary [0, {info.vocab_size})")
    return ids.tolist()


def sampling_from_config(c: pb.GenerateConfig, prompt_len: int,
                         info: ModelInfo) -> tuple[SamplingParams, list[list[int]]]:
    """GenerateConfig -> engine params. max_length / min_length are totals (prompt included).

    Honoured: do_sample, temperature, top_k, top_p, repetition_penalty, presence_penalty,
    min_length, max_length, early_stopping + eos_token_id, stop_words_ids, seed (all 64 bits),
    response_format (JSON mode, see `constraint_from_response_format`); lora_name is read by
    `AllSparkServicer._adapter` (a loaded adapter, else LORA_NOT_LOADED).
    Refused when set (PARAM_ERROR, the reason in the `allspark-error` trailer): the fields in
    `_unsupported`. Accepted without effect, as upstream: length_penalty (beam search only, and
    num_beams > 1 is refused), input_len (deprecated, filled internally), async /
    async_token_num / first_token_num / loop_context (scheduling hints), uuid (the request key),
    vocab / vocab_type (upstream builds its JSON parser from them when the model folder has no
    tokenizer; here the grammar is always built from the served model's own tokenizer)."""
    for name, is_set in _unsupported(c):
        if is_set:
            raise _Refused(PARAM_ERROR, f"config.{name} is not supported by this server")
    constraint = constraint_from_response_format(dict(c.response_format))
    for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "length_penalty"):
        value = getattr(c, name)
        if not math.isfinite(value):  # NaN would otherwise read as "unset" below
            raise _Refused(PARAM_ERROR, f"config.{name} must be a finite number, got {value}")
    if c.top_p < 0 or c.top_p > 1:
        raise _Refused(PARAM_ERROR, f"config.top_p must be in [0, 1], got {c.top_p}")
    if c.max_length > info.max_model_len:
        raise _Refused(EXCEED_LIMIT, f"config.max_length {c.max_length} exceeds engine_max_length {info.max_model_len}")
    if c.max_length and c.max_length <= prompt_len:
        raise _Refused(PARAM_ERROR, f"config.max_length {c.max_length} must exceed the prompt length "
                                    f"{prompt_len}: it counts prompt + generated tokens")
    single, multi = [], []
    for arr in c.stop_words_ids.ids:
        words = list(arr.word)
        if len(words) == 1:
            single.append(words[0])
        elif words:
            multi.append(words)
    stop_ids = list(single)
    ignore_eos = True
    if c.early_stopping:
        if c.eos_token_id > 0:
            stop_ids.append(c.eos_token_id)   # the configured EOS replaces the model's
        else:
            ignore_eos = False                # unset: the model's own EOS ids
    params = SamplingParams(
        temperature=c.temperature if c.do_sample and c.temperature > 0 else 0.0,
        top_k=c.top_k if c.top_k > 0 else 0,
        top_p=c.top_p if c.top_p > 0 else 1.0,
        repetition_penalty=c.repetition_penalty if c.repetition_penalty > 0 else 1.0,
        presence_penalty=c.presence_penalty,
        max_new_tokens=c.max_length - prompt_len if c.max_length else None,
        min_new_tokens=max(0, c.min_length - prompt_len),
        stop_token_ids=stop_ids,
        ignore_eos=ignore_eos,
        seed=c.seed & 0xFFFFFFFFFFFFFFFF,
        constraint=constraint,
    )
    return params, multi


RESPONSE_FORMAT_KEYS = ("type", "json_schema")


def constraint_from_response_format(rf: dict[str, str]) -> Optional[Constraint]:
    """DashInfer's JSON mode: `{"type": "json_object"}` is any JSON object (kind json_object);
    with a non-empty `"json_schema": "<schema JSON text>"` the output matches that schema (kind
    json_schema); `{"type": "text"}` is free text. Upstream reads only these two keys and silently
    ignores any other type (or a map without one); here those are refused by name instead. An empty json_schema is the same as
    none, as upstream. Empty map: free text."""
    if not rf:
        return None
    unknown = sorted(k for k in rf if k not in RESPONSE_FORMAT_KEYS)
    if unknown:
        raise _Refused(PARAM_ERROR, f"config.response_format has unknown key {unknown[0]!r} "
                                    f"(known: {', '.join(RESPONSE_FORMAT_KEYS)})")
    kind = rf.get("type")
    if kind is None:
        raise _Refused(PARAM_ERROR, "config.response_format.type is required (\"json_object\")")
    if kind == "text" and not rf.get("json_schema", "").strip():
        return None                     # OpenAI's name for free text
    if kind != "json_object":
        raise _Refused(PARAM_ERROR, f"config.response_format.type {kind!r} is not supported "
                                    "(\"json_object\", or \"text\" without a schema)")
    schema = rf.get("json_schema", "")
    if schema.strip():
        return Constraint(kind="json_schema", spec=schema)
    return Constraint(kind="json_object")


def _constraint_message(message: str, req: GenerateRequest) -> str:
    """An engine refusal of the constraint ("constraint.<kind>: why") named by this protocol's
    field: config.response_format.json_schema for a schema, config.response_format for JSON mode."""
    field, sep, rest = message.partition(":")
    c = req.params.constraint
    if c is None or not sep or field.split(".")[0] != "constraint":
        return message
    name = "config.response_format.json_schema" if c.kind == "json_schema" else "config.response_format"
    return f"{name}:{rest}"


def _unsupported(c: pb.GenerateConfig) -> tuple[tuple[str, bool], ...]:
    """(field, set to a value the engine cannot honour) for every GenerateConfig field refused."""
    return (
        ("num_beams", c.num_beams > 1),
        ("num_return_sequences", c.num_return_sequences > 1),
        ("no_repeat_ngram_size", c.no_repeat_ngram_size > 0),
        ("bad_words_ids", any(len(a.word) for a in c.bad_words_ids.ids)),
        ("suppress_repetition_in_generation", c.suppress_repetition_in_generation),
        # per-row arrays of a batched call: one request here has one top_k / top_p / seed
        ("top_k_arr", len(c.top_k_arr) > 0),
        ("top_p_arr", len(c.top_p_arr) > 0),
        ("seed_arr", len(c.seed_arr) > 0),
        ("probe_only", c.probe_only),
    )


ERROR_TRAILER = "allspark-error"


def _status(context: Any, status: int, message: str) -> pb.AsStatus:
    """A failed life-cycle call: the status in-band, the reason in the `allspark-error` trailer."""
    log.info("AllSpark call refused (as_status %d): %s", status, message)
    context.set_trailing_metadata(((ERROR_TRAILER, _ascii_line(message)),))
    return pb.AsStatus(as_status=status)


def _refusal(context: Any, uid: str, status: int, message: str) -> pb.StartRequestResponse:
    """A refused StartRequest: the status in-band (gRPC OK, as upstream) and the reason, which
    names the field, in the `allspark-error` trailer (the JSON mirror: `trailer-allspark-error`)."""
    log.info("StartRequest %s refused (as_status %d): %s", uid, status, message)
    context.set_trailing_metadata(((ERROR_TRAILER, _ascii_line(message)),))
    return pb.StartRequestResponse(as_status=status, uuid=uid)


def _ascii_line(text: str, limit: int = 1024) -> str:
    """`text` as a legal metadata value: printable ASCII, one line, bounded."""
    return "".join(ch if " " <= ch <= "~" else "?" for ch in text)[:limit]


def _final_status(reason: Optional[str], stop_requested: bool) -> int:
    if reason in ("stop", "length") or (reason == "abort" and stop_requested):
        return pb.GenerateFinished
    return pb.GenerateInterrupted  # error, or aborted by someone else (eviction, drain)


def _stop_word_end(ids: list[int], new: list[int], words: list[list[int]]) -> Optional[int]:
    """How many of `new` to keep when a multi-token stop word completes inside them."""
    if not words or not new:
        return None
    seq = ids + new
    for k in range(len(ids) + 1, len(seq) + 1):
        if any(k >= len(w) and seq[k - len(w):k] == w for w in words):
            return k - len(ids)
    return None


def _take(st: Optional[_Request]) -> pb.GeneratedElements:
    msg = pb.GeneratedElements(empty=0)
    msg.tensors_from_model_inference.SetInParent()
    if st is not None:
        end = len(st.ids)
        msg.ids_from_generate.extend(st.ids[st.fetched:end])
        st.fetched = end
    return msg


def _config_version(path: str, root: Optional[str]) -> str:
    """transformers_version from config.json of a folder under --model-root, else ""."""
    try:
        if not path or not root:
            return ""
        real, real_root = os.path.realpath(path), os.path.realpath(root)
        if os.path.commonpath([real, real_root]) != real_root:
            return ""
        cfg = os.path.join(real, "config.json") if os.path.isdir(real) else real
        if os.path.getsize(cfg) > 16 * 1024 * 1024:
            return ""
        with open(cfg) as f:
            return str(json.load(f).get("transformers_version", ""))
    except Exception:
        return ""


async def _maybe_await(fn: Callable[[], Any]) -> None:
    result = fn()
    if asyncio.iscoroutine(result):
        await result
