"""The inter-token latency guard: when a prompt may be prefilled in a step longer than the latency
budget while other streams decode beside it.

Why: the latency budget (--max-num-batched-tokens, 64 on CPU) bounds every step, so a 128-token
prompt arriving beside decoding streams took 2-3 steps to its first token, and its time to first
token (TTFT) was 1.56-1.73x the split engine's, which prefilled the whole prompt at once
(benchmarks/ragged_step.py, 'small' Llama, Poisson 0.5-2 req/s, 2-vCPU Xeon). A larger budget
fixed that and broke the other target: at budget 256 the inter-token p99 was 5.4x its median at
0.5 req/s (a one-shot prefill step of ~100 ms against ~18 ms decode steps), 3.8x at 1 req/s,
3.6x at 2 req/s. No fixed budget met both at every rate: what a long step costs the decoding
streams depends on how long their usual steps are and how many of them wait.

So the scheduler asks this guard, whenever prompts wait beside decoding streams, how far past
the latency budget a step may go (up to the burst budget). The guard measures, on this host and
load, every step's wall time (per token bucket, a moving average: the cost of the step it is
asked about) and the gaps the decoding streams saw (the last `window` of them: the median gap).
A step is allowed when its expected time stays under `safety * ratio * median`, so it cannot
raise the p99/p50 ratio above `ratio`; a step that finishes every waiting prompt (one-shot) is
also allowed past that, as long as the gaps above the line, its own included, stay under
`share` of the window: a p99 ignores the slowest 1 %, and the guard spends at most `share` of it
(the streams delayed by one such step: as many gaps as streams decode beside it, so a prompt
arriving beside one stream is cheap, one arriving beside thirty is not). Otherwise the largest
allowed bucket above the budget (or the budget itself) chunks the prompt.
A bucket never observed is allowed once, and is observed then.

Measured (ragged_step.json, same host and workload, 0.5 / 1 / 2 req/s, against the split engine):
TTFT 1.11 / 1.18 / 1.13x with ITL p99/p50 3.73 / 3.47 / 3.46 at budget 64 (commit 5ed0766); a
0.9 safety factor and a 0.7 % share were too cautious (1.23 / 1.39 / 1.42x, ratios 2.4-3.2).
After the GEMM prefetch made decode steps faster (median gap 28 -> 20 ms at 1 req/s) the line
fell with it and more prompts were chunked: 1.09 / 1.20 / 1.25x, ratios 3.46-3.87.
"""
from __future__ import annotations

from collections import deque
from typing import Optional

COST_WEIGHT = 0.2          # moving average of a bucket's step time: recent steps count, noise is damped


class LatencyGuard:
    def __init__(self, ratio: float, share: float = 0.008, window: int = 2048, safety: float = 1.0):
        if ratio <= 1.0:
            raise ValueError(f"the inter-token ratio must be > 1, got {ratio}")
        self.ratio, self.share, self.window, self.safety = ratio, share, window, safety
        self._steps: deque[tuple[float, int]] = deque()     # (ms, decoding streams) of recent steps
        self._gaps = 0                                       # sum of the streams over _steps
        self.cost: dict[int, float] = {}                     # token bucket -> ms (moving average)

    def observe(self, bucket: int, ms: float, decoding: int) -> None:
        """A step of this token bucket took `ms` from its start to the next; `decoding` streams
        waited for it (each one gap)."""
        old = self.cost.get(bucket)
        self.cost[bucket] = ms if old is None else old + COST_WEIGHT * (ms - old)
        if decoding <= 0:
            return
        self._steps.append((ms, decoding))
        self._gaps += decoding
        while self._steps and self._gaps - self._steps[0][1] >= self.window:
            self._gaps -= self._steps.popleft()[1]

    def median_gap(self) -> Optional[float]:
        """The median gap of the window (each step counted once per stream that waited for it)."""
        if not self._steps:
            return None
        half, seen = self._gaps / 2.0, 0
        for ms, n in sorted(self._steps):
            seen += n
            if seen >= half:
                return ms
        return None      # unreachable: the counts sum to _gaps

    def line(self) -> Optional[float]:
        """The step time above which a step is long (None: nothing measured yet)."""
        med = self.median_gap()
        return None if med is None else self.safety * self.ratio * med

    def choose(self, buckets: list[int], decoding: int) -> Optional[int]:
        """The largest of these token buckets (ascending; the last one prefills every waiting
        prompt to its end) a step may run in now, beside `decoding` streams; None: none of them."""
        if not buckets:
            return None
        if decoding <= 0:
            return buckets[-1]
        line = self.line()
        if line is None:
            return buckets[-1]
        ms = self.cost.get(buckets[-1])
        if ms is None or ms <= line:
            return buckets[-1]
        long = sum(n for t, n in self._steps if t > line)
        if long + decoding <= self.share * self.window:
            return buckets[-1]
        for b in reversed(buckets[:-1]):
            ms = self.cost.get(b)
            if ms is None or ms <= line:
                return b
        return None
