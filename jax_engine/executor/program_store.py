"""Compiled programs kept on disk, so a restart loads them instead of tracing them again.

Why: JAX's persistent compilation cache saves the XLA compile, but to find a program in it JAX
must first trace the Python function and lower it to StableHLO (the cache key is a hash of the
lowered module). For the default models that is most of a warm restart: on the 2-vCPU Zen 4
reference host, each of the demo generator's 16 step programs took ~0.23 s to trace, lower and
fetch from JAX's cache (see `benchmarks/start_time.py`). This store keys a serialized executable
by everything that decides the program *without* tracing it: the engine's source, the JAX
versions and platform, the owner's configuration (model config, runner settings, dtype, mesh,
parameter tree), the program's name and bucket, and the shape, dtype and sharding of every
argument. A restart with nothing changed deserializes the executable directly.

What it cannot see is code that is not the engine's own (a monkeypatched function in a test, an
edited installed library of the same version); `XLASERVE_PROGRAM_STORE=0` turns it off, and JAX's
own cache, keyed by the lowered module, still applies then. Files are loaded with pickle from the
user's own cache directory, the same trust JAX's persistent cache asks for.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import io
import logging
import os
import pickle
import re
import threading
from typing import Any, Optional

import jax
import numpy as np
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # jax_engine/
_source_lock = threading.Lock()
_source_digest: Optional[str] = None


def _source_hash() -> str:
    """A digest of every source file of the engine package (Python and the CPU kernels' C++)."""
    global _source_digest
    with _source_lock:
        if _source_digest is None:
            h = hashlib.sha256()
            for root, dirs, files in os.walk(_PACKAGE_DIR):
                dirs[:] = sorted(d for d in dirs if d != "__pycache__")
                for name in sorted(files):
                    if name.endswith((".py", ".cc", ".h")):
                        path = os.path.join(root, name)
                        h.update(os.path.relpath(path, _PACKAGE_DIR).encode())
                        with open(path, "rb") as f:
                            h.update(f.read())
            _source_digest = h.hexdigest()
        return _source_digest


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def stable_repr(obj: Any) -> str:
    """A rendering that is equal across processes for equal configurations: dataclasses by their
    compared fields only (a MatmulPlan's timings and source are not part of its identity), dicts
    sorted, dtypes and meshes by name and shape."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [f for f in dataclasses.fields(obj) if f.compare]
        inner = ", ".join(f"{f.name}={stable_repr(getattr(obj, f.name))}" for f in fields)
        return f"{type(obj).__qualname__}({inner})"
    if isinstance(obj, dict):
        items = sorted((stable_repr(k), stable_repr(v)) for k, v in obj.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(obj, (list, tuple)):
        return type(obj).__name__ + "(" + ", ".join(stable_repr(x) for x in obj) + ")"
    if isinstance(obj, (set, frozenset)):
        return "set(" + ", ".join(sorted(stable_repr(x) for x in obj)) + ")"
    if isinstance(obj, jax.sharding.Mesh):
        return f"Mesh({dict(obj.shape)}, {[d.id for d in obj.devices.flat]})"
    if isinstance(obj, type):
        return obj.__module__ + "." + obj.__qualname__
    if isinstance(obj, np.dtype):
        return str(obj)
    if callable(obj) and hasattr(obj, "__qualname__"):
        return getattr(obj, "__module__", "") + "." + obj.__qualname__
    return repr(obj)


def _arg_signature(args: tuple) -> str:
    """The tree structure and per-leaf shape, dtype, weak type and sharding of a call's arguments."""
    leaves, treedef = jax.tree_util.tree_flatten((args, {}))
    parts = [str(treedef)]
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        parts.append(f"{tuple(np.shape(x))}:{np.dtype(x.dtype) if hasattr(x, 'dtype') else type(x).__name__}:"
                     f"{bool(getattr(x, 'weak_type', False))}:{sharding!r}")
    return "|".join(parts)


def _platform_signature() -> str:
    devs = jax.devices()
    return stable_repr({
        "jax": _version("jax"), "jaxlib": _version("jaxlib"), "flax": _version("flax"), "numpy": np.__version__,
        "backend": jax.default_backend(), "kinds": sorted({d.device_kind for d in devs}), "devices": len(devs),
        "processes": jax.process_count(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "x64": bool(jax.config.jax_enable_x64), "precision": str(jax.config.jax_default_matmul_precision),
        "source": _source_hash(),
    })


_TARGET_RE = re.compile(r'custom_call_target="(xlaserve_[A-Za-z0-9_]+)"')


def _register(targets: list[str]) -> bool:
    """Make the engine's own FFI targets a loaded program calls resolvable in this process.

    Tracing the model registers them (jax_engine/kernels/cpu.py) before anything compiles; a
    program loaded without tracing must do it itself, or XLA would find no handler for the call
    (and the library sgemm path would run with no sgemm bound). False: not possible here."""
    if not targets:
        return True
    from jax_engine.kernels import cpu as cpu_kernels  # only here: the kernels are below this layer's callers

    if not cpu_kernels.available():
        return False
    library = (cpu_kernels.BLAS_TARGET, cpu_kernels.BLAS_BIAS_TARGET, cpu_kernels.BLAS_GELU_TARGET)
    return not any(t in targets for t in library) or cpu_kernels.blas_available()


class ProgramStore:
    """Serialized executables under `directory`, one file per key (see the module docstring)."""

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.loaded = 0
        self.saved = 0

    def key(self, context: str, program: str, bucket: Any, args: tuple) -> str:
        h = hashlib.sha256()
        for part in (_platform_signature(), context, program, stable_repr(bucket), _arg_signature(args)):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key[:40] + ".xlx")

    def load(self, key: str) -> Optional[Any]:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                blob, in_tree, out_tree, device_ids, targets = pickle.load(f)
            if not _register(targets):
                return None
            by_id = {d.id: d for d in jax.devices()}
            devices = [by_id[i] for i in device_ids]     # the devices it was compiled for, in order
            exe = serialize_executable.deserialize_and_load(blob, in_tree, out_tree, backend=devices[0].client,
                                                            execution_devices=devices)
        except FileNotFoundError:
            return None
        except Exception as e:     # a truncated or foreign file: compile instead, and replace it
            log.warning("program store: ignoring %s (%s)", path, e)
            return None
        self.loaded += 1
        return exe

    def save(self, key: str, exe: Any) -> None:
        try:
            blob, in_tree, out_tree = serialize_executable.serialize(exe)
            # deserialize_and_load would otherwise place it on every device of the backend
            device_ids = [d.id for d in exe._executable.xla_executable.local_devices()]
            targets = sorted(set(_TARGET_RE.findall(exe.as_text() or "")))
            buf = io.BytesIO()
            pickle.dump((blob, in_tree, out_tree, device_ids, targets), buf, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:     # e.g. a backend without executable serialization
            log.debug("program store: cannot serialize (%s)", e)
            return
        path = self._path(key)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(buf.getvalue())
            os.replace(tmp, path)
        except OSError as e:       # a full or read-only cache: serve anyway, compile again next start
            log.warning("program store: cannot write %s (%s)", path, e)
            return
        self.saved += 1


_store: Optional[ProgramStore] = None
_here = threading.local()
_listening = False


def _on_event(event: str, **_: Any) -> None:
    # both recorded synchronously in the compiling thread, by jax's compile_or_get_cached
    if event == "/jax/compilation_cache/compile_requests_use_cache":
        _here.requests = getattr(_here, "requests", 0) + 1
    elif event == "/jax/compilation_cache/cache_hits":
        _here.hits = getattr(_here, "hits", 0) + 1


@dataclasses.dataclass(frozen=True)
class CompileEvents:
    """This thread's count of compiles that reached JAX's persistent cache, and of those it served."""
    requests: int
    hits: int


def compile_events_here() -> CompileEvents:
    return CompileEvents(getattr(_here, "requests", 0), getattr(_here, "hits", 0))


def really_compiled(before: CompileEvents) -> bool:
    """Whether the one compile since `before` ran XLA's compiler in this thread.

    Only such an executable may be stored. One JAX loaded from its persistent cache is serialized
    by XLA:CPU without its compiled functions, and loading that in another process fails ("Function
    ... not found"). Nor may one JAX handed back from its in-process compile cache (the same jitted
    function lowered again to the same module, e.g. a module-level program another owner compiled
    first): it reaches neither event and may itself have come from the persistent cache (CI caught
    this for the LoRA write program). So: exactly one cache request, and no hit."""
    now = compile_events_here()
    return now.requests == before.requests + 1 and now.hits == before.hits


def configure(directory: Optional[str]) -> Optional[ProgramStore]:
    """Use `directory` for serialized programs (None: none); off on a multi-process slice (each
    process must compile its part of the collective program itself) and with
    XLASERVE_PROGRAM_STORE=0."""
    global _store, _listening
    if not _listening:
        _listening = True
        jax.monitoring.register_event_listener(_on_event)
    if directory is None or os.environ.get("XLASERVE_PROGRAM_STORE", "1") == "0" or jax.process_count() > 1:
        _store = None
    else:
        _store = ProgramStore(directory)
    return _store


def current() -> Optional[ProgramStore]:
    return _store
