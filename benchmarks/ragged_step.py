"""The ragged step engine against the split engine it replaced: saturation, Poisson latency, token budget.

What changed: the engine used to run, per scheduler step, a prefill program (chunks under the
token budget), then a separate decode+sample program for every running sequence (commit
fa23e3a, "split"). It now runs ONE ragged step program per scheduler step: every running
sequence's next token first, prefill chunks in what is left of the budget, the first token of a
finished prompt drawn in the same step (jax_engine/decode/runner.py, scheduler.py; "ragged",
the working tree). The issue asks, as same-run ratios against that peer:
  * completed tokens/s at saturation (32 concurrent streams, 128-token prompts, 128 new tokens,
    greedy, ignore_eos) >= 1.3x the split engine;
  * Poisson arrivals of 128-token prompts / 128-token answers at 0.5, 1 and 2 req/s:
    ITL p99 <= 4x ITL p50, and TTFT p50 no worse than the split engine's by more than 20 %;
  * ITL p99 and TTFT p50 against the token budget (--max-num-batched-tokens), so the default
    (64 on CPU) is a visible choice: benchmarks/results/ragged_step_budget.png.
Each engine runs with its own default budget in the comparison (ragged 64, split 512), as a
user who sets nothing gets them.
benchmarks/serve_load.py measures the served (gRPC / HTTP) version of the Poisson load; this
script compares the two engines in-process, nothing else in between.

How: each engine runs in its own worker process (this script with --worker --tree DIR, which
puts DIR first on sys.path, so `jax_engine` comes from that tree, and speaks the JSON-lines
protocol of benchmarks/peer_worker.py; torch is blocked there). "ragged" imports the engine
from this repository's working tree; "split" from a `git worktree add --detach` of fa23e3a
under ~/.cache/xlaserve/bench-trees/fa23e3a (created when absent, never modified). Both build
  Engine(EngineArgs(models=[ModelSpec("bench", <random 'small' Llama>)], max_running_requests=32,
         max_num_batched_tokens=BUDGET, max_model_len=512, page_size=16,
         enable_prefix_cache=False, compile_cache_dir=~/.cache/xlaserve/bench-jax-cache))
with the benchmark's random 'small' Llama (benchmarks/generate_vs_hf.py; 'tiny' in --quick).
Both engines compile their programs ahead of time (warmup=True, their normal start): ~20-30
ragged step programs per budget, ~140 split programs (72 decode, 56 prefill, first-token,
prompt-logprobs); the shared persistent compile cache makes every later start a load.
--split-warmup lazy (the --quick default, to stay short) compiles the split engine's programs
on first use instead; a Poisson warm-up round cannot be sure to meet every shape, so a compile
may then land in a timed round. Either way an untimed warm-up round of the same scenario
(saturation; Poisson at the highest rate) runs on each engine before its timed rounds, and
every timed run records the programs that appeared and JAX's backend compilations during it
(`compiles`, printed as COMPILED), so a compile inside a timed round is visible, not hidden.
Timed rounds alternate between the engines, the first side rotating from round to round
(ragged, split | split, ragged | ...); figures are medians over rounds (clean rounds when there
are any, see benchmarks/common.py), ratios come from the same run. The CPU window of every
round counts both worker processes as ours.

Scenarios (timed inside the worker, on its own clock):
  saturation   `streams` requests submitted at once. completed_tok_s = all output tokens /
               (first submit -> last token); decode_tok_s = tokens that arrive while all
               streams decode (after the last first token, up to the first finish) / that time.
  poisson      N requests with exponential gaps at RATE req/s (fixed seed: the same arrival
               times and prompts for both engines and every round; the default seed 8 draws
               gaps whose mean is within 2 % of 1/RATE for 20 and for 6 requests, so the rate
               sent is the rate named; seed 7, serve_load's, would send 1.6x it with 20).
               Per request TTFT = submit -> first token event; ITL = gaps between consecutive
               token events of one request.
               Reported: the rate actually sent, TTFT p50/p99, ITL p50/p99 and p99/p50, output
               tok/s (all output tokens / first submit -> last token), errors.
  budget sweep the ragged engine only, one worker per budget (64, 96, 128, 256, 512), Poisson
               at 1 and 2 req/s; the default budget's point reuses the comparison's ragged medians.

Time (2 cores, 'small' model, compile cache warm): a saturation round ~12 s per engine
(4096 prompt tokens at ~1 ms each, then 128 steps at batch 32 at ~55 ms): 1 warm-up + 3
rounds x 2 engines ~ 100 s. Poisson with 20 requests lasts ~ 19/RATE + 3.5 s: ~77 s per
engine per round over 0.5/1/2 req/s; 1 warm-up (2 req/s) + 2 rounds x 2 engines ~ 340 s. The
sweep: 4 budgets x (start ~15 s + warm-up 13 s + 1 and 2 req/s ~36 s) ~ 260 s. Engine starts
~40 s. About 12-13 minutes in all on a quiet machine (a busy one adds up to 60 s before the
start and 10 s before each of the ~18 rounds, waiting for quiet). The first run on an empty
compile cache adds the compilations: ~140 split programs and ~25 ragged ones per budget,
2-4 s each on 2 cores (about 5-8 minutes more).
--quick (tiny model, 64-token prompts, 32 new tokens, 6 requests at 2 req/s, budgets 128 and
512, one round) is a smoke test of every path in about 2-3 minutes.

Run:  python -m benchmarks.ragged_step [--quick] [--phases saturation,poisson,sweep]
          [--rounds 2] [--saturation-rounds 3] [--requests 20] [--rates 0.5,1,2]
          [--budgets 64,96,128,256,512] [--sweep-rates 1,2] [--budget 64] [--split-budget 512]
          [--split-commit fa23e3a] [--split-warmup aot|lazy] [--quiet-wait S] [--no-plot]
Writes benchmarks/results/ragged_step.json (ragged_step_quick.json) and ragged_step_budget.png.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C
from benchmarks import generate_vs_hf as G
from benchmarks.peer_worker import Peer, PeerError, probe_limits, run_worker
from benchmarks.serve_load import arrival_times, sent_rate

NAME = "ragged_step"
SPLIT_COMMIT = "fa23e3a"
TREES = ("ragged", "split")
MODEL_NAME = "bench"
DEFAULT_BUDGET = 64          # the ragged engine's CPU default (jax_engine/config.token_budget_default)
SPLIT_DEFAULT_BUDGET = 512   # the split engine's default at fa23e3a
SCRIPT = os.path.abspath(__file__)
# the goals
SATURATION_GOAL = 1.3        # ragged / split completed tok/s, at least
ITL_SPREAD_GOAL = 4.0        # ITL p99 / ITL p50, at most
TTFT_GOAL = 1.2              # ragged / split TTFT p50, at most
# the per-run scalars a Poisson run reports (medians over rounds are taken of these)
POISSON_KEYS = ("offered_rate_rps", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "itl_p99_over_p50",
                "output_tok_s", "duration_s")
SATURATION_KEYS = ("completed_tok_s", "decode_tok_s", "prefill_s", "ttft_first_s", "e2e_s", "ms_per_step_p50")


# =============================================================================================
# pure helpers (tests/unit/test_bench_ragged.py)
# =============================================================================================
def alternation(names: Sequence[str], rounds: int, first: int = 0) -> list[list[str]]:
    """The order of every round: each side once per round, the first side rotating from round
    to round (ragged, split | split, ragged | ...), as common.run_pairs does."""
    names = list(names)
    out = []
    for r in range(rounds):
        k = (r + first) % len(names)
        out.append(names[k:] + names[:k])
    return out


def itl_gaps(events: Sequence[tuple[float, int]]) -> list[float]:
    """Inter-token latencies of one request: the gaps between consecutive token events."""
    return [b[0] - a[0] for a, b in zip(events, events[1:])]


def poisson_metrics(recs: list[dict], rate: float, new_tokens: int) -> dict:
    """One Poisson run's figures from its request records ({t_send, events, ids, error, t_end}):
    TTFT = send -> first token event, ITL = gaps between one request's consecutive token events,
    output tok/s = every output token / (first send -> last token)."""
    ok = [r for r in recs if r.get("error") is None and len(r["ids"]) == new_tokens]
    ttft = [r["events"][0][0] - r["t_send"] for r in ok if r["events"]]
    itl = [g for r in ok for g in itl_gaps(r["events"])]
    tokens = sum(len(r["ids"]) for r in recs)
    ends = [r["events"][-1][0] for r in recs if r["events"]]
    span = (max(ends) - min(r["t_send"] for r in recs)) if ends else 0.0
    t, i = C.summarize(ttft, 1e3, 2), C.summarize(itl, 1e3, 2)
    return {
        "nominal_rate_rps": rate, "offered_rate_rps": C.rnd(sent_rate(recs), 3), "requests": len(recs),
        "errors": len(recs) - len(ok),
        "error_samples": sorted({str(r.get("error") or f"{len(r['ids'])} tokens") for r in recs if r not in ok})[:3],
        "output_tokens": tokens, "duration_s": C.rnd(span, 2),
        "output_tok_s": C.rnd(tokens / span, 1) if span > 0 else None,
        "ttft_ms": t, "itl_ms": i,
        "ttft_p50_ms": t.get("p50"), "ttft_p99_ms": t.get("p99"), "itl_p50_ms": i.get("p50"), "itl_p99_ms": i.get("p99"),
        "itl_p99_over_p50": C.ratio(i.get("p99"), i.get("p50")),
    }


def saturation_metrics(t0: float, recs: list[dict], new_tokens: int) -> dict:
    """Completed tokens/s (all output tokens / first submit -> last token) and the steady decode
    rate while every stream decodes (generate_vs_hf.stream_metrics), without the token ids."""
    m = G.stream_metrics(t0, recs, new_tokens)
    m.pop("output_ids", None)
    m["completed_tok_s"] = m.pop("e2e_tok_s", None)
    m["streams"] = len(recs)
    return m


def saturation_flops(cfg: dict, streams: int, prompt_len: int, new_tokens: int) -> float:
    """Floating-point operations of the saturation workload on a Llama-shaped config.json: every
    token through every layer's matrices (2 per weight), the LM head for each drawn token, and
    attention (QK and PV, 4 x context x heads x head dim per token and layer) at each token's
    own context. What any engine must compute, whatever it batches."""
    H, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    nh = cfg["num_attention_heads"]
    D = cfg.get("head_dim") or H // nh
    kv = cfg.get("num_key_value_heads") or nh
    layer_weights = H * (nh + 2 * kv) * D + nh * D * H + 3 * H * cfg["intermediate_size"]
    tokens = prompt_len + new_tokens - 1                  # the last token is drawn, never fed
    ctx_sum = tokens * (tokens + 1) / 2                   # sum over positions of the context attended
    per_stream = 2 * L * layer_weights * tokens + 2 * V * H * new_tokens + 4 * L * nh * D * ctx_sum
    return float(streams * per_stream)


def compute_floor(flops: float, gflops: float | None, streams: int, new_tokens: int) -> dict:
    """The fastest the saturation workload can complete at a measured matmul rate (no engine can
    beat it on this host): seconds and completed tokens/s."""
    if not gflops:
        return {}
    s = flops / (gflops * 1e9)
    return {"flops": flops, "matmul_gflops": gflops, "floor_s": C.rnd(s, 3),
            "max_completed_tok_s": C.rnd(streams * new_tokens / s, 1)}


def compile_delta(before: dict, after: dict) -> dict:
    """What a timed run added to a worker's compile counters."""
    return {k: after[k] - before[k] for k in ("programs", "jax_compiles", "engine_after_warmup")
            if k in before and k in after}


def median_of(runs: list[dict], key: str, digits: int = 3) -> float | None:
    """The median of `key` over clean runs when there are any, else over all (None if absent)."""
    clean = [r for r in runs if r.get("clean")]
    use = clean or runs
    return C.rnd(C.median(r[key] for r in use if r.get(key) is not None), digits)


def pair_table(a: list[dict], b: list[dict], keys: Sequence[str]) -> dict:
    """Per key: medians of each side and the ratio a / b (common.paired_summary), the quoted
    figures from clean rounds when there are any."""
    out = {}
    for key in keys:
        ps = C.paired_summary(a, b, key, 3)
        clean = ps["clean_rounds"] > 0
        out[key] = {"ragged": ps["a_clean"] if clean else ps["a"], "split": ps["b_clean"] if clean else ps["b"],
                    "ratio_ragged_over_split": ps["best"], "from_clean_rounds": clean, "all_rounds": ps}
    return out


def targets(doc: dict) -> dict:
    """The issue's goals, checked against this run's figures."""
    t: dict[str, Any] = {}
    sat = doc.get("saturation")
    if sat:
        t["saturation_completed_tok_s_ragged_over_split"] = C.target(
            sat["summary"]["completed_tok_s"]["ratio_ragged_over_split"], SATURATION_GOAL)
    for rate, p in (doc.get("poisson") or {}).items():
        s = p["summary"]
        t[f"poisson_{rate}_itl_p99_over_p50_ragged"] = C.target(s["itl_p99_over_p50"]["ragged"], ITL_SPREAD_GOAL,
                                                                higher_is_better=False)
        t[f"poisson_{rate}_ttft_p50_ragged_over_split"] = C.target(s["ttft_p50_ms"]["ratio_ragged_over_split"],
                                                                   TTFT_GOAL, higher_is_better=False)
    comp = doc.get("compiles") or {}
    if "ragged" in comp:
        t["ragged_programs_added_in_timed_runs"] = C.target(comp["ragged"].get("timed_programs_added"), 0,
                                                            higher_is_better=False)
    errs = [r.get("errors", 0) for tree in TREES for r in timed_runs(doc, tree)]
    errs += [m.get("errors", 0) for by_rate in (doc.get("budget_sweep") or {}).values() for m in by_rate.values()]
    if errs:
        t["errors"] = C.target(sum(errs), 0, higher_is_better=False)
    return t


def timed_runs(doc: dict, tree: str) -> list[dict]:
    """Every timed run of one engine in the comparison (saturation and Poisson rounds)."""
    sat = ((doc.get("saturation") or {}).get("rounds") or {}).get(tree, [])
    return list(sat) + [r for p in (doc.get("poisson") or {}).values() for r in p["rounds"].get(tree, [])]


def compile_summary(load: dict, end: dict, timed: list[dict]) -> dict:
    """An engine's programs: at load, at the end, and what appeared during its timed runs."""
    return {"warmup": load["warmup"], "programs_at_load": load["counts"]["programs"], "programs_end": end["programs"],
            "engine_compilations_after_warmup": end["engine_after_warmup"],
            "timed_programs_added": sum((t.get("compiles") or {}).get("programs", 0) for t in timed),
            "timed_jax_compiles": sum((t.get("compiles") or {}).get("jax_compiles", 0) for t in timed)}


def sweep_rows(sweep: dict) -> list[dict]:
    """The budget sweep as flat rows {budget, rate, ttft_p50_ms, itl_p99_ms, ...}, budget-sorted."""
    rows = []
    for budget, by_rate in sweep.items():
        for rate, m in by_rate.items():
            rows.append({"budget": int(budget), "rate": float(rate), **{k: m.get(k) for k in POISSON_KEYS}})
    return sorted(rows, key=lambda r: (r["rate"], r["budget"]))


def parse_list(text: str, kind: Callable[[str], Any] = float) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def rate_key(rate: float) -> str:
    """A rate as a results key: 0.5 -> '0.5', 2.0 -> '2'."""
    return f"{rate:g}"


# =============================================================================================
# the engine worker (its own process; jax_engine from the tree it was given)
# =============================================================================================
class EngineWorker:
    """One engine, built from the tree `tree`; commands as in benchmarks/peer_worker.py."""

    def __init__(self, tree: str) -> None:
        self.tree = os.path.abspath(tree)
        if "jax_engine" in sys.modules:
            raise RuntimeError("jax_engine was imported before the tree was put on sys.path")
        sys.path.insert(0, self.tree)
        import jax_engine

        here = os.path.abspath(jax_engine.__file__)
        if not here.startswith(self.tree + os.sep):
            raise RuntimeError(f"jax_engine came from {here}, not from {self.tree}")
        self.engine = None
        self.vocab = 0
        self.loop = asyncio.new_event_loop()

    def cmd_hello(self) -> dict:
        import jax_engine

        return {"pid": os.getpid(), "tree": self.tree, "jax_engine": os.path.dirname(jax_engine.__file__),
                **C.isolation_report(C.ENGINE_BLOCKED)}

    def cmd_load(self, model_dir: str, budget: int, max_running: int, max_model_len: int, warmup: bool,
                 cache_dir: str) -> dict:
        from jax_engine.config import EngineArgs, ModelSpec
        from jax_engine.engine import Engine

        with open(os.path.join(model_dir, "config.json")) as f:
            self.vocab = json.load(f)["vocab_size"]
        t0 = time.perf_counter()
        self.engine = Engine(EngineArgs(models=[ModelSpec(name=MODEL_NAME, path=model_dir)],
                                        max_running_requests=max_running, max_num_batched_tokens=budget,
                                        max_model_len=max_model_len, page_size=16, enable_prefix_cache=False,
                                        compile_cache_dir=cache_dir))
        self.engine.load_all(progress=False, warmup=warmup)
        runner = self.engine.worker(MODEL_NAME).replicas[0].runner
        buckets = {k: list(getattr(runner, k)) for k in ("token_buckets", "page_buckets", "batch_buckets",
                                                           "prefill_batch_buckets") if hasattr(runner, k)}
        return {"load_s": round(time.perf_counter() - t0, 2), "warmup": "aot" if warmup else "lazy", "budget": budget,
                "runner_max_tokens": getattr(runner, "max_tokens", None), "buckets": buckets,
                "num_pages": runner.rc.num_pages, "counts": self.cmd_counts()}

    def cmd_counts(self) -> dict:
        from jax_engine.executor.compilation import global_compile_count

        runners = self.engine.decoder_runners()
        return {"programs": sum(len(r.programs) for r in runners.values()), "jax_compiles": global_compile_count(),
                "engine_after_warmup": self.engine.compilations_after_warmup()}

    async def _stream(self, prompt: list[int], new_tokens: int) -> dict:
        from jax_engine.types import GenerateRequest, SamplingParams

        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, temperature=0.0)
        req = GenerateRequest(request_id="", prompt_ids=list(prompt), params=params)
        rec: dict[str, Any] = {"t_send": time.perf_counter(), "events": [], "ids": [], "error": None,
                               "finish_reason": None}
        try:
            async for out in self.engine.generate(req):
                if out.new_token_ids:
                    rec["events"].append((time.perf_counter(), len(out.new_token_ids)))
                    rec["ids"] += out.new_token_ids
                if out.finished:
                    rec["finish_reason"] = out.finish_reason
                    rec["error"] = out.error
        except Exception as e:  # noqa: BLE001 -- recorded as the request's error
            rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rec["t_end"] = time.perf_counter()
        return rec

    def _timed(self, coro) -> tuple[Any, dict]:
        before = self.cmd_counts()
        got = self.loop.run_until_complete(coro)
        return got, compile_delta(before, self.cmd_counts())

    def _burst_steps(self) -> int | None:
        """Steps run at the burst budget so far (None: an engine without burst steps)."""
        return getattr(self.engine.stats(MODEL_NAME), "burst_steps", None)

    def cmd_saturation(self, streams: int, prompt_len: int, new_tokens: int, seed: int) -> dict:
        prompts = G.make_prompts(streams, prompt_len, self.vocab, seed)

        async def run() -> tuple[float, list[dict]]:
            t0 = time.perf_counter()
            return t0, await asyncio.gather(*[self._stream(p, new_tokens) for p in prompts])

        bursts = self._burst_steps()
        (t0, recs), delta = self._timed(run())
        after = self._burst_steps()
        return {**saturation_metrics(t0, recs, new_tokens), "compiles": delta,
                "burst_steps": None if after is None or bursts is None else after - bursts}

    def cmd_poisson(self, rate: float, n: int, prompt_len: int, new_tokens: int, seed: int) -> dict:
        prompts = G.make_prompts(n, prompt_len, self.vocab, seed)
        times = arrival_times(n, rate, seed)

        async def run() -> list[dict]:
            t0 = time.perf_counter()

            async def fire(at: float, p: list[int]) -> dict:
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                return await self._stream(p, new_tokens)

            return await asyncio.gather(*[fire(at, p) for at, p in zip(times, prompts)])

        bursts = self._burst_steps()
        recs, delta = self._timed(run())
        after = self._burst_steps()
        return {**poisson_metrics(recs, rate, new_tokens), "compiles": delta,
                "burst_steps": None if after is None or bursts is None else after - bursts}

    def cmd_close(self) -> dict:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        return {}


def worker_main(tree: str) -> None:
    os.environ.setdefault("XLASERVE_PROGRESS", "0")
    run_worker(functools.partial(EngineWorker, tree), blocked=C.ENGINE_BLOCKED)


# =============================================================================================
# the driver's side of a worker
# =============================================================================================
class TreeProcess(Peer):
    """A worker process running the engine of one tree (peer_worker's JSON-lines protocol)."""

    def __init__(self, name: str, tree: str) -> None:
        self.tree = tree
        super().__init__(argv=[sys.executable, SCRIPT, "--worker", "--tree", tree], env={"XLASERVE_PROGRESS": "0"},
                         name=name)

    def close(self) -> int | None:
        if self.proc.poll() is None:
            for cmd in ("close", "quit"):
                try:
                    self.call(cmd)
                except (PeerError, OSError, ValueError):
                    break
            return C.wait_or_kill(self.proc)
        return self.proc.returncode


def trees_root() -> str:
    return os.path.join(os.path.dirname(C.bench_cache_root()), "bench-trees")


def jax_cache_dir() -> str:
    return os.path.join(os.path.dirname(C.bench_cache_root()), "bench-jax-cache")


def _git(*args: str, cwd: str = C.REPO_ROOT) -> str:
    return subprocess.run(["git", "-C", cwd, *args], check=True, capture_output=True, text=True).stdout.strip()


def ensure_tree(commit: str, root: str | None = None) -> str:
    """A detached git worktree of `commit` (created once, never modified); returns its path."""
    path = os.path.join(root or trees_root(), commit)
    want = _git("rev-parse", f"{commit}^{{commit}}")
    if os.path.isfile(os.path.join(path, "jax_engine", "engine.py")):
        have = _git("rev-parse", "HEAD", cwd=path)
        if have != want:
            raise RuntimeError(f"{path} is at {have[:10]}, not {commit}; remove it (git worktree remove) to rebuild")
        return path
    C.log(f"creating a git worktree of {commit} at {path} (once) ...")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    add = ["git", "-C", C.REPO_ROOT, "worktree", "add", "--detach"]
    p = subprocess.run([*add, path, want], capture_output=True, text=True)
    if p.returncode != 0:     # a registered worktree whose folder was deleted: add -f re-creates it
        subprocess.run([*add, "-f", path, want], check=True, capture_output=True, text=True)
    return path


def tree_info(path: str) -> dict:
    """Which code a tree is: its commit and, for a working tree with local changes to the engine,
    a hash of `git diff HEAD -- jax_engine` (so the results name exactly what was measured)."""
    try:
        commit = _git("rev-parse", "HEAD", cwd=path)
        changed = _git("diff", "HEAD", "--name-only", "--", "jax_engine", cwd=path).split()
        untracked = _git("ls-files", "--others", "--exclude-standard", "--", "jax_engine", cwd=path).split()
        diff = _git("diff", "HEAD", "--", "jax_engine", cwd=path) if changed else ""
    except (subprocess.CalledProcessError, OSError) as e:
        return {"path": path, "error": str(e)[:200]}
    return {"path": path, "commit": commit, "engine_files_changed": changed, "engine_files_untracked": untracked,
            "engine_diff_sha1": hashlib.sha1(diff.encode()).hexdigest()[:12] if diff else None}


# =============================================================================================
# rounds
# =============================================================================================
def run_rounds(sides: dict[str, Callable[[], dict]], rounds: int, label: str, quiet_s: float) -> dict[str, list[dict]]:
    """Every side once per round in alternation() order; each result marked with its round and
    whether the round was clean (no side disturbed)."""
    out: dict[str, list[dict]] = {n: [] for n in sides}
    for r, order in enumerate(alternation(list(sides), rounds)):
        if quiet_s > 0:
            q = C.wait_for_quiet(quiet_s, C.DISTURBED_OTHERS_SHARE)
            if q["waited_s"] > 1:
                C.log(f"  waited {q['waited_s']}s for a quiet machine (others {q['others_share_at_start']})")
        got = {}
        for n in order:
            res = sides[n]()
            got[n] = res
            C.log(f"  {label} round {r + 1} {n}: {res.get('headline', '')} cpu {res['cpu']['cpu_share_of_cores']} "
                  f"others {res['cpu']['others_share_of_cores']}{' DISTURBED' if res['cpu']['disturbed'] else ''}"
                  f"{' COMPILED ' + str(res['compiles']) if any((res.get('compiles') or {}).values()) else ''}")
        clean = not any(g["cpu"]["disturbed"] for g in got.values())
        for n, res in got.items():
            res["round"], res["clean"] = r, clean
            out[n].append(res)
    return out


def _headline_sat(m: dict) -> dict:
    m["headline"] = (f"completed {m.get('completed_tok_s') or 0:.1f} tok/s, decode {m.get('decode_tok_s') or 0:.1f} "
                     f"tok/s, prefill {(m.get('prefill_s') or 0) * 1e3:.0f} ms, errors {m.get('errors')}")
    return m


def _headline_poisson(m: dict) -> dict:
    m["headline"] = (f"sent {m.get('offered_rate_rps')} req/s, TTFT p50 {m.get('ttft_p50_ms')} ms, ITL p50 "
                     f"{m.get('itl_p50_ms')} / p99 {m.get('itl_p99_ms')} ms (x{m.get('itl_p99_over_p50')}), "
                     f"{m.get('output_tok_s')} tok/s, errors {m.get('errors')}")
    return m


class Bench:
    """The driver: settings, the worker processes, one method per phase."""

    def __init__(self, run: dict, model_dir: str, quiet_s: float) -> None:
        self.run, self.model_dir, self.quiet_s = run, model_dir, quiet_s
        self.procs: dict[str, TreeProcess] = {}
        self.loads: dict[str, dict] = {}
        self.poisson_warmup: dict[str, dict] = {}

    def start(self, name: str, tree: str, budget: int, warmup: bool) -> TreeProcess:
        C.log(f"starting the {name} engine (budget {budget}, {'aot' if warmup else 'lazy'} compile) from {tree} ...")
        p = TreeProcess(name, tree)
        self.procs[name] = p
        for q in self.procs.values():       # every live worker's CPU counts as ours
            q.window_pids = [x.pid for x in self.procs.values()]
        info = p.call("load", model_dir=self.model_dir, budget=budget, max_running=self.run["max_running"],
                      max_model_len=self.run["max_model_len"], warmup=warmup, cache_dir=self.run["jax_cache_dir"])
        info["hello"] = p.hello
        self.loads[f"{name}@{budget}"] = info
        C.log(f"  {name}: loaded in {info['load_s']} s, {info['counts']['programs']} programs")
        return p

    def stop(self, name: str) -> None:
        p = self.procs.pop(name, None)
        if p is not None:
            p.close()
        for q in self.procs.values():
            q.window_pids = [x.pid for x in self.procs.values()]

    def close(self) -> None:
        for name in list(self.procs):
            self.stop(name)

    def saturation(self, p: TreeProcess, seed: int) -> dict:
        r = self.run
        return _headline_sat(p.timed("saturation", streams=r["streams"], prompt_len=r["prompt_len"],
                                     new_tokens=r["new_tokens"], seed=seed))

    def poisson(self, p: TreeProcess, rate: float) -> dict:
        r = self.run
        return _headline_poisson(p.timed("poisson", rate=rate, n=r["requests"], prompt_len=r["prompt_len"],
                                         new_tokens=r["new_tokens"], seed=r["seed"]))

    # ------------------------------------------------------------------ phases
    def phase_saturation(self) -> dict:
        r = self.run
        warm = {}
        for name in TREES:
            C.log(f"saturation warm-up round (untimed): {name} ...")
            warm[name] = self.saturation(self.procs[name], r["seed"] - 1)
            C.log(f"  {warm[name]['headline']}; programs added {warm[name]['compiles']}")
        runs = run_rounds({n: functools.partial(self.saturation, self.procs[n], r["seed"]) for n in TREES},
                          r["saturation_rounds"], "saturation", self.quiet_s)
        C.log("compute floor: torch fp32 matmul rate, one probe in a peer process ...")
        limits = C.combine_limits([probe_limits(0.5 if r["quick"] else 2.0, 3, matmul=True)])
        with open(os.path.join(self.model_dir, "config.json")) as f:
            flops = saturation_flops(json.load(f), r["streams"], r["prompt_len"], r["new_tokens"])
        floor = compute_floor(flops, limits.get("torch_matmul_fp32_gflops"), r["streams"], r["new_tokens"])
        summary = pair_table(runs["ragged"], runs["split"], SATURATION_KEYS)
        if floor:
            for side in TREES:
                floor[f"{side}_of_floor"] = C.rnd((summary["completed_tok_s"][side] or 0) / floor["max_completed_tok_s"], 3)
            floor["goal_tok_s"] = C.rnd(SATURATION_GOAL * (summary["completed_tok_s"]["split"] or 0), 1)
        return {"warmup_round": {n: _slim(w) for n, w in warm.items()}, "rounds": runs, "summary": summary,
                "compute_floor": floor, "limits": limits}

    def phase_poisson(self) -> dict:
        r = self.run
        warm_rate = max(r["rates"])
        for name in TREES:
            C.log(f"poisson warm-up round (untimed, {warm_rate:g} req/s): {name} ...")
            w = self.poisson(self.procs[name], warm_rate)
            C.log(f"  {w['headline']}; programs added {w['compiles']}")
            self.poisson_warmup[name] = _slim(w)
        out = {}
        for rate in r["rates"]:
            runs = run_rounds({n: functools.partial(self.poisson, self.procs[n], rate) for n in TREES},
                              r["rounds"], f"poisson {rate:g} req/s", self.quiet_s)
            out[rate_key(rate)] = {"rate": rate, "rounds": runs,
                                   "summary": pair_table(runs["ragged"], runs["split"], POISSON_KEYS)}
        return out

    def phase_sweep(self, tree: str, reuse: dict) -> dict:
        """Ragged engine only: one worker per budget, Poisson at the sweep rates."""
        r = self.run
        sweep: dict[str, dict] = {}
        for budget in r["budgets"]:
            rates = [x for x in r["sweep_rates"] if not (budget == r["budget"] and rate_key(x) in reuse)]
            sweep[str(budget)] = {rate_key(x): {**reuse[rate_key(x)], "reused_from": "poisson comparison"}
                                  for x in r["sweep_rates"] if budget == r["budget"] and rate_key(x) in reuse}
            if not rates:
                continue
            name = f"ragged-b{budget}"
            p = self.start(name, tree, budget, r["ragged_warmup"] == "aot")
            try:
                w = self.poisson(p, max(rates))
                C.log(f"  budget {budget} warm-up (untimed): {w['headline']}")
                for rate in rates:
                    runs = run_rounds({name: functools.partial(self.poisson, p, rate)}, r["sweep_rounds"],
                                      f"budget {budget} at {rate:g} req/s", self.quiet_s)[name]
                    row = {k: median_of(runs, k) for k in POISSON_KEYS}
                    row["errors"] = sum(x["errors"] for x in runs)
                    row["compiles"] = [x["compiles"] for x in runs]
                    row["rounds"] = [_slim(x) for x in runs]
                    sweep[str(budget)][rate_key(rate)] = row
                self.loads[f"{name}@{budget}"]["counts_end"] = p.call("counts")
            finally:
                self.stop(name)
        return sweep


def _slim(m: dict) -> dict:
    return {k: v for k, v in m.items() if k != "headline"}


# =============================================================================================
# plots and the printed summary
# =============================================================================================
def budget_plot(path: str, sweep: dict, default_budget: int, note: str) -> str:
    """ITL p99 and TTFT p50 against the token budget, one line per rate, the default marked."""
    plt = C._plt()
    rows = sweep_rows(sweep)
    rates = sorted({r["rate"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, key, title in ((axes[0], "itl_p99_ms", "ITL p99 (ms)"), (axes[1], "ttft_p50_ms", "TTFT p50 (ms)")):
        for rate in rates:
            pts = [(r["budget"], r[key]) for r in rows if r["rate"] == rate and r[key] is not None]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"{rate:g} req/s")
        ax.axvline(default_budget, color="gray", linestyle="--", linewidth=1)
        ax.annotate(f"default {default_budget}", (default_budget, 0.0), xycoords=("data", "axes fraction"),
                    xytext=(-3, 4), textcoords="offset points", ha="right", fontsize=8, color="gray")
        ax.set_xscale("log", base=2)
        budgets = sorted({r["budget"] for r in rows})
        ax.set_xticks(budgets)
        ax.set_xticklabels([str(b) for b in budgets])
        ax.set_xlabel("token budget per step (--max-num-batched-tokens)")
        ax.set_ylabel(title)
        ax.set_title(f"{title} against the token budget")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return C._save_figure(plt, fig, path, note)


def report_lines(doc: dict) -> list[str]:
    """The ratios and the host line, as printed at the end of a run."""
    lines = [C.host_line(doc.get("machine"))]
    sat = doc.get("saturation")
    if sat:
        s = sat["summary"]["completed_tok_s"]
        d = sat["summary"]["decode_tok_s"]
        lines.append(f"saturation ({doc['setup']['streams']} streams): completed tok/s ragged {s['ragged']} vs split "
                     f"{s['split']} -> {s['ratio_ragged_over_split']}x (goal >= {SATURATION_GOAL}); steady decode "
                     f"{d['ragged']} vs {d['split']} -> {d['ratio_ragged_over_split']}x")
        fl = sat.get("compute_floor") or {}
        if fl:
            lines.append(f"compute floor at {fl['matmul_gflops']} GFLOP/s (torch fp32 matmul): {fl['floor_s']} s, at most "
                         f"{fl['max_completed_tok_s']} tok/s; ragged {fl['ragged_of_floor']}, split {fl['split_of_floor']} "
                         f"of it; the goal needs {fl['goal_tok_s']} tok/s")
    for rate, p in (doc.get("poisson") or {}).items():
        s = p["summary"]
        lines.append(f"poisson {rate} req/s (sent {s['offered_rate_rps']['ragged']} / {s['offered_rate_rps']['split']}): "
                     f"TTFT p50 ragged {s['ttft_p50_ms']['ragged']} vs split {s['ttft_p50_ms']['split']} ms -> "
                     f"{s['ttft_p50_ms']['ratio_ragged_over_split']}x (goal <= {TTFT_GOAL}); ITL p99/p50 ragged "
                     f"{s['itl_p99_over_p50']['ragged']} (goal <= {ITL_SPREAD_GOAL}), split {s['itl_p99_over_p50']['split']}; "
                     f"ITL p50/p99 ragged {s['itl_p50_ms']['ragged']}/{s['itl_p99_ms']['ragged']} ms, split "
                     f"{s['itl_p50_ms']['split']}/{s['itl_p99_ms']['split']} ms")
    for row in sweep_rows(doc.get("budget_sweep") or {}):
        lines.append(f"budget {row['budget']:>5} at {row['rate']:g} req/s: TTFT p50 {row['ttft_p50_ms']} ms, "
                     f"ITL p50 {row['itl_p50_ms']} / p99 {row['itl_p99_ms']} ms, {row['output_tok_s']} tok/s")
    for name, c in (doc.get("compiles") or {}).items():
        lines.append(f"compiles {name}: {c}")
    for k, t in (doc.get("targets") or {}).items():
        met = {True: "met", False: "NOT met"}.get(t["met"], "-")
        lines.append(f"target {k}: {t['value']} (goal {t['goal']}) {met}")
    return lines


# =============================================================================================
# main
# =============================================================================================
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ragged_step", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, few requests, one round (smoke test, < 3 min)")
    ap.add_argument("--phases", default="saturation,poisson,sweep", help="any of saturation,poisson,sweep")
    ap.add_argument("--model", choices=["small", "tiny"], default=None, help="default small; quick: tiny")
    ap.add_argument("--model-dir", default=None, help="where the random model is cached")
    ap.add_argument("--rounds", type=int, default=None, help="timed Poisson rounds per engine and rate (default 2; quick 1)")
    ap.add_argument("--saturation-rounds", type=int, default=None, help="timed saturation rounds (default 3; quick 1)")
    ap.add_argument("--sweep-rounds", type=int, default=1, help="timed rounds per budget and rate in the sweep (default 1)")
    ap.add_argument("--requests", type=int, default=None, help="requests per Poisson run (default 20; quick 6)")
    ap.add_argument("--rates", default=None, help="Poisson rates, req/s (default 0.5,1,2; quick 2)")
    ap.add_argument("--sweep-rates", default=None, help="rates of the budget sweep (default 1,2; quick 2)")
    ap.add_argument("--budgets", default=None, help="token budgets of the sweep (default 64,96,128,256,512; quick 128,512)")
    ap.add_argument("--budget", type=int, default=DEFAULT_BUDGET,
                    help=f"the ragged engine's budget in the comparison (default {DEFAULT_BUDGET}, its CPU default)")
    ap.add_argument("--split-budget", type=int, default=SPLIT_DEFAULT_BUDGET,
                    help=f"the split engine's budget in the comparison (default {SPLIT_DEFAULT_BUDGET}, its default)")
    ap.add_argument("--streams", type=int, default=32, help="saturation streams = max running requests (default 32)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128; quick 64")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128; quick 32")
    ap.add_argument("--max-model-len", type=int, default=None, help="default 512; quick 128")
    ap.add_argument("--seed", type=int, default=8, help="arrival times and prompts (default 8: the rate sent is the rate named)")
    ap.add_argument("--split-commit", default=SPLIT_COMMIT, help=f"the split engine's commit (default {SPLIT_COMMIT})")
    ap.add_argument("--split-warmup", choices=["aot", "lazy"], default=None,
                    help="split engine: compile every program ahead (default), or on first use (quick default)")
    ap.add_argument("--ragged-warmup", choices=["aot", "lazy"], default="aot", help="ragged engine (default aot)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--quiet-wait", type=float, default=None,
                    help="seconds to wait before each round for other processes to go quiet (default 10, 60 before the "
                         "first; quick 0). Shorter than the other scripts' 60: this one has ~18 rounds")
    ap.add_argument("--no-plot", action="store_true")
    return ap.parse_args(list(argv))


def settings(a: argparse.Namespace) -> dict:
    q = a.quick
    run = {
        "quick": q, "model": a.model or ("tiny" if q else "small"),
        "streams": a.streams, "max_running": a.streams, "budget": a.budget, "split_budget": a.split_budget,
        "prompt_len": a.prompt_len or (64 if q else 128), "new_tokens": a.new_tokens or (32 if q else 128),
        "max_model_len": a.max_model_len or (128 if q else 512),
        "rounds": a.rounds or (1 if q else 2), "saturation_rounds": a.saturation_rounds or (1 if q else 3),
        "sweep_rounds": a.sweep_rounds, "requests": a.requests or (6 if q else 20),
        "rates": parse_list(a.rates or ("2" if q else "0.5,1,2")),
        "sweep_rates": parse_list(a.sweep_rates or ("2" if q else "1,2")),
        "budgets": parse_list(a.budgets or ("128,512" if q else "64,96,128,256,512"), int),
        "seed": a.seed, "split_commit": a.split_commit, "split_warmup": a.split_warmup or ("lazy" if q else "aot"),
        "ragged_warmup": a.ragged_warmup, "phases": [p.strip() for p in a.phases.split(",") if p.strip()],
        "jax_cache_dir": jax_cache_dir(),
        "quiet_s": a.quiet_wait if a.quiet_wait is not None else (0.0 if q else 10.0),
        "start_quiet_s": a.quiet_wait if a.quiet_wait is not None else (0.0 if q else 60.0),
    }
    if run["prompt_len"] + run["new_tokens"] > run["max_model_len"]:
        raise SystemExit("prompt_len + new_tokens must fit in max_model_len")
    bad = [p for p in run["phases"] if p not in ("saturation", "poisson", "sweep")]
    if bad:
        raise SystemExit(f"unknown phase(s) {bad}")
    return run


def main(argv: Sequence[str] | None = None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.worker:
        worker_main(a.tree)
        return None
    C.engine_process()
    run = settings(a)
    doc = C.header(NAME, a.quick, argv)
    doc["quiet_wait"] = C.wait_for_quiet(run["start_quiet_s"])
    total = C.CpuWindow(children=True).start()
    model_dir = G.ensure_model(run["model"], a.model_dir)
    ragged_tree = C.REPO_ROOT
    split_tree = ensure_tree(run["split_commit"])
    doc["setup"] = {**run, "model_dir": model_dir, "trees": {"ragged": tree_info(ragged_tree), "split": tree_info(split_tree)},
                    "engine_args": {"max_running_requests": run["max_running"], "max_num_batched_tokens": run["budget"],
                                    "max_model_len": run["max_model_len"], "page_size": 16, "enable_prefix_cache": False,
                                    "compile_cache_dir": run["jax_cache_dir"]},
                    "how": "each engine in its own worker process; timed rounds alternate, the first side rotating"}
    bench = Bench(run, model_dir, run["quiet_s"])
    try:
        if {"saturation", "poisson"} & set(run["phases"]):
            bench.start("ragged", ragged_tree, run["budget"], run["ragged_warmup"] == "aot")
            bench.start("split", split_tree, run.get("split_budget", run["budget"]), run["split_warmup"] == "aot")
            if "saturation" in run["phases"]:
                doc["saturation"] = bench.phase_saturation()
            if "poisson" in run["phases"]:
                doc["poisson"] = bench.phase_poisson()
            budgets = {"ragged": run["budget"], "split": run.get("split_budget", run["budget"])}
            doc["compiles"] = {name: compile_summary(bench.loads[f"{name}@{budgets[name]}"], bench.procs[name].call("counts"),
                                                     timed_runs(doc, name)) for name in TREES}
            bench.close()
        if "sweep" in run["phases"]:
            reuse = {k: {key: v["summary"][key]["ragged"] for key in POISSON_KEYS}
                     for k, v in (doc.get("poisson") or {}).items()}
            doc["budget_sweep"] = bench.phase_sweep(ragged_tree, reuse)
    finally:
        bench.close()
    doc["engines"] = bench.loads
    if bench.poisson_warmup:
        doc["poisson_warmup_round"] = bench.poisson_warmup
    doc["cpu"] = total.stop()
    doc["targets"] = targets(doc)
    doc["plots"] = []
    if not a.no_plot and doc.get("budget_sweep"):
        cpu = doc["cpu"]
        note = (f"ragged engine, '{run['model']}' model, {run['prompt_len']}-token prompts, {run['new_tokens']} new; "
                f"cpu share {cpu['cpu_share_of_cores']}, others {cpu['others_share_of_cores']}"
                + (" (DISTURBED)" if cpu["disturbed"] else ""))
        doc["plots"].append(C.rel(budget_plot(C.result_path(NAME + "_budget", a.quick, "png"), doc["budget_sweep"],
                                              run["budget"], note)))
    for line in report_lines(doc):
        C.log(line)
    return C.finish(doc, NAME, a.quick)


if __name__ == "__main__":
    main()
