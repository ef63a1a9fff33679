"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Phi-3, Gemma 2/3, Mixtral, Qwen3-MoE):
its configuration, RoPE variants, building blocks and matmul routing.

The model itself is the flax.nnx module tree of jax_engine/models/decoder.py, which calls these.
Layer weights are stacked on a leading axis and the layers run under `lax.scan`, which compiles
~3x faster than an unrolled loop on XLA:CPU and runs faster too.

Weight layout (chosen for fused matmuls and clean tensor-parallel sharding):
  qkv   [L, H, KVH, G+2, D]  per KV head: its G query heads, then K, then V
  o     [L, KVH, G, D, H]    row-parallel over KVH
  gate_up [L, H, 2, I]       column-parallel over I
  down  [L, I, H]            row-parallel over I
Linear weights are either arrays or {"q": int8, "s": per-output-channel scale} (weight-only int8).
With cfg.matmul == "kernel" (CPU) the four layer matrices and the LM head are instead packed into
64-column panels [L, P, K, 64] (decoder.pack_for_kernel), for jax_engine/kernels/cpu.py. With
"mixed" (--cpu-matmul auto measured a different winner per matrix or per row count, jax_engine/
kernels/choose.py) cfg.matmul_plan routes each matmul by its static row count M: a matrix only the
kernel serves is packed in place of its layout, one served by both keeps its layout and gets the
packed copy beside it. "blas" (the library sgemm, float32) reads the layouts above unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_engine.errors import InvalidRequest
from jax_engine.kernels.plan import MatmulPlan
from jax_engine.models.registry import DECODERS, architecture_of


@dataclass(frozen=True)
class LlamaConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    max_position_embeddings: int
    inv_freq: tuple = field(repr=False)   # RoPE inverse frequencies (host-computed, incl. scaling)
    rope_attention_factor: float = 1.0
    # LongRoPE (Phi-3): positions >= rope_long_from use these frequencies instead (() = none)
    inv_freq_long: tuple = field(default=(), repr=False)
    rope_long_from: int = 0
    # dynamic NTK (rope_type "dynamic"): (factor, original context, theta); a token at position
    # p >= the original context rotates with the base of a (p + 1)-token sequence (() = none)
    rope_dynamic: tuple = ()
    # Gemma 2 / 3
    act: str = "silu"                     # MLP gate activation: silu | gelu_tanh (GeGLU)
    embed_scale: float = 1.0              # embeddings multiplied by this (Gemma: sqrt(hidden))
    sandwich_norms: bool = False          # RMSNorm after attention and after the MLP too
    attn_softcap: float = 0.0             # attention logits -> cap * tanh(s / cap) (0 = off)
    final_softcap: float = 0.0            # LM-head logits, the same (0 = off)
    attn_scale: float = 0.0               # softmax scale (0 = 1 / sqrt(head_dim))
    layer_windows: tuple = ()             # per-layer sliding window (0 = global); () = sliding_window everywhere
    inv_freq_local: tuple = field(default=(), repr=False)   # Gemma 3: RoPE of the windowed layers
    # mixture of experts (Mixtral, Qwen3-MoE): jax_engine/models/moe.py; 0 = a dense MLP
    num_experts: int = 0
    experts_per_token: int = 0
    normalize_top_k: bool = True
    sliding_window: Optional[int] = None
    qkv_bias: bool = False
    o_bias: bool = False                  # Llama's attention_bias biases o_proj too (Qwen2: q, k, v only)
    qk_norm: bool = False
    tie_embeddings: bool = False
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple = ()
    pad_token_id: Optional[int] = None
    kv_repeat: int = 1                    # KV heads replicated this many times (TP > KV heads)
    # jax_engine/attention backend; the served path sets it from --attention-backend (attention.resolve)
    attention_backend: str = "reference"
    # "xla": einsum over the layouts above; "kernel": packed [L, P, K, 64] weights and the CPU
    # custom call (jax_engine/kernels/cpu.py); "blas": the library sgemm on the XLA layouts (float32);
    # "mixed": per matrix and row count, as matmul_plan
    # says (jax_engine/kernels/choose.py); the served path sets both from --cpu-matmul
    matmul: str = "xla"
    matmul_plan: Optional[MatmulPlan] = None
    # --quantize w8a8: every int8 matrix's input is quantized to int8 per row (dynamically, each
    # call) and multiplied in integers (quantize_rows, linear; cpu.cc GemmI8A8Impl on the kernel)
    act_int8: bool = False

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlamaConfig":
        arch = architecture_of(cfg)
        if arch not in DECODERS:
            raise InvalidRequest(f"{arch} is not a decoder; supported decoders: {', '.join(DECODERS)}")
        mt = cfg.get("model_type", "llama")
        h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
        hd = cfg.get("head_dim") or h // nh
        kvh = cfg.get("num_key_value_heads") or nh
        gemma = mt in ("gemma2", "gemma3_text")
        act_name = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        acts = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
        if act_name not in acts:
            raise InvalidRequest(f"hidden activation {act_name!r} is not supported ({', '.join(acts)})")
        window = cfg.get("sliding_window") if mt in ("mistral", "phi3") else None
        layer_windows: tuple = ()
        if gemma:               # alternating windowed ("sliding_attention") and global layers
            types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
            layer_windows = tuple(int(cfg.get("sliding_window") or 0) if t == "sliding_attention" else 0 for t in types)
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise InvalidRequest(f"partial_rotary_factor {cfg.get('partial_rotary_factor')} is not supported (only 1.0)")
        if mt in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
            raise InvalidRequest(f"{mt} with use_sliding_window=true is not supported")
        local_inv: tuple = ()
        rp = cfg.get("rope_parameters") or {}
        if "full_attention" in rp:           # Gemma 3: RoPE per layer type
            for t, p in rp.items():
                if isinstance(p, dict) and p.get("rope_type", p.get("type")) in ("dynamic", "longrope", "su"):
                    raise InvalidRequest(f"{p.get('rope_type', p.get('type'))} RoPE per layer type ({t}) is not supported")
            inv_freq, factor = _rope_inv_freq({**cfg, "rope_parameters": rp["full_attention"], "rope_scaling": None}, hd)
            local, local_factor = _rope_inv_freq({**cfg, "rope_parameters": rp.get("sliding_attention", rp["full_attention"]),
                                                   "rope_scaling": None}, hd)
            if local_factor != factor:
                raise InvalidRequest("RoPE attention factors that differ between layer types are not supported")
            local_inv = tuple(float(x) for x in local)
        else:
            inv_freq, factor = _rope_inv_freq(cfg, hd)
            if cfg.get("rope_local_base_freq"):   # older Gemma 3 configs
                local, _ = _rope_inv_freq({"rope_theta": cfg["rope_local_base_freq"]}, hd)
                local_inv = tuple(float(x) for x in local)
        long_inv, long_from = _longrope_long(cfg, hd)
        dynamic = _rope_dynamic(cfg) if "full_attention" not in rp else ()
        max_pos = cfg.get("max_position_embeddings", 4096)
        if dynamic:     # served context: the original times the factor, as vLLM derives it
            max_pos = max(max_pos, int(dynamic[0] * dynamic[1]))
        qps = cfg.get("query_pre_attn_scalar") if gemma else None
        experts, inter = 0, cfg.get("intermediate_size")
        if mt in ("mixtral", "qwen3_moe"):
            experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
            if mt == "qwen3_moe":
                inter = cfg["moe_intermediate_size"]
                if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
                    raise InvalidRequest("qwen3_moe with dense layers (mlp_only_layers / decoder_sparse_step) is not supported")
            if mt == "mixtral":
                window = cfg.get("sliding_window")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch, model_type=mt, vocab_size=cfg["vocab_size"], hidden_size=h,
            intermediate_size=inter, num_layers=cfg["num_hidden_layers"],
            num_heads=nh, num_kv_heads=kvh, head_dim=hd, rms_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=max_pos,
            inv_freq=tuple(float(x) for x in inv_freq), rope_attention_factor=factor,
            inv_freq_long=tuple(float(x) for x in long_inv), rope_long_from=long_from, rope_dynamic=dynamic,
            sliding_window=window, qkv_bias=bool(mt == "qwen2" or cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)),
            num_experts=experts, experts_per_token=cfg.get("num_experts_per_tok", 0) if experts else 0,
            normalize_top_k=bool(cfg.get("norm_topk_prob", True)) if mt == "qwen3_moe" else True,
            qk_norm=(mt in ("qwen3", "gemma3_text", "qwen3_moe")), tie_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            act=acts[act_name], embed_scale=float(h) ** 0.5 if gemma else 1.0, sandwich_norms=gemma,
            attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0) if gemma else 0.0,
            final_softcap=float(cfg.get("final_logit_softcapping") or 0.0) if gemma else 0.0,
            attn_scale=float(qps) ** -0.5 if qps else 0.0, layer_windows=layer_windows, inv_freq_local=local_inv,
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
            pad_token_id=cfg.get("pad_token_id"),
        )


def _rope_inv_freq(cfg: dict, head_dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies with the config's RoPE scaling (old `rope_scaling` or new `rope_parameters`)."""
    params = _rope_params(cfg)
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rtype = params.get("rope_type", params.get("type", "default")) or "default"
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    if rtype == "default":
        return inv, 1.0
    if rtype == "linear":
        return inv / params["factor"], 1.0
    if rtype == "llama3":
        factor, lo, hi = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old = params["original_max_position_embeddings"]
        lo_wl, hi_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        out = np.where(wl > lo_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wl < hi_wl) & ~(wl > lo_wl)
        return np.where(medium, smoothed, out).astype(np.float32), 1.0
    if rtype == "yarn":
        return _yarn(params, cfg, head_dim, theta, inv)
    if rtype in ("longrope", "su"):
        return _longrope(params, cfg, head_dim, theta, "short_factor")
    if rtype == "dynamic":      # plain within the original context; beyond it per position (_rope_dynamic)
        return inv, 1.0
    raise InvalidRequest(f"rope type {rtype!r} is not supported (default, linear, llama3, yarn, longrope, dynamic)")


def _rope_params(cfg: dict) -> dict:
    return {**(cfg.get("rope_scaling") or {}), **dict(cfg.get("rope_parameters") or {})}


def _longrope(params: dict, cfg: dict, dim: int, theta: float, which: str) -> tuple[np.ndarray, float]:
    """LongRoPE (Phi-3, arXiv:2402.13753) as transformers computes it: the base frequencies divided
    by per-frequency factors (short_factor within the original context, long_factor beyond), and
    an attention factor sqrt(1 + ln(factor) / ln(original context)) scaling cos and sin."""
    orig = params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if not orig:
        raise InvalidRequest("longrope needs original_max_position_embeddings")
    ext = np.asarray(params[which], np.float32)
    if ext.shape != (dim // 2,):
        raise InvalidRequest(f"longrope {which} has {ext.size} entries, expected {dim // 2}")
    factor = params.get("factor") or cfg.get("max_position_embeddings", orig) / orig
    attn = params.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    inv = 1.0 / (ext * theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    return inv.astype(np.float32), float(attn)


def _longrope_long(cfg: dict, head_dim: int) -> tuple[np.ndarray, int]:
    """(long-context frequencies, first position that uses them) of a LongRoPE config, else ((), 0).

    Position p >= the original context uses long_factor, earlier ones short_factor. That is what
    transformers' generate does whenever the prompt fits the original context (it switches when
    the sequence outgrows it, and cached keys keep their rotation); a longer prompt is rotated
    entirely with long_factor there, per position here (vLLM's rule)."""
    params = _rope_params(cfg)
    if params.get("rope_type", params.get("type")) not in ("longrope", "su"):
        return np.zeros(0, np.float32), 0
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    inv, _ = _longrope(params, cfg, head_dim, theta, "long_factor")
    return inv, int(params.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"])


def _rope_dynamic(cfg: dict) -> tuple:
    """(factor, original context, theta) of a dynamic-NTK config (rope_type "dynamic"), else ().

    transformers recomputes the base whenever the sequence outgrows the original context
    (max_position_embeddings): for an n-token sequence, base' = base * (factor * n / orig -
    (factor - 1)) ** (D / (D - 2)), plain RoPE while n <= orig. In a cached generate the keys keep
    the rotation they were written with, so token p (generated one at a time) rotates with the base
    of n = p + 1. That per-position rule is ours for every token (`token_inv_freq`): exact against
    transformers for a prompt within the original context and everything generated after it, also
    beyond that context, and the same for any chunking or prefix reuse. The one difference: a
    prompt longer than the original context is rotated there entirely with the base of its own
    length (so earlier tokens change with the prompt's length), here per position. vLLM instead
    uses one base for every position, that of n = orig * factor, so it differs from transformers
    at every length, also within the original context. The served context is orig * factor (vLLM's)."""
    params = _rope_params(cfg)
    if (params.get("rope_type", params.get("type")) or "default") != "dynamic":
        return ()
    factor = params.get("factor")
    if not isinstance(factor, (int, float)) or factor < 1.0:
        raise InvalidRequest(f"dynamic RoPE needs a factor >= 1, got {factor!r}")
    if params.get("alpha") is not None:
        raise InvalidRequest("dynamic RoPE with an NTK alpha is not supported")
    orig = int(cfg.get("max_position_embeddings", 4096))
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    return (float(factor), orig, theta)


def token_inv_freq(cfg: "LlamaConfig", positions: jax.Array) -> jax.Array:
    """RoPE inverse frequencies of tokens at `positions` [1, T]: [D/2] when they do not depend on
    the position, else [1, T, D/2] (LongRoPE past the original context, dynamic NTK)."""
    inv_freq = jnp.asarray(np.array(cfg.inv_freq, dtype=np.float32))
    if cfg.inv_freq_long:        # LongRoPE: per token, long frequencies from the original context on
        long = jnp.asarray(np.array(cfg.inv_freq_long, dtype=np.float32))
        inv_freq = jnp.where(positions[..., None] >= cfg.rope_long_from, long, inv_freq)
    if cfg.rope_dynamic:         # dynamic NTK: the base of a (p + 1)-token sequence, in float32 as transformers
        factor, orig, theta = cfg.rope_dynamic
        d = cfg.head_dim
        n = jnp.maximum(positions + 1, orig).astype(jnp.float32)[..., None]            # [1, T, 1]
        base = theta * (factor * n / orig - (factor - 1)) ** (d / (d - 2))
        inv_freq = 1.0 / (base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))         # [1, T, D/2]
    return inv_freq


def _yarn(params: dict, cfg: dict, dim: int, theta: float, inv: np.ndarray) -> tuple[np.ndarray, float]:
    """YaRN (Peng et al., arXiv:2309.00071) as transformers computes it: per frequency a linear ramp
    between interpolation (inv / factor) and extrapolation (inv) over the dimensions whose
    wavelength falls between beta_fast and beta_slow rotations of the original context, and an
    attention factor (0.1 ln(factor) + 1 unless given) that scales cos and sin."""
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise InvalidRequest("rope partial_rotary_factor != 1 is not supported")
    orig = params.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 4096)
    factor = params.get("factor") or cfg.get("max_position_embeddings", orig) / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = params.get("attention_factor")
    if attn is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def corr_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if params.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - lo) / (hi - lo), 0, 1)
    extrapolate = 1 - ramp
    out = (inv / factor) * (1 - extrapolate) + inv * extrapolate
    return out.astype(np.float32), float(attn)


# --------------------------------------------------------------------------- building blocks
def quantize_rows(x: jax.Array, k_dims: int) -> tuple[jax.Array, jax.Array]:
    """--quantize w8a8's activations: x's last k_dims axes (one row of a matmul's input) as int8,
    symmetric, per row: amax = max |row|, xq = round(x * 127 / amax) (half to even) in [-127, 127],
    scale amax / 127 (shape x.shape[:-k_dims] + (1,) * k_dims; a zero row is zeros with scale 0).
    Float32 throughout, in the order cpu.cc's quantize_row computes it, so the kernel and this
    path feed the same integers to their (exact) int32 sums."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=tuple(range(x.ndim - k_dims, x.ndim)), keepdims=True)
    inv = jnp.where(amax > 0, jnp.float32(127) / jnp.where(amax > 0, amax, jnp.float32(1)), jnp.float32(0))
    xq = jnp.round(jnp.clip(xf * inv, -127, 127)).astype(jnp.int8)
    return xq, amax / jnp.float32(127)


def _a8_einsum(spec: str, x: jax.Array, w: dict, k_dims: int) -> jax.Array:
    """float32 einsum(spec, x, dequantised w) with x quantized per row (quantize_rows): int8 x int8
    summed in int32 (exact), then times the row scale and the column scale, in that order."""
    xq, sx = quantize_rows(x, k_dims)
    y = jnp.einsum(spec, xq, w["q"], preferred_element_type=jnp.int32).astype(jnp.float32)
    lead = x.ndim - k_dims
    return y * sx.reshape(x.shape[:lead] + (1,) * (y.ndim - lead)) * w["s"]


def linear(x: jax.Array, w: Any, spec: str, a8_k_dims: int = 0) -> jax.Array:
    """einsum with a float or weight-only-int8 weight; int8 is dequantised inside the matmul, or
    with `a8_k_dims` (--quantize w8a8: the spec's contraction dims, x's last) multiplied in
    integers against x quantized per row (_a8_einsum)."""
    if isinstance(w, dict) and a8_k_dims:
        return _a8_einsum(spec, x, w, a8_k_dims).astype(x.dtype)
    if isinstance(w, dict):
        y = jnp.einsum(spec, x, w["q"].astype(x.dtype), preferred_element_type=jnp.float32)
        return (y * w["s"]).astype(x.dtype)
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, factor: float) -> jax.Array:
    """HF rotate-half RoPE. x [..., T, heads..., D], positions broadcastable to x[..., T]."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    extra = x.ndim - emb.ndim
    shape = emb.shape[:-1] + (1,) * extra + emb.shape[-1:]
    cos = (jnp.cos(emb) * factor).reshape(shape)
    sin = (jnp.sin(emb) * factor).reshape(shape)
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rot * sin).astype(x.dtype)


# --------------------------------------------------------------------------- forward
@jax.tree_util.register_dataclass
@dataclass
class StepInputs:
    """Static-shape inputs of one ragged step: T query tokens (a flat list, each row's tokens
    contiguous, rows in order, padding tokens last) over R rows (real rows first).

    A token at position p of row r writes its KV to `slots` and attends the keys of r's pages at
    positions < kv_limit (= p + 1: causal over earlier pages and its own chunk; 0 for padding)."""

    tokens: jax.Array        # [T] int32
    positions: jax.Array     # [T] int32
    slots: jax.Array         # [T] int32 flat KV slot to write (page 0, the reserved dummy, for padding)
    rows: jax.Array          # [T] int32 row of each token (0 for padding)
    kv_limit: jax.Array      # [T] int32 keys visible to each token (position + 1; 0 for padding)
    page_table: jax.Array    # [R, P] int32 each row's pages in position order
    kv_lens: jax.Array       # [R] int32 valid keys of each row after this step (0 for padding rows)
    cu_q_lens: jax.Array     # [R + 1] int32 where each row's tokens start in the flat list; [num_rows]
    #                          is the real token count (the CPU GEMM computes only those rows)
    num_rows: jax.Array      # [1] int32 real rows


PACKED = ("qkv", "o", "gate_up", "down")
MATRICES = PACKED + ("lm_head",)         # every matmul cfg.matmul routes
K_DIMS = {"qkv": 1, "o": 3, "gate_up": 1, "down": 1}
SPECS = {"qkv": "bth,hkgd->btkgd", "o": "btkgd,kgdh->bth", "gate_up": "bth,hci->btci", "down": "bti,ih->bth"}


def matmul_dims(cfg: LlamaConfig) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """(contraction dims, output dims) of each layer matrix's einsum (SPECS) and of the LM head,
    as models/decoder.py runs them (unsharded)."""
    G = cfg.num_heads // (cfg.num_kv_heads * cfg.kv_repeat)
    kvh, D, H, inter = cfg.num_kv_heads * cfg.kv_repeat, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {"qkv": ((H,), (kvh, G + 2, D)), "o": ((kvh, G, D), (H,)), "gate_up": ((H,), (2, inter)), "down": ((inter,), (H,)),
            "lm_head": ((H,), (cfg.vocab_size,))}


def matmul_path(cfg: LlamaConfig, name: str, m: int) -> str:
    """The path ("xla", "kernel" or "blas") of matrix `name` multiplying m rows (static at trace time)."""
    if cfg.matmul == "mixed":
        assert cfg.matmul_plan is not None
        return cfg.matmul_plan.path(name, m)
    return cfg.matmul


def layouts_of(cfg: LlamaConfig, name: str) -> frozenset[str]:
    """"xla" (XLA's layout, which the library sgemm also reads) and/or "kernel" (packed panels)."""
    if cfg.matmul == "mixed":
        assert cfg.matmul_plan is not None
        return cfg.matmul_plan.layouts(name)
    return frozenset({"kernel" if cfg.matmul == "kernel" else "xla"})


def head_einsum(h: jax.Array, w: Any, tied: bool, a8: bool = False) -> jax.Array:
    """XLA's LM-head matmul: h [..., H] by the [V, H] embedding (tied) or the [H, V] head, an
    array or int8 {"q", "s"} (the float32 accumulator is scaled, not rounded to the activation
    dtype; with `a8`, --quantize w8a8, h quantized per row: _a8_einsum); float32 logits."""
    if tied:
        return jnp.einsum("...h,vh->...v", h, w, preferred_element_type=jnp.float32)
    if isinstance(w, dict) and a8:
        return _a8_einsum("...h,hv->...v", h, w, 1)
    if isinstance(w, dict):
        return jnp.einsum("...h,hv->...v", h, w["q"].astype(h.dtype), preferred_element_type=jnp.float32) * w["s"]
    return jnp.einsum("...h,hv->...v", h, w, preferred_element_type=jnp.float32)
