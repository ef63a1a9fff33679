"""The Llama-family decoder as `flax.nnx` modules whose parameter paths follow Hugging Face names.

One module tree serves every decoder family (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3, Mixtral,
Qwen3-MoE); jax_engine/models/llama.py holds the configuration, RoPE and the building blocks.
The tree mirrors the HF checkpoint, with the fused projections vLLM uses and the layer index
dropped (layers are stacked on a leading axis):

  model.embed_tokens.weight                       [V, H]
  model.layers.input_layernorm.weight             [L, H]
  model.layers.self_attn.qkv_proj.weight          [L, H, KVH, G+2, D]   (q_proj, k_proj, v_proj)
  model.layers.self_attn.qkv_proj.bias            [L, KVH, G+2, D]      (Qwen2)
  model.layers.self_attn.{q_norm,k_norm}.weight   [L, D]                (Qwen3, Gemma 3)
  model.layers.self_attn.o_proj.weight            [L, KVH, G, D, H]
  model.layers.self_attn.o_proj.bias              [L, H]                (Llama's attention_bias)
  model.layers.post_attention_layernorm.weight    [L, H]
  model.layers.{pre,post}_feedforward_layernorm.weight                  (Gemma's sandwich norms)
  model.layers.mlp.gate_up_proj.weight            [L, H, 2, I]          (gate_proj, up_proj)
  model.layers.mlp.down_proj.weight               [L, I, H]
  model.layers.mlp.gate.weight                    [L, H, E]             (MoE router)
  model.layers.mlp.experts.{gate_up_proj,down_proj}.weight  [L, E, H, 2, I], [L, E, I, H]
  model.norm.weight                               [H]
  lm_head.weight                                  [H, V]                (absent when tied)

so loading (llama_weights.py) is a table from HF names to these paths, and the converted
checkpoint stores each tensor under its path. A weight-only int8 matrix has `weight` (int8) and
`scale` (float32, per output channel); a matrix the CPU kernel serves has `panels` (and
`panels_scale`), in place of `weight` when only the kernel reads it (jax_engine/kernels/cpu.py).
Every parameter carries its tensor-parallel partition spec as nnx sharding metadata, read from
the one table jax_engine/checkpoint/layout.py.

Why modules and still pure functions: the engine splits the module once (`nnx.split`) into a
graph definition and a state pytree, and its compiled programs are pure functions of that state
(`nnx.merge` inside the trace costs nothing at run time), so buckets, donation and shardings stay
the runner's. The layers run under `lax.scan` over the stacked state; a matrix routed to the CPU
kernel or the library sgemm is kept whole (not sliced per layer) and indexed by the layer inside
the custom call, which saved a per-layer weight copy (models/moe.py measured 73 vs 3.2 ms per MoE
layer at T 1 for the same reason).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_engine import attention
from jax_engine.checkpoint import layout
from jax_engine.kernels import cpu as cpu_kernels
from jax_engine.models import lora as lora_terms
from jax_engine.models import moe, stacked
from jax_engine.models.llama import (
    K_DIMS,
    SPECS,
    LlamaConfig,
    StepInputs,
    head_einsum,
    layouts_of,
    linear,
    matmul_path,
    rms_norm,
    rope,
    token_inv_freq,
)

Bank = lora_terms.Bank


def param(name: str, value: Any) -> nnx.Param:
    """Tensor `name`'s parameter with its partition spec (layout.LAYOUT) as nnx sharding
    metadata; the loader places the arrays, so no eager sharding here."""
    return nnx.Param(value, out_sharding=tuple(layout.spec_of(name)), eager_sharding=False)


class Norm(nnx.Module):
    """RMSNorm weight (float32; Gemma's +1 is folded in at load)."""

    def __init__(self, path: str, value: Any):
        self.weight = param(path + ".weight", value)

    def __call__(self, x: jax.Array, eps: float) -> jax.Array:
        return rms_norm(x, self.weight[...], eps)


class Linear(nnx.Module):
    """One matrix of the decoder (stacked over layers, or the LM head) and the paths that read it.

    `name` is its routing key ("qkv", "o", "gate_up", "down", "lm_head": llama.MATRICES);
    `weight`/`scale` are XLA's layout (absent when only the kernel reads it), `panels`/
    `panels_scale` the CPU kernel's packed layout (absent unless the kernel reads it)."""

    def __init__(self, path: str, name: str, weight: Any, scale: Any = None, bias: Any = None):
        self.path, self.name = path, name
        # optional slots are declared data (nnx.data), so a later set_panels or drop is allowed
        self.weight = nnx.data(param(path + ".weight", weight) if weight is not None else None)
        self.scale = nnx.data(param(path + layout.SCALE, scale) if scale is not None else None)
        self.bias = nnx.data(param(path + ".bias", bias) if bias is not None else None)
        self.panels: Optional[nnx.Param] = nnx.data(None)
        self.panels_scale: Optional[nnx.Param] = nnx.data(None)

    def xla_weight(self) -> Any:
        """The weight as llama.linear / cpu.blas_* take it: an array or int8 {"q", "s"}."""
        assert self.weight is not None, f"{self.path} has no XLA layout"
        w = self.weight[...]
        return {"q": w, "s": self.scale[...]} if self.scale is not None else w

    def kernel_weight(self) -> Any:
        """The packed panels as cpu.linear takes them: an array or int8 {"q", "s"}."""
        assert self.panels is not None, f"{self.path} has no packed panels"
        p = self.panels[...]
        return {"q": p, "s": self.panels_scale[...]} if self.panels_scale is not None else p

    def set_panels(self, packed: Any, keep_xla: bool) -> None:
        """Attach the kernel's packed layout; drop XLA's when only the kernel reads this matrix."""
        if isinstance(packed, dict):
            self.panels = nnx.Param(packed["q"], eager_sharding=False)
            self.panels_scale = nnx.Param(packed["s"], eager_sharding=False)
        else:
            self.panels = nnx.Param(packed, eager_sharding=False)
        if not keep_xla:
            self.weight, self.scale = None, None


def kept_whole(path: str, cfg: LlamaConfig, m: int) -> bool:
    """Whether the scan hands variable `path` (relative to the layers module) whole rather than
    sliced per layer: packed panels and a library-sgemm weight are indexed by the layer inside
    the custom call, MoE experts inside models/moe.py; everything else is sliced by the scan."""
    parts = path.split(".")
    if parts[-1] in ("panels", "panels_scale") or "experts" in parts:
        return True
    if parts[-1] == "weight" and parts[-2] in _LINEAR_NAMES:
        return matmul_path(cfg, _LINEAR_NAMES[parts[-2]], m) == "blas"
    return False


def matmul(cfg: LlamaConfig, lin: Linear, li: jax.Array, v: jax.Array, out_tail: tuple[int, ...], m: int,
           live: Optional[jax.Array] = None) -> jax.Array:
    """One layer matmul of a program with m rows, on the path cfg routes it to; `li` is the layer
    index (the kernel and the library sgemm read the stacked weight), out_tail the unsharded
    output dims (what the kernel path needs). `live` (a scalar, or None): rows past it are
    padding; the kernel path skips them (zeros), the others compute them."""
    path = matmul_path(cfg, lin.name, m)
    if path == "kernel":
        return kernel_matmul(lin, li, v, out_tail, live).astype(v.dtype)
    if path == "blas":
        return cpu_kernels.blas_linear(v, lin.weight[...], li, K_DIMS[lin.name]).astype(v.dtype)
    return linear(v, lin.xla_weight(), SPECS[lin.name], K_DIMS[lin.name] if cfg.act_int8 else 0)


def kernel_matmul(lin: Linear, li: jax.Array, v: jax.Array, out_tail: tuple[int, ...],
                  live: Optional[jax.Array]) -> jax.Array:
    """The CPU kernel's float32 product for matmul (which rounds it to v's dtype) and for the
    bfloat16 gated activation (glu_on_kernel: which rounds it itself)."""
    return cpu_kernels.linear(v, lin.kernel_weight(), li, K_DIMS[lin.name], out_tail, live)


def gate_activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """The MLP gate's activation (silu | gelu_tanh), computed in float32 and rounded to the input's
    dtype once, as torch's kernels compute it for bfloat16 tensors (written in bfloat16, XLA would
    round after each of its five elementwise ops). A no-op cast for float32 models. On the CPU
    kernel path a bfloat16 model runs the whole act(gate) * up in cpu.cc instead (glu_on_kernel)."""
    base = (lambda v: jax.nn.gelu(v, approximate=True)) if name == "gelu_tanh" else jax.nn.silu
    return lambda v: base(v.astype(jnp.float32)).astype(v.dtype)


def glu_on_kernel(cfg: LlamaConfig, m: int, dtype: Any, lora: bool) -> bool:
    """Whether a program's gated MLP activation runs as cpu.cc's kernel (cpu_kernels.glu): a
    bfloat16 model whose gate_up projection takes the CPU kernel at m rows, without a LoRA term
    (which adds to the rounded projection). Measured: XLA's fusion of it took 33 us a layer at
    batch 1 and ~100 us at batch 16, 7-9 % of a bfloat16 decode step (cpu.cc says why)."""
    return (not lora and jnp.dtype(dtype) == jnp.bfloat16 and cfg.act in cpu_kernels.GLU_ACTS
            and matmul_path(cfg, "gate_up", m) == "kernel")


def scan_layers(layers: "Layers", cfg: LlamaConfig, m: int, body: Callable, init: Any, extra: Any = None) -> Any:
    """`lax.scan` of body(carry, layer, extra_slice) -> carry over the stacked layers of a program
    with m rows: `layer` is the Layers module merged from this layer's slice of the sliced state
    and the whole kept state (`kept_whole`), `extra` (e.g. the LoRA bank, or None) is sliced
    along with it. Returns the final carry."""
    return stacked.scan(layers, lambda path: kept_whole(path, cfg, m), cfg.num_layers, body, init, extra)


_LINEAR_NAMES = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down"}


class Attention(nnx.Module):
    def __init__(self, qkv_proj: Linear, o_proj: Linear, q_norm: Optional[Norm], k_norm: Optional[Norm]):
        self.qkv_proj, self.o_proj = qkv_proj, o_proj
        self.q_norm, self.k_norm = nnx.data(q_norm), nnx.data(k_norm)


class Experts(nnx.Module):
    """Every expert's gate/up and down of every layer, [L, E, H, 2, I] and [L, E, I, H] (int8:
    with per-expert, per-output-channel scales), read by models/moe.py."""

    def __init__(self, gate_up_proj: Linear, down_proj: Linear):
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj


class Router(nnx.Module):
    def __init__(self, weight: Any):
        self.weight = param("model.layers.mlp.gate.weight", weight)


class MoE(nnx.Module):
    def __init__(self, gate: Router, experts: Experts):
        self.gate, self.experts = gate, experts


class MLP(nnx.Module):
    def __init__(self, gate_up_proj: Linear, down_proj: Linear):
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj


class Layers(nnx.Module):
    """All decoder layers, each parameter stacked on a leading layer axis."""

    def __init__(self, input_layernorm: Norm, self_attn: Attention, post_attention_layernorm: Norm,
                 mlp: MLP | MoE, pre_feedforward_layernorm: Optional[Norm] = None,
                 post_feedforward_layernorm: Optional[Norm] = None):
        self.input_layernorm, self.self_attn = input_layernorm, self_attn
        self.post_attention_layernorm, self.mlp = post_attention_layernorm, mlp
        self.pre_feedforward_layernorm = nnx.data(pre_feedforward_layernorm)
        self.post_feedforward_layernorm = nnx.data(post_feedforward_layernorm)


class Embed(nnx.Module):
    def __init__(self, weight: Any):
        self.weight = param("model.embed_tokens.weight", weight)


class Model(nnx.Module):
    def __init__(self, embed_tokens: Embed, layers: Layers, norm: Norm):
        self.embed_tokens, self.layers, self.norm = embed_tokens, layers, norm


class CausalLM(nnx.Module):
    """The decoder: `__call__` runs the layers of one ragged step, `logits` the LM head."""

    def __init__(self, cfg: LlamaConfig, model: Model, lm_head: Optional[Linear]):
        self.cfg = cfg
        self.model, self.lm_head = model, nnx.data(lm_head)

    # ------------------------------------------------------------------ forward
    def __call__(self, k_cache: jax.Array, v_cache: jax.Array, inp: StepInputs, page_size: int,
                 lora: Optional[tuple[Bank, jax.Array]] = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Run all layers; returns (final-normed hidden [T, H], k_cache, v_cache).

        `lora` = (the adapter bank [L, S, ...] of jax_engine/lora/bank.py, each token's 1-based
        slot [T], 0 = none): every layer matrix gets its tokens' LoRA term. The runner passes None
        for a step without an adapter row (a program compiled without the term).

        The caches' layout belongs to the attention backend (jax_engine/attention/; the
        reference's is [L, num_pages * page_size, KVH, D]); they travel in the scan carry and are
        updated with scatters so a donated buffer is written in place."""
        cfg = self.cfg
        G = cfg.num_heads // (cfg.num_kv_heads * cfg.kv_repeat)      # query heads per (replicated) KV head
        # activations are [1, T, ...]: the layouts' einsums (SPECS) and the CPU kernels take a
        # [B, Tq] lead; attention sees the flat [T, ...] view
        x = self.model.embed_tokens.weight[...][inp.tokens][None]    # [1, T, H]
        if cfg.embed_scale != 1.0:        # Gemma: the scale is rounded to the embedding's dtype first
            x = x * jnp.asarray(cfg.embed_scale, x.dtype)
        q_pos = inp.positions[None]
        inv_freq = token_inv_freq(cfg, q_pos)                        # [D/2] or per token [1, T, D/2]
        windowed = jnp.asarray(np.array(cfg.layer_windows or [0] * cfg.num_layers) > 0)      # [L]
        local_freq = jnp.asarray(np.array(cfg.inv_freq_local, dtype=np.float32)) if cfg.inv_freq_local else None
        q_scale = cfg.attn_scale * math.sqrt(cfg.head_dim) if cfg.attn_scale else 1.0   # backends scale by 1/sqrt(D)
        act_fn = gate_activation(cfg.act)
        attn = attention.get(cfg.attention_backend)
        meta = attn.prepare(cfg, inp, page_size)                     # masks / kernel metadata, once per step
        M = math.prod(inp.tokens.shape)                              # rows of every layer matmul in this program
        kvh_r = cfg.num_kv_heads * cfg.kv_repeat

        bank = lora[0] if lora is not None else None
        lora_mask = (lora_terms.token_mask(lora[1], *bank["down_a"].shape[-2:], x.dtype)   # [T, S*R]
                     if lora is not None else None)

        # the step's real tokens (padding tokens come last): the CPU kernel computes only those
        # rows, so a bucket's padding costs little. 'small' model, a 128-token prompt beside 4
        # streams (132 tokens in the 160 bucket), 2-vCPU AMX Xeon: 90.9 -> 80.3 ms a step
        live = inp.cu_q_lens[inp.num_rows[0]]

        def mm(lin: Linear, li, v, out_tail) -> jax.Array:
            return matmul(cfg, lin, li, v, out_tail, M, live)

        def plus_lora(lb: Optional[Bank], y, term: Callable[[Bank], jax.Array]):
            """y [1, T, ...] plus its LoRA term (term(this layer's bank slice): [T, ...])."""
            return y if lb is None else y + term(lb)[None].astype(y.dtype)

        def layer(carry, ly: Layers, lb: Optional[Bank]):
            x, kc, vc, li = carry
            at = ly.self_attn
            h = ly.input_layernorm(x, cfg.rms_eps)
            qkv = mm(at.qkv_proj, li, h, (kvh_r, G + 2, cfg.head_dim))   # [B, Tq, KVH, G+2, D]
            qkv = plus_lora(lb, qkv, lambda b: lora_terms.qkv_delta(h[0], b, lora_mask))
            if at.qkv_proj.bias is not None:
                qkv = qkv + at.qkv_proj.bias[...].astype(qkv.dtype)
            q, k, v = qkv[..., :G, :], qkv[..., G, :], qkv[..., G + 1, :]
            if at.q_norm is not None:
                q = at.q_norm(q, cfg.rms_eps)
                k = at.k_norm(k, cfg.rms_eps)
            freq = inv_freq if local_freq is None else jnp.where(windowed[li], local_freq, inv_freq)
            q = rope(q, q_pos, freq, cfg.rope_attention_factor)
            k = rope(k, q_pos, freq, cfg.rope_attention_factor)
            if q_scale != 1.0:
                q = (q.astype(jnp.float32) * q_scale).astype(q.dtype)
            kc, vc = attn.write(kc, vc, li, k[0], v[0], meta)
            a = attn.attend(q[0], kc, vc, li, meta).astype(x.dtype)[None]   # [1, T, KVH, G, D]
            o = plus_lora(lb, mm(at.o_proj, li, a, (cfg.hidden_size,)), lambda b: lora_terms.o_delta(a[0], b, lora_mask))
            if at.o_proj.bias is not None:
                o = o + at.o_proj.bias[...].astype(o.dtype)
            if ly.pre_feedforward_layernorm is not None:     # Gemma: post-attention norm, then pre-MLP norm
                x = x + ly.post_attention_layernorm(o, cfg.rms_eps)
                h = ly.pre_feedforward_layernorm(x, cfg.rms_eps)
            else:
                x = x + o
                h = ly.post_attention_layernorm(x, cfg.rms_eps)
            if isinstance(ly.mlp, MoE):
                ex = ly.mlp.experts
                d = moe.moe_mlp(h[0], ly.mlp.gate.weight[...], ex.gate_up_proj.xla_weight(), ex.down_proj.xla_weight(),
                                cfg.experts_per_token, cfg.normalize_top_k, act_fn, layer=li)[None]
                return x + d, kc, vc, li + 1
            mlp = ly.mlp
            if glu_on_kernel(cfg, M, h.dtype, lb is not None):     # float32 projection -> bfloat16 act
                gu = kernel_matmul(mlp.gate_up_proj, li, h, (2, cfg.intermediate_size), live)
                act = cpu_kernels.glu(gu, cfg.act, live)
            else:
                gu = mm(mlp.gate_up_proj, li, h, (2, cfg.intermediate_size))
                gu = plus_lora(lb, gu, lambda b: lora_terms.gate_up_delta(h[0], b, lora_mask))
                act = act_fn(gu[..., 0, :]) * gu[..., 1, :]
            d = plus_lora(lb, mm(mlp.down_proj, li, act, (cfg.hidden_size,)),
                          lambda b: lora_terms.down_delta(act[0], b, lora_mask))
            if ly.post_feedforward_layernorm is not None:
                d = ly.post_feedforward_layernorm(d, cfg.rms_eps)
            return x + d, kc, vc, li + 1

        x, k_cache, v_cache, _ = scan_layers(self.model.layers, cfg, M, layer, (x, k_cache, v_cache, jnp.int32(0)), bank)
        return self.model.norm(x[0], cfg.rms_eps), k_cache, v_cache

    # ------------------------------------------------------------------ head
    def logits(self, h: jax.Array) -> jax.Array:
        """Logits in float32 for hidden states [..., H] (Gemma: soft-capped)."""
        y = self.head_matmul(h)
        if self.cfg.final_softcap:
            y = jnp.tanh(y / self.cfg.final_softcap) * self.cfg.final_softcap
        return y

    def head_matmul(self, h: jax.Array) -> jax.Array:
        """The LM-head matmul alone (float32 logits before any soft-capping), on the routed path."""
        cfg = self.cfg
        path = matmul_path(cfg, "lm_head", math.prod(h.shape[:-1]))
        if path == "kernel":
            return cpu_kernels.linear(h, self.lm_head.kernel_weight(), 0, 1, (cfg.vocab_size,))
        embed = self.model.embed_tokens.weight
        if path == "blas":                 # tied: sgemm reads the [V, H] embedding transposed
            w = embed[...] if cfg.tie_embeddings else self.lm_head.weight[...]
            y = cpu_kernels.blas_gemm(h.reshape(-1, h.shape[-1]), w[None], 0, trans_b=cfg.tie_embeddings)
            return y.reshape(h.shape[:-1] + (cfg.vocab_size,))
        if cfg.tie_embeddings:
            return head_einsum(h, embed[...], tied=True)
        return head_einsum(h, self.lm_head.xla_weight(), tied=False, a8=cfg.act_int8)


# --------------------------------------------------------------------------- building the tree
def build(cfg: LlamaConfig, tensors: dict[str, Any]) -> CausalLM:
    """The module over `tensors` ({path: array}, the paths of this module's docstring; an int8
    matrix as "<path>.weight" int8 and "<path>.scale"). Which submodules exist follows the config
    (biases, q/k norms, Gemma's norms, MoE), so the tree itself documents the family."""
    t = dict(tensors)

    def take(path: str) -> Any:
        return t.pop(path)

    def opt(path: str) -> Any:
        return t.pop(path, None)

    def lin(path: str, name: str, bias: bool = False) -> Linear:
        return Linear(path, name, take(path + ".weight"), opt(path + layout.SCALE), take(path + ".bias") if bias else None)

    def norm(path: str) -> Norm:
        return Norm(path, take(path + ".weight"))

    L = "model.layers."
    A = L + "self_attn."
    attn = Attention(lin(A + "qkv_proj", "qkv", bias=cfg.qkv_bias), lin(A + "o_proj", "o", bias=cfg.o_bias),
                     norm(A + "q_norm") if cfg.qk_norm else None, norm(A + "k_norm") if cfg.qk_norm else None)
    if cfg.num_experts:
        mlp: MLP | MoE = MoE(Router(take(L + "mlp.gate.weight")),
                             Experts(lin(L + "mlp.experts.gate_up_proj", "experts_gate_up"),
                                     lin(L + "mlp.experts.down_proj", "experts_down")))
    else:
        mlp = MLP(lin(L + "mlp.gate_up_proj", "gate_up"), lin(L + "mlp.down_proj", "down"))
    sandwich = cfg.sandwich_norms
    layers = Layers(norm(L + "input_layernorm"), attn, norm(L + "post_attention_layernorm"), mlp,
                    norm(L + "pre_feedforward_layernorm") if sandwich else None,
                    norm(L + "post_feedforward_layernorm") if sandwich else None)
    model = Model(Embed(take("model.embed_tokens.weight")), layers, norm("model.norm"))
    head = None if cfg.tie_embeddings else lin("lm_head", "lm_head")
    if t:
        raise ValueError(f"tensors the {cfg.model_type} module has no place for: {sorted(t)}")
    return CausalLM(cfg, model, head)


def linears(m: CausalLM) -> dict[str, Linear]:
    """The matrices llama.MATRICES names, by routing key (the LM head only when untied)."""
    out: dict[str, Linear] = {"qkv": m.model.layers.self_attn.qkv_proj, "o": m.model.layers.self_attn.o_proj}
    if isinstance(m.model.layers.mlp, MLP):
        out.update(gate_up=m.model.layers.mlp.gate_up_proj, down=m.model.layers.mlp.down_proj)
    if m.lm_head is not None:
        out["lm_head"] = m.lm_head
    return out


def pack_for_kernel(m: CausalLM) -> CausalLM:
    """Give the matrices the kernel serves (all with cfg.matmul == "kernel"; those the plan routes
    to it with "mixed") the kernel's packed panels; a matrix only the kernel serves loses its XLA
    layout. Tied embeddings get an LM head holding only the packed embed^T. In place; returns m."""
    cfg = m.cfg
    if cfg.matmul in ("xla", "blas"):
        return m
    embed = m.model.embed_tokens.weight[...]
    mats = linears(m)
    if "kernel" in layouts_of(cfg, "lm_head") and cfg.tie_embeddings:
        m.lm_head = Linear("lm_head", "lm_head", None)
        m.lm_head.set_panels(cpu_kernels.pack(embed.T, 1, stacked=False), keep_xla=False)
    for name, lin_ in mats.items():
        lay = layouts_of(cfg, name)
        if "kernel" not in lay:
            continue
        stacked = name != "lm_head"
        packed = cpu_kernels.pack(lin_.xla_weight(), K_DIMS.get(name, 1), stacked=stacked, a8=cfg.act_int8)
        lin_.set_panels(packed, keep_xla="xla" in lay)
    return m


def split(m: CausalLM) -> tuple[nnx.GraphDef, nnx.State]:
    """The graph definition (static, closed over by every compiled program) and the state pytree
    (the programs' argument)."""
    return nnx.split(m)


def merge(graphdef: nnx.GraphDef, state: nnx.State) -> CausalLM:
    return nnx.merge(graphdef, state)


def shardings(state: nnx.State, mesh: Mesh) -> Any:
    """The state's NamedShardings on `mesh`, from its parameters' sharding metadata (mesh axes
    the mesh lacks dropped; the kernel's panels, which carry none, replicated)."""
    specs = nnx.get_partition_spec(state)
    return jax.tree.map(lambda s: NamedSharding(mesh, layout.on_mesh(s, mesh)), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def count_params(cfg: LlamaConfig) -> int:
    H, V, FF, L = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.num_layers
    nh, kvh, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    mlp = cfg.num_experts * (3 * H * FF + H) if cfg.num_experts else 3 * H * FF
    per_layer = H * (nh + 2 * kvh) * D + nh * D * H + mlp + 2 * H
    return V * H * (1 if cfg.tie_embeddings else 2) + L * per_layer + H
