"""The grammar engine, chosen by measurement: token-mask time per step at batch 16, llguidance vs xgrammar.

Issue 17 asks for a maintained grammar library, llguidance or xgrammar, chosen by measurement:
mask time per token at batch 16 for a nested JSON schema, on our tokenizers. This script measures
both, each in its own worker process, and the README says which one the server uses and why.

Tokenizers (ours):
  demo    the bundled demo generator's byte-level BPE tokenizer, 512 tokens
          (jax_engine.models.demo.default_demo_dir(), built by build_demo_generator when absent);
  v152k   the 151,936-token Qwen2-sized tokenizer of the benchmark model folders
          (generate_vs_hf's 'small-v152k' / 'tiny-v152k' under ~/.cache/xlaserve/bench-models;
          the same tokenizer.json in both; built with generate_vs_hf.ensure_model('tiny-v152k')
          when neither exists).
Workload: one JSON schema (SCHEMA below: an object with a nested object holding a nested object,
an array of objects holding an array of strings, an enum, integers with bounds, strings with
patterns and length bounds, required and optional fields, no additional properties; depth 3).
16 valid documents for it (make_documents: seeded, different sizes and optional fields, three
whitespace styles) are tokenized with the HF tokenizer (`tokenizers`, no special tokens) and end
in the tokenizer's EOS; each library first checks every token of every document against its own
mask (`load`), so a trajectory is known to be accepted before it is timed.
A timed pass is `steps` decode steps of 16 requests at once (batch 16): at every step the batch's
16-row bitmask is computed (the timed "mask" figure, µs per step for the whole batch), each row's
next token is checked against its row (untimed) and consumed (timed apart, "consume"). A request
that has consumed its EOS is replaced by a new request for the same schema, as a server would
start one (a new matcher; timed apart, "new request"), so rows drift apart and every grammar
state is met. Two ways per library, both timed in every round:
  batch   what each library's docs recommend for a batch: llguidance
          `llguidance.numpy.fill_next_token_bitmask_par(LLExecutor(threads), ...)` and
          `consume_token_par`; xgrammar `BatchGrammarMatcher(threads).batch_fill_next_token_bitmask`
          and `BatchGrammarMatcher.batch_accept_token`;
  serial  one call per row: llguidance `fill_next_token_bitmask` / `consume_token`, xgrammar
          `GrammarMatcher.fill_next_token_bitmask` / `accept_token`.
Also per round, in the same worker call: the cold compile of the schema (llguidance:
`grammar_from_json_schema` + `LLMatcher(tokenizer, grammar)`, the matcher being the compiled
grammar; xgrammar: `GrammarCompiler(info, cache_enabled=False).compile_json_schema`, i.e. a schema
the compiler has not seen) and the time to the first mask (compile + matcher + first mask).
A new request for a schema already compiled: llguidance `deep_copy()` of the start-state matcher
(what jax_engine/constrain/compiler.py does), xgrammar `GrammarMatcher(compiled)` from its
compiler's cache.
Per tokenizer, once per worker: the tokenizer-info build (llguidance `llguidance.hf.from_tokenizer`,
xgrammar `TokenizerInfo.from_huggingface`, from an already loaded HF fast tokenizer; first build
and median of repeats), xgrammar's `CompiledGrammar.memory_size_bytes` (llguidance has no such
figure), and the worker's RSS. Both keep the schema's property order. Whitespace (--whitespace):
  compact   (default) the server's JSON: no whitespace between tokens (jax_engine/constrain/grammar.py
            adds llguidance's {"x-guidance": {"whitespace_flexible": false}}; xgrammar gets
            any_whitespace=False, separators=(",", ":")); all 16 documents compact;
  flexible  each library's defaults (free whitespace); the documents cycle through compact,
            ", " / ": " separators and indent=2.

How: each library runs in a worker process of its own (`python -m benchmarks.grammar_mask --worker
llguidance|xgrammar`, the JSON-lines protocol of benchmarks/peer_worker.py; jax is blocked in both
and torch in the llguidance worker, which needs none, as in the server). Rounds alternate between
the two workers, the first side rotating (common.run_pairs), the order of the two ways rotating
too; a round's CPU window counts both workers; figures are medians over rounds (clean rounds
when there are any). Both libraries get the same thread count (the usable cores).
Also recorded: each library's install weight (its runtime requirement closure from installed
package metadata, MiB on disk, and what it adds beyond xlaserve's base install, pyproject.toml),
and, where benchmarks/results/generate_vs_hf.json has one, its sampled decode step at batch 16 over
the same 151,936-token vocabulary ('small-v152k'), to set the mask time against (`decode_step`).

Time (2 cores): ~10 s of tokenizer-info builds and checks per tokenizer, then 5 rounds x 2
libraries x (2 ways x 600 steps + a compile), ~1-2 s each: about 2 minutes in all (2m05-2m25 on
this host; waiting for quiet adds up to 30 s before the start and 5 s before each round).
--quick: 1 round of 200 steps, one tokenizer-info build: ~15-20 s.

Run:  python -m benchmarks.grammar_mask [--quick] [--rounds 5] [--steps 600] [--tokenizers demo,v152k]
          [--libraries llguidance,xgrammar] [--whitespace compact|flexible] [--threads N] [--retries 2]
          [--info-repeats 3] [--seed 17] [--quiet-wait S]
Writes benchmarks/results/grammar_mask.json (grammar_mask_quick.json).
"""
from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import importlib.util
import itertools
import json
import os
import random
import string
import sys
import time
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C
from benchmarks.peer_worker import Peer, run_worker

NAME = "grammar_mask"
LIBRARIES = ("llguidance", "xgrammar")
MODES = ("batch", "serial")
TOKENIZERS = ("demo", "v152k")
BATCH = 16
SERVER_LIBRARY = "llguidance"        # what jax_engine's structured generation uses (base install)
SERVER_REASON = ("llguidance has no Python dependencies, while xgrammar 0.2.9 requires torch and triton (besides "
                 "transformers and apache-tvm-ffi), which the base install must not pull")
# the figures of one timed pass that are summarized over rounds (per way: batch_..., serial_...)
PASS_KEYS = ("mask_p50_us", "mask_p90_us", "mask_p99_us", "mask_mean_us", "consume_p50_us", "step_p50_us",
             "step_p99_us", "new_request_p50_us", "allowed_mean", "rejected")
COMPILE_KEYS = ("compile_ms", "first_mask_ms")

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "status": {"enum": ["active", "suspended", "closed"]},
        "email": {"type": "string", "pattern": "^[a-z0-9._]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                        "required": ["lat", "lon"], "additionalProperties": False},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array", "minItems": 1, "maxItems": 8,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                    "price": {"type": "number"},
                    "tags": {"type": "array", "maxItems": 4, "items": {"type": "string"}},
                },
                "required": ["sku", "quantity"],
                "additionalProperties": False,
            },
        },
        "verified": {"type": "boolean"},
    },
    "required": ["id", "name", "status", "address", "orders"],
    "additionalProperties": False,
}
STYLES = ("compact", "spaced", "indent2")
WHITESPACE = ("compact", "flexible")


# =============================================================================================
# pure helpers (tests/unit/test_bench_grammar.py)
# =============================================================================================
def make_documents(n: int = BATCH, seed: int = 17) -> list[dict]:
    """`n` different valid documents for SCHEMA (keys in the schema's order), seeded."""
    rng = random.Random(seed)
    words = [w for w in C.WORDS if w.isalpha() and w.islower()]
    docs = []
    for i in range(n):
        d: dict[str, Any] = {"id": rng.randint(0, 10 ** 6),
                             "name": " ".join(w.capitalize() for w in rng.sample(words, 2)),
                             "status": rng.choice(SCHEMA["properties"]["status"]["enum"])}
        if i % 2 == 0:
            d["email"] = f"{rng.choice(words)}.{rng.choice(words)}@{rng.choice(words)}.{rng.choice(['com', 'org', 'io'])}"
        addr: dict[str, Any] = {"street": f"{rng.randint(1, 999)} {rng.choice(words)} {rng.choice(['road', 'lane'])}",
                                "city": rng.choice(words).capitalize(), "zip": f"{rng.randint(0, 99999):05d}"}
        if i % 3 != 0:
            addr["geo"] = {"lat": round(rng.uniform(-90, 90), 4), "lon": round(rng.uniform(-180, 180), 4)}
        d["address"] = addr
        orders = []
        for _ in range(1 + i % 4):
            o: dict[str, Any] = {"sku": "".join(rng.choice(string.ascii_uppercase) for _ in range(3))
                                 + f"-{rng.randint(0, 9999):04d}", "quantity": rng.randint(1, 100)}
            if rng.random() < 0.6:
                o["price"] = round(rng.uniform(0.5, 500.0), 2)
            if rng.random() < 0.5:
                o["tags"] = rng.sample(words, rng.randint(0, 3))
            orders.append(o)
        d["orders"] = orders
        if i % 4 != 1:
            d["verified"] = rng.random() < 0.5
        docs.append(d)
    return docs


def render(doc: dict, style: str) -> str:
    """A document as text: compact, with ', ' / ': ' separators, or indented by 2."""
    if style == "compact":
        return json.dumps(doc, separators=(",", ":"))
    if style == "spaced":
        return json.dumps(doc)
    if style == "indent2":
        return json.dumps(doc, indent=2)
    raise ValueError(style)


def document_styles(n: int, whitespace: str = "compact") -> list[str]:
    """Each document's style: all compact for the server's compact JSON, else cycling through STYLES."""
    if whitespace not in WHITESPACE:
        raise ValueError(whitespace)
    return ["compact" if whitespace == "compact" else STYLES[i % len(STYLES)] for i in range(n)]


def document_texts(n: int = BATCH, seed: int = 17, whitespace: str = "compact") -> list[str]:
    """The `n` documents as text in their document_styles()."""
    return [render(d, st) for d, st in zip(make_documents(n, seed), document_styles(n, whitespace))]


def llguidance_schema(schema: str, whitespace: str) -> str:
    """The schema as llguidance gets it: compact JSON the way the server asks for it
    (jax_engine/constrain/grammar.py), unless the schema sets llguidance's own options."""
    obj = json.loads(schema)
    if whitespace == "compact" and isinstance(obj, dict) and "x-guidance" not in obj:
        obj = {**obj, "x-guidance": {"whitespace_flexible": False}}
    return json.dumps(obj)


def xgrammar_options(whitespace: str) -> dict:
    """compile_json_schema keywords for the same JSON as llguidance_schema()."""
    return {"any_whitespace": False, "separators": (",", ":")} if whitespace == "compact" else {}


def token_allowed(mask, tokens: Sequence[int]):
    """Per row r: whether bit tokens[r] of bitmask row r is set (int32 words, 32 tokens each)."""
    import numpy as np

    t = np.asarray(tokens, dtype=np.int64)
    words = mask[np.arange(len(t)), t >> 5].astype(np.int64) & 0xFFFFFFFF
    return ((words >> (t & 31)) & 1).astype(bool)


def allowed_counts(mask, vocab: int):
    """Tokens allowed per row of an int32 bitmask (bits past `vocab` not counted)."""
    import numpy as np

    u = np.ascontiguousarray(mask).view(np.uint32)
    full, rest = divmod(vocab, 32)
    n = np.bitwise_count(u[:, :full]).sum(axis=1).astype(np.int64)
    if rest:
        n += np.bitwise_count(u[:, full] & np.uint32((1 << rest) - 1)).astype(np.int64)
    return n


def pass_stats(mask_s: Sequence[float], consume_s: Sequence[float], new_s: Sequence[float]) -> dict:
    """One timed pass's figures in µs: mask and consume per step of the whole batch, new requests."""
    m, c = C.summarize(mask_s, 1e6, 1), C.summarize(consume_s, 1e6, 1)
    s = C.summarize([a + b for a, b in zip(mask_s, consume_s)], 1e6, 1)
    n = C.summarize(new_s, 1e6, 1)
    return {"mask_us": m, "consume_us": c, "step_us": s, "new_request_us": n,
            "mask_p50_us": m.get("p50"), "mask_p90_us": m.get("p90"), "mask_p99_us": m.get("p99"),
            "mask_mean_us": m.get("mean"), "consume_p50_us": c.get("p50"), "step_p50_us": s.get("p50"),
            "step_p99_us": s.get("p99"), "new_request_p50_us": n.get("p50")}


def flat_round(res: dict) -> dict:
    """A round's result as flat keys (batch_mask_p50_us, ..., compile_ms) for medians over rounds."""
    out: dict[str, Any] = {k: (res.get("compile") or {}).get(k) for k in COMPILE_KEYS}
    for mode, m in (res.get("modes") or {}).items():
        out.update({f"{mode}_{k}": m.get(k) for k in PASS_KEYS})
    return out


def median_of(runs: list[dict], key: str, digits: int = 2) -> float | None:
    """The median of `key` over clean runs when there are any, else over all (None if absent)."""
    use = [r for r in runs if r.get("clean")] or runs
    vals = [r[key] for r in use if r.get(key) is not None]
    return C.rnd(C.median(vals), digits) if vals else None


def summarize_rounds(rounds: list[dict]) -> dict:
    """Medians over rounds of every flat key, with the count of (clean) rounds."""
    flat = [{**flat_round(r), "clean": r.get("clean")} for r in rounds]
    keys = [f"{m}_{k}" for m in MODES for k in PASS_KEYS] + list(COMPILE_KEYS)
    out: dict[str, Any] = {k: median_of(flat, k, 3 if k.endswith("_ms") else 2) for k in keys}
    out["rounds"] = len(rounds)
    out["clean_rounds"] = sum(1 for r in rounds if r.get("clean"))
    # the batch API and the serial loop met the same states: their masks must be bit-identical
    shas = [{m.get("mask_sha1") for m in (r.get("modes") or {}).values()} for r in rounds if len(r.get("modes") or {}) > 1]
    out["ways_masks_identical"] = all(len(x) == 1 for x in shas) if shas else None
    # the library's faster way here (its batch API or one call per row), by median mask time
    ways = [(out[f"{m}_mask_p50_us"], m) for m in MODES if out.get(f"{m}_mask_p50_us") is not None]
    best = min(ways) if ways else (None, None)
    out["best_way"], out["best_mask_p50_us"] = best[1], best[0]
    out["best_mask_p99_us"] = out.get(f"{best[1]}_mask_p99_us") if best[1] else None
    return out


def compare(a: dict, b: dict) -> dict:
    """llguidance / xgrammar for the headline figures of two summaries (< 1: llguidance lower)."""
    keys = ("best_mask_p50_us", "batch_mask_p50_us", "batch_mask_p99_us", "serial_mask_p50_us", "serial_mask_p99_us",
            "compile_ms", "first_mask_ms", "batch_new_request_p50_us")
    return {k: C.ratio(a.get(k), b.get(k)) for k in keys}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def requirement_closure(name: str) -> dict[str, dict]:
    """The installed distributions `name` needs at run time (no extras), with their size on disk:
    {normalized name: {"name", "version", "mib"}}; a requirement that is not installed has version None."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    out: dict[str, dict] = {}
    todo = [name]
    while todo:
        n = todo.pop()
        key = _norm(n)
        if key in out:
            continue
        try:
            d = distribution(n)
        except PackageNotFoundError:
            out[key] = {"name": n, "version": None, "mib": 0.0}
            continue
        size = sum((f.size or 0) for f in (d.files or []))
        out[key] = {"name": d.metadata["Name"], "version": d.version, "mib": round(size / 2 ** 20, 1)}
        for spec in d.requires or []:
            r = Requirement(spec)
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(r.name)
    return out


def base_requirements(pyproject: str = os.path.join(C.REPO_ROOT, "pyproject.toml")) -> list[str]:
    """The base install's requirement names, from pyproject.toml (the installed metadata of an
    editable install can be older than the file; it is the fallback where tomllib is missing)."""
    from packaging.requirements import Requirement

    try:
        import tomllib  # noqa: I001 -- Python >= 3.11
    except ImportError:
        from importlib.metadata import distribution

        deps = list(distribution("xlaserve").requires or [])
    else:
        with open(pyproject, "rb") as f:
            deps = tomllib.load(f)["project"]["dependencies"]
    return [Requirement(d).name for d in deps if Requirement(d).marker is None or Requirement(d).marker.evaluate({"extra": ""})]


def install_weight(libraries: Sequence[str] = LIBRARIES, base: Sequence[str] | None = None) -> dict:
    """Each library's own size, its requirement closure, and what it adds beyond the base install
    (the closure of xlaserve's own requirements, pyproject.toml, without the grammar libraries)."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement

    base = list(base_requirements() if base is None else base)
    base_closure: dict[str, dict] = {}
    for name in base:
        if _norm(name) not in LIBRARIES:
            base_closure.update(requirement_closure(name))
    out: dict[str, Any] = {"base": "xlaserve (pyproject.toml [project].dependencies)",
                           "base_requires": {lib: any(_norm(n) == lib for n in base) for lib in libraries}}
    for lib in libraries:
        clo = requirement_closure(lib)
        own = clo.get(_norm(lib)) or {}
        if own.get("version") is None:
            out[lib] = {"installed": False}
            continue
        direct = [Requirement(s).name for s in (distribution(lib).requires or [])
                  if Requirement(s).marker is None or Requirement(s).marker.evaluate({"extra": ""})]
        extra = {k: v for k, v in clo.items() if k not in base_closure and k != _norm(lib)}
        out[lib] = {"installed": True, "version": own["version"], "own_mib": own["mib"], "requires": direct,
                    "closure_mib": round(sum(v["mib"] for v in clo.values()), 1),
                    "beyond_base": {v["name"]: v["mib"] for v in sorted(extra.values(), key=lambda v: -v["mib"])},
                    "beyond_base_mib": round(own["mib"] + sum(v["mib"] for v in extra.values()), 1)}
    return out


# =============================================================================================
# the library workers (each in its own process)
# =============================================================================================
def _rss_mib() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


class _State:
    """One tokenizer's objects in a worker."""

    def __init__(self, vocab: int, info: Any) -> None:
        self.vocab, self.info = vocab, info
        self.schema = ""
        self.whitespace = "compact"
        self.factory: Any = None          # what a new request's matcher is made from
        self.cold: Any = None             # xgrammar: a compiler with its cache off
        self.trajectories: list[list[int]] = []


class GrammarWorker:
    """The library-independent part: tokenizers, checks, the timed pass. Subclasses implement the
    library calls (_info, _compile_cold, _prepare, _new, _alloc, _view, _fill_*, _consume_*, _done)."""

    LIB = ""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or C.usable_cores()
        self.state: dict[str, _State] = {}

    # ---------------------------------------------------------------- commands
    def cmd_hello(self) -> dict:
        from importlib.metadata import version

        return {"library": self.LIB, "version": version(self.LIB), "threads": self.threads,
                **C.isolation_report(("jax", "torch", "transformers"))}

    def cmd_isolation(self) -> dict:
        return C.isolation_report(("jax", "torch", "transformers"))

    def cmd_setup(self, key: str, path: str, vocab_size: int, repeats: int = 3) -> dict:
        """Load the HF fast tokenizer (untimed), then build the library's tokenizer info `repeats` times."""
        from transformers import PreTrainedTokenizerFast

        rss0 = _rss_mib()
        hf = PreTrainedTokenizerFast.from_pretrained(path)
        times, info = [], None
        for _ in range(max(1, repeats)):
            info = None
            gc.collect()
            t0 = time.perf_counter()
            info = self._info(hf, vocab_size)
            times.append(time.perf_counter() - t0)
        self.state[key] = _State(vocab_size, info)
        return {"tokenizer_info_first_ms": C.rnd(times[0] * 1e3, 1),
                "tokenizer_info_ms": C.rnd(C.median(times) * 1e3, 1), "tokenizer_info_runs_ms":
                [C.rnd(t * 1e3, 1) for t in times], "hf_len": len(hf), "eos_token_id": hf.eos_token_id,
                "rss_mib_before": rss0, "rss_mib": _rss_mib()}

    def cmd_compile(self, key: str, schema: str) -> dict:
        """Cold compile of `schema` (a schema this worker's compiler has not cached), then the
        first mask of a matcher for it."""
        import numpy as np

        st = self.state[key]
        gc.collect()
        t0 = time.perf_counter()
        compiled, extra = self._compile_cold(st, schema)
        t1 = time.perf_counter()
        m = self._matcher_from_compiled(st, compiled)
        mask = self._alloc(1, st.vocab)
        self._fill_serial([m], mask)
        t2 = time.perf_counter()
        allowed = int(allowed_counts(np.asarray(self._view(mask)), st.vocab)[0])
        return {"compile_ms": C.rnd((t1 - t0) * 1e3, 3), "first_mask_ms": C.rnd((t2 - t0) * 1e3, 3),
                "first_mask_allowed": allowed, **extra}

    def cmd_load(self, key: str, schema: str, trajectories: list[list[int]], warm_steps: int = 50,
                 whitespace: str = "compact") -> dict:
        """Keep the schema and the 16 token trajectories; check every token of every trajectory
        against this library's own mask (one matcher per document, one row), then an untimed pass."""
        import numpy as np

        st = self.state[key]
        st.schema, st.trajectories, st.whitespace = schema, [list(t) for t in trajectories], whitespace
        t0 = time.perf_counter()
        st.factory = self._prepare(st, schema)
        prepare_ms = (time.perf_counter() - t0) * 1e3
        mask = self._alloc(1, st.vocab)
        view = np.asarray(self._view(mask))
        checked, rejected, failures, ended = 0, 0, [], 0
        for d, traj in enumerate(st.trajectories):
            m = self._new(st)
            for k, tok in enumerate(traj):
                self._fill_serial([m], mask)
                ok = bool(token_allowed(view, [tok])[0]) and bool(self._consume_serial([m], [tok])[0])
                checked += 1
                if not ok:
                    rejected += 1
                    failures.append({"document": d, "position": k, "token": tok, "error": self._error(m)})
                    break
            ended += bool(self._done(m))
        warm = self._pass(st, "batch", warm_steps) if warm_steps > 0 else {}
        return {"prepare_ms": C.rnd(prepare_ms, 3), "tokens_checked": checked, "rejected": rejected,
                "failures": failures[:3], "documents_ended": ended, "documents": len(st.trajectories),
                "warmup_pass": {k: warm.get(k) for k in ("mask_p50_us", "rejected")}, "rss_mib": _rss_mib(), **self._memory(st)}

    def cmd_round(self, key: str, modes: list[str], steps: int) -> dict:
        """One round: a cold compile, then a timed pass per way, in the given order."""
        st = self.state[key]
        out = {"compile": self.cmd_compile(key, st.schema), "modes": {}}
        for mode in modes:
            out["modes"][mode] = self._pass(st, mode, steps)
        b = out["modes"].get("batch") or {}
        s = out["modes"].get("serial") or {}
        out["headline"] = (f"batch mask p50 {b.get('mask_p50_us')} / p99 {b.get('mask_p99_us')} µs, serial "
                           f"{s.get('mask_p50_us')} / {s.get('mask_p99_us')} µs, compile {out['compile']['compile_ms']} ms")
        return out

    # ---------------------------------------------------------------- the timed pass
    def _pass(self, st: _State, mode: str, steps: int) -> dict:
        """`steps` steps of the batch: mask (timed), check (untimed), consume (timed); a row whose
        trajectory is done starts a new request (a new matcher; timed apart)."""
        import numpy as np

        trajs = st.trajectories
        B = len(trajs)
        fill = self._fill_batch if mode == "batch" else self._fill_serial
        consume = self._consume_batch if mode == "batch" else self._consume_serial
        mask = self._alloc(B, st.vocab)
        view = np.asarray(self._view(mask))
        matchers = [self._new(st) for _ in range(B)]
        pos = [0] * B
        mask_s, consume_s, new_s = [], [], []
        rejected, requests, allowed = 0, B, 0
        digest = hashlib.sha1()
        gc.collect()
        for _ in range(steps):
            for r in range(B):
                if pos[r] >= len(trajs[r]):
                    t0 = time.perf_counter()
                    matchers[r] = self._new(st)
                    new_s.append(time.perf_counter() - t0)
                    pos[r], requests = 0, requests + 1
            toks = [trajs[r][pos[r]] for r in range(B)]
            t0 = time.perf_counter()
            fill(matchers, mask)
            t1 = time.perf_counter()
            ok = token_allowed(view, toks)
            allowed += int(allowed_counts(view, st.vocab).sum())
            digest.update(view.tobytes())
            t2 = time.perf_counter()
            consumed = consume(matchers, toks)
            t3 = time.perf_counter()
            mask_s.append(t1 - t0)
            consume_s.append(t3 - t2)
            for r in range(B):
                if not (ok[r] and consumed[r]):
                    rejected += 1
                    pos[r] = len(trajs[r])        # a new request next step
                else:
                    pos[r] += 1
        out = pass_stats(mask_s, consume_s, new_s)
        out.update({"mode": mode, "steps": steps, "batch": B, "requests": requests, "rejected": rejected,
                    "allowed_mean": C.rnd(allowed / max(1, steps * B), 2), "mask_sha1": digest.hexdigest()[:16]})
        return out

    # ---------------------------------------------------------------- library calls
    def _memory(self, st: _State) -> dict:
        return {}

    def _error(self, m: Any) -> str | None:
        return None

    def _matcher_from_compiled(self, st: _State, compiled: Any) -> Any:
        return compiled


class LLGuidanceWorker(GrammarWorker):
    LIB = "llguidance"

    def __init__(self, threads: int | None = None) -> None:
        super().__init__(threads)
        import llguidance

        self.executor = llguidance.LLExecutor(self.threads)

    def _info(self, hf: Any, vocab: int) -> Any:
        import llguidance.hf

        return llguidance.hf.from_tokenizer(hf, n_vocab=vocab)

    def _compile_cold(self, st: _State, schema: str) -> tuple[Any, dict]:
        from llguidance import LLMatcher

        m = LLMatcher(st.info, LLMatcher.grammar_from_json_schema(llguidance_schema(schema, st.whitespace)), log_level=0)
        if m.is_error():
            raise RuntimeError(f"llguidance: {m.get_error()}")
        return m, {}

    def _prepare(self, st: _State, schema: str) -> Any:
        # as the server's GrammarCompiler: compile once, compute the first mask, keep the start state
        m, _ = self._compile_cold(st, schema)
        self._fill_serial([m], self._alloc(1, st.vocab))
        return m

    def _new(self, st: _State) -> Any:
        return st.factory.deep_copy()                # a new request: a copy of the start state (the server's way)

    def _alloc(self, batch: int, vocab: int) -> Any:
        from llguidance.numpy import allocate_token_bitmask

        return allocate_token_bitmask(batch, vocab)

    def _view(self, mask: Any) -> Any:
        return mask

    def _fill_batch(self, matchers: list, mask: Any) -> None:
        from llguidance.numpy import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], mask)

    def _fill_serial(self, matchers: list, mask: Any) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        for i, m in enumerate(matchers):
            fill_next_token_bitmask(m, mask, i)

    def _consume_batch(self, matchers: list, toks: list[int]) -> list[bool]:
        from llguidance.numpy import consume_token_par

        return consume_token_par(self.executor, list(zip(matchers, toks)))

    def _consume_serial(self, matchers: list, toks: list[int]) -> list[bool]:
        return [m.consume_token(t) for m, t in zip(matchers, toks)]

    def _done(self, m: Any) -> bool:
        return m.is_stopped()

    def _error(self, m: Any) -> str | None:
        return m.get_error() or None


class XGrammarWorker(GrammarWorker):
    LIB = "xgrammar"

    def __init__(self, threads: int | None = None) -> None:
        super().__init__(threads)
        import xgrammar

        self.xgr = xgrammar
        self.batcher = xgrammar.BatchGrammarMatcher(self.threads)

    def _info(self, hf: Any, vocab: int) -> Any:
        return self.xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)

    def _compile_cold(self, st: _State, schema: str) -> tuple[Any, dict]:
        # the compiler with its cache off (made in _prepare): every call compiles, as for a schema never seen
        cg = st.cold.compile_json_schema(schema, **xgrammar_options(st.whitespace))
        return cg, {"memory_bytes": cg.memory_size_bytes}

    def _matcher_from_compiled(self, st: _State, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def _prepare(self, st: _State, schema: str) -> Any:
        # the server's compiler: cache on, so a new request for a seen schema is a cache hit
        comp = self.xgr.GrammarCompiler(st.info, max_threads=self.threads, cache_enabled=True)
        comp.compile_json_schema(schema, **xgrammar_options(st.whitespace))
        st.cold = self.xgr.GrammarCompiler(st.info, max_threads=self.threads, cache_enabled=False)
        return comp

    def _new(self, st: _State) -> Any:
        return self.xgr.GrammarMatcher(st.factory.compile_json_schema(st.schema, **xgrammar_options(st.whitespace)))

    def _alloc(self, batch: int, vocab: int) -> Any:
        return self.xgr.allocate_token_bitmask(batch, vocab)

    def _view(self, mask: Any) -> Any:
        return mask.numpy()                           # shares the tensor's memory

    def _fill_batch(self, matchers: list, mask: Any) -> None:
        self.batcher.batch_fill_next_token_bitmask(matchers, mask)

    def _fill_serial(self, matchers: list, mask: Any) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)

    def _consume_batch(self, matchers: list, toks: list[int]) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, toks)

    def _consume_serial(self, matchers: list, toks: list[int]) -> list[bool]:
        return [m.accept_token(t) for m, t in zip(matchers, toks)]

    def _done(self, m: Any) -> bool:
        return m.is_terminated()

    def _memory(self, st: _State) -> dict:
        return {"memory_bytes": st.factory.compile_json_schema(st.schema, **xgrammar_options(st.whitespace)).memory_size_bytes}


WORKERS: dict[str, type[GrammarWorker]] = {"llguidance": LLGuidanceWorker, "xgrammar": XGrammarWorker}
# what each worker may not import: jax in both; torch where the library does not need it (as in the server)
BLOCKED = {"llguidance": C.PEER_BLOCKED + C.ENGINE_BLOCKED, "xgrammar": C.PEER_BLOCKED}


def worker_main(lib: str, threads: int | None) -> None:
    run_worker(functools.partial(WORKERS[lib], threads), blocked=BLOCKED[lib])


# =============================================================================================
# the driver
# =============================================================================================
class LibProcess(Peer):
    """A worker process for one library (peer_worker's JSON-lines protocol)."""

    def __init__(self, lib: str, threads: int) -> None:
        super().__init__(argv=[sys.executable, "-m", "benchmarks.grammar_mask", "--worker", lib, "--threads", str(threads)],
                         name=lib)


def available(lib: str) -> bool:
    return importlib.util.find_spec(lib) is not None


def _sha1_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha1(f.read()).hexdigest()[:12]


def ensure_tokenizers(keys: Sequence[str]) -> dict[str, dict]:
    """The tokenizer folders (built the way the benchmarks build them when absent)."""
    out = {}
    for key in keys:
        if key == "demo":
            from jax_engine.models.demo import build_demo_generator, default_demo_dir

            path, source = build_demo_generator(default_demo_dir()), "the bundled demo generator (demo-generator-v1)"
        elif key == "v152k":
            root = C.bench_cache_root()
            found = [os.path.join(root, f"{m}-llama-v2") for m in ("small-v152k", "tiny-v152k")]
            path = next((p for p in found if os.path.isfile(os.path.join(p, "bench_model.json"))), None)
            if path is None:
                from benchmarks import generate_vs_hf as G

                path = G.ensure_model("tiny-v152k")
            source = f"the benchmark model folder {os.path.basename(path)} (generate_vs_hf)"
        else:
            raise SystemExit(f"unknown tokenizer {key!r}; choose from {TOKENIZERS}")
        with open(os.path.join(path, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        out[key] = {"path": path, "source": source, "vocab_size": vocab,
                    "tokenizer_json_sha1": _sha1_file(os.path.join(path, "tokenizer.json"))}
    return out


def trajectories(path: str, texts: Sequence[str]) -> tuple[list[list[int]], dict]:
    """Every text's token ids (the HF tokenizer, no special tokens) followed by the EOS id."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        eos = json.load(f).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    eos_id = tok.token_to_id(eos)
    ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    roundtrip = all(tok.decode(x, skip_special_tokens=False) == t for x, t in zip(ids, texts))
    lens = [len(x) + 1 for x in ids]
    return [x + [eos_id] for x in ids], {"eos_token": eos, "eos_id": eos_id, "tokens_per_document": lens,
                                         "tokens_total": sum(lens), "decode_roundtrip": roundtrip}


def decode_step_context(quick: bool = False) -> dict | None:
    """A sampled decode step at batch 16 over the same 151,936-token vocabulary, from
    generate_vs_hf's results file (its 'small-v152k' row), to set the mask time against; None without one."""
    path = C.result_path("generate_vs_hf", quick)
    try:
        with open(path) as f:
            g = json.load(f)
    except (OSError, ValueError):
        return None
    for model, row in (g.get("sampled") or {}).items():
        if row.get("vocab_size") == 151936 and row.get("batch") == BATCH and row.get("sampled_decode_tok_s"):
            return {"source": C.rel(path), "finished": g.get("finished"), "model": model, "batch": BATCH,
                    "engine_dtype": row.get("engine_dtype"), "sampled_decode_tok_s": row["sampled_decode_tok_s"],
                    "ms_per_step": C.rnd(BATCH / row["sampled_decode_tok_s"] * 1e3, 2)}
    return None


def _round(p: LibProcess, key: str, orders: Any, steps: int) -> dict:
    """One library's round (the ways' order rotating from round to round) in a CPU window."""
    return p.timed("round", key=key, modes=next(orders), steps=steps)


def report_lines(doc: dict) -> list[str]:
    lines = [C.host_line(doc.get("machine"))]
    for key, by_lib in (doc.get("results") or {}).items():
        for lib, r in by_lib.items():
            s = r.get("summary") or {}
            if "skipped" in r:
                lines.append(f"{key} {lib}: skipped ({r['skipped']})")
                continue
            lines.append(f"{key} {lib}: mask/step at batch {BATCH}: batch API p50 {s.get('batch_mask_p50_us')} / p99 "
                         f"{s.get('batch_mask_p99_us')} µs, serial p50 {s.get('serial_mask_p50_us')} / p99 "
                         f"{s.get('serial_mask_p99_us')} µs; compile {s.get('compile_ms')} ms, first mask "
                         f"{s.get('first_mask_ms')} ms; new request {s.get('batch_new_request_p50_us')} µs; tokenizer info "
                         f"{(r.get('setup') or {}).get('tokenizer_info_ms')} ms; allowed/row {s.get('batch_allowed_mean')}; "
                         f"{s.get('clean_rounds')} of {s.get('rounds')} rounds clean")
        ratio = (doc.get("ratios") or {}).get(key)
        if ratio:
            lines.append(f"{key} llguidance / xgrammar: {ratio}")
    return lines


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.grammar_mask", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round of 200 steps, one tokenizer-info build (~30 s)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per library and tokenizer (default 5; quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps per timed pass (default 600; quick 200)")
    ap.add_argument("--retries", type=int, default=None, help="extra rounds when a round was disturbed (default 2; quick 0)")
    ap.add_argument("--tokenizers", default=",".join(TOKENIZERS), help=f"any of {','.join(TOKENIZERS)}")
    ap.add_argument("--libraries", default=",".join(LIBRARIES), help=f"any of {','.join(LIBRARIES)}")
    ap.add_argument("--threads", type=int, default=None, help="threads of both libraries' batch APIs (default: usable cores)")
    ap.add_argument("--info-repeats", type=int, default=None, help="tokenizer-info builds per tokenizer (default 3; quick 1)")
    ap.add_argument("--seed", type=int, default=17, help="the documents (default 17)")
    ap.add_argument("--whitespace", choices=WHITESPACE, default="compact",
                    help="compact: the server's JSON, no free whitespace (default); flexible: each library's defaults")
    ap.add_argument("--quiet-wait", type=float, default=None,
                    help="seconds to wait before each round for other processes to go quiet (default 5, 30 before the "
                         "first; quick 0)")
    ap.add_argument("--worker", choices=LIBRARIES, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(list(argv))


def settings(a: argparse.Namespace) -> dict:
    q = a.quick
    libs = [x.strip() for x in a.libraries.split(",") if x.strip()]
    toks = [x.strip() for x in a.tokenizers.split(",") if x.strip()]
    bad = [x for x in libs if x not in LIBRARIES] + [x for x in toks if x not in TOKENIZERS]
    if bad:
        raise SystemExit(f"unknown library or tokenizer {bad}")
    return {"quick": q, "libraries": libs, "tokenizers": toks, "batch": BATCH,
            "rounds": a.rounds or (1 if q else 5), "steps": a.steps or (200 if q else 600),
            "retries": a.retries if a.retries is not None else (0 if q else 2),
            "threads": a.threads or C.usable_cores(), "info_repeats": a.info_repeats or (1 if q else 3),
            "seed": a.seed, "whitespace": a.whitespace,
            "quiet_s": a.quiet_wait if a.quiet_wait is not None else (0.0 if q else 5.0),
            "start_quiet_s": a.quiet_wait if a.quiet_wait is not None else (0.0 if q else 30.0)}


def main(argv: Sequence[str] | None = None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.worker:
        worker_main(a.worker, a.threads)
        return None
    run = settings(a)
    doc = C.header(NAME, a.quick, argv)
    doc["machine"]["versions"].update(C.package_versions(("llguidance", "xgrammar", "apache-tvm-ffi", "triton")))
    doc["quiet_wait"] = C.wait_for_quiet(run["start_quiet_s"])
    total = C.CpuWindow(children=True).start()
    toks = ensure_tokenizers(run["tokenizers"])
    texts = document_texts(BATCH, run["seed"], run["whitespace"])
    schema = json.dumps(SCHEMA)
    doc["setup"] = {**run, "schema": SCHEMA, "server_library": SERVER_LIBRARY, "server_reason": SERVER_REASON,
                    "documents": {"n": len(texts), "styles": document_styles(len(texts), run["whitespace"]),
                                  "chars": [len(t) for t in texts], "texts": texts},
                    "tokenizers": toks,
                    "apis": {"llguidance": {"tokenizer_info": "llguidance.hf.from_tokenizer(hf, n_vocab=V)",
                                            "compile": "LLMatcher(tok, LLMatcher.grammar_from_json_schema(schema))",
                                            "new_request": "start_state.deep_copy() (the server's way: compiled once, "
                                                           "first mask computed, then copied per request)",
                                            "batch": "llguidance.numpy.fill_next_token_bitmask_par(LLExecutor(threads), "
                                                     "...) + consume_token_par",
                                            "serial": "llguidance.numpy.fill_next_token_bitmask per row + consume_token"},
                             "xgrammar": {"tokenizer_info": "TokenizerInfo.from_huggingface(hf, vocab_size=V)",
                                          "compile": "GrammarCompiler(info, cache_enabled=False).compile_json_schema(schema)",
                                          "new_request": "GrammarMatcher(compiler.compile_json_schema(schema)) "
                                                         "(compiler cache on: a hit)",
                                          "batch": "BatchGrammarMatcher(threads).batch_fill_next_token_bitmask + "
                                                   "BatchGrammarMatcher.batch_accept_token",
                                          "serial": "GrammarMatcher.fill_next_token_bitmask per row + accept_token"}},
                    "json_options": {"llguidance": json.loads(llguidance_schema("{}", run["whitespace"])),
                                     "xgrammar": xgrammar_options(run["whitespace"])},
                    "how": ("each library in its own worker process; rounds alternate between the workers, first side "
                            "rotating; per round: a cold compile, then a timed pass per way; medians over rounds")}
    doc["install"] = install_weight()
    doc["decode_step"] = decode_step_context(a.quick)
    doc["results"] = {}
    doc["ratios"] = {}
    procs: dict[str, LibProcess] = {}
    skipped = {lib: "not installed (the `bench` extra has it)" for lib in run["libraries"] if not available(lib)}
    try:
        for lib in run["libraries"]:
            if lib in skipped:
                C.log(f"{lib}: not installed, skipped")
                continue
            C.log(f"starting the {lib} worker ...")
            procs[lib] = LibProcess(lib, run["threads"])
        for p in procs.values():
            p.window_pids = [q.pid for q in procs.values()]
        doc["setup"]["workers"] = {lib: p.hello for lib, p in procs.items()}
        for key, t in toks.items():
            trajs, tinfo = trajectories(t["path"], texts)
            t.update(tinfo)
            res: dict[str, dict] = {lib: {"skipped": why} for lib, why in skipped.items()}
            order = list(procs)
            k = run["tokenizers"].index(key) % max(1, len(order))
            for lib in order[k:] + order[:k]:
                p = procs[lib]
                C.log(f"{key}: {lib} tokenizer info ({run['info_repeats']}x) and trajectory check ...")
                setup = p.call("setup", key=key, path=t["path"], vocab_size=t["vocab_size"], repeats=run["info_repeats"])
                load = p.call("load", key=key, schema=schema, trajectories=trajs, whitespace=run["whitespace"])
                C.log(f"  tokenizer info {setup['tokenizer_info_ms']} ms; {load['tokens_checked']} tokens checked, "
                      f"{load['rejected']} rejected")
                res[lib] = {"setup": setup, "load": load}
            sides = {lib: functools.partial(_round, p, key, itertools.cycle([list(MODES), list(reversed(MODES))]),
                                            run["steps"]) for lib, p in procs.items()}
            runs = C.run_pairs(sides, run["rounds"], run["retries"], label=key, quiet_s=run["quiet_s"])
            for lib, rounds in runs.items():
                res[lib]["rounds"] = [{k: v for k, v in r.items() if k != "headline"} for r in rounds]
                res[lib]["summary"] = summarize_rounds(rounds)
            if "llguidance" in runs and "xgrammar" in runs:
                doc["ratios"][key] = compare(res["llguidance"]["summary"], res["xgrammar"]["summary"])
                doc["ratios"][key]["batch_mask_p50_paired"] = C.paired_summary(
                    [{**flat_round(r), "clean": r.get("clean")} for r in runs["llguidance"]],
                    [{**flat_round(r), "clean": r.get("clean")} for r in runs["xgrammar"]], "batch_mask_p50_us")
            doc["results"][key] = res
        doc["process_isolation"] = {lib: p.call("isolation") for lib, p in procs.items()}
    finally:
        for p in procs.values():
            p.close()
    doc["cpu"] = total.stop()
    for line in report_lines(doc):
        C.log(line)
    return C.finish(doc, NAME, a.quick)


if __name__ == "__main__":
    main()
