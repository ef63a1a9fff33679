"""The store of serialized programs (jax_engine/executor/program_store.py): a second engine with the
same configuration loads every program instead of tracing and compiling it and serves the same
tokens; a damaged file is compiled again; anything that decides a program is in its key."""
from __future__ import annotations

import dataclasses
import os

from jax_engine.engine import Engine
from jax_engine.executor import program_store
from jax_engine.kernels.plan import UNBOUNDED, MatmulPlan, Timing
from tests.helpers.engines import PROMPTS, greedy_all, small_args


def _engine(path: str, cache: str, **kw) -> Engine:
    from jax_engine.config import ModelSpec

    eng = Engine(small_args(models=[ModelSpec(name="m", path=path)], compile_cache_dir=cache, cpu_matmul="xla",
                                burst_batched_tokens=0, **kw))
    eng.load_all(progress=False)
    return eng


def test_second_engine_loads_every_program_and_serves_the_same_tokens(demo_generator_path, tmp_path, server_loop):
    cache = str(tmp_path / "cache")
    first = _engine(demo_generator_path, cache)
    try:
        r1 = first.worker("m").replicas[0].runner
        assert r1.programs.loaded_from_store == 0
        saved = len(os.listdir(os.path.join(cache, "xlaserve-programs")))
        assert saved == len(r1.programs)
        want = server_loop.run(greedy_all(first, PROMPTS, 6))
    finally:
        first.shutdown()

    second = _engine(demo_generator_path, cache)
    try:
        r2 = second.worker("m").replicas[0].runner
        # every program came from the store: none was traced, lowered or compiled
        assert r2.programs.loaded_from_store == len(r2.programs) == saved
        got = server_loop.run(greedy_all(second, PROMPTS, 6))
        assert got == want
        assert r2.programs.compilations_after_warmup == 0
        assert not r2.state_lost()       # donated state is handed back as before
    finally:
        second.shutdown()

    # a damaged file is ignored (with a warning) and its program compiled again
    store_dir = os.path.join(cache, "xlaserve-programs")
    for name in os.listdir(store_dir):
        with open(os.path.join(store_dir, name), "wb") as f:
            f.write(b"not a program")
    third = _engine(demo_generator_path, cache)
    try:
        r3 = third.worker("m").replicas[0].runner
        assert r3.programs.loaded_from_store == 0 and len(r3.programs) == saved
        assert server_loop.run(greedy_all(third, PROMPTS, 6)) == want
    finally:
        third.shutdown()


def test_off_by_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("XLASERVE_PROGRAM_STORE", "0")
    assert program_store.configure(str(tmp_path)) is None
    monkeypatch.delenv("XLASERVE_PROGRAM_STORE")
    assert program_store.configure(str(tmp_path)) is not None


def test_key_covers_what_decides_a_program(tmp_path):
    import numpy as np

    store = program_store.ProgramStore(str(tmp_path))
    args = (np.zeros((4, 8), np.int32), np.zeros((4,), np.float32))
    base = store.key("ctx", "step", (16, 2), args)
    assert store.key("ctx", "step", (16, 2), args) == base
    assert store.key("ctx2", "step", (16, 2), args) != base
    assert store.key("ctx", "copy_page", (16, 2), args) != base
    assert store.key("ctx", "step", (16, 4), args) != base
    assert store.key("ctx", "step", (16, 2), (args[0], args[1].astype(np.float16))) != base
    assert store.key("ctx", "step", (16, 2), (args[0][:2], args[1])) != base
    assert store.key("ctx", "step", (16, 2), (args,)) != base


def test_stable_repr_ignores_measurements_but_not_routes():
    t = Timing(weight="wq", m=1, shape_class="gemv", xla_s=1.0, kernel_s=2.0)
    plan = MatmulPlan(routes=(("wq", ((UNBOUNDED, "xla"),)),), decode_rows=8, timings=(t,))
    same = dataclasses.replace(plan, timings=(), source="cached")
    other = dataclasses.replace(plan, routes=(("wq", ((UNBOUNDED, "kernel"),)),))
    r = program_store.stable_repr
    assert r(plan) == r(same)
    assert r(plan) != r(other)
    assert r({"b": 1, "a": 2}) == r({"a": 2, "b": 1})
    assert "0x" not in r(test_stable_repr_ignores_measurements_but_not_routes)
    assert r(plan) != r(dataclasses.replace(plan, decode_rows=16))


_KERNEL_SCRIPT = """
import json, sys
import jax, numpy as np
from jax_engine.executor import program_store
from jax_engine.executor.compilation import ProgramCache
from jax_engine.kernels import cpu as K
program_store.configure(sys.argv[1])
pc = ProgramCache("t", context="a program calling the engine's own FFI target")
pc.register("attn", jax.jit(lambda qkv, mask: K.encoder_attention(qkv, mask, 2, 0.25)))
qkv = np.random.RandomState(0).randn(2, 5, 3 * 2 * 16).astype(np.float32)
mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.int32)
exe = pc.compile("attn", (2, 5), (qkv, mask))
print(json.dumps({"loaded": pc.loaded_from_store, "out": np.asarray(exe(qkv, mask)).ravel().tolist()}))
"""


def test_a_program_calling_the_cpu_kernel_loads_in_a_fresh_process(tmp_path):
    """Tracing registers the C++ kernels' FFI targets; a program loaded without tracing, in a process
    that never traced one, must register them itself or XLA finds no handler for the call."""
    import json
    import subprocess
    import sys

    from jax_engine.kernels import cpu as cpu_kernels

    if not cpu_kernels.available():
        import pytest

        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.reason()}")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def run() -> dict:
        out = subprocess.run([sys.executable, "-c", _KERNEL_SCRIPT, str(tmp_path / "store")], cwd=root,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert (first["loaded"], second["loaded"]) == (0, 1)
    assert second["out"] == first["out"]


def test_only_real_compiles_are_stored(tmp_path):
    """XLA:CPU serializes an executable JAX loaded from its persistent cache without its compiled
    functions (loading it elsewhere fails: "Function ... not found"), so only real compiles are
    stored: a function compiled by a first owner is stored; a second owner whose compile JAX finds
    in its persistent cache stores nothing; nor does a third owner compiling the second's very
    jitted function, which JAX hands back from its in-process cache without reaching either (the
    executable is the one loaded from the persistent cache)."""
    import jax
    import numpy as np

    from jax_engine.executor.compilation import ProgramCache

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    saved = {n: getattr(jax.config, n) for n in names}
    saved_store = program_store.current()
    try:
        # every compile goes to JAX's cache (the directory it first opened in this process, if any)
        jax.config.update("jax_compilation_cache_dir", saved["jax_compilation_cache_dir"] or str(tmp_path / "jax"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        store = program_store.configure(str(tmp_path / "store"))

        x = np.ones((8, 16), np.float32)
        jitted = None
        for ctx in ("first owner", "second owner", "third owner"):
            if jitted is None or ctx == "second owner":
                def f(a, b):       # a new function: lowered again, the second found in JAX's cache
                    return jax.numpy.where(a > 0, a + b, b * 3.0).sum(axis=1)
                jitted = jax.jit(f)
            pc = ProgramCache("t", context=ctx)
            pc.register("f", jitted)
            before = program_store.compile_events_here()
            pc.compile("f", (8,), (x, x))
            after = program_store.compile_events_here()
            if ctx == "second owner":
                assert (after.requests, after.hits) == (before.requests + 1, before.hits + 1)
            if ctx == "third owner":
                assert after == before      # JAX's in-process cache: no event at all
        assert store.saved == 1 and len(os.listdir(tmp_path / "store")) == 1
    finally:
        for n, v in saved.items():
            jax.config.update(n, v)
        program_store._store = saved_store
