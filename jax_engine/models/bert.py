"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa) as plain JAX functions.

Why plain functions over a params pytree rather than flax.linen modules: the serving path needs
exactly one thing from a model, a pure `forward(params, batch)` that `jax.jit` can lower once per
bucket. A dict of arrays is what the loader streams tensors into (no module init, no shape
inference from a dummy call, no second copy of the weights), and per-layer weights are stacked
on a leading axis so the layers run under `lax.scan`: XLA compiles one layer body instead of
N unrolled copies, which keeps warmup (dozens of bucket programs) short.

Layout choices, all for speed: weights are stored [in, out] so `x @ w` needs no transpose, and
query/key/value are fused into one [hidden, 3*hidden] matmul. LayerNorm, softmax and pooling
run in float32 whatever the weight dtype, as HF does under autocast.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_engine.checkpoint.hf import CheckpointError, CheckpointReader, read_config
from jax_engine.executor import backend
from jax_engine.kernels import cpu as cpu_kernels
from jax_engine.kernels.plan import MatmulPlan
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
                 ) -> tuple[EncoderConfig, dict]:
    """Config and device params of the encoder in an HF folder, streamed tensor by tensor.

    Each tensor is read from the safetensors mmap, cast, and put on the device before the next
    is read; per-layer tensors of one kind are stacked on the host (one [layers, ...] buffer at a
    time, never the whole model) so the forward can scan over layers.
    """
    cfg = parse_config(read_config(path), path, task=task, dtype=dtype)
    reader = CheckpointReader(path)
    prefix = _find_prefix(reader)
    np_dtype = np.dtype(backend.DTYPE_NAMES[dtype])
    load = _TensorLoader(reader, prefix, np_dtype)
    params = {"embeddings": _load_embeddings(load, cfg), "layers": _load_layers(load, cfg)}
    if cfg.task == "classify":
        params["head"] = _load_head(load, cfg)
    return cfg, params


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
        """One tensor as a host array in the final dtype; `linear` flips [out, in] to [in, out]."""
        full = name if bare else self.prefix + name
        found = self.reader.find(full, *_legacy_names(full)) or full
        hf_shape = (shape[1], shape[0]) if linear else shape
        arr = self.reader.get(found, hf_shape)
        return np.asarray(arr.T if linear else arr).astype(self.dtype)

    def device(self, name: str, shape: tuple, linear: bool = False, bare: bool = False) -> jax.Array:
        return jax.device_put(self.host(name, shape, linear, bare))

    def stacked(self, names: list[str], shape: tuple, linear: bool = False) -> jax.Array:
        buf = np.empty((len(names),) + shape, self.dtype)
        for i, n in enumerate(names):
            buf[i] = self.host(n, shape, linear)
        return jax.device_put(buf)


def _legacy_names(name: str) -> list[str]:
    if name.endswith("LayerNorm.weight"):
        return [name[: -len("weight")] + "gamma"]
    if name.endswith("LayerNorm.bias"):
        return [name[: -len("bias")] + "beta"]
    return []


def _load_embeddings(load: _TensorLoader, c: EncoderConfig) -> dict:
    h = c.hidden_size
    return {
        "word": load.device("embeddings.word_embeddings.weight", (c.vocab_size, h)),
        "position": load.device("embeddings.position_embeddings.weight", (c.max_position_embeddings, h)),
        "token_type": load.device("embeddings.token_type_embeddings.weight", (c.type_vocab_size, h)),
        "ln_scale": load.device("embeddings.LayerNorm.weight", (h,)),
        "ln_bias": load.device("embeddings.LayerNorm.bias", (h,)),
    }


def _load_layers(load: _TensorLoader, c: EncoderConfig) -> dict:
    h, inter, n = c.hidden_size, c.intermediate_size, c.num_layers
    layer = [f"encoder.layer.{i}." for i in range(n)]

    def stacked(suffix: str, shape: tuple, linear: bool = False) -> jax.Array:
        return load.stacked([p + suffix for p in layer], shape, linear)

    return {
        "qkv_w": _stacked_qkv(load, layer, "weight", (h, h), linear=True),
        "qkv_b": _stacked_qkv(load, layer, "bias", (h,)),
        "attn_out_w": stacked("attention.output.dense.weight", (h, h), linear=True),
        "attn_out_b": stacked("attention.output.dense.bias", (h,)),
        "attn_ln_scale": stacked("attention.output.LayerNorm.weight", (h,)),
        "attn_ln_bias": stacked("attention.output.LayerNorm.bias", (h,)),
        "ffn_in_w": stacked("intermediate.dense.weight", (h, inter), linear=True),
        "ffn_in_b": stacked("intermediate.dense.bias", (inter,)),
        "ffn_out_w": stacked("output.dense.weight", (inter, h), linear=True),
        "ffn_out_b": stacked("output.dense.bias", (h,)),
        "ffn_ln_scale": stacked("output.LayerNorm.weight", (h,)),
        "ffn_ln_bias": stacked("output.LayerNorm.bias", (h,)),
    }


def _stacked_qkv(load: _TensorLoader, layer: list[str], kind: str, shape: tuple,
                 linear: bool = False) -> jax.Array:
    """[layers, ..., 3*hidden]: query, key, value concatenated on the output axis."""
    out_axis = len(shape) - 1
    fused = shape[:-1] + (3 * shape[-1],)
    buf = np.empty((len(layer),) + fused, load.dtype)
    for i, p in enumerate(layer):
        parts = [load.host(f"{p}attention.self.{qkv}.{kind}", shape, linear) for qkv in ("query", "key", "value")]
        buf[i] = np.concatenate(parts, axis=out_axis)
    return jax.device_put(buf)


def _load_head(load: _TensorLoader, c: EncoderConfig) -> dict:
    """Both heads are dense+tanh on the first token then a linear layer, so one layout serves."""
    h, nl = c.hidden_size, c.num_labels
    if c.family == "bert":
        names = (load.prefix + "pooler.dense", "classifier")
    else:
        names = ("classifier.dense", "classifier.out_proj")
    return {
        "dense_w": load.device(f"{names[0]}.weight", (h, h), linear=True, bare=True),
        "dense_b": load.device(f"{names[0]}.bias", (h,), bare=True),
        "out_w": load.device(f"{names[1]}.weight", (h, nl), linear=True, bare=True),
        "out_b": load.device(f"{names[1]}.bias", (nl,), bare=True),
    }


def count_params(params: dict) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))


# ---------------------------------------------------------------------------------------------
# forward


def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    x = x.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32) + bias.astype(jnp.float32)


def _position_ids(c: EncoderConfig, input_ids: jax.Array) -> jax.Array:
    if c.family == "roberta":
        # HF rule: real tokens count up from padding_idx + 1, pad tokens sit at padding_idx.
        real = (input_ids != c.pad_token_id).astype(jnp.int32)
        return jnp.cumsum(real, axis=1) * real + c.pad_token_id
    return jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)


def embed_tokens(params: dict, c: EncoderConfig, input_ids: jax.Array, token_type_ids: jax.Array) -> jax.Array:
    e = params["embeddings"]
    x = (e["word"][input_ids] + e["position"][_position_ids(c, input_ids)]
         + e["token_type"][token_type_ids])
    return _layer_norm(x, e["ln_scale"], e["ln_bias"], c.layer_norm_eps)


MATRICES = ("qkv_w", "attn_out_w", "ffn_in_w", "ffn_out_w")


def matrix_dims(c: EncoderConfig) -> dict[str, tuple[int, int]]:
    """(K, N) of each layer matrix, [in, out] as stored."""
    h, i = c.hidden_size, c.intermediate_size
    return {"qkv_w": (h, 3 * h), "attn_out_w": (h, h), "ffn_in_w": (h, i), "ffn_out_w": (i, h)}


def _paths(c: EncoderConfig, name: str) -> frozenset[str]:
    return c.matmul_plan.layouts(name) if c.matmul_plan is not None else frozenset({"xla"})


def pack_for_kernel(params: dict, c: EncoderConfig) -> dict:
    """The matrices the plan routes to the CPU kernel get packed panels ("<name>_panels"); one only
    the kernel serves loses its XLA layout. Unchanged without a plan."""
    if c.matmul_plan is None:
        return params
    layers = dict(params["layers"])
    for name in MATRICES:
        paths = _paths(c, name)
        if "kernel" in paths:
            layers[name + "_panels"] = cpu_kernels.pack(layers[name], 1, stacked=True,
                                                        pairs=layers[name].dtype == jnp.bfloat16)
            if "xla" not in paths:
                del layers[name]
    return {**params, "layers": layers}


def _matmul(c: EncoderConfig, x: jax.Array, w: dict, panels: dict, li: jax.Array, name: str) -> jax.Array:
    """x [B, S, K] @ matrix `name` of layer li, by the path the plan names for B x S rows."""
    m = x.shape[0] * x.shape[1]
    if c.matmul_plan is not None and c.matmul_plan.path(name, m) == "kernel":
        return cpu_kernels.linear(x, panels[name], li, 1, (matrix_dims(c)[name][1],)).astype(x.dtype)
    return x @ w[name]


def _encoder_layer(c: EncoderConfig, x: jax.Array, mask_bias: jax.Array, w: dict, panels: dict,
                   li: jax.Array) -> jax.Array:
    """One post-LN block. x: [B, S, H] float32 residual stream; weights in the model dtype."""
    dt = w["qkv_b"].dtype
    b, s, h = x.shape
    qkv = _matmul(c, x.astype(dt), w, panels, li, "qkv_w") + w["qkv_b"]
    q, k, v = jnp.split(qkv.reshape(b, s, 3, c.num_heads, c.head_dim), 3, axis=2)
    q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(scores / np.sqrt(c.head_dim) + mask_bias, axis=-1)
    ctx = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(dt), v).reshape(b, s, h)
    attn = _matmul(c, ctx, w, panels, li, "attn_out_w") + w["attn_out_b"]
    x = _layer_norm(x + attn.astype(jnp.float32), w["attn_ln_scale"], w["attn_ln_bias"], c.layer_norm_eps)
    inner = _ACTIVATIONS[c.hidden_act](_matmul(c, x.astype(dt), w, panels, li, "ffn_in_w") + w["ffn_in_b"])
    out = _matmul(c, inner, w, panels, li, "ffn_out_w") + w["ffn_out_b"]
    return _layer_norm(x + out.astype(jnp.float32), w["ffn_ln_scale"], w["ffn_ln_bias"], c.layer_norm_eps)


def encode(params: dict, c: EncoderConfig, input_ids: jax.Array, token_type_ids: jax.Array,
           attention_mask: jax.Array) -> jax.Array:
    """Last hidden state [B, S, H] float32. Inputs are [B, S] int32, right padded."""
    x = embed_tokens(params, c, input_ids, token_type_ids)
    # Finite large negative (not -inf) so an all-padding row of a bucket stays NaN-free.
    mask_bias = jnp.where(attention_mask[:, None, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)
    # packed panels pass whole (the kernel takes the layer index), so the scan does not slice them
    layers = params["layers"]
    panels = {k[:-len("_panels")]: v for k, v in layers.items() if k.endswith("_panels")}
    sliced = {k: v for k, v in layers.items() if not k.endswith("_panels")}

    def body(carry: tuple[jax.Array, jax.Array], w: dict) -> tuple[tuple[jax.Array, jax.Array], None]:
        x, li = carry
        return (_encoder_layer(c, x, mask_bias, w, panels, li), li + 1), None

    (x, _), _ = jax.lax.scan(body, (x, jnp.int32(0)), sliced)
    return x


def pool(c: EncoderConfig, hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """[B, H] float32 by the model's pooling mode (as sentence-transformers computes it)."""
    if c.pooling == "cls":
        return hidden[:, 0]
    m = attention_mask.astype(jnp.float32)
    if c.pooling == "mean":
        return (hidden * m[..., None]).sum(1) / jnp.maximum(m.sum(1, keepdims=True), 1e-9)
    last = jnp.maximum(attention_mask.sum(1) - 1, 0)  # right padding: last real token
    return jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]


def classify(params: dict, c: EncoderConfig, hidden: jax.Array) -> jax.Array:
    """Logits [B, num_labels] float32 from the first token."""
    hd = params["head"]
    dt = hd["dense_w"].dtype
    x = jnp.tanh(hidden[:, 0].astype(dt) @ hd["dense_w"] + hd["dense_b"])
    return (x @ hd["out_w"] + hd["out_b"]).astype(jnp.float32)


def forward(params: dict, c: EncoderConfig, input_ids: jax.Array, token_type_ids: jax.Array,
            attention_mask: jax.Array) -> jax.Array:
    """What a served encoder returns: pooled vectors [B, H] or classifier logits [B, num_labels]."""
    hidden = encode(params, c, input_ids, token_type_ids, attention_mask)
    if c.task == "classify":
        return classify(params, c, hidden)
    return pool(c, hidden, attention_mask)


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """Row-wise L2 normalization as torch.nn.functional.normalize (eps 1e-12)."""
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
