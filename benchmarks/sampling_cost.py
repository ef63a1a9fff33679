"""What the on-device sampler costs per decode step, by path, against a full-vocabulary sort.

  python -m benchmarks.sampling_cost [--quick]

Times the jitted `jax_engine.decode.sampling.sample` over [16, V] float32 logits (V = 32,000, the
'small' benchmark model, and 151,936, Qwen's vocabulary) for: greedy rows; top_k 50 / top_p 0.9
(decided among the 64 candidates); plain temperature sampling and min-p (no ranking); top_p 0.9
alone with a flat distribution (the cut lies beyond the candidates: exact bisection); and, as the
baseline, the textbook sampler that sorts the whole vocabulary (what the engine did before).
Writes results/sampling_cost.json. Medians of repeated calls in this process.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C
from jax_engine.decode.rows import SamplingRow

ROWS = 16
CASES = {
    "greedy": dict(temperature=0.0),
    "top_k 50, top_p 0.9, t 0.7 (candidates)": dict(temperature=0.7, top_k=50, top_p=0.9),
    "plain, t 1.0 (no ranking)": dict(temperature=1.0),
    "min_p 0.1 (no ranking)": dict(temperature=1.0, min_p=0.1),
    "top_p 0.9 alone, t 1.0 (bisection)": dict(temperature=1.0, top_p=0.9),
}


def sort_sampler(logits, sa):
    """The textbook sampler: sort the vocabulary, mask, draw (the engine's method before)."""
    import jax
    import jax.numpy as jnp

    V = logits.shape[-1]
    t = jnp.where(sa.temperature <= 0, 1.0, sa.temperature)[:, None]
    order = jnp.argsort(-logits / t, axis=-1)
    srt = jnp.take_along_axis(logits / t, order, axis=-1)
    probs = jax.nn.softmax(srt, axis=-1)
    k = jnp.where(sa.top_k <= 0, V, sa.top_k)[:, None]
    keep = (jnp.arange(V)[None] < k) & (jnp.cumsum(probs, -1) - probs < sa.top_p[:, None])
    keys = jax.vmap(jax.random.fold_in)(sa.seeds, sa.steps)
    pick = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, srt, -1e30))
    return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0]


def time_ms(fn: Callable, args: tuple, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append((time.perf_counter() - t0) * 1e3)
    return round(C.median(ts), 3)


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_engine.decode import sampling as S

    doc = C.header("sampling_cost", a.quick, list(argv or sys.argv[1:]))
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, rep_pen=1.0, freq_pen=0.0, pres_pen=0.0,
                seeds=1, steps=0, bias=[], ban=[])
    repeats = 3 if a.quick else 15
    sample, sort = jax.jit(S.sample), jax.jit(sort_sampler)
    out = {}
    for V in ([32000] if a.quick else [32000, 151936]):
        logits = jnp.asarray(np.random.default_rng(0).standard_normal((ROWS, V)).astype(np.float32))
        row = {}
        for name, params in CASES.items():
            host = S.host_arrays([SamplingRow(**{**base, **params, "seeds": i}) for i in range(ROWS)], ROWS, 4, 4)
            sa = S.SamplingArrays(**{k: jnp.asarray(v) for k, v in host.items()})
            row[name] = time_ms(sample, (logits, sa), repeats)
            C.log(f"V={V} {name}: {row[name]} ms")
        host = S.host_arrays([SamplingRow(**{**base, **CASES["top_k 50, top_p 0.9, t 0.7 (candidates)"]})] * ROWS,
                             ROWS, 4, 4)
        sa = S.SamplingArrays(**{k: jnp.asarray(v) for k, v in host.items()})
        row["full-vocabulary sort (baseline)"] = time_ms(sort, (logits, sa), max(2, repeats // 5))
        C.log(f"V={V} sort baseline: {row['full-vocabulary sort (baseline)']} ms")
        out[str(V)] = row
    doc.update({"rows": ROWS, "ms_median": out, "repeats": repeats})
    return C.finish(doc, "sampling_cost", a.quick)


if __name__ == "__main__":
    main()
