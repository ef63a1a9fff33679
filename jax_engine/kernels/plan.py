"""The measured CPU matmul decision as data: which path (XLA's dot, the packed-panel kernel, the
library sgemm) multiplies each decoder matrix at each row count, with the timings behind it.

Its own module so the model (jax_engine/models/llama.py, which routes by it) and the chooser that
measures it (choose.py, which builds the model's programs to time) both import it without
importing each other.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

PATHS = ("xla", "kernel", "blas")
LAYOUT = {"xla": "xla", "blas": "xla", "kernel": "kernel"}     # the library sgemm reads XLA's layout
UNBOUNDED = sys.maxsize          # max_m of a matrix's last route


# --------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Timing:
    """One timed point: median seconds per layer of each path on the timed slice."""

    weight: str
    m: int
    shape_class: str
    xla_s: float
    kernel_s: float
    slice: str = ""              # what was timed, e.g. "2 x [768] -> [2048] float32"
    blas_s: Optional[float] = None   # the library sgemm, where it was timed (float32 prefill points)

    def seconds(self) -> dict[str, float]:
        out = {"xla": self.xla_s, "kernel": self.kernel_s}
        return out if self.blas_s is None else {**out, "blas": self.blas_s}


@dataclass(frozen=True)
class MatmulPlan:
    """Which path multiplies each matrix, by row count: routes[weight] = ((max_m, path), ...),
    ascending; the first route with m <= max_m applies (the last has max_m = UNBOUNDED)."""

    routes: tuple[tuple[str, tuple[tuple[int, str], ...]], ...]
    decode_rows: int = 0
    timings: tuple[Timing, ...] = field(default=(), compare=False, hash=False)
    source: str = field(default="measured", compare=False, hash=False)     # measured | cached

    def path(self, weight: str, m: int) -> str:
        for max_m, p in dict(self.routes)[weight]:
            if m <= max_m:
                return p
        raise AssertionError("the last route is unbounded")

    def layouts(self, weight: str) -> frozenset[str]:
        """The weight layouts `weight` needs: "xla" (XLA's, also read by the library sgemm) and/or
        "kernel" (packed panels)."""
        return frozenset(LAYOUT[p] for _, p in dict(self.routes)[weight])

    @property
    def mode(self) -> str:
        """"xla" or "kernel" when one path serves everything (cfg.matmul), else "mixed"."""
        used = {p for _, rs in self.routes for _, p in rs}
        return used.pop() if len(used) == 1 else "mixed"

    def summary(self) -> list[dict[str, Any]]:
        """One row per (matrix, route), for stats and metrics: weight; shape_class ("decode" =
        1..decode_rows, "prefill" = beyond, "all", or "M<=4" / "4<M<=16" / "M>16" when a class
        splits); min_m, max_m (None = unbounded); path; and the timed points inside the route
        (ms per layer on the timed slice, both paths)."""
        out = []
        for w, rs in self.routes:
            lo = 1
            for max_m, p in rs:
                hi = None if max_m == UNBOUNDED else max_m
                pts = [t for t in self.timings if t.weight == w and lo <= t.m <= (hi or UNBOUNDED)]
                out.append({"weight": w, "shape_class": _class_name(lo, hi, self.decode_rows), "min_m": lo, "max_m": hi,
                            "path": p, "timings_ms": {t.m: {k: v * 1e3 for k, v in t.seconds().items()} for t in pts}})
                lo = max_m + 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {"routes": {w: [list(r) for r in rs] for w, rs in self.routes}, "decode_rows": self.decode_rows,
                "timings": [dataclasses.asdict(t) for t in self.timings]}

    @classmethod
    def from_json(cls, d: dict[str, Any], source: str) -> "MatmulPlan":
        return cls(routes=tuple((w, tuple((int(m), str(p)) for m, p in rs)) for w, rs in d["routes"].items()),
                   decode_rows=int(d["decode_rows"]), timings=tuple(Timing(**t) for t in d["timings"]), source=source)


def _class_name(lo: int, hi: Optional[int], d: int) -> str:
    named = {(1, d): "decode", (d + 1, None): "prefill", (1, None): "all"}
    if (lo, hi) in named:
        return named[(lo, hi)]
    return f"M>{lo - 1}" if hi is None else (f"M<={hi}" if lo == 1 else f"{lo - 1}<M<={hi}")


