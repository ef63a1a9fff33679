"""The C++ CPU kernels (jax_engine/kernels/cpu.cc) against NumPy and the reference attention.

The served decoder on CPU uses them (--cpu-matmul auto where they measure faster, or kernel;
--attention-backend auto), and tests/engine/test_decoder.py's transformers parity runs through them too; here each kernel is
pinned down on awkward shapes: ragged output columns, odd K, stacked layers, rows of different lengths,
shuffled pages, GQA, sliding windows, a padding row, a head size that is not a multiple of 16.
"""
from __future__ import annotations

import os
import platform
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_engine.attention.cpu import CpuKernel
from jax_engine.attention.reference import Reference
from jax_engine.errors import InvalidRequest
from jax_engine.kernels import cpu as K
from jax_engine.models.llama import StepInputs


def test_kernels_build_on_this_machine():
    # CI runs on a machine like this one (gcc present): the fast path must not silently vanish
    assert K.available(), K.reason()
    lib = K._build()
    mtime = os.path.getmtime(lib)
    assert K._build() == lib and os.path.getmtime(lib) == mtime      # cached, not rebuilt
    # -march=native: the w8a8 GEMM runs on AVX512-VNNI exactly where the CPU has it
    assert K.vnni_active() == ("avx512_vnni" in K._cpu_flags().split())


@pytest.mark.parametrize("march", ["x86-64", "haswell", "skylake-avx512", "sapphirerapids"])
def test_kernel_source_compiles_for_every_x86_level(march):
    # the kernel is built with -march=native on whatever host serves: every intrinsic path needs
    # its fallback (an AVX2-only Zen 3 once failed here on the encoder attention's AVX-512
    # transposition and served int8 at 13 tok/s through XLA's dot instead of ~200)
    cxx = K._compiler()
    if cxx is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs an x86 C++ compiler")
    cmd = [cxx, "-fsyntax-only", f"-march={march}", "-std=c++17", "-w", f"-I{jax.ffi.include_dir()}", K._SOURCE]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


def test_l1d_size_from_sysfs_keys_the_build(tmp_path):
    # the float kernel's K chunk follows the L1 data cache (cpu.cc kKcF32): sysfs's L1d entry is
    # read (not the L1i or L2 beside it), and the size reaches the build flags, so the build key
    # (and the cached matmul choice keyed by it) differs between a 32 KiB and a 48 KiB host
    for idx, (level, kind, size) in enumerate([("1", "Instruction", "64K"), ("1", "Data", "48K"), ("2", "Unified", "2048K")]):
        d = tmp_path / f"index{idx}"
        d.mkdir()
        (d / "level").write_text(level + "\n")
        (d / "type").write_text(kind + "\n")
        (d / "size").write_text(size + "\n")
    assert K._l1d_bytes(str(tmp_path)) == 48 << 10
    assert K._l1d_bytes(str(tmp_path / "missing")) > 0
    assert f"-DXLASERVE_L1D_BYTES={K._l1d_bytes()}" in K._FLAGS


@pytest.mark.parametrize("M,K_,N,L", [(1, 64, 64, 1), (5, 3, 100, 2), (16, 300, 1287, 3), (33, 96, 64 * 3 + 1, 1),
                                      (7, 1, 5, 1), (400, 20, 130, 2),       # M > 384: row chunks
                                      (160, 2048, 70, 1),    # K 2048: the row cap is 72 (float_row_cap)
                                      (1, 300, 200, 2),      # one row over several K chunks (AVX2: micro1_avx2)
                                      (13, 200, 70, 1)])     # a last block of one row with a prefetch stream
def test_gemm_matches_numpy(M, K_, N, L):
    rng = np.random.default_rng(M * 1000 + N)
    w = rng.standard_normal((L, K_, N), dtype=np.float32)
    x = rng.standard_normal((M, K_), dtype=np.float32)
    packed = K.pack(jnp.asarray(w), 1, stacked=True)
    assert packed.shape == (L, K.num_panels(N), K_, K.PANEL)
    f = jax.jit(lambda x, w, li: K.gemm(x, w, li, N))
    for li in range(L):
        got = np.asarray(f(jnp.asarray(x), packed, li))
        want = x.astype(np.float64) @ w[li].astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.sqrt(K_))
        np.testing.assert_allclose(K.reference_gemm(x, np.asarray(packed), li, N), want, rtol=1e-6, atol=1e-5)


def test_gemm_from_concurrent_programs_matches_numpy():
    """Small calls share one set of kernel helper threads (cpu.cc, Helpers): a call made while
    another program's call holds them falls back to XLA's pool. Four threads running decode-sized
    GEMMs at once must all get the exact products, and none may hang."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(7)
    w = rng.standard_normal((1, 256, 1000), dtype=np.float32)
    packed = K.pack(jnp.asarray(w), 1, stacked=True)
    f = jax.jit(lambda x, w: K.gemm(x, w, 0, 1000))
    xs = [rng.standard_normal((m, 256), dtype=np.float32) for m in (1, 8, 33, 64)]
    wants = [x.astype(np.float64) @ w[0].astype(np.float64) for x in xs]

    def run(i: int) -> None:
        for _ in range(50):
            got = np.asarray(f(jnp.asarray(xs[i]), packed))
            np.testing.assert_allclose(got, wants[i], rtol=1e-5, atol=1e-4 * 16)

    with ThreadPoolExecutor(4) as pool:
        for fut in [pool.submit(run, i) for i in range(4)]:
            fut.result(timeout=300)


def test_gemm_live_rows_compute_the_real_tokens_and_zero_the_padding():
    """`rows` (a ragged step's real tokens): the first rows equal the full product, the padding
    rows come out zero whatever x holds there (NaN included), for the three weight layouts and
    int8 under bfloat16 activations (its own kernel)."""
    from jax_engine.models.llama_weights import quantize_int8

    rng = np.random.default_rng(21)
    L, K_, N, M = 2, 96, 130, 20
    w = rng.standard_normal((L, K_, N), dtype=np.float32)
    q, s = (np.stack(a) for a in zip(*(quantize_int8(w[i], (0,)) for i in range(L))))
    layouts = {"float32": (K.pack(jnp.asarray(w), 1, stacked=True), jnp.float32),
               "int8": (K.pack({"q": jnp.asarray(q), "s": jnp.asarray(s)}, 1, stacked=True), jnp.float32),
               "bfloat16": (K.pack(jnp.asarray(w).astype(jnp.bfloat16), 1, stacked=True), jnp.bfloat16),
               "int8, bfloat16 x": (K.pack({"q": jnp.asarray(q), "s": jnp.asarray(s)}, 1, stacked=True),
                                    jnp.bfloat16)}
    x = rng.standard_normal((M, K_), dtype=np.float32)
    for name, (packed, dt) in layouts.items():
        f = jax.jit(lambda x, w, r: K.gemm(x, w, 1, N, r))
        full = np.asarray(jax.jit(lambda x, w: K.gemm(x, w, 1, N))(jnp.asarray(x, dt), packed))
        for live in (0, 1, 7, 19, M, M + 5):
            xp = x.copy()
            xp[min(live, M):] = np.nan
            got = np.asarray(f(jnp.asarray(xp, dt), packed, jnp.int32(live)))
            r = min(live, M)
            np.testing.assert_array_equal(got[:r], full[:r], err_msg=name)
            assert (got[r:] == 0).all(), (name, live)


@pytest.mark.parametrize("M,K_,N", [(1, 64, 128), (37, 96, 204), (300, 384, 1536)])
def test_gemm_bias_gelu_matches_the_exact_gelu(M, K_, N):
    """The fused projections: x @ w[layer] + bias, and gelu of it with the erf GELU, as float64
    math computes them (N 204: a ragged last panel of 12 columns, 8 by vectors on AVX2-only builds
    and the rest by the scalar path);
    float32 panels only."""
    import math

    rng = np.random.default_rng(5)
    w = (rng.standard_normal((2, K_, N)) * 0.1).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    x = rng.standard_normal((M, K_)).astype(np.float32)
    packed = K.pack(jnp.asarray(w), 1, True)
    f = jax.jit(lambda x, p, b: (K.gemm_bias(x, p, 1, b), K.gemm_bias(x, p, 1, b, gelu=True)))
    plain, got = (np.asarray(a) for a in f(x, packed, b))
    pre = x.astype(np.float64) @ w[1].astype(np.float64) + b
    want = 0.5 * pre * (1 + np.vectorize(math.erf)(pre / math.sqrt(2)))
    np.testing.assert_allclose(plain, pre, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert np.abs(want).max() > 3           # the erf is exercised past its linear range
    with pytest.raises(ValueError, match="float32 panels"):
        K.gemm_bias(x, K.pack(jnp.asarray(w, jnp.bfloat16), 1, True), 1, b, gelu=True)
    # `rows` (packed encoder inputs: the bucket's padding tokens after them): the first rows as
    # above, bit for bit, the rest zeros without bias or GELU, whatever x holds there
    live = M // 2
    xp = x.copy()
    xp[live:] = np.nan
    g = jax.jit(lambda x, p, b, r: K.gemm_bias(x, p, 1, b, True, r))
    part = np.asarray(g(xp, packed, b, jnp.int32(live)))
    np.testing.assert_array_equal(part[:live], got[:live])
    assert (part[live:] == 0).all()


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_glu_rounds_as_torch_does_on_bfloat16(act):
    """A bfloat16 model's act(gate) * up from the float32 gate_up projection (cpu.cc GluBF16Impl)
    against torch on bfloat16 tensors (the projection's output rounded to bfloat16, then F.silu /
    the tanh GELU, then the product): equal bits but where the two exps round differently (at
    most one bfloat16 step, rarely; silu matched all 32,768 of a wider sample). I 200: 12
    vectors and an 8-column scalar tail; rows past `rows` are zeros; bad operands are refused."""
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(3)
    M, inter, live = 5, 200, 3
    gu = (rng.standard_normal((M, 2, inter)) * 4).astype(np.float32)
    gu[0, 0, :4] = [0.0, -0.0, 30.0, -30.0]                   # exact zeros and saturated tails
    got = jax.jit(lambda g, r: K.glu(g, act, r))(jnp.asarray(gu), jnp.int32(live))
    assert got.dtype == jnp.bfloat16 and got.shape == (M, inter)
    got = np.asarray(got.astype(jnp.float32))
    t = torch.from_numpy(gu).to(torch.bfloat16)
    fn = F.silu if act == "silu" else (lambda v: F.gelu(v, approximate="tanh"))
    want = (fn(t[:, 0]) * t[:, 1]).float().numpy()
    assert np.all(got[live:] == 0)
    big = np.abs(want[:live]) > 1e-3
    diff = got[:live][big] != want[:live][big]
    assert diff.mean() < 0.01, f"{diff.sum()} of {diff.size} differ"
    # the tanh GELU's far negative tail: torch's 0.5 g (1 + tanh z) cancels to ~0 where the
    # kernel's equal form g / (1 + e^(-2 z)) keeps the tiny value (|y| < 1e-5 there)
    np.testing.assert_allclose(got[:live], want[:live], rtol=2 ** -7, atol=1e-30 if act == "silu" else 2e-5)
    # the activation was applied: not the bare product of the rounded operands
    bare = (t[:live, 0].float() * t[:live, 1].float()).numpy()
    assert not np.allclose(got[:live], bare, rtol=0.05)
    with pytest.raises(ValueError, match="act in"):
        K.glu(jnp.asarray(gu), "relu")
    with pytest.raises(ValueError, match=r"\[\.\.\., 2, I\]"):
        K.glu(jnp.zeros((M, 3, inter), jnp.float32), act)


@pytest.mark.parametrize("K_", [96, 300])      # 300: several K chunks (kKc 128) accumulate into one row
def test_int8_gemm_matches_numpy(K_):
    from jax_engine.models.llama_weights import quantize_int8

    rng = np.random.default_rng(11)
    L = 2
    # N = 520 (9 panels): every work item takes all M rows, so 16 and 40 rows run 3 and 7 register
    # blocks in one call (with 4 panels the rows split into items of at most 12)
    for N, Ms in ((200, (1, 7, 16)), (520, (16, 40))):
        w = rng.standard_normal((L, K_, N), dtype=np.float32)
        q, s = zip(*(quantize_int8(w[i], (0,)) for i in range(L)))            # per-output-column scales [1, N]
        weight = {"q": jnp.asarray(np.stack(q)), "s": jnp.asarray(np.stack(s))}
        packed = K.pack(weight, 1, stacked=True)
        assert packed["q"].dtype == jnp.int8 and packed["s"].shape == (L, K.num_panels(N) * K.PANEL)
        for M in Ms:
            x = rng.standard_normal((M, K_), dtype=np.float32)
            for li in range(L):
                got = np.asarray(jax.jit(lambda x, w: K.gemm(x, w, li, N))(jnp.asarray(x), packed))
                want = x.astype(np.float64) @ (np.stack(q)[li].astype(np.float64) * np.stack(s)[li])
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
                np.testing.assert_allclose(K.reference_gemm(x, packed, li, N), want, rtol=1e-6, atol=1e-5)


def test_w8a8_gemm_quantizes_rows_and_sums_exactly():
    """--quantize w8a8's kernel (cpu.cc GemmI8A8Impl): x quantized per row to int8, multiplied by the
    int8 weights in int32 (exact), scaled by the row's and the column's scale. Against NumPy doing
    the same arithmetic (reference_gemm) and XLA's path (llama.linear with a8), which feed the same
    integers to exact sums, so the results agree to the last float32 multiply; and within the two
    quantizations' error of the float product. Shapes: K not a multiple of 4 (a zero-padded quad),
    K past one 64-quad pass with more than 6 rows and with one row, a ragged last panel, rows across
    register tiles, a zero row (scale 0: zeros), the live-row operand (padding rows zeros), every
    weight and input at +-127 (the largest pair sums of the AVX2 one-row loop's int16 products)."""
    from jax_engine.models.llama import linear
    from jax_engine.models.llama_weights import quantize_int8

    rng = np.random.default_rng(21)
    for L, K_, N, Ms in ((2, 96, 200, (1, 5, 7, 16)), (1, 301, 64, (1, 3, 13, 200)), (1, 260, 70, (1, 2))):
        w = rng.standard_normal((L, K_, N), dtype=np.float32)
        if K_ == 260:   # every weight and input at +-127 after quantizing: the largest int16 pair sums
            w = np.sign(w) + np.float32(0)
        q, s = (np.stack(a) for a in zip(*(quantize_int8(w[i], (0,)) for i in range(L))))
        packed = K.pack({"q": jnp.asarray(q), "s": jnp.asarray(s)}, 1, stacked=True, a8=True)
        assert packed["q"].dtype == jnp.uint8 and packed["q"].shape == K.packed_shape((L,), K_, N, jnp.uint8)
        # the layout: element [l, p, j, 4c + e] is w[l, 4j + e, 64p + c] + 128
        assert int(packed["q"][L - 1, 0, 2, 4 * 5 + 3]) == int(q[L - 1, 11, 5]) + 128
        for M in Ms:
            x = rng.standard_normal((M, K_), dtype=np.float32) * rng.uniform(0.1, 10, (M, 1)).astype(np.float32)
            if K_ == 260:
                x = np.sign(x) * np.float32(3)
            if M > 1:       # one row stays nonzero
                x[M // 2] = 0.0
            for li in range(L):
                got = np.asarray(jax.jit(lambda x, w: K.gemm(x, w, li, N))(jnp.asarray(x), packed))
                np.testing.assert_allclose(got, K.reference_gemm(x, packed, li, N), rtol=1e-6, atol=0)
                xla = np.asarray(jax.jit(lambda x, w: linear(x, w, "mk,kn->mn", 1))(
                    jnp.asarray(x), {"q": jnp.asarray(q[li]), "s": jnp.asarray(s[li])}))
                np.testing.assert_allclose(got, xla, rtol=1e-6, atol=0)
                assert M == 1 or not got[M // 2].any()
                want = x.astype(np.float64) @ (q[li].astype(np.float64) * s[li])
                scale = np.abs(x).max(1, keepdims=True) * np.abs(q[li] * s[li]).sum(0) / 127
                assert np.all(np.abs(got - want) <= 0.5 * scale + 1e-6)
        x = rng.standard_normal((9, K_), dtype=np.float32)
        live = np.asarray(jax.jit(lambda x, w: K.gemm(x, w, 0, N, rows=jnp.int32(4)))(jnp.asarray(x), packed))
        np.testing.assert_array_equal(live[:4], K.reference_gemm(x[:4], packed, 0, N))
        assert not live[4:].any()


def test_bfloat16_gemm_matches_numpy():
    """The pair kernel (bfloat16 x bfloat16, float32 accumulation) against float64 NumPy: exact
    products, so only the summation order differs. Odd K (a zero-padded pair), K past one 64-pair
    pass, and M past the 6-row register tile and past one 384-row chunk."""
    rng = np.random.default_rng(12)
    for L, K_, N, Ms in ((2, 80, 150, (1, 6, 9)), (1, 301, 64, (13, 400))):
        w = jnp.asarray(rng.standard_normal((L, K_, N), dtype=np.float32)).astype(jnp.bfloat16)
        packed = K.pack(w, 1, stacked=True)
        assert packed.dtype == jnp.bfloat16 and packed.shape == K.packed_shape((L,), K_, N, jnp.bfloat16)
        wf = np.asarray(w.astype(jnp.float32)).astype(np.float64)
        # the layout: element [l, p, j, 2c + e] is w[l, 2j + e, 64p + c]
        assert float(packed[L - 1, 0, 3, 2 * 5 + 1]) == wf[L - 1, 7, 5]
        for M in Ms:
            x = jnp.asarray(rng.standard_normal((M, K_), dtype=np.float32)).astype(jnp.bfloat16)
            xf = np.asarray(x.astype(jnp.float32)).astype(np.float64)
            for li in range(L):
                got = np.asarray(jax.jit(lambda x, w: K.gemm(x, w, li, N))(x, packed))
                want = xf @ wf[li]
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
                np.testing.assert_allclose(K.reference_gemm(xf, packed, li, N), want, rtol=1e-6, atol=1e-5)


def test_int8_gemm_under_bfloat16_activations_matches_numpy():
    """int8 weights of a bfloat16 model (the plain int8 panels, bfloat16 x, per-column scale;
    cpu.cc GemmI8BF16Impl): rows 2j and 2j + 1 widened into bfloat16 pairs, in registers up to 6
    rows (K even), through a per-chunk L1 buffer above 6 rows or for an odd K. Every int8 value is
    exact in bfloat16, so against float64 NumPy only the summation order differs. Shapes: odd K
    (the last pair's odd weight row past K, zero), several K passes (301 rows: three of 64 pairs),
    M on both sides of 6 and past one register tile."""
    rng = np.random.default_rng(13)
    for L, K_, N, Ms in ((2, 80, 150, (1, 6, 7, 9)), (1, 301, 64, (1, 5, 13, 400))):
        q = rng.integers(-127, 128, (L, K_, N), dtype=np.int8)
        s = (rng.random((L, N), dtype=np.float32) + 0.5) / 64
        packed = K.pack({"q": jnp.asarray(q), "s": jnp.asarray(s)}, 1, stacked=True)
        assert packed["q"].dtype == jnp.int8 and packed["q"].shape == K.packed_shape((L,), K_, N, jnp.int8)
        assert int(packed["q"][L - 1, 0, 7, 5]) == q[L - 1, 7, 5]
        for M in Ms:
            x = jnp.asarray(rng.standard_normal((M, K_), dtype=np.float32)).astype(jnp.bfloat16)
            xf = np.asarray(x.astype(jnp.float32)).astype(np.float64)
            for li in range(L):
                got = np.asarray(jax.jit(lambda x, w: K.gemm(x, w, li, N))(x, packed))
                want = xf @ (q[li].astype(np.float64) * s[li].astype(np.float64))
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
                np.testing.assert_allclose(K.reference_gemm(xf, packed, li, N), want, rtol=1e-6, atol=1e-5)
    # the in-register loop (<= 6 rows) and the buffered one add in the same order: a row's bits do
    # not depend on how many rows ride with it (7 and 9 rows: buffered, off AMX tiles, which start
    # at 16)
    q = rng.integers(-127, 128, (1, 768, 128), dtype=np.int8)
    packed = K.pack({"q": jnp.asarray(q), "s": jnp.asarray(np.full((1, 128), 0.01, np.float32))}, 1, stacked=True)
    x = jnp.asarray(rng.standard_normal((1, 768), dtype=np.float32)).astype(jnp.bfloat16)
    f = jax.jit(lambda x, w: K.gemm(x, w, 0, 128))
    one = np.asarray(f(x, packed))
    for M in (2, 7, 9):
        np.testing.assert_array_equal(np.asarray(f(jnp.tile(x, (M, 1)), packed)), np.tile(one, (M, 1)), err_msg=f"M={M}")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def test_amx_tiles_match_numpy():
    """bfloat16 and int8-in-bfloat16 GEMMs at M >= 16 with K a multiple of 32 run on AMX tiles
    where the CPU has them (cpu.cc: amx_panel; it must be on wherever the CPU and the build allow,
    unless XLASERVE_AMX=0), on the vdpbf16ps kernel elsewhere: the same float64-NumPy check
    either way. Shapes: whole 16-row tiles plus a ragged tail, several 32-deep K steps, a ragged
    last panel, layer 1 of 2."""
    wanted = {"amx_tile", "amx_bf16", "avx512_bf16"} <= _cpu_flags() and os.environ.get("XLASERVE_AMX", "1") != "0"
    assert K.amx_active() == wanted, f"AMX active {K.amx_active()}, CPU and environment allow it: {wanted}"
    rng = np.random.default_rng(14)
    L, K_, N = 2, 96, 150
    w = jnp.asarray(rng.standard_normal((L, K_, N), dtype=np.float32)).astype(jnp.bfloat16)
    q = rng.integers(-127, 128, (L, K_, N), dtype=np.int8)
    s = (rng.random((L, N), dtype=np.float32) + 0.5) / 64
    weights = {
        "bfloat16": (K.pack(w, 1, stacked=True), np.asarray(w.astype(jnp.float32)).astype(np.float64)),
        "int8": (K.pack({"q": jnp.asarray(q), "s": jnp.asarray(s)}, 1, stacked=True),
                 q.astype(np.float64) * s[:, None, :].astype(np.float64)),
    }
    for name, (packed, wf) in weights.items():
        for M in (16, 37, 200):
            x = jnp.asarray(rng.standard_normal((M, K_), dtype=np.float32)).astype(jnp.bfloat16)
            xf = np.asarray(x.astype(jnp.float32)).astype(np.float64)
            got = np.asarray(jax.jit(lambda x, w: K.gemm(x, w, 1, N))(x, packed))
            np.testing.assert_allclose(got, xf @ wf[1], rtol=1e-5, atol=1e-4, err_msg=f"{name} M={M}")


def test_linear_keeps_structured_shapes():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((2, 4, 3, 8, 24), dtype=np.float32)            # [L, KVH, G, D, H], 3 contraction dims
    x = rng.standard_normal((2, 5, 4, 3, 8), dtype=np.float32)             # [B, T, KVH, G, D]
    packed = K.pack(jnp.asarray(w), 3, stacked=True)
    got = np.asarray(jax.jit(lambda x, w: K.linear(x, w, 1, 3, (24,)))(jnp.asarray(x), packed))
    np.testing.assert_allclose(got, np.einsum("btkgd,kgdh->bth", x, w[1]), rtol=1e-5, atol=1e-4)
    head = rng.standard_normal((16, 70), dtype=np.float32)                 # unstacked [K, N]
    ph = K.pack(jnp.asarray(head), 1, stacked=False)
    got = np.asarray(K.linear(jnp.asarray(x[0, :, 0, 0, :]).repeat(2, -1), ph, 0, 1, (70,)))
    np.testing.assert_allclose(got, x[0, :, 0, 0, :].repeat(2, -1) @ head, rtol=1e-5, atol=1e-4)
    for k_dims, tail in ((3, (100,)), (2, (24,))):      # too many panels; wrong contraction size
        with pytest.raises(ValueError, match="does not fit"):
            K.linear(jnp.asarray(x), packed, 0, k_dims, tail)


def _attention_case(D: int, G: int, window: int, seed: int):
    """A ragged step on shuffled pages: decode rows at kv lengths 37 and 5, a 16-token prompt chunk,
    a 10-token chunk continuing 120 earlier keys, 3 padding tokens; returns the flat StepInputs
    (llama.StepInputs) both backends take, and which tokens are real."""
    rng = np.random.default_rng(seed)
    L, kvh, ps, num_pages, Pn = 2, 2, 8, 64, 17
    rows = [(36, 1), (4, 1), (0, 16), (120, 10)]            # (start position, query tokens)
    perm = rng.permutation(np.arange(1, num_pages))
    R, T = 6, sum(n for _, n in rows) + 3
    table = np.zeros((R, Pn), np.int32)
    tok_row, pos, cu, used = [], [], [0], 0
    for r, (start, n) in enumerate(rows):
        k = -(-(start + n) // ps)
        table[r, :k] = perm[used:used + k]
        used += k
        tok_row += [r] * n
        pos += list(range(start, start + n))
        cu.append(cu[-1] + n)
    real = np.array([True] * len(pos) + [False] * 3)
    pos = np.array(pos + [0] * 3, np.int32)
    limit = np.where(real, pos + 1, 0).astype(np.int32)
    kv_lens = np.array([s + n for s, n in rows] + [0] * (R - len(rows)), np.int32)
    kc = rng.standard_normal((L, num_pages * ps, kvh, D), dtype=np.float32)
    vc = rng.standard_normal((L, num_pages * ps, kvh, D), dtype=np.float32)
    q = rng.standard_normal((T, kvh, G, D), dtype=np.float32)
    cfg = type("Cfg", (), {"sliding_window": window or None, "head_dim": D, "num_kv_heads": kvh, "kv_repeat": 1})()
    i32 = lambda a: jnp.asarray(np.asarray(a, np.int32))      # noqa: E731
    inp = StepInputs(tokens=i32(np.zeros(T)), positions=i32(pos), slots=i32(np.zeros(T)),
                     rows=i32(tok_row + [0] * 3), kv_limit=i32(limit), page_table=i32(table), kv_lens=i32(kv_lens),
                     cu_q_lens=i32(cu + [cu[-1]] * (R - len(rows))), num_rows=i32([len(rows)]))
    return cfg, inp, ps, jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), real


@pytest.mark.parametrize("D,G,window", [(64, 3, 0), (24, 2, 0), (16, 1, 9), (80, 4, 1000), (48, 2, 0)])
def test_ragged_attention_matches_reference(D, G, window):
    """Decode tokens and prompt chunks of one ragged step through the C++ kernel equal the pure-JAX
    reference; padding tokens attend to nothing."""
    cfg, inp, ps, q, kc, vc, real = _attention_case(D, G, window, seed=D + G)
    ref, cpu = Reference(), CpuKernel()
    for li in (0, 1):
        want = np.asarray(ref.attend(q, kc, vc, jnp.int32(li), ref.prepare(cfg, inp, ps)))
        got = np.asarray(jax.jit(lambda q, kc, vc: cpu.attend(q, kc, vc, jnp.int32(li), cpu.prepare(cfg, inp, ps)))(q, kc, vc))
        np.testing.assert_allclose(got[real], want[real], rtol=1e-5, atol=2e-6)
        assert np.all(got[~real] == 0)


def _encoder_attention_reference(qkv: np.ndarray, mask: np.ndarray, heads: int) -> np.ndarray:
    b, s, w = qkv.shape
    d = w // (3 * heads)
    q, k, v = (a.reshape(b, s, heads, d).astype(np.float64) for a in np.split(qkv, 3, axis=-1))
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d) + np.where(mask[:, None, None, :] > 0, 0.0, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v).reshape(b, s, heads * d)


@pytest.mark.parametrize("B,S,H,D", [(3, 13, 2, 16), (2, 48, 12, 32), (4, 37, 3, 64), (2, 20, 2, 128)])
def test_encoder_attention_matches_numpy(B, S, H, D):
    """The encoder attention kernel: every real query against its row's real keys (right padding,
    a row with holes in its mask, a row of one token), float64 NumPy as the truth; padding
    queries are zeros; and the same numbers as models/bert.py's XLA path at real queries."""
    from jax_engine.models import bert

    rng = np.random.default_rng(B * S + D)
    qkv = rng.standard_normal((B, S, 3 * H * D)).astype(np.float32)
    lens = rng.integers(1, S + 1, B)
    lens[-1] = 1
    mask = (np.arange(S)[None, :] < lens[:, None]).astype(np.int32)
    if B > 2:
        mask[0] = 0
        mask[0, [1, 4, 7]] = 1                                 # not a prefix: the kernel reads the mask, not a length
    got = np.asarray(jax.jit(lambda a, m: K.encoder_attention(a, m, H, D ** -0.5))(qkv, mask))
    real = mask > 0
    np.testing.assert_allclose(got[real], _encoder_attention_reference(qkv, mask, H)[real], rtol=2e-5, atol=2e-6)
    assert not got[~real].any()
    xla = np.asarray(jax.jit(lambda a, m: bert.xla_attention(a, bert.attention_bias(m), H))(qkv, mask))
    np.testing.assert_allclose(got[real], xla[real], rtol=2e-5, atol=2e-6)
    assert K.encoder_attention_fits(D) and not K.encoder_attention_fits(24)


def test_encoder_attention_varlen_matches_padded():
    """Packed sequences (the varlen entry): each sequence attends within its own tokens, exactly
    as the same sequence alone in a padded batch; unused slots (lens 0) are skipped, tokens no
    sequence covers are zeros; a sequence outside the tokens is refused."""
    H, D, T = 3, 32, 48
    rng = np.random.default_rng(7)
    qkv = rng.standard_normal((T, 3 * H * D)).astype(np.float32)
    lens = np.array([5, 1, 17, 0, 9], np.int32)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32)
    f = jax.jit(lambda a, s, n: K.encoder_attention_varlen(a, s, n, H, D ** -0.5))
    got = np.asarray(f(qkv, starts, lens))
    for s0, n in zip(starts, lens):
        if n:
            one = _encoder_attention_reference(qkv[None, s0:s0 + n], np.ones((1, n), np.int32), H)[0]
            np.testing.assert_allclose(got[s0:s0 + n], one, rtol=2e-5, atol=2e-6)
    assert not got[int(lens.sum()):].any()
    with pytest.raises(Exception, match="outside the tokens"):
        jax.block_until_ready(f(qkv, np.array([40], np.int32), np.array([9], np.int32)))


def test_reference_attention_is_per_token_softmax():
    """The reference itself against numpy: each token attends its row's keys at positions below its
    position + 1 (inside the window), read through the page table."""
    cfg, inp, ps, q, kc, vc, real = _attention_case(16, 2, 9, seed=3)
    got = np.asarray(Reference().attend(q, kc, vc, jnp.int32(1), Reference().prepare(cfg, inp, ps)))
    table, rows, pos = np.asarray(inp.page_table), np.asarray(inp.rows), np.asarray(inp.positions)
    K, V, Q = np.asarray(kc)[1], np.asarray(vc)[1], np.asarray(q)
    for t in np.flatnonzero(real):
        keys = np.arange(max(0, pos[t] - 8), pos[t] + 1)            # window 9
        slots = table[rows[t], keys // ps] * ps + keys % ps
        s = np.einsum("kgd,skd->kgs", Q[t], K[slots]) / np.sqrt(16)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(got[t], np.einsum("kgs,skd->kgd", p, V[slots]), rtol=1e-5, atol=1e-6)


def test_resolve_rules():
    # resolve says where the kernel may run; with auto, choose.py then measures (test_cpu_matmul_choice.py)
    assert K.resolve("auto", "cpu", jnp.float32, "none", 1) == "kernel"
    assert K.resolve("auto", "cpu", jnp.float32, "int8", 1) == "kernel"
    assert K.resolve("auto", "cpu", jnp.float32, "w8a8", 1) == "kernel"
    assert K.resolve("auto", "cpu", jnp.bfloat16, "none", 1) == "kernel"
    assert K.resolve("xla", "cpu", jnp.float32, "none", 1) == "xla"
    for plat, dt, quant, tp in (("gpu", jnp.float32, "none", 1), ("cpu", jnp.float16, "none", 1),
                                ("cpu", jnp.float32, "int4", 1), ("cpu", jnp.float32, "none", 2)):
        assert K.resolve("auto", plat, dt, quant, tp) == "xla"
        with pytest.raises(InvalidRequest, match="--cpu-matmul kernel"):
            K.resolve("kernel", plat, dt, quant, tp)
    with pytest.raises(InvalidRequest):
        K.resolve("mkl", "cpu", jnp.float32, "none", 1)


def test_flag_reaches_the_model(tmp_path, monkeypatch, demo_generator_path):
    from frontends.cli import engine_args, parse_serve_args
    from jax_engine.config import EngineArgs
    from jax_engine.executor import backend
    from tests.helpers.engines import small_engine

    assert EngineArgs().cpu_matmul == "auto"
    assert engine_args(parse_serve_args(["--cpu-matmul", "xla", "--model", f"g={tmp_path}"])).cpu_matmul == "xla"
    with pytest.raises(SystemExit):
        parse_serve_args(["--cpu-matmul", "mkl"])
    from jax_engine.kernels import choose

    def timer(kernel_s):         # auto measures (choose.py): a deterministic fake timer stands in
        return lambda case, m, runs: {"xla": 1e-3, "kernel": kernel_s, **({"blas": 5e-3} if "blas" in runs else {})}

    for i, (choice, dtype, want, kernel_s) in enumerate((
            ("auto", "float32", "kernel", 0.5e-3), ("xla", "float32", "xla", None), ("auto", "bfloat16", "kernel", 0.5e-3),
            ("auto", "float32", "xla", 2e-3), ("kernel", "float32", "kernel", 2e-3), ("blas", "float32", "blas", None))):
        monkeypatch.setattr(choose, "default_timer", timer(kernel_s))
        monkeypatch.setattr(choose, "decision_dir", lambda i=i: str(tmp_path / f"decisions{i}"))
        with small_engine(demo_generator_path, dtype=dtype, cpu_matmul=choice) as engine:
            worker = engine.worker("m")
            runner = worker.replicas[0].runner
            assert worker.cfg.matmul == want
            qkv = runner.model().model.layers.self_attn.qkv_proj
            packed = qkv.panels is not None and qkv.weight is None
            assert packed == (want == "kernel")
            if packed:
                assert qkv.panels[...].ndim == 4 and qkv.panels[...].shape[-1] in (K.PANEL, 2 * K.PANEL)
            # XLA:CPU cannot update a bfloat16 cache in place in the layer scan: CPU keeps KV in float32
            c = runner.cfg
            assert runner.state["k"].dtype == jnp.float32
            assert runner.kv_bytes_per_page() == 2 * c.num_layers * 16 * c.num_kv_heads * c.head_dim * 4
            assert worker.cfg.attention_backend == "cpu"
    monkeypatch.setattr(backend, "platform", lambda: "gpu")      # a CPU kernel on a GPU: refused
    with pytest.raises(InvalidRequest, match="--cpu-matmul kernel"):
        with small_engine(demo_generator_path, dtype="float32", cpu_matmul="kernel"):
            pass


def test_bfloat16_int8_model_serves_through_the_pair_kernel(tmp_path):
    """A bfloat16 model with int8 weights end to end: the kernel's K-pair int8 panels serve it
    (decode rows and a multi-row prefill), greedy answers equal XLA's dot on the same weights
    (the kernel path with cpu.cc's gated activation, XLA's with its own), and nothing compiles
    after warmup."""
    import asyncio

    from jax_engine.config import EngineArgs, ModelSpec
    from jax_engine.decode.rows import SampleRow, SamplingRow, StepRow
    from jax_engine.engine import Engine
    from tests.helpers import hf_models
    from tests.helpers.engines import greedy_all

    path = str(tmp_path / "llama")
    hf_models.build("llama3", path)
    prompts = [list(range(3, 40)), [7, 8, 9], list(range(100, 130))]
    out = {}
    for path_kind in ("kernel", "xla"):
        eng = Engine(EngineArgs(models=[ModelSpec(name="m", path=path, dtype="bfloat16", quantize="int8")],
                                cpu_matmul=path_kind, max_running_requests=4, max_num_batched_tokens=64,
                                max_model_len=128, page_size=8))
        eng.load_all(progress=False, warmup=True)
        try:
            qkv = eng.worker("m").replicas[0].runner.model().model.layers.self_attn.qkv_proj
            panels = qkv.panels is not None and qkv.panels_scale is not None and qkv.panels[...].shape[-1] == K.PANEL
            assert panels == (path_kind == "kernel")
            assert (qkv.weight is not None and qkv.weight[...].dtype == jnp.int8) == (path_kind == "xla")
            out[path_kind] = asyncio.run(greedy_all(eng, prompts, 12, model="m"))
            assert eng.compilations_after_warmup() == 0
            # the gated MLP activation runs as the kernel beside the kernel's projections only
            runner = eng.worker("m").replicas[0].runner
            key, args = runner._step_args([StepRow([5], 3, [1], [SampleRow(0, SamplingRow())])])
            hlo = runner.programs.get("step", key, args).as_text()
            assert (K.GLU_TARGET in hlo) == (path_kind == "kernel")
        finally:
            eng.shutdown(timeout=2.0)
    assert out["kernel"] == out["xla"]
