"""Shared pieces of the benchmarks: corpus, timing, machine-limit probes, CPU accounting, output.

Rules every benchmark follows (this machine is small and shared):
  * A and B run in the same time window, alternating, and the figures are medians over
    repeats; ratios come from the same run, never from stored numbers.
  * Each side runs in its own process: the JAX engine in the script's process (torch blocked
    there), every torch peer in a benchmarks/peer_worker.py subprocess (jax blocked there), so
    neither framework's thread pool slows the other. CPU windows count both processes.
  * A peer is configured the way its users run it (sentence-transformers encodes the whole
    corpus in one call and sorts it itself), and every ratio names the peer's dtype.
  * Every result records how much of the 2 cores this process got and how busy everything
    else was (``cpu`` block); a run where others took a noticeable share is flagged
    ``disturbed`` and should be repeated before anyone draws conclusions from it.
  * One JSON document per script goes to stdout and to ``benchmarks/results/<name>.json``
    (``<name>_quick.json`` in --quick mode, so a smoke run never overwrites real numbers).
"""
from __future__ import annotations

import json
import math
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_CORES = os.cpu_count() or 1
# "others used more than this share of the cores during the run" marks a run as disturbed
DISTURBED_OTHERS_SHARE = 0.10

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask), the thread count a peer is given."""
    try:
        return len(os.sched_getaffinity(0)) or NUM_CORES
    except (AttributeError, OSError):
        return NUM_CORES


def bench_cache_root() -> str:
    """Where the benchmarks keep what they build once: random models, GGUF and ONNX files, the
    llama.cpp converter (``$XDG_CACHE_HOME/xlaserve/bench-models``, default ~/.cache/...)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "xlaserve", "bench-models")


def log(*parts: Any) -> None:
    """Progress goes to stderr; stdout carries only the JSON document."""
    print(*parts, file=sys.stderr, flush=True)


# =============================================================================================
# corpus
# =============================================================================================
# Ordinary English words, so word-piece tokenizers see realistic text (about one token per
# word for MiniLM's vocabulary). The list is part of the benchmark definition: do not reorder.
WORDS = """
the of and to in is was for on that with as by at from his her are were be this which have
or one had not but what all when we there can an your will each about how up out them then she
many some so these would other into has more two like him see time could no make than first
been its who now people my made over did down only way find use may water long little very after
words called just where most know get through back much before go good new write our used me
man too any day same right look think also around another came come work three word must because
does part even place well such here take why things help put years different away again off went
old number great tell men say small every found still between name should home big give air line
set own under read last never us left end along while might next sound below saw something thought
both few those always looked show large often together asked house world going want school
important until form food keep children feet land side without boy once animals life enough took
sometimes four head above kind began almost live page got earth need far hand high year mother
light parts country father let night following picture being study second eyes soon times story
boys since white days ever paper hard near sentence better best across during today others sure
means knew its try told young miles sun ways thing whole hear example heard several change answer
room sea against top turned learn point city play toward five using himself usually money seen
car morning given body family later turn move face door cut done group true leave color red friends
easy early open behind river order am ready building map mountains certain reached bread problem
piece weather bright market train garden morning kitchen window table chair doctor music quiet
""".split()  # noqa: SIM905 -- one readable block; the order is part of the benchmark


def make_corpus(n: int = 2000, seed: int = 1234, min_words: int = 8, max_words: int = 60) -> list[str]:
    """`n` deterministic sentences of min_words..max_words words drawn from WORDS."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(min_words, max_words)
        words = [rng.choice(WORDS) for _ in range(k)]
        words[0] = words[0].capitalize()
        out.append(" ".join(words) + ".")
    return out


# =============================================================================================
# statistics and timing
# =============================================================================================
def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; nan for an empty list."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median(xs: Iterable[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


def summarize(xs: Sequence[float], scale: float = 1.0, digits: int = 3) -> dict[str, float]:
    """p50/p90/p99/mean/min/max of xs (times `scale`, e.g. 1e3 for seconds -> ms)."""
    if not xs:
        return {"n": 0}
    ys = [x * scale for x in xs]
    return {"n": len(ys), "p50": rnd(percentile(ys, 50), digits), "p90": rnd(percentile(ys, 90), digits),
            "p99": rnd(percentile(ys, 99), digits), "mean": rnd(sum(ys) / len(ys), digits),
            "min": rnd(min(ys), digits), "max": rnd(max(ys), digits)}


def rnd(x: float | None, digits: int = 3) -> float | None:
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return None
    return round(float(x), digits)


def fmt(x: Any, spec: str = "{:.1f}") -> str:
    """A README table cell: `spec` applied, "–" for a missing value."""
    if x is None:
        return "–"
    try:
        return spec.format(x)
    except (TypeError, ValueError):
        return str(x)


def fmt_ratio(r: Any) -> str:
    return "–" if r is None else f"**{r:.2f}×**"


def fmt_met(t: dict | None) -> str:
    """✅ / ❌ for a {"met": bool} target record, "–" when there is none."""
    if not t or t.get("met") is None:
        return "–"
    return "✅" if t["met"] else "❌"


def cpu_line(doc: dict) -> str:
    """"cpu share X, others Y" of a results file's whole run (the README headings), flagged when disturbed."""
    c = doc.get("cpu") or {}
    flag = " **(disturbed)**" if c.get("disturbed") else ""
    return f"cpu share {c.get('cpu_share_of_cores')}, others {c.get('others_share_of_cores')}{flag}"


def source_line(name: str, quick: bool, doc: dict) -> str:
    """The line under every README heading: the results file, when it was written, and the host."""
    path = os.path.relpath(result_path(name, quick), REPO_ROOT)
    return (f"_Source: `{path}` ({doc.get('finished') or doc.get('started')}). "
            f"{host_line(doc.get('machine'), doc.get('limits'))}_")


def fmt_spread(d: dict | None) -> str:
    """"min / median / max" of a summary dict (e.g. tokens per row), "–" when absent."""
    if not d:
        return "–"
    return f"{fmt(d.get('min'), '{:g}')} / {fmt(d.get('median'), '{:g}')} / {fmt(d.get('max'), '{:g}')}"


def prefix_match(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two greedy sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def ratio(a: float | None, b: float | None, digits: int = 3) -> float | None:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return round(a / b, digits)


def run_pairs(sides: dict[str, Callable[[], dict]], repeats: int, retries: int = 0, label: str = "",
              first: int = 0, quiet_s: float = 0.0) -> dict[str, list[dict]]:
    """Run every side `repeats` times, alternating who goes first; each call returns a dict
    with a `cpu` block (from cpu_window). A round in which any side was disturbed is run again,
    up to `retries` extra rounds in all; every round is kept and marked `clean` or not.
    Before each round, wait up to `quiet_s` seconds for other processes to go quiet."""
    names = list(sides)
    out: dict[str, list[dict]] = {n: [] for n in names}
    clean_rounds, r = 0, 0
    while r < repeats + retries and not (r >= repeats and clean_rounds >= repeats):
        settle(quiet_s)
        k = (r + first) % len(names)
        got = {}
        for n in names[k:] + names[:k]:
            res = sides[n]()
            got[n] = res
            log(f"  {label} round {r + 1} {n}: {res.get('headline', '')} cpu {res['cpu']['cpu_share_of_cores']}"
                f" others {res['cpu']['others_share_of_cores']}{' DISTURBED' if res['cpu']['disturbed'] else ''}")
        clean = not any(g["cpu"]["disturbed"] for g in got.values())
        for n in names:
            got[n]["round"] = r
            got[n]["clean"] = clean
            out[n].append(got[n])
        clean_rounds += clean
        r += 1
    return out


def paired_summary(a: list[dict], b: list[dict], key: str, digits: int = 2) -> dict:
    """Medians of `key` over all rounds and over clean rounds, and the ratios a / b."""
    def med(runs: list[dict]) -> float | None:
        return rnd(median(x[key] for x in runs if x.get(key) is not None), digits)

    ca = [x for x in a if x.get("clean")]
    cb = [x for x in b if x.get("clean")]
    out = {"a": med(a), "b": med(b), "ratio": ratio(med(a), med(b)),
           "a_clean": med(ca) if ca else None, "b_clean": med(cb) if cb else None,
           "ratio_clean": ratio(med(ca), med(cb)) if ca and cb else None,
           "rounds": len(a), "clean_rounds": len(ca),
           "paired_ratios": [ratio(x.get(key), y.get(key)) for x, y in zip(a, b)]}
    # the figure to quote: clean rounds when there are any, else everything (flagged)
    out["best"] = out["ratio_clean"] if out["ratio_clean"] is not None else out["ratio"]
    return out


# =============================================================================================
# CPU accounting: how much of the machine we got, and how much others took
# =============================================================================================
def _proc_stat_busy() -> tuple[float, float]:
    """(busy seconds of all CPUs, steal seconds) from /proc/stat; (nan, nan) where unavailable."""
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()[1:]
        v = [int(x) for x in parts]
        tick = os.sysconf("SC_CLK_TCK")
        user, nice, system, _idle, _iowait, irq, softirq = v[:7]
        steal = v[7] if len(v) > 7 else 0
        return (user + nice + system + irq + softirq) / tick, steal / tick
    except (OSError, ValueError, IndexError):
        return float("nan"), float("nan")


def pid_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads, plus reaped children) from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
        fields = data[data.rindex(")") + 2:].split()
        tick = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / tick
    except (OSError, ValueError, IndexError):
        return float("nan")


def _self_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@dataclass
class CpuWindow:
    """CPU use over a stretch of wall time: ours (this process + `pids`) against everyone's.

    cpu_share_of_cores: our CPU seconds / (wall x cores); 1.0 = we had both cores all along.
    others_share_of_cores: everything else that ran (other processes, the kernel for them).
    steal_share_of_cores: time the hypervisor gave our vCPUs to someone else.
    """

    pids: list[int] = field(default_factory=list)
    children: bool = False          # count reaped child processes too (a subprocess run to its end)
    t0: float = 0.0
    ours0: float = 0.0
    busy0: float = 0.0
    steal0: float = 0.0
    load0: tuple = ()
    result: dict | None = None

    def _ours(self) -> float:
        kids = 0.0
        if self.children:
            r = resource.getrusage(resource.RUSAGE_CHILDREN)
            kids = r.ru_utime + r.ru_stime
        return _self_cpu_seconds() + kids + sum(pid_cpu_seconds(p) for p in self.pids)

    def start(self) -> CpuWindow:
        self.t0 = time.perf_counter()
        self.ours0 = self._ours()
        self.busy0, self.steal0 = _proc_stat_busy()
        self.load0 = os.getloadavg()
        return self

    def stop(self) -> dict:
        wall = max(1e-9, time.perf_counter() - self.t0)
        ours = self._ours() - self.ours0
        busy, steal = _proc_stat_busy()
        cap = wall * NUM_CORES
        others = max(0.0, (busy - self.busy0) - ours) / cap
        self.result = {
            "wall_s": rnd(wall, 2),
            "cores": NUM_CORES,
            "cpu_share_of_cores": rnd(ours / cap),
            "others_share_of_cores": rnd(others),
            "steal_share_of_cores": rnd((steal - self.steal0) / cap),
            "loadavg_start": [round(x, 2) for x in self.load0],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        }
        self.result["disturbed"] = bool(
            (self.result["others_share_of_cores"] or 0) > DISTURBED_OTHERS_SHARE
            or (self.result["steal_share_of_cores"] or 0) > DISTURBED_OTHERS_SHARE)
        return self.result


@contextmanager
def cpu_window(pids: Sequence[int] = ()) -> Iterator[CpuWindow]:
    w = CpuWindow(pids=list(pids)).start()
    try:
        yield w
    finally:
        w.stop()


def busy_processes(limit: int = 5, min_share: float = 0.05, sample_s: float = 0.5) -> list[dict]:
    """The processes (other than us) using the most CPU right now: who disturbed the run."""
    me = os.getpid()

    def snap() -> dict[int, float]:
        out = {}
        for d in os.listdir("/proc"):
            if d.isdigit() and int(d) != me:
                out[int(d)] = pid_cpu_seconds(int(d))
        return out

    try:
        a = snap()
        time.sleep(sample_s)
        b = snap()
    except OSError:
        return []
    rows = []
    for pid, t in b.items():
        if pid in a and not math.isnan(t) and not math.isnan(a[pid]):
            share = (t - a[pid]) / sample_s / NUM_CORES
            if share >= min_share:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
                except OSError:
                    cmd = "?"
                rows.append({"pid": pid, "share_of_cores": round(share, 2), "cmd": cmd})
    return sorted(rows, key=lambda r: -r["share_of_cores"])[:limit]


def settle(quiet_s: float) -> None:
    """Before a timed stretch: wait up to quiet_s seconds for other processes to go quiet (the
    threshold that marks a round disturbed), and say so when that took a while."""
    if quiet_s > 0:
        q = wait_for_quiet(quiet_s, DISTURBED_OTHERS_SHARE)
        if q["waited_s"] > 1:
            log(f"  waited {q['waited_s']}s for a quiet machine (others {q['others_share_at_start']})")


def wait_for_quiet(max_wait_s: float = 0.0, threshold: float = 0.15) -> dict:
    """Optionally wait (up to max_wait_s) until others use < threshold of the cores; report it."""
    t0 = time.time()
    while True:
        busy0, _ = _proc_stat_busy()
        ours0 = _self_cpu_seconds()
        time.sleep(0.5)
        busy1, _ = _proc_stat_busy()
        others = max(0.0, (busy1 - busy0) - (_self_cpu_seconds() - ours0)) / (0.5 * NUM_CORES)
        if others < threshold or time.time() - t0 >= max_wait_s:
            return {"waited_s": round(time.time() - t0, 1), "others_share_at_start": round(others, 3)}
        time.sleep(2.0)


# =============================================================================================
# machine
# =============================================================================================
# the instruction-set flags that decide which kernels run fast (matmul and attention paths)
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; ('?', set()) where unreadable."""
    cpu, flags = "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and cpu == "?":
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return cpu, flags


def cpu_flags() -> set[str]:
    """The CPU's flags from /proc/cpuinfo (empty where unreadable)."""
    return _cpuinfo()[1]


def cache_sizes(cpu: int = 0) -> dict[str, str]:
    """Cache sizes of one CPU from sysfs, e.g. {'L1d': '32K', 'L2': '1024K', 'L3': '32768K'}."""
    out: dict[str, str] = {}
    base = f"/sys/devices/system/cpu/cpu{cpu}/cache"
    try:
        entries = sorted(d for d in os.listdir(base) if d.startswith("index"))
    except OSError:
        return out
    for d in entries:
        try:
            def read(name: str, d: str = d) -> str:
                with open(os.path.join(base, d, name)) as f:
                    return f.read().strip()
            level, kind, size = read("level"), read("type"), read("size")
        except OSError:
            continue
        key = f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind, "")
        out[key] = size
    return out


def package_versions(names: Sequence[str] = ("jax", "jaxlib", "torch", "transformers", "sentence-transformers",
                                             "numpy", "grpcio", "tokenizers", "llama-cpp-python", "onnxruntime",
                                             "onnx")) -> dict[str, str]:
    """Installed versions from package metadata: imports nothing, so it is safe in either process."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for n in names:
        try:
            out[n] = version(n)
        except PackageNotFoundError:
            pass
    return out


def machine_info() -> dict:
    """What the README's host line needs: CPU model, relevant ISA flags, caches, cores, memory."""
    cpu, flags = _cpuinfo()
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    except (ValueError, OSError):
        mem_gib = float("nan")
    return {
        "cpu": cpu, "cores": NUM_CORES, "mem_gib": rnd(mem_gib, 1), "python": platform.python_version(),
        "isa": [f for f in ISA_FLAGS if f in flags], "isa_absent": [f for f in ISA_FLAGS if f not in flags],
        "caches": cache_sizes(), "versions": package_versions(),
    }


def host_line(machine: dict | None, limits: dict | None = None) -> str:
    """One line naming the host a table was measured on (README: beside every table)."""
    m = machine or {}
    caches = m.get("caches") or {}
    bw = (limits or {}).get("torch_sum_gbps")
    probes = (limits or {}).get("probes")
    best = f"best of {probes} probes" if probes and probes > 1 else "one probe"
    bw_text = (f"read bandwidth {bw:.1f} GB/s (torch sum, all cores, {best} in this run)"
               if bw else "read bandwidth not measured in this run")
    return (f"Host: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, L2 {caches.get('L2', '?')} per core, "
            f"flags {' '.join(m.get('isa') or []) or 'none of ' + '/'.join(ISA_FLAGS)}"
            f"{' (no ' + ', '.join(m['isa_absent']) + ')' if m.get('isa_absent') else ''}; {bw_text}.")


# =============================================================================================
# process isolation: the engine never imports torch, a peer never imports jax
# =============================================================================================
# Each framework's thread pool slows the other down when both live in one process (XLA's pool
# took transformers from 34.7 to ~24 tok/s at batch 1), so each side runs in its own process.
ENGINE_BLOCKED = ("torch",)                  # not an xlaserve dependency: deployments have none
PEER_BLOCKED = ("jax", "jaxlib", "flax")     # a torch user's process has no XLA in it


def block_modules(names: Sequence[str]) -> None:
    """Make `import name` fail (and transformers' availability checks say no) in this process.

    A None entry in sys.modules is Python's own way to mark a module unimportable;
    importlib.util.find_spec returns None for it. Modules already loaded stay loaded, and
    isolation_report() then says so."""
    for n in names:
        if n not in sys.modules:
            sys.modules[n] = None  # type: ignore[assignment]


def module_loaded(name: str) -> bool:
    return sys.modules.get(name) is not None


def isolation_report(names: Sequence[str]) -> dict:
    """For the results JSON: whether each module is loaded in this process (it must not be)."""
    return {"pid": os.getpid(), **{f"{n}_loaded": module_loaded(n) for n in names},
            "blocked": [n for n in names if n in sys.modules and sys.modules[n] is None]}


def engine_process() -> None:
    """Call first thing in a script that runs the JAX engine in-process."""
    block_modules(ENGINE_BLOCKED)


# =============================================================================================
# machine limits: probes run in the peer process (torch) and are combined over the run
# =============================================================================================
LIMIT_KEYS = ("torch_sum_gbps", "torch_matmul_fp32_gflops", "torch_matmul_bf16_gflops")


def combine_limits(probes: Sequence[dict]) -> dict:
    """The best of every probe this run made (another process can only make a probe slower).

    Each probe is the dict peer_worker.torch_limits() returns; every probe's own figures are
    kept under `probe_runs`, so a reader can see how much they varied."""
    probes = [p for p in probes if p]
    out: dict[str, Any] = {"probes": len(probes),
                           "buffer_gib": probes[0].get("buffer_gib") if probes else None,
                           "method": "bandwidth: torch sum over a buffer far larger than the caches, all cores, "
                                     "in the peer process; matmul: torch.matmul square fp32 / bf16; "
                                     "each figure is the best repeat of the best probe"}
    for key in LIMIT_KEYS:
        vals = [p[key] for p in probes if p.get(key)]
        if vals:
            out[key] = max(vals)
            out[key + "_per_probe"] = vals
    out["matmul_size"] = max((p.get("matmul_size") or 0 for p in probes), default=None) or None
    out["probe_runs"] = [{k: v for k, v in p.items() if k != "cpu"} | {"cpu": p.get("cpu")} for p in probes]
    return out


# =============================================================================================
# output
# =============================================================================================
def result_path(name: str, quick: bool, ext: str = "json") -> str:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    return os.path.join(RESULTS_DIR, f"{name}{'_quick' if quick else ''}.{ext}")


def header(name: str, quick: bool, argv: Sequence[str]) -> dict:
    return {"benchmark": name, "mode": "quick" if quick else "full",
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": list(argv), "machine": machine_info()}


def finish(doc: dict, name: str, quick: bool) -> dict:
    """Write the JSON document to results/ and print it (the script's one stdout document)."""
    doc["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    path = result_path(name, quick)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=_json_default)
        f.write("\n")
    log(f"wrote {os.path.relpath(path)}")
    print(json.dumps(doc, default=_json_default), flush=True)
    return doc


def _json_default(o: Any) -> Any:
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:
        pass
    return str(o)


def target(value: float | None, goal: float, higher_is_better: bool = True) -> dict:
    """A target check: {value, goal, met} (met None when the value is missing)."""
    met = None if value is None else (value >= goal if higher_is_better else value <= goal)
    return {"value": value, "goal": goal, "met": met}


# =============================================================================================
# plots
# =============================================================================================
def rel(path: str) -> str:
    """A path as the README (at the repository root) links it."""
    return os.path.relpath(path, REPO_ROOT)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bar_plot(path: str, title: str, groups: Sequence[str], series: dict[str, Sequence[float | None]],
             ylabel: str, note: str = "") -> str:
    """Grouped bars: one group per x label, one bar per series."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    k = max(1, len(series))
    width = 0.8 / k
    for i, (label, vals) in enumerate(series.items()):
        xs = [g + (i - (k - 1) / 2) * width for g in range(len(groups))]
        ys = [v if v is not None else 0.0 for v in vals]
        bars = ax.bar(xs, ys, width, label=label)
        for b, v in zip(bars, vals):
            if v is not None:
                ax.annotate(f"{v:.3g}", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save_figure(plt, fig, path, note)


def line_plot(path: str, title: str, series: dict[str, tuple[Sequence[float], Sequence[float | None]]],
              xlabel: str, ylabel: str, logy: bool = False, note: str = "") -> str:
    """One line per series; series maps label -> (xs, ys)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for label, (xs, ys) in series.items():
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save_figure(plt, fig, path, note)


# =============================================================================================
# engine helpers (in-process xlaserve engine)
# =============================================================================================
def compile_counts(engine) -> dict:
    """The engine's own counter (programs compiled after warmup) and JAX's process-wide count."""
    from jax_engine.executor.compilation import global_compile_count

    return {"engine_after_warmup": engine.compilations_after_warmup(), "jax_process_total": global_compile_count()}


def build_engine(specs: list, progress: bool = False, **engine_kw):
    """Construct, load and warm an Engine; returns (engine, seconds spent)."""
    from jax_engine import heap
    from jax_engine.config import EngineArgs
    from jax_engine.engine import Engine

    os.environ.setdefault("XLASERVE_PROGRESS", "1" if progress else "0")
    t0 = time.perf_counter()
    engine = Engine(EngineArgs(models=specs, **engine_kw))
    engine.load_all(progress=progress)
    heap.freeze()                      # as the server does once its models are warm
    return engine, time.perf_counter() - t0


def _save_figure(plt, fig, path: str, note: str) -> str:
    """Footnote, layout, PNG, close: the common end of every plot."""
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, alpha=0.7)
    fig.tight_layout(rect=(0, 0.03 if note else 0, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"wrote {os.path.relpath(path)}")
    return path


def add_round_args(ap) -> None:
    """The --quiet-wait / --no-plot options every benchmark script shares."""
    ap.add_argument("--quiet-wait", type=float, default=None,
                    help="seconds to wait before each round for other processes to go quiet (default 60; quick 0)")
    ap.add_argument("--no-plot", action="store_true")


def quiet_seconds(a) -> float:
    return a.quiet_wait if a.quiet_wait is not None else (0.0 if a.quick else 60.0)


def wait_or_kill(proc: subprocess.Popen, grace_s: float = 30.0) -> int | None:
    """The exit code of a process already asked to stop, killed if it takes over grace_s."""
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    return proc.returncode


def serve_command(args: Sequence[str], block_torch: bool = True) -> list[str]:
    """argv that runs `xlaserve serve ARGS` in a subprocess.

    With block_torch (the default) torch is made unimportable there first: it is not an
    xlaserve dependency, so a deployment has none, while this venv has it for the peers (and
    transformers would import it while loading a tokenizer)."""
    if not block_torch:
        return [sys.executable, "-m", "frontends.cli", "serve", *args]
    code = ("import sys; sys.modules['torch'] = None; from frontends.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    return [sys.executable, "-c", code, "serve", *args]
