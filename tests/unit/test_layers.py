"""The layering rules, checked on the source: every import (module-level and function-local)
of every module under jax_engine/, frontends/ and weights_convert/ is read with `ast`.

- the engine (`jax_engine`) never imports the offline tool (`weights_convert`) or a front;
- no import circle exists between modules;
- the fronts (frontends/grpc, frontends/http, frontends/common) reach the engine only through
  `jax_engine.api`, `jax_engine.types` and `jax_engine.errors`;
- no file under tests/ (or benchmarks/) imports a test module (`tests...test_*`) or `tests.conftest`:
  what test files share lives in tests/helpers/.
"""
from __future__ import annotations

import ast
import os
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/<layer>/ -> repo
PACKAGES = ("jax_engine", "frontends", "weights_convert")
FRONTS = ("frontends.grpc", "frontends.http", "frontends.common")
FRONT_MAY_IMPORT = ("jax_engine.api", "jax_engine.types", "jax_engine.errors")


def _modules() -> dict[str, str]:
    """Dotted module name -> file path, for every .py file of PACKAGES."""
    out = {}
    for pkg in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(ROOT, pkg)):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
            for fn in sorted(files):
                if not fn.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(folder, fn), ROOT)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(folder, fn)
    return out


MODULES = _modules()


def _target(name: str) -> Optional[str]:
    """The module an import of `name` loads (itself, or its nearest known parent), if ours."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imported_names(tree: ast.AST, module: str, is_pkg: bool) -> list[tuple[str, str]]:
    """(base, base.name) of every import anywhere in `tree`, relative imports resolved against
    `module`; for `import a.b` both are "a.b"."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                parts = parts if is_pkg else parts[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            out += [(base, f"{base}.{a.name}") for a in node.names]
    return out


def _imports(module: str, path: str) -> set[str]:
    """Every module of ours that `module` imports, anywhere in its file."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out: set[str] = set()
    # `from pkg import sub` imports pkg.sub when that is a module, else a name of pkg
    names = [full if full in MODULES else base for base, full in _imported_names(tree, module, path.endswith("__init__.py"))]
    for n in names:
        t = _target(n)
        if t is not None and t != module:
            out.add(t)
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_walk_sees_the_packages():
    assert {"jax_engine.engine", "frontends.cli", "weights_convert.convert"} <= set(MODULES)
    assert "jax_engine.config" in GRAPH["jax_engine.engine"]


def test_the_engine_imports_neither_the_converter_nor_a_front():
    bad = sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if _in(m, "jax_engine")
                 for t in ts if _in(t, "weights_convert") or _in(t, "frontends"))
    assert not bad, "jax_engine must not import weights_convert or frontends:\n" + "\n".join(bad)


def test_no_import_circles():
    cycles = _cycles(GRAPH)
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _front_violations() -> list[str]:
    return sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if any(_in(m, f) for f in FRONTS)
                  for t in ts if _in(t, "jax_engine") and t not in FRONT_MAY_IMPORT)


def test_fronts_reach_the_engine_only_through_its_api():
    bad = _front_violations()
    assert not bad, ("fronts may import only " + ", ".join(FRONT_MAY_IMPORT) + " of the engine:\n"
                     + "\n".join(bad))


def test_the_old_circle_is_gone():
    # engine -> generate_worker -> multihost -> engine, before the channel was passed down
    assert "jax_engine.executor.multihost" in GRAPH["jax_engine.decode.worker"]
    assert "jax_engine.engine" not in GRAPH["jax_engine.executor.multihost"]


# ---------------------------------------------------------------------------------- the tests' own rule
TEST_IMPORT_SCAN = ("tests", "benchmarks")


def _test_module_imports(source: str, module: str, is_pkg: bool = False) -> list[str]:
    """Modules `tests.<...>.test_*` or `tests.conftest` (or names of that form) that `source` imports."""
    out = []
    for _, name in _imported_names(ast.parse(source), module, is_pkg):
        parts = name.split(".")
        if parts[0] == "tests" and any(p == "conftest" or p.startswith("test_") for p in parts[1:]):
            out.append(name)
    return out


def test_no_test_file_imports_another_test_file_or_conftest():
    bad, seen = [], 0
    for top in TEST_IMPORT_SCAN:
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
            for fn in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, fn)
                rel = os.path.relpath(path, ROOT)
                module = rel[:-3].replace(os.sep, ".")
                with open(path) as f:
                    found = _test_module_imports(f.read(), module, fn == "__init__.py")
                seen += fn.startswith("test_")
                bad += [f"{rel} -> {name}" for name in found]
    assert seen > 20, "the walk found no test files"
    assert not bad, "import shared code from tests/helpers/, not from test files or conftest:\n" + "\n".join(bad)


def test_the_test_import_check_finds_each_form():
    src = ("from tests.engine.test_decoder import PROMPTS\nimport tests.conftest\nfrom tests import test_encoder as T\n"
           "from .test_mirror import x\nfrom tests.conftest import GEN\n"
           "from tests.helpers.shared import GEN\nfrom benchmarks.test_report import parse_summary\n")
    assert _test_module_imports(src, "tests.frontends.test_x") == [
        "tests.engine.test_decoder.PROMPTS", "tests.conftest", "tests.test_encoder", "tests.frontends.test_mirror.x",
        "tests.conftest.GEN"]
