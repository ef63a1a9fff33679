"""Plain dataclasses that cross the engine boundary.

Engine-level inputs carry *semantic* defaults (temperature 1.0, top_p 1.0, top_k off, ...).
Each front converts its protocol's zero values explicitly before building these.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

# Text prompts longer than this are tokenized on a worker thread, not on the event loop.
TOKENIZE_INLINE_CHARS = 16384


CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "ebnf", "lark", "choice", "structural_tag")


@dataclass
class Constraint:
    """What a request's output must match (structured generation; jax_engine/constrain compiles it).

    kind:
      json_schema     spec = a JSON Schema (JSON text); always enforced (OpenAI `strict` or not)
      json_object     any JSON object (OpenAI response_format json_object); spec unused
      regex           spec = a regular expression the whole output matches
      ebnf            spec = a GBNF / EBNF grammar (`root ::= ...`, SGLang's ebnf_grammar)
      lark            spec = a Lark grammar (llguidance dialect, `start: ...`)
      choice          choices = the output is exactly one of these strings
      structural_tag  spec = SGLang's structural tag JSON: {"structures": [{"begin", "schema", "end"}],
                      "triggers": [...]}: free text, with a schema enforced between begin and end
    """

    kind: str
    spec: str = ""
    choices: list[str] = field(default_factory=list)
    any_whitespace: bool = False   # JSON kinds: any whitespace between tokens (default: compact JSON)


@dataclass
class FunctionTool:
    """An OpenAI function tool: its name and the JSON schema of its arguments."""

    name: str
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass
class SamplingParams:
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0                # 1 = off
    top_k: int = 0                    # 0 or -1 = off
    min_p: float = 0.0                # 0 = off
    repetition_penalty: float = 1.0   # 1 = off (HF/vLLM multiplicative rule)
    frequency_penalty: float = 0.0    # OpenAI additive rule, counts over generated tokens
    presence_penalty: float = 0.0
    max_new_tokens: Optional[int] = None  # None = up to the context limit
    min_new_tokens: int = 0           # EOS and stop tokens masked before this many tokens
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: Optional[int] = None        # None = a fresh random seed per request
    n: int = 1
    logprobs: bool = False            # logprob of each chosen token
    top_logprobs: int = 0             # top-N alternatives per position (<= engine's static max)
    prompt_logprobs_start: Optional[int] = None  # None = no prompt logprobs; else first position
    skip_special_tokens: bool = True  # for the text the engine detokenizes
    spaces_between_special_tokens: bool = True  # passed to the tokenizer's decode (fast ones ignore it)
    include_stop_str_in_output: bool = False
    constraint: Optional[Constraint] = None   # structured generation; None = free text


@dataclass
class GenerateRequest:
    request_id: str
    prompt_ids: Optional[list[int]] = None  # exactly one of prompt_ids / prompt
    prompt: Optional[str] = None
    params: SamplingParams = field(default_factory=SamplingParams)
    model: Optional[str] = None             # None / "" = the default generation model
    priority: int = 0                       # lower is served earlier (vLLM rule)
    adapter: Optional[str] = None           # a loaded LoRA adapter's name; None / "" = the base model


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class GenerateOutput:
    """One event of a generate stream. Events of the n>1 sequences interleave; `index` says which."""

    request_id: str
    index: int = 0
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    logprobs: Optional[list[TokenLogprob]] = None            # one per new token, when asked
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None  # first event only; None for pos 0
    finished: bool = False
    finish_reason: Optional[str] = None   # "stop" | "length" | "abort" | "error"
    matched_stop: Optional[Union[int, str]] = None  # token id or stop string
    prompt_tokens: int = 0
    completion_tokens: int = 0            # cumulative for this index
    cached_tokens: int = 0
    error: Optional[str] = None           # set with finish_reason "error"
    error_kind: Optional[str] = None      # EngineError.kind of the failure


@dataclass
class EmbedRequest:
    request_id: str
    texts: Optional[list[str]] = None
    token_ids: Optional[list[list[int]]] = None
    pairs: Optional[list[tuple[str, str]]] = None   # cross-encoder (query, document) pairs
    token_type_ids: Optional[list[list[int]]] = None
    model: Optional[str] = None
    normalize: Optional[bool] = None    # None = the model's own pooling config
    truncate: bool = True               # texts longer than the context are truncated (TEI default)
    priority: int = 0
    dimensions: Optional[int] = None    # Matryoshka: keep the first n of the pooled vector (then L2
                                        # renormalise if the model normalises); one of the model's
                                        # ModelInfo.matryoshka_dimensions; None = the full vector


@dataclass
class EmbedOutput:
    request_id: str
    embeddings: Optional[np.ndarray] = None   # [n, dim] float32, request order
    scores: Optional[np.ndarray] = None       # [n, num_labels] for cross-encoders
    prompt_tokens: int = 0
    token_counts: list[int] = field(default_factory=list)


@dataclass
class ModelInfo:
    name: str
    path: str
    tokenizer_path: str
    task: str                 # "generate" | "embed" | "classify"
    architecture: str
    model_type: str
    dtype: str
    vocab_size: int
    max_model_len: int
    num_params: int
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    id2label: dict[int, str] = field(default_factory=dict)
    hidden_size: int = 0
    embedding_dim: int = 0
    # Embedding sizes EmbedRequest.dimensions may ask for (Matryoshka), from the HF config.json as
    # vLLM reads it: `matryoshka_dimensions`, or every size 1..embedding_dim when it only says
    # `is_matryoshka: true`; empty = the full embedding_dim only.
    matryoshka_dimensions: list[int] = field(default_factory=list)
    tp: int = 1
    ep: int = 1                    # expert parallelism (mixture-of-experts decoders; a replica uses tp x ep devices)
    replicas: int = 1
    page_size: int = 0
    quantization: str = "none"
    random_weights: bool = False   # the bundled demo generator
    ready: bool = False
    state: str = "built"           # built | running | stopped


@dataclass
class AdapterInfo:
    """A LoRA adapter (PEFT format) served on top of a generation model."""

    name: str
    model: str                  # the base model it applies to
    path: str
    rank: int
    alpha: float
    target_modules: list[str] = field(default_factory=list)   # HF module names (q_proj, ..., down_proj)
    state: str = "loaded"       # loaded | unloading (finishing its requests; refuses new ones)
    in_flight: int = 0          # requests using it now


@dataclass
class SpecStats:
    """Speculative decoding of one model (--speculative): guesses proposed and accepted."""

    method: str                         # ngram | suffix
    num_speculative_tokens: int         # most guesses per row and step
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    verify_rows: int = 0                # row verifications that carried at least one guess
    accepted_histogram: list[int] = field(default_factory=list)   # [a]: verifications accepting a guesses

    @property
    def accept_rate(self) -> float:
        """Accepted / proposed guesses."""
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def accept_length(self) -> float:
        """Tokens a speculating row emits per step on average (accepted guesses + the one the
        step draws itself): SGLang's accept length."""
        return 1.0 + self.accepted_tokens / self.verify_rows if self.verify_rows else 0.0


@dataclass
class MatmulRoute:
    """Which path serves one decoder matrix for a range of rows (--cpu-matmul; see
    jax_engine/kernels/choose.py): path "kernel" or "xla"; weight "all" when one path was forced."""
    weight: str
    shape_class: str
    path: str


@dataclass
class ModelStats:
    name: str
    running_requests: int = 0
    waiting_requests: int = 0
    pages_total: int = 0
    pages_used: int = 0
    pages_free: int = 0
    page_size: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    total_prompt_tokens: int = 0
    total_generated_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_miss_tokens: int = 0
    compilations_after_warmup: int = 0
    max_running_requests: int = 0
    max_num_batched_tokens: int = 0      # the ragged step's token budget (per replica)
    grammar_queue: int = 0               # requests waiting for their grammar to compile
    preemptions: int = 0
    burst_steps: int = 0                 # steps over the latency budget (a backlog waited, or nothing decoded)
    lora_slots_used: int = 0             # LoRA adapter slots holding an adapter (per replica: the same)
    lora_slots_total: int = 0            # --max-loras when LoRA is enabled, else 0
    spec: Optional[SpecStats] = None     # speculative decoding (None when --speculative off)
    matmul_routes: list[MatmulRoute] = field(default_factory=list)
    replicas: list["ModelStats"] = field(default_factory=list)
