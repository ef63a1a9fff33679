"""The one table of supported HF architectures: which model family serves each, and its task."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from jax_engine.checkpoint.hf import CheckpointError


@dataclass(frozen=True)
class Architecture:
    kind: str            # "decoder" (jax_engine/models/llama.py) | "encoder" (models/bert.py)
    family: str          # "llama" | "bert" | "roberta" (RoBERTa: position ids from padding_idx + 1)
    head: bool = False   # an encoder with a sequence-classification head (task "classify")


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("decoder", "llama"),
    "MistralForCausalLM": Architecture("decoder", "llama"),
    "Qwen2ForCausalLM": Architecture("decoder", "llama"),
    "Qwen3ForCausalLM": Architecture("decoder", "llama"),
    "Phi3ForCausalLM": Architecture("decoder", "llama"),     # fused qkv / gate_up, split at load
    "Gemma2ForCausalLM": Architecture("decoder", "llama"),
    "MixtralForCausalLM": Architecture("decoder", "llama"),  # mixture of experts (models/moe.py)
    "Qwen3MoeForCausalLM": Architecture("decoder", "llama"),
    "Gemma3ForCausalLM": Architecture("decoder", "llama"),   # text only (gemma3_text)
    "BertModel": Architecture("encoder", "bert"),
    "BertForMaskedLM": Architecture("encoder", "bert"),
    "BertForSequenceClassification": Architecture("encoder", "bert", head=True),
    "RobertaModel": Architecture("encoder", "roberta"),
    "RobertaForSequenceClassification": Architecture("encoder", "roberta", head=True),
    "XLMRobertaModel": Architecture("encoder", "roberta"),
    "XLMRobertaForSequenceClassification": Architecture("encoder", "roberta", head=True),
}
# folders without `architectures` (some sentence-transformers ones): the bare model of the type
BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "bert": "BertModel",
                 "roberta": "RobertaModel", "xlm-roberta": "XLMRobertaModel"}
DECODERS = tuple(a for a, x in ARCHITECTURES.items() if x.kind == "decoder")
ENCODERS = tuple(a for a, x in ARCHITECTURES.items() if x.kind == "encoder" and not x.head)
CLASSIFIERS = tuple(a for a, x in ARCHITECTURES.items() if x.head)
SUPPORTED = tuple(ARCHITECTURES)


class UnsupportedArchitecture(CheckpointError):
    pass


def architecture_of(config: dict, kind: Optional[str] = None) -> str:
    """The served architecture of a config.json dict (of `kind` "decoder" / "encoder" if given)."""
    supported = [a for a, x in ARCHITECTURES.items() if kind is None or x.kind == kind]
    archs = config.get("architectures") or []
    for a in archs:
        if a in supported:
            return a
    if not archs and BY_MODEL_TYPE.get(config.get("model_type")) in supported:
        return BY_MODEL_TYPE[config["model_type"]]
    raise UnsupportedArchitecture(
        f"unsupported {kind + ' ' if kind else ''}architecture {archs or config.get('model_type')!r}; "
        f"supported: {', '.join(supported)}")


def task_of(config: dict) -> str:
    arch = ARCHITECTURES[architecture_of(config)]
    if arch.kind == "decoder":
        return "generate"
    return "classify" if arch.head else "embed"
