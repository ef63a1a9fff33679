"""A small, deterministic `EngineAPI` for front tests that do not need the warmed JAX engine.

It serves a generator "fake-gen" and an embedding model "fake-embed" with the real boundary
types (`jax_engine.types`, `jax_engine.errors`). Token ids are a pure function of the prompt:
the k-th new token of sequence i is `(last prompt id + 1 + i + k) % vocab`; text is byte-level
(id - 3 is the byte), so the front's own text handling runs too.

LoRA: an in-memory adapter table (`enable_lora` / `loras` as EngineArgs take them). A run-time
`load_adapter` checks what the engine checks (LoRA enabled, the path under --model-root, a PEFT
folder with `adapter_config.json`, rank <= max_lora_rank, a free slot, a new name); a generate
request naming an adapter that is not loaded on its model raises NotFound. Every generate
request is kept in `generate_requests`, every adapter call in `adapter_calls`.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from typing import Any, AsyncGenerator, Optional

import numpy as np

from jax_engine.api import EngineArgs, ModelSpec
from jax_engine.errors import AlreadyExists, InvalidRequest, NotFound, Overloaded, PermissionDenied, Unavailable
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

    def __init__(self, model_root: Optional[str] = None, *, enable_lora: bool = False,
                 loras: Optional[list[tuple[str, str]]] = None, max_loras: int = 8, max_lora_rank: int = 64,
                 speculative: str = "off", num_speculative_tokens: int = 4) -> None:
        self.args = EngineArgs(models=[ModelSpec(name=FAKE_GEN, path=f"/fake/{FAKE_GEN}"),
                                       ModelSpec(name=FAKE_EMBED, path=f"/fake/{FAKE_EMBED}")],
                               model_root=model_root, enable_lora=enable_lora, loras=list(loras or []),
                               max_loras=max_loras, max_lora_rank=max_lora_rank, speculative=speculative,
                               num_speculative_tokens=num_speculative_tokens)
        self.counters = FakeCounters()
        self.start_time = time.time()
        self.compile_cache_dir = "/fake/compile-cache"
        self._models = {FAKE_GEN: _info(FAKE_GEN, "generate"), FAKE_EMBED: _info(FAKE_EMBED, "embed")}
        self._tokenizer = FakeTokenizer()
        self._draining = False
        self._loaded = True
        self.aborted: list[str] = []
        self.calls: list[str] = []
        self.generate_requests: list[GenerateRequest] = []   # every generate request, as received
        self.adapter_calls: list[tuple[Any, ...]] = []       # ("load_adapter", name, path, model), ...
        self._adapters: dict[str, AdapterInfo] = {}
        for name, path in self.args.loras:                   # --lora NAME=PATH: onto the default generator
            self._adapters[name] = AdapterInfo(name=name, model=FAKE_GEN, path=path, rank=8, alpha=16.0,
                                               target_modules=["q_proj", "v_proj"])

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
        lora = self._lora_enabled() and info.task == "generate"
        return ModelStats(name=info.name, pages_total=64, pages_used=0, pages_free=64, page_size=16,
                          max_running_requests=self.args.max_running_requests,
                          lora_slots_used=self._slots_used(info.name) if lora else 0,
                          lora_slots_total=self.args.max_loras if lora else 0, spec=self._spec(info))

    def _spec(self, info: ModelInfo) -> Optional[SpecStats]:
        """Fixed speculation counters for the generation model when served with --speculative:
        40 verifications of 100 guesses, 60 accepted (rate 0.6, accept length 2.5)."""
        if self.args.speculative == "off" or info.task != "generate":
            return None
        k = self.args.num_speculative_tokens
        hist = [10, 10, 10, 10] + [0] * (k - 3)
        return SpecStats(method=self.args.speculative, num_speculative_tokens=k, proposed_tokens=100,
                         accepted_tokens=60, verify_rows=40, accepted_histogram=hist)

    # ------------------------------------------------------------ LoRA adapters
    def _lora_enabled(self) -> bool:
        return self.args.enable_lora or bool(self.args.loras)

    def _slots_used(self, model: str) -> int:
        return sum(1 for a in self._adapters.values() if a.model == model)

    def adapters(self, model: Optional[str] = None) -> list[AdapterInfo]:
        self.calls.append("adapters")
        return [a for a in self._adapters.values() if model is None or a.model == model]

    async def load_adapter(self, name: str, path: str, model: Optional[str] = None) -> AdapterInfo:
        self.calls.append("load_adapter")
        self.adapter_calls.append(("load_adapter", name, path, model))
        if not self._lora_enabled():
            raise InvalidRequest("LoRA is not enabled: start the server with --enable-lora")
        info = self._known(model or self.default_model("generate") or "")  # built, running or stopped
        if info.task != "generate":
            raise InvalidRequest(f"model {info.name!r} is not a generation model: LoRA adapters need one")
        if self.args.model_root is None:
            raise PermissionDenied("loading LoRA adapters over the network needs --model-root")
        real, root = os.path.realpath(path), os.path.realpath(self.args.model_root)
        if os.path.commonpath([real, root]) != root:
            raise PermissionDenied(f"adapter path {path!r} is outside --model-root")
        if name in self._adapters or name in self._models:
            raise AlreadyExists(f"LoRA adapter {name!r} is already loaded")
        config = os.path.join(real, "adapter_config.json")
        if not os.path.isfile(config):
            raise InvalidRequest(f"{path!r} is not a PEFT adapter folder (no adapter_config.json)")
        with open(config) as f:
            cfg = json.load(f)
        rank = int(cfg.get("r", 8))
        if rank > self.args.max_lora_rank:
            raise InvalidRequest(f"adapter {name!r} has rank {rank}, above --max-lora-rank {self.args.max_lora_rank}")
        if self._slots_used(info.name) >= self.args.max_loras:
            raise Overloaded(f"every LoRA slot of model {info.name!r} is in use (--max-loras {self.args.max_loras})")
        adapter = AdapterInfo(name=name, model=info.name, path=path, rank=rank, alpha=float(cfg.get("lora_alpha", rank)),
                              target_modules=list(cfg.get("target_modules") or []))
        self._adapters[name] = adapter
        return adapter

    async def unload_adapter(self, name: str) -> None:
        self.calls.append("unload_adapter")
        self.adapter_calls.append(("unload_adapter", name))
        if name not in self._adapters:
            raise NotFound(f"LoRA adapter {name!r} is not loaded")
        del self._adapters[name]

    # ------------------------------------------------------------ requests
    async def generate(self, req: GenerateRequest) -> AsyncGenerator[GenerateOutput, None]:
        self.calls.append("generate")
        self.generate_requests.append(req)
        if self._draining:
            raise Unavailable("server is draining; not accepting new requests")
        info = self.model_info(req.model, "generate")
        if req.adapter:
            adapter = self._adapters.get(req.adapter)
            if adapter is None or adapter.model != info.name or adapter.state != "loaded":
                raise NotFound(f"LoRA adapter {req.adapter!r} is not loaded on model {info.name!r}")
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
