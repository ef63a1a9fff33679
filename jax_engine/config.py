"""Engine-wide and per-model configuration (the CLI's serve flags map onto these)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class ModelSpec:
    """One served model. Unset limits fall back to EngineArgs, then to the model's own."""

    name: str
    path: str
    task: Optional[str] = None          # None = from config.json ("generate" / "embed" / "classify")
    dtype: str = "auto"                 # auto | float32 | bfloat16
    quantize: str = "none"              # none | int8
    tp: int = 1
    replicas: int = 1
    max_model_len: Optional[int] = None
    page_size: Optional[int] = None
    num_pages: Optional[int] = None
    max_running_requests: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    enable_prefix_cache: Optional[bool] = None
    prefix_cache_ttl_s: float = 0.0     # 0 = no TTL
    random_weights: bool = False        # label for the demo generator


@dataclass
class EngineArgs:
    models: list[ModelSpec] = field(default_factory=list)
    dtype: str = "auto"
    quantize: str = "none"
    tp: int = 1
    replicas: int = 1
    max_model_len: Optional[int] = None
    page_size: int = 16
    page_bucket_ratio: int = 2            # KV page-count buckets step by this factor (2 or more)
    num_pages: Optional[int] = None      # None = from memory
    max_running_requests: int = 16
    max_num_batched_tokens: int = 512
    max_waiting_requests: int = 256
    enable_prefix_cache: bool = True
    compile_cache_dir: Optional[str] = None
    attention_backend: str = "auto"           # auto | reference | pallas (jax_engine/attention/__init__.py)
    cpu_matmul: str = "auto"                  # auto (measure on CPU, jax_engine/kernels/choose.py) | xla | kernel
    # limits enforced at admission (interface.md / reliability_security.md)
    max_prompt_tokens: Optional[int] = None   # None = the model's context
    max_new_tokens_limit: int = 4096
    max_n: int = 8
    max_top_logprobs: int = 5                 # static maximum of the top-N program
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    max_embed_inputs: int = 256               # prompts per Encode / embeddings request
    embed_max_batch_tokens: int = 8192        # TEI-style token budget per encoder batch
    model_root: Optional[str] = None          # network-supplied paths must lie under this
