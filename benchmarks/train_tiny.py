"""Train the small Llama-shaped model that speculative decoding is measured with (issue 20).

Acceptance rates on random weights mean nothing: a random model never repeats what it read, so
n-gram and suffix proposals would look useless on it. This script trains a real (small) model
on text every machine has offline, the Python standard library's own source files, so the
speculation benchmark can ask it to continue, copy and repeat code.

What it trains: a Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU; untied LM head) written
here as a few JAX functions over a params pytree with the layers stacked under `lax.scan`, fp32,
AdamW (optax) with linear warmup and cosine decay, gradient clipping at 1.0. The tokenizer is
byte-level (`jax_engine.models.demo.write_tokenizer` with no merges: 256 byte symbols + 6
specials = 262 ids), so any file is representable and nothing is learned outside the model.
The saved folder is an ordinary Hugging Face folder: config.json (LlamaForCausalLM),
model.safetensors under the HF tensor names, tokenizer files. `--verify` loads it with
transformers (logits must match this script's forward to 1e-3) and with the engine, and exits 1
when either differs. Its config.json allows 1024 positions so a benchmark can serve prompt +
answer beyond the 256-token training window; positions past 256 were never trained.

Data: `sysconfig.get_paths()["stdlib"]`/**/*.py, sorted by relative path, without tests,
`encodings` (code-page tables), `pydoc_data` and site-packages; a file goes to the held-out set
when sha1(relative path) % 20 == 0, so the split does not depend on which other files exist.
Files are joined with <|eos|> between them; training windows are the non-overlapping
(context + 1)-token windows of the train stream in a permutation fixed by the seed, the held-out
loss is over the first `eval_windows` windows of the held-out stream. Same seed, same steps, same
Python version and the same CPU type give the same model.

Cache: the folder goes to <bench cache root>/train-tiny-<key>, the key a hash of every
hyper-parameter and of the corpus bytes; a run with the same settings finds it and returns at
once (--force retrains). The folder's xlaserve_train.json holds the run's losses and sample.

Size and time: 3.04 M parameters (hidden 256, 4 layers, 4 heads / 2 KV heads, MLP 688, vocab 262).
A step of 16 x 256 tokens takes 1.0-1.1 s on the quiet 2-core reference machine (~3.9k tokens/s;
1.4-2 s while other processes compete), so the default 500 steps (2 M tokens, ~0.2 epoch) take
~9 minutes plus ~40 s of tokenizing, compiling, evaluating and sampling. `--minutes` (default 12)
stops a slower run early and says so in the report (the issue's bound is 15 minutes).

Run:  python -m benchmarks.train_tiny [--steps 500] [--minutes 12] [--verify] [--force] [--quick]
Writes benchmarks/results/train_tiny.json (train_tiny_quick.json for --quick or a non-default
--steps, so a smoke run never overwrites the real numbers).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common as C

NAME = "train_tiny"
DEFAULT_STEPS = 500
# bump when the meaning of a saved folder changes (model code, data selection), so old caches are not reused
FORMAT_VERSION = 1
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__", "encodings", "pydoc_data"})
SAMPLE_PROMPT = "import os\n\n\ndef "


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 262               # write_tokenizer's 6 specials + 256 bytes, no merges
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 688
    context: int = 256                  # training window
    max_positions: int = 1024           # config.json's limit; positions past `context` were never trained
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class TrainConfig:
    steps: int = DEFAULT_STEPS
    batch: int = 16
    peak_lr: float = 3e-3
    warmup: int = 40
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    holdout_mod: int = 20
    eval_windows: int = 48


# =============================================================================================
# model: HF Llama semantics (LlamaForCausalLM), params in HF orientation ([out, in]) stacked per layer
# =============================================================================================
LAYER_KEYS = ("attn_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down")
HF_LAYER = {"attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
            "v": "self_attn.v_proj", "o": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
            "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def init_params(cfg: ModelConfig, seed: int) -> dict:
    """GPT-2 style init: N(0, 0.02), the two residual-output projections scaled by 1/sqrt(2 L)."""
    k = iter(jax.random.split(jax.random.PRNGKey(seed), 16))
    h, i, L, D = cfg.hidden, cfg.intermediate, cfg.layers, cfg.head_dim
    nq, nkv = cfg.heads * D, cfg.kv_heads * D

    def w(*shape: int, std: float = 0.02) -> jax.Array:
        return std * jax.random.normal(next(k), shape, jnp.float32)

    out_std = 0.02 / math.sqrt(2 * L)
    layers = {"attn_norm": jnp.ones((L, h)), "q": w(L, nq, h), "k": w(L, nkv, h), "v": w(L, nkv, h),
              "o": w(L, h, nq, std=out_std), "mlp_norm": jnp.ones((L, h)), "gate": w(L, i, h), "up": w(L, i, h),
              "down": w(L, h, i, std=out_std)}
    return {"embed": w(cfg.vocab_size, h), "layers": layers, "norm": jnp.ones(h), "lm_head": w(cfg.vocab_size, h)}


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_tables(cfg: ModelConfig, T: int) -> tuple[jax.Array, jax.Array]:
    """cos/sin [T, D] in HF's rotate-half layout (the two halves share frequencies)."""
    D = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D)
    ang = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None]
    ang = np.concatenate([ang, ang], axis=-1)
    return jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, heads, D]."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None] + rot * sin[:, None]


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] -> logits [B, T, vocab], causal."""
    B, T = tokens.shape
    D, KV, G = cfg.head_dim, cfg.kv_heads, cfg.heads // cfg.kv_heads
    cos, sin = rope_tables(cfg, T)
    mask = jnp.tril(jnp.ones((T, T), bool))
    x = params["embed"][tokens]

    def layer(x, lp):
        a = rms_norm(x, lp["attn_norm"], cfg.rms_eps)
        # query head i reads KV head i // G, as HF's repeat_kv does
        q = apply_rope((a @ lp["q"].T).reshape(B, T, KV * G, D), cos, sin).reshape(B, T, KV, G, D)
        k = apply_rope((a @ lp["k"].T).reshape(B, T, KV, D), cos, sin)
        v = (a @ lp["v"].T).reshape(B, T, KV, D)
        s = jnp.einsum("btkgd,bskd->bkgts", q, k) / math.sqrt(D)
        p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
        o = jnp.einsum("bkgts,bskd->btkgd", p, v).reshape(B, T, KV * G * D)
        x = x + o @ lp["o"].T
        m = rms_norm(x, lp["mlp_norm"], cfg.rms_eps)
        x = x + (jax.nn.silu(m @ lp["gate"].T) * (m @ lp["up"].T)) @ lp["down"].T
        return x, None

    x, _ = jax.lax.scan(layer, x, params["layers"])
    return rms_norm(x, params["norm"], cfg.rms_eps) @ params["lm_head"].T


def loss_fn(params: dict, cfg: ModelConfig, batch: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats) of batch [B, T + 1]."""
    logits = forward(params, cfg, batch[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1))


def make_optimizer(tc: TrainConfig):
    import optax

    sched = optax.warmup_cosine_decay_schedule(0.0, tc.peak_lr, tc.warmup, max(tc.steps, tc.warmup + 1),
                                               end_value=tc.peak_lr * tc.final_lr_ratio)
    # norms are not decayed: they are scales, not weights that should shrink
    decay = lambda p: {"embed": True, "lm_head": True, "norm": False,  # noqa: E731
                       "layers": {k: not k.endswith("norm") for k in LAYER_KEYS}}
    return optax.chain(optax.clip_by_global_norm(tc.clip),
                       optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=tc.weight_decay, mask=decay)), sched


def make_train_step(cfg: ModelConfig, opt):
    import optax

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, cfg, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


@functools.lru_cache(maxsize=None)
def programs(cfg: ModelConfig, tc: TrainConfig):
    """(optimizer, schedule, train step, loss) for a configuration, built and compiled once per process."""
    opt, sched = make_optimizer(tc)
    return opt, sched, make_train_step(cfg, opt), jax.jit(lambda p, b: loss_fn(p, cfg, b))


def param_count(params: dict) -> int:
    return int(sum(x.size for x in jax.tree_util.tree_leaves(params)))


# =============================================================================================
# HF folder: names, config, tokenizer
# =============================================================================================
def to_hf(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    t = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["norm"], "lm_head.weight": params["lm_head"]}
    for key, hf in HF_LAYER.items():
        for layer in range(cfg.layers):
            t[f"model.layers.{layer}.{hf}.weight"] = params["layers"][key][layer]
    return {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in t.items()}


def from_hf(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    layers = {key: jnp.stack([jnp.asarray(tensors[f"model.layers.{i}.{hf}.weight"]) for i in range(cfg.layers)])
              for key, hf in HF_LAYER.items()}
    return {"embed": jnp.asarray(tensors["model.embed_tokens.weight"]), "layers": layers,
            "norm": jnp.asarray(tensors["model.norm.weight"]), "lm_head": jnp.asarray(tensors["lm_head.weight"])}


def write_tokenizer(path: str, cfg: ModelConfig) -> dict[str, int]:
    """The demo tokenizer with no merges: one id per byte (vocab = 6 specials + 256 bytes)."""
    from jax_engine.models.demo import write_tokenizer as demo_tokenizer

    return demo_tokenizer(path, vocab_size=cfg.vocab_size)


def hf_config(cfg: ModelConfig, ids: dict[str, int]) -> dict:
    from jax_engine.models.demo import llama_config

    return llama_config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_positions, rms_norm_eps=cfg.rms_eps,
                        rope_theta=cfg.rope_theta, bos_token_id=ids["<|bos|>"], eos_token_id=ids["<|eos|>"],
                        pad_token_id=ids["<|pad|>"])


def save_weights(path: str, params: dict, cfg: ModelConfig, ids: dict[str, int]) -> None:
    """config.json + model.safetensors into `path` (which already holds the tokenizer)."""
    from safetensors.numpy import save_file

    save_file(to_hf(params, cfg), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config(cfg, ids), f, indent=2)


def load_weights(path: str, cfg: ModelConfig) -> dict:
    from safetensors.numpy import load_file

    return from_hf(load_file(os.path.join(path, "model.safetensors")), cfg)


# =============================================================================================
# data
# =============================================================================================
def stdlib_files(holdout_mod: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, held-out) lists of (relative path, text), sorted by path."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for p in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = p.relative_to(root).as_posix()
        if SKIP_DIRS & set(rel.split("/")[:-1]) or not p.is_file():
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        digest = int(hashlib.sha1(rel.encode()).hexdigest(), 16)
        (held if digest % holdout_mod == 0 else train).append((rel, text))
    return train, held


def corpus_digest(files: Sequence[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for rel, text in files:
        h.update(rel.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


def tokenize_stream(tokenizer_dir: str, files: Sequence[tuple[str, str]], eos: int) -> np.ndarray:
    """All files' ids through the saved tokenizer (what the engine will use), <|eos|> after each."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    out: list[int] = []
    for enc in tok.encode_batch([text for _, text in files], add_special_tokens=False):
        out += enc.ids
        out.append(eos)
    return np.asarray(out, np.int32)


def windows(stream: np.ndarray, T: int) -> np.ndarray:
    """Start offsets of the non-overlapping (T + 1)-token windows of `stream`."""
    return np.arange(0, len(stream) - (T + 1) + 1, T, dtype=np.int64)


def gather(stream: np.ndarray, starts: np.ndarray, T: int) -> np.ndarray:
    return stream[starts[:, None] + np.arange(T + 1)[None]]


# =============================================================================================
# evaluation and sampling
# =============================================================================================
def eval_loss(params: dict, cfg: ModelConfig, tc: TrainConfig, stream: np.ndarray) -> float:
    starts, batch = windows(stream, cfg.context)[:tc.eval_windows], tc.batch
    f = programs(cfg, tc)[3]
    losses = [float(f(params, jnp.asarray(gather(stream, starts[i:i + batch], cfg.context))))
              * len(starts[i:i + batch]) for i in range(0, len(starts), batch)]
    return sum(losses) / len(starts)


def greedy(params: dict, cfg: ModelConfig, prompt: list[int], n: int, stop: int | None = None) -> list[int]:
    """Greedy continuation with this script's forward: one [1, context] program, the newest
    `context` tokens in it (right padding is harmless under the causal mask)."""
    T = cfg.context
    f = jax.jit(lambda p, x, i: forward(p, cfg, x)[0, i])
    toks, out = list(prompt), []
    for _ in range(n):
        win = toks[-T:]
        x = np.zeros((1, T), np.int32)
        x[0, :len(win)] = win
        nxt = int(jnp.argmax(f(params, jnp.asarray(x), len(win) - 1)))
        if nxt == stop:
            break
        toks.append(nxt)
        out.append(nxt)
    return out


# =============================================================================================
# training
# =============================================================================================
def cache_key(mc: ModelConfig, tc: TrainConfig, corpus: str) -> str:
    blob = json.dumps({"model": dataclasses.asdict(mc), "train": dataclasses.asdict(tc), "corpus": corpus,
                       "python": list(sys.version_info[:2]), "format": FORMAT_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def train(mc: ModelConfig, tc: TrainConfig, train_stream: np.ndarray, held_stream: np.ndarray,
          minutes: float, log_every: int = 25) -> tuple[dict, dict]:
    """Run the optimizer; returns (params, report)."""
    opt, sched, step_fn, _ = programs(mc, tc)
    params = init_params(mc, tc.seed)
    opt_state = opt.init(params)
    starts = windows(train_stream, mc.context)
    order = np.random.default_rng(tc.seed).permutation(len(starts))
    n_per_step = tc.batch * mc.context
    C.log(f"train_tiny: {param_count(params) / 1e6:.2f} M parameters, {len(train_stream) / 1e6:.2f} M train tokens "
          f"({len(starts)} windows), {tc.steps} steps x {n_per_step} tokens = {tc.steps * n_per_step / len(train_stream):.2f} "
          f"epochs")
    held0 = eval_loss(params, mc, tc, held_stream)
    curve, evals, recent = [], [{"step": 0, "heldout_loss": round(held0, 4)}], []
    cpu_win = C.CpuWindow().start()     # a contended run is slower; the report says how contended
    t0 = time.perf_counter()
    compile_s = None
    stopped_by, done = "steps", 0
    for s in range(tc.steps):
        idx = order[(np.arange(tc.batch) + s * tc.batch) % len(order)]
        params, opt_state, loss = step_fn(params, opt_state, jnp.asarray(gather(train_stream, starts[idx], mc.context)))
        recent.append(float(loss))
        done = s + 1
        if compile_s is None:
            compile_s = time.perf_counter() - t0
        el = time.perf_counter() - t0
        out_of_time = el > minutes * 60 and done < tc.steps
        if done % log_every == 0 or done == tc.steps or out_of_time:
            curve.append({"step": done, "train_loss": round(float(np.mean(recent)), 4), "lr": float(sched(s)),
                          "elapsed_s": round(el, 1)})
            C.log(f"  step {done:4d}  train loss {np.mean(recent):.3f}  lr {float(sched(s)):.2e}  {el:6.1f} s")
            recent = []
        if out_of_time:
            stopped_by = "minutes"
            C.log(f"train_tiny: --minutes {minutes} reached after {done} of {tc.steps} steps; stopping early "
                  f"(the model is cached as it is: --force retrains, e.g. on a quieter machine)")
            break
    train_s = time.perf_counter() - t0
    cpu = cpu_win.stop()
    held = eval_loss(params, mc, tc, held_stream)
    evals.append({"step": done, "heldout_loss": round(held, 4)})
    last = [c["train_loss"] for c in curve[-2:]]      # the final figure: mean over the last two log windows
    report = {
        "parameters": param_count(params), "steps_done": done, "stopped_by": stopped_by,
        "train_seconds": round(train_s, 1), "first_step_seconds_incl_compile": round(compile_s or 0.0, 2),
        # steady state: the steps after the first (which includes compilation)
        "tokens_per_s": round((done - 1) * n_per_step / max(train_s - (compile_s or 0.0), 1e-9), 1),
        "tokens_seen": done * n_per_step, "epochs": round(done * n_per_step / len(train_stream), 3),
        "train_loss_first": curve[0]["train_loss"] if curve else None,
        "train_loss_final": round(float(np.mean(last)), 4) if last else None,
        "heldout_loss_initial": round(held0, 4), "heldout_loss_final": round(held, 4),
        "heldout_bits_per_byte": round(held / math.log(2), 4),
        "curve": curve, "evals": evals, "cpu": cpu,
    }
    return params, report


# =============================================================================================
# verification: transformers and the engine read the folder as this script's forward does
# =============================================================================================
def hf_logits(path: str, seqs: Sequence[list[int]]) -> list[np.ndarray] | None:
    try:
        import torch
        from transformers import LlamaForCausalLM
    except ImportError:
        return None
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0].numpy() for s in seqs]


def engine_logits(path: str, seqs: Sequence[list[int]]) -> list[np.ndarray]:
    from jax_engine.config import EngineArgs, ModelSpec
    from jax_engine.decode.parity import prompt_logits
    from jax_engine.engine import Engine

    longest = max(len(s) for s in seqs)
    engine = Engine(EngineArgs(models=[ModelSpec(name="m", path=path)], max_running_requests=2,
                               max_num_batched_tokens=64, max_model_len=max(longest, 64), page_size=16,
                               num_pages=2 * math.ceil(max(longest, 64) / 16) + 2))
    try:
        engine.load_all(progress=False, warmup=False)
        runner = engine.worker("m").replicas[0].runner
        return [prompt_logits(runner, list(s)) for s in seqs]
    finally:
        engine.shutdown(timeout=2.0)


def verify(path: str, mc: ModelConfig, tc: TrainConfig, tol: float = 1e-3) -> dict:
    """Max abs logit difference against transformers and the engine on held-out sequences; the
    tokenizer the engine loads (AutoTokenizer) is one id per byte and gives the training ids."""
    with open(os.path.join(path, "config.json")) as f:
        eos = json.load(f)["eos_token_id"]
    held_files = stdlib_files(tc.holdout_mod)[1]
    held_stream = tokenize_stream(path, held_files, eos)
    params = load_weights(path, mc)
    seqs = [held_stream[:17].tolist(), held_stream[1000:1100].tolist(), held_stream[5000:5000 + mc.context].tolist()]
    ours = [np.asarray(forward(params, mc, jnp.asarray([s]))[0]) for s in seqs]
    out: dict[str, Any] = {"sequence_lengths": [len(s) for s in seqs], "tolerance": tol}
    from transformers import AutoTokenizer

    text = "def f(x):\n    return {'é': x ** 2}  # ü\n"
    tok = AutoTokenizer.from_pretrained(path)
    out["tokenizer_is_bytes"] = len(tok.encode(text, add_special_tokens=False)) == len(text.encode())
    out["tokenizer_round_trip"] = tok.decode(tok.encode(text, add_special_tokens=False)) == text
    first = held_files[0][1]
    want = held_stream[:len(first.encode())].tolist()
    out["tokenizer_matches_training_ids"] = tok.encode(first, add_special_tokens=False) == want
    ref = hf_logits(path, seqs)
    if ref is None:
        out["transformers"] = "not importable"
    else:
        err = max(float(np.max(np.abs(a - b))) for a, b in zip(ours, ref))
        out["transformers_max_abs_diff"] = err
        out["transformers_ok"] = err <= tol
    eng = engine_logits(path, seqs)
    err = max(float(np.max(np.abs(a - b))) for a, b in zip(ours, eng))
    out["engine_max_abs_diff"] = err
    out["engine_ok"] = err <= tol
    out["ok"] = all(out.get(k, True) for k in ("transformers_ok", "engine_ok", "tokenizer_is_bytes", "tokenizer_round_trip",
                                               "tokenizer_matches_training_ids"))
    return out


# =============================================================================================
# main
# =============================================================================================
def ensure_model(mc: ModelConfig | None = None, tc: TrainConfig | None = None, minutes: float = 12.0,
                 force: bool = False, root: str | None = None) -> tuple[str, dict]:
    """The trained folder for these settings (training it when absent) and its xlaserve_train.json.
    The speculation benchmark calls this with the defaults."""
    mc, tc = mc or ModelConfig(), tc or TrainConfig()
    t0 = time.perf_counter()
    train_files, held_files = stdlib_files(tc.holdout_mod)
    corpus = corpus_digest(train_files + held_files)
    key = cache_key(mc, tc, corpus)
    path = os.path.join(root or C.bench_cache_root(), f"train-tiny-{key}")
    meta_path = os.path.join(path, "xlaserve_train.json")
    data = {"train_files": len(train_files), "heldout_files": len(held_files),
            "train_bytes": sum(len(t.encode()) for _, t in train_files),
            "heldout_bytes": sum(len(t.encode()) for _, t in held_files), "corpus_sha256": corpus}
    if os.path.isfile(meta_path) and not force:
        with open(meta_path) as f:
            meta = json.load(f)
        C.log(f"train_tiny: cached model {path} ({time.perf_counter() - t0:.1f} s)")
        return path, {**meta, "cached": True}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".train-tiny-", dir=os.path.dirname(path))
    try:
        ids = write_tokenizer(tmp, mc)
        eos = ids["<|eos|>"]
        train_stream = tokenize_stream(tmp, train_files, eos)
        held_stream = tokenize_stream(tmp, held_files, eos)
        C.log(f"train_tiny: corpus read and tokenized in {time.perf_counter() - t0:.1f} s: {data['train_files']} train "
              f"files, {data['heldout_files']} held-out files")
        params, report = train(mc, tc, train_stream, held_stream, minutes)
        prompt = tokenize_stream(tmp, [("", SAMPLE_PROMPT)], eos)[:-1].tolist()
        cont = greedy(params, mc, prompt, 200, stop=eos)
        from tokenizers import Tokenizer

        sample = Tokenizer.from_file(os.path.join(tmp, "tokenizer.json")).decode(cont)
        save_weights(tmp, params, mc, ids)
        meta = {"key": key, "model": dataclasses.asdict(mc), "train": dataclasses.asdict(tc), "minutes": minutes,
                "data": data, "python": sys.version.split()[0], "report": report,
                "sample": {"prompt": SAMPLE_PROMPT, "greedy_continuation": sample}}
        with open(os.path.join(tmp, "xlaserve_train.json"), "w") as f:
            json.dump(meta, f, indent=2)
        if os.path.isdir(path):
            shutil.rmtree(path)     # --force: replace the old folder
        os.rename(tmp, path)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return path, {**meta, "cached": False}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.train_tiny", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=None, help=f"optimizer steps (default {DEFAULT_STEPS}; --quick 20)")
    ap.add_argument("--minutes", type=float, default=12.0, help="stop training after this long (default 12)")
    ap.add_argument("--batch", type=int, default=TrainConfig.batch)
    ap.add_argument("--lr", type=float, default=TrainConfig.peak_lr, help="peak learning rate")
    ap.add_argument("--seed", type=int, default=TrainConfig.seed)
    ap.add_argument("--layers", type=int, default=ModelConfig.layers)
    ap.add_argument("--hidden", type=int, default=ModelConfig.hidden)
    ap.add_argument("--context", type=int, default=ModelConfig.context)
    ap.add_argument("--quick", action="store_true", help="20 steps, results to train_tiny_quick.json (smoke test)")
    ap.add_argument("--verify", action="store_true", help="compare logits with transformers and the engine")
    ap.add_argument("--force", action="store_true", help="train even when the cache has this model")
    ap.add_argument("--cache-dir", default=None, help="default: the benchmark cache root")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    steps = a.steps if a.steps is not None else (20 if a.quick else DEFAULT_STEPS)
    quick = a.quick or steps != DEFAULT_STEPS
    mc = ModelConfig(layers=a.layers, hidden=a.hidden, context=a.context, max_positions=max(ModelConfig.max_positions, a.context))
    tc = TrainConfig(steps=steps, batch=a.batch, peak_lr=a.lr, seed=a.seed, warmup=min(TrainConfig.warmup, max(1, steps // 10)))
    doc = C.header(NAME, quick, argv)
    cpu = C.CpuWindow().start()
    path, meta = ensure_model(mc, tc, a.minutes, a.force, a.cache_dir)
    doc.update({"model_dir": path, "cached": meta["cached"], "key": meta["key"], "model": meta["model"],
                "train": meta["train"], "data": meta["data"], "report": meta["report"], "sample": meta["sample"]})
    if a.verify:
        doc["verify"] = verify(path, mc, tc)
        C.log(f"verify: {json.dumps(doc['verify'])}")
    doc["cpu"] = cpu.stop()
    r = meta["report"]
    C.log(f"train_tiny: {r['parameters'] / 1e6:.2f} M params, {r['steps_done']} steps ({r['stopped_by']}), "
          f"train loss {r['train_loss_final']}, held-out loss {r['heldout_loss_final']} nats/byte "
          f"({r['heldout_bits_per_byte']} bits/byte; initial {r['heldout_loss_initial']}), {r['train_seconds']} s")
    sample = meta["sample"]
    C.log(f"sample (greedy) after {sample['prompt']!r}:\n{sample['prompt']}{sample['greedy_continuation']}")
    return C.finish(doc, NAME, quick)


if __name__ == "__main__":
    sys.exit(0 if main().get("verify", {}).get("ok", True) else 1)
