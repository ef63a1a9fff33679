"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa) as flax.nnx modules.

The module tree follows the HF checkpoint's names with the layer index dropped and query/key/
value fused (`embeddings.word_embeddings.weight`, `encoder.layer.attention.qkv.weight`,
`encoder.layer.output.LayerNorm.bias`, `classifier.out_proj.weight`), so loading is one table
(`TOP_TENSORS`, `LAYER_TENSORS`: module path <- the HF tensors it is made of). The worker splits
the module once (nnx.split) and its bucket programs are pure functions of the state pytree, which
`jax.jit` lowers once per bucket. The loader streams tensors straight into the module's
parameters (no module init, no shape inference from a dummy call, no second copy of the weights),
and per-layer weights are stacked on a leading axis so the layers run under `lax.scan`: XLA
compiles one layer body instead of N unrolled copies, which keeps warmup (dozens of bucket
programs) short.

Layout choices, all for speed: weights are stored [in, out] so `x @ w` needs no transpose, and
query/key/value are fused into one [hidden, 3*hidden] matmul. LayerNorm, softmax and pooling
run in float32 whatever the weight dtype, as HF does under autocast.

Two input layouts: padded [B, S] batches (`forward`; attention by XLA or, where the plan says,
the CPU kernel) and, where the CPU attention kernel serves every program size, inputs packed
back to back (`forward_packed`, `Packed`: TEI's layout; each input attends within its own tokens
through the kernel's varlen entry, so no padding row runs through the matrices).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_engine.checkpoint.hf import CheckpointError, CheckpointReader, read_config
from jax_engine.executor import backend
from jax_engine.kernels import cpu as cpu_kernels
from jax_engine.kernels.plan import MatmulPlan
from jax_engine.models import stacked
from jax_engine.models.registry import ARCHITECTURES, architecture_of

_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # HF "gelu" is the exact erf form
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}
POOLING_MODES = ("cls", "mean", "last")


@dataclass
class EncoderConfig:
    architecture: str
    model_type: str
    family: str                    # "bert" | "roberta" (position ids from padding_idx + 1)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    pad_token_id: int
    hidden_act: str
    task: str                      # "embed" | "classify"
    num_labels: int = 0
    id2label: dict[int, str] = field(default_factory=dict)
    pooling: str = "cls"
    normalize: bool = False
    dtype: str = "float32"
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    # CPU: which path (XLA's dot or the packed-panel kernel, jax_engine/kernels/cpu.cc) multiplies
    # each of MATRICES at each row count (batch x sequence); None = XLA's dot everywhere. Set by
    # the encode worker from --cpu-matmul (jax_engine/kernels/choose.py: configure_encoder).
    matmul_plan: Optional[MatmulPlan] = None

    @property
    def position_offset(self) -> int:
        """First position id of a real token (RoBERTa reserves 0..padding_idx)."""
        return self.pad_token_id + 1 if self.family == "roberta" else 0

    @property
    def max_len(self) -> int:
        """Longest input, special tokens included, that has position embeddings."""
        return self.max_position_embeddings - self.position_offset

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def output_dim(self) -> int:
        return self.num_labels if self.task == "classify" else self.hidden_size


# ---------------------------------------------------------------------------------------------
# config


def parse_config(cfg: dict, folder: Optional[str] = None, task: Optional[str] = None,
                 dtype: str = "float32") -> EncoderConfig:
    """EncoderConfig from a config.json dict (+ sentence-transformers files in `folder`)."""
    arch = architecture_of(cfg, kind="encoder")
    family, has_head = ARCHITECTURES[arch].family, ARCHITECTURES[arch].head
    task = task or ("classify" if has_head else "embed")
    if task == "classify" and not has_head:
        raise CheckpointError(f"architecture {arch} has no classification head; serve it as 'embed'")
    if task not in ("embed", "classify"):
        raise CheckpointError(f"encoder {arch} cannot serve task {task!r} (embed or classify)")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise CheckpointError(
            f"position_embedding_type {cfg['position_embedding_type']!r} is not supported (absolute only)")
    act = cfg.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise CheckpointError(f"hidden_act {act!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    if dtype not in backend.DTYPE_NAMES:
        raise CheckpointError(f"dtype {dtype!r} is not supported for encoders; use one of {sorted(backend.DTYPE_NAMES)}")
    dtype = jnp.dtype(backend.DTYPE_NAMES[dtype]).name
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    if hidden % heads:
        raise CheckpointError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    num_labels = _num_labels(cfg) if task == "classify" else 0
    pooling, normalize = _sentence_transformers_pooling(folder, task)
    return EncoderConfig(
        architecture=arch,
        model_type=cfg.get("model_type", family),
        family=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        intermediate_size=int(cfg["intermediate_size"]),
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        type_vocab_size=int(cfg.get("type_vocab_size", 2)),
        layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
        pad_token_id=_pad_token_id(cfg, family),
        hidden_act=act,
        task=task,
        num_labels=num_labels,
        id2label={int(k): str(v) for k, v in (cfg.get("id2label") or {}).items()} if num_labels else {},
        pooling=pooling,
        normalize=normalize,
        dtype=dtype,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
    )


def _pad_token_id(cfg: dict, family: str) -> int:
    """RoBERTa's padding_idx also fixes where position ids start, so its default (1) matters."""
    pad = cfg.get("pad_token_id")
    return int(pad) if pad is not None else (1 if family == "roberta" else 0)


def _num_labels(cfg: dict) -> int:
    if cfg.get("id2label"):
        return len(cfg["id2label"])
    return int(cfg.get("num_labels", 2))


def _sentence_transformers_pooling(folder: Optional[str], task: str) -> tuple[str, bool]:
    """(pooling mode, L2 normalize) from modules.json / 1_Pooling/config.json.

    Defaults: mean for sentence-transformers folders (that is its own default), cls otherwise
    (classification heads read the first token; plain HF encoders have no better convention).
    """
    modules = _read_json(os.path.join(folder, "modules.json")) if folder else None
    if task == "classify" or modules is None:
        return "cls", False
    pooling, normalize = "mean", False
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            pooling = _pooling_mode(os.path.join(folder, m.get("path", "")), pooling)
        else:
            # A Dense or other projection changes the vector; refuse rather than serve wrong output.
            raise CheckpointError(f"sentence-transformers module {m.get('type')!r} is not supported")
    return pooling, normalize


def _pooling_mode(pool_dir: str, default: str) -> str:
    pc = _read_json(os.path.join(pool_dir, "config.json"))
    if pc is None:
        return default
    if isinstance(pc.get("pooling_mode"), str):  # newer sentence-transformers spelling
        named = {"cls": "cls", "mean": "mean", "lasttoken": "last"}.get(pc["pooling_mode"])
        if named is None:
            raise CheckpointError(f"pooling mode {pc['pooling_mode']!r} is not supported; use cls/mean/lasttoken")
        return named
    flags = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_lasttoken": "last"}
    on = [k for k, v in pc.items() if k.startswith("pooling_mode_") and v]
    unsupported = [k for k in on if k not in flags]
    if unsupported or len(on) > 1:
        raise CheckpointError(f"pooling {on} is not supported; exactly one of {sorted(flags)} may be set")
    return flags[on[0]] if on else default


def _read_json(path: str) -> Optional[object]:
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e


# ---------------------------------------------------------------------------------------------
# weights


def load_encoder(path: str, dtype: str = "float32", task: Optional[str] = None,
                 ) -> tuple[EncoderConfig, "EncoderModel"]:
    """Config and the nnx module of the encoder in an HF folder, streamed tensor by tensor.

    Each tensor is read from the safetensors mmap, cast, and put on the device before the next
    is read; per-layer tensors of one kind are stacked on the host (one [layers, ...] buffer at a
    time, never the whole model) so the forward can scan over layers.
    """
    cfg = parse_config(read_config(path), path, task=task, dtype=dtype)
    reader = CheckpointReader(path)
    load = _TensorLoader(reader, _find_prefix(reader), np.dtype(backend.DTYPE_NAMES[dtype]))
    dims = {"h": cfg.hidden_size, "i": cfg.intermediate_size, "v": cfg.vocab_size, "p": cfg.max_position_embeddings,
            "t": cfg.type_vocab_size, "n": cfg.num_labels}
    tensors = {}
    for name, (sources, shape, linear) in TOP_TENSORS.items():
        tensors[name] = jax.device_put(load.joined(sources, tuple(dims[d] for d in shape), linear))
    for name, (sources, shape, linear) in LAYER_TENSORS.items():
        hf_shape = tuple(dims[d] for d in shape)
        tensors["encoder.layer." + name] = jax.device_put(np.stack([
            load.joined([f"encoder.layer.{i}.{s}" for s in sources], hf_shape, linear) for i in range(cfg.num_layers)]))
    if cfg.task == "classify":
        bert_head = (load.prefix + "pooler.dense", "classifier")
        names = bert_head if cfg.family == "bert" else ("classifier.dense", "classifier.out_proj")
        for mod, hf in zip(("classifier.dense", "classifier.out_proj"), names):
            out = "h" if mod == "classifier.dense" else "n"
            tensors[mod + ".weight"] = jax.device_put(load.joined([hf + ".weight"], (dims[out], dims["h"]), True, bare=True))
            tensors[mod + ".bias"] = jax.device_put(load.joined([hf + ".bias"], (dims[out],), False, bare=True))
    return cfg, build(tensors)


# module path <- (the HF tensors it is made of, concatenated on the output axis; their HF shape in
# dims h(idden), i(ntermediate), v(ocab), p(ositions), t(oken types); an [out, in] linear weight,
# stored [in, out]). Layer tensors are named within "encoder.layer.{i}." and stacked.
TOP_TENSORS: dict[str, tuple[tuple[str, ...], tuple[str, ...], bool]] = {
    "embeddings.word_embeddings.weight": (("embeddings.word_embeddings.weight",), ("v", "h"), False),
    "embeddings.position_embeddings.weight": (("embeddings.position_embeddings.weight",), ("p", "h"), False),
    "embeddings.token_type_embeddings.weight": (("embeddings.token_type_embeddings.weight",), ("t", "h"), False),
    "embeddings.LayerNorm.weight": (("embeddings.LayerNorm.weight",), ("h",), False),
    "embeddings.LayerNorm.bias": (("embeddings.LayerNorm.bias",), ("h",), False),
}
LAYER_TENSORS: dict[str, tuple[tuple[str, ...], tuple[str, ...], bool]] = {
    "attention.qkv.weight": (tuple(f"attention.self.{n}.weight" for n in ("query", "key", "value")), ("h", "h"), True),
    "attention.qkv.bias": (tuple(f"attention.self.{n}.bias" for n in ("query", "key", "value")), ("h",), False),
    **{f"{m}.{p}": ((f"{m}.{p}",), shape, p == "weight" and "LayerNorm" not in m)
       for m, shapes in (("attention.output.dense", (("h", "h"), ("h",))), ("attention.output.LayerNorm", (("h",), ("h",))),
                         ("intermediate.dense", (("i", "h"), ("i",))), ("output.dense", (("h", "i"), ("h",))),
                         ("output.LayerNorm", (("h",), ("h",))))
       for p, shape in zip(("weight", "bias"), shapes)},
}


def build(tensors: dict[str, Any]) -> "EncoderModel":
    """The module over `tensors` ({module path: array}); the head exists for cross-encoders."""
    t = dict(tensors)

    def dense(path: str, name: str = "") -> Dense:
        return Dense(name, t.pop(path + ".weight"), t.pop(path + ".bias"))

    def ln(path: str) -> LayerNorm:
        return LayerNorm(t.pop(path + ".weight"), t.pop(path + ".bias"))

    E, L = "embeddings.", "encoder.layer."
    emb = Embeddings(t.pop(E + "word_embeddings.weight"), t.pop(E + "position_embeddings.weight"),
                     t.pop(E + "token_type_embeddings.weight"), ln(E + "LayerNorm"))
    attn_out = AttentionOutput(dense(L + "attention.output.dense", "attn_out_w"), ln(L + "attention.output.LayerNorm"))
    layer = Layer(Attention(dense(L + "attention.qkv", "qkv_w"), attn_out),
                  Intermediate(dense(L + "intermediate.dense", "ffn_in_w")),
                  Output(dense(L + "output.dense", "ffn_out_w"), ln(L + "output.LayerNorm")))
    head = Classifier(dense("classifier.dense"), dense("classifier.out_proj")) if "classifier.dense.weight" in t else None
    if t:
        raise ValueError(f"tensors the encoder has no place for: {sorted(t)}")
    return EncoderModel(emb, Encoder(layer), head)


def _find_prefix(reader: CheckpointReader) -> str:
    for p in ("", "bert.", "roberta.", "model."):
        if f"{p}embeddings.word_embeddings.weight" in reader:
            return p
    raise CheckpointError(
        f"checkpoint {reader.path!r} has no embeddings.word_embeddings.weight "
        "(with or without a bert./roberta. prefix): not a BERT-family encoder")


class _TensorLoader:
    """Name resolution (prefix, LayerNorm gamma/beta spellings), shape checks and casting."""

    def __init__(self, reader: CheckpointReader, prefix: str, dtype: np.dtype):
        self.reader, self.prefix, self.dtype = reader, prefix, dtype

    def host(self, name: str, shape: tuple, linear: bool = False, bare: bool = False) -> np.ndarray:
        """One tensor (`shape` as HF stores it) as a host array in the final dtype; `linear`
        flips [out, in] to [in, out]."""
        full = name if bare else self.prefix + name
        found = self.reader.find(full, *_legacy_names(full)) or full
        arr = self.reader.get(found, shape)
        return np.asarray(arr.T if linear else arr).astype(self.dtype)

    def joined(self, names: list[str] | tuple[str, ...], shape: tuple, linear: bool, bare: bool = False) -> np.ndarray:
        """Tensors of one HF shape concatenated on the output axis (query, key, value -> qkv)."""
        parts = [self.host(n, shape, linear, bare) for n in names]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)


def _legacy_names(name: str) -> list[str]:
    if name.endswith("LayerNorm.weight"):
        return [name[: -len("weight")] + "gamma"]
    if name.endswith("LayerNorm.bias"):
        return [name[: -len("bias")] + "beta"]
    return []


def _position_ids(c: EncoderConfig, input_ids: jax.Array) -> jax.Array:
    if c.family == "roberta":
        # HF rule: real tokens count up from padding_idx + 1, pad tokens sit at padding_idx.
        real = (input_ids != c.pad_token_id).astype(jnp.int32)
        return jnp.cumsum(real, axis=1) * real + c.pad_token_id
    return jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)


# ---------------------------------------------------------------------------------------------
# the module tree


def _param(value: Any) -> nnx.Param:
    return nnx.Param(value, eager_sharding=False)


class LayerNorm(nnx.Module):
    def __init__(self, weight: Any, bias: Any):
        self.weight, self.bias = _param(weight), _param(bias)

    def __call__(self, x: jax.Array, eps: float) -> jax.Array:
        x = x.astype(jnp.float32)
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + eps) * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)


class Dense(nnx.Module):
    """A linear layer, weight [(L,) in, out] (HF's [out, in] transposed at load) and bias; `name`
    is its routing key (MATRICES) for a stacked layer matrix. `panels` holds the CPU kernel's
    packed copy when the plan routes it there, in place of `weight` when only the kernel reads it."""

    def __init__(self, name: str, weight: Any, bias: Any):
        self.name = name
        self.weight = nnx.data(_param(weight))
        self.bias = _param(bias)
        self.panels: Optional[nnx.Param] = nnx.data(None)

    def __call__(self, c: "EncoderConfig", x: jax.Array, li: Optional[jax.Array] = None,
                 gelu: bool = False, rows: Optional[jax.Array] = None) -> jax.Array:
        """x [B, S, K] (or [B, K]) @ this matrix (layer li's, on the path the plan names for the
        program's row count) + bias, then (`gelu`) HF's exact GELU: the bias and GELU in the
        kernel's own pass over each output tile for float32 panels (cpu.gemm_bias), in the library
        sgemm's call on its path (cpu.blas_gemm_bias; the weight then comes whole, [L, K, N]),
        else by XLA.
        `rows` (packed inputs: the tokens the inputs cover, the bucket's padding after them): the
        kernel computes only those rows and leaves zeros in the rest; XLA's dot computes them all."""
        m = math.prod(x.shape[:-1])
        path = c.matmul_plan.path(self.name, m) if li is not None and c.matmul_plan is not None else "xla"
        if path == "blas":      # float32 weights only (cpu.resolve), passed whole (Encoder)
            y = cpu_kernels.blas_gemm_bias(x.reshape(m, x.shape[-1]), self.weight[...], li, self.bias[...], gelu, rows)
            return y.reshape(x.shape[:-1] + y.shape[-1:]).astype(x.dtype)
        if path == "kernel":
            w = self.panels[...]
            if w.dtype == jnp.float32 and self.bias[...].dtype == jnp.float32:
                y = cpu_kernels.gemm_bias(x.reshape(m, x.shape[-1]), w, li, self.bias[...], gelu, rows)
                return y.reshape(x.shape[:-1] + y.shape[-1:]).astype(x.dtype)
            y = cpu_kernels.linear(x, w, li, 1, (matrix_dims(c)[self.name][1],), rows).astype(x.dtype)
        else:
            w = self.weight[...]
            y = x @ (w[li] if li is not None and w.ndim == 3 else w)     # 3-D: passed whole for the blas path
        y = y + self.bias[...]
        return _ACTIVATIONS["gelu"](y) if gelu else y


class Embed(nnx.Module):
    def __init__(self, weight: Any):
        self.weight = _param(weight)


class Embeddings(nnx.Module):
    def __init__(self, word: Any, position: Any, token_type: Any, ln: LayerNorm):
        self.word_embeddings, self.position_embeddings = Embed(word), Embed(position)
        self.token_type_embeddings, self.LayerNorm = Embed(token_type), ln

    def __call__(self, c: "EncoderConfig", input_ids: jax.Array, token_type_ids: jax.Array,
                 position_ids: jax.Array) -> jax.Array:
        x = (self.word_embeddings.weight[...][input_ids] + self.position_embeddings.weight[...][position_ids]
             + self.token_type_embeddings.weight[...][token_type_ids])
        return self.LayerNorm(x, c.layer_norm_eps)


class AttentionOutput(nnx.Module):
    def __init__(self, dense: Dense, ln: LayerNorm):
        self.dense, self.LayerNorm = dense, ln


class Attention(nnx.Module):
    def __init__(self, qkv: Dense, output: AttentionOutput):
        self.qkv, self.output = qkv, output


class Intermediate(nnx.Module):
    def __init__(self, dense: Dense):
        self.dense = dense


class Output(nnx.Module):
    def __init__(self, dense: Dense, ln: LayerNorm):
        self.dense, self.LayerNorm = dense, ln


class Layer(nnx.Module):
    """Every encoder layer, each parameter stacked on a leading layer axis."""

    def __init__(self, attention: Attention, intermediate: Intermediate, output: Output):
        self.attention, self.intermediate, self.output = attention, intermediate, output

    def __call__(self, c: "EncoderConfig", x: jax.Array, attend: Attend, li: jax.Array,
                 rows: Optional[jax.Array] = None) -> jax.Array:
        """One post-LN block (this layer's slice). x: [B, S, H] float32 residual stream (B = 1 for
        packed sequences); weights in the model dtype; `attend` maps the fused projection
        [B, S, 3 H D] to the attention's context [B, S, H D]; `rows` as Dense's."""
        at = self.attention
        dt = at.qkv.bias[...].dtype
        qkv = at.qkv(c, x.astype(dt), li, rows=rows)
        attn = at.output.dense(c, attend(qkv).astype(dt), li, rows=rows)
        x = at.output.LayerNorm(x + attn.astype(jnp.float32), c.layer_norm_eps)
        if fused_gelu_matrix(c):        # the kernel path fuses it into the projection
            inner = self.intermediate.dense(c, x.astype(dt), li, gelu=True, rows=rows)
        else:
            inner = _ACTIVATIONS[c.hidden_act](self.intermediate.dense(c, x.astype(dt), li, rows=rows))
        out = self.output.dense(c, inner, li, rows=rows)
        return self.output.LayerNorm(x + out.astype(jnp.float32), c.layer_norm_eps)


class Encoder(nnx.Module):
    def __init__(self, layer: Layer):
        self.layer = layer

    def __call__(self, c: "EncoderConfig", x: jax.Array, attend: Attend, rows: Optional[jax.Array] = None) -> jax.Array:
        # packed panels pass whole (the kernel takes the layer index), so the scan does not slice them
        def body(carry: tuple[jax.Array, jax.Array], layer: "Layer", _) -> tuple[jax.Array, jax.Array]:
            x, li = carry
            return layer(c, x, attend, li, rows), li + 1

        plan = c.matmul_plan
        blas = {n for n in MATRICES if plan is not None and "blas" in {p for _, p in dict(plan.routes)[n]}}
        blas_paths = {_MATRIX_PATHS[n] + ".weight" for n in blas}
        return stacked.scan(self.layer, lambda path: path.split(".")[-1] == "panels" or path in blas_paths,
                            c.num_layers, body, (x, jnp.int32(0)))[0]


class Classifier(nnx.Module):
    """Both HF heads are dense + tanh on the first token then a linear layer: one module serves
    (BERT's pooler.dense + classifier, RoBERTa's classifier.dense + classifier.out_proj)."""

    def __init__(self, dense: Dense, out_proj: Dense):
        self.dense, self.out_proj = dense, out_proj

    def __call__(self, c: "EncoderConfig", first: jax.Array) -> jax.Array:
        """Logits [B, num_labels] from each input's first token's hidden state [B, H]."""
        dt = self.dense.weight[...].dtype
        x = jnp.tanh(self.dense(c, first.astype(dt)))
        return self.out_proj(c, x).astype(jnp.float32)


class EncoderModel(nnx.Module):
    """A BERT-family encoder as served: embeddings, the stacked layers, and (cross-encoders) the
    classification head. Parameter paths follow HF's with the layer index dropped and
    query/key/value fused (`encoder.layer.attention.qkv.weight`)."""

    def __init__(self, embeddings: Embeddings, encoder: Encoder, classifier: Optional[Classifier]):
        self.embeddings, self.encoder = embeddings, encoder
        self.classifier = nnx.data(classifier)

    def encode(self, c: "EncoderConfig", input_ids: jax.Array, token_type_ids: jax.Array,
               attention_mask: jax.Array) -> jax.Array:
        """Last hidden state [B, S, H] float32. Inputs are [B, S] int32, right padded."""
        x = self.embeddings(c, input_ids, token_type_ids, _position_ids(c, input_ids))
        if attention_on_kernel(c, input_ids.size):
            def attend(qkv: jax.Array) -> jax.Array:
                return cpu_kernels.encoder_attention(qkv, attention_mask, c.num_heads, 1.0 / np.sqrt(c.head_dim))
        else:
            bias = attention_bias(attention_mask)

            def attend(qkv: jax.Array) -> jax.Array:
                return xla_attention(qkv, bias, c.num_heads)
        return self.encoder(c, x, attend)

    def encode_packed(self, c: "EncoderConfig", p: "Packed") -> jax.Array:
        """Last hidden state [T, H] float32 of inputs packed back to back (`Packed`); rows of
        tokens no input covers are padding nothing reads. Attention: the CPU kernel's varlen
        entry (each input attends within itself)."""
        x = self.embeddings(c, p.ids[None], p.types[None], p.positions[None])

        def attend(qkv: jax.Array) -> jax.Array:
            return cpu_kernels.encoder_attention_varlen(qkv[0], p.starts, p.lens, c.num_heads,
                                                        1.0 / np.sqrt(c.head_dim))[None]
        # the inputs fill the bucket's first sum(lens) tokens: the kernel skips the padding rows
        # after them (see Dense). A 37-token sentence in the 40-token program: 5.33 -> 4.90 ms a
        # program (all-MiniLM-L6-v2, 2-vCPU Zen 4, medians of 500, alternating builds)
        return self.encoder(c, x, attend, jnp.sum(p.lens))[0]


def attention_bias(attention_mask: jax.Array) -> jax.Array:
    """[B, 1, 1, S] additive score bias: 0 at real keys, a finite large negative (not -inf, so an
    all-padding row of a bucket stays NaN-free) at padding."""
    return jnp.where(attention_mask[:, None, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)


def xla_attention(qkv: jax.Array, mask_bias: jax.Array, heads: int) -> jax.Array:
    """XLA's path for the self-attention of qkv [B, S, 3 H D] (the fused projection) under
    mask_bias (`attention_bias`): [B, S, H D] in qkv's dtype, scores and softmax in float32."""
    b, s, w = qkv.shape
    d = w // (3 * heads)
    q, k, v = jnp.split(qkv.reshape(b, s, 3, heads, d), 3, axis=2)
    q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(scores / np.sqrt(d) + mask_bias, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(qkv.dtype), v).reshape(b, s, heads * d)


Attend = Callable[[jax.Array], jax.Array]     # fused projection [B, S, 3 H D] -> context [B, S, H D]
MATRICES = ("qkv_w", "attn_out_w", "ffn_in_w", "ffn_out_w")
# each matrix's Dense inside a Layer (dotted nnx path), as layer_matrices finds it
_MATRIX_PATHS = {"qkv_w": "attention.qkv", "attn_out_w": "attention.output.dense", "ffn_in_w": "intermediate.dense",
                 "ffn_out_w": "output.dense"}
ATTENTION = "attention"      # the self-attention's route in the plan (XLA's path or cpu.encoder_attention)


def matrix_dims(c: EncoderConfig) -> dict[str, tuple[int, int]]:
    """(K, N) of each layer matrix, [in, out] as stored."""
    h, i = c.hidden_size, c.intermediate_size
    return {"qkv_w": (h, 3 * h), "attn_out_w": (h, h), "ffn_in_w": (h, i), "ffn_out_w": (i, h)}


def fused_gelu_matrix(c: EncoderConfig) -> Optional[str]:
    """The layer matrix whose product the kernel path finishes with the GELU (Layer: the exact
    erf form only), or None."""
    return "ffn_in_w" if c.hidden_act == "gelu" else None


def attention_on_kernel(c: EncoderConfig, tokens: Optional[int] = None) -> bool:
    """Whether the plan routes the self-attention to the CPU kernel for a program of `tokens`
    tokens, or (None) for programs of every size, as the packed layout needs."""
    plan = c.matmul_plan
    if plan is None or ATTENTION not in dict(plan.routes):
        return False
    return plan.layouts(ATTENTION) == {"kernel"} if tokens is None else plan.path(ATTENTION, tokens) == "kernel"


def attention_dims(c: EncoderConfig) -> Optional[tuple[int, int]]:
    """(heads, head_dim) when the CPU attention kernel takes this model's heads, else None."""
    return (c.num_heads, c.head_dim) if cpu_kernels.encoder_attention_fits(c.head_dim) else None


def layer_matrices(model: "EncoderModel") -> dict[str, "Dense"]:
    ly = model.encoder.layer
    return {"qkv_w": ly.attention.qkv, "attn_out_w": ly.attention.output.dense, "ffn_in_w": ly.intermediate.dense,
            "ffn_out_w": ly.output.dense}


def pack_for_kernel(model: "EncoderModel", c: EncoderConfig) -> "EncoderModel":
    """The matrices the plan routes to the CPU kernel get packed panels; one only the kernel
    serves loses its XLA layout. Unchanged without a plan. In place; returns the model."""
    if c.matmul_plan is None:
        return model
    for name, d in layer_matrices(model).items():
        paths = c.matmul_plan.layouts(name)
        if "kernel" in paths:
            w = d.weight[...]
            d.panels = _param(cpu_kernels.pack(w, 1, stacked=True))
            if "xla" not in paths:
                d.weight = None
    return model


def count_params(model: "EncoderModel") -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(nnx.state(model))))


def forward(model: "EncoderModel", c: EncoderConfig, input_ids: jax.Array, token_type_ids: jax.Array,
            attention_mask: jax.Array) -> jax.Array:
    """What a served encoder returns: pooled vectors [B, H] or classifier logits [B, num_labels]."""
    hidden = model.encode(c, input_ids, token_type_ids, attention_mask)
    if c.task == "classify":
        return model.classifier(c, hidden[:, 0])
    return pool(c, hidden, attention_mask)


@jax.tree_util.register_dataclass
@dataclass
class Packed:
    """Inputs packed back to back (TEI's layout), one program's worth: T tokens (a token
    bucket), room for S inputs. Input s is tokens [starts[s], starts[s] + lens[s]); the inputs
    fill tokens [0, sum(lens)) back to back (encode_packed skips the rest in the kernel's
    matrices); unused slots have lens 0; tokens past the last input are padding."""

    ids: jax.Array          # [T] int32
    types: jax.Array        # [T] int32
    positions: jax.Array    # [T] int32 position ids (`packed_positions`)
    segments: jax.Array     # [T] int32 the input each token belongs to (S: padding)
    starts: jax.Array       # [S] int32
    lens: jax.Array         # [S] int32


def packed_positions(c: EncoderConfig, ids: np.ndarray) -> np.ndarray:
    """Position ids of one input as `_position_ids` gives them in a padded row (RoBERTa counts
    real tokens from padding_idx + 1)."""
    if c.family == "roberta":
        real = (ids != c.pad_token_id).astype(np.int32)
        return (np.cumsum(real) * real + c.pad_token_id).astype(np.int32)
    return np.arange(ids.size, dtype=np.int32)


def forward_packed(model: "EncoderModel", c: EncoderConfig, p: Packed) -> jax.Array:
    """`forward` for packed inputs: [S, H] pooled vectors or [S, num_labels] logits (rows of
    unused slots are meaningless)."""
    hidden = model.encode_packed(c, p)
    first = hidden[p.starts]
    if c.task == "classify":
        return model.classifier(c, first)
    if c.pooling == "cls":
        return first
    if c.pooling == "mean":
        n = p.starts.shape[0]
        sums = jax.ops.segment_sum(hidden, p.segments, num_segments=n + 1)[:n]       # padding: segment n
        return sums / jnp.maximum(p.lens, 1).astype(jnp.float32)[:, None]
    return hidden[jnp.maximum(p.starts + p.lens - 1, 0)]


def pool(c: EncoderConfig, hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """[B, H] float32 by the model's pooling mode (as sentence-transformers computes it)."""
    if c.pooling == "cls":
        return hidden[:, 0]
    m = attention_mask.astype(jnp.float32)
    if c.pooling == "mean":
        return (hidden * m[..., None]).sum(1) / jnp.maximum(m.sum(1, keepdims=True), 1e-9)
    last = jnp.maximum(attention_mask.sum(1) - 1, 0)  # right padding: last real token
    return jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """Row-wise L2 normalization as torch.nn.functional.normalize (eps 1e-12)."""
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
