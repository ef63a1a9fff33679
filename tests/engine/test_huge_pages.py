"""jax_engine/executor/huge_pages.py: the weights' buffers are collapsed onto 2 MiB pages where
Linux allows it, their contents and addresses unchanged, and small arrays are left alone."""
from __future__ import annotations

import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jax_engine.executor import huge_pages as H


def _anon_huge_kib(lo: int, hi: int) -> int:
    """AnonHugePages of the mappings that overlap [lo, hi) (from /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a < hi and b > lo
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


def test_small_arrays_are_left_alone():
    r = H.advise([jnp.ones((16, 16), jnp.float32), np.ones(1 << 22, np.float32)])   # numpy: not a jax.Array
    assert r == H.HugePageReport(0, 0, 0, "")


@pytest.mark.skipif(not sys.platform.startswith("linux") or H.thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages unavailable here")
def test_large_weights_land_on_huge_pages_unchanged():
    w = jnp.asarray(np.random.default_rng(0).standard_normal((3, 1024, 1024), dtype=np.float32))   # 12 MiB
    before = np.asarray(w).copy()
    ptr = w.unsafe_buffer_pointer()
    r = H.advise([w])
    lo, hi = -(-ptr // H.HUGE) * H.HUGE, (ptr + w.nbytes) // H.HUGE * H.HUGE
    assert r.arrays == 1 and r.bytes_tried == hi - lo >= 8 << 20
    if r.error:                        # e.g. a kernel before 6.1 (no MADV_COLLAPSE): reported, nothing changed
        pytest.skip(f"the kernel refused: {r.error}")
    assert r.bytes_collapsed == r.bytes_tried
    assert _anon_huge_kib(lo, hi) * 1024 >= hi - lo
    assert w.unsafe_buffer_pointer() == ptr
    np.testing.assert_array_equal(np.asarray(w), before)


def test_flag_reaches_the_runner(tmp_path, demo_generator_path):
    from frontends.cli import engine_args, parse_serve_args
    from jax_engine.config import ModelSpec
    from jax_engine.engine import Engine
    from tests.helpers.engines import small_args

    assert engine_args(parse_serve_args(["--model", f"m={tmp_path}"])).huge_pages is True
    assert engine_args(parse_serve_args(["--model", f"m={tmp_path}", "--huge-pages", "off"])).huge_pages is False
    for on in (True, False):
        eng = Engine(small_args(models=[ModelSpec(name="m", path=demo_generator_path)], huge_pages=on))
        eng.load_all(progress=False, warmup=False)
        report = eng.worker("m").replicas[0].runner.huge_pages
        eng.shutdown()
        if not on:
            assert report is None
        else:       # the demo model's weights: every array of >= 4 MiB tried (the embedding table at least)
            assert report is not None and report.arrays >= 1 and report.bytes_tried > 0
