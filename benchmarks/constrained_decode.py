"""Structured generation: batch decode with every row under a nested JSON schema against free decode,
and grammar compile times.

The issue's target: batch-16 decode with every row under a nested JSON schema >= 0.85x the
unconstrained tok/s on the 'small' model; grammar compile time p50/p99 for the schemas used.

Decode (one in-process `Engine`, torch blocked, no server in between):
  model    the random 'small' Llama of benchmarks/generate_vs_hf.py with the 151,936-token
           vocabulary ('small-v152k', the default: a constrained row's host mask is one bit per
           vocabulary entry, so its cost scales with the vocabulary; `--model small` for 32,000);
           --quick: 'tiny-v152k'.
  engine   EngineArgs(models=[ModelSpec("bench", <model>)], max_running_requests=B,
           max_model_len=512, page_size=16, enable_prefix_cache=False): the server's CPU
           defaults otherwise (token budget 64, the server's persistent compile cache, programs
           compiled ahead of time). The prefix cache is off as in the other benchmarks: both
           sides of a round get the same prompts.
  workload B = 16 concurrent requests (quick 4), a 128-token random prompt each (quick 32),
           temperature 1 with per-request seeds (request i: seed i), max_new_tokens 128 (quick 32).
           free: ignore_eos. constrained: every row under NESTED_SCHEMA (objects in objects, an
           array of objects with minItems and no maxItems, enums, bounded integers, patterned and
           long free strings), so a random-weight model cannot finish the document within 128
           tokens; the tokens each row actually produced (and why it finished) are reported.
  rounds   one untimed warm-up round per side (it also compiles the schema into the engine's
           grammar cache, so timed rounds measure decoding, not compiling); then free and
           constrained alternate, the first side rotating (common.run_pairs), 3 rounds each
           (+ up to 2 more when others disturbed a round); medians, clean rounds when any.
  figures  decode tok/s = tokens that arrive after the last first token / (last first token ->
           last token); full-batch decode tok/s = the same up to the first row that finishes;
           ms per step = median gap between consecutive tokens of a row while every row decodes.
           Host grammar cost: `jax_engine.decode.scheduler.fill_masks` (the step's bitmasks, all
           constrained rows on llguidance's pool) and `GrammarState.consume` are wrapped in this
           process (the engine's code is not touched) and timed per call; mask ms per step =
           median fill_masks call inside the decode window. Compilations after warmup are the
           engine's own counter (target 0).

Grammar compile time: per kind (the nested schema above, a flat object, an enum, a regex, an
EBNF grammar, a tool-call "required" schema from jax_engine.api.tool_constraint), a fresh
`GrammarCompiler` over the model's tokenizer (one untimed compile first: it waits for the
llguidance tokenizer to be built), then N compiles of distinct texts (a property name, enum
value, literal or function name carries the index, so the LRU cache always misses), each timed
as the engine waits for it: compile(c).result() = grammar text, llguidance matcher, first mask.
p50 / p99 ms per kind.

Time (2 cores, 'small-v152k', compile cache warm): engine load + warmup ~1 min (an empty compile
cache adds the ahead-of-time compiles, a few minutes); a round ~10-12 s per side (2048 prompt
tokens through a 64-token budget, then 128 steps at batch 16); 1 warm-up + 3 rounds x 2 sides
~1.5 min, plus up to 60 s before the start and before each round waiting for a quiet machine;
compile phase (6 kinds x 100 compiles + 6 tokenizer builds) well under a minute. About 4-7
minutes in all. --quick (tiny-v152k, batch 4, 32-token prompts, 32 new tokens, 2 rounds,
10 compiles per kind) is a smoke test of every path.

Run:  python -m benchmarks.constrained_decode [--quick] [--model small-v152k] [--batch 16]
          [--prompt-len 128] [--new-tokens 128] [--rounds 3] [--retries 2] [--compile-n 100]
          [--phases decode,compile] [--quiet-wait S]
Writes benchmarks/results/constrained_decode.json (constrained_decode_quick.json in --quick);
`render(doc, quick)` returns the README lines.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C

NAME = "constrained_decode"
MODEL_NAME = "bench"
GOAL_RATIO = 0.85            # constrained / free decode tok/s, at least
PHASES = ("decode", "compile")

# =============================================================================================
# the grammars
# =============================================================================================
_ITEM = {"type": "object",
         "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                        "kind": {"enum": ["book", "tool", "food", "toy"]},
                        "note": {"type": "string", "minLength": 8, "maxLength": 32}},
         "required": ["sku", "qty", "kind", "note"], "additionalProperties": False}


def nested_schema(tag: str = "") -> dict:
    """The decode workload's schema: objects in objects, an array of objects (minItems 8, no
    maxItems), enums, bounded integers, patterned and long free strings. Under uniform-ish random
    logits a row spends ~60 tokens on the owner object and ~30 per item, so it is never complete
    within 128 tokens. `tag` is appended to the first property's name (compile-time runs)."""
    owner = {"type": "object",
             "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{2,15}$"},
                            "email": {"type": "string", "pattern": "^[a-z]{3,12}@[a-z]{3,8}\\.(com|org|net)$"},
                            "address": {"type": "object",
                                        "properties": {"city": {"type": "string", "maxLength": 20},
                                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                        "required": ["city", "zip"], "additionalProperties": False}},
             "required": ["name", "email", "address"], "additionalProperties": False}
    props = {f"id{tag}": {"type": "integer", "minimum": 0, "maximum": 1000000},
             "status": {"enum": ["active", "pending", "closed"]},
             "owner": owner,
             "items": {"type": "array", "minItems": 8, "items": _ITEM},
             "summary": {"type": "string", "minLength": 40}}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def flat_schema(tag: str = "") -> dict:
    props = {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
             "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
             "active": {"type": "boolean"}, "score": {"type": "number"},
             "tags": {"type": "array", "items": {"type": "string"}}, f"field{tag}": {"type": "string"}}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def enum_schema(tag: str = "") -> dict:
    """60 distinct words of the benchmark corpus and one tagged value."""
    words = list(dict.fromkeys(C.WORDS))[:60]
    return {"enum": words + [f"value{tag}"]}


def regex_spec(tag: str = "") -> str:
    return (r"(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z|[A-Z]{3}-\d{4}|\+\d{1,3} \(\d{3}\) \d{3}-\d{4}"
            rf"|[a-z]{{3,12}}@[a-z]{{3,8}}\.(com|org|net)|id{tag}:[a-z0-9]{{8,16}})")


def ebnf_spec(tag: str = "") -> str:
    """A small command language in GBNF (SGLang's ebnf_grammar format)."""
    return "\n".join([
        'root ::= command ("\\n" command)*',
        f'command ::= move | say | wait | "tag{tag} " num',
        'move ::= "move " dir " " num ("," num)?',
        'say ::= "say \\"" text "\\""',
        'wait ::= "wait " num ("ms" | "s")',
        'dir ::= "north" | "south" | "east" | "west"',
        'num ::= [0-9] | [1-9] [0-9]*',
        'text ::= [a-zA-Z ,.!?]*',
    ])


def tool_tools(tag: str = "") -> list:
    from jax_engine.types import FunctionTool

    return [
        FunctionTool(f"get_weather{tag}", {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14}}, "required": ["city", "unit"]}),
        FunctionTool("search_web", {"type": "object", "properties": {
            "query": {"type": "string", "minLength": 1}, "max_results": {"type": "integer", "minimum": 1, "maximum": 50},
            "site": {"type": "string", "pattern": "^[a-z0-9.-]+\\.[a-z]{2,}$"}}, "required": ["query"]}),
        FunctionTool("book_flight", {"type": "object", "properties": {
            "origin": {"type": "string", "pattern": "^[A-Z]{3}$"}, "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "date": {"type": "string", "pattern": "^\\d{4}-\\d{2}-\\d{2}$"},
            "passengers": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                "required": ["name", "age"]}},
            "class": {"enum": ["economy", "premium", "business", "first"]}},
            "required": ["origin", "destination", "date", "passengers"]}),
    ]


def _json(kind_schema: Callable[[str], dict]) -> Callable[[str], Any]:
    def make(tag: str):
        from jax_engine.types import Constraint

        return Constraint("json_schema", json.dumps(kind_schema(tag)))
    return make


def _tool_required(tag: str):
    from jax_engine.api import tool_constraint

    return tool_constraint(tool_tools(tag), "required")


def _regex(tag: str):
    from jax_engine.types import Constraint

    return Constraint("regex", regex_spec(tag))


def _ebnf(tag: str):
    from jax_engine.types import Constraint

    return Constraint("ebnf", ebnf_spec(tag))


# name -> (a description for the README, the constraint for a tag)
COMPILE_CASES: dict[str, tuple[str, Callable[[str], Any]]] = {
    "nested JSON schema (the decode workload)": ("json_schema", _json(nested_schema)),
    "flat object, 7 properties": ("json_schema", _json(flat_schema)),
    "enum, 61 strings": ("json_schema", _json(enum_schema)),
    "regex, 5 alternatives": ("regex", _regex),
    "EBNF command language": ("ebnf", _ebnf),
    'tool call, tool_choice "required", 3 tools': ("json_schema", _tool_required),
}


def constraint_for(case: str, i: int | None):
    """The constraint of one compile case: index i in its text (None: the untagged text)."""
    return COMPILE_CASES[case][1]("" if i is None else f"_{i}")


def spec_bytes(c) -> int:
    return len(c.spec.encode()) + sum(len(s.encode()) for s in c.choices)


# =============================================================================================
# pure helpers (tests/unit/test_bench_constrained.py)
# =============================================================================================
def decode_metrics(t0: float, reqs: list[dict], new_tokens: int) -> dict:
    """One round's figures from per-request token arrival times ({events: [(t, k)], ids, finish_reason}).

    decode_tok_s:            tokens arriving after the last first token / (last first token -> last token)
    full_batch_decode_tok_s: the same window, cut at the first row to finish (every row decoding)
    ms_per_step_p50:         median gap between consecutive tokens of a row in the full-batch window
    """
    firsts = [r["events"][0][0] for r in reqs if r["events"]]
    lasts = [r["events"][-1][0] for r in reqs if r["events"]]
    lens = [len(r["ids"]) for r in reqs]
    reasons = dict(Counter(str(r.get("finish_reason")) for r in reqs))
    out: dict[str, Any] = {"rows": len(reqs), "tokens": sum(lens), "tokens_per_row": lens,
                           "tokens_per_row_min": min(lens) if lens else None,
                           "tokens_per_row_median": C.median(lens) if lens else None,
                           "tokens_per_row_max": max(lens) if lens else None,
                           "rows_at_max_new_tokens": sum(1 for n in lens if n >= new_tokens),
                           "finish_reasons": reasons,
                           "errors": sum(1 for r in reqs if r.get("finish_reason") not in ("length", "stop"))}
    if not firsts:
        return {**out, "decode_tok_s": None, "full_batch_decode_tok_s": None, "ms_per_step_p50": None}
    all_first, last, first_done = max(firsts), max(lasts), min(lasts)
    n = sum(k for r in reqs for (t, k) in r["events"] if all_first < t <= last)
    n_full = sum(k for r in reqs for (t, k) in r["events"] if all_first < t <= first_done)
    gaps = [b[0] - a[0] for r in reqs for a, b in zip(r["events"], r["events"][1:])
            if all_first <= a[0] and b[0] <= first_done]
    window, full = last - all_first, first_done - all_first
    out.update({
        "prefill_s": C.rnd(all_first - t0, 4), "e2e_s": C.rnd(last - t0, 4),
        "decode_window_s": C.rnd(window, 4), "decode_window_tokens": n,
        "decode_tok_s": C.rnd(n / window, 2) if window > 0 and n else None,
        "full_batch_window_s": C.rnd(full, 4), "full_batch_window_tokens": n_full,
        "full_batch_decode_tok_s": C.rnd(n_full / full, 2) if full > 0 and n_full else None,
        "ms_per_step_p50": C.rnd(C.percentile(gaps, 50) * 1e3, 3) if gaps else None,
        "window": (all_first, last),
    })
    return out


def mask_metrics(calls: Sequence[tuple[float, float, int]], consumes: Sequence[tuple[float, float]],
                 window: tuple[float, float] | None) -> dict:
    """Host grammar cost inside a decode window: `calls` are fill_masks calls (start, seconds,
    rows), `consumes` GrammarState.consume calls (start, seconds). Per step = per fill_masks call
    (the scheduler makes one per step that has a constrained row)."""
    if window is not None:
        lo, hi = window
        calls = [c for c in calls if lo <= c[0] <= hi]
        consumes = [c for c in consumes if lo <= c[0] <= hi]
    if not calls:
        return {"mask_calls": 0}
    durs = [c[1] for c in calls]
    return {"mask_calls": len(calls), "mask_rows_p50": C.median(c[2] for c in calls),
            "mask_ms_per_step_p50": C.rnd(C.percentile(durs, 50) * 1e3, 4),
            "mask_ms_per_step_p99": C.rnd(C.percentile(durs, 99) * 1e3, 4),
            "mask_ms_per_step_mean": C.rnd(sum(durs) / len(durs) * 1e3, 4),
            "consume_ms_per_step_mean": C.rnd(sum(c[1] for c in consumes) / len(calls) * 1e3, 4),
            "consume_calls": len(consumes)}


def side_summary(runs: list[dict], key: str, digits: int = 3) -> float | None:
    """The median of `key` over clean rounds when there are any, else over all."""
    use = [r for r in runs if r.get("clean")] or runs
    return C.rnd(C.median(r[key] for r in use if r.get(key) is not None), digits)


def summarize_decode(runs: dict[str, list[dict]]) -> dict:
    """Medians per side and the constrained / free ratios, from the rounds of run_pairs."""
    con, free = runs["constrained"], runs["free"]
    out: dict[str, Any] = {}
    for key in ("decode_tok_s", "full_batch_decode_tok_s", "ms_per_step_p50", "prefill_s"):
        ps = C.paired_summary(con, free, key, 3)
        clean = ps["clean_rounds"] > 0
        out[key] = {"free": ps["b_clean"] if clean else ps["b"], "constrained": ps["a_clean"] if clean else ps["a"],
                    "ratio_constrained_over_free": ps["best"], "from_clean_rounds": clean, "all_rounds": ps}
    for key in ("mask_ms_per_step_p50", "mask_ms_per_step_p99", "mask_ms_per_step_mean", "consume_ms_per_step_mean",
                "mask_rows_p50"):
        out[key] = side_summary(con, key, 4)
    for side, rs in runs.items():
        lens = [n for r in rs for n in r.get("tokens_per_row", [])]
        reasons: Counter = Counter()
        for r in rs:
            reasons.update(r.get("finish_reasons") or {})
        out[f"tokens_per_row_{side}"] = ({"min": min(lens), "median": C.median(lens), "max": max(lens), "rows": len(lens)}
                                         if lens else None)
        out[f"finish_reasons_{side}"] = dict(reasons)
        out[f"errors_{side}"] = sum(r.get("errors", 0) for r in rs)
    return out


def summarize_compile(times_s: list[float]) -> dict:
    return C.summarize(times_s, 1e3, 3)


def targets(doc: dict) -> dict:
    t: dict[str, Any] = {}
    dec = (doc.get("decode") or {}).get("summary") or {}
    if "decode_tok_s" in dec:
        t["decode_tok_s_constrained_over_free"] = C.target(dec["decode_tok_s"]["ratio_constrained_over_free"], GOAL_RATIO)
    comp = (doc.get("decode") or {}).get("compilations")
    if comp:
        t["compilations_after_warmup"] = C.target(comp.get("engine_after_warmup"), 0, higher_is_better=False)
    return t


# =============================================================================================
# the README section
# =============================================================================================
_f, _x, _met, _rows = C.fmt, C.fmt_ratio, C.fmt_met, C.fmt_spread     # README cells (benchmarks/common.py)


def render(d: dict, quick: bool) -> list[str]:
    """README lines for benchmarks/results/constrained_decode.json: the decode table (free vs every
    row constrained, the 0.85× target) and the grammar compile-time table."""
    st = d.get("setup") or {}
    lines = [f"### Structured generation: every row under a JSON schema vs free decode, in-process "
             f"({C.cpu_line(d)})", "", C.source_line(NAME, quick, d), ""]
    dec = d.get("decode") or {}
    tg = d.get("targets") or {}
    if dec:
        s = dec.get("summary") or {}
        B, P, N = st.get("batch", "?"), st.get("prompt_len", "?"), st.get("new_tokens", "?")
        lines.append(
            f"Random '{st.get('model', '?')}' Llama (vocabulary {_f(st.get('vocab_size'), '{:,}')}; its tokenizer is the "
            "benchmarks' byte-level BPE padded with merges to the full vocabulary, so a mask covers every id), one in-process "
            f"`Engine` with the server's CPU defaults (token budget {st.get('token_budget', '?')}, prefix cache off), "
            f"{B} concurrent requests, {P}-token prompts, {N} new tokens, temperature 1 with per-request seeds. "
            "Free rows ignore EOS; constrained rows are each under the nested JSON schema of "
            "`benchmarks/constrained_decode.py` (objects in objects, an array of objects without maxItems, enums, "
            "bounded integers, patterned and long strings). Free and constrained rounds alternate; medians "
            "(clean rounds when there are any). Decode tok/s = tokens after the last first token / (last first "
            "token to last token); mask ms = host time of the step's `fill_masks` (every constrained row's "
            "bitmask, on llguidance's threads), which the step waits for.")
        dt = s.get("decode_tok_s") or {}
        ratio = dt.get("ratio_constrained_over_free")
        if ratio is None:
            ratio = C.ratio(dt.get("constrained"), dt.get("free"))
        goal = (tg.get("decode_tok_s_constrained_over_free") or {}).get("goal", GOAL_RATIO)
        t = C.target(ratio, goal)
        ps = dt.get("all_rounds") or {}
        clean = f"{ps['clean_rounds']} of {ps['rounds']}" if ps.get("rounds") else "–"
        lines += ["", f"| batch {B}, {P}-token prompts, {N} new tokens | free | constrained | constrained / free | "
                      "target | met | clean rounds |", "|---|---|---|---|---|---|---|",
                  f"| decode tok/s | {_f(dt.get('free'))} | {_f(dt.get('constrained'))} | {_x(ratio)} | "
                  f"≥ {goal:g}× | {_met(t)} | {clean} |"]
        fb = s.get("full_batch_decode_tok_s") or {}
        if fb:
            lines.append(f"| decode tok/s while every row decodes | {_f(fb.get('free'))} | {_f(fb.get('constrained'))} | "
                         f"{_x(fb.get('ratio_constrained_over_free'))} | – | – | {clean} |")
        sp = s.get("ms_per_step_p50") or {}
        if sp:
            lines.append(f"| ms per step (p50) | {_f(sp.get('free'), '{:.2f}')} | {_f(sp.get('constrained'), '{:.2f}')} | "
                         f"{_x(sp.get('ratio_constrained_over_free'))} | – | – | {clean} |")
        lines.append(f"| tokens per row, min / median / max | {_rows(s.get('tokens_per_row_free'))} | "
                     f"{_rows(s.get('tokens_per_row_constrained'))} | – | – | – | {clean} |")
        mask = s.get("mask_ms_per_step_p50")
        share = (f" ({100 * mask / sp['constrained']:.1f} % of a step)"
                 if mask is not None and sp.get("constrained") else "")
        lines.append(f"| grammar mask ms per step, host (p50 / p99) | – | {_f(mask, '{:.3f}')} / "
                     f"{_f(s.get('mask_ms_per_step_p99'), '{:.3f}')}{share} | – | – | – | {clean} |")
        if s.get("consume_ms_per_step_mean") is not None:
            lines.append(f"| grammar consume ms per step, host (mean) | – | {_f(s['consume_ms_per_step_mean'], '{:.3f}')} "
                         f"| – | – | – | {clean} |")
        comp = dec.get("compilations") or {}
        tc = tg.get("compilations_after_warmup") or C.target(comp.get("engine_after_warmup"), 0, higher_is_better=False)
        reasons = s.get("finish_reasons_constrained")
        lines += ["", f"Compilations after warmup: {_f(comp.get('engine_after_warmup'), '{}')} (target 0, {_met(tc)}); "
                      f"during the timed rounds {_f(comp.get('during_timing'), '{}')}. Constrained rows finished: "
                      + (", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) if reasons else "–") + "."]
    comp_t = d.get("compile") or {}
    cases = comp_t.get("cases") or {}
    if cases:
        lines += ["", f"Grammar compile time (`GrammarCompiler` over the model's tokenizer, "
                      f"{_f(comp_t.get('vocab_size'), '{:,}')} tokens; a fresh compiler per grammar, "
                      f"{comp_t.get('n', '?')} distinct texts each so its cache always misses; timed as a request waits: "
                      "grammar text, llguidance matcher, first mask):", "",
                  "| grammar | kind | bytes | p50 ms | p99 ms | max ms | n |", "|---|---|---|---|---|---|---|"]
        for name, r in cases.items():
            ms = r.get("ms") or {}
            lines.append(f"| {name} | {r.get('kind', '?')} | {_f(r.get('bytes'), '{:,}')} | {_f(ms.get('p50'), '{:.2f}')} | "
                         f"{_f(ms.get('p99'), '{:.2f}')} | {_f(ms.get('max'), '{:.2f}')} | {_f(ms.get('n'), '{}')} |")
        tb = comp_t.get("tokenizer_build_s")
        if tb is not None:
            lines += ["", f"Not in the table: a fresh compiler's first compile, which waits for llguidance's view of "
                          f"the tokenizer (built once per model, in the background while it loads): {tb:.2f} s "
                          f"(median of {len(cases)})."]
    return lines + [""]


# =============================================================================================
# measurement
# =============================================================================================
class HostTimer:
    """Wraps the scheduler's fill_masks and GrammarState.consume in this process; records
    (start, seconds, rows) per fill_masks call and (start, seconds) per consume call."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float, int]] = []
        self.consumes: list[tuple[float, float]] = []

    def install(self) -> None:
        from jax_engine.constrain import state
        from jax_engine.decode import scheduler

        fill = scheduler.fill_masks
        consume = state.GrammarState.consume
        calls, consumes = self.calls, self.consumes
        clock = time.perf_counter

        def timed_fill(rows, out):
            t = clock()
            try:
                return fill(rows, out)
            finally:
                calls.append((t, clock() - t, len(rows)))

        def timed_consume(self_, token):
            t = clock()
            try:
                return consume(self_, token)
            finally:
                consumes.append((t, clock() - t))

        scheduler.fill_masks = timed_fill
        state.GrammarState.consume = timed_consume


async def run_requests(engine, prompts: list[list[int]], new_tokens: int, constraint) -> tuple[float, list[dict]]:
    """Submit every prompt at once, temperature 1, request i with seed i; free rows ignore EOS."""
    from jax_engine.types import GenerateRequest, SamplingParams

    async def one(i: int, p: list[int]) -> dict:
        events: list[tuple[float, int]] = []
        ids: list[int] = []
        text: list[str] = []
        reason = error = None
        params = SamplingParams(temperature=1.0, seed=i, max_new_tokens=new_tokens, ignore_eos=constraint is None,
                                constraint=constraint)
        async for out in engine.generate(GenerateRequest(request_id="", prompt_ids=list(p), params=params)):
            if out.new_token_ids:
                events.append((time.perf_counter(), len(out.new_token_ids)))
                ids += out.new_token_ids
            text.append(out.new_text or "")
            if out.finished:
                reason, error = out.finish_reason, out.error
        return {"events": events, "ids": ids, "finish_reason": reason, "error": error, "text": "".join(text)}

    t0 = time.perf_counter()
    reqs = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    return t0, list(reqs)


class Bench:
    def __init__(self, path: str, batch: int, max_model_len: int, timer: HostTimer) -> None:
        from jax_engine.config import ModelSpec

        self.engine, self.load_s = C.build_engine([ModelSpec(name=MODEL_NAME, path=path)], progress=False,
                                                  max_running_requests=batch, max_model_len=max_model_len,
                                                  page_size=16, enable_prefix_cache=False)
        self.loop = asyncio.new_event_loop()
        self.timer = timer

    def round(self, prompts: list[list[int]], new_tokens: int, constraint) -> dict:
        n0, c0 = len(self.timer.calls), len(self.timer.consumes)
        with C.cpu_window() as w:
            t0, reqs = self.loop.run_until_complete(run_requests(self.engine, prompts, new_tokens, constraint))
        res = decode_metrics(t0, reqs, new_tokens)
        window = res.pop("window", None)
        if constraint is not None:
            res.update(mask_metrics(self.timer.calls[n0:], self.timer.consumes[c0:], window))
            res["sample_text"] = reqs[0]["text"][:240]
        errs = sorted({str(r["error"]) for r in reqs if r.get("error")})
        if errs:
            res["error_samples"] = errs[:3]
        res["cpu"] = w.result
        res["headline"] = (f"decode {_f(res.get('decode_tok_s'))} tok/s, step {_f(res.get('ms_per_step_p50'), '{:.1f}')} ms, "
                           f"tokens/row {res['tokens_per_row_min']}-{res['tokens_per_row_max']}"
                           + (f", mask {_f(res.get('mask_ms_per_step_p50'), '{:.3f}')} ms/step" if constraint else ""))
        return res

    def close(self) -> None:
        self.engine.shutdown()
        self.loop.close()


def measure_decode(path: str, vocab: int, a, timer: HostTimer) -> dict:
    from benchmarks import generate_vs_hf as G
    from jax_engine.types import Constraint

    B, P, N = a.batch, a.prompt_len, a.new_tokens
    max_model_len = max(128 if a.quick else 512, 2 ** (P + N - 1).bit_length())
    C.log(f"loading + warming the engine (batch {B}, max_model_len {max_model_len}) ...")
    bench = Bench(path, B, max_model_len, timer)
    runner = bench.engine.worker(MODEL_NAME).replicas[0].runner
    schema = Constraint("json_schema", json.dumps(nested_schema()))
    t0 = time.perf_counter()
    warm = {"free": bench.round(G.make_prompts(B, P, vocab, 998), min(8, N), None),
            "constrained": bench.round(G.make_prompts(B, P, vocab, 997), min(8, N), schema)}
    warm_s = time.perf_counter() - t0
    before = C.compile_counts(bench.engine)
    run = {"prompt_len": P}
    prompts_for = G.round_prompts(B, run, vocab, 5000)
    sides = {"free": lambda: bench.round(prompts_for("free"), N, None),
             "constrained": lambda: bench.round(prompts_for("constrained"), N, schema)}
    runs = C.run_pairs(sides, a.rounds, a.retries, label=f"b{B}", quiet_s=a.quiet_s)
    after = C.compile_counts(bench.engine)
    budget = getattr(runner, "max_tokens", None)
    out = {"engine_load_and_warmup_s": C.rnd(bench.load_s, 1), "warmup_rounds_s": C.rnd(warm_s, 1),
           "warmup_rounds": {k: {kk: v.get(kk) for kk in ("tokens_per_row_max", "finish_reasons", "errors")}
                             for k, v in warm.items()},
           "runner": {"max_tokens": budget, "num_pages": getattr(getattr(runner, "rc", None), "num_pages", None)},
           "max_model_len": max_model_len,
           "compilations": {"engine_after_warmup": after["engine_after_warmup"],
                            "during_timing": after["engine_after_warmup"] - before["engine_after_warmup"],
                            "jax_during_timing": after["jax_process_total"] - before["jax_process_total"]},
           "rounds": runs, "summary": summarize_decode(runs)}
    bench.close()
    return out


def load_tokenizer_info(path: str) -> tuple[Any, int, set[int]]:
    """The model's tokenizer, vocabulary size and EOS ids, as the decode worker builds them."""
    from jax_engine.checkpoint.hf import load_tokenizer

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    tok = load_tokenizer(path)
    eos = cfg.get("eos_token_id")
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tok.eos_token_id is not None:
        eos_ids.add(tok.eos_token_id)
    return tok, cfg["vocab_size"], eos_ids


def measure_compile(path: str, n: int) -> dict:
    """Per compile case: a fresh GrammarCompiler, one untimed compile (waits for its llguidance
    tokenizer), then n compiles of distinct texts, each timed as compile(c).result()."""
    from jax_engine.config import EngineArgs
    from jax_engine.constrain.compiler import GrammarCompiler

    tok, vocab, eos_ids = load_tokenizer_info(path)
    args = EngineArgs()
    out: dict[str, Any] = {"n": n, "vocab_size": vocab, "tokenizer_len": len(tok), "cases": {}}
    builds = []
    with C.cpu_window() as w:
        for name, (kind, _) in COMPILE_CASES.items():
            gc = GrammarCompiler(tok, vocab, eos_ids, args.grammar_cache_size, args.max_grammar_bytes)
            try:
                t0 = time.perf_counter()
                gc.compile(constraint_for(name, -1)).result()
                builds.append(time.perf_counter() - t0)
                times = []
                for i in range(n):
                    c = constraint_for(name, i)
                    t = time.perf_counter()
                    gc.compile(c).result()
                    times.append(time.perf_counter() - t)
            finally:
                gc.close()
            base = constraint_for(name, None)
            out["cases"][name] = {"kind": kind, "bytes": spec_bytes(base), "ms": summarize_compile(times),
                                  "first_compile_with_tokenizer_build_ms": C.rnd(builds[-1] * 1e3, 1)}
            ms = out["cases"][name]["ms"]
            C.log(f"compile {name}: p50 {ms['p50']} ms, p99 {ms['p99']} ms (n {n})")
    out["tokenizer_build_s"] = C.rnd(C.median(builds), 2)
    out["cpu"] = w.result
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from benchmarks import generate_vs_hf as G

    ap = argparse.ArgumentParser(prog="python -m benchmarks.constrained_decode", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny-v152k, batch 4, short rounds (smoke test)")
    ap.add_argument("--model", choices=list(G.MODELS), default=None, help="default small-v152k; quick: tiny-v152k")
    ap.add_argument("--model-dir", default=None, help="where the random model is cached")
    ap.add_argument("--batch", type=int, default=None, help="concurrent requests (default 16; quick 4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128; quick 32")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128; quick 32")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per side (default 3; quick 2)")
    ap.add_argument("--retries", type=int, default=None, help="extra rounds when one was disturbed (default 2; quick 0)")
    ap.add_argument("--compile-n", type=int, default=None, help="compiles per grammar (default 100; quick 10)")
    ap.add_argument("--phases", default=",".join(PHASES), help="decode,compile (default both)")
    ap.add_argument("--quiet-wait", type=float, default=None,
                    help="seconds to wait before each round for other processes to go quiet (default 60; quick 0)")
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    q = a.quick
    a.model = a.model or ("tiny-v152k" if q else "small-v152k")
    a.batch = a.batch or (4 if q else 16)
    a.prompt_len = a.prompt_len or (32 if q else 128)
    a.new_tokens = a.new_tokens or (32 if q else 128)
    a.rounds = a.rounds or (2 if q else 3)
    a.retries = a.retries if a.retries is not None else (0 if q else 2)
    a.compile_n = a.compile_n or (10 if q else 100)
    a.quiet_s = C.quiet_seconds(a)
    a.phases = [p.strip() for p in a.phases.split(",") if p.strip()]
    bad = [p for p in a.phases if p not in PHASES]
    if bad:
        ap.error(f"unknown phase(s) {', '.join(bad)}; expected {', '.join(PHASES)}")
    return a


def main(argv: Sequence[str] | None = None) -> dict:
    C.engine_process()
    from benchmarks import generate_vs_hf as G

    a = parse_args(argv)
    doc = C.header(NAME, a.quick, sys.argv[1:] if argv is None else argv)
    doc["quiet_wait"] = C.wait_for_quiet(0 if a.quick else 60)
    total = C.CpuWindow().start()
    path = G.ensure_model(a.model, a.model_dir)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    timer = HostTimer()
    timer.install()
    doc["setup"] = {"model": a.model, "model_dir": path, "vocab_size": cfg["vocab_size"],
                    "config": {k: cfg[k] for k in G.MODELS[a.model]},
                    "batch": a.batch, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
                    "rounds": a.rounds, "retries": a.retries, "phases": a.phases,
                    "sampling": "temperature 1, seed = request index, max_new_tokens = new_tokens; free rows ignore_eos",
                    "nested_schema": nested_schema(),
                    "engine_args": {"max_running_requests": a.batch, "page_size": 16, "enable_prefix_cache": False,
                                    "max_num_batched_tokens": "server default", "compile_cache_dir": "server default"}}
    if "decode" in a.phases:
        doc["decode"] = measure_decode(path, cfg["vocab_size"], a, timer)
        doc["setup"]["token_budget"] = doc["decode"]["runner"]["max_tokens"]
        doc["setup"]["engine_args"]["max_model_len"] = doc["decode"]["max_model_len"]
    if "compile" in a.phases:
        C.log(f"grammar compile times ({a.compile_n} per grammar) ...")
        doc["compile"] = measure_compile(path, a.compile_n)
    doc["process_isolation"] = {"engine": C.isolation_report(C.ENGINE_BLOCKED)}
    doc["cpu"] = total.stop()
    doc["busy_processes_at_end"] = C.busy_processes()
    doc["targets"] = targets(doc)
    s = (doc.get("decode") or {}).get("summary") or {}
    if s:
        dt = s["decode_tok_s"]
        C.log(f"decode tok/s free {dt['free']}, constrained {dt['constrained']}, ratio {dt['ratio_constrained_over_free']} "
              f"(target {GOAL_RATIO}); mask {s.get('mask_ms_per_step_p50')} ms/step")
    return C.finish(doc, NAME, a.quick)


if __name__ == "__main__":
    main()
