"""Which model class serves which HF architecture (chosen from config.json)."""
from __future__ import annotations

from jax_engine.errors import InvalidRequest

DECODERS = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
ENCODERS = (
    "BertModel",
    "BertForMaskedLM",
    "XLMRobertaModel",
    "RobertaModel",
)
CLASSIFIERS = (
    "BertForSequenceClassification",
    "XLMRobertaForSequenceClassification",
    "RobertaForSequenceClassification",
)
SUPPORTED = DECODERS + ENCODERS + CLASSIFIERS


class UnsupportedArchitecture(InvalidRequest):
    pass


def architecture_of(config: dict) -> str:
    archs = config.get("architectures") or []
    for a in archs:
        if a in SUPPORTED:
            return a
    # sentence-transformers folders sometimes omit `architectures`; fall back on model_type
    by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "bert": "BertModel", "xlm-roberta": "XLMRobertaModel",
               "roberta": "RobertaModel"}
    if not archs and config.get("model_type") in by_type:
        return by_type[config["model_type"]]
    raise UnsupportedArchitecture(
        f"unsupported architecture {archs or config.get('model_type')!r}; supported: {', '.join(SUPPORTED)}"
    )


def task_of(config: dict) -> str:
    arch = architecture_of(config)
    if arch in DECODERS:
        return "generate"
    if arch in CLASSIFIERS:
        return "classify"
    return "embed"
