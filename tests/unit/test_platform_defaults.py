"""`--dtype auto`: float32 on CPU, bfloat16 weights and KV cache on GPU / TPU (the platform is
monkeypatched; the arrays themselves live on the CPU), float32 logits everywhere."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jax_engine.errors import InvalidRequest
from jax_engine.executor import backend


@pytest.mark.parametrize("plat, want", [("cpu", jnp.float32), ("gpu", jnp.bfloat16), ("tpu", jnp.bfloat16)])
def test_auto_follows_the_platform(monkeypatch, plat, want):
    monkeypatch.setattr(backend, "platform", lambda: plat)
    for choice in ("auto", "", None):
        assert backend.resolve_dtype(choice) == want
    assert backend.default_decoder_dtype() == jnp.dtype(want).name
    assert backend.is_accelerator() == (plat != "cpu")


@pytest.mark.parametrize("plat", ["cpu", "gpu", "tpu"])
def test_explicit_choice_wins(monkeypatch, plat):
    monkeypatch.setattr(backend, "platform", lambda: plat)
    assert backend.resolve_dtype("float32") == jnp.float32
    assert backend.resolve_dtype("fp32") == jnp.float32
    assert backend.resolve_dtype("bfloat16") == jnp.bfloat16
    assert backend.resolve_dtype("bf16") == jnp.bfloat16
    with pytest.raises(InvalidRequest):
        backend.resolve_dtype("float16")


def test_the_real_platform_here_is_cpu():
    assert backend.platform() == "cpu"
    assert backend.resolve_dtype("auto") == jnp.float32


@pytest.fixture(scope="module")
def demo_path(tmp_path_factory) -> str:
    from jax_engine.models.demo import build_demo_generator

    return build_demo_generator(str(tmp_path_factory.mktemp("platform") / "demo"))


def _load(path: str):
    from jax_engine.config import EngineArgs, ModelSpec
    from jax_engine.engine import Engine

    # the attention backend stays the CPU one: this is about dtypes, and the arrays live on the CPU
    extra = {"attention_backend": "reference"} if "attention_backend" in EngineArgs.__dataclass_fields__ else {}
    args = EngineArgs(models=[ModelSpec(name="m", path=path)], max_running_requests=2, max_num_batched_tokens=32,
                      max_model_len=64, page_size=8, num_pages=16, **extra)
    engine = Engine(args)
    engine.load_all(progress=False, warmup=False)
    return engine


@pytest.mark.parametrize("plat, want", [("gpu", "bfloat16"), ("cpu", "float32")])
def test_generate_worker_weights_and_kv_cache(monkeypatch, demo_path, plat, want):

    monkeypatch.setattr(backend, "platform", lambda: plat)
    engine = _load(demo_path)
    try:
        worker = engine.worker("m")
        assert worker.info.dtype == want
        runner = worker.replicas[0].runner
        assert runner.state["k"].dtype == want and runner.state["v"].dtype == want
        # matrices take the chosen dtype; norm weights (and biases) stay float32 by design
        m = runner.model()
        ly = m.model.layers
        assert m.model.embed_tokens.weight[...].dtype == want
        for lin in (m.lm_head, ly.self_attn.qkv_proj, ly.self_attn.o_proj, ly.mlp.gate_up_proj, ly.mlp.down_proj):
            w = lin.weight if lin.weight is not None else lin.panels        # the CPU kernel's panels only
            assert w[...].dtype == want
        assert m.model.norm.weight[...].dtype == jnp.float32 and ly.input_layernorm.weight[...].dtype == jnp.float32
        # logits come out in float32 whatever the weights are
        h = jnp.ones((2, worker.cfg.hidden_size), want)
        logits = m.logits(h)
        assert logits.dtype == jnp.float32 and bool(np.isfinite(np.asarray(logits)).all())
        # the page budget counts the KV cache at its real width
        assert runner.kv_bytes_per_page() == (2 * worker.cfg.num_layers * 8 * worker.cfg.num_kv_heads
                                              * worker.cfg.head_dim * jnp.dtype(want).itemsize)
    finally:
        engine.shutdown(timeout=2.0)


# ------------------------------------------------------------------ config resolution
def test_a_spec_pins_what_it_sets_and_inherits_the_rest(demo_path):
    from jax_engine.config import EngineArgs, ModelSpec, resolve

    args = EngineArgs(tp=2, replicas=2, quantize="int8", dtype="float32", page_size=8, max_model_len=64)
    pinned = resolve(ModelSpec(name="m", path=demo_path, tp=1, replicas=1, quantize="none", dtype="bfloat16",
                               page_size=16, enable_prefix_cache=False), args)
    assert (pinned.tp, pinned.replicas, pinned.quantize, pinned.dtype) == (1, 1, "none", "bfloat16")
    assert (pinned.page_size, pinned.enable_prefix_cache, pinned.max_model_len) == (16, False, 64)
    inherited = resolve(ModelSpec(name="m", path=demo_path), args)
    assert (inherited.tp, inherited.replicas, inherited.quantize, inherited.dtype) == (2, 2, "int8", "float32")
    assert (inherited.task, inherited.page_size, inherited.enable_prefix_cache) == ("generate", 8, True)


def test_random_weights_is_decided_once_from_the_spec_or_the_demo_marker(demo_path, tmp_path):
    from jax_engine.config import EngineArgs, ModelSpec, is_random_weights, resolve

    assert resolve(ModelSpec(name="m", path=demo_path), EngineArgs()).random_weights is True
    assert is_random_weights(ModelSpec(name="m", path=str(tmp_path), random_weights=True))
    assert not is_random_weights(ModelSpec(name="m", path=str(tmp_path)))


@pytest.mark.parametrize("plat", ["cpu", "gpu"])
def test_token_budget_and_burst_defaults(monkeypatch, demo_path, plat):
    """--max-num-batched-tokens / --burst-batched-tokens: 64 with a 256 burst on CPU, 2048 and no
    burst on accelerators; the burst default applies only above the budget; an explicit burst at
    or below the budget is refused by name; 0 turns it off."""
    from jax_engine.config import EngineArgs, ModelSpec, resolve

    monkeypatch.setattr(backend, "platform", lambda: plat)
    spec = ModelSpec(name="m", path=demo_path)
    r = resolve(spec, EngineArgs())
    assert (r.max_num_batched_tokens, r.burst_batched_tokens) == ((64, 256) if plat == "cpu" else (2048, 0))
    assert resolve(spec, EngineArgs(max_num_batched_tokens=256)).burst_batched_tokens == 0
    assert resolve(spec, EngineArgs(max_num_batched_tokens=32, burst_batched_tokens=512)).burst_batched_tokens == 512
    assert resolve(spec, EngineArgs(burst_batched_tokens=0)).burst_batched_tokens == 0
    with pytest.raises(InvalidRequest, match="--burst-batched-tokens 32 must exceed --max-num-batched-tokens 64"):
        resolve(spec, EngineArgs(max_num_batched_tokens=64, burst_batched_tokens=32))
    with pytest.raises(InvalidRequest, match="--burst-min-prompts must be >= 1"):
        resolve(spec, EngineArgs(burst_min_prompts=0))
    with pytest.raises(InvalidRequest, match="--itl-p99-ratio must be 0"):
        resolve(spec, EngineArgs(itl_p99_ratio=0.5))


def test_burst_buckets_double_from_the_budget():
    from jax_engine.decode.runner import burst_buckets, step_buckets

    assert burst_buckets(64, 256) == [128, 256]
    assert burst_buckets(64, 300) == [128, 256, 300]
    assert burst_buckets(64, 100) == [100] and burst_buckets(64, 64) == [] and burst_buckets(64, 0) == []
    assert step_buckets(64) + burst_buckets(64, 256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    # with the latency guard: four per octave above the budget (a prompt plus the streams beside it)
    assert burst_buckets(64, 256, fine=True) == [80, 96, 112, 128, 160, 192, 224, 256]
    assert burst_buckets(64, 100, fine=True) == [80, 96, 100] and burst_buckets(64, 64, fine=True) == []
