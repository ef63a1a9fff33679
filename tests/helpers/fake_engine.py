"""A small, deterministic `EngineAPI` for front tests that do not need the warmed JAX engine.

It serves a generator "fake-gen" and an embedding model "fake-embed" with the real boundary
types (`jax_engine.types`, `jax_engine.errors`). Token ids are a pure function of the prompt:
the k-th new token of sequence i is `(last prompt id + 1 + i + k) % vocab`; text is byte-level
(id - 3 is the byte), so the front's own text handling runs too.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncGenerator, Optional

import numpy as np

from jax_engine.api import EngineArgs, ModelSpec
from jax_engine.errors import AlreadyExists, InvalidRequest, NotFound, Unavailable
from jax_engine.types import EmbedOutput, EmbedRequest, GenerateOutput, GenerateRequest, ModelInfo, ModelStats

FAKE_GEN = "fake-gen"
FAKE_EMBED = "fake-embed"
VOCAB = 512
EMBED_DIM = 8
DEFAULT_NEW_TOKENS = 4
_OFFSET = 3  # ids 0..2 are <pad>, <bos>, <eos>; id b + 3 is byte b
EOS = 2


class FakeTokenizer:
    """Byte-level: id = byte + 3. Chat messages render as "<role>: content\\n" lines."""

    chat_template: Optional[str] = "{fake}"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + _OFFSET for b in text.encode("utf-8")]
        return [1, *ids] if add_special_tokens else ids

    def decode(self, token_ids: list[int]) -> str:
        return bytes((t - _OFFSET) % 256 for t in token_ids if t >= _OFFSET).decode("utf-8", "replace")

    def apply_chat_template(self, conversation: list[dict[str, Any]], tokenize: bool = True,
                            add_generation_prompt: bool = False) -> Any:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in conversation)
        if add_generation_prompt:
            text += "assistant: "
        return self.encode(text, add_special_tokens=False) if tokenize else text


class FakeCounters:
    def __init__(self) -> None:
        self.counts = {"accepted": 0, "completed": 0, "errored": 0, "cancelled": 0}

    def add(self, outcome: str) -> None:
        self.counts[outcome] += 1

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)


def _info(name: str, task: str) -> ModelInfo:
    return ModelInfo(name=name, path=f"/fake/{name}", tokenizer_path=f"/fake/{name}", task=task,
                     architecture="FakeForCausalLM" if task == "generate" else "FakeModel",
                     model_type="fake", dtype="float32", vocab_size=VOCAB, max_model_len=128, num_params=1000,
                     eos_token_ids=[EOS], bos_token_id=1, pad_token_id=0, hidden_size=EMBED_DIM,
                     embedding_dim=EMBED_DIM if task == "embed" else 0, page_size=16,
                     ready=True, state="running")


class FakeEngine:
    """Implements `jax_engine.api.EngineAPI`; every call is recorded in `calls`."""

    def __init__(self, model_root: Optional[str] = None) -> None:
        self.args = EngineArgs(models=[ModelSpec(name=FAKE_GEN, path=f"/fake/{FAKE_GEN}"),
                                       ModelSpec(name=FAKE_EMBED, path=f"/fake/{FAKE_EMBED}")],
                               model_root=model_root)
        self.counters = FakeCounters()
        self.start_time = time.time()
        self.compile_cache_dir = "/fake/compile-cache"
        self._models = {FAKE_GEN: _info(FAKE_GEN, "generate"), FAKE_EMBED: _info(FAKE_EMBED, "embed")}
        self._tokenizer = FakeTokenizer()
        self._draining = False
        self._loaded = True
        self.aborted: list[str] = []
        self.calls: list[str] = []

    # ------------------------------------------------------------ state
    @property
    def draining(self) -> bool:
        return self._draining

    def ready(self) -> bool:
        return self._loaded and not self._draining

    def healthy(self) -> bool:
        return True

    def models(self) -> list[ModelInfo]:
        return list(self._models.values())

    def model_info(self, name: Optional[str] = None, task: Optional[str] = None) -> ModelInfo:
        name = name or (self.default_model(task) if task else next(iter(self._models), None))
        info = self._models.get(name or "")
        if info is None:
            raise NotFound(f"model {name!r} is not served (served: {sorted(self._models)})")
        if task == "generate" and info.task != "generate":
            raise InvalidRequest(f"model {name!r} is an {info.task} model, not a generation model")
        if info.state != "running":
            raise Unavailable(f"model {name!r} is not running (state {info.state})")
        return info

    def default_model(self, task: str) -> Optional[str]:
        wanted = ("embed", "classify") if task == "embed" else (task,)
        return next((m.name for m in self._models.values() if m.task in wanted), None)

    def tokenizer(self, name: Optional[str] = None, task: Optional[str] = None) -> FakeTokenizer:
        self.model_info(name, task)
        return self._tokenizer

    def stats(self, name: Optional[str] = None) -> ModelStats:
        info = self.model_info(name)
        return ModelStats(name=info.name, pages_total=64, pages_used=0, pages_free=64, page_size=16,
                          max_running_requests=self.args.max_running_requests)

    # ------------------------------------------------------------ requests
    async def generate(self, req: GenerateRequest) -> AsyncGenerator[GenerateOutput, None]:
        self.calls.append("generate")
        if self._draining:
            raise Unavailable("server is draining; not accepting new requests")
        info = self.model_info(req.model, "generate")
        if not req.request_id:
            req.request_id = uuid.uuid4().hex
        ids = list(req.prompt_ids) if req.prompt_ids is not None else self._tokenizer.encode(req.prompt or "")
        if not ids:
            raise InvalidRequest("prompt is empty")
        bad = [t for t in ids if not 0 <= t < info.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt_ids has id {bad[0]} outside the vocabulary [0, {info.vocab_size})")
        p = req.params
        steps = p.max_new_tokens if p.max_new_tokens is not None else DEFAULT_NEW_TOKENS
        self.counters.add("accepted")
        finished = 0
        try:
            for i in range(p.n):
                for k in range(steps):
                    await asyncio.sleep(0)
                    tid = (ids[-1] + 1 + i + k) % info.vocab_size
                    last = k == steps - 1 or tid in p.stop_token_ids
                    reason = ("stop" if tid in p.stop_token_ids else "length") if last else None
                    yield GenerateOutput(request_id=req.request_id, index=i, new_token_ids=[tid],
                                         new_text=self._tokenizer.decode([tid]), finished=last, finish_reason=reason,
                                         matched_stop=tid if reason == "stop" else None,
                                         prompt_tokens=len(ids), completion_tokens=k + 1)
                    if last:
                        finished += 1
                        break
            self.counters.add("completed")
        finally:
            if finished < p.n:
                self.aborted.append(req.request_id)
                self.counters.add("cancelled")

    async def embed(self, req: EmbedRequest) -> EmbedOutput:
        self.calls.append("embed")
        if self._draining:
            raise Unavailable("server is draining; not accepting new requests")
        info = self.model_info(req.model or self.default_model("embed"), None)
        if info.task != "embed":
            raise InvalidRequest(f"model {info.name!r} cannot embed")
        seqs = req.token_ids if req.token_ids is not None else [self._tokenizer.encode(t) for t in req.texts or []]
        rows = []
        for ids in seqs:
            v = np.zeros(EMBED_DIM, dtype=np.float32)
            for j, t in enumerate(ids):
                v[(t + j) % EMBED_DIM] += 1.0
            rows.append(v / max(float(np.linalg.norm(v)), 1e-6))
        self.counters.add("accepted")
        self.counters.add("completed")
        return EmbedOutput(request_id=req.request_id or uuid.uuid4().hex, embeddings=np.stack(rows),
                           prompt_tokens=sum(len(s) for s in seqs), token_counts=[len(s) for s in seqs])

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return False

    # ------------------------------------------------------------ life cycle
    def load_all(self, progress: bool = True, warmup: bool = True) -> None:
        self._loaded = True

    async def load_model(self, spec: ModelSpec) -> ModelInfo:
        if spec.name in self._models:
            raise AlreadyExists(f"model {spec.name!r} is already loaded")
        info = _info(spec.name, spec.task or "generate")
        info.state, info.ready = "built", False
        self._models[spec.name] = info
        return info

    async def start_model(self, name: str) -> None:
        info = self._known(name)
        info.state, info.ready = "running", True

    async def stop_model(self, name: str) -> None:
        info = self._known(name)
        info.state, info.ready = "stopped", False

    async def release_model(self, name: str) -> None:
        self._known(name)
        del self._models[name]

    def begin_drain(self) -> None:
        self._draining = True

    def fail_in_flight(self, message: str) -> int:
        return 0

    def shutdown(self, timeout: float = 5.0) -> None:
        self._loaded = False

    def _known(self, name: str) -> ModelInfo:
        info = self._models.get(name)
        if info is None:
            raise NotFound(f"model {name!r} is not served")
        return info
