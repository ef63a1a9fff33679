"""--cpu-matmul auto: the measured choice between XLA's dot and the packed-panel kernel
(jax_engine/kernels/choose.py).

Timings are injected (deterministic fake timers that never run the programs), so nothing here
depends on wall-clock speed: the tests pin down the rule (faster path wins, a second layout only
when each path wins by more than 10%), the decision cache (a second resolution times nothing),
forcing, and that a served model with a mixed plan (every combination of layouts) still matches
transformers with zero compilations after warmup.
"""
from __future__ import annotations

import asyncio
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_engine.errors import InvalidRequest
from jax_engine.kernels import choose as C
from jax_engine.kernels import cpu as K
from jax_engine.models import llama
from jax_engine.models.llama import LlamaConfig
from tests.helpers import hf_models

D, T = 4, 64          # decode rows (--max-running-requests) and prefill chunk (--max-num-batched-tokens)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, architectures=["LlamaForCausalLM"])


class FakeTimer:
    """Seconds per call from table(weight, m) -> (xla, kernel) or (xla, kernel, blas); the library
    sgemm, where it is timed (float32 prefill points), is 10x XLA unless the table says otherwise.
    Counts the points it was asked for."""

    def __init__(self, table):
        self.table, self.calls = table, []

    def __call__(self, case, m, runs):
        assert {"xla", "kernel"} <= set(runs) <= {"xla", "kernel", "blas"}
        assert ("blas" in runs) == (case.blas and m > D and m >= case.blas_min_rows), \
            "the library sgemm is timed at float32 prefill rows only"
        self.calls.append((case.weight, m))
        got = self.table(case.weight, m)
        out = {"xla": got[0], "kernel": got[1]}
        if "blas" in runs:
            out["blas"] = got[2] if len(got) > 2 else 10 * got[0]
        return out


@pytest.fixture
def decisions(tmp_path, monkeypatch):
    """An empty decision cache for this test (the kernel build itself stays where it is)."""
    assert K.available(), K.reason()
    monkeypatch.setattr(C, "decision_dir", lambda: str(tmp_path))
    return tmp_path


def _cases(dtype=jnp.float32, quantize="none", library=False, **kw):
    return C.cases(LlamaConfig.from_hf({**TINY, **kw}), dtype, quantize, D, T, library=library)


def test_cases_cover_every_matrix_and_class():
    cs = {c.weight: c for c in _cases()}
    assert set(cs) == set(llama.MATRICES)
    # decode rows 1 and D; prefill at a prompt-sized point between D and T (the power of two
    # nearest their geometric mean) and at T; the head: decode rows only
    assert cs["qkv"].points == (1, D, 16, T) and cs["lm_head"].points == (1, D)
    cfg = LlamaConfig.from_hf(TINY)
    assert C.cases(cfg, jnp.float32, "none", 16, 2048)[0].points == (1, 16, 256, 2048)
    assert C.cases(cfg, jnp.float32, "none", 32, 64)[0].points == (1, 32, 64)     # no room for a middle point
    assert cs["qkv"].k_dims == (64,) and cs["qkv"].out_dims == (2, 4, 16) and cs["o"].k_dims == (2, 2, 16)
    assert cs["down"].k == 128 and cs["gate_up"].n == 256 and cs["lm_head"].n == 512
    q = {c.weight: c for c in _cases(quantize="int8", tie_word_embeddings=True)}
    assert q["qkv"].int8 and q["qkv"].itemsize == 1 and not q["lm_head"].int8 and q["lm_head"].tied
    assert not q["qkv"].a8
    a8 = {c.weight: c for c in _cases(quantize="w8a8")}
    assert all(c.int8 and c.a8 and c.itemsize == 1 for c in a8.values())
    a8t = {c.weight: c for c in _cases(quantize="w8a8", tie_word_embeddings=True)}
    assert a8t["qkv"].a8 and not (a8t["lm_head"].int8 or a8t["lm_head"].a8)     # a tied head stays float


@pytest.mark.parametrize("slow", ["kernel", "xla"])
def test_the_faster_path_wins_everywhere(decisions, slow):
    timer = FakeTimer(lambda w, m: (3e-3, 1e-3) if slow == "xla" else (1e-3, 3e-3))
    plan = C.choose(_cases(), D, timer=timer)
    fast = "kernel" if slow == "xla" else "xla"
    assert plan.mode == fast and plan.source == "measured"
    assert all(rs == ((C.UNBOUNDED, fast),) for _, rs in plan.routes)
    assert sorted(timer.calls) == sorted((c.weight, m) for c in _cases() for m in c.points)
    assert {r["shape_class"] for r in plan.summary()} == {"all"}


def test_mixed_routes_and_the_memory_margin(decisions):
    def table(w, m):
        if w == "qkv":          # the kernel wins decode by 2x, XLA prefill by 2x: both layouts
            return (2e-3, 1e-3) if m <= D else (1e-3, 2e-3)
        if w == "o":            # XLA wins prefill by only 5%: not worth a second layout, the kernel everywhere
            return (2e-3, 1e-3) if m <= D else (1.0e-3, 1.05e-3)
        if w == "gate_up":      # the kernel wins decode by 5% only: XLA everywhere
            return (1.05e-3, 1e-3) if m <= D else (1e-3, 2e-3)
        if w == "down":         # a crossover inside decode: the kernel at M=1, XLA from M=D on; one
            # decode path, by the summed time (XLA 1 + 1.5 against the kernel 0.5 + 3 ms): XLA
            return (1e-3, 0.5e-3) if m == 1 else (1.5e-3, 3e-3)
        return (1e-3, 1e-3) if m == 1 else (1e-3, 2e-3)     # lm_head: a tie is XLA's
    plan = C.choose(_cases(), D, timer=FakeTimer(table))
    routes = dict(plan.routes)
    assert routes["qkv"] == ((D, "kernel"), (C.UNBOUNDED, "xla"))
    assert routes["o"] == ((C.UNBOUNDED, "kernel"),)
    assert routes["gate_up"] == ((C.UNBOUNDED, "xla"),)
    assert routes["down"] == ((C.UNBOUNDED, "xla"),)
    assert routes["lm_head"] == ((C.UNBOUNDED, "xla"),)
    assert plan.mode == "mixed" and plan.layouts("qkv") == {"xla", "kernel"} and plan.layouts("o") == {"kernel"}
    assert [plan.path("qkv", m) for m in (1, D, D + 1, 10 ** 6)] == ["kernel", "kernel", "xla", "xla"]
    rows = {(r["weight"], r["shape_class"]): r for r in plan.summary()}
    assert rows[("qkv", "decode")]["path"] == "kernel" and rows[("qkv", "prefill")]["path"] == "xla"
    assert rows[("down", "all")]["path"] == "xla"
    t = rows[("qkv", "decode")]["timings_ms"][1]                        # per layer of the timed stack (2 here)
    assert t == {"xla": 1.0, "kernel": 0.5}


def test_the_decision_is_cached_and_reused(decisions):
    first = FakeTimer(lambda w, m: (2e-3, 1e-3))
    plan = C.choose(_cases(), D, timer=first)
    assert first.calls and len(list(decisions.glob("matmul-*.json"))) == 1
    again = FakeTimer(lambda w, m: (1e-3, 2e-3))        # would pick XLA, were it asked
    cached = C.choose(_cases(), D, timer=again)
    assert again.calls == [] and cached == plan and cached.source == "cached"
    assert cached.timings == plan.timings
    other = FakeTimer(lambda w, m: (1e-3, 2e-3))        # other shapes (or dtype): timed anew, cached apart
    assert C.choose(_cases(dtype=jnp.bfloat16), D, timer=other).mode == "xla" and other.calls
    assert len(list(decisions.glob("matmul-*.json"))) == 2


def test_forcing_never_times(decisions, monkeypatch):
    timer = FakeTimer(lambda w, m: pytest.fail("a forced path must not be timed"))
    cfg = LlamaConfig.from_hf(TINY)
    for choice in ("xla", "kernel"):
        got = C.configure(choice, cfg, "cpu", jnp.float32, "none", 1, decode_rows=D, prefill_tokens=T, timer=timer)
        assert got.matmul == choice and got.matmul_plan is None
    got = C.configure("auto", cfg, "gpu", jnp.float32, "none", 1, decode_rows=D, prefill_tokens=T, timer=timer)
    assert got.matmul == "xla" and got.matmul_plan is None             # auto off CPU: XLA, nothing timed
    got = C.configure("auto", cfg, "cpu", jnp.float32, "none", 2, decode_rows=D, prefill_tokens=T, timer=timer)
    assert got.matmul == "xla"                                          # tp 2: XLA, nothing timed
    assert timer.calls == []
    auto = C.configure("auto", cfg, "cpu", jnp.float32, "none", 1, decode_rows=D, prefill_tokens=T,
                       timer=FakeTimer(lambda w, m: (2e-3, 1e-3)))
    assert auto.matmul == "kernel" and auto.matmul_plan is not None and auto.matmul_plan.mode == "kernel"


def test_real_timer_measures_both_paths():
    # the default timer runs both compiled programs (no assertion on which is faster)
    case = next(c for c in _cases() if c.weight == "down")
    pt = C._Point(case, 2, D)
    got = C.wall_timer(case, 2, {p: pt.runner(p) for p in pt.paths})
    assert set(got) == {"xla", "kernel"} and all(v > 0 for v in got.values())
    assert K.blas_available(), K.blas_reason()           # numpy's wheel ships an OpenBLAS
    case = next(c for c in _cases(library=True) if c.weight == "down")
    pre = C._Point(case, T, D)                            # a float32 prefill point: the library sgemm too
    got = C.wall_timer(case, T, {p: pre.runner(p) for p in pre.paths})
    assert set(got) == {"xla", "kernel", "blas"} and all(v > 0 for v in got.values())
    for w in ("o", "lm_head"):                             # w8a8: both paths quantize the rows (quad panels)
        case = next(c for c in _cases(quantize="w8a8") if c.weight == w)
        pt = C._Point(case, 2, D)
        assert "w8a8" in pt.slice and pt.specs["kernel"]["q"].dtype == jnp.uint8
        got = C.wall_timer(case, 2, {p: pt.runner(p) for p in pt.paths})
        assert set(got) == {"xla", "kernel"} and all(v > 0 for v in got.values())


def test_encoder_points_time_the_bias_and_gelu_on_both_paths():
    """A float32 encoder matrix is timed as its program runs it: + bias, and the exact GELU for the
    matrix the kernel finishes with it (bert.fused_gelu_matrix); both timed programs compute the
    same numbers from the same weights (the kernel's fused pass vs XLA's dot and fusions)."""
    dims = {"qkv_w": (64, 192), "ffn_in_w": (64, 256)}
    cases_ = C.encoder_cases(dims, 2, jnp.float32, 2048, gelu="ffn_in_w")
    assert [c.epilogue for c in cases_] == ["bias", "bias_gelu"]
    assert all(not c.epilogue for c in C.encoder_cases(dims, 2, jnp.bfloat16, 2048, gelu="ffn_in_w"))
    rng = np.random.default_rng(3)
    for case in cases_:
        pt = C._Point(case, 16, 0)
        k, n = dims[case.weight]
        w = rng.standard_normal((2, k, n)).astype(np.float32) * 0.3
        b = rng.standard_normal((2, n)).astype(np.float32)
        x = jnp.asarray(rng.standard_normal((16, k)).astype(np.float32))
        xla = np.asarray(pt.fns["xla"](x, {"w": jnp.asarray(w), "b": jnp.asarray(b)}))
        kern = np.asarray(pt.fns["kernel"](x, {"p": K.pack(jnp.asarray(w), 1, stacked=True), "b": jnp.asarray(b)}))
        pre = np.einsum("mk,lkn->lmn", np.asarray(x, np.float64), w) + b[:, None, :]
        want = pre if case.epilogue == "bias" else 0.5 * pre * (1 + np.vectorize(math.erf)(pre / math.sqrt(2)))
        np.testing.assert_allclose(xla, want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(kern, want, rtol=1e-4, atol=1e-4)
        got = C.wall_timer(case, 16, {p: pt.runner(p) for p in pt.paths})
        assert set(got) == {"xla", "kernel"} and all(v > 0 for v in got.values())


def test_the_library_sgemm_wins_only_by_a_margin(decisions):
    def table(w, m):
        if m <= D:
            return (2e-3, 1e-3)                            # the kernel at decode rows
        if w == "qkv":
            return (3e-3, 4e-3, 1e-3)                      # sgemm 3x faster than XLA at prefill rows
        if w == "o":
            return (1.0e-3, 4e-3, 0.95e-3)                 # sgemm 5% faster: not enough (its own threads)
        return (1e-3, 4e-3, 5e-3)                          # sgemm slower
    plan = C.choose(_cases(library=True), D, timer=FakeTimer(table))
    routes = dict(plan.routes)
    assert routes["qkv"] == ((D, "kernel"), (C.UNBOUNDED, "blas"))
    assert routes["o"] == ((D, "kernel"), (C.UNBOUNDED, "xla"))
    assert plan.layouts("qkv") == {"kernel", "xla"}        # the sgemm reads XLA's layout: no third copy
    t = next(t for t in plan.timings if t.weight == "qkv" and t.m == T)
    assert t.blas_s is not None and t.blas_s < t.xla_s
    assert [c for c in _cases(dtype=jnp.bfloat16, library=True) if c.blas] == []          # float32 only
    assert [c for c in _cases(quantize="int8", library=True) if c.blas] == []
    assert [c for c in _cases() if c.blas] == [] and not C.LIBRARY_IN_AUTO                 # auto: opt-in only


def test_the_library_sgemm_matches_einsum():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 4, 6, 40)).astype(np.float32)                # [L, K..., N]
    x = rng.standard_normal((2, 5, 4, 6)).astype(np.float32)
    y = jax.jit(lambda x, w, li: K.blas_linear(x, w, li, 2))(x, w, 2)
    np.testing.assert_allclose(np.asarray(y), np.einsum("btkd,kdn->btn", x, w[2]), rtol=1e-5, atol=1e-5)
    e = rng.standard_normal((50, 24)).astype(np.float32)                     # a tied head: [V, H], transposed
    h = rng.standard_normal((3, 24)).astype(np.float32)
    y = jax.jit(lambda h, e: K.blas_gemm(h, e[None], 0, trans_b=True))(h, e)
    np.testing.assert_allclose(np.asarray(y), h @ e.T, rtol=1e-5, atol=1e-5)


def test_an_isolated_winner_is_timed_again(decisions):
    """A point whose fastest path differs from the one both neighbours share is timed a second
    time and each path keeps its lower figure: a one-off (noise) no longer routes the matrix
    there, a winner that holds on the second timing still does. Other points are timed once."""
    dims = {"qkv_w": (64, 192), "attn_out_w": (64, 64)}
    seen: dict = {}

    def table(w, m):
        n = seen[(w, m)] = seen.get((w, m), 0) + 1
        if m == 64 and w == "qkv_w" and n == 1:           # interference slowed the kernel's samples once
            return (3e-3, 6e-3)
        if m == 64 and w == "attn_out_w":                  # XLA really faster there: every time
            return (0.5e-3, 1e-3)
        return (3e-3, 1e-3)
    timer = FakeTimer(table)
    plan = C.configure_encoder("auto", "cpu", jnp.float32, 1, dims, layers=2, max_rows=2048, timer=timer)
    assert [plan.path("qkv_w", m) for m in (16, 64, 256)] == ["kernel"] * 3
    assert [plan.path("attn_out_w", m) for m in (16, 64, 256)] == ["kernel", "xla", "kernel"]
    again = {k for k in timer.calls if timer.calls.count(k) > 1}
    assert again == {("qkv_w", 64), ("attn_out_w", 64)} and len(timer.calls) == 2 * len(C.ENCODER_POINTS) + 2
    t = next(t for t in plan.timings if t.weight == "qkv_w" and t.m == 64)
    assert (t.xla_s, t.kernel_s) == (3e-3 / 2, 1e-3 / 2)       # per layer; each path's lower figure


def test_the_library_sgemm_with_bias_and_gelu_matches_numpy():
    """The encoder's library path (blas_gemm_bias): x @ w[layer] + bias, then the exact GELU, in
    one call; with `rows`, only the first rows (the rest zeros, no bias); rows split across
    threads (M >= 64) and columns split (fewer rows) both give the same product."""
    from scipy.special import erf

    rng = np.random.default_rng(2)
    w = rng.standard_normal((3, 48, 200)).astype(np.float32)
    b = rng.standard_normal((3, 200)).astype(np.float32)
    for m in (5, 130):
        x = rng.standard_normal((m, 48)).astype(np.float32)
        ref = x @ w[1] + b[1]
        for gelu in (False, True):
            want = 0.5 * ref * (1 + erf(ref / np.sqrt(2))) if gelu else ref
            y = jax.jit(lambda x, w, b, g=gelu: K.blas_gemm_bias(x, w, 1, b[1], g))(x, w, b)
            np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
        live = m - 3
        y = np.asarray(jax.jit(lambda x, w, b, r: K.blas_gemm_bias(x, w, 1, b[1], False, r))(x, w, b, live))
        np.testing.assert_allclose(y[:live], ref[:live], rtol=1e-5, atol=1e-5)
        assert (y[live:] == 0).all()


def test_encoder_library_sgemm_timed_at_large_programs_only(decisions):
    """auto for a float32 encoder also times the library sgemm, at ENCODER_LIBRARY_ROWS rows and
    more, and routes a matrix there where it is the fastest (no extra margin, unlike a decoder's);
    never for bfloat16 (numpy's OpenBLAS has no such GEMM)."""
    dims = {"qkv_w": (64, 192), "attn_out_w": (64, 64), "ffn_in_w": (64, 256), "ffn_out_w": (256, 64)}

    def table(w, m):
        if m < C.ENCODER_LIBRARY_ROWS:
            return (3e-3, 1e-3)                            # the kernel on small programs
        if w == "attn_out_w":
            return (3e-3, 1e-3, 1.05e-3)                   # 5 % slower than the kernel
        return (3e-3, 3e-3, 1e-3)                          # the library 3x faster
    timer = FakeTimer(table)
    plan = C.configure_encoder("auto", "cpu", jnp.float32, 1, dims, layers=2, max_rows=2048, timer=timer)
    assert C.ENCODER_LIBRARY_IN_AUTO
    for w in ("qkv_w", "ffn_in_w", "ffn_out_w"):
        assert [plan.path(w, m) for m in (16, 64, 127, 128, 256, 2048)] == ["kernel"] * 4 + ["blas"] * 2, w
        assert plan.layouts(w) == {"kernel", "xla"}        # the library reads XLA's layout
    assert all(plan.path("attn_out_w", m) == "kernel" for m in (16, 2048)) and plan.layouts("attn_out_w") == {"kernel"}
    timed = {m for w, m in timer.calls}
    assert timed == set(C.ENCODER_POINTS)
    assert all(t.blas_s is not None for t in plan.timings if t.m >= C.ENCODER_LIBRARY_ROWS)
    assert all(t.blas_s is None for t in plan.timings if t.m < C.ENCODER_LIBRARY_ROWS)
    bf16 = C.encoder_cases(dims, 2, jnp.bfloat16, 2048, library=True)
    assert not any(c.blas for c in bf16)
    assert not any(c.blas for c in C.encoder_cases(dims, 2, jnp.float32, 128, library=True))   # no large program


def _mixed_table(w, m):
    """Every layout combination: qkv both (kernel at decode), o kernel only, gate_up XLA's layout
    only (XLA at decode, the library sgemm at prefill), down both (the kernel at M = 1 and XLA from
    M = 2 on, whose decode points take one path, the kernel: summed 2 ms against 3; XLA at
    prefill), lm_head kernel only (timed at decode rows only)."""
    if w == "gate_up" and m > D:
        return (1e-3, 2e-3, 0.5e-3)
    if w == "down" and m <= D:
        return (2e-3, 0.5e-3) if m == 1 else (1e-3, 1.5e-3)
    kernel_wins = {"qkv": m <= D, "o": True, "gate_up": False, "down": False, "lm_head": True}[w]
    return (2e-3, 1e-3) if kernel_wins else (1e-3, 2e-3)


@pytest.fixture(scope="module")
def mixed_engine(tmp_path_factory):
    from jax_engine.config import EngineArgs, ModelSpec
    from jax_engine.engine import Engine

    path = str(tmp_path_factory.mktemp("llama3"))
    model = hf_models.build("llama3", path)
    mp = pytest.MonkeyPatch()
    mp.setattr(C, "decision_dir", lambda: str(tmp_path_factory.mktemp("decisions")))
    mp.setattr(C, "default_timer", FakeTimer(_mixed_table))
    mp.setattr(C, "LIBRARY_IN_AUTO", True)          # the library sgemm's route through a real engine too
    try:
        engine = Engine(EngineArgs(models=[ModelSpec(name="m", path=path)], max_running_requests=D,
                                   max_num_batched_tokens=T, max_model_len=128, page_size=8))
        engine.load_all(progress=False)
    finally:
        mp.undo()
    yield model, engine
    engine.shutdown()


def test_mixed_plan_serves_the_reference_output(mixed_engine):
    from jax_engine.decode.parity import prompt_logits
    from jax_engine.types import GenerateRequest, SamplingParams

    model, engine = mixed_engine
    worker = engine.worker("m")
    cfg = worker.cfg
    assert cfg.matmul == "mixed"
    m = worker.replicas[0].runner.model()
    at, mlp = m.model.layers.self_attn, m.model.layers.mlp
    assert at.qkv_proj.weight[...].ndim == 5 and at.qkv_proj.panels[...].shape[-1] == K.PANEL   # both layouts
    assert at.o_proj.panels[...].shape[-1] == K.PANEL and at.o_proj.weight is None             # panels only
    assert mlp.gate_up_proj.weight[...].ndim == 4 and mlp.gate_up_proj.panels is None          # XLA's only
    assert cfg.matmul_plan.path("gate_up", T) == "blas" and cfg.matmul_plan.path("gate_up", D) == "xla"
    assert mlp.down_proj.weight[...].ndim == 3 and mlp.down_proj.panels[...].shape[-1] == K.PANEL
    assert m.lm_head.weight is None and m.lm_head.panels[...].shape[-1] == K.PANEL
    assert cfg.matmul_plan.path("down", 1) == cfg.matmul_plan.path("down", D) == "kernel"
    # the panels are the packed XLA layout, not a second copy of anything else
    np.testing.assert_array_equal(np.asarray(K.pack(mlp.down_proj.weight[...], 1, stacked=True)),
                                  np.asarray(mlp.down_proj.panels[...]))

    prompts = [list(range(3, 40)), [7, 8, 9], list(range(100, 130))]      # prefill M = 64 (> D), decode M = 1..4
    for p in prompts[:2]:
        err = float(np.max(np.abs(prompt_logits(worker.replicas[0].runner, p) - hf_models.hf_logits(model, p))))
        assert err <= 1e-4

    async def greedy(p):
        toks = []
        req = GenerateRequest(request_id="", prompt_ids=p, model="m",
                              params=SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True))
        async for o in engine.generate(req):
            toks += o.new_token_ids
        return toks

    async def run_all():
        return await asyncio.gather(*[greedy(p) for p in prompts])

    for p, toks in zip(prompts, asyncio.run(run_all())):          # 3 rows at once (M = 4), then one by one (M = 1)
        assert toks == hf_models.hf_greedy(model, p, 16)
    assert asyncio.run(greedy(prompts[1])) == hf_models.hf_greedy(model, prompts[1], 16)
    assert engine.stats("m").compilations_after_warmup == 0


def test_both_paths_agree_on_the_same_weights(mixed_engine):
    # the same weights through the other route of each matrix: XLA-only and kernel-only configs
    _, engine = mixed_engine
    worker = engine.worker("m")
    runner = worker.replicas[0].runner
    cfg = worker.cfg
    x = np.random.default_rng(0).standard_normal((3, cfg.intermediate_size)).astype(np.float32)
    plan = cfg.matmul_plan
    down = runner.model().model.layers.mlp.down_proj            # both layouts (the kernel at decode)
    for li in range(cfg.num_layers):
        got_xla = np.asarray(llama.linear(jnp.asarray(x)[None], down.xla_weight()[li], llama.SPECS["down"]))[0]
        got_k = np.asarray(K.linear(jnp.asarray(x), down.kernel_weight(), li, 1, (cfg.hidden_size,)))
        np.testing.assert_allclose(got_k, got_xla, rtol=1e-5, atol=1e-5)
    assert plan.path("down", 1) == "kernel" and plan.path("down", T) == "xla"


def test_encoder_matmul_choice(decisions):
    """Encoders: `kernel` routes every layer matrix to the kernel (refused where it cannot run);
    `xla` and `blas` keep XLA's dot; `auto` times both paths per matrix at ENCODER_POINTS rows
    (up to the largest program) and the faster one wins, whichever is made slow."""
    dims = {"qkv_w": (64, 192), "attn_out_w": (64, 64), "ffn_in_w": (64, 256), "ffn_out_w": (256, 64)}
    plan = C.configure_encoder("kernel", "cpu", jnp.float32, 1, dims, layers=2, max_rows=2048)
    assert plan.mode == "kernel" and all(plan.path(w, m) == "kernel" for w in dims for m in (1, 10 ** 6))
    for choice in ("xla", "blas"):
        assert C.configure_encoder(choice, "cpu", jnp.float32, 1, dims, layers=2, max_rows=2048) is None
    with pytest.raises(InvalidRequest, match="--cpu-matmul kernel"):
        C.configure_encoder("kernel", "gpu", jnp.float32, 1, dims, layers=2, max_rows=2048)
    never = FakeTimer(lambda w, m: pytest.fail("nothing is timed off the CPU"))
    assert C.configure_encoder("auto", "gpu", jnp.float32, 1, dims, layers=2, max_rows=2048, timer=never) is None
    for slow in ("xla", "kernel"):
        for f in decisions.iterdir():          # the same matrices: a cached decision would answer
            f.unlink()
        timer = FakeTimer(lambda w, m: (3e-3, 1e-3) if slow == "xla" else (1e-3, 3e-3))
        got = C.configure_encoder("auto", "cpu", jnp.float32, 1, dims, layers=2, max_rows=512 if slow == "xla" else 2048,
                                  timer=timer)
        fast = "kernel" if slow == "xla" else "xla"
        assert all(got.path(w, m) == fast for w in dims for m in (16, 300, 2048))
        want = [m for m in C.ENCODER_POINTS if m <= (512 if slow == "xla" else 2048)]
        assert sorted(timer.calls) == sorted((w, m) for w in dims for m in want)
    # mixed: the kernel wins small programs, XLA's dot large ones, each by more than the margin
    for f in decisions.iterdir():
        f.unlink()
    mixed = C.configure_encoder("auto", "cpu", jnp.float32, 1, dims, layers=2, max_rows=2048,
                                timer=FakeTimer(lambda w, m: (3e-3, 1e-3) if m <= 64 else (1e-3, 3e-3)))
    assert [mixed.path("qkv_w", m) for m in (16, 64, 128, 129, 256, 2048)] == ["kernel"] * 3 + ["xla"] * 3
    assert mixed.layouts("qkv_w") == {"kernel", "xla"}
    # the self-attention is a case of its own when the kernel takes the head size: timed at the
    # same token counts, routed by the same rule, forced with the matrices by `kernel`
    forced = C.configure_encoder("kernel", "cpu", jnp.float32, 1, dims, layers=2, max_rows=2048, attention=(2, 32))
    assert forced.path(C.ATTENTION, 1) == "kernel" and forced.path(C.ATTENTION, 10 ** 6) == "kernel"
    for slow in ("xla", "kernel"):
        for f in decisions.iterdir():
            f.unlink()
        timer = FakeTimer(lambda w, m: (1e-3, 1e-3) if w != C.ATTENTION else ((3e-3, 1e-3) if slow == "xla" else (1e-3, 3e-3)))
        got = C.configure_encoder("auto", "cpu", jnp.float32, 1, dims, layers=2, max_rows=2048, timer=timer,
                                  attention=(2, 32))
        assert all(got.path(C.ATTENTION, m) == ("kernel" if slow == "xla" else "xla") for m in (16, 300, 2048))
        assert sorted(m for w, m in timer.calls if w == C.ATTENTION) == list(C.ENCODER_POINTS)
