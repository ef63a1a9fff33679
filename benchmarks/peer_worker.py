"""A torch peer (sentence-transformers, transformers `generate`) in its own process.

Why a separate process: with the JAX engine and torch in one process, XLA's thread pool and
torch's OpenMP threads share the cores and slow each other down (transformers fell from 34.7
to ~24 tok/s at batch 1 with jax loaded beside it). So the benchmark's own process runs the
engine (torch blocked), and the peer runs here (jax blocked), loaded once and driven round by
round, so the two sides still alternate in the same time window.

Protocol: one JSON object per line on stdin, `{"cmd": NAME, ...args}`; one JSON line back,
`{"ok": true, "result": ...}` or `{"ok": false, "error": "..."}`. The worker points its fd 1
at stderr before loading anything, so a library that prints cannot corrupt the replies.
All timings are taken here, inside the peer, around the peer's own call; the parent wraps
each call in a CPU window that counts both processes (`Peer.timed`).

The client class `Peer` imports only the standard library and benchmarks.common, so the
engine process can use it without importing torch. The same protocol serves the other peers:
`Peer(module="benchmarks.llamacpp_peer")` (llama.cpp) and `Peer(module="benchmarks.ort_peer")`
(ONNX Runtime) start a worker of their own class through `run_worker` (neither jax nor torch in
those processes).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C


class PeerError(RuntimeError):
    """The peer worker answered a command with an error (its traceback is the message)."""


# =============================================================================================
# client side (runs in the engine's process)
# =============================================================================================
class Peer:
    """A running peer worker subprocess; `call` sends one command and waits for its reply.

    `module` is the worker's module (default: this one, the torch peer). `window_pids` are the
    processes every `timed` CPU window counts as ours (this peer's by default; a script with
    several peers sets it to all of them, so an idle peer's stray CPU is not called 'others')."""

    def __init__(self, module: str = "benchmarks.peer_worker", argv: list[str] | None = None,
                 env: dict[str, str] | None = None, name: str = "peer") -> None:
        """argv / env: run that command line (with these extra environment variables) instead of
        `python -m module`; name: how errors call this worker."""
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
        self.module, self.name = module, name
        self.proc = subprocess.Popen(argv or [sys.executable, "-m", module], cwd=C.REPO_ROOT, env=full_env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        self.window_pids = [self.pid]
        self.hello = self.call("hello")

    def call(self, cmd: str, **args: Any) -> Any:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise PeerError(f"{self.name} worker exited with {self.proc.wait()} during {cmd!r}")
        msg = json.loads(line)
        if not msg.get("ok"):
            raise PeerError(f"{self.name} {cmd}: {msg.get('error')}")
        return msg["result"]

    def timed(self, cmd: str, **args: Any) -> dict:
        """One measured round: the call inside a CPU window over this process and the peer."""
        with C.cpu_window(self.window_pids) as w:
            res = self.call(cmd, **args)
        res["cpu"] = w.result
        return res

    def limits(self, gib: float, repeats: int, matmul: bool = True) -> dict:
        """One bandwidth (and matmul) probe with torch, in the peer process."""
        return self.call("limits", gib=gib, repeats=repeats, matmul=matmul)

    def isolation(self) -> dict:
        return self.call("isolation")

    def close(self) -> int | None:
        if self.proc.poll() is None:
            try:
                self.call("quit")
            except (PeerError, OSError, ValueError):
                pass
            return C.wait_or_kill(self.proc)
        return self.proc.returncode



def probe_limits(gib: float, repeats: int, matmul: bool = True) -> dict:
    """A one-off torch probe in a short-lived peer (for scripts that have no peer of their own)."""
    peer = Peer()
    try:
        return peer.limits(gib, repeats, matmul)
    finally:
        peer.close()


# =============================================================================================
# worker side (runs in the peer's process)
# =============================================================================================
def set_torch_threads(n: int = C.NUM_CORES) -> int:
    import torch

    torch.set_num_threads(n)
    return torch.get_num_threads()


def _probe(fn: Callable[[], Any], repeats: int) -> list[float]:
    fn()  # warm: page faults, first touch, caches
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def torch_limits(gib: float = 2.0, repeats: int = 5, matmul: bool = True) -> dict:
    """Read bandwidth (torch sum, all threads, a buffer far larger than any cache) and the
    fp32 / bf16 torch.matmul rate. Limits are the best repeat (another process can only make
    a repeat slower); the medians are kept beside them."""
    import torch

    threads = set_torch_threads()
    n = int(gib * 2 ** 30) // 4
    nbytes = n * 4
    res: dict[str, Any] = {"buffer_gib": gib, "torch_threads": threads, "repeats": repeats}
    with C.cpu_window() as w:
        t = _sum_times(n, repeats)
        res["torch_sum_gbps"] = C.rnd(nbytes / min(t) / 1e9, 2)
        res["torch_sum_gbps_median"] = C.rnd(nbytes / C.median(t) / 1e9, 2)
        res["torch_sum_gbps_runs"] = [C.rnd(nbytes / s / 1e9, 1) for s in t]
        if matmul:
            m = 4096 if gib >= 1 else 2048
            res["matmul_size"] = m
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                mm = _matmul_size(m, dtype)
                if mm != m:
                    res[f"matmul_size_{name}"] = mm
                t = _matmul_times(mm, dtype, 3)
                res[f"torch_matmul_{name}_gflops"] = C.rnd(2 * mm ** 3 / min(t) / 1e9, 1)
                res[f"torch_matmul_{name}_gflops_median"] = C.rnd(2 * mm ** 3 / C.median(t) / 1e9, 1)
    res["cpu"] = w.result
    return res


def _sum_times(n: int, repeats: int) -> list[float]:
    """Seconds per read-only pass (torch sum, all threads) over n float32 values."""
    import torch

    x = torch.ones(n, dtype=torch.float32)
    return _probe(lambda: float(x.sum()), repeats)


def _matmul_size(m: int, dtype, budget_s: float = 1.0) -> int:
    """`m`, or a smaller power of two where one m x m matmul would take over `budget_s`: torch's
    bfloat16 matmul on a CPU without AVX512_BF16 / AMX ran at a few GFLOP/s (a 2-vCPU Zen 3:
    minutes for the 4096 probe's four calls). Timed from one warm 512 x 512 call."""
    import torch

    small = 512
    a = torch.randn(small, small).to(dtype)
    torch.matmul(a, a)                     # warm: the thread pool's start
    t0 = time.perf_counter()
    torch.matmul(a, a)
    rate = 2 * small ** 3 / max(time.perf_counter() - t0, 1e-9)
    while m > small and 2 * m ** 3 / rate > budget_s:
        m //= 2
    return m


def _matmul_times(m: int, dtype, repeats: int) -> list[float]:
    """Seconds per m x m torch.matmul in `dtype`."""
    import torch

    a, b = torch.randn(m, m).to(dtype), torch.randn(m, m).to(dtype)
    return _probe(lambda: torch.matmul(a, b), repeats)


class Worker:
    """The peer's state (loaded models, named text lists) and one method per command."""

    def __init__(self) -> None:
        self.texts: dict[str, list[str]] = {}
        self.st = None
        self.hf: dict[str, Any] = {}

    # ---------------------------------------------------------------- general
    def cmd_hello(self) -> dict:
        return {"torch_threads": set_torch_threads(), **C.isolation_report(C.PEER_BLOCKED)}

    def cmd_isolation(self) -> dict:
        return C.isolation_report(C.PEER_BLOCKED)

    def cmd_limits(self, gib: float, repeats: int, matmul: bool = True) -> dict:
        return torch_limits(gib, repeats, matmul)

    def cmd_set_texts(self, key: str, texts: list[str]) -> dict:
        """Keep a text list here, so a round's command does not ship the corpus again."""
        self.texts[key] = list(texts)
        return {"n": len(texts)}

    # ---------------------------------------------------------------- sentence-transformers
    def cmd_st_load(self, path: str) -> dict:
        from sentence_transformers import SentenceTransformer

        t0 = time.perf_counter()
        self.st = SentenceTransformer(path, device="cpu")
        self.st.eval()
        return {"load_s": time.perf_counter() - t0, "max_seq_length": self.st.max_seq_length}

    def _encode(self, texts: list[str], batch_size: int):
        return self.st.encode(texts, batch_size=batch_size, convert_to_numpy=True, show_progress_bar=False)

    def cmd_st_encode(self, key: str, batch_size: int, return_embeddings: bool = False) -> dict:
        """The whole text list in one encode() call, as its users run it (ST sorts by length)."""
        texts = self.texts[key]
        t0 = time.perf_counter()
        emb = self._encode(texts, batch_size)
        dt = time.perf_counter() - t0
        out: dict[str, Any] = {"seconds": dt, "sentences_per_s": len(texts) / dt}
        if return_embeddings:
            out["embeddings"] = emb.astype("float32").tolist()
        return out

    def cmd_st_latency(self, key: str) -> dict:
        """One encode([s]) call per sentence: the batch-1 latency a single-sentence caller sees."""
        lat = []
        t0 = time.perf_counter()
        for s in self.texts[key]:
            t = time.perf_counter()
            self._encode([s], 1)
            lat.append(time.perf_counter() - t)
        dt = time.perf_counter() - t0
        return {"seconds": dt, "sentences_per_s": len(lat) / dt, "latencies": lat}

    def cmd_st_token_lengths(self, key: str) -> dict:
        return {"lengths": [len(x) for x in self.st.tokenizer(self.texts[key])["input_ids"]]}

    # ---------------------------------------------------------------- transformers generate
    def cmd_hf_load(self, path: str, dtype: str) -> dict:
        import torch
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
        model.eval()
        self.hf[dtype] = model
        return {"load_s": time.perf_counter() - t0, "params": sum(p.numel() for p in model.parameters()),
                "dtype": str(next(model.parameters()).dtype).replace("torch.", "")}

    def cmd_hf_unload(self, dtype: str) -> dict:
        import gc

        self.hf.pop(dtype, None)
        gc.collect()
        return {}

    def cmd_hf_generate(self, dtype: str, prompts: list[list[int]], new_tokens: int, cache: str | None) -> dict:
        """Greedy generate of exactly `new_tokens`; a logits processor stamps every step."""
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList

        stamps: list[float] = []

        class Stamp(LogitsProcessor):
            def __call__(self, input_ids, scores):
                stamps.append(time.perf_counter())
                return scores

        ids = torch.tensor(prompts, dtype=torch.long)
        kw: dict[str, Any] = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False,
                              "logits_processor": LogitsProcessorList([Stamp()]), "pad_token_id": 0, "eos_token_id": 2}
        if cache:
            kw["cache_implementation"] = cache
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.hf[dtype].generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
            t1 = time.perf_counter()
        B, T = ids.shape
        steps = max(1, len(stamps) - 1)
        return {"prefill_s": stamps[0] - t0, "decode_tok_s": B * (len(stamps) - 1) / (stamps[-1] - stamps[0]),
                "e2e_s": t1 - t0, "steps": len(stamps), "ms_per_step": (stamps[-1] - stamps[0]) / steps * 1e3,
                "output_ids": out[:, T:].tolist()}


def serve(inp, out, worker_cls: type | None = None) -> None:
    """Answer commands from `inp` on `out` until `quit` or end of input."""
    w = (worker_cls or Worker)()
    for line in inp:
        if not line.strip():
            continue
        msg = json.loads(line)
        cmd = msg.pop("cmd")
        if cmd == "quit":
            out.write(json.dumps({"ok": True, "result": {}}) + "\n")
            out.flush()
            return
        try:
            reply = {"ok": True, "result": getattr(w, f"cmd_{cmd}")(**msg)}
        except Exception:  # noqa: BLE001 -- any failure goes back to the parent, which decides
            reply = {"ok": False, "error": traceback.format_exc(limit=6)}
        out.write(json.dumps(reply, default=C._json_default) + "\n")
        out.flush()


def run_worker(worker_cls: type | None = None, blocked: tuple[str, ...] = C.PEER_BLOCKED) -> None:
    """A worker process's main: block `blocked`, keep fd 1 for the replies, serve commands."""
    C.block_modules(blocked)
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)               # anything printed from here on goes to stderr
    sys.stdout = sys.stderr
    serve(sys.stdin, proto, worker_cls)


def main() -> None:
    run_worker(Worker)


if __name__ == "__main__":
    main()
