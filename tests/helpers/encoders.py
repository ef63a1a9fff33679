"""Encoder-side helpers shared by tests/engine/test_encoder.py, tests/frontends/test_grpc_sglang.py
and benchmarks/parity_report.py: tiny random BERT cross-encoders and XLM-R encoders (transformers,
saved as HF folders with their own tokenizers), an EmbedWorker on them, and submit-and-wait."""
from __future__ import annotations

import json
import os
import random
import threading

import numpy as np

from jax_engine.config import EngineArgs, ModelSpec
from jax_engine.encode.worker import EmbedWorker, EncoderBuckets
from jax_engine.errors import EngineError
from jax_engine.types import EmbedOutput, EmbedRequest

WORDS = ("the a quick brown fox jumps over lazy dog what is capital of france paris city river "
         "bank money water bridge long short night day sun moon").split()
TINY_ARGS = dict(embed_max_batch_tokens=128, max_embed_inputs=64)


def run(worker: EmbedWorker, req: EmbedRequest, timeout: float = 120.0) -> EmbedOutput:
    """Submit and wait for the callback; re-raise an engine error."""
    got: dict = {}
    ev = threading.Event()

    def done(out):
        got["out"] = out
        ev.set()

    worker.submit(req, done)
    assert ev.wait(timeout), f"request {req.request_id} never finished"
    out = got["out"]
    if isinstance(out, EngineError):
        raise out
    return out


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(1)


def random_text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def perturb(model) -> None:
    """Random init is near-trivial (LayerNorm 1/0, std 0.02); spread weights so parity means something."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)


def save_bert_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(specials + WORDS + ["##s", "##ing"])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    BertTokenizerFast(tokenizer_object=tok).save_pretrained(path)


def save_xlmr_tokenizer(path: str) -> int:
    from transformers import XLMRobertaTokenizerFast

    pieces = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + w, -1.0 - i) for i, w in enumerate(WORDS)]
    pieces += [("\u2581", -40.0)] + [(c, -50.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    XLMRobertaTokenizerFast(vocab=pieces).save_pretrained(path)
    return len(pieces)


def build_bert_cross_encoder(path: str, num_labels: int) -> None:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    save_bert_tokenizer(path)
    cfg = BertConfig(vocab_size=len(WORDS) + 7, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, num_labels=num_labels)
    model = BertForSequenceClassification(cfg).eval()
    perturb(model)
    model.save_pretrained(path, safe_serialization=True)


def build_xlmr_encoder(path: str) -> None:
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaModel

    torch.manual_seed(0)
    vocab = save_xlmr_tokenizer(path)
    cfg = XLMRobertaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=66, type_vocab_size=1,
                           pad_token_id=1, bos_token_id=0, eos_token_id=2)
    model = XLMRobertaModel(cfg, add_pooling_layer=False).eval()
    perturb(model)
    model.save_pretrained(path, safe_serialization=True)
    # sentence-transformers layout: mean pooling, no Normalize module
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}], f)
    os.makedirs(os.path.join(path, "1_Pooling"))
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 32, "pooling_mode_cls_token": False,
                   "pooling_mode_mean_tokens": True}, f)


def make_worker(path: str, name: str, warm: bool = True, start: bool = True, **args) -> EmbedWorker:
    w = EmbedWorker(ModelSpec(name=name, path=path), EngineArgs(**{**TINY_ARGS, **args}))
    if warm:
        w.warmup(progress=False)
    if start:
        w.start()
    return w


def xlmr_reference(path: str, texts: list[str]) -> np.ndarray:
    import torch
    from transformers import AutoTokenizer, XLMRobertaModel

    tok = AutoTokenizer.from_pretrained(path)
    model = XLMRobertaModel.from_pretrained(path, add_pooling_layer=False).eval()
    enc = tok(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")
    with torch.no_grad():
        h = model(**enc).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).float()
    return ((h * m).sum(1) / m.sum(1)).numpy()


def one_bucket_padded(lengths: list[int], b: EncoderBuckets) -> int:
    """Padded tokens when a step's inputs run as one bucket: every row padded to the longest."""
    return b.batch_bucket(len(lengths)) * b.seq_bucket(max(lengths))
