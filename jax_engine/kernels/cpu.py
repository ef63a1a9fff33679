"""CPU kernels (cpu.cc) behind XLA FFI custom calls: the layer matmuls, the decoder's ragged
attention and the encoders' attention (padded batches and packed sequences).

Matmul, why: XLA:CPU's dot repacks the weight panel on every call and reached only 10-20 GB/s at the
decode shapes (M = 1..64 rows against megabytes of weights). The kernel reads weights that were
packed once at load time into 64-column panels ([L, P, K, 64], see `pack`) and keeps every row's
accumulators in registers; a stacked [L, ...] weight is passed whole with a layer index, so the
layer scan does not slice (copy) it. Decode attention: see jax_engine/attention/cpu.py.

The kernel is compiled here with the machine's C++ compiler (-O3 -march=native) on first use and
cached under $XDG_CACHE_HOME/xlaserve/kernels, keyed by the source, the jaxlib headers, the
compiler and this CPU's flags. No compiler (or a failed build) means `available()` is False with a
reason, and `--cpu-matmul auto` falls back to XLA's dot. Where it builds, `auto` does not assume the
kernel is faster: jax_engine/kernels/choose.py times both paths on this host and keeps the faster.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("xlaserve.kernels")

PANEL = 64                       # output columns per panel (4 AVX-512 vectors); must match cpu.cc
TARGET = "xlaserve_cpu_gemm_f32"
BIAS_TARGET = "xlaserve_cpu_gemm_bias_f32"
GELU_TARGET = "xlaserve_cpu_gemm_bias_gelu_f32"
I8_TARGET = "xlaserve_cpu_gemm_i8"
BF16_TARGET = "xlaserve_cpu_gemm_bf16"
I8_BF16_TARGET = "xlaserve_cpu_gemm_i8_bf16"
I8A8_TARGET = "xlaserve_cpu_gemm_i8a8"
ATTN_TARGET = "xlaserve_cpu_decode_attention_f32"
ENC_ATTN_TARGET = "xlaserve_cpu_encoder_attention_f32"
ENC_ATTN_VARLEN_TARGET = "xlaserve_cpu_encoder_attention_varlen_f32"
BLAS_TARGET = "xlaserve_cpu_blas_gemm_f32"
BLAS_BIAS_TARGET = "xlaserve_cpu_blas_gemm_bias_f32"
BLAS_GELU_TARGET = "xlaserve_cpu_blas_gemm_bias_gelu_f32"
GLU_TARGET = "xlaserve_cpu_glu_bf16"
GLU_ACTS = {"silu": 0, "gelu_tanh": 1}     # cpu.cc GluBF16Impl's act codes
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu.cc")
_lock = threading.Lock()
_state: dict[str, Any] = {}      # "ok": bool, "reason": str, "lib": CDLL


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> Optional[str]:
    for cand in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "xlaserve", "kernels")


def _l1d_bytes(base: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """This CPU's L1 data cache per core in bytes (sysfs, else sysconf), 32 KiB when neither says:
    it sizes the float kernel's K chunk (cpu.cc kKcF32), which on a 32 KiB-L1 Zen 4 decoded 16
    streams ~28 % faster at the size that fits than at the one that suits a 48 KiB L1."""
    try:
        for idx in sorted(os.listdir(base)):
            d = os.path.join(base, idx)
            with open(os.path.join(d, "level")) as f:
                level = f.read().strip()
            with open(os.path.join(d, "type")) as f:
                kind = f.read().strip()
            if level == "1" and kind in ("Data", "Unified"):
                with open(os.path.join(d, "size")) as f:
                    size = f.read().strip().upper()
                mult = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
                n = int(size.rstrip("KMB")) * mult
                if n > 0:
                    return n
    except (OSError, ValueError):
        pass
    try:
        n = int(os.sysconf("SC_LEVEL1_DCACHE_SIZE"))
        if n > 0:
            return n
    except (ValueError, OSError, AttributeError):
        pass
    return 32 << 10


_FLAGS = ["-O3", "-march=native", "-std=c++17", "-fPIC", "-w", f"-DXLASERVE_L1D_BYTES={_l1d_bytes()}"]
# cpu.cc is compiled as these parts side by side (-DXLASERVE_PART=n), then linked: 9.5 s as one
# compile on a 2-core Zen 4, ~5 s as two (GEMMs 4.4 s, attention 4.3 s), off a cold start's
# critical path (nothing else runs while the first model waits for its kernels).
_PARTS = (1, 2)


def build_key() -> str:
    """Hash of what the compiled library depends on: the source, jax, the FFI headers, the
    compiler, this CPU's flags and the build flags (also keys the matmul choice, choose.py)."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++; or set CXX)")
    if "build_key" in _state:
        return _state["build_key"]
    with open(_SOURCE, "rb") as f:
        src = f.read()
    cxx_version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    include = jax.ffi.include_dir()
    key = hashlib.sha256(b"\0".join([
        src, jax.__version__.encode(), jax.lib.__version__.encode() if hasattr(jax.lib, "__version__") else b"",
        include.encode(), cxx_version.encode(), _cpu_flags().encode(), " ".join(_FLAGS).encode(), repr(_PARTS).encode(),
    ])).hexdigest()[:16]
    _state["build_key"] = key
    return key


def _build() -> str:
    """Path of the compiled library, building it if this machine has not yet."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++; or set CXX)")
    include = jax.ffi.include_dir()
    if not os.path.exists(os.path.join(include, "xla", "ffi", "api", "ffi.h")):
        raise RuntimeError(f"jaxlib ships no XLA FFI headers under {include}")
    flags = _FLAGS
    key = build_key()
    out = os.path.join(cache_dir(), f"cpu-{key}.so")
    if os.path.exists(out):
        return out
    os.makedirs(cache_dir(), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir())
    os.close(fd)
    objs = [f"{tmp}.{n}.o" for n in _PARTS]
    procs: list[subprocess.Popen] = []
    try:
        procs += [subprocess.Popen([cxx, *flags, f"-DXLASERVE_PART={n}", "-I", include, "-c", _SOURCE, "-o", o],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for n, o in zip(_PARTS, objs)]
        errors = [p.communicate(timeout=300)[1] for p in procs]     # both compile meanwhile
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{os.path.basename(cxx)} failed: {' '.join(errors).strip()[-600:]}")
        r = subprocess.run([cxx, "-shared", *objs, "-o", tmp], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{os.path.basename(cxx)} failed to link: {r.stderr.strip()[-600:]}")
        os.replace(tmp, out)          # atomic: processes building at once never load a partial file
    finally:
        for p in procs:             # a part still compiling after the other failed or timed out
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in [tmp, *objs]:
            if os.path.exists(f):
                os.unlink(f)
    return out


def build_in_background() -> None:
    """Build (or load) the library on a thread now, so that on a cold start the compile overlaps
    the first model's weight loading and tokenizer set-up instead of starting at its first
    matmul choice: the model work before that choice took ~3.6 s of a 2-core Zen 4's cold start,
    the build ~5 s. Whoever calls available() meanwhile waits for the same build (_lock)."""
    threading.Thread(target=available, name="xlaserve-kernel-build", daemon=True).start()


def available() -> bool:
    """Build (once), load and register the kernel; False (with `reason()`) if that is impossible."""
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        try:
            if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
                raise RuntimeError(f"untested CPU architecture {platform.machine()}")
            lib = ctypes.cdll.LoadLibrary(_build())
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.XlaserveGemmF32), platform="cpu")
            jax.ffi.register_ffi_target(BIAS_TARGET, jax.ffi.pycapsule(lib.XlaserveGemmBiasF32), platform="cpu")
            jax.ffi.register_ffi_target(GELU_TARGET, jax.ffi.pycapsule(lib.XlaserveGemmBiasGeluF32), platform="cpu")
            jax.ffi.register_ffi_target(I8_TARGET, jax.ffi.pycapsule(lib.XlaserveGemmI8), platform="cpu")
            jax.ffi.register_ffi_target(BF16_TARGET, jax.ffi.pycapsule(lib.XlaserveGemmBF16), platform="cpu")
            jax.ffi.register_ffi_target(I8_BF16_TARGET, jax.ffi.pycapsule(lib.XlaserveGemmI8BF16), platform="cpu")
            jax.ffi.register_ffi_target(I8A8_TARGET, jax.ffi.pycapsule(lib.XlaserveGemmI8A8), platform="cpu")
            jax.ffi.register_ffi_target(ATTN_TARGET, jax.ffi.pycapsule(lib.XlaserveDecodeAttentionF32), platform="cpu")
            jax.ffi.register_ffi_target(ENC_ATTN_TARGET, jax.ffi.pycapsule(lib.XlaserveEncoderAttentionF32),
                                        platform="cpu")
            jax.ffi.register_ffi_target(ENC_ATTN_VARLEN_TARGET, jax.ffi.pycapsule(lib.XlaserveEncoderAttentionVarlenF32),
                                        platform="cpu")
            jax.ffi.register_ffi_target(BLAS_TARGET, jax.ffi.pycapsule(lib.XlaserveBlasGemmF32), platform="cpu")
            jax.ffi.register_ffi_target(BLAS_BIAS_TARGET, jax.ffi.pycapsule(lib.XlaserveBlasGemmBiasF32),
                                        platform="cpu")
            jax.ffi.register_ffi_target(BLAS_GELU_TARGET, jax.ffi.pycapsule(lib.XlaserveBlasGemmBiasGeluF32),
                                        platform="cpu")
            jax.ffi.register_ffi_target(GLU_TARGET, jax.ffi.pycapsule(lib.XlaserveGluBF16), platform="cpu")
            _state.update(ok=True, reason="", lib=lib)
        except Exception as e:  # noqa: BLE001 - any failure means: use XLA's dot instead
            _state.update(ok=False, reason=str(e) or type(e).__name__)
            log.warning("CPU matmul kernel unavailable, using XLA's dot: %s", _state["reason"])
        return _state["ok"]


def amx_active() -> bool:
    """Whether the kernel runs bfloat16 GEMMs of 16+ rows on AMX tiles here (cpu.cc: amx_panel):
    built with AMX (-march=native on such a CPU), CPUID says AMX-BF16, Linux granted the tile
    state, and XLASERVE_AMX is not 0."""
    return available() and bool(_state["lib"].XlaserveAmxActive())


def vnni_active() -> bool:
    """Whether the w8a8 GEMM (cpu.cc: GemmI8A8Impl) runs on AVX512-VNNI here; without it the kernel
    is a plain C++ loop (still exact), which choose.py measures against XLA's int8 dot."""
    return available() and bool(_state["lib"].XlaserveVnniActive())


def reason() -> str:
    return _state.get("reason", "not built yet")


def _require() -> None:
    """Trace-time check that the custom-call targets are registered in this process."""
    if not available():
        raise RuntimeError(f"CPU kernels unavailable: {reason()}")


# --------------------------------------------------------------------------- library sgemm
def _find_sgemm() -> tuple[int, bool, str]:
    """(address, ilp64, library) of a cblas_sgemm: the OpenBLAS inside numpy's wheel (numpy.libs /
    numpy/.dylibs, symbols scipy_cblas_sgemm64_ or scipy_cblas_sgemm), else a system libopenblas.
    numpy already loaded its copy, so this adds no library to the process and no dependency.
    The library's own thread pool is set to one thread: cpu.cc (blas_run) runs one single-threaded
    sgemm per thread of ours, and the library's pool threads spin after each call, taking the
    cores XLA's pool and our helpers run on (see there)."""
    here = os.path.dirname(os.path.abspath(np.__file__))
    cands = sorted(glob.glob(os.path.join(here + ".libs", "libscipy_openblas*")) +
                   glob.glob(os.path.join(here, ".dylibs", "libscipy_openblas*")))
    sys_lib = ctypes.util.find_library("openblas")
    cands += [sys_lib] if sys_lib else []
    for path in cands:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for sym, ilp64 in (("scipy_cblas_sgemm64_", True), ("scipy_cblas_sgemm", False), ("cblas_sgemm", False)):
            fn = getattr(lib, sym, None)
            if fn is not None:
                for setter in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                               "openblas_set_num_threads"):
                    if hasattr(lib, setter):
                        getattr(lib, setter).argtypes = [ctypes.c_int]
                        getattr(lib, setter)(1)
                        break
                return ctypes.cast(fn, ctypes.c_void_p).value or 0, ilp64, os.path.basename(path)
    raise RuntimeError("no OpenBLAS found (numpy's wheel bundles one; a system libopenblas also works)")


def blas_available() -> bool:
    """The library sgemm path: the kernel library builds and an OpenBLAS is found; False (with
    `blas_reason()`) otherwise."""
    if not available():
        return False
    with _lock:
        if "blas_ok" not in _state:
            try:
                addr, ilp64, name = _find_sgemm()
                _state["lib"].XlaserveSetSgemm(ctypes.c_void_p(addr), ctypes.c_int(int(ilp64)))
                _state.update(blas_ok=True, blas_reason="", blas_lib=name)
            except Exception as e:  # noqa: BLE001 - any failure means: no library path
                _state.update(blas_ok=False, blas_reason=str(e) or type(e).__name__)
        return _state["blas_ok"]


def blas_reason() -> str:
    return _state.get("blas_reason", "not looked for yet") if available() else reason()


def blas_gemm(x: jax.Array, w: jax.Array, layer: Any, trans_b: bool = False,
              rows: Optional[jax.Array] = None) -> jax.Array:
    """x [M, K] @ w[layer] for a float32 stacked weight w [L, K, N] (XLA's layout; [L, N, K] with
    trans_b), by the library sgemm; [M, N] float32. `rows` as gemm's: rows past it are zeros."""
    if not blas_available():
        raise RuntimeError(f"library sgemm unavailable: {blas_reason()}")
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1] if trans_b else w.shape[2]), jnp.float32)
    li = _layer_operand(layer, rows)
    return jax.ffi.ffi_call(BLAS_TARGET, out)(x.astype(jnp.float32), w.astype(jnp.float32), li, trans_b=int(trans_b))


def blas_gemm_bias(x: jax.Array, w: jax.Array, layer: Any, bias: jax.Array, gelu: bool = False,
                   rows: Optional[jax.Array] = None) -> jax.Array:
    """gemm_bias on the library sgemm: x [M, K] @ w[layer] (float32 [L, K, N], XLA's layout) + bias
    [N], then (`gelu`) HF's exact GELU, in the same call (cpu.cc: XlaserveBlasGemmBias[Gelu]F32).
    `rows` as gemm's: rows past it are zeros (no bias)."""
    if not blas_available():
        raise RuntimeError(f"library sgemm unavailable: {blas_reason()}")
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32)
    li = _layer_operand(layer, rows)
    return jax.ffi.ffi_call(BLAS_GELU_TARGET if gelu else BLAS_BIAS_TARGET, out)(
        x.astype(jnp.float32), w.astype(jnp.float32), li, bias.astype(jnp.float32))


def blas_linear(x: jax.Array, w: jax.Array, layer: Any, k_dims: int) -> jax.Array:
    """The library-sgemm counterpart of an einsum contracting x's last k_dims axes with the stacked
    weight w [L, K..., N...] (XLA's layout, contraction dims first): x.shape[:-k_dims] + N... float32."""
    lead, kshape = x.shape[:x.ndim - k_dims], x.shape[x.ndim - k_dims:]
    if tuple(w.shape[1:1 + k_dims]) != tuple(kshape):
        raise ValueError(f"weight {w.shape} does not fit input {x.shape}")
    out_tail = tuple(w.shape[1 + k_dims:])
    K, n = math.prod(kshape), math.prod(out_tail)
    y = blas_gemm(x.reshape(-1, K), w.reshape(w.shape[0], K, n), layer)
    return y.reshape(lead + out_tail)


# --------------------------------------------------------------------------- layout
def num_panels(n: int) -> int:
    return -(-n // PANEL)


def packed_shape(lead: tuple[int, ...], k: int, n: int, dtype: Any) -> tuple[int, ...]:
    """Shape of `pack`'s panels for a [*lead, k, n] weight: [*lead, P, K, 64], or in K pairs
    [*lead, P, ceil(K / 2), 128] (cpu.cc's pair kernel) for bfloat16 weights, or in K quads
    [*lead, P, ceil(K / 4), 256] (uint8: the w8a8 kernel's panels)."""
    if jnp.dtype(dtype) == jnp.bfloat16:
        return lead + (num_panels(n), -(-k // 2), 2 * PANEL)
    if jnp.dtype(dtype) == jnp.uint8:
        return lead + (num_panels(n), -(-k // 4), 4 * PANEL)
    return lead + (num_panels(n), k, PANEL)


def pack(w: Any, k_dims: int, stacked: bool, a8: bool = False) -> Any:
    """[L?, K..., N...] (k_dims contraction dims after the optional layer axis) -> [L, P, K, 64],
    the output axis zero-padded to whole panels; other floats become float32. bfloat16 stays
    bfloat16 in K pairs: [L, P, ceil(K / 2), 128], element [l, p, j, 2c + e] = w[l, 2j + e, 64p + c]
    (K zero-padded to even). A weight-only int8 {"q", "s"} weight keeps int8 panels, whatever the
    model's activations (gemm picks the kernel by them), and gets its per-column scale as [L, 64 P].
    With `a8` (--quantize w8a8) an int8 weight is packed in K quads for the int8-activation
    kernel: uint8 [L, P, ceil(K / 4), 256], element [l, p, j, 4c + e] = w[l, 4j + e, 64p + c] + 128
    (K zero-padded to a multiple of 4; cpu.cc: GemmI8A8Impl)."""
    lead = 1 if stacked else 0
    q = w["q"] if isinstance(w, dict) else w
    L = q.shape[0] if stacked else 1
    K = math.prod(q.shape[lead:lead + k_dims])
    N = math.prod(q.shape[lead + k_dims:])
    P = num_panels(N)
    in_pairs = q.dtype == jnp.bfloat16
    in_quads = a8 and isinstance(w, dict)

    @jax.jit
    def _panels(a):
        a = a.reshape((L, K, N))
        if in_quads:
            k4 = -(-K // 4)
            a = jnp.pad(a, ((0, 0), (0, 4 * k4 - K), (0, P * PANEL - N)))
            a = (a.astype(jnp.int16) + 128).astype(jnp.uint8)
            return a.reshape(L, k4, 4, P, PANEL).transpose(0, 3, 1, 4, 2).reshape(L, P, k4, 4 * PANEL)
        if in_pairs:
            k2 = -(-K // 2)
            a = jnp.pad(a, ((0, 0), (0, 2 * k2 - K), (0, P * PANEL - N)))
            return a.reshape(L, k2, 2, P, PANEL).transpose(0, 3, 1, 4, 2).reshape(L, P, k2, 2 * PANEL)
        a = a if a.dtype == jnp.int8 else a.astype(jnp.float32)
        a = jnp.pad(a, ((0, 0), (0, 0), (0, P * PANEL - N)))
        return a.reshape(L, K, P, PANEL).transpose(0, 2, 1, 3)

    if not isinstance(w, dict):
        return _panels(w)
    scale = jax.jit(lambda s: jnp.pad(s.reshape(L, N).astype(jnp.float32), ((0, 0), (0, P * PANEL - N))))(w["s"])
    return {"q": _panels(q), "s": scale}


def _pairs(w: Any) -> bool:
    """Whether packed weights are in the K-pair layout (last axis 128)."""
    return (w["q"] if isinstance(w, dict) else w).shape[-1] == 2 * PANEL


def _quads(w: Any) -> bool:
    """Whether packed weights are the w8a8 kernel's K quads (int8 {"q", "s"}, last axis 256)."""
    return isinstance(w, dict) and w["q"].shape[-1] == 4 * PANEL


def _layer_operand(layer: Any, rows: Optional[jax.Array]) -> jax.Array:
    """The GEMM kernels' layer operand: the layer index as an int32 scalar, or with `rows` the pair
    [layer, rows] (cpu.cc: live_rows)."""
    li = jnp.asarray(layer, jnp.int32).reshape(())
    if rows is None:
        return li
    return jnp.stack([li, jnp.asarray(rows, jnp.int32).reshape(())])


def gemm(x: jax.Array, w: Any, layer: Any, n: int, rows: Optional[jax.Array] = None) -> jax.Array:
    """x [M, K] @ w[layer] (packed float32 or bfloat16, or int8 {"q", "s"}) -> [M, n] float32.
    x is computed in float32 for float32 panels (as XLA's preferred_element_type) and rounded to
    bfloat16 for the K-pair panels of bfloat16 weights. int8 panels take x as it comes: bfloat16
    (a bfloat16 model's activations) as it is (cpu.cc's GemmI8BF16Impl), anything else in float32.
    `rows` (an int32 scalar, or None for all M): only x's first `rows` rows are computed, the rest
    of the result is zeros (a ragged step's padding tokens; cpu.cc: live_rows). Quad panels
    (--quantize w8a8) take x in float32 and quantize each row to int8 inside the call
    (cpu.cc: GemmI8A8Impl; llama.linear's `a8` is the same arithmetic on XLA)."""
    _require()
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    li = _layer_operand(layer, rows)
    if _quads(w):
        return jax.ffi.ffi_call(I8A8_TARGET, out)(x.astype(jnp.float32), w["q"], w["s"], li)
    bf16_x = _pairs(w) or (isinstance(w, dict) and x.dtype == jnp.bfloat16)
    if bf16_x:
        xb = x.astype(jnp.bfloat16)
        if xb.shape[1] % 2:                                   # the pair loops' zero row
            xb = jnp.pad(xb, ((0, 0), (0, 1)))
        if isinstance(w, dict):
            return jax.ffi.ffi_call(I8_BF16_TARGET, out)(xb, w["q"], w["s"], li)
        return jax.ffi.ffi_call(BF16_TARGET, out)(xb, w, li)
    if isinstance(w, dict):
        return jax.ffi.ffi_call(I8_TARGET, out)(x.astype(jnp.float32), w["q"], w["s"], li)
    return jax.ffi.ffi_call(TARGET, out)(x.astype(jnp.float32), w, li)


def gemm_bias(x: jax.Array, w: jax.Array, layer: Any, bias: jax.Array, gelu: bool = False,
              rows: Optional[jax.Array] = None) -> jax.Array:
    """x [M, K] @ w[layer] + bias [N], then (`gelu`) HF's exact (erf) GELU; float32 panels only
    (cpu.cc: XlaserveGemmBiasF32 / XlaserveGemmBiasGeluF32): an encoder's projection, its bias
    and activation in one pass over the output. `rows` as gemm's: rows past it are zeros (no bias)."""
    _require()
    if _pairs(w) or isinstance(w, dict):
        raise ValueError("gemm_bias takes float32 panels only")
    n = bias.shape[-1]
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    li = _layer_operand(layer, rows)
    return jax.ffi.ffi_call(GELU_TARGET if gelu else BIAS_TARGET, out)(
        x.astype(jnp.float32), w, li, bias.astype(jnp.float32))


def glu(gu: jax.Array, act: str, rows: Optional[jax.Array] = None) -> jax.Array:
    """A bfloat16 model's gated MLP activation: gu [..., 2, I] float32 (the gate_up projection's
    kernel output, not yet rounded) -> act(gate) * up [..., I] bfloat16, rounded as torch rounds
    bfloat16 tensors (cpu.cc: GluBF16Impl, which says why it is a kernel). act: silu | gelu_tanh.
    `rows` as gemm's: rows past it are zeros."""
    _require()
    lead, inter = gu.shape[:-2], gu.shape[-1]
    if gu.shape[-2] != 2 or act not in GLU_ACTS:
        raise ValueError(f"glu takes [..., 2, I] float32 and act in {sorted(GLU_ACTS)}, got {gu.shape} and {act!r}")
    m = math.prod(lead)
    live = jnp.asarray(m if rows is None else rows, jnp.int32).reshape(())
    y = jax.ffi.ffi_call(GLU_TARGET, jax.ShapeDtypeStruct((m, inter), jnp.bfloat16))(
        gu.reshape(m, 2 * inter).astype(jnp.float32), live, act=GLU_ACTS[act])
    return y.reshape(lead + (inter,))


def linear(x: jax.Array, w: jax.Array, layer: Any, k_dims: int, out_tail: tuple[int, ...],
           rows: Optional[jax.Array] = None) -> jax.Array:
    """The packed-weight counterpart of an einsum contracting x's last k_dims axes: returns
    x.shape[:-k_dims] + out_tail in float32 (`rows`: as gemm's, over the flattened lead)."""
    lead = x.shape[:x.ndim - k_dims]
    K = math.prod(x.shape[x.ndim - k_dims:])
    n = math.prod(out_tail)
    q = w["q"] if isinstance(w, dict) else w
    if tuple(q.shape[1:]) != packed_shape((), K, n, q.dtype):
        raise ValueError(f"packed weight {q.shape} does not fit input {x.shape} -> {out_tail}")
    y = gemm(x.reshape(-1, K), w, layer, n, rows)
    return y.reshape(lead + tuple(out_tail))


def decode_attention(q: jax.Array, kc: jax.Array, vc: jax.Array, page_table: jax.Array, kv_lens: jax.Array,
                     positions: jax.Array, layer: Any, *, page_size: int, window: int, scale: float) -> jax.Array:
    """q [B, KVH, G, D] against layer `layer` of caches [L, slots, KVH, D] through page_table
    [B, P]; keys s <= positions[b], s < kv_lens[b] (and s > positions[b] - window if window > 0).
    Returns [B, KVH, G, D] float32; rows with no valid key are zeros."""
    _require()

    def i32(a: Any) -> jax.Array:
        return jnp.asarray(a, jnp.int32)
    return jax.ffi.ffi_call(ATTN_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), kc, vc, i32(page_table), i32(kv_lens), i32(positions), i32(layer).reshape(()),
        page_size=int(page_size), window=int(window), scale=np.float32(scale))


def encoder_attention(qkv: jax.Array, mask: jax.Array, heads: int, scale: float) -> jax.Array:
    """Bidirectional attention of an encoder batch (cpu.cc: XlaserveEncoderAttentionF32): qkv
    [B, S, 3 H D] (the fused projection's q, k, v), mask [B, S] (> 0: a real token); query i of
    row b attends to row b's real keys. Returns [B, S, H D] float32, zeros at padding queries.
    D must be a multiple of 16 (`encoder_attention_fits`)."""
    _require()
    b, s, w = qkv.shape
    return jax.ffi.ffi_call(ENC_ATTN_TARGET, jax.ShapeDtypeStruct((b, s, w // 3), jnp.float32))(
        qkv.astype(jnp.float32), jnp.asarray(mask, jnp.int32), heads=int(heads), scale=np.float32(scale))


def encoder_attention_varlen(qkv: jax.Array, starts: jax.Array, lens: jax.Array, heads: int, scale: float) -> jax.Array:
    """`encoder_attention` over packed sequences: qkv [T, 3 H D] holds them back to back, sequence
    s at tokens [starts[s], starts[s] + lens[s]) (lens 0: an unused slot). Returns [T, H D]
    float32, zeros at tokens no sequence covers."""
    _require()
    t, w = qkv.shape
    return jax.ffi.ffi_call(ENC_ATTN_VARLEN_TARGET, jax.ShapeDtypeStruct((t, w // 3), jnp.float32))(
        qkv.astype(jnp.float32), jnp.asarray(starts, jnp.int32), jnp.asarray(lens, jnp.int32), heads=int(heads),
        scale=np.float32(scale))


def encoder_attention_fits(head_dim: int) -> bool:
    """Whether the encoder attention kernel takes this head size (whole 16-float vectors)."""
    return head_dim > 0 and head_dim % 16 == 0


def reference_gemm(x: np.ndarray, w_packed: Any, layer: int, n: int) -> np.ndarray:
    """NumPy meaning of `gemm` (for tests): unpack the layer's panels and multiply; quad panels
    (w8a8) quantize x's rows first and multiply in integers (float32 for the scales, as cpu.cc)."""
    q = np.asarray(w_packed["q"] if isinstance(w_packed, dict) else w_packed)
    if _quads(w_packed):
        _, P, K4, _ = q.shape
        k = np.shape(x)[-1]
        wq = (q[layer].reshape(P, K4, PANEL, 4).transpose(1, 3, 0, 2).reshape(4 * K4, P * PANEL)[:k, :n]
              .astype(np.int64) - 128)
        xf = np.asarray(x, np.float32)
        amax = np.max(np.abs(xf), axis=-1, keepdims=True)
        inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
        xq = np.round(np.clip(xf * inv, -127, 127)).astype(np.int64)
        acc = (xq @ wq).astype(np.float32)
        return (acc * (amax / np.float32(127)) * np.asarray(w_packed["s"])[layer, :n]).astype(np.float64)
    if _pairs(w_packed):
        _, P, K2, _ = q.shape
        w = q[layer].reshape(P, K2, PANEL, 2).transpose(1, 3, 0, 2).reshape(2 * K2, P * PANEL)
        w = w[:np.shape(x)[-1], :n].astype(np.float32).astype(np.float64)
    else:
        _, P, K, _ = q.shape
        w = q[layer].transpose(1, 0, 2).reshape(K, P * PANEL)[:, :n].astype(np.float32).astype(np.float64)
    if isinstance(w_packed, dict):
        w = w * np.asarray(w_packed["s"])[layer, :n].astype(np.float64)
    return np.asarray(x, np.float64) @ w


# --------------------------------------------------------------------------- choice
CHOICES = ("auto", "xla", "kernel", "blas")


def resolve(choice: str, plat: str, dtype: Any, quantize: str, tp: int) -> str:
    """--cpu-matmul without measuring: 'kernel' where the kernel can run (CPU, float32 or bfloat16
    weights or weight-only int8, tp 1, and it builds), else 'xla'. 'xla' forces XLA's dot, 'blas'
    the library sgemm (float32 only); asking for 'kernel' or 'blas' where it cannot run is an error
    rather than a silent fallback. With 'auto' a 'kernel' answer means "eligible": choose.configure
    then times the paths and keeps the fastest."""
    from jax_engine.errors import InvalidRequest

    if choice not in CHOICES:
        raise InvalidRequest(f"--cpu-matmul {choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "xla":
        log.info("layer matmuls: XLA dot (--cpu-matmul xla)")
        return "xla"
    why = None
    if plat != "cpu":
        why = f"it is a CPU kernel and the platform is {plat}"
    elif choice == "blas" and (jnp.dtype(dtype) != jnp.float32 or quantize != "none"):
        why = f"the library sgemm takes float32 weights (dtype {jnp.dtype(dtype).name}, quantize {quantize})"
    elif jnp.dtype(dtype) not in (jnp.float32, jnp.bfloat16):
        why = f"it takes float32 or bfloat16 (dtype {jnp.dtype(dtype).name})"
    elif quantize not in ("none", "int8", "w8a8"):
        why = f"it has no {quantize} weights"
    elif tp != 1:
        why = f"it is not sharded for tensor parallelism (tp {tp})"
    elif not available():
        why = reason()
    elif choice == "blas" and not blas_available():
        why = blas_reason()
    if why is None:
        if choice in ("kernel", "blas"):
            log.info("layer matmuls: %s (--cpu-matmul %s)",
                     "packed-panel CPU kernel" if choice == "kernel" else f"library sgemm ({_state.get('blas_lib')})", choice)
            return choice
        return "kernel"
    if choice in ("kernel", "blas"):
        raise InvalidRequest(f"--cpu-matmul {choice}: {why}; use auto or xla")
    log.info("layer matmuls: XLA dot (%s)", why)
    return "xla"
