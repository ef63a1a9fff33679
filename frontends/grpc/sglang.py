"""`sglang.grpc.scheduler.SglangScheduler` (seed revision): what the SGLang router talks to.

Contract: protos/ (sglang) and tests/frontends/test_grpc_sglang.py. Errors travel as gRPC status codes, never as
`GenerateError` (both seed-era and newer routers understand a status). Zero values of an
explicit `sampling_params` are read the way SGLang reads them; an absent message means the
engine's semantic defaults. Request fields we cannot honour are refused by name, never dropped.
`lora_id` names a loaded LoRA adapter (engine-wide names): the request runs on the model that
adapter is loaded on; an unknown one is NOT_FOUND. `GetLoads` reports the adapter slots in `lora`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from datetime import datetime, timezone
from typing import Any, AsyncIterator, Optional

from google.protobuf import timestamp_pb2

from frontends.common.errors import abort_with, engine_error
from frontends.common.version import version_string
from frontends.grpc.gen.sglang import sglang_scheduler_pb2 as pb
from frontends.grpc.gen.sglang import sglang_scheduler_pb2_grpc as pb_grpc
from jax_engine.api import EngineAPI
from jax_engine.errors import EngineError, InvalidRequest, NotFound
from jax_engine.types import (
    Constraint,
    EmbedRequest,
    GenerateOutput,
    GenerateRequest,
    ModelInfo,
    SamplingParams,
    TokenLogprob,
)

SERVICE = "sglang.grpc.scheduler.SglangScheduler"
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")
# SamplingParams `constraint` oneof member -> the engine's Constraint kind (spec = the text as sent)
CONSTRAINT_KINDS = {"regex": "regex", "json_schema": "json_schema", "ebnf_grammar": "ebnf",
                    "structural_tag": "structural_tag"}
_BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


class SglangServicer(pb_grpc.SglangSchedulerServicer):
    def __init__(self, engine: EngineAPI):
        self.engine = engine
        self.active_requests = 0
        self.last_receive_timestamp = 0.0

    # ------------------------------------------------------------------ Generate
    async def Generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        try:
            info = self._generation_model(request.lora_id)
            req, interval = build_generate_request(request, info)
        except EngineError as e:
            await abort_with(context, e)
            return
        stream = _ResponseStream(request, req, interval, info)
        outputs = self.engine.generate(req)
        self.active_requests += 1
        try:
            async for out in outputs:
                self.last_receive_timestamp = time.time()
                if out.finished and out.finish_reason == "error":
                    await abort_with(context, engine_error(out.error_kind, out.error or "generation failed"))
                for msg in stream.on_output(out):
                    yield msg
            for msg in stream.at_end():
                yield msg
        except EngineError as e:  # refused at admission (before any event)
            await abort_with(context, _constraint_error(e, req))
        finally:
            self.active_requests -= 1
            await outputs.aclose()  # aborts the request if the call was cancelled mid-stream

    # ------------------------------------------------------------------ Embed
    async def Embed(self, request: pb.EmbedRequest, context: Any) -> pb.EmbedResponse:
        rid = request.request_id or uuid.uuid4().hex
        try:
            req = self._embed_request(request, rid)
            self.active_requests += 1
            try:
                out = await self.engine.embed(req)
            finally:
                self.active_requests -= 1
        except EngineError as e:
            await abort_with(context, e)
            return pb.EmbedResponse()
        self.last_receive_timestamp = time.time()
        rows = out.scores if request.is_cross_encoder else out.embeddings
        if rows is None:
            rows = out.embeddings if out.embeddings is not None else out.scores
        rows = [[float(v) for v in row] for row in rows]
        complete = pb.EmbedComplete(embedding=rows[0], prompt_tokens=out.prompt_tokens, cached_tokens=0,
                                    embedding_dim=len(rows[0]))
        if len(rows) > 1 or request.is_cross_encoder:
            complete.batch_embeddings.extend(pb.Embedding(values=r, index=i) for i, r in enumerate(rows))
        return pb.EmbedResponse(request_id=rid, complete=complete)

    def _embed_request(self, request: pb.EmbedRequest, rid: str) -> EmbedRequest:
        if _has_content(request, "mm_inputs"):
            raise InvalidRequest("mm_inputs is not supported: this server embeds text tokens only")
        if request.is_cross_encoder:
            texts = list(request.texts)
            if not texts or len(texts) % 2:
                raise InvalidRequest("texts must hold (query, document) pairs for is_cross_encoder, "
                                     f"an even number of strings; got {len(texts)}")
            model = _first_model(self.engine, "classify")
            if model is None:
                raise InvalidRequest("is_cross_encoder needs a served classification (cross-encoder) model")
            return EmbedRequest(request_id=rid, pairs=list(zip(texts[0::2], texts[1::2])), model=model)
        model = _first_model(self.engine, "embed") or _first_model(self.engine, "classify")
        if model is None:
            raise InvalidRequest("no embedding model is served")
        has_ids = request.HasField("tokenized") and bool(request.tokenized.input_ids)
        if request.texts:
            # Texts are embedded (tokenized here), one vector per text in batch_embeddings.
            if has_ids or request.token_type_ids:
                raise InvalidRequest("texts and tokenized.input_ids / token_type_ids are mutually exclusive: "
                                     "send either texts or one tokenized input")
            return EmbedRequest(request_id=rid, texts=list(request.texts), model=model)
        if not has_ids:
            raise InvalidRequest("tokenized.input_ids (or texts) is required and must not be empty")
        tt = [list(request.token_type_ids)] if request.token_type_ids else None
        return EmbedRequest(request_id=rid, token_ids=[list(request.tokenized.input_ids)],
                            token_type_ids=tt, model=model)

    # ------------------------------------------------------------------ management
    async def HealthCheck(self, request: pb.HealthCheckRequest, context: Any) -> pb.HealthCheckResponse:
        """Answers at once from engine state; never a non-OK status (routers read `healthy`)."""
        if self.engine.draining:
            return pb.HealthCheckResponse(healthy=False, message="Server is shutting down")
        if not self.engine.ready():
            reason = "engine worker is not alive" if not self.engine.healthy() else "models are not loaded yet"
            return pb.HealthCheckResponse(healthy=False, message=f"Server is not ready: {reason}")
        return pb.HealthCheckResponse(healthy=True, message="Health check passed")

    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortResponse:
        """Aborts the id and its n>1 children (engine.abort), never other ids sharing a prefix."""
        try:
            self.engine.abort(request.request_id)
        except Exception as e:
            return pb.AbortResponse(success=False, message=str(e))
        return pb.AbortResponse(success=True, message=f"Request {request.request_id} aborted")

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Any) -> pb.GetModelInfoResponse:
        try:
            info = self._main_model()
        except EngineError as e:
            await abort_with(context, e)
            return pb.GetModelInfoResponse()
        resp = pb.GetModelInfoResponse(
            model_path=info.path,
            tokenizer_path=info.tokenizer_path,
            is_generation=info.task == "generate",
            preferred_sampling_params="",
            weight_version="default",
            served_model_name=info.name,
            max_context_length=info.max_model_len,
            vocab_size=info.vocab_size,
            supports_vision=False,
            model_type=info.model_type,
            eos_token_ids=list(info.eos_token_ids),
            pad_token_id=info.pad_token_id or 0,
            bos_token_id=info.bos_token_id or 0,
            max_req_input_len=self._max_req_input_len(info),
            architectures=[info.architecture] if info.architecture else [],
        )
        if info.task == "classify" and info.id2label:
            resp.id2label_json = json.dumps({str(k): v for k, v in sorted(info.id2label.items())})
            resp.num_labels = len(info.id2label)
        return resp

    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context: Any) -> pb.GetServerInfoResponse:
        args = self.engine.args
        server_args = _jsonable(dataclasses.asdict(args))
        server_args.update(tp_size=args.tp, dp_size=args.replicas,
                           served_models=[m.name for m in self.engine.models()])
        scheduler_info: dict[str, Any] = {"max_running_requests": args.max_running_requests,
                                          "max_num_batched_tokens": args.max_num_batched_tokens}
        try:
            info = self._main_model()
            stats = self.engine.stats(info.name)
            scheduler_info.update(model=info.name, max_total_num_tokens=stats.pages_total * stats.page_size,
                                  max_num_batched_tokens=stats.max_num_batched_tokens,
                                  page_size=stats.page_size, max_req_input_len=self._max_req_input_len(info),
                                  max_model_len=info.max_model_len)
        except EngineError:
            pass
        resp = pb.GetServerInfoResponse(
            active_requests=self.active_requests,
            is_paused=False,
            last_receive_timestamp=self.last_receive_timestamp,
            uptime_seconds=time.time() - self.engine.start_time,
            sglang_version=f"xlaserve {version_string()}",
            server_type="grpc",
            start_time=timestamp_pb2.Timestamp(seconds=int(self.engine.start_time)),
        )
        resp.server_args.update(server_args)
        resp.scheduler_info.update(_jsonable(scheduler_info))
        return resp

    async def GetLoads(self, request: pb.GetLoadsRequest, context: Any) -> pb.GetLoadsResponse:
        include = list(request.include) or ["all"]
        unknown = [s for s in include if s not in LOAD_SECTIONS]
        if unknown:
            await abort_with(context, InvalidRequest(
                f"include has unknown section(s) {unknown}; valid: {', '.join(LOAD_SECTIONS)}"))
            return pb.GetLoadsResponse()
        sections = set(LOAD_SECTIONS) if "all" in include else set(include)
        try:
            info = self._main_model()
            stats = self.engine.stats(info.name)
        except EngineError as e:
            await abort_with(context, e)
            return pb.GetLoadsResponse()
        ranks = stats.replicas or [stats]
        # LoRA slots are the same on every replica (each holds every adapter): the model's numbers
        lora = _lora_metrics(stats) if "lora" in sections else None
        loads = [_scheduler_load(r, s, info, sections, lora) for r, s in enumerate(ranks)]
        if request.HasField("dp_rank"):
            loads = [ld for ld in loads if ld.dp_rank == request.dp_rank]
        resp = pb.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(),
                                   version=version_string(), dp_rank_count=len(loads), loads=loads)
        if loads:
            resp.aggregate.CopyFrom(pb.AggregateMetrics(
                total_running_reqs=sum(ld.num_running_reqs for ld in loads),
                total_waiting_reqs=sum(ld.num_waiting_reqs for ld in loads),
                total_reqs=sum(ld.num_total_reqs for ld in loads),
                avg_token_usage=round(sum(ld.token_usage for ld in loads) / len(loads), 4),
                avg_throughput=round(sum(ld.gen_throughput for ld in loads) / len(loads), 2),
                avg_utilization=round(sum(ld.utilization for ld in loads) / len(loads), 4),
            ))
        return resp

    # ------------------------------------------------------------------ helpers
    def _generation_model(self, lora_id: str) -> ModelInfo:
        """The default generator; with `lora_id`, the base model that adapter is loaded on
        (NotFound if no adapter of that name is loaded)."""
        if not lora_id:
            return self.engine.model_info(None, "generate")
        adapter = next((a for a in self.engine.adapters() if a.name == lora_id), None)
        if adapter is None or adapter.state != "loaded":
            loaded = ", ".join(sorted(a.name for a in self.engine.adapters() if a.state == "loaded")) or "none"
            why = "is being unloaded" if adapter is not None else f"is not loaded (loaded: {loaded})"
            raise NotFound(f"lora_id {lora_id!r}: this LoRA adapter {why}")
        return self.engine.model_info(adapter.model, "generate")

    def _main_model(self) -> ModelInfo:
        """The model this worker presents to the router: the default generator, else any."""
        name = self.engine.default_model("generate") or next((m.name for m in self.engine.models()), None)
        if name is None:
            raise NotFound("no model is served")
        return self.engine.model_info(name)

    def _max_req_input_len(self, info: ModelInfo) -> int:
        limit = self.engine.args.max_prompt_tokens
        longest = max(1, info.max_model_len - 1)  # leave room for at least one new token
        return min(limit, longest) if limit else longest


# ---------------------------------------------------------------------- request conversion
def build_generate_request(request: pb.GenerateRequest, info: ModelInfo) -> tuple[GenerateRequest, int]:
    """Engine request + stream interval from the wire request; InvalidRequest names bad fields."""
    _refuse_unsupported(request)
    if not request.HasField("tokenized"):
        raise InvalidRequest("tokenized is required (this protocol carries token ids, not text)")
    n_ids = len(request.tokenized.input_ids)
    if not n_ids:
        raise InvalidRequest("tokenized.input_ids must not be empty")
    if n_ids >= info.max_model_len:  # refuse a huge prompt before copying it (the engine checks the rest)
        raise InvalidRequest(f"tokenized.input_ids: {n_ids} tokens exceeds the limit of {info.max_model_len - 1} "
                             f"(context length {info.max_model_len})")
    prompt = list(request.tokenized.input_ids)
    explicit = request.sampling_params if request.HasField("sampling_params") else None
    params, interval = sampling_from_proto(explicit)
    if params.max_new_tokens is not None:
        # SGLang clips a requested max_new_tokens to the room left in the context.
        room = info.max_model_len - len(prompt)
        if room > 0:
            params.max_new_tokens = min(params.max_new_tokens, room)
    if request.return_logprob:
        if request.top_logprobs_num < 0:
            raise InvalidRequest(f"top_logprobs_num must be >= 0, got {request.top_logprobs_num}")
        params.logprobs = True
        params.top_logprobs = request.top_logprobs_num
        if request.logprob_start_len >= 0:  # -1 = no input logprobs
            params.prompt_logprobs_start = request.logprob_start_len
    rid = request.request_id or uuid.uuid4().hex
    # info is the model lora_id's adapter is loaded on (SglangServicer._generation_model)
    adapter = request.lora_id or None
    return GenerateRequest(request_id=rid, prompt_ids=prompt, params=params, model=info.name if adapter else None,
                           adapter=adapter), interval


def sampling_from_proto(p: Optional[pb.SamplingParams]) -> tuple[SamplingParams, int]:
    """Absent message = semantic defaults (as the spec recommends: temperature 1, i.e. sampled,
    top_p 1, top_k off, n 1, skip_special_tokens true); explicit zero values read as SGLang reads
    them. There is no seed field: every request draws from a fresh random seed. The `constraint`
    oneof becomes the engine's Constraint; the engine compiles it and refuses (INVALID_ARGUMENT)
    a grammar it cannot compile."""
    if p is None:
        return SamplingParams(), 1
    constraint = _constraint(p)
    if p.HasField("custom_params") and p.custom_params.fields:
        raise InvalidRequest("sampling_params.custom_params is not supported")
    if p.top_p > 1.0:
        raise InvalidRequest(f"sampling_params.top_p must be in (0, 1], got {p.top_p}")
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        value = getattr(p, name)
        if not math.isfinite(value):  # NaN would otherwise read as "unset" below
            raise InvalidRequest(f"sampling_params.{name} must be a finite number, got {value}")
    if p.top_k < -1:
        raise InvalidRequest(f"sampling_params.top_k must be -1 or 0 (off) or positive, got {p.top_k}")
    if p.HasField("max_new_tokens") and p.max_new_tokens < 0:
        raise InvalidRequest(f"sampling_params.max_new_tokens must be >= 0, got {p.max_new_tokens}")
    try:
        bias = {int(k): float(v) for k, v in p.logit_bias.items()}
    except ValueError:
        raise InvalidRequest("sampling_params.logit_bias keys must be token ids (decimal strings)") from None
    interval = p.stream_interval if p.HasField("stream_interval") else 1
    sp = SamplingParams(
        temperature=0.0 if p.temperature < 1e-6 else p.temperature,   # SGLang: < 1e-6 is greedy
        top_p=p.top_p if p.top_p > 0 else 1.0,   # 0 is not a probability mass; treat as unset (off)
        top_k=p.top_k if p.top_k > 0 else 0,     # -1 and 0 = whole vocabulary
        min_p=p.min_p,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty > 0 else 1.0,
        max_new_tokens=p.max_new_tokens if p.HasField("max_new_tokens") else None,
        min_new_tokens=max(0, p.min_new_tokens),
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logit_bias=bias,
        n=max(1, p.n),
        skip_special_tokens=p.skip_special_tokens,
        spaces_between_special_tokens=p.spaces_between_special_tokens,  # to decode, as SGLang does
        include_stop_str_in_output=p.no_stop_trim,
        constraint=constraint,
    )
    return sp, max(1, interval)


def _constraint(p: pb.SamplingParams) -> Optional[Constraint]:
    """The oneof member set, as a Constraint (the engine checks and compiles the text)."""
    which = p.WhichOneof("constraint")
    if which is None:
        return None
    return Constraint(kind=CONSTRAINT_KINDS[which], spec=getattr(p, which))


def _constraint_error(err: EngineError, req: GenerateRequest) -> EngineError:
    """An engine refusal of the constraint ("constraint.<kind>: why") named by this protocol's
    field, sampling_params.<oneof member>; any other error as it is."""
    c = req.params.constraint
    field, sep, rest = err.message.partition(":")
    if c is None or not isinstance(err, InvalidRequest) or not sep or field.split(".")[0] != "constraint":
        return err
    member = next(k for k, kind in CONSTRAINT_KINDS.items() if kind == c.kind)
    return InvalidRequest(f"sampling_params.{member}:{rest}")


def _refuse_unsupported(request: pb.GenerateRequest) -> None:
    checks = (
        ("mm_inputs", _has_content(request, "mm_inputs")),
        ("input_embeds", len(request.input_embeds) > 0),
        ("custom_logit_processor", bool(request.custom_logit_processor)),
        ("return_hidden_states", request.return_hidden_states),
        ("token_ids_logprob", len(request.token_ids_logprob) > 0),
        ("disaggregated_params", _has_content(request, "disaggregated_params")),
    )
    for name, is_set in checks:
        if is_set:
            raise InvalidRequest(f"{name} is not supported by this server")


def _has_content(msg: Any, field: str) -> bool:
    return msg.HasField(field) and bool(getattr(msg, field).ListFields())


def _first_model(engine: EngineAPI, task: str) -> Optional[str]:
    return next((m.name for m in engine.models() if m.task == task), None)


# ---------------------------------------------------------------------- response building
class _ResponseStream:
    """Turns engine events into GenerateResponse messages (stream and non-stream shapes)."""

    def __init__(self, request: pb.GenerateRequest, req: GenerateRequest, interval: int, info: ModelInfo):
        self.rid = req.request_id
        self.prompt = req.prompt_ids or []
        self.stream = request.stream
        self.interval = interval
        self.top_n = request.top_logprobs_num if request.return_logprob else 0
        self.want_logprobs = request.return_logprob
        self.prompt_start = req.params.prompt_logprobs_start
        # ids that end generation "on a token" when the engine does not say which matched
        self.stop_ids = set(req.params.stop_token_ids) | (set() if req.params.ignore_eos else set(info.eos_token_ids))
        self.ids: dict[int, list[int]] = {}           # all output ids per index
        self.lps: dict[int, list[TokenLogprob]] = {}  # all output logprobs per index
        self.pending: dict[int, int] = {}             # ids not yet sent in a chunk (stream mode)
        self.last_delta: dict[int, tuple[int, int]] = {}  # (start, end) of the last chunk sent
        self.input_lp: dict[int, pb.InputLogProbs] = {}
        self.input_sent: set[int] = set()
        self.finals: dict[int, GenerateOutput] = {}

    def on_output(self, out: GenerateOutput) -> list[pb.GenerateResponse]:
        i = out.index
        ids = self.ids.setdefault(i, [])
        ids.extend(out.new_token_ids)
        if out.logprobs:
            self.lps.setdefault(i, []).extend(out.logprobs)
        if out.prompt_logprobs is not None and i not in self.input_lp:
            self.input_lp[i] = self._input_logprobs(out.prompt_logprobs)
        if out.finished:
            self.finals[i] = out
        if not self.stream:
            return []
        msgs = []
        self.pending[i] = self.pending.get(i, 0) + len(out.new_token_ids)
        if self.pending[i] and (self.pending[i] >= self.interval or out.finished):
            msgs.append(self._chunk(i, out))
        if out.finished:
            msgs.append(self._complete(i, out))
        return msgs

    def at_end(self) -> list[pb.GenerateResponse]:
        """Non-stream: one complete per index, in index order, after all have finished."""
        if self.stream:
            return []
        return [self._complete(i, self.finals[i]) for i in sorted(self.finals)]

    def _chunk(self, i: int, out: GenerateOutput) -> pb.GenerateResponse:
        end = len(self.ids[i])
        start = end - self.pending[i]
        self.pending[i] = 0
        self.last_delta[i] = (start, end)
        chunk = pb.GenerateStreamChunk(
            token_ids=self.ids[i][start:end], prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens, index=i)
        if self.want_logprobs:
            chunk.output_logprobs.CopyFrom(self._output_logprobs(i, start, end))
        if i in self.input_lp and i not in self.input_sent:
            chunk.input_logprobs.CopyFrom(self.input_lp[i])
            self.input_sent.add(i)
        return pb.GenerateResponse(request_id=self.rid, chunk=chunk)

    def _complete(self, i: int, out: GenerateOutput) -> pb.GenerateResponse:
        ids = self.ids.get(i, [])
        # stream: the final chunk's delta (as upstream); non-stream: every output id
        start, end = self.last_delta.get(i, (len(ids), len(ids))) if self.stream else (0, len(ids))
        reason = _finish_reason(out.finish_reason)
        done = pb.GenerateComplete(
            output_ids=ids[start:end], finish_reason=reason, prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens, index=i)
        if reason == "stop":
            matched = out.matched_stop
            if matched is None and ids and ids[-1] in self.stop_ids:
                matched = ids[-1]
            if isinstance(matched, str):
                done.matched_stop_str = matched
            elif matched is not None:
                done.matched_token_id = int(matched)
        if self.want_logprobs:
            done.output_logprobs.CopyFrom(self._output_logprobs(i, start, end))
        if i in self.input_lp and i not in self.input_sent:
            done.input_logprobs.CopyFrom(self.input_lp[i])
            self.input_sent.add(i)
        return pb.GenerateResponse(request_id=self.rid, complete=done)

    def _output_logprobs(self, i: int, start: int, end: int) -> pb.OutputLogProbs:
        lps = self.lps.get(i, [])[start:end]
        msg = pb.OutputLogProbs(token_logprobs=[lp.logprob for lp in lps], token_ids=[lp.token_id for lp in lps])
        if self.top_n > 0:
            msg.top_logprobs.extend(_top(lp.top) for lp in lps)
        return msg

    def _input_logprobs(self, entries: list[Optional[TokenLogprob]]) -> pb.InputLogProbs:
        start = self.prompt_start or 0
        msg = pb.InputLogProbs()
        for j, lp in enumerate(entries):
            pos = start + j
            if lp is None:
                msg.token_logprobs.add()  # first prompt token: no value
                msg.token_ids.append(self.prompt[pos] if pos < len(self.prompt) else 0)
                if self.top_n > 0:
                    msg.top_logprobs.add()
            else:
                msg.token_logprobs.add(value=lp.logprob)
                msg.token_ids.append(lp.token_id)
                if self.top_n > 0:
                    msg.top_logprobs.append(_top(lp.top))
        return msg


def _top(top: list[tuple[int, float]]) -> pb.TopLogProbs:
    return pb.TopLogProbs(values=[v for _, v in top], token_ids=[t for t, _ in top])


def _finish_reason(reason: Optional[str]) -> str:
    return reason if reason in ("length", "abort") else "stop"


def _lora_metrics(stats: Any) -> Optional[pb.LoRAMetrics]:
    """The `lora` section: adapter slots used / total; unset (not available) without LoRA."""
    total = stats.lora_slots_total
    if not total:
        return None
    used = stats.lora_slots_used
    return pb.LoRAMetrics(slots_used=used, slots_total=total, utilization=used / total)


def _scheduler_load(rank: int, s: Any, info: ModelInfo, sections: set[str],
                    lora: Optional[pb.LoRAMetrics] = None) -> pb.SchedulerLoad:
    used = s.pages_used * s.page_size
    total = s.pages_total * s.page_size
    hits, misses = s.prefix_cache_hit_tokens, s.prefix_cache_miss_tokens
    load = pb.SchedulerLoad(
        dp_rank=rank,
        num_running_reqs=s.running_requests,
        num_waiting_reqs=s.waiting_requests,
        num_total_reqs=s.running_requests + s.waiting_requests,
        num_used_tokens=used,
        max_total_num_tokens=total,
        token_usage=used / total if total else 0.0,
        gen_throughput=s.decode_tokens_per_s,
        cache_hit_rate=hits / (hits + misses) if hits + misses else 0.0,
        utilization=s.running_requests / s.max_running_requests if s.max_running_requests else 0.0,
        max_running_requests=s.max_running_requests,
    )
    if "memory" in sections:
        weight_bytes = info.num_params * _BYTES_PER_PARAM.get(info.dtype, 4) / max(1, info.tp)
        load.memory.CopyFrom(pb.MemoryMetrics(weight_gb=weight_bytes / 2**30, token_capacity=total))
    if "disagg" in sections:
        load.disaggregation.CopyFrom(pb.DisaggregationMetrics(mode="null"))
    if "queues" in sections:
        load.queues.CopyFrom(pb.QueueMetrics(waiting=s.waiting_requests, grammar=s.grammar_queue))
    if lora is not None:
        load.lora.CopyFrom(lora)
    if "spec" in sections and s.spec is not None:      # served with --speculative: SGLang's accept length and rate
        load.speculative.CopyFrom(pb.SpeculativeMetrics(accept_length=s.spec.accept_length,
                                                        accept_rate=s.spec.accept_rate))
    return load


def _jsonable(value: Any) -> Any:
    """Struct-safe copy: non-JSON values (paths, enums, ...) become strings."""
    return json.loads(json.dumps(value, default=str))
