"""The engine as the fronts see it: the `EngineAPI` Protocol and what crosses that boundary.

Why this module exists: the fronts (frontends/grpc, frontends/http) and the CLI's serve loop
must depend on one explicit contract, not on `jax_engine.engine.Engine` and its internals. A
front imports `jax_engine.api`, `jax_engine.types` and `jax_engine.errors`, and nothing else of
the engine; whatever else a front needs from the engine (a constant, a helper, the config
dataclasses it passes in) is re-exported here. `jax_engine.engine.Engine` satisfies `EngineAPI`
structurally (it does not inherit from it); a test checks every member and signature, and a
fake engine in the tests implements the same Protocol so front tests need no JAX.
"""
from __future__ import annotations

from typing import Any, AsyncGenerator, Optional, Protocol, runtime_checkable

from jax_engine.config import EngineArgs, ModelSpec
from jax_engine.constrain.tools import tool_constraint
from jax_engine.types import (
    TOKENIZE_INLINE_CHARS,
    AdapterInfo,
    EmbedOutput,
    EmbedRequest,
    GenerateOutput,
    GenerateRequest,
    ModelInfo,
    ModelStats,
)

__all__ = [
    "EngineAPI", "RequestCounters", "Tokenizer", "REQUEST_OUTCOMES",
    "EngineArgs", "ModelSpec", "TOKENIZE_INLINE_CHARS", "device_memory", "tool_constraint",
]

# Keys of `EngineAPI.counters.snapshot()`: accepted, then exactly one terminal outcome each.
REQUEST_OUTCOMES = ("accepted", "completed", "errored", "cancelled")


@runtime_checkable
class RequestCounters(Protocol):
    """Request accounting (Prometheus counters, the CLI's drain loop)."""

    def snapshot(self) -> dict[str, int]:
        """{outcome: count} for every name in REQUEST_OUTCOMES."""
        ...


@runtime_checkable
class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the fronts use (chat templates, logprob text)."""

    chat_template: Optional[str]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], tokenize: bool = True,
                            add_generation_prompt: bool = False, **template_kwargs: Any) -> Any: ...


@runtime_checkable
class EngineAPI(Protocol):
    """Everything the fronts and the CLI call on the engine; nothing else.

    Errors are `jax_engine.errors.EngineError` subclasses; a generate stream that fails after
    its first event ends with an output whose finish_reason is "error" (`error_kind` set).
    """

    # ------------------------------------------------------------ state read by the fronts
    args: EngineArgs                 # limits the fronts check and report (max_embed_inputs, ...)
    counters: RequestCounters
    start_time: float                # time.time() at construction
    compile_cache_dir: str           # the JAX persistent compilation cache in use (CLI log line)

    @property
    def draining(self) -> bool: ...

    def ready(self) -> bool:
        """Every model loaded and warm, not draining, every worker alive."""
        ...

    def healthy(self) -> bool:
        """Every running model's worker is alive (true during warmup)."""
        ...

    # ------------------------------------------------------------ models
    def models(self) -> list[ModelInfo]:
        """Every model, whatever its state."""
        ...

    def model_info(self, name: Optional[str] = None, task: Optional[str] = None) -> ModelInfo:
        """A running model by name, or the default one for `task`; NotFound / InvalidRequest / Unavailable."""
        ...

    def default_model(self, task: str) -> Optional[str]: ...

    def tokenizer(self, name: Optional[str] = None, task: Optional[str] = None) -> Tokenizer: ...

    def stats(self, name: Optional[str] = None) -> ModelStats: ...

    # ------------------------------------------------------------ LoRA adapters (names are engine-wide)
    def adapters(self, model: Optional[str] = None) -> list[AdapterInfo]:
        """Loaded adapters (all, or those of one base model), including ones still unloading."""
        ...

    async def load_adapter(self, name: str, path: str, model: Optional[str] = None) -> AdapterInfo:
        """Load a PEFT adapter folder onto `model` (default: the default generation model) at run
        time; `path` comes from the network, so it must lie under --model-root (PermissionDenied).
        InvalidRequest: LoRA not enabled, a malformed or unsupported adapter, rank above
        --max-lora-rank; AlreadyExists: the name is taken; Overloaded: every slot is in use."""
        ...

    async def unload_adapter(self, name: str) -> None:
        """Stop admitting requests for adapter `name` (NotFound if unknown); its slot is freed
        once the requests already using it finish."""
        ...

    # ------------------------------------------------------------ requests
    def generate(self, req: GenerateRequest) -> AsyncGenerator[GenerateOutput, None]:
        """Stream the outputs of all `n` sequences; closing the stream early aborts the request."""
        ...

    async def embed(self, req: EmbedRequest) -> EmbedOutput: ...

    def abort(self, request_id: str) -> bool:
        """Abort `request_id` (and its n>1 sequences); True if it was found."""
        ...

    # ------------------------------------------------------------ life cycle (AllSpark admin, CLI)
    def load_all(self, progress: bool = True, warmup: bool = True) -> None: ...

    async def load_model(self, spec: ModelSpec) -> ModelInfo: ...

    async def start_model(self, name: str) -> None: ...

    async def stop_model(self, name: str) -> None: ...

    async def release_model(self, name: str) -> None: ...

    def begin_drain(self) -> None: ...

    def fail_in_flight(self, message: str) -> int: ...

    def shutdown(self, timeout: float = 5.0) -> None: ...


def device_memory() -> tuple[int, int]:
    """(limit, in use) bytes of the first accelerator; (0, 0) where JAX reports none (CPU)."""
    try:
        import jax  # heavy: only imported when a front asks for device memory

        stats = jax.local_devices()[0].memory_stats() or {}
        return int(stats.get("bytes_limit", 0)), int(stats.get("bytes_in_use", 0))
    except Exception:
        return 0, 0
