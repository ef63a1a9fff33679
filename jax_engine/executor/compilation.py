"""One owner for compiled programs.

Every jitted program the engine runs goes through a `ProgramCache`: programs are compiled
ahead of time (`jit(...).lower(...).compile()`) for each bucket at warmup, and looked up by key
afterwards. A key not compiled at warmup is compiled on demand and counted, so
`compilations_after_warmup` is exact. A process-wide listener on JAX's compile event is a
second witness used by tests.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Optional

import jax
from jax.tree_util import PyTreeDef

from jax_engine.executor import program_store

_lock = threading.Lock()
_global_compiles = 0
_listener_installed = False


def _on_event(event: str, duration: float, **_: Any) -> None:
    global _global_compiles
    if event == "/jax/core/compile/backend_compile_duration":
        with _lock:
            _global_compiles += 1


def install_compile_listener() -> None:
    global _listener_installed
    with _lock:
        if _listener_installed:
            return
        _listener_installed = True
    jax.monitoring.register_event_duration_secs_listener(_on_event)


def global_compile_count() -> int:
    """Backend compilations in this process so far (all owners)."""
    return _global_compiles


def enable_persistent_cache(cache_dir: Optional[str]) -> str:
    """Turn on JAX's persistent compilation cache and, in it, the store of serialized programs
    (program_store.py); returns the directory used."""
    if not cache_dir:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        cache_dir = os.path.join(base, "xlaserve", "jax_cache")
    os.makedirs(cache_dir, exist_ok=True)
    program_store.configure(os.path.join(cache_dir, "xlaserve-programs"))
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return cache_dir


@dataclass(frozen=True)
class FlatState:
    """A module's state (parameters) as the compiled programs take it: its leaves as a plain
    tuple, rebuilt into the state pytree inside the traced program (`unflatten`, free there).

    Why: `nnx.State` and its Variables are pytrees flattened by Python callbacks, and a compiled
    program's C++ call path flattens its arguments and checks their tree structure on every call.
    Measured on a 2-vCPU Zen 5, medians: all-MiniLM-L6-v2's state (25 leaves) took 0.33 ms to
    dispatch its 32-token program, the leaves 0.19 ms (the whole call, 400 interleaved calls:
    4.38 -> 4.23 ms); the trained 3 M decoder's stacked state (9 leaves) 0.038 -> 0.010 ms a step.
    """

    leaves: tuple[jax.Array, ...]
    treedef: PyTreeDef

    @staticmethod
    def of(state: Any) -> "FlatState":
        leaves, treedef = jax.tree_util.tree_flatten(state)
        return FlatState(tuple(leaves), treedef)

    def unflatten(self, leaves: tuple[jax.Array, ...]) -> Any:
        """The state pytree over `leaves` (the program's argument, or these leaves)."""
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


class ProgramCache:
    """Compiled executables keyed by (program name, bucket key).

    `context`: a stable rendering (program_store.stable_repr) of everything the registered
    functions close over (model config, settings, dtype, mesh, parameter tree); with the program
    store on, compiled programs are saved under it and a later process with the same context
    loads them instead of tracing (program_store.py: why)."""

    def __init__(self, name: str, context: str = ""):
        self.name = name
        self.context = f"{name}|{context}"
        self.loaded_from_store = 0
        self._programs: dict[Hashable, Any] = {}
        self._builders: dict[str, Callable[..., Any]] = {}
        self.warm = False
        self.compilations_after_warmup = 0
        self._lock = threading.Lock()

    def register(self, program: str, jitted: Callable[..., Any]) -> None:
        self._builders[program] = jitted

    def compile(self, program: str, key: Hashable, example_args: tuple) -> Any:
        """Compile `program` for `key` using abstract or concrete `example_args` (or load it from
        the program store)."""
        store = program_store.current()
        skey = store.key(self.context, program, key, example_args) if store is not None else None
        exe = store.load(skey) if store is not None and skey is not None else None
        if exe is None:
            before = program_store.compile_events_here()
            exe = self._builders[program].lower(*example_args).compile()
            if store is not None and skey is not None and program_store.really_compiled(before):
                store.save(skey, exe)       # program_store.really_compiled: why only these
        else:
            with self._lock:
                self.loaded_from_store += 1
        with self._lock:
            self._programs[(program, key)] = exe
        return exe

    def get(self, program: str, key: Hashable, args: tuple) -> Any:
        exe = self._programs.get((program, key))
        if exe is None:
            if self.warm:
                self.compilations_after_warmup += 1
            exe = self.compile(program, key, args)
        return exe

    def __len__(self) -> int:
        return len(self._programs)

    def keys(self) -> Iterable[Hashable]:
        return list(self._programs)
