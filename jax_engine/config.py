"""Engine-wide and per-model configuration, and the one function that resolves a model's
settings against the engine's (`resolve`). The CLI's serve flags map onto `EngineArgs`."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from jax_engine.checkpoint.hf import read_config, st_max_seq_length
from jax_engine.errors import InvalidRequest
from jax_engine.models.demo import is_demo_model
from jax_engine.models.registry import task_of


@dataclass
class ModelSpec:
    """One served model. A None field inherits the EngineArgs value (then the model's own);
    any other value is pinned for this model (tp 1 under --tp 2 stays 1)."""

    name: str
    path: str
    task: Optional[str] = None          # None = from config.json ("generate" / "embed" / "classify")
    dtype: Optional[str] = None         # auto | float32 | bfloat16
    quantize: Optional[str] = None      # none | int8 | w8a8
    tp: Optional[int] = None
    ep: Optional[int] = None            # expert-parallel size (mixture-of-experts models only)
    replicas: Optional[int] = None
    max_model_len: Optional[int] = None
    page_size: Optional[int] = None
    num_pages: Optional[int] = None
    max_running_requests: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    enable_prefix_cache: Optional[bool] = None
    prefix_cache_ttl_s: float = 0.0     # 0 = no TTL
    random_weights: bool = False        # the caller knows the weights are random (demo generator)


@dataclass
class EngineArgs:
    models: list[ModelSpec] = field(default_factory=list)
    dtype: str = "auto"
    quantize: str = "none"
    tp: int = 1
    ep: int = 1                               # expert parallelism: experts sharded over ep devices (MoE only)
    replicas: int = 1
    max_model_len: Optional[int] = None
    page_size: int = 16
    page_bucket_ratio: int = 2            # KV page-count buckets step by this factor (2 or more)
    num_pages: Optional[int] = None      # None = from memory
    max_running_requests: int = 16
    max_num_batched_tokens: Optional[int] = None   # None = token_budget_default() for the platform
    burst_batched_tokens: Optional[int] = None     # None = burst_budget_default(); 0 = off
    burst_min_prompts: int = 4                # prompts awaiting their first token that switch a step to the burst budget
    itl_p99_ratio: float = 4.0                # latency guard (decode/latency_guard.py): 0 = off, else > 1
    max_waiting_requests: int = 256
    enable_prefix_cache: bool = True
    compile_cache_dir: Optional[str] = None
    attention_backend: str = "auto"           # auto | reference | pallas (jax_engine/attention/__init__.py)
    cpu_matmul: str = "auto"                  # auto (measure on CPU, jax_engine/kernels/choose.py) | xla | kernel | blas
    huge_pages: bool = True                   # CPU: decoder weights onto 2 MiB pages (executor/huge_pages.py)
    # limits enforced at admission
    max_prompt_tokens: Optional[int] = None   # None = the model's context
    max_new_tokens_limit: int = 4096
    max_n: int = 8
    max_top_logprobs: int = 5                 # static maximum of the top-N program
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    max_grammar_bytes: int = 65536           # size of one request's constraint (schema, regex, grammar)
    grammar_compile_timeout_s: float = 10.0   # a grammar compiling longer is refused (400)
    grammar_cache_size: int = 256             # compiled grammars kept per model (LRU)
    max_embed_inputs: int = 256               # prompts per Encode / embeddings request
    embed_max_batch_tokens: int = 8192        # TEI-style token budget per encoder batch
    model_root: Optional[str] = None          # network-supplied paths must lie under this
    # LoRA (jax_engine/lora): adapter slots in device arrays, padded to the maximum rank
    enable_lora: bool = False                 # allocate the slots (implied by `loras`)
    loras: list[tuple[str, str]] = field(default_factory=list)   # (name, path) loaded into the default generator
    max_loras: int = 8                        # adapter slots per generation model
    max_lora_rank: int = 64                   # adapters of a higher rank are refused
    # speculative decoding without a draft model (jax_engine/spec, jax_engine/decode/speculate.py)
    speculative: str = "off"                  # off | ngram | suffix
    # most guesses per row and step (1..MAX_SPECULATIVE_TOKENS); the planner keeps per step only
    # those that pay, so the cap matters where text repeats: 8 repeated greedy streams of the
    # trained benchmark model ran 2.75x faster than without speculation with 16, ~2.3x with 8
    num_speculative_tokens: int = 16


CPU_TOKEN_BUDGET = 64
ACCELERATOR_TOKEN_BUDGET = 2048


def token_budget_default(accelerator: bool) -> int:
    """The ragged step's token budget when --max-num-batched-tokens is not given.

    CPU: 64, from the budget sweep of benchmarks/ragged_step.py on the 2-core reference machine
    ('small' Llama, Poisson 128-token prompts and answers at 1 and 2 req/s): a step's time grows
    with its tokens, so the budget bounds how long a prompt chunk holds up the streams decoding
    beside it; 64 kept the inter-token p99 under 4x the median (3.6x / 3.5x) for a first token
    ~20 % later than at 128 (196 vs 166 ms at 1 req/s), where the p99 was 6.6x. Since the latency
    guard (--itl-p99-ratio, decode/latency_guard.py) lets a prompt past it whenever the measured
    step times allow, the budget is the chunk size when the guard says no. GPU / TPU: 2048,
    vLLM's chunked-prefill default (a step there is bandwidth-bound far beyond 64 tokens; not
    measured here: no accelerator was available)."""
    return ACCELERATOR_TOKEN_BUDGET if accelerator else CPU_TOKEN_BUDGET


CPU_BURST_BUDGET = 256


def burst_budget_default(accelerator: bool) -> int:
    """The token budget of a step while a backlog of prompts waits (--burst-batched-tokens), when
    not given; 0 = off.

    CPU: 256. The small latency budget above starves prefill when many prompts arrive at once:
    each step's decode tokens come out of the same 64, so the prompts behind them enter a few
    tokens at a time and finish their answers one after another, the last ones in steps of a
    few rows, the costliest per token on a compute-bound host ('small' Llama, 32 streams of 128 +
    128 tokens: 215 steps). With at least --burst-min-prompts prompts waiting, a step takes up to
    256 tokens instead, so the backlog is prefilled in large steps and the streams decode
    together (150 steps; see the saturation rows of benchmarks/ragged_step.py). Under arrivals
    the server keeps up with, fewer prompts than that wait and the latency budget holds the
    inter-token p99. A step with no sequence decoding takes the burst budget too: no stream's
    next token waits for it, and a 128-token prompt is prefilled in one step instead of two.
    GPU / TPU: off (the budget there is already 2048)."""
    return 0 if accelerator else CPU_BURST_BUDGET


@dataclass(frozen=True)
class ResolvedSpec:
    """A ModelSpec with every inherited setting decided (see `resolve`)."""

    name: str
    path: str
    task: str                           # generate | embed | classify
    dtype: str                          # float32 | bfloat16 (auto decided for this platform)
    quantize: str                       # none | int8 | w8a8 (a converted int8 checkpoint is int8)
    tp: int
    replicas: int
    max_model_len: Optional[int]        # None = the model's own context (encoders: see resolve)
    page_size: int
    num_pages: Optional[int]            # None = from memory
    max_running_requests: int
    max_num_batched_tokens: int
    enable_prefix_cache: bool
    prefix_cache_ttl_s: float
    random_weights: bool
    ep: int = 1                         # expert-parallel size: each replica uses tp x ep devices
    burst_batched_tokens: int = 0       # > max_num_batched_tokens, or 0 = off


def _pick(pinned, inherited):
    return pinned if pinned is not None else inherited


def is_random_weights(spec: ModelSpec) -> bool:
    """Whether a model's weights are random: the caller says so, or the folder is the demo generator."""
    return spec.random_weights or is_demo_model(spec.path)


def resolve(spec: ModelSpec, args: EngineArgs) -> ResolvedSpec:
    """Every setting of `spec`, pinned or inherited from `args`; reads the folder's config.json."""
    # heavy: jax (this module is imported by the CLI's argument parser, before any JAX work)
    from jax_engine.checkpoint.converted import converted_quantize
    from jax_engine.executor import backend

    hf = None if spec.task else read_config(spec.path)
    task = spec.task or task_of(hf)
    choice = _pick(spec.dtype, args.dtype)
    quantize = _pick(spec.quantize, args.quantize)
    if task == "generate":
        dtype = np.dtype(backend.resolve_dtype(choice)).name   # auto: bfloat16 on accelerators, float32 on CPU
        if quantize not in ("none", "int8", "w8a8"):
            raise InvalidRequest(f"quantize {quantize!r} is not supported (none, int8, w8a8)")
        if quantize == "none":                  # a checkpoint converted with --quantize int8 is int8
            quantize = converted_quantize(spec.path)
    elif choice and choice != "auto":
        dtype = choice
    elif not backend.is_accelerator():          # encoders: auto is float32 on CPU, elsewhere the
        dtype = "float32"                       # checkpoint's saved half dtype if it has one
    else:
        hf = hf or read_config(spec.path)
        saved = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
        dtype = "bfloat16" if saved in ("bfloat16", "float16") else "float32"
    max_model_len = spec.max_model_len
    if task != "generate":
        # sentence-transformers' own max_seq_length (256 for MiniLM) is what its users get; TEI and
        # vLLM honour it too, so it wins over the engine-wide --max-model-len
        max_model_len = max_model_len or st_max_seq_length(spec.path)
    max_model_len = max_model_len or args.max_model_len
    budget = (spec.max_num_batched_tokens or args.max_num_batched_tokens
              or token_budget_default(backend.is_accelerator()))
    burst = args.burst_batched_tokens
    if burst is None:                           # the default applies only above the budget
        burst = burst_budget_default(backend.is_accelerator())
        burst = burst if burst > budget else 0
    elif burst and burst <= budget:
        raise InvalidRequest(f"--burst-batched-tokens {burst} must exceed --max-num-batched-tokens {budget} "
                             "(or be 0: off)")
    if not (args.itl_p99_ratio == 0 or 1 < args.itl_p99_ratio < math.inf):
        raise InvalidRequest(f"--itl-p99-ratio must be 0 (off) or > 1, got {args.itl_p99_ratio}")
    if args.burst_min_prompts < 1:
        raise InvalidRequest(f"--burst-min-prompts must be >= 1, got {args.burst_min_prompts}")
    return ResolvedSpec(
        name=spec.name, path=spec.path, task=task,
        dtype=dtype, quantize=quantize,
        tp=_pick(spec.tp, args.tp), replicas=_pick(spec.replicas, args.replicas),
        max_model_len=max_model_len,
        page_size=spec.page_size or args.page_size,
        num_pages=spec.num_pages or args.num_pages,
        max_running_requests=spec.max_running_requests or args.max_running_requests,
        max_num_batched_tokens=budget, burst_batched_tokens=burst,
        enable_prefix_cache=_pick(spec.enable_prefix_cache, args.enable_prefix_cache),
        prefix_cache_ttl_s=spec.prefix_cache_ttl_s,
        random_weights=is_random_weights(spec),
        ep=_pick(spec.ep, args.ep),
    )

