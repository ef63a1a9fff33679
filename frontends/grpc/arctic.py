"""`arctic_inference.InferenceService`: embeddings as the Arctic replica serves them.

Contract: protos/ (arctic_inference) and tests/frontends/test_grpc_arctic.py. Every validation or engine failure of Encode is
reported in `EncodeResponse.error` with gRPC status OK, because that field is the only error
channel the shipped client reads.
"""
from __future__ import annotations

import uuid
from typing import Any, Optional

import numpy as np

from frontends.common.errors import error_message
from frontends.grpc.gen.arctic_inference import inference_pb2 as pb
from frontends.grpc.gen.arctic_inference import inference_pb2_grpc as pb_grpc
from jax_engine.api import EngineAPI
from jax_engine.errors import EngineError, InvalidRequest
from jax_engine.types import EmbedRequest, ModelInfo

SERVICE = "arctic_inference.InferenceService"


class ArcticServicer(pb_grpc.InferenceServiceServicer):
    """Serves the engine's embedding models ("embed" task) over the Arctic protocol."""

    def __init__(self, engine: EngineAPI):
        self.engine = engine

    # ------------------------------------------------------------------ Encode
    async def Encode(self, request: pb.EncodeRequest, context: Any) -> pb.EncodeResponse:
        rid = request.request_id or uuid.uuid4().hex
        try:
            info = self._embed_model(request.model_name)
            inputs = self._inputs(request, info)
        except EngineError as e:
            return pb.EncodeResponse(request_id=rid, error=e.message)
        texts, token_ids = inputs
        n = len(texts if texts is not None else token_ids)
        if n == 0:
            # n_prompts=0 and nothing given: an empty success (upstream crashed with UNKNOWN).
            return pb.EncodeResponse(request_id=rid, n_prompts=0, embedding_dim=info.embedding_dim)
        req = EmbedRequest(request_id=rid, texts=texts, token_ids=token_ids, model=info.name,
                           priority=request.priority, truncate=True)
        try:
            out = await self.engine.embed(req)
        except Exception as e:  # engine errors and anything unexpected stay in-band
            return pb.EncodeResponse(request_id=rid, error=error_message(e))
        emb = out.embeddings
        if emb is None or len(emb) != n:
            return pb.EncodeResponse(request_id=rid, error="No encoding result")
        emb = np.asarray(emb, dtype="<f4")
        return pb.EncodeResponse(
            request_id=rid,
            n_prompts=request.n_prompts,
            embedding_dim=int(emb.shape[1]),
            embedding_bytes_fp32=[row.tobytes() for row in emb],
        )

    def _embed_model(self, name: str) -> ModelInfo:
        """The served embedding model `name` names; empty = the default embedding model."""
        served = [m for m in self.engine.models() if m.task == "embed"]
        if not served:
            raise InvalidRequest("Model not ready")
        if not name:
            default = self.engine.default_model("embed")
            match = [m for m in served if m.name == default] or served
            return match[0]
        for m in served:
            if m.name == name:
                return m
        raise InvalidRequest(f"Expected model name {' or '.join(m.name for m in served)}, got {name}")

    def _inputs(self, request: pb.EncodeRequest,
                info: ModelInfo) -> tuple[Optional[list[str]], Optional[list[list[int]]]]:
        """(None, token ids) when token_id_bytes_i32 is given (it wins), else (prompts, None)."""
        n = request.n_prompts
        if len(request.token_id_bytes_i32):
            if len(request.token_id_bytes_i32) != n:
                raise InvalidRequest(f"Expected {n} prompts, got {len(request.token_id_bytes_i32)}")
            return None, [_decode_ids(i, b, info.vocab_size) for i, b in enumerate(request.token_id_bytes_i32)]
        if len(request.prompts) != n:
            raise InvalidRequest(f"Expected {n} prompts, got {len(request.prompts)}")
        return list(request.prompts), None

    # ------------------------------------------------------------------ the rest
    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortResponse:
        try:
            # One engine request carries all prompts of an Encode, so this aborts them all.
            self.engine.abort(request.request_id)
        except Exception as e:
            return pb.AbortResponse(success=False, message=f"Error aborting request: {error_message(e)}")
        return pb.AbortResponse(success=True, message=f"Request {request.request_id} aborted successfully")

    async def GetReplicaInfo(self, request: pb.ReplicaInfoRequest, context: Any) -> pb.ReplicaInfoResponse:
        """One entry per replica the engine really runs of each embedding model."""
        args = self.engine.args
        lora_config = _lora_config(self.engine)
        infos = []
        for m in self.engine.models():
            if m.task != "embed":
                continue
            for r in range(max(1, m.replicas)):
                infos.append(pb.SingleReplicaInfoResponse(
                    model_name=m.name,
                    task=m.task,
                    dtype=m.dtype,
                    ready=bool(m.ready),
                    parallel_config=f"tensor_parallel_size={m.tp} replica={r} of {max(1, m.replicas)}",
                    decoding_config="None",
                    scheduler_config=(f"max_num_inputs={args.max_embed_inputs} "
                                      f"max_batch_tokens={args.embed_max_batch_tokens} "
                                      f"max_model_len={m.max_model_len}"),
                    lora_config=lora_config,
                ))
        healthy = sum(1 for i in infos if i.ready) if self.engine.healthy() else 0
        message = "" if infos else "no embedding model is served"
        return pb.ReplicaInfoResponse(replica_infos=infos, n_replicas=len(infos),
                                      n_healthy_replicas=healthy, message=message)

    async def HealthCheck(self, request: pb.HealthCheckRequest, context: Any) -> pb.HealthCheckResponse:
        if self.engine.ready():
            return pb.HealthCheckResponse(healthy=True, message="")
        return pb.HealthCheckResponse(healthy=False, message=f"Service is unhealthy: {_why_not_ready(self.engine)}")


def _lora_config(engine: EngineAPI) -> str:
    """Like str() of vLLM's LoRAConfig: "None" without LoRA, else the server's slots, maximum rank
    and loaded adapters (LoRA serves generation models; Encode carries no adapter field)."""
    args = engine.args
    if not (args.enable_lora or args.loras):
        return "None"
    names = ", ".join(a.name for a in engine.adapters())
    return f"LoRAConfig(max_loras={args.max_loras}, max_lora_rank={args.max_lora_rank}, adapters=[{names}])"


def _decode_ids(i: int, data: bytes, vocab_size: int) -> list[int]:
    """int32 little-endian ids of prompt i, checked against the vocabulary."""
    if len(data) % 4:
        raise InvalidRequest(
            f"token_id_bytes_i32[{i}] has {len(data)} bytes, not a multiple of 4 (int32 little-endian)")
    ids = np.frombuffer(data, dtype="<i4")
    if ids.size == 0:
        raise InvalidRequest(f"token_id_bytes_i32[{i}] is empty")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise InvalidRequest(f"token_id_bytes_i32[{i}] has id {int(bad[0])} outside the vocabulary [0, {vocab_size})")
    return ids.astype(np.int64).tolist()


def _why_not_ready(engine: EngineAPI) -> str:
    if engine.draining:
        return "server is draining"
    if not engine.healthy():
        return "an engine worker is not alive"
    return "models are not loaded yet"
