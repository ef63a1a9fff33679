"""Tiny random decoders built with `transformers` (fixed seed) and saved as safetensors."""
from __future__ import annotations

import os

import torch

from jax_engine.models.demo import write_tokenizer

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def family_config(family: str):
    import transformers as tf

    if family == "llama3":
        return tf.LlamaConfig(**TINY, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                              rope_theta=500000.0)
    if family == "mistral":
        return tf.MistralConfig(**TINY, sliding_window=24)     # shorter than the test prompts
    if family == "qwen2":
        return tf.Qwen2Config(**TINY)
    if family == "qwen3":
        return tf.Qwen3Config(**{**TINY, "head_dim": 32})
    if family == "qwen2_yarn":   # YaRN factor 4 over an original context shorter than the test prompts
        return tf.Qwen2Config(**TINY, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                                    "rope_theta": 10000.0})
    if family == "llama_dynamic":   # dynamic NTK factor 4 over a 64-token context: greedy decode crosses it
        return tf.LlamaConfig(**{**TINY, "max_position_embeddings": 64},
                              rope_scaling={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    if family == "phi3":   # LongRoPE beyond a 64-token original context (decode crosses it), a window
        half = TINY["hidden_size"] // TINY["num_attention_heads"] // 2
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
                "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [1.5 + 0.5 * i for i in range(half)]}
        return tf.Phi3Config(**TINY, rope_scaling=rope, original_max_position_embeddings=64, sliding_window=40,
                             pad_token_id=0)
    if family == "gemma2":    # soft-capping on, a 24-token window on alternate layers, GeGLU, +1 norms
        return tf.Gemma2Config(**{**TINY, "num_hidden_layers": 3}, head_dim=16, sliding_window=24, query_pre_attn_scalar=32,
                               attn_logit_softcapping=20.0, final_logit_softcapping=5.0)
    if family == "gemma3":    # q/k norms, local (10k) and global (1M) RoPE bases, a window on 2 of 3 layers
        return tf.Gemma3TextConfig(**{**TINY, "num_hidden_layers": 3}, head_dim=16, sliding_window=24,
                                   query_pre_attn_scalar=16, layer_types=["sliding_attention", "sliding_attention",
                                                                          "full_attention"])
    if family == "mixtral":   # 8 experts, top 2
        return tf.MixtralConfig(**TINY, num_local_experts=8, num_experts_per_tok=2)
    if family == "qwen3_moe":  # 8 experts, top 2, the normalisation rule off (Qwen3's own switch)
        return tf.Qwen3MoeConfig(**TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                                 norm_topk_prob=False)
    if family == "llama_tied":   # also attention_bias: q, k, v and o biases
        return tf.LlamaConfig(**TINY, tie_word_embeddings=True, attention_bias=True)
    raise ValueError(family)


def build(family: str, path: str, seed: int = 0):
    """Write the model + a byte-level tokenizer to `path`; returns the torch model (eval, fp32)."""
    import transformers as tf

    cfg = family_config(family)
    ids = write_tokenizer(path, cfg.vocab_size)
    cfg.eos_token_id, cfg.bos_token_id, cfg.pad_token_id = ids["<|eos|>"], ids["<|bos|>"], ids["<|pad|>"]
    torch.manual_seed(seed)
    cls = {"llama3": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM, "qwen2": tf.Qwen2ForCausalLM,
           "qwen3": tf.Qwen3ForCausalLM, "llama_tied": tf.LlamaForCausalLM, "llama_dynamic": tf.LlamaForCausalLM,
           "qwen2_yarn": tf.Qwen2ForCausalLM, "phi3": tf.Phi3ForCausalLM, "gemma2": tf.Gemma2ForCausalLM,
           "gemma3": tf.Gemma3ForCausalLM, "mixtral": tf.MixtralForCausalLM, "qwen3_moe": tf.Qwen3MoeForCausalLM}[family]
    model = cls(cfg).eval()
    if family.startswith("qwen2") or family == "llama_tied":   # biases start at 0: make them non-zero
        with torch.no_grad():
            for layer in model.model.layers:
                at = layer.self_attn
                for proj in (at.q_proj, at.k_proj, at.v_proj, at.o_proj):
                    if proj.bias is not None:
                        proj.bias.normal_(0, 0.1)
    if family.startswith("gemma"):   # Gemma's norms start at 0 (a factor of 1 + 0): make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0, 0.2)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logits(model, prompt: list[int]):
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().numpy()


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_lora(model, path: str, seed: int, r: int = 8, alpha: float = 16.0, targets=None, rslora: bool = False):
    """A PEFT LoRA adapter on `model` with random non-zero A and B (PEFT starts B at zero, which would
    test nothing), saved to `path`; returns the PEFT model (eval) to compare against. `model` is not
    modified (PEFT wraps a deep copy)."""
    import copy

    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets or LORA_TARGETS), lora_dropout=0.0,
                     use_rslora=rslora, init_lora_weights=False)
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(model), cfg).eval()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.normal_(0, 0.05)
    os.makedirs(path, exist_ok=True)
    peft_model.save_pretrained(path, safe_serialization=True)
    return peft_model
