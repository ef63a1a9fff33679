"""Deterministic tiny checkpoints written without torch or a download.

Used for the bundled demo generator (random weights, clearly labelled) and by tests that need
an HF folder with a real tokenizer and chat template. The tokenizer is byte-level BPE over the
256 byte symbols plus a few special tokens, so any text round-trips.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Optional

import numpy as np

SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' + m['content'] + '<|eos|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
DEMO_LLAMA = dict(
    vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
)


def write_tokenizer(path: str, vocab_size: int = 512) -> dict[str, int]:
    """Byte-level BPE tokenizer with merges learned from a fixed text; returns special ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [
        "the quick brown fox jumps over the lazy dog. hello world! serving models with jax and xla.",
        "a man is eating food. a man is eating a piece of bread. the weather is nice today.",
    ] * 8
    # deterministic pseudo-words so the merges fill the whole vocabulary
    rng = np.random.default_rng(1234)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    p = np.linspace(2.0, 0.2, len(letters))
    corpus += [" ".join("".join(rng.choice(letters, size=rng.integers(2, 9), p=p / p.sum()))
                        for _ in range(12)) for _ in range(400)]
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        model_max_length=DEMO_LLAMA["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return {s: tok.token_to_id(s) for s in SPECIALS}


def llama_config(arch: str = "LlamaForCausalLM", **overrides) -> dict:
    """config.json for a decoder family; `overrides` win."""
    cfg = dict(DEMO_LLAMA)
    cfg.update(
        architectures=[arch], model_type={"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                                          "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[arch],
        hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        torch_dtype="float32", bos_token_id=1, eos_token_id=2, pad_token_id=0,
        attention_bias=False,
    )
    cfg.update(overrides)
    return cfg


def write_random_llama(path: str, config: dict, seed: int = 0) -> None:
    """Random llama-layout weights (HF tensor names) saved as safetensors, numpy only."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    h, i = config["hidden_size"], config["intermediate_size"]
    nh, kvh = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // nh
    v = config["vocab_size"]
    qkv_bias = config.get("model_type") == "qwen2" or config.get("attention_bias", False)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": norm(h)}
    if not config.get("tie_word_embeddings"):
        t["lm_head.weight"] = w(v, h)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        t[p + "self_attn.q_proj.weight"] = w(nh * hd, h)
        t[p + "self_attn.k_proj.weight"] = w(kvh * hd, h)
        t[p + "self_attn.v_proj.weight"] = w(kvh * hd, h)
        t[p + "self_attn.o_proj.weight"] = w(h, nh * hd)
        if qkv_bias:
            t[p + "self_attn.q_proj.bias"] = w(nh * hd)
            t[p + "self_attn.k_proj.bias"] = w(kvh * hd)
            t[p + "self_attn.v_proj.bias"] = w(kvh * hd)
        if config.get("model_type") == "qwen3":
            t[p + "self_attn.q_norm.weight"] = norm(hd)
            t[p + "self_attn.k_norm.weight"] = norm(hd)
        t[p + "mlp.gate_proj.weight"] = w(i, h)
        t[p + "mlp.up_proj.weight"] = w(i, h)
        t[p + "mlp.down_proj.weight"] = w(h, i)
        t[p + "input_layernorm.weight"] = norm(h)
        t[p + "post_attention_layernorm.weight"] = norm(h)
    os.makedirs(path, exist_ok=True)
    save_file(t, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def build_demo_generator(path: str, seed: int = 0, config: Optional[dict] = None) -> str:
    """Create (once) the demo generator folder: random weights + real tokenizer + chat template."""
    if os.path.isfile(os.path.join(path, "xlaserve_demo.json")):
        return path
    # Built beside the target and renamed into place, so processes starting together on one
    # host (several servers, or a multi-process slice) never see a half-written folder.
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".demo-build-", dir=parent)
    try:
        ids = write_tokenizer(tmp, vocab_size=(config or DEMO_LLAMA)["vocab_size"])
        cfg = config or llama_config(bos_token_id=ids["<|bos|>"], eos_token_id=ids["<|eos|>"],
                                     pad_token_id=ids["<|pad|>"])
        write_random_llama(tmp, cfg, seed=seed)
        with open(os.path.join(tmp, "xlaserve_demo.json"), "w") as f:
            json.dump({"random_weights": True, "seed": seed,
                       "note": "xlaserve demo generator: RANDOM weights, output is meaningless"}, f)
        if os.path.isdir(path) and not os.listdir(path):
            os.rmdir(path)      # an empty folder (e.g. a mounted volume's mount point's child)
        os.rename(tmp, path)
    except OSError:
        if not os.path.isfile(os.path.join(path, "xlaserve_demo.json")):
            raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def default_demo_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "xlaserve", "demo-generator-v1")


def is_demo_model(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "xlaserve_demo.json"))
