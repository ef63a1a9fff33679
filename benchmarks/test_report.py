"""Run the test suite and record what the README says about it, into results/tests.json.

Runs `python -m pytest -q [ARGS]` from the repository root (ARGS by default `-n 2`, the README's
test command: two xdist workers; output streams to stderr), times
it, and parses pytest's final summary line ("380 passed, 2 skipped in 567.89s (0:09:27)")
into counts. --empty-cache runs it on a fresh temporary XDG_CACHE_HOME (no compiled XLA
programs or CPU kernels yet: the first run on a fresh clone); by default the user's cache is
used. The JSON also names the commit (and whether the tree had changes) that was tested.

Run:  python -m benchmarks.test_report [--quick] [--empty-cache] [-- PYTEST ARGS]
      (--quick runs one small test file; its result goes to tests_quick.json)
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C

NAME = "tests"
QUICK_ARGS = ["tests/unit/test_protos.py"]
DEFAULT_ARGS = ["-n", "2"]          # the README's test command (and .ci/run's)
_COUNT_RE = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|warnings?|deselected|rerun)")
_TIME_RE = re.compile(r" in ([\d.]+)s")


def parse_summary(line: str) -> dict:
    """Counts and seconds from pytest's last line; every known outcome present, 0 when absent.

    '1 failed, 378 passed, 2 skipped, 3 warnings in 567.89s (0:09:27)' ->
    {'passed': 378, 'failed': 1, 'skipped': 2, 'errors': 0, ..., 'warnings': 3, 'pytest_seconds': 567.89}
    """
    text = line.strip().strip("=").strip()
    out: dict = {k: 0 for k in ("passed", "failed", "skipped", "errors", "xfailed", "xpassed", "warnings",
                                "deselected")}
    for n, kind in _COUNT_RE.findall(text):
        key = {"error": "errors", "warning": "warnings"}.get(kind, kind)
        out[key] = out.get(key, 0) + int(n)
    m = _TIME_RE.search(text)
    out["pytest_seconds"] = float(m.group(1)) if m else None
    return out


def summary_line(output: str) -> str | None:
    """pytest's final summary line: the last line with ' in N s' and an outcome count."""
    for line in reversed(output.splitlines()):
        if _TIME_RE.search(line) and _COUNT_RE.search(line):
            return line.strip()
    return None


def git_state() -> dict:
    """The commit tested and whether the working tree differed from it."""
    def git(*args: str) -> str:
        p = subprocess.run(["git", *args], cwd=C.REPO_ROOT, capture_output=True, text=True, check=False)
        return p.stdout.strip()
    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain"))}


def run_pytest(args: Sequence[str], env: dict) -> tuple[int, str, float]:
    """pytest in a subprocess; its output goes through to stderr and is kept for parsing."""
    cmd = [sys.executable, "-m", "pytest", "-q", *args]
    C.log("$ " + " ".join(cmd[1:]))
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=C.REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    assert p.stdout
    for line in p.stdout:
        sys.stderr.write(line)
        lines.append(line)
    code = p.wait()
    return code, "".join(lines), time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.test_report", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"run only {' '.join(QUICK_ARGS)} (checks the parsing)")
    ap.add_argument("--empty-cache", action="store_true", help="run on a fresh temporary XDG_CACHE_HOME")
    ap.add_argument("pytest_args", nargs="*", help="passed to pytest instead of -n 2 (put them after --)")
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    args = a.pytest_args or (QUICK_ARGS if a.quick else DEFAULT_ARGS)
    doc = C.header(NAME, a.quick, sys.argv[1:] if argv is None else argv)
    doc["git"] = git_state()
    cache = tempfile.mkdtemp(prefix="xlaserve-test-cache-") if a.empty_cache else None
    env = dict(os.environ, **({"XDG_CACHE_HOME": cache} if cache else {}))
    total = C.CpuWindow(children=True).start()     # pytest is a child, reaped before stop()
    try:
        code, output, wall = run_pytest(args, env)
    finally:
        if cache:
            shutil.rmtree(cache, ignore_errors=True)
    line = summary_line(output)
    doc["setup"] = {"command": "python -m pytest -q " + " ".join(args),
                    "cache": "empty (fresh temporary XDG_CACHE_HOME)" if cache else "the user's XDG cache"}
    doc["exit_code"] = code
    doc["summary_line"] = line
    doc["counts"] = parse_summary(line) if line else None
    doc["wall_s"] = C.rnd(wall, 1)
    doc["cpu"] = total.stop()
    doc["ok"] = code == 0 and bool(doc["counts"]) and doc["counts"]["failed"] == 0 and doc["counts"]["errors"] == 0
    return C.finish(doc, NAME, a.quick)


if __name__ == "__main__":
    main()
