"""Speculative decoding on the scheduler's side: what each running sequence proposes before a
step, how many of the guesses the step verifies, what it accepted, and when a sequence should
stop proposing.

The proposers (jax_engine/spec/) guess; the step program verifies (runner.py, sampling.verify);
this module decides how many guesses each row carries and keeps the numbers. A guess costs the
step a query token (and a step with any guess runs the "spec" program variant, whose sampling
runs over one row per verified position), so guesses are worth it only when the tokens they are
expected to add outweigh what the wider step costs on this host:

  * each sequence keeps `q`, an exponential average of the chance that one guess is accepted
    (a verification that accepted a of g guesses is a successes and, when a < g, one failure),
    so its i-th guess is expected to add q^i tokens;
  * `choose` adds guesses in order of that expected gain and keeps the prefix that maximises
    (decode tokens + expected accepted guesses) / step time, the step time measured per token
    bucket at warmup (runner.time_steps) and kept current from served steps (runner._observe).
    On an accelerator wider steps cost about the same and every good guess is kept; on a small
    CPU host only the likely ones are.
  * a sequence whose q falls below `min_accept_rate` stops proposing for `backoff` decode steps
    (doubling up to MAX_BACKOFF while probes keep failing), so text the proposer cannot predict
    costs one probe every few dozen tokens, and no host time goes into proposing for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from jax_engine.spec import Proposer, Speculator, make_speculator
from jax_engine.types import SpecStats

MIN_BACKOFF = 4
MAX_BACKOFF = 64
EMA = 0.3          # weight of the latest verification in a sequence's acceptance average (0.5 let
                   # one full acceptance of sampled text lift q enough for 64-token steps that
                   # then emitted ~13 tokens: 8 rows at temperature 0.8, trained model)
PRIOR_Q = 0.7      # a new sequence's guess acceptance chance, before any verification


@dataclass
class SpecTrack:
    """One sequence's proposer and its recent acceptance."""

    proposer: Proposer
    rate: float = PRIOR_Q           # exponential average of one guess's acceptance chance (q)
    pause: int = 0                  # decode steps left without proposing
    backoff: int = MIN_BACKOFF


@dataclass
class Drafter:
    """A scheduler's speculation policy and statistics (one per replica: its suffix cache holds
    that replica's outputs; a proposer is not thread-safe and lives on the scheduler thread)."""

    method: str
    max_tokens: int                            # --num-speculative-tokens: most guesses per row
    min_accept_rate: float = 0.3
    speculator: Optional[Speculator] = None
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    verify_rows: int = 0                       # row verifications with at least one guess
    hist: list[int] = field(default_factory=list)   # hist[a]: verifications that accepted a guesses

    def __post_init__(self) -> None:
        if self.speculator is None:
            self.speculator = make_speculator(self.method)
        if not self.hist:
            self.hist = [0] * (self.max_tokens + 1)

    def start(self, prompt: Sequence[int]) -> SpecTrack:
        assert self.speculator is not None
        return SpecTrack(self.speculator.start(prompt))

    def propose(self, track: SpecTrack, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to min(limit, max_tokens) guesses to follow `tokens`; none while the sequence pauses."""
        if track.pause > 0:
            track.pause -= 1
            return []
        k = min(limit, self.max_tokens)
        return track.proposer.propose(tokens, k)[:k] if k > 0 else []

    def record(self, track: SpecTrack, proposed: int, accepted: int) -> None:
        """The step verified `proposed` guesses of this sequence and accepted the first `accepted`."""
        if proposed <= 0:
            return
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        self.verify_rows += 1
        self.hist[min(accepted, self.max_tokens)] += 1
        trials = accepted + (1 if accepted < proposed else 0)
        track.rate = (1 - EMA) * track.rate + EMA * accepted / trials
        if track.rate < self.min_accept_rate:
            track.pause = track.backoff
            track.backoff = min(MAX_BACKOFF, track.backoff * 2)
            track.rate = self.min_accept_rate          # the probe after the pause decides afresh
        elif accepted == proposed:
            track.backoff = MIN_BACKOFF

    def choose(self, proposals: Sequence[Sequence[int]], tracks: Sequence[SpecTrack], decode_tokens: int,
               room: int, cost: Callable[[int, bool], float]) -> list[int]:
        """How many of each row's guesses to verify (see the module docstring): the prefix of all
        guesses, in order of expected gain q^i, that maximises (decode_tokens + expected accepted)
        / cost(decode_tokens + guesses, True), against cost(decode_tokens, False) without any; at
        most `room` guesses in all."""
        items = sorted(((tr.rate ** (i + 1), -i, r) for r, (g, tr) in enumerate(zip(proposals, tracks))
                        for i in range(len(g))), reverse=True)
        best, best_val = 0, decode_tokens / max(cost(decode_tokens, False), 1e-9)
        gain = float(decode_tokens)
        for m, (g, _, _) in enumerate(items[:max(0, room)], 1):
            gain += g
            val = gain / max(cost(decode_tokens + m, True), 1e-9)
            if val > best_val:
                best, best_val = m, val
        take = [0] * len(proposals)
        for _, _, r in items[:best]:
            take[r] += 1
        return take

    def finish(self, track: SpecTrack, tokens: Optional[Sequence[int]]) -> None:
        """The sequence ended with `tokens` (prompt + output), or was aborted or failed (None)."""
        track.proposer.finish(tokens)

    def stats(self) -> SpecStats:
        return SpecStats(method=self.method, num_speculative_tokens=self.max_tokens,
                         proposed_tokens=self.proposed_tokens, accepted_tokens=self.accepted_tokens,
                         verify_rows=self.verify_rows, accepted_histogram=list(self.hist))
