"""The order the suite's modules are handed to the README's two xdist workers.

`python -m pytest -q -n 2` runs one module per work unit (pyproject's addopts: --dist loadfile
--no-loadscope-reorder), handed out in collection order, which tests/conftest.py sorts by
`module_rank`: the longest modules first, so that neither worker is left alone with a long one at
the end. xdist's own order (most tests first) put these single-fixture modules last: in an
empty-cache run the last 7 % of the tests took ~6 of its 22.4 minutes.
"""
from __future__ import annotations

# Seconds: the module's setups and calls among the 60 slowest of that empty-cache run on two
# workers (pytest --durations=60, 2-vCPU Zen 3); the device check alone, at LLVM level 0: 91 s.
SLOW_FIRST = (
    "tests/engine/test_speculative.py",         # 186 s
    "tests/engine/test_lora.py",                # 142
    "tests/engine/test_decoder.py",             # 142
    "tests/e2e/test_model_zoo_served.py",       # 141
    "tests/engine/test_parallel.py",            # 112
    "tests/engine/test_multihost.py",           # 104
    "tests/engine/test_scheduler.py",           # 95
    "tests/e2e/test_device_check.py",           # 91
    "tests/engine/test_moe_parallel.py",        # 89
    "tests/engine/test_weights.py",             # 88
    "tests/engine/test_cpu_kernels.py",         # 83
    "tests/e2e/test_cli_e2e.py",                # 51
)
_RANK = {path: i for i, path in enumerate(SLOW_FIRST)}


def module_rank(nodeid: str) -> int:
    """A test's place in the hand-out order: its module's index in SLOW_FIRST, else after them all."""
    return _RANK.get(nodeid.split("::")[0], len(SLOW_FIRST))
