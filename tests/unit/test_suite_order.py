"""The suite's hand-out order for the README's two xdist workers (tests/helpers/order.py): the
listed modules exist, collection puts them first in their listed order, and xdist is told to keep
that order and hand out whole modules."""
from __future__ import annotations

import os
import subprocess
import sys

import tomllib

from tests.helpers.order import SLOW_FIRST

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/<layer>/ -> repo


def test_every_listed_module_exists():
    for path in SLOW_FIRST:
        assert os.path.isfile(os.path.join(REPO, path)), f"{path} is listed in tests/helpers/order.py but gone"


def test_collection_puts_the_longest_modules_first():
    # given last-first on the command line: the hook must reorder them
    args = ["tests/unit/test_protos.py", "tests/e2e/test_cli_e2e.py", "tests/engine/test_speculative.py"]
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    modules: list[str] = []
    for line in p.stdout.splitlines():
        if "::" in line and line.split("::")[0] not in modules:
            modules.append(line.split("::")[0])
    assert modules == ["tests/engine/test_speculative.py", "tests/e2e/test_cli_e2e.py", "tests/unit/test_protos.py"]


def test_xdist_hands_out_whole_modules_in_collection_order():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        addopts = tomllib.load(f)["tool"]["pytest"]["ini_options"]["addopts"].split()
    assert "--no-loadscope-reorder" in addopts
    assert addopts[addopts.index("--dist") + 1] == "loadfile"
