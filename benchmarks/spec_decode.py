"""Speculative decoding (issue 20): decode tok/s with --speculative off, ngram and suffix on the
trained model, on workloads that repeat themselves, copy, and do neither.

Model: benchmarks/train_tiny.py's byte-level Llama (3.04 M parameters, trained here on the Python
standard library's source; cached, trained on first use in ~10 minutes). Acceptance on random
weights would mean nothing. Its training window is 256 tokens, so prompt + answer stay within it.

Engines: three in-process `Engine`s over that folder, alive for the whole run, the server's CPU
defaults otherwise (token budget 64, prefix cache on, programs compiled ahead of time):
  off     --speculative off
  ngram   --speculative ngram  --num-speculative-tokens K (default 16, the server default)
  suffix  --speculative suffix --num-speculative-tokens K
max_running_requests 8, max_model_len 512.

Workloads (prompts cut from held-out standard-library files at a method definition, so no
prompt was trained on; every request greedy with EOS ignored unless said, `new_tokens` each):
  repeat   the same B prompts asked twice (as agent loops re-send a request); the second pass is
           timed. The suffix engine's cache holds the first pass's answers.
  copy     the answer repeats a long span of its prompt: the prompt is a code span P (32 bytes), the
           model's own greedy continuation R of P (64 tokens, made by the off engine before the
           rounds, so no speculating engine's cache holds it), a newline, and P again; the model
           answers P as it did before, so an answer starts with R when the text before does not
           change its next tokens (say how often it did). New spans every round.
           Why not a span S and its first bytes (the first form): the trained model never went on
           with S (0 of 32 held-out spans; nor when S was given twice before the cue), and a
           retraining with copy exercises in a quarter of its windows did not teach it to either
           (0 of 16 after 500 steps: such induction needs far more tokens than its 15 minutes see).
  fresh    new held-out prompts every round, greedy.
  sampled  new held-out prompts every round, temperature 0.8, top-p 0.95, seeds fixed per prompt:
           text with few exact repeats. Output distribution unchanged by speculation (tested in
           tests/engine/test_speculative.py), so only the speed is compared.
Batch B = 1 (8 requests per timed pass, one after another) and 8 (24 requests, 8 in flight: each
request that finishes is replaced by the next, as a server under load sees them). Not in waves of
8: a wave lasts as long as its slowest row, so a row that speculation finished early only left its
slot idle, and on sampled text (where rows' acceptance differs) the waves measured the slowest
row of each wave rather than the server's throughput.

Rounds: the three sides alternate with the first side rotating (common.run_pairs), 3 rounds
(quick: 1), medians (clean rounds when there are any). tok/s = completion tokens of the timed
pass / its wall time. Accept rate (accepted / proposed guesses) and accept length (tokens per
verifying row-step, accepted + 1) are the speculative engine's own counters over the timed pass.
Greedy answers are compared with the off engine's of the same round (must be identical).

`--model small` (results spec_decode_small.json): the same measurement of the `repeat` workload
only, sides off and suffix, on generate_vs_hf's random 'small' Llama (124.7 M parameters,
float32; 64 random prompt tokens, 64 new tokens). Random weights are no obstacle there: a
repeated greedy request replays its answer exactly, whatever the weights. The point of this row:
the trained model is so small (12 MB of weights) that even a batch-1 step is compute-bound on a
CPU, while the 500 MB 'small' model is bandwidth-bound at batch 1 (a 4-token step cost 24 ms at
warmup against 18 ms for 1 token on the reference machine). At batch 8 both are compute-bound on
2 cores (the 'small' model: 31 ms for 8 tokens, 89 ms for 32).

Run:  python -m benchmarks.spec_decode [--quick] [--k 16] [--rounds 3] [--batches 1,8] [--model small]
                                       [--results-name NAME]
Writes benchmarks/results/spec_decode.json (+ _quick), spec_decode.png and spec_decode_accept.png;
with --results-name NAME (another host class: spec_decode_avx2), NAME.json and its plots instead,
which the README shows as a table of its own.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C

NAME = "spec_decode"
SIDES = ("off", "ngram", "suffix")
WORKLOADS = ("repeat", "copy", "fresh", "sampled")
GOALS = {"repeat": 2.5, "copy": 1.5, "fresh": 0.97, "sampled": 0.97}
PROMPT_BYTES = 96
COPY_PREFIX, COPY_REPEAT = 32, 64     # copy: P's bytes, R's tokens (prompt 32 + 64 + 1 + 32 = 129 tokens,
                                      # so prompt and answer stay inside the 256 trained positions)
COPY_CHECK = 32                       # an answer "copied" when it starts with R's first 32 bytes
WAVES = 3           # batch B > 1: 3 B requests per timed pass, B in flight
B1_REQUESTS = 8     # batch 1: requests per timed pass, one after another (4 gave ~0.5 s passes: too noisy)
NUM_PAGES = 1024    # KV pages of every engine (16,384 tokens): room for the prefix cache to keep the
                    # repeated prompts between passes, as a server's KV cache sized to its memory
                    # does. The auto size (8 rows x 512 tokens, 257 pages) holds only the running
                    # rows, so a batch-8 pass of 24 requests (~14 pages each) evicted every prompt
                    # before it came back and each side re-ran all its prefills.


def requests_per_round(batch: int) -> int:
    """Requests of one timed pass at this batch size (a round of a workload takes this many)."""
    return WAVES * batch if batch > 1 else B1_REQUESTS


def held_out_spans(n: int, size: int) -> list[str]:
    """n code spans of `size` bytes from held-out standard-library files, each starting at a line
    that opens a method or function definition: files in path order, the first definition of
    each file first, then each file's second one, and so on."""
    import re

    from benchmarks import train_tiny as TT

    _, held = TT.stdlib_files(TT.TrainConfig().holdout_mod)
    per_file = []
    for _, text in held:
        starts = [m.start() + 1 for m in re.finditer(r"\n(?:    )?def ", text)]
        per_file.append([text[i:i + size] for i in starts if len(text) - i > size and text[i:i + size].isascii()])
    out: list[str] = []
    for depth in range(max(map(len, per_file), default=0)):
        out += [spans[depth] for spans in per_file if depth < len(spans)]
        if len(out) >= n:
            return out[:n]
    raise RuntimeError(f"only {len(out)} held-out spans of {size} bytes, need {n}")


def copy_prompt(prefix: str, repeat: str) -> str:
    """P, the model's continuation R of P, a newline, P again (the copy workload)."""
    return prefix + repeat + "\n" + prefix


def copy_prompts(engine, spans: list[str]) -> list[str]:
    """The copy workload's prompts for these spans: each span's first COPY_PREFIX bytes P with
    `engine`'s greedy COPY_REPEAT-token continuation R of P (copy_prompt). Run on the off engine
    only: a speculating engine that answered P would hold R in its cache of earlier answers, and
    the workload is about repeating the prompt. (The off engine's prefix cache then holds P's
    two pages: that favours off, the side the ratios divide by.)"""
    prefixes = [s[:COPY_PREFIX] for s in spans]
    answers, _ = _pass(engine, prefixes, 8, COPY_REPEAT, False)
    tok = engine.tokenizer("m")
    return [copy_prompt(p, tok.decode(a)) for p, a in zip(prefixes, answers)]


def copied_repeat(prompt: str) -> str:
    """R's first COPY_CHECK bytes, read back from a copy prompt (P + R + newline + P)."""
    return prompt[COPY_PREFIX:len(prompt) - 1 - COPY_PREFIX][:COPY_CHECK]


async def _one(engine, prompt: str | list[int], new_tokens: int, sampled: bool, seed: int) -> list[int]:
    from jax_engine.types import GenerateRequest, SamplingParams

    p = SamplingParams(temperature=0.8, top_p=0.95, seed=seed) if sampled else SamplingParams(temperature=0.0)
    p.max_new_tokens, p.ignore_eos = new_tokens, True
    toks: list[int] = []
    req = (GenerateRequest(request_id="", prompt=prompt, model="m", params=p) if isinstance(prompt, str)
           else GenerateRequest(request_id="", prompt_ids=prompt, model="m", params=p))
    async for o in engine.generate(req):
        toks += o.new_token_ids
    return toks


def _pass(engine, prompts: list, batch: int, new_tokens: int, sampled: bool) -> tuple[list[list[int]], float]:
    """Answers to `prompts` (in order), `batch` in flight (a finished one is replaced by the next
    prompt); wall seconds."""
    async def go():
        gate = asyncio.Semaphore(batch)

        async def one(i: int, q) -> list[int]:
            async with gate:
                return await _one(engine, q, new_tokens, sampled, 1000 + i)
        return list(await asyncio.gather(*[one(i, q) for i, q in enumerate(prompts)]))
    t0 = time.perf_counter()
    res = asyncio.run(go())
    return res, time.perf_counter() - t0


def _spec_counts(engine) -> tuple[int, int, int]:
    st = engine.stats("m").spec
    return (st.proposed_tokens, st.accepted_tokens, st.verify_rows) if st is not None else (0, 0, 0)


def run_side(engine, workload: str, prompts: list, batch: int, new_tokens: int) -> dict[str, Any]:
    sampled = workload == "sampled"
    if workload == "repeat":
        _pass(engine, prompts, batch, new_tokens, sampled)          # the first time: untimed
    p0, a0, v0 = _spec_counts(engine)
    with C.cpu_window() as w:
        answers, wall = _pass(engine, prompts, batch, new_tokens, sampled)
    p1, a1, v1 = _spec_counts(engine)
    toks = sum(len(a) for a in answers)
    out = {"tok_s": C.rnd(toks / wall, 1), "tokens": toks, "wall_s": C.rnd(wall, 3),
           "proposed": p1 - p0, "accepted": a1 - a0, "verify_rows": v1 - v0,
           "accept_rate": C.rnd((a1 - a0) / (p1 - p0), 3) if p1 > p0 else None,
           "accept_length": C.rnd(1 + (a1 - a0) / (v1 - v0), 3) if v1 > v0 else None,
           "digest": hashlib.sha1(repr(answers).encode()).hexdigest()[:16], "cpu": w.result}
    if workload == "copy":        # how many answers begin with the continuation their prompt repeats
        out["copied"] = sum(1 for q, a in zip(prompts, answers) if _copied(engine, q, a))
    out["headline"] = f"{out['tok_s']} tok/s, accept {out['accept_rate']}, length {out['accept_length']}"
    return out


def _copied(engine, prompt: str, answer: list[int]) -> bool:
    return engine.tokenizer("m").decode(answer).startswith(copied_repeat(prompt))


def summarize(runs: dict[str, list[dict]]) -> dict[str, Any]:
    def med(side: str, key: str) -> float | None:
        rs = [r for r in runs[side] if r.get("clean")] or runs[side]
        xs = [r[key] for r in rs if r.get(key) is not None]
        return C.rnd(C.median(xs), 3) if xs else None

    s: dict[str, Any] = {"tok_s": {k: med(k, "tok_s") for k in runs},
                         "accept_rate": {k: med(k, "accept_rate") for k in runs if k != "off"},
                         "accept_length": {k: med(k, "accept_length") for k in runs if k != "off"}}
    s["speedup"] = {k: C.ratio(s["tok_s"][k], s["tok_s"]["off"]) for k in runs if k != "off"}
    s["paired_speedups"] = {k: [C.ratio(a["tok_s"], b["tok_s"]) for a, b in zip(runs[k], runs["off"])]
                            for k in runs if k != "off"}
    s["identical_to_off"] = {k: all(a["digest"] == b["digest"] for a, b in zip(runs[k], runs["off"]))
                             for k in runs if k != "off"}
    s["rounds"] = len(runs["off"])
    s["clean_rounds"] = sum(1 for r in runs["off"] if r.get("clean"))
    if "copied" in runs["off"][0]:
        s["copied"] = {k: [r["copied"] for r in runs[k]] for k in runs}
    return s


def result_names(model: str, dtype: str, results_name: str | None) -> tuple[str, str]:
    """(the document's "benchmark" field, the results file's name). The field stays the default
    name under --results-name: the README's variants loop renders a file by that field, so
    spec_decode_avx2.json is drawn as a spec_decode table (and spec_decode_small's as its own)."""
    default = NAME + ("_small" if model == "small" else "") + ("_bf16" if dtype == "bfloat16" else "")
    return default, results_name or default


def main(argv: list[str] | None = None) -> dict:
    from jax_engine.config import EngineArgs

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--k", type=int, default=EngineArgs.num_speculative_tokens,
                    help="--num-speculative-tokens of the speculating engines (default: the server's)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per workload (default 3; quick 1)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=None, help="answer length (default 128; quick 48)")
    ap.add_argument("--model", choices=["trained", "small"], default="trained",
                    help="small: the repeat workload on the random 'small' Llama (off and suffix only)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the engines' dtype (bfloat16 writes spec_decode_bf16.json; not part of `python -m "
                         "benchmarks`: on the 2-vCPU AMX Xeon, one round at batch 8 gave the repeat workload 1.71x "
                         "against 1.54x in float32, the step loop's host work bounding both)")
    ap.add_argument("--results-name", default=None,
                    help="results file name (default spec_decode, spec_decode_small or spec_decode_bf16); e.g. "
                         "spec_decode_avx2 keeps another host class's run beside the default one, which the README "
                         "shows as a table of its own")
    C.add_round_args(ap)
    a = ap.parse_args(argv)
    rounds = a.rounds or (1 if a.quick else 3)
    small = a.model == "small"
    new_tokens = a.new_tokens or (48 if a.quick else (64 if small else 128))
    batches = [int(b) for b in a.batches.split(",")]
    default, name = result_names(a.model, a.dtype, a.results_name)
    doc = C.header(default, a.quick, argv if argv is not None else sys.argv[1:])
    C.engine_process()
    from benchmarks import train_tiny as TT
    from jax_engine.config import ModelSpec

    sides = ("off", "suffix") if small else SIDES
    workloads = ("repeat",) if small else WORKLOADS
    if small:
        from benchmarks import generate_vs_hf as GH

        path, meta = GH.ensure_model("tiny" if a.quick else "small"), {}
    else:
        path, meta = TT.ensure_model()
    doc["model"] = {"name": ("tiny" if a.quick else "small") if small else "trained",
                    "path": path, "params": (meta.get("report") or {}).get("parameters"),
                    "heldout_loss_nats_per_byte": (meta.get("report") or {}).get("heldout_loss_final"),
                    "sample": meta.get("sample")}
    engines, build_s = {}, {}
    for side in sides:
        engines[side], build_s[side] = C.build_engine(
            [ModelSpec(name="m", path=path)], speculative=side, num_speculative_tokens=a.k,
            max_running_requests=8, max_model_len=512, num_pages=NUM_PAGES, dtype=a.dtype)
    doc["setup"] = {"k": a.k, "dtype": a.dtype, "sides": list(sides), "workloads": list(workloads),
                    "rounds": rounds, "new_tokens": new_tokens, "batches": batches,
                    "prompt_bytes": PROMPT_BYTES, "copy_prefix": COPY_PREFIX, "copy_repeat": COPY_REPEAT,
                    "max_running_requests": 8, "num_pages": NUM_PAGES,
                    "token_budget": engines["off"].stats("m").max_num_batched_tokens,
                    "build_s": {k: C.rnd(v, 1) for k, v in build_s.items()},
                    "step_ms": {f"{T}{'+spec' if s else ''}{'' if g else ' sampled'}": C.rnd(v, 3) for (T, s, g), v in
                                sorted(engines["suffix"]._workers["m"].replicas[0].runner.step_ms.items(),
                                       key=lambda kv: (not kv[0][2], kv[0][0], kv[0][1]))}}
    if small:
        import numpy as np

        doc["model"]["params"] = engines["off"].model_info("m").num_params
    per_round = max(map(requests_per_round, batches))
    # fresh spans for copy, fresh and sampled: each round of each batch takes its own requests
    # (the held-out set has 619 spans of 96 bytes: 6 rounds at batches 1 and 8)
    need = rounds * sum(map(requests_per_round, batches))
    spans = held_out_spans(per_round + 3 * need, PROMPT_BYTES)
    repeat_set: list = [s[:PROMPT_BYTES] for s in spans[:per_round]]
    if small:       # random token ids (the random model's tokenizer covers few of its ids)
        rng = np.random.default_rng(0)
        repeat_set = [rng.integers(10, 400, 64).tolist() for _ in range(per_round)]
    fresh_pool = iter(spans[per_round:])
    quiet = C.quiet_seconds(a)
    doc["runs"], doc["summary"] = {}, {}
    with C.cpu_window() as whole:
        for B in batches:
            for wl in workloads:
                n = requests_per_round(B)
                label = f"b{B}/{wl}"
                sets = []
                for _ in range(rounds):
                    if wl == "repeat":
                        sets.append(repeat_set[:n])
                    else:
                        fresh = [next(fresh_pool) for _ in range(n)]
                        sets.append(copy_prompts(engines["off"], fresh) if wl == "copy"
                                    else [s[:PROMPT_BYTES] for s in fresh])
                calls = [0]     # a round's prompts are the same for every side: round = calls // sides

                def side_fn(side: str, wl: str = wl, B: int = B, sets: list = sets, calls: list = calls):
                    def f() -> dict:
                        r = min(calls[0] // len(sides), len(sets) - 1)
                        calls[0] += 1
                        return run_side(engines[side], wl, sets[r], B, new_tokens)
                    return f
                runs = C.run_pairs({side: side_fn(side) for side in sides}, rounds, retries=0 if a.quick else 2,
                                   label=label, quiet_s=quiet)
                doc["runs"][label] = runs
                doc["summary"][label] = summarize(runs)
                C.log(f"{label}: {doc['summary'][label]['speedup']} accept {doc['summary'][label]['accept_rate']}")
    doc["cpu"] = whole.result
    doc["compilations"] = {k: C.compile_counts(e) for k, e in engines.items()}
    doc["targets"] = {}
    for label, s in doc["summary"].items():
        wl = label.split("/")[1]
        for side in sides[1:]:
            doc["targets"][f"{label}/{side}"] = C.target(s["speedup"].get(side), GOALS[wl])
    doc["targets"]["compilations_after_warmup"] = C.target(
        max(c["engine_after_warmup"] for c in doc["compilations"].values()), 0, higher_is_better=False)
    if not a.no_plot and not small:
        plots(doc, a.quick, name)
    for e in engines.values():
        e.shutdown(timeout=5.0)
    return C.finish(doc, name, a.quick)


def plots(doc: dict, quick: bool, name: str = NAME) -> None:
    labels = list(doc["summary"])
    note = C.host_line(doc.get("machine"))
    dt = doc["setup"].get("dtype", "float32")
    C.bar_plot(C.result_path(name, quick, "png"),
               f"Speculative decoding: tok/s over --speculative off (K {doc['setup']['k']}, {dt})",
               labels, {side: [doc["summary"][lb]["speedup"].get(side) for lb in labels] for side in ("ngram", "suffix")},
               "speed-up (x)", note)
    C.bar_plot(C.result_path(name + "_accept", quick, "png"), f"Accept length (tokens per verifying row-step, {dt})",
               labels, {side: [doc["summary"][lb]["accept_length"].get(side) for lb in labels] for side in ("ngram", "suffix")},
               "tokens", note)


def render_small(d: dict, quick: bool) -> list[str]:
    """README lines for benchmarks/results/spec_decode_small.json (the bandwidth-bound case)."""
    st, m = d.get("setup") or {}, d.get("model") or {}
    lines = [f"### Speculative decoding on a larger model: repeated requests, random '{m.get('name')}' Llama "
             f"({C.cpu_line(d)})", "", C.source_line(NAME + "_small", quick, d), "",
             f"The `repeat` workload only (a repeated greedy request replays its answer exactly, whatever the weights), "
             f"on generate_vs_hf's random '{m.get('name')}' Llama ({m.get('params')} parameters, float32): engines "
             f"`--speculative off` and `suffix` (K = {st.get('k')}), {st.get('new_tokens')} new tokens after 64 random "
             f"prompt tokens, alternating rounds ({st.get('rounds')}), medians.", "",
             "| batch | off tok/s | suffix tok/s | speed-up | accept rate | accept length | greedy identical | clean rounds |",
             "|---|---|---|---|---|---|---|---|"]
    for label, s in (d.get("summary") or {}).items():
        ts, sp = s.get("tok_s", {}), s.get("speedup", {})
        ident = "yes" if all((s.get("identical_to_off") or {}).values()) else "NO"
        lines.append(f"| {label.split('/')[0]} | {C.fmt(ts.get('off'))} | {C.fmt(ts.get('suffix'))} | {_x(sp.get('suffix'))} | "
                     f"{C.fmt((s.get('accept_rate') or {}).get('suffix'), '{:.2f}')} | "
                     f"{C.fmt((s.get('accept_length') or {}).get('suffix'), '{:.2f}')} | {ident} | "
                     f"{s.get('clean_rounds')} of {s.get('rounds')} |")
    comp = ", ".join(f"{k} {v.get('engine_after_warmup')}" for k, v in (d.get("compilations") or {}).items())
    return lines + ["", f"Compilations after warmup: {comp} (target 0).", ""]


def _requests(label: str) -> int:
    """Requests per round of a summary row ("b8/copy" -> 24)."""
    return requests_per_round(int(label.split("/")[0][1:]))


def _x(v: Any) -> str:
    return f"{v:.2f}×" if isinstance(v, (int, float)) else "–"


def _copy_words(st: dict) -> str:
    """The copy workload as the run's setup recorded it (files of the first form have copy_cue)."""
    if "copy_cue" in st:
        return f"copy: a code span then a newline and its first {st['copy_cue']} bytes"
    return (f"copy: a code span's first {st.get('copy_prefix')} bytes P, the model's own greedy "
            f"{st.get('copy_repeat')}-token continuation R of P, a newline and P again (the answer repeats R, "
            "a span of its prompt, when the model answers P as before)")


def render(d: dict, quick: bool, name: str | None = None) -> list[str]:
    """README lines for benchmarks/results/spec_decode.json (or the results file `name`)."""
    st = d.get("setup") or {}
    m = d.get("model") or {}
    dt = st.get("dtype", "float32")
    name = name or NAME + ("_bf16" if dt == "bfloat16" else "")
    tag = "" if name == NAME else f" (`{name}`)"
    lines = [f"### Speculative decoding{tag}: off vs ngram vs suffix on the trained model, {dt}, in-process "
             f"({C.cpu_line(d)})", "", C.source_line(name, quick, d), "",
             f"The model of `benchmarks/train_tiny.py` ({m.get('params', '?')} parameters, byte-level, trained here on the "
             f"Python standard library; held-out loss {m.get('heldout_loss_nats_per_byte', '?')} nats/byte). Three "
             f"in-process engines (`--speculative off`, `ngram`, `suffix`; K = {st.get('k')} guesses per row at most, the "
             f"server's CPU defaults otherwise: token budget {st.get('token_budget')}, prefix cache on), alternating rounds "
             f"({st.get('rounds')} per row), medians; {st.get('new_tokens')} new tokens per request, EOS ignored; batch 1: "
             f"{B1_REQUESTS} requests one after another, batch B: {WAVES} B requests with B in flight (a finished one "
             "replaced by the next). repeat: the "
             f"same prompts asked a second time (timed); {_copy_words(st)}; fresh: unseen held-out prompts, greedy; "
             "sampled: unseen prompts at temperature 0.8, "
             "top-p 0.95. Speed-up = tok/s over the off engine's in the same rounds; accept rate = accepted / proposed "
             "guesses; accept length = tokens a verifying row emits per step.", "",
             "| batch / workload | off tok/s | ngram tok/s | ngram speed-up | suffix tok/s | suffix speed-up | goal | "
             "accept rate ngram / suffix | accept length ngram / suffix | greedy identical | clean rounds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    tg = d.get("targets") or {}
    for label, s in (d.get("summary") or {}).items():
        wl = label.split("/")[1]
        ts, sp, ar, al = s.get("tok_s", {}), s.get("speedup", {}), s.get("accept_rate", {}), s.get("accept_length", {})
        met = "/".join("met" if (tg.get(f"{label}/{x}") or {}).get("met") else "not met" for x in ("ngram", "suffix"))
        ident = "–" if wl == "sampled" else ("yes" if all((s.get("identical_to_off") or {}).values()) else "NO")
        lines.append(f"| {label} | {C.fmt(ts.get('off'))} | {C.fmt(ts.get('ngram'))} | {_x(sp.get('ngram'))} | "
                     f"{C.fmt(ts.get('suffix'))} | {_x(sp.get('suffix'))} | ≥ {GOALS[wl]:g}× ({met}) | "
                     f"{C.fmt(ar.get('ngram'), '{:.2f}')} / {C.fmt(ar.get('suffix'), '{:.2f}')} | "
                     f"{C.fmt(al.get('ngram'), '{:.2f}')} / {C.fmt(al.get('suffix'), '{:.2f}')} | {ident} | "
                     f"{s.get('clean_rounds')} of {s.get('rounds')} |")
    copied = [f"{label} {'/'.join(map(str, s['copied'].get('off') or []))} of {_requests(label)}"
              for label, s in (d.get("summary") or {}).items() if s.get("copied")]
    if copied:
        what = ("went on with their prompt's span (the next 32 bytes)" if "copy_cue" in st
                else f"repeated the continuation R in their prompt (its first {COPY_CHECK} bytes)")
        lines += ["", f"Copy answers that {what}, per round "
                      "(greedy: the same for every engine): " + "; ".join(copied) + "."]
    comp = ", ".join(f"{k} {v.get('engine_after_warmup')}" for k, v in (d.get("compilations") or {}).items())
    lines += ["", f"Compilations after warmup: {comp} "
                  "(target 0). Step program times the planner used (ms, token bucket, `+spec` = the verifying variant): "
                  + ", ".join(f"{k} {v}" for k, v in (st.get("step_ms") or {}).items()) + "."]
    sample = m.get("sample") or {}
    if sample:
        lines += ["", f"A sample of the model (greedy, from its training run's report): prompt "
                      f"`{sample.get('prompt', '')!r}` →", "", "```", (sample.get("greedy_continuation") or "")[:200], "```"]
    for png in (name, name + "_accept"):
        p = C.result_path(png, quick, "png")
        if os.path.isfile(p):
            lines += ["", f"![{png}]({C.rel(p)})"]
    return lines + [""]


if __name__ == "__main__":
    main()
