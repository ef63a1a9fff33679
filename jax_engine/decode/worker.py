"""A served decoder: validation, tokenization, and dispatch over data-parallel replicas.

Each replica is a (ModelRunner, PagePool, Scheduler) on its own group of `tp` devices (a row of
the ('data', 'model') mesh). New requests go to the least-loaded replica.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from jax_engine import attention
from jax_engine.checkpoint.hf import load_tokenizer, read_config
from jax_engine.config import EngineArgs, ModelSpec, ResolvedSpec, resolve
from jax_engine.constrain.compiler import CompiledGrammar, GrammarCompiler
from jax_engine.decode.detokenizer import IncrementalDetokenizer
from jax_engine.decode.latency_guard import LatencyGuard
from jax_engine.decode.page_pool import PagePool
from jax_engine.decode.runner import NUM_BAN, NUM_BIAS, ModelRunner, RunnerConfig
from jax_engine.decode.scheduler import Scheduler
from jax_engine.decode.sequence import Request, Sequence
from jax_engine.decode.speculate import Drafter
from jax_engine.errors import AlreadyExists, Internal, InvalidRequest, NotFound, Overloaded
from jax_engine.executor import backend
from jax_engine.executor.multihost import StepChannel
from jax_engine.kernels import choose as cpu_matmul
from jax_engine.lora.adapter import load_adapter
from jax_engine.lora.table import AdapterTable
from jax_engine.models.decoder import count_params, pack_for_kernel
from jax_engine.models.llama import LlamaConfig
from jax_engine.models.llama_weights import load_model
from jax_engine.spec import METHODS
from jax_engine.types import (
    AdapterInfo,
    Constraint,
    EmbedOutput,
    EmbedRequest,
    GenerateOutput,
    GenerateRequest,
    MatmulRoute,
    ModelInfo,
    ModelStats,
    SamplingParams,
    SpecStats,
)

log = logging.getLogger("xlaserve.generate")


def make_meshes(tp: int, replicas: int, ep: int = 1) -> list[Optional[Mesh]]:
    """One ('data', 'model') mesh row per replica; None = single device, no sharding. With expert
    parallelism (ep > 1, mixture-of-experts models) each replica's mesh is ('data', 'expert', 'model')
    of 1 x ep x tp devices: experts sharded over 'expert', attention and each expert's intermediate
    dim over 'model' (jax_engine/checkpoint/layout.py), attention replicated over 'expert'."""
    devs = jax.devices()
    per = tp * ep
    if jax.process_count() > 1 and (replicas != 1 or per != len(devs)):
        raise InvalidRequest(f"with {jax.process_count()} processes a decoder runs as one TP mesh over all "
                             f"{len(devs)} devices: use --tp x --ep = {len(devs)} and --replicas 1 (got tp {tp}, ep {ep}, "
                             f"replicas {replicas}); for more replicas run more servers behind a router")
    if per * replicas > len(devs):
        raise InvalidRequest(f"tp {tp} x ep {ep} x replicas {replicas} needs {per * replicas} devices, have {len(devs)}")
    if per == 1 and replicas == 1:
        return [None]
    if ep > 1:
        grid = np.array(devs[: per * replicas]).reshape(replicas, ep, tp)
        return [Mesh(grid[r:r + 1], ("data", "expert", "model")) for r in range(replicas)]
    grid = np.array(devs[: tp * replicas]).reshape(replicas, tp)
    return [Mesh(grid[r:r + 1], ("data", "model")) for r in range(replicas)]


class GenerateWorker:
    """One served decoder. `spec` is resolved against `args` here unless it already is;
    `channel` (multi-host only) makes process 0 publish each runner call to the followers."""

    def __init__(self, spec: Union[ModelSpec, ResolvedSpec], args: EngineArgs,
                 channel: Optional[StepChannel] = None):
        spec = spec if isinstance(spec, ResolvedSpec) else resolve(spec, args)
        self.spec, self.args = spec, args
        self._embed_groups: dict[str, list[str]] = {}
        hf = read_config(spec.path)
        cfg = LlamaConfig.from_hf(hf)
        tp, replicas = spec.tp, spec.replicas
        ep = spec.ep
        if ep > 1 and not cfg.num_experts:
            raise InvalidRequest(f"--ep {ep}: expert parallelism needs a mixture-of-experts model; {cfg.architecture} "
                                 "has no experts (use --ep 1, and --tp to shard it)")
        if cfg.num_experts and cfg.num_experts % ep:
            raise InvalidRequest(f"--ep {ep} does not divide the {cfg.num_experts} experts of {cfg.architecture}")
        if cfg.num_experts and cfg.intermediate_size % tp:
            raise InvalidRequest(f"tp {tp} does not divide the experts' intermediate size {cfg.intermediate_size}")
        if cfg.num_heads % tp:
            raise InvalidRequest(f"tp {tp} does not divide {cfg.num_heads} attention heads")
        kv_repeat = 1
        if tp > cfg.num_kv_heads:
            if tp % cfg.num_kv_heads or (cfg.num_heads // tp) < 1:
                raise InvalidRequest(f"tp {tp} is incompatible with {cfg.num_kv_heads} KV heads")
            kv_repeat = tp // cfg.num_kv_heads
        elif cfg.num_kv_heads % tp:
            raise InvalidRequest(f"tp {tp} does not divide {cfg.num_kv_heads} KV heads")
        self.cfg = dataclasses.replace(cfg, kv_repeat=kv_repeat)
        self.dtype = backend.resolve_dtype(spec.dtype)
        self.quantize = quant = spec.quantize
        if quant == "w8a8":            # int8 weights as --quantize int8, int8 activations on top
            if cfg.num_experts:
                raise InvalidRequest("--quantize w8a8 is not supported for mixture-of-experts models (their "
                                     "experts run weight-only int8): use --quantize int8")
            self.cfg = dataclasses.replace(self.cfg, act_int8=True)
        self.max_model_len = min(spec.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.page_size = spec.page_size
        self.cfg = dataclasses.replace(self.cfg, attention_backend=attention.resolve(
            args.attention_backend, self.cfg, self.page_size, self.dtype, tp, ep=ep))   # jax_engine/attention
        self.cfg = cpu_matmul.configure(                                        # jax_engine/kernels/choose.py
            args.cpu_matmul, self.cfg, backend.platform(), self.dtype, quant, tp,
            decode_rows=spec.max_running_requests, prefill_tokens=spec.max_num_batched_tokens)
        max_running, max_tokens = spec.max_running_requests, spec.max_num_batched_tokens
        self.tokenizer = load_tokenizer(spec.path)
        tok_eos = self.tokenizer.eos_token_id
        self.eos_ids = set(cfg.eos_token_ids) | ({tok_eos} if tok_eos is not None else set())
        self.grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size, self.eos_ids, args.grammar_cache_size,
                                        args.max_grammar_bytes, max_queued=args.max_waiting_requests)
        self.meshes = make_meshes(tp, replicas, ep)
        lora_on = args.enable_lora or bool(args.loras)
        if lora_on:
            if channel is not None:
                raise InvalidRequest("LoRA (--enable-lora / --lora) is not supported on a multi-host slice")
            if args.max_loras < 1 or args.max_lora_rank < 1:
                raise InvalidRequest(f"--max-loras and --max-lora-rank must be >= 1 with LoRA enabled "
                                     f"(got {args.max_loras}, {args.max_lora_rank})")
        self.lora_table: Optional[AdapterTable] = AdapterTable(args.max_loras) if lora_on else None
        spec_k = _spec_tokens(args)
        # the latency guard needs room above the budget (a burst budget) to let prompts through
        guard_on = args.itl_p99_ratio > 0 and spec.burst_batched_tokens > 0
        self.replicas: list[Scheduler] = []
        self.local_runners: dict[str, ModelRunner] = {}   # by "<model>/<replica>", never wrapped
        for r, mesh in enumerate(self.meshes):
            bar = tqdm(total=self.cfg.num_layers, desc=f"loading {spec.name} (replica {r})", unit="layer",
                       disable=not os.environ.get("XLASERVE_PROGRESS", "1") == "1")
            weights = "int8" if quant == "w8a8" else quant        # the same int8 weights (or checkpoint)
            model = pack_for_kernel(load_model(spec.path, self.cfg, self.dtype, weights, mesh, bar.update))
            bar.close()
            rc = RunnerConfig(page_size=self.page_size, num_pages=0, max_running=max_running,
                              max_batched_tokens=max_tokens, max_model_len=self.max_model_len,
                              max_n=args.max_n, top_n=max(1, args.max_top_logprobs),
                              page_bucket_ratio=max(2, args.page_bucket_ratio),
                              lora_slots=args.max_loras if lora_on else 0, lora_rank=args.max_lora_rank,
                              spec_tokens=spec_k, burst_tokens=spec.burst_batched_tokens,
                              burst_fine=guard_on, huge_pages=args.huge_pages)
            rc.num_pages = spec.num_pages or self._auto_pages(rc)
            runner = ModelRunner(self.cfg, model, rc, mesh, self.dtype)
            self.local_runners[f"{spec.name}/{r}"] = runner
            if channel is not None and jax.process_index() == 0:
                runner.mirror = (channel, f"{spec.name}/{r}")     # publish each device call to the followers
            pool = PagePool(rc.num_pages, self.page_size, enable_prefix_cache=spec.enable_prefix_cache,
                            ttl_s=spec.prefix_cache_ttl_s)
            drafter = Drafter(args.speculative, spec_k) if spec_k else None
            guard = LatencyGuard(args.itl_p99_ratio) if guard_on else None
            self.replicas.append(Scheduler(runner, pool, self.eos_ids, self.max_model_len, f"{spec.name}/{r}",
                                           drafter, burst_min_prompts=args.burst_min_prompts, guard=guard))
        tok = self.tokenizer
        self.info = ModelInfo(
            name=spec.name, path=os.path.abspath(spec.path), tokenizer_path=os.path.abspath(spec.path), task="generate",
            architecture=cfg.architecture, model_type=cfg.model_type, dtype=jnp.dtype(self.dtype).name,
            vocab_size=cfg.vocab_size, max_model_len=self.max_model_len, num_params=count_params(cfg),
            eos_token_ids=sorted(self.eos_ids),
            bos_token_id=cfg.bos_token_id if cfg.bos_token_id is not None else tok.bos_token_id,
            pad_token_id=cfg.pad_token_id if cfg.pad_token_id is not None else tok.pad_token_id,
            hidden_size=cfg.hidden_size, embedding_dim=cfg.hidden_size, tp=tp, ep=ep, replicas=replicas,
            page_size=self.page_size, quantization=quant,
            random_weights=spec.random_weights,
        )

    def _auto_pages(self, rc: RunnerConfig) -> int:
        """Enough pages for every running row at full context, capped by a memory budget."""
        want = rc.max_running * math.ceil(rc.max_model_len / rc.page_size) + 1
        c = self.cfg
        per_page = (2 * c.num_layers * rc.page_size * c.num_kv_heads * c.kv_repeat * c.head_dim
                    * backend.kv_dtype(self.dtype).itemsize)
        budget = 4 << 30
        try:
            stats = jax.local_devices()[0].memory_stats() or {}
            if "bytes_limit" in stats:
                budget = int((stats["bytes_limit"] - stats.get("bytes_in_use", 0)) * 0.8)
        except Exception:
            pass
        return max(2, min(want, budget // per_page))

    # ------------------------------------------------------------------ lifecycle
    def warmup(self, progress: bool = True) -> None:
        t = time.time()
        for s in self.replicas:
            s.runner.warmup(progress)
        self.warmup_s = time.time() - t
        r = self.replicas[0].runner
        g = self.replicas[0].guard
        log.info("%s: %d programs compiled in %.1fs (ragged step: token buckets %s, page buckets %s; budget %d, "
                 "burst %s; latency guard %s)", self.spec.name, len(r.programs), self.warmup_s, r.token_buckets,
                 r.page_buckets, r.budget_tokens,
                 f"{r.max_tokens} from {self.args.burst_min_prompts} waiting prompts or an idle step"
                 if r.max_tokens > r.budget_tokens else "off",
                 f"ITL p99 <= {g.ratio:g}x p50" if g is not None else "off")

    def start(self) -> None:
        for s in self.replicas:
            if s.thread is None or not s.thread.is_alive():
                s.start()

    def stop(self, timeout: float = 30.0) -> None:
        for s in self.replicas:
            s.stop(timeout)

    def alive(self) -> bool:
        return all(s.alive() for s in self.replicas)

    # ------------------------------------------------------------------ LoRA adapters
    def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Read a PEFT folder and write it into a free slot of every replica (blocking; compiles nothing)."""
        table = self.lora_table
        if table is None:
            raise InvalidRequest(f"lora: LoRA is not enabled for model {self.spec.name!r}; "
                                 "start the server with --enable-lora or --lora NAME=PATH")
        if not name or len(name) > 256 or name.strip() != name:
            raise InvalidRequest("lora_name: 1..256 characters without surrounding whitespace")
        slot = table.reserve(name)
        try:
            t = time.time()
            ad = load_adapter(name, path, self.cfg, self.args.max_lora_rank, np.dtype(self.dtype))
            for f in [s.call_between_steps(lambda s=s: s.runner.write_lora_slot(slot - 1, ad.arrays))
                      for s in self.replicas]:
                f.result()
        except BaseException:
            table.cancel(name, slot)
            raise
        info = AdapterInfo(name=name, model=self.spec.name, path=ad.path, rank=ad.rank, alpha=ad.alpha,
                           target_modules=ad.target_modules)
        table.commit(info, slot)
        log.info("%s: LoRA adapter %r (rank %d, %s) loaded into slot %d in %.2fs", self.spec.name, name,
                 ad.rank, ",".join(ad.target_modules), slot, time.time() - t)
        return info

    def unload_adapter(self, name: str) -> None:
        if self.lora_table is None or name not in self.lora_table:
            raise NotFound(f"LoRA adapter {name!r} is not loaded")
        self.lora_table.unload(name)

    def adapters(self) -> list[AdapterInfo]:
        return self.lora_table.infos() if self.lora_table is not None else []

    def _use_adapter(self, r: Request, name: str) -> None:
        """Bind a request to adapter `name` (NotFound if it is not loaded) until the scheduler forgets it."""
        if self.lora_table is None:
            raise NotFound(f"LoRA adapter {name!r} is not loaded (LoRA is not enabled: --enable-lora)")
        table = self.lora_table
        r.lora_slot, r.hash_root = table.acquire(name)
        r.on_release = lambda: table.release(name)

    # ------------------------------------------------------------------ requests
    def compile_constraint(self, c: Constraint) -> "Future[CompiledGrammar]":
        """Start compiling a request's constraint (InvalidRequest at once for a malformed one);
        the request waits in the grammar queue until the future is done."""
        return self.grammars.compile(c)

    def submit_generate(self, req: GenerateRequest, sink: Callable[[GenerateOutput], None],
                        grammar: Optional[CompiledGrammar] = None) -> str:
        """Validate and queue a request; `grammar` is its compiled constraint (compile_constraint)."""
        if (req.params.constraint is None) != (grammar is None):
            raise InvalidRequest("constraint: the request's constraint was not compiled")
        ids = self._prompt_ids(req)
        max_new = self._validate(req, ids)
        sched = min(self.replicas, key=lambda s: s.load())
        if any(req.request_id in s.requests for s in self.replicas):
            raise AlreadyExists(f"request_id {req.request_id!r} is already active")
        self._check_queue()
        p = req.params
        seed = p.seed if p.seed is not None else random.getrandbits(64)
        r = Request(request_id=req.request_id, prompt_ids=ids, params=p, sink=sink, max_new_tokens=max_new,
                    priority=req.priority, seed=seed)
        for i in range(p.n):
            r.seqs.append(Sequence(req=r, index=i, detok=IncrementalDetokenizer(
                self.tokenizer, ids, p.skip_special_tokens, list(p.stop), p.include_stop_str_in_output,
                p.spaces_between_special_tokens), grammar=grammar.new_state() if grammar is not None else None))
        if req.adapter:
            self._use_adapter(r, req.adapter)
        sched.submit(r)
        return req.request_id

    def _check_queue(self) -> None:
        waiting = sum(s.load() for s in self.replicas) - sum(len(s.running) for s in self.replicas)
        if waiting >= self.args.max_waiting_requests:
            raise Overloaded(f"waiting queue is full ({self.args.max_waiting_requests} requests); retry later")

    def abort(self, request_id: str) -> bool:
        found = False
        for rid in [request_id] + self._embed_groups.get(request_id, []):
            for s in self.replicas:
                found = s.abort(rid) or found
        return found

    def submit_embed(self, req: EmbedRequest, done: Callable[[object], None]) -> None:
        """Decoder as embedder: last-token pooling of the final hidden state, L2-normalised
        unless req.normalize is False. Each input is a prefill-only request `<id>:<i>`."""
        if req.pairs is not None:
            raise InvalidRequest(f"pairs: model {self.spec.name!r} is a decoder, not a cross-encoder")
        if req.token_type_ids is not None:
            raise InvalidRequest("token_type_ids: not used by decoder models")
        if (req.texts is None) == (req.token_ids is None):
            raise InvalidRequest("input: give exactly one of texts or token_ids")
        items = req.texts if req.texts is not None else req.token_ids
        if not items:
            raise InvalidRequest("input: at least one input is required")
        self._check_queue()
        if len(items) > self.args.max_embed_inputs:
            raise InvalidRequest(f"input: {len(items)} inputs exceeds the limit of {self.args.max_embed_inputs}")
        limit = self.max_model_len - 1
        ids_list = []
        for i, item in enumerate(items):
            if req.texts is not None:
                ids = self.tokenizer(item, add_special_tokens=True)["input_ids"]
                if req.truncate:
                    ids = ids[:limit]
            else:
                ids = [int(t) for t in item]
            sub = GenerateRequest(request_id=f"{req.request_id}:{i}", prompt_ids=ids,
                                  params=SamplingParams(max_new_tokens=1))
            ids_list.append(self._prompt_ids(sub))
            self._validate(sub, ids_list[-1])
        results: list = [None] * len(items)
        state = {"left": len(items), "failed": False}
        lock = threading.Lock()
        normalize = req.normalize is not False
        sub_ids = [f"{req.request_id}:{i}" for i in range(len(items))]
        self._embed_groups[req.request_id] = sub_ids

        def finish(result) -> None:
            self._embed_groups.pop(req.request_id, None)
            done(result)

        def on_vec(i: int, v: np.ndarray) -> None:
            if normalize:
                v = v / max(float(np.linalg.norm(v)), 1e-12)
            with lock:
                results[i] = v
                state["left"] -= 1
                last = state["left"] == 0 and not state["failed"]
            if last:
                finish(EmbedOutput(request_id=req.request_id, embeddings=np.stack(results).astype(np.float32),
                                   prompt_tokens=sum(map(len, ids_list)), token_counts=[len(x) for x in ids_list]))

        def on_output(out: GenerateOutput) -> None:
            if out.finished and out.finish_reason in ("abort", "error"):
                with lock:
                    first_failure = not state["failed"]
                    state["failed"] = True
                if first_failure:
                    for rid in sub_ids:
                        self.abort(rid)
                    finish(None if out.finish_reason == "abort" else Internal(out.error or "embedding failed"))

        for i, ids in enumerate(ids_list):
            r = Request(request_id=sub_ids[i], prompt_ids=ids, params=SamplingParams(max_new_tokens=1),
                        sink=on_output, max_new_tokens=1, priority=req.priority,
                        on_embedding=lambda v, i=i: on_vec(i, v))
            r.seqs.append(Sequence(req=r, index=0))
            min(self.replicas, key=lambda s: s.load()).submit(r)

    def _prompt_ids(self, req: GenerateRequest) -> list[int]:
        if req.prompt_ids is not None and req.prompt is not None:
            raise InvalidRequest("give either prompt or prompt_ids, not both")
        if req.prompt_ids is not None:
            ids = [int(t) for t in req.prompt_ids]
        elif req.prompt is not None:
            ids = self.tokenizer(req.prompt, add_special_tokens=True)["input_ids"]
        else:
            raise InvalidRequest("prompt: a prompt or prompt token ids are required")
        if not ids:
            raise InvalidRequest("prompt: the prompt is empty (0 tokens)")
        V = self.cfg.vocab_size
        bad = [t for t in ids if t < 0 or t >= V]
        if bad:
            raise InvalidRequest(f"prompt_ids: token id {bad[0]} is out of range [0, {V})")
        return ids

    def _validate(self, req: GenerateRequest, ids: list[int]) -> int:
        """Check every sampling field against the engine's limits; returns max_new_tokens."""
        p, a, V = req.params, self.args, self.cfg.vocab_size
        L = len(ids)
        limit = a.max_prompt_tokens or (self.max_model_len - 1)
        if L > min(limit, self.max_model_len - 1):
            raise InvalidRequest(f"prompt: {L} tokens exceeds the limit of {min(limit, self.max_model_len - 1)} "
                                 f"(context length {self.max_model_len})")
        room = self.max_model_len - L
        pool_pages = min(s.pool.usable for s in self.replicas)
        if p.max_new_tokens is None:   # up to the context, the limit, and what one sequence can hold
            max_new = max(1, min(room, a.max_new_tokens_limit, pool_pages * self.page_size - L))
        else:
            if p.max_new_tokens < 1:
                raise InvalidRequest(f"max_new_tokens: must be >= 1, got {p.max_new_tokens}")
            if p.max_new_tokens > a.max_new_tokens_limit:
                raise InvalidRequest(f"max_new_tokens: {p.max_new_tokens} exceeds the limit of {a.max_new_tokens_limit}")
            if p.max_new_tokens > room:
                raise InvalidRequest(f"max_new_tokens: prompt ({L} tokens) + max_new_tokens ({p.max_new_tokens}) "
                                     f"exceeds the context length {self.max_model_len}")
            max_new = p.max_new_tokens
        need = math.ceil((L + max_new) / self.page_size)
        if need > pool_pages:
            raise InvalidRequest(f"max_new_tokens: prompt ({L}) + max_new_tokens ({max_new}) needs {need} KV pages "
                                 f"of {self.page_size} tokens but the pool has {pool_pages}")
        _finite(p.temperature, "temperature", 0.0, 100.0)
        _finite(p.top_p, "top_p", 0.0, 1.0)
        if p.top_p <= 0:
            raise InvalidRequest(f"top_p: must be in (0, 1], got {p.top_p}")
        _finite(p.min_p, "min_p", 0.0, 1.0)
        if p.top_k < -1:
            raise InvalidRequest(f"top_k: must be -1, 0 (off) or positive, got {p.top_k}")
        _finite(p.repetition_penalty, "repetition_penalty", 1e-6, 100.0)
        _finite(p.frequency_penalty, "frequency_penalty", -2.0, 2.0)
        _finite(p.presence_penalty, "presence_penalty", -2.0, 2.0)
        if not 1 <= p.n <= a.max_n:
            raise InvalidRequest(f"n: must be in [1, {a.max_n}], got {p.n}")
        if p.top_logprobs < 0 or p.top_logprobs > a.max_top_logprobs:
            raise InvalidRequest(f"top_logprobs: must be in [0, {a.max_top_logprobs}], got {p.top_logprobs}")
        if p.min_new_tokens < 0 or p.min_new_tokens > max_new:
            raise InvalidRequest(f"min_new_tokens: must be in [0, max_new_tokens={max_new}], got {p.min_new_tokens}")
        if len(p.stop) > a.max_stop_strings:
            raise InvalidRequest(f"stop: {len(p.stop)} stop strings exceeds the limit of {a.max_stop_strings}")
        for s in p.stop:
            if not s or len(s) > a.max_stop_string_len:
                raise InvalidRequest(f"stop: each stop string must have 1..{a.max_stop_string_len} characters")
        for t in p.stop_token_ids:
            if not 0 <= t < V:
                raise InvalidRequest(f"stop_token_ids: token id {t} is out of range [0, {V})")
        if len(set(p.stop_token_ids) | self.eos_ids) > NUM_BAN:
            raise InvalidRequest(f"stop_token_ids: at most {NUM_BAN - len(self.eos_ids)} ids are supported")
        if len(p.logit_bias) > NUM_BIAS:
            raise InvalidRequest(f"logit_bias: at most {NUM_BIAS} entries are supported, got {len(p.logit_bias)}")
        for t, v in p.logit_bias.items():
            if not 0 <= int(t) < V:
                raise InvalidRequest(f"logit_bias: token id {t} is out of range [0, {V})")
            _finite(v, f"logit_bias[{t}]", -100.0, 100.0)
        if p.prompt_logprobs_start is not None and not 0 <= p.prompt_logprobs_start < L:
            raise InvalidRequest(f"prompt_logprobs_start: must be in [0, {L}), got {p.prompt_logprobs_start}")
        if p.seed is not None and not 0 <= p.seed < 2 ** 64:
            raise InvalidRequest(f"seed: must be in [0, 2^64), got {p.seed}")
        return max_new

    # ------------------------------------------------------------------ stats
    def stats(self) -> ModelStats:
        per = []
        for s in self.replicas:
            pre, dec = s.throughput()
            pool = s.pool
            per.append(ModelStats(
                name=self.spec.name, running_requests=len(s.running) + len(s.prefilling),
                waiting_requests=len(s.waiting), pages_total=pool.usable, pages_used=pool.num_used(),
                pages_free=pool.num_free(), page_size=pool.page_size, prefill_tokens_per_s=pre,
                decode_tokens_per_s=dec, total_prompt_tokens=s.total_prompt_tokens,
                total_generated_tokens=s.total_generated_tokens, prefix_cache_hit_tokens=pool.hit_tokens,
                prefix_cache_miss_tokens=pool.miss_tokens,
                compilations_after_warmup=s.runner.programs.compilations_after_warmup,
                max_running_requests=s.max_running, max_num_batched_tokens=s.budget, preemptions=s.preemptions,
                burst_steps=s.burst_steps))
        # requests wait for their grammar before a replica is chosen: the queue is the model's, shown on rank 0
        per[0].grammar_queue = self.grammars.queued
        tot = ModelStats(name=self.spec.name, page_size=self.page_size, replicas=per,
                         max_num_batched_tokens=self.replicas[0].budget, matmul_routes=self._matmul_routes(),
                         grammar_queue=self.grammars.queued)
        if self.replicas[0].drafter is not None:
            each = [s.drafter.stats() for s in self.replicas if s.drafter is not None]
            for x, st in zip(per, each):
                x.spec = st
            tot.spec = SpecStats(method=each[0].method, num_speculative_tokens=each[0].num_speculative_tokens,
                                 proposed_tokens=sum(e.proposed_tokens for e in each),
                                 accepted_tokens=sum(e.accepted_tokens for e in each),
                                 verify_rows=sum(e.verify_rows for e in each),
                                 accepted_histogram=[sum(h) for h in zip(*(e.accepted_histogram for e in each))])
        if self.lora_table is not None:   # every replica holds every adapter: the same slots
            for x in per + [tot]:
                x.lora_slots_used, x.lora_slots_total = self.lora_table.used(), self.lora_table.slots
        for f in ("running_requests", "waiting_requests", "pages_total", "pages_used", "pages_free",
                  "prefill_tokens_per_s", "decode_tokens_per_s", "total_prompt_tokens", "total_generated_tokens",
                  "prefix_cache_hit_tokens", "prefix_cache_miss_tokens", "compilations_after_warmup",
                  "max_running_requests", "preemptions", "burst_steps"):
            setattr(tot, f, sum(getattr(x, f) for x in per))
        return tot


    def _matmul_routes(self) -> list[MatmulRoute]:
        plan = self.cfg.matmul_plan
        if plan is None:   # forced (or not on CPU): one path for every matrix
            return [MatmulRoute("all", "all", self.cfg.matmul)]
        return [MatmulRoute(r["weight"], r["shape_class"], r["path"]) for r in plan.summary()]


MAX_SPECULATIVE_TOKENS = 16


def _spec_tokens(args: EngineArgs) -> int:
    """Most guesses per row (0: speculation off), validated."""
    if args.speculative not in METHODS:
        raise InvalidRequest(f"--speculative must be one of {', '.join(METHODS)}, got {args.speculative!r}")
    if args.speculative == "off":
        return 0
    k = args.num_speculative_tokens
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise InvalidRequest(f"--num-speculative-tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}")
    return k


def _finite(v: float, name: str, lo: float, hi: float) -> None:
    if not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise InvalidRequest(f"{name}: must be a finite number in [{lo}, {hi}], got {v}")
