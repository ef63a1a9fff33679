"""--cpu-matmul auto: time XLA's dot against the packed-panel kernel on this host and keep the faster.

Why measure: which path wins depends on the host, not only on the shapes. Weights 768 x 2048
float32, median ms per layer (M = rows multiplied at once):

    M                           1      4     16     64    128    512   2048
    this host (2 vCPU Zen 4,
      1 MiB L2, 32 MiB L3)
      XLA dot                1.04   0.85   0.81   3.94   6.07   18.2   71.4
      kernel                 0.52   0.38   0.53   2.82   4.85   17.5   73.9
    a 2 vCPU Intel host (AVX-512 VNNI, no AMX, 1.25 MiB L2, ~16 GB/s)
      XLA dot                0.62      -    2.8      -    9.9      -     82
      kernel                 1.56      -    6.4      -     26      -    238

so a fixed rule ("the kernel on CPU") is 2.5-3x too slow there, and even here the kernel's lead
fades above a few hundred rows.

The third path, the library sgemm (cpu.cc's XlaserveBlasGemmF32 calling the OpenBLAS inside
numpy's wheel: no new dependency, no extra weight layout, since it reads XLA's own [L, K, N]):
where XLA's dot is weak at prefill-sized M (the Intel host above: 78 GFLOP/s against torch's 227)
a tuned BLAS is what wins; where it is not, it must not be chosen. Standalone [M, 768] x [768,
2048] float32 on this host, quiet, GFLOP/s:

    M                           1     16    128    512   2048
      OpenBLAS (numpy)         63     95    172    198    200
      XLA dot                  35    155    182    204    204

so here the two are level at prefill rows and XLA leads at decode rows. `auto` leaves it out
(LIBRARY_IN_AUTO: it lost a whole-request A/B); where it is timed (`cases(library=True)`), it is
timed for float32 weights at prefill row counts only (it has no bfloat16 or int8 GEMM; at decode rows it is
a GEMV against the panel kernel's weight stream), and since it runs on its own thread pool (which
spins after a call, competing with XLA's) it is kept only where it beats the best other path by
more than MARGIN.

What is timed (`choose`): for each matrix of the served decoder (qkv, o, gate_up, down and the LM
head) both paths on synthetic weights with the model's real contraction size, layout and dtype
(float32 / bfloat16 arrays, or weight-only int8 {"q", "s"}): XLA's einsum over the model's layout
inside a `lax.scan` over stacked layers (as models/decoder.py runs it, slicing included), and the
kernel on packed panels with the layer index. Row counts: 1 and the largest decode batch D
(--max-running-requests) for the "decode" class (M <= D); for "prefill" (M > D) the largest step
T (--max-num-batched-tokens) and, where it fits (2 D <= m <= T / 2), a prompt-sized point m, the
power of two nearest sqrt(D T) (D 16, T 2048: 256). Why the middle point: XLA:CPU's dot changes
implementation with size, so one point at T can pick the wrong path for a 128-token prompt (bfloat16
here: XLA level with the kernel at M = 2048 but 1.2-1.5x slower at 256; timed only at 2048, a
128-token bfloat16 prefill took 135 ms, with the middle point 97-106 ms). The LM head is timed at
decode rows only: it multiplies more than D rows only for prompt logprobs (opt-in), which follow
its decode choice.
Cost bounds, so a cold start on 2 cores pays a few seconds (nothing on a warm start, which reads
the cached decision): a decode point streams about 2 x the last-level cache (64-256 MiB, from
several stacked layers, or fewer output columns of a larger matrix) so it is DRAM-bound as in
serving; a prefill point keeps >= 512 output columns and ~0.5 GFLOP per layer. Both paths scale
linearly in output columns, so fewer columns keep the comparison. Each point: one warm call per
path, then 5 alternating samples (A, B, A, B, ...; each sample >= 2 ms of back-to-back calls),
medians compared: alternation and medians keep a noisy, shared host from favouring either path
(two samples suffice when one path is over twice as slow in every sample). A point whose fastest
path differs from the one both its neighbours share is timed once more, each path keeping its
lower median (`_isolated`: one noisy point had routed a matrix off its faster path).

The rule (`_route`):
  1. per timed row count, the path with the lowest median wins (XLA on a tie; the library sgemm
     only if it beats the others by more than MARGIN);
  2. the decode row counts (1 .. D) take one path, the one with the least summed time over them,
     where their winners differ; neighbouring row counts with the same winner form one class, a
     boundary falls at D (decode / prefill) or between prefill points at the power of two nearest
     their geometric mean. Why one decode path: decode steps come at every row count from 1 to D,
     and a matrix switching paths inside that range lost whole steps where its own timing won
     (2-vCPU Zen 4, 'small' model, batch-16 decode, tok/s, 2 alternating rounds each: bfloat16 +
     int8 with qkv and o on XLA from 5 rows, as the per-point rule chose, 614 / 590 against 682 /
     703 on the kernel alone; float32 + int8 with qkv on XLA from 5 rows 561 / 567 against 598 /
     574), though XLA's dot timed 5-27 % faster for those matrices at 16 rows alone;
  3. memory: a matrix served by both paths needs both layouts (the packed panels and XLA's),
     i.e. its weight bytes twice. A path is kept for a matrix only if it wins somewhere by more
     than MARGIN (10%); otherwise the other path serves every row count (one layout, at most 10%
     slower there, which is within what two runs on a shared host disagree by). Both are kept
     only when each wins by more than 10%, and the log says what the second layout costs.
So a path measurably slower than XLA's dot (beyond the 10% margin) is never chosen.

The decision is cached as JSON under $XDG_CACHE_HOME/xlaserve/kernels/matmul-<hash>.json, keyed by
the CPU model name and flags, the cache sizes, the usable CPU count, jax / jaxlib, the kernel build
key (source, compiler, build flags), the matrices' shapes and dtype, the timed row counts and
RULE_VERSION. Every decision is logged per matrix and class with both timings, and is kept on the
config (`LlamaConfig.matmul_plan.summary()`) for the engine's stats.

Measured here (`small` benchmark model: H 768, I 2048, 12 + 4 heads, V 32000; D 16, T 512; a
shared, loaded 2-core host), median ms per layer, kernel / XLA:
  float32   decode M=1: qkv 0.19/0.30, o 0.09/0.25, gate_up 0.54/0.90, down 0.27/0.44, head 2.7/3.0;
            decode M=16: 0.44/0.65 ... head 6.7/10.2; prefill M=512: within 2% of each other
            -> the kernel for every matrix and row count (one layout).
  bfloat16  (the pair kernel, vdpbf16ps: cpu.cc) decode: the kernel 3-15x faster (XLA:CPU's
            bfloat16 dot is slow at small M); M=256: the kernel 1.1-1.5x faster for o, gate_up
            and down, XLA 1.2x for qkv (320 columns); M=2048: level within 15% -> the kernel for
            every matrix to 1024 rows, qkv on XLA above 16 rows, gate_up on XLA above 1024 (both
            layouts for those two).
  int8      the kernel everywhere but qkv at M=16 (XLA 11% faster, so qkv kept both layouts,
            +11 MiB; since rule 2's one decode path, the kernel for all decode rows: the whole
            step lost with the split). A cold choice took 6-8 s here (half of it compiling 28 small programs);
            a warm start reads the cached JSON in ~10 ms.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

import jax
import jax.numpy as jnp

from jax_engine.errors import InvalidRequest
from jax_engine.kernels import cpu as cpu_kernels
from jax_engine.kernels.plan import LAYOUT, PATHS, UNBOUNDED, MatmulPlan, Timing
from jax_engine.models import bert, llama

log = logging.getLogger("xlaserve.kernels")

RULE_VERSION = 6
Epilogue = Literal["", "bias", "bias_gelu"]    # what a timed encoder matrix does after its product
MARGIN = 0.10                    # a second layout must win by more than this (see the module docstring)
SAMPLES = 5                      # alternating samples per path and point (after one warm call each)
MIN_SAMPLE_S = 0.002             # back-to-back calls per sample until at least this long
PREFILL_FLOPS = 0.5e9            # per layer at a prefill point
MIN_COLUMNS = 512                # output columns kept at a prefill point
# `auto` does not time the library sgemm. Timed alone (one matrix in a scan) it won every float32
# prefill point of the 'small' model here by 1.4-1.9x, but a same-run A/B of whole requests
# ('small', float32, 2 rounds, 128-token prompts) lost with it: prefill b1 159-161 vs 130-145 ms,
# decode b16 439-476 vs 539-560 tok/s, decode b1 66-67 vs 69-72 tok/s. OpenBLAS ran its own
# thread pool then, which kept spinning beside XLA's after each call (the sgemm now runs one
# single-threaded call per thread of ours: cpu.cc, blas_run), and keeping its layout made the
# plan move qkv / down at 16 rows off the kernel. Per-matrix timing cannot see the latter, and
# decoders were not re-measured since, so the path stays opt-in for them (`--cpu-matmul blas`).
# Encoders time it in auto (ENCODER_LIBRARY_IN_AUTO).
LIBRARY_IN_AUTO = False


# --------------------------------------------------------------------------- what to time
@dataclass(frozen=True)
class Case:
    """One matrix of the served decoder as the timing needs it."""

    weight: str                      # qkv | o | gate_up | down | lm_head
    k_dims: tuple[int, ...]          # contraction dims
    out_dims: tuple[int, ...]        # output dims
    layers: int                      # stacked layers (1 for the LM head)
    dtype: str                       # activation / weight dtype name
    int8: bool                       # int8 weights {"q", "s"}
    tied: bool = False               # LM head = embed^T (XLA reads the [V, H] embedding)
    points: tuple[int, ...] = ()     # row counts to time
    blas: bool = False               # also time the library sgemm (at prefill points)
    blas_min_rows: int = 0           # ... of at least this many rows
    flat: bool = False               # an encoder matrix: x [M, K] @ w [K, N] (no decoder layout)
    a8: bool = False                 # int8 activations too (--quantize w8a8: quantized per row)
    epilogue: Epilogue = ""          # a flat float32 matrix's finish as its program runs it: "bias",
                                     # "bias_gelu" (encoder_cases: why)

    @property
    def k(self) -> int:
        return math.prod(self.k_dims)

    @property
    def n(self) -> int:
        return math.prod(self.out_dims)

    @property
    def itemsize(self) -> int:
        return 1 if self.int8 else jnp.dtype(self.dtype).itemsize


def cases(cfg: Any, dtype: Any, quantize: str, decode_rows: int, prefill_tokens: int,
          library: bool = False) -> list[Case]:
    """The matrices of `cfg` (a LlamaConfig, tp 1) and the row counts each is timed at; with
    `library`, the library sgemm too (off in `configure`: see LIBRARY_IN_AUTO)."""
    dec = sorted({1, decode_rows})
    pre = [prefill_tokens] if prefill_tokens > decode_rows else []
    mid = 2 ** round(math.log2(math.sqrt(max(decode_rows, 1) * prefill_tokens))) if pre else 0
    if 2 * decode_rows <= mid <= prefill_tokens // 2:    # a prompt-sized point between D and T
        pre.insert(0, mid)
    name = jnp.dtype(dtype).name
    # the library sgemm: float32 only (numpy's OpenBLAS has no bfloat16 or int8 GEMM), timed at
    # prefill rows only (at decode rows it is a GEMV against the panel kernel's stream)
    blas = library and name == "float32" and quantize == "none" and bool(pre) and cpu_kernels.blas_available()
    out = []
    for w, (kd, od) in llama.matmul_dims(cfg).items():
        head = w == "lm_head"
        int8 = quantize in ("int8", "w8a8") and not (head and cfg.tie_embeddings)
        out.append(Case(w, kd, od, 1 if head else cfg.num_layers, name, int8=int8,
                        tied=head and cfg.tie_embeddings, points=tuple(dec if head else dec + pre),
                        blas=blas and not head, a8=int8 and quantize == "w8a8"))
    return out


def _cache_sizes() -> dict[str, str]:
    """{"L1d": "32K", "L2": "1024K", ...} from sysfs (empty where the kernel does not say)."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    out: dict[str, str] = {}
    try:
        for idx in sorted(os.listdir(base)):
            if not idx.startswith("index"):
                continue
            rd = lambda f: open(os.path.join(base, idx, f)).read().strip()   # noqa: E731
            typ = rd("type")
            out[f"L{rd('level')}" + {"Data": "d", "Instruction": "i"}.get(typ, "")] = rd("size")
    except OSError:
        pass
    return out


def _bytes(size: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(size[:-1]) * mult[size[-1]] if size and size[-1] in mult else int(size or 0)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_key() -> dict[str, Any]:
    """What a timing depends on besides the shapes."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    import jaxlib

    return {"cpu": _cpu_model(), "flags": cpu_kernels._cpu_flags().strip(), "caches": _cache_sizes(), "cpus": cpus,
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "kernel": cpu_kernels.build_key(), "rule": RULE_VERSION}


def _decode_target_bytes() -> int:
    """Bytes a decode point streams: twice the last-level cache, within [64, 256] MiB."""
    llc = max((_bytes(v) for k, v in _cache_sizes().items() if not k.endswith("i")), default=0)
    return min(256 << 20, max(64 << 20, 2 * llc))


def _timed_slice(case: Case, m: int, decode_rows: int) -> tuple[int, int]:
    """(stacked layers, output columns) timed at row count m (see the module docstring)."""
    n, layer_bytes = case.n, case.k * case.n * case.itemsize
    if m > decode_rows:                                   # prefill: compute-bound, bound the FLOPs
        cols = max(MIN_COLUMNS, int(PREFILL_FLOPS / (2 * m * case.k)))
        return min(2, case.layers), min(n, -(-cols // cpu_kernels.PANEL) * cpu_kernels.PANEL)
    target = _decode_target_bytes()
    if case.layers == 1 or 2 * layer_bytes >= target:    # one big matrix: fewer columns
        layers = min(2, case.layers)
        cols = -(-int(target / (layers * case.k * case.itemsize)) // cpu_kernels.PANEL) * cpu_kernels.PANEL
        return layers, min(n, max(cpu_kernels.PANEL, cols))
    return min(case.layers, max(2, -(-target // layer_bytes))), n


def _shrink(dims: tuple[int, ...], cols: int) -> tuple[int, ...]:
    """dims with its largest axis cut so the product is about cols (unchanged if already <=)."""
    n = math.prod(dims)
    if cols >= n:
        return dims
    i = max(range(len(dims)), key=lambda j: dims[j])
    rest = n // dims[i]
    return dims[:i] + (max(1, -(-cols // rest)),) + dims[i + 1:]


# --------------------------------------------------------------------------- the timed programs
class _Point:
    """Both paths of one case at one row count: jitted programs and synthetic operands."""

    def __init__(self, case: Case, m: int, decode_rows: int):
        self.case, self.m = case, m
        self.shape_class = "decode" if m <= decode_rows else "prefill"
        L, cols = _timed_slice(case, m, decode_rows)
        out = _shrink(case.out_dims, cols)
        n = math.prod(out)
        dt = jnp.dtype(case.dtype)
        self.slice = f"{L} x {list(case.k_dims)} -> {list(out)} {('w8a8' if case.a8 else 'int8') if case.int8 else dt.name}"
        P = cpu_kernels.num_panels(n)
        sds = jax.ShapeDtypeStruct
        if case.weight == "lm_head":
            self.x = sds((m, case.k), dt)                  # h[:, 0] of the decode step
            if case.tied:
                xla_w: Any = sds((n, case.k), dt)
            elif case.int8:
                xla_w = {"q": sds((case.k, n), jnp.int8), "s": sds((n,), jnp.float32)}
            else:
                xla_w = sds((case.k, n), dt)
            xla_fn = lambda x, w: llama.head_einsum(x, w, tied=case.tied, a8=case.a8)   # noqa: E731
            kernel_fn = lambda x, w: cpu_kernels.linear(x, w, 0, 1, (n,))              # noqa: E731
            pk_lead: tuple[int, ...] = (1,)
        else:
            kd = len(case.k_dims)
            if case.flat:                                  # an encoder's [M, K] rows, as models/bert.py
                self.x = sds((m,) + case.k_dims, dt)

                def one(x: jax.Array, wl: Any) -> jax.Array:
                    if not case.epilogue:
                        return x @ wl
                    y = x @ wl["w"] + wl["b"]
                    return jax.nn.gelu(y, approximate=False) if case.epilogue == "bias_gelu" else y
            else:
                spec = llama.SPECS[case.weight]
                rows = (m, 1) if self.shape_class == "decode" else (1, m)              # [B, Tq] as the programs
                self.x = sds(rows + case.k_dims, dt)

                def one(x: jax.Array, wl: Any) -> jax.Array:
                    return llama.linear(x, wl, spec, kd if case.a8 else 0)
            if case.int8:
                xla_w = {"q": sds((L,) + case.k_dims + out, jnp.int8), "s": sds((L,) + out, jnp.float32)}
            else:
                xla_w = sds((L,) + case.k_dims + out, dt)

            def xla_fn(x, w):
                return jax.lax.scan(lambda c, wl: (c, one(x, wl)), 0, w)[1]

            def kernel_fn(x, w):
                if case.epilogue:
                    def fused(li: jax.Array) -> jax.Array:
                        return cpu_kernels.gemm_bias(x, w["p"], li, w["b"][li], case.epilogue == "bias_gelu")
                    return jax.lax.scan(lambda li, _: (li + 1, fused(li)), jnp.int32(0), None, length=L)[1]
                return jax.lax.scan(lambda li, _: (li + 1, cpu_kernels.linear(x, w, li, kd, out).astype(x.dtype)),
                                    jnp.int32(0), None, length=L)[1]
            pk_lead = (L,)
        kdt = (jnp.uint8 if case.a8 else jnp.int8) if case.int8 else (jnp.bfloat16 if dt == jnp.bfloat16 else jnp.float32)
        packed: Any = sds(cpu_kernels.packed_shape(pk_lead, case.k, n, kdt), kdt)
        if case.int8:
            packed = {"q": packed, "s": sds(pk_lead + (P * cpu_kernels.PANEL,), jnp.float32)}
        if case.epilogue:                                  # the stacked bias beside each layout
            bias = sds((L, n), dt)
            xla_w, packed = {"w": xla_w, "b": bias}, {"p": packed, "b": bias}
        self.layers = L
        self.specs = {"xla": xla_w, "kernel": packed}
        self.fns = {"xla": jax.jit(xla_fn), "kernel": jax.jit(kernel_fn)}
        if case.blas and self.shape_class == "prefill" and case.weight != "lm_head" and m >= case.blas_min_rows:
            def blas_fn(x, w):
                if case.epilogue:            # an encoder matrix, finished in the same call (models/bert.py)
                    def fused(li: jax.Array) -> jax.Array:
                        return cpu_kernels.blas_gemm_bias(x, w["w"], li, w["b"][li], case.epilogue == "bias_gelu")
                    return jax.lax.scan(lambda li, _: (li + 1, fused(li)), jnp.int32(0), None, length=L)[1]
                return jax.lax.scan(lambda li, _: (li + 1, cpu_kernels.blas_linear(x, w, li, kd).astype(x.dtype)),
                                    jnp.int32(0), None, length=L)[1]
            self.specs["blas"], self.fns["blas"] = xla_w, jax.jit(blas_fn)
        self.paths = tuple(self.fns)
        self._exe: dict[str, Any] = {}
        self._args: dict[str, tuple] = {}

    def compile(self, path: str) -> None:
        if path not in self._exe:
            self._exe[path] = self.fns[path].lower(self.x, self.specs[path]).compile()

    def runner(self, path: str) -> Callable[[], None]:
        """A function running `path` once (compiling and filling operands on first use)."""
        def run() -> None:
            self.compile(path)
            if path not in self._args:
                fill = lambda s: jnp.full(s.shape, 1 if s.dtype in (jnp.int8, jnp.uint8) else 0.01, s.dtype)  # noqa: E731
                self._args[path] = (fill(self.x), jax.tree.map(fill, self.specs[path]))
            jax.block_until_ready(self._exe[path](*self._args[path]))
        return run

    def release(self) -> None:
        self._args.clear()


class _AttentionPoint:
    """An encoder's self-attention at m tokens, both paths: XLA's (models/bert.py's
    xla_attention) and the C++ kernel (cpu.encoder_attention), on one layer's [b, s, 3 H D]
    projection with every token real. s = min(m, ATTENTION_SEQ), b = m // s: what a batch of
    short sentences runs (MiniLM's corpus: 11-63 tokens)."""

    def __init__(self, case: Case, m: int):
        heads, d = case.k_dims
        s = min(m, ATTENTION_SEQ)
        b = max(1, m // s)
        dt = jnp.dtype(case.dtype)
        self.case, self.m, self.shape_class, self.layers = case, m, "prefill", 1
        self.slice = f"{b} x {s} tokens, {heads} heads of {d} {dt.name}"
        self.x = jax.ShapeDtypeStruct((b, s, 3 * heads * d), dt)
        self.mask = jax.ShapeDtypeStruct((b, s), jnp.int32)
        scale = 1.0 / math.sqrt(d)
        self.fns = {"xla": jax.jit(lambda qkv, mask: bert.xla_attention(qkv, bert.attention_bias(mask), heads)),
                    "kernel": jax.jit(lambda qkv, mask: cpu_kernels.encoder_attention(qkv, mask, heads, scale))}
        self.paths = tuple(self.fns)
        self._exe: dict[str, Any] = {}
        self._args: Optional[tuple[jax.Array, jax.Array]] = None

    def compile(self, path: str) -> None:
        if path not in self._exe:
            self._exe[path] = self.fns[path].lower(self.x, self.mask).compile()

    def runner(self, path: str) -> Callable[[], None]:
        def run() -> None:
            self.compile(path)
            if self._args is None:
                k = jax.random.PRNGKey(0)
                self._args = (jax.random.normal(k, self.x.shape, self.x.dtype), jnp.ones(self.mask.shape, jnp.int32))
            jax.block_until_ready(self._exe[path](*self._args))
        return run

    def release(self) -> None:
        self._args = None


def _point(case: Case, m: int, decode_rows: int) -> "_Point | _AttentionPoint":
    return _AttentionPoint(case, m) if case.weight == ATTENTION else _Point(case, m, decode_rows)


Timer = Callable[[Case, int, dict[str, Callable[[], None]]], dict[str, float]]


def wall_timer(case: Case, m: int, runs: dict[str, Callable[[], None]]) -> dict[str, float]:
    """Median seconds per call of each path: one warm call each, then up to SAMPLES alternating
    samples of back-to-back calls lasting >= MIN_SAMPLE_S. Stops after two rounds when every
    sample of every other path is over twice every sample of the fastest (bfloat16 XLA dots can be 40x
    slower than the kernel: no need to time them five times)."""
    reps = {}
    for p, run in runs.items():
        t0 = time.perf_counter()
        run()
        reps[p] = max(1, min(100, math.ceil(MIN_SAMPLE_S / max(time.perf_counter() - t0, 1e-7))))
    samples: dict[str, list[float]] = {p: [] for p in runs}
    for i in range(SAMPLES):
        order = list(runs) if i % 2 == 0 else list(runs)[::-1]
        for p in order:
            t0 = time.perf_counter()
            for _ in range(reps[p]):
                runs[p]()
            samples[p].append((time.perf_counter() - t0) / reps[p])
        fast = min(samples.values(), key=statistics.median)
        if i >= 1 and all(min(s) > 2 * max(fast) for s in samples.values() if s is not fast):
            break
    return {p: statistics.median(s) for p, s in samples.items()}


wall_timer.precompile = True         # type: ignore[attr-defined]  # real timings: compile all programs up front
default_timer: Timer = wall_timer    # what configure / choose use unless given a timer (tests replace it)


def decision_dir() -> str:
    """Where decisions are cached: next to the kernel build."""
    return cpu_kernels.cache_dir()


# --------------------------------------------------------------------------- the rule
def _route(case: Case, times: dict[int, dict[str, float]], decode_rows: int) -> tuple[tuple[int, str], ...]:
    """Routes of one matrix from its timed points (rules 1-3 of the module docstring). In a
    decoder the library sgemm must beat the other paths by more than MARGIN: timed alone, it does
    not show what it costs whole decoder steps (LIBRARY_IN_AUTO). An encoder's is priced as
    timed: whole programs followed its timing (ENCODER_LIBRARY_IN_AUTO)."""
    pts = sorted(times)
    blas_margin = 0.0 if case.flat else MARGIN

    def best(m: int, allowed: set[str]) -> str:
        cand = [p for p in PATHS if p in times[m] and p in allowed]
        return min(cand, key=lambda p: times[m][p] * (1 + blas_margin if p == "blas" else 1))

    def decide(allowed: set[str]) -> dict[int, str]:
        win = {m: best(m, allowed) for m in pts}
        dec = [m for m in pts if m <= decode_rows]
        both = [p for p in PATHS if p in allowed and all(p in times[m] for m in dec)]
        if len({win[m] for m in dec}) > 1 and both:      # rule 2: one path for the decode class
            one = min(both, key=lambda p: sum(times[m][p] for m in dec))
            win.update({m: one for m in dec})
        return win

    every = set(PATHS)
    win = decide(every)
    lays = {LAYOUT[win[m]] for m in pts}
    if len(lays) == 2:                                   # rule 3: does each layout pay for itself?
        def margin(lay: str) -> float:
            return max((min(t for p, t in times[m].items() if LAYOUT[p] != lay) / times[m][win[m]] - 1
                        for m in pts if LAYOUT[win[m]] == lay), default=-1.0)
        weak = [lay for lay in ("kernel", "xla") if margin(lay) <= MARGIN]
        if weak:
            drop = weak[0]                               # both weak: drop the panels (XLA's layout stays)
            win = decide({p for p in PATHS if LAYOUT[p] != drop})
    routes: list[tuple[int, str]] = []
    for a, b in zip(pts, pts[1:]):
        if win[a] != win[b]:
            bound = decode_rows if a <= decode_rows < b else 2 ** round(math.log2(math.sqrt(a * b)))
            routes.append((max(a, min(bound, b - 1)), win[a]))
    routes.append((UNBOUNDED, win[pts[-1]]))
    return tuple(routes)


def _isolated(pts: list[Any], times: dict[int, dict[str, float]]) -> list[Any]:
    """The points whose fastest path differs from the one both neighbours agree on (row counts in
    order): what one noisy point looks like, and what `choose` times a second time. Why: on a
    2-vCPU Zen 3 whose neighbours on the host come and go, two of three cold starts of the default
    models routed one MiniLM matrix (qkv; the attention output) to XLA's dot at 33-128 rows from
    its 64-row point alone (0.72 against 1.02 ms; every other start timed the kernel 15-40 %
    faster there), and 40-token programs ran 11.4-12.1 ms against 8.9-9.8 with the kernel. A
    second timing keeps each path's lower median (interference only adds time); a real change of
    path at that size shows in both."""
    win = {pt.m: min(times[pt.m], key=times[pt.m].__getitem__) for pt in pts}
    return [pts[i] for i in range(1, len(pts) - 1)
            if win[pts[i - 1].m] == win[pts[i + 1].m] != win[pts[i].m]]


def _log_plan(plan: MatmulPlan, cases_: list[Case]) -> None:
    by = {c.weight: c for c in cases_}
    for w, rs in plan.routes:
        c = by[w]
        pts = "; ".join(f"{t.shape_class} M={t.m}: " + ", ".join(f"{p} {v * 1e3:.3f} ms" for p, v in t.seconds().items())
                        + f" ({t.slice})" for t in plan.timings if t.weight == w)
        route = ", ".join(f"{p} for M<={m}" if m != UNBOUNDED else (f"{p} beyond" if len(rs) > 1 else p) for m, p in rs)
        extra = ""
        if len(plan.layouts(w)) == 2 and not (w == "lm_head" and c.tied) and w != ATTENTION:
            extra = f"; both layouts kept: +{c.layers * c.k * c.n * c.itemsize / 2 ** 20:.0f} MiB"
        log.info("cpu matmul %s [%s -> %s] %s (%s): %s%s", w, c.k, c.n, ("w8a8" if c.a8 else "int8") if c.int8 else c.dtype,
                 plan.source, route, f" | {pts}{extra}" if pts else extra)


def choose(cases_: list[Case], decode_rows: int, *, timer: Optional[Timer] = None,
           cache: Optional[str] = None) -> MatmulPlan:
    """Measure (or read the cached decision for) every case; see the module docstring."""
    key = {"host": host_key(), "decode_rows": decode_rows, "cases": [dataclasses.asdict(c) for c in cases_]}
    key = json.loads(json.dumps(key, sort_keys=True))    # as it reads back from the file (tuples -> lists)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(cache or decision_dir(), f"matmul-{digest}.json")
    try:
        with open(path) as f:
            doc = json.load(f)
        if doc.get("key") == key:
            plan = MatmulPlan.from_json(doc["plan"], source="cached")
            _log_plan(plan, cases_)
            return plan
    except (OSError, ValueError, KeyError, TypeError):
        pass
    t0 = time.time()
    points = [_point(c, m, decode_rows) for c in cases_ for m in c.points]
    timer = timer or default_timer
    if getattr(timer, "precompile", False):              # compile everything first, a few at a time
        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
            list(pool.map(lambda a: a[0].compile(a[1]), [(pt, p) for pt in points for p in pt.paths]))
    t_compiled = time.time()
    timings, routes = [], []
    for c in cases_:
        times: dict[int, dict[str, float]] = {}
        mine = sorted((p for p in points if p.case is c), key=lambda p: p.m)
        for pt in mine:
            got = timer(c, pt.m, {p: pt.runner(p) for p in pt.paths})
            pt.release()                                 # operands refill on a second timing
            times[pt.m] = {p: got[p] / pt.layers for p in pt.paths}
        for pt in _isolated(mine, times):                # once more, each path's lower figure kept
            got = timer(c, pt.m, {p: pt.runner(p) for p in pt.paths})
            pt.release()
            times[pt.m] = {p: min(times[pt.m][p], got[p] / pt.layers) for p in pt.paths}
        for pt in mine:
            timings.append(Timing(c.weight, pt.m, pt.shape_class, times[pt.m]["xla"], times[pt.m]["kernel"], pt.slice,
                                  blas_s=times[pt.m].get("blas")))
        routes.append((c.weight, _route(c, times, decode_rows)))
    plan = MatmulPlan(routes=tuple(routes), decode_rows=decode_rows, timings=tuple(timings))
    log.info("cpu matmul: timed %d row counts x 2-3 paths in %.1fs (compiling %.1fs); cached as %s", len(points),
             time.time() - t0, t_compiled - t0, path)
    _log_plan(plan, cases_)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "plan": plan.to_json()}, f, indent=1)
        os.replace(tmp, path)                            # atomic: concurrent starts never read half a file
    except OSError as e:
        log.warning("cpu matmul: could not cache the decision in %s: %s", path, e)
    return plan


# --------------------------------------------------------------------------- encoders
ENCODER_POINTS = (16, 64, 256, 1024)    # rows (batch x sequence) an encoder's matrices are timed at
# Encoders time the library sgemm too (float32, at ENCODER_LIBRARY_ROWS rows and up: below that a
# program is a few sentences and the panel kernel's lead there is wide). Unlike the decoders' case
# (LIBRARY_IN_AUTO), whole programs follow the per-matrix timing since the sgemm runs one
# single-threaded call per thread of ours (cpu.cc: blas_run) and finishes bias and GELU in the
# same call: all-MiniLM-L6-v2 packed programs on a 2-vCPU Zen 3 (AVX2, 512 KiB L2), ms p50 of 15
# alternating calls, kernel up to 128 rows and XLA / kernel above as that host's plan had it ->
# the library above 128 rows: 256 tokens 47.7 -> 41.7, 1,024 198.5 -> 172.2, 2,048 419.7 ->
# 353.2; the corpus at batch 32 128 -> 145 sentences/s, batch 128 144 -> 163 (medians of 4
# alternating rounds, same process). Standalone on that host numpy's OpenBLAS ran these shapes
# at 157-165 GFLOP/s, XLA's dot and the panel kernel at 100-136.
ENCODER_LIBRARY_IN_AUTO = True
ENCODER_LIBRARY_ROWS = 256
ATTENTION = bert.ATTENTION              # the encoder self-attention's route name in a plan
ATTENTION_SEQ = 64                      # sequence length of a timed attention point (b = rows / 64)


def encoder_cases(matrices: dict[str, tuple[int, int]], layers: int, dtype: Any, max_rows: int,
                  attention: Optional[tuple[int, int]] = None, gelu: Optional[str] = None,
                  library: bool = False) -> list[Case]:
    """An encoder's layer matrices ({name: (K, N)}, stacked over `layers`) and the row counts each
    is timed at: ENCODER_POINTS up to the largest program (`max_rows`), which span the bucket
    programs from one short sentence (16 rows) to the batches (2,048 on CPU). With `attention`
    (heads, head_dim) the self-attention is a case too (_AttentionPoint), at the same token counts.

    Float32 matrices are timed with their bias, and `gelu` (the matrix the program finishes with
    the exact GELU) with it too, on both paths as the program runs them: the kernel in its pass
    over each output tile (cpu.gemm_bias), XLA as its own fusions after the dot. Timed bare, the
    two paths came within the noise at 256-1024 rows and the plan flipped between starts on one
    host (2-vCPU Zen 3, all-MiniLM-L6-v2): one start put every matrix on XLA's dot, 140-147
    sentences/s at batch 32, where `--cpu-matmul kernel` ran 134-177 (median 171 of 8 runs;
    runs minutes apart). With
    the epilogue timed, that host's plans keep XLA's dot only for qkv and FFN out at ~1,000 rows;
    whole programs with such a plan against the kernel alone, alternating: 148-166 vs 159-175 (so
    per-matrix timing can still leave ~5 % there).

    With `library` (float32 only), the library sgemm is timed as well at ENCODER_LIBRARY_ROWS rows and
    more, with the same epilogue (ENCODER_LIBRARY_IN_AUTO: why)."""
    pts = tuple(m for m in ENCODER_POINTS if m <= max_rows) or (max(1, max_rows),)
    name = jnp.dtype(dtype).name
    blas = (library and name == "float32" and any(m >= ENCODER_LIBRARY_ROWS for m in pts)
            and cpu_kernels.blas_available())
    def epi(w: str) -> Epilogue:
        return "" if name != "float32" else "bias_gelu" if w == gelu else "bias"
    out = [Case(w, (k,), (n,), layers, name, int8=False, points=pts, flat=True, epilogue=epi(w), blas=blas,
                blas_min_rows=ENCODER_LIBRARY_ROWS if blas else 0)
           for w, (k, n) in matrices.items()]
    if attention is not None:
        heads, d = attention
        out.append(Case(ATTENTION, (heads, d), (heads * d,), layers, name, int8=False, points=pts, flat=True))
    return out


def configure_encoder(choice: str, plat: str, dtype: Any, tp: int, matrices: dict[str, tuple[int, int]],
                      layers: int, max_rows: int, timer: Optional[Timer] = None,
                      attention: Optional[tuple[int, int]] = None, gelu: Optional[str] = None) -> Optional[MatmulPlan]:
    """--cpu-matmul for an encoder's layer matrices and, with `attention` ((heads, head_dim),
    where the kernel takes that head size), its self-attention: "kernel" routes every one to the
    C++ kernels (an error where they cannot run, as for decoders); "auto" times XLA's path
    against the kernel per matrix (and the attention) at ENCODER_POINTS tokens where the kernel
    can run (CPU, tp 1) and keeps the faster by the decoder's rule (`_route`); "xla" and "blas"
    keep XLA's (None).

    Why time: at batch 1 the kernel wins and XLA's dot loses twice, on the small-M product and
    on the copy `lax.scan` makes of each layer's weight slice (the kernel reads its packed
    panels whole, with the layer index). all-MiniLM-L6-v2 whole programs, float32, this host,
    XLA / kernel ms: 1 x 16 tokens 5.45 / 3.18, 1 x 48 8.36 / 6.34, 8 x 48 35.6 / 35.9, 32 x 48
    130 / 142, 8 x 256 400 / 428. So small programs want the kernel and large ones XLA's dot,
    and the crossover moves with the host. The attention, XLA / kernel ms per layer (a 2-vCPU
    Xeon with AMX): 32 x 48 tokens 4.1-4.5 / 1.3-1.5; timed points 1 x 16 0.098 / 0.020,
    16 x 64 6.9 / 1.6. Whole MiniLM programs with it (measured plan, before -> after): 1 x 16
    4.34 -> 3.81 ms, 1 x 48 7.28 -> 6.03, 32 x 48 155 -> 138. Cost: 5 cases x 4 token counts x 2
    paths, a few seconds on a cold start (cached with the kernel build, so nothing on a warm one)."""
    names = list(matrices) + ([ATTENTION] if attention is not None else [])
    if choice == "kernel":
        cpu_kernels.resolve(choice, plat, dtype, "none", tp)      # raises where the kernel cannot run
        return MatmulPlan(routes=tuple((w, ((UNBOUNDED, "kernel"),)) for w in names), source="forced")
    if choice != "auto" or cpu_kernels.resolve("auto", plat, dtype, "none", tp) != "kernel":
        return None
    return choose(encoder_cases(matrices, layers, dtype, max_rows, attention, gelu, library=ENCODER_LIBRARY_IN_AUTO),
                  0, timer=timer)


def configure(choice: str, cfg: Any, plat: str, dtype: Any, quantize: str, tp: int, *, decode_rows: int,
              prefill_tokens: int, timer: Optional[Timer] = None) -> Any:
    """cfg with matmul / matmul_plan set from --cpu-matmul: "xla" and "kernel" force a path (no
    timing; "kernel" where it cannot run is an error, cpu.resolve); "auto" measures on CPU with
    tp 1 (where the kernel builds) and is XLA's dot elsewhere."""
    if getattr(cfg, "num_experts", 0):     # MoE: the experts are grouped XLA matmuls (models/moe.py)
        if choice == "kernel":
            raise InvalidRequest("--cpu-matmul kernel: mixture-of-experts models run their matmuls on XLA; use auto or xla")
        return dataclasses.replace(cfg, matmul="xla", matmul_plan=None)
    path = cpu_kernels.resolve(choice, plat, dtype, quantize, tp)
    if choice != "auto" or path == "xla":
        return dataclasses.replace(cfg, matmul=path, matmul_plan=None)
    plan = choose(cases(cfg, dtype, quantize, decode_rows, prefill_tokens, library=LIBRARY_IN_AUTO), decode_rows,
                  timer=timer)
    return dataclasses.replace(cfg, matmul=plan.mode, matmul_plan=plan)     # the plan also when uniform: stats
