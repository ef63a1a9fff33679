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
    (decode tokens + expected accepted guesses) / step time, by at least MARGIN more than the
    step without guesses, the step time measured per token
    bucket at warmup (runner.time_steps) and kept current from served steps (runner._observe),
    plus the scheduler thread's own time per step, measured apart for steps with and without
    guesses (observe_host).
    On an accelerator wider steps cost about the same and every good guess is kept; on a small
    CPU host only the likely ones are. Before the proposers run, the same pricing with every row
    offering all the guesses it may decides which rows are asked at all.
  * a sequence whose q falls below `min_accept_rate` stops proposing for `backoff` decode steps
    (doubling up to MAX_BACKOFF while probes keep failing), so text the proposer cannot predict
    costs one probe every few dozen tokens, and no host time goes into proposing for it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Callable, Optional, Sequence

from jax_engine.spec import Proposer, Speculator, make_speculator
from jax_engine.types import SpecStats

MIN_BACKOFF = 4
MAX_BACKOFF = 64
EMA = 0.3          # weight of the latest verification in a sequence's acceptance average (0.5 let
                   # one full acceptance of sampled text lift q enough for 64-token steps that
                   # then emitted ~13 tokens: 8 rows at temperature 0.8, trained model)
MARGIN = 0.03      # how much more tokens per ms guesses must promise than the step without them,
                   # against the noise of the measured costs (the host work a verifying step adds
                   # is measured: observe_host)
HOST_EMA = 0.05    # weight of one step in the host-time averages (observe_host): ~20 steps
HOST_CLIP = 4.0     # a step's host time counts at most HOST_CLIP x the average it updates plus
HOST_JUMP_MS = 1.0  # HOST_JUMP_MS (observe_host): one pause of the scheduler thread (a GC pass,
                    # another thread holding the GIL, the OS) is not the price of guessing, while a
                    # lasting cost still gets in (the average may grow ~15 % a step)
EXPLORE_EVERY = 64  # steps without a verified guess after which one step verifies a few anyway
MAX_EXPLORE_EVERY = 512   # that interval doubles after each exploration the pricing did not follow
EXPLORE_GUESSES = 4  # guesses per row in that step (see Drafter.exploring)
EXPLORE_PRIOR = 2.0  # an exploration that accepted every guess counts the drafter's prior as this
                     # many trials: on its own, 4 of 4 accepted put q at 1.0, and 8 sampled streams of the
                     # trained model (per-guess acceptance ~0.56) then bet 8 guesses a row on text
                     # that took ~2 of them (steps of 30-40 tokens at ~3x a plain step's time)
IDLE_PLANS = 8     # planned steps in a row without a guess before planning pauses (Drafter.gate)
PRIOR_Q = 0.7      # the first sequences' guess acceptance chance, before any verification
PRIOR_EMA = 0.02   # weight of one verification in the drafter's acceptance average, which later
                   # sequences start from (~50 verifications: the recent workload, not one row)


@dataclass
class SpecTrack:
    """One sequence's proposer and its recent acceptance."""

    proposer: Proposer
    rate: float = PRIOR_Q           # exponential average of one guess's acceptance chance (q)
    pause: int = 0                  # decode steps left without proposing
    backoff: int = MIN_BACKOFF
    explored: bool = False          # its guesses this step are an exploration (Drafter.exploring)
    greedy: bool = True             # its tokens are argmax draws (which prior it feeds: Drafter.start)


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
    # what a new sequence's q starts from, for greedy (True) and sampled (False) sequences (see start)
    prior: dict[bool, float] = field(default_factory=lambda: {True: PRIOR_Q, False: PRIOR_Q})
    idle_plans: int = 0                        # consecutive planned steps that verified no guess
    gate_pause: int = 0                        # steps left that skip planning altogether (see gate)
    gate_backoff: int = MIN_BACKOFF
    unverified_steps: int = 0                  # steps since one verified a guess (see exploring)
    explore_every: int = EXPLORE_EVERY         # the current exploration interval (see exploring)
    host_ms: list[Optional[float]] = field(default_factory=lambda: [None, None])  # see observe_host

    def __post_init__(self) -> None:
        if self.speculator is None:
            self.speculator = make_speculator(self.method)
        if not self.hist:
            self.hist = [0] * (self.max_tokens + 1)

    def start(self, prompt: Sequence[int], greedy: bool = True) -> SpecTrack:
        """A new sequence's track. Its q starts from the acceptance of this drafter's recent
        verifications (over every sequence), not from a constant: with a fixed 0.7, each of 8
        concurrent sampled streams of the trained model (measured acceptance ~0.4-0.6) bet on several guesses
        as soon as it started, and a server whose requests come and go kept paying for those
        bets. Never below min_accept_rate, so a new sequence still probes.

        Greedy and sampled sequences keep a prior each: a greedy guess is accepted when it is
        the argmax, a sampled one by rejection sampling, and the two rates differ by far on the
        same text (trained model, suffix: 0.9-1.0 greedy, 0.3-0.6 at temperature 0.8). With one
        prior, sampled streams that followed greedy ones (spec_decode runs its workloads in that
        order on one engine) started from the greedy rows' q: the first two rounds of 8 sampled
        streams accepted 4.3 and 3.1 tokens a verifying row (2.4-2.6 later) and ran at 0.89x
        and 0.81x the speed without speculation, the next four at 0.91-1.05x. (Whole runs
        with the two priors gave 1.02x and 0.92x there: within this host's noise.)

        A new sequence also ends the planning gate's pause (see gate): the next step is a probe.
        Text the proposer cannot predict keeps pausing (the backoff is not reset), but a request
        that repeats an earlier one would otherwise wait out up to MAX_BACKOFF steps of its answer
        unguessed: two prompts answered twice, 20 tokens each, had 2 of their second answers' 20
        steps planned (CI caught it: 4 guesses accepted of a possible 40)."""
        assert self.speculator is not None
        self.gate_pause = 0
        return SpecTrack(self.speculator.start(prompt, greedy), rate=max(self.prior[greedy], self.min_accept_rate),
                         greedy=greedy)

    def gate(self) -> bool:
        """Whether to plan guesses for this step at all. Planning costs host time on the scheduler
        thread every step (the sequences' pricing, the proposers; ~0.1-0.15 ms a step at 8
        sampled streams of the trained model, 5-7 % of the step), paid also when it keeps no
        guess. After IDLE_PLANS planned steps in a row that kept none, planning pauses for 4,
        8, ... MAX_BACKOFF steps while each probe after a pause keeps none either; a step that
        keeps a guess ends the pause cycle. An exploring step (see exploring) is always planned."""
        self.unverified_steps += 1
        if self.exploring():
            self.gate_pause = 0
            return True
        if self.gate_pause > 0:
            self.gate_pause -= 1
            return False
        return True

    def exploring(self) -> bool:
        """Whether this step verifies up to EXPLORE_GUESSES guesses of every proposing row whatever
        they are priced at. A row's q only changes when its guesses are verified, and the pricing
        verifies none at a low q where wider steps cost much (8 rows of the trained model: a
        16-token step costs 1.5x an 8-token one, so nothing under q ~0.75 pays): rows started at
        a low prior, or back from a pause at min_accept_rate, then never guessed again, and a
        repeated workload at batch 8 ran without speculation for whole rounds (spec_decode, b8
        repeat: 2 of 4 rounds with no guess verified). One such step every EXPLORE_EVERY steps
        without a verified guess costs ~2 % there (a 40-token step instead of an 8-token one).

        Where explorations find nothing the pricing then keeps, the interval doubles after each
        (64, 128, ... MAX_EXPLORE_EVERY steps) and a priced step with guesses resets it: on 8
        sampled streams of the trained model (2-vCPU Xeon), explorations every 64 steps were ~11
        steps of ~5 ms in a pass of ~390 plain ~1.9 ms ones, ~4 % of its time for nothing."""
        return self.unverified_steps >= self.explore_every

    def planned(self, guesses: int) -> None:
        """The step planned by the scheduler verifies `guesses` guesses (see gate)."""
        if self.exploring():         # an exploration (also one that found nothing to guess) waits longer
            self.unverified_steps = 0
            self.explore_every = min(MAX_EXPLORE_EVERY, self.explore_every * 2)
        elif guesses > 0:
            self.unverified_steps = 0
            self.explore_every = EXPLORE_EVERY
        if guesses > 0:
            self.idle_plans, self.gate_backoff = 0, MIN_BACKOFF
            return
        self.idle_plans += 1
        if self.idle_plans >= IDLE_PLANS:
            self.gate_pause = self.gate_backoff
            self.gate_backoff = min(MAX_BACKOFF, self.gate_backoff * 2)

    def observe_host(self, verified: bool, ms: float) -> None:
        """A served step's time on the scheduler thread outside the step program's call (planning,
        proposing, building rows, accepting and emitting tokens, and whatever else held the GIL
        meanwhile), kept as an average apart for steps that verified guesses and steps that did
        not. A verifying step costs more there, and the step-time table (timed on the program
        call alone) does not see it: 8 sampled streams of the trained model (2-vCPU Xeon) spent
        0.73-0.91 ms a verifying step outside the call against 0.28-0.36 ms a plain one, a
        quarter of the plain step's 1.96 ms period, where a flat 10 % margin had stood in for it.

        A sample counts at most HOST_CLIP x the average it updates + HOST_JUMP_MS, and the verifying
        steps' average starts from the plain one (0 before any plain step) instead of from its own
        first sample: set outright, one pause of the scheduler thread on the first verifying step
        (a 200 ms sample) priced every later guess out until the rare exploring steps averaged it
        away, and a test's greedy batch verified 10 rows instead of ~150."""
        i = int(verified)
        old = self.host_ms[i]
        if old is None:                          # the first sample of its kind
            if not verified:
                self.host_ms[0] = min(ms, HOST_JUMP_MS)
                return
            old = self.host_ms[0] or 0.0
        self.host_ms[i] = old + HOST_EMA * (min(ms, HOST_CLIP * old + HOST_JUMP_MS) - old)

    def host_cost(self, verified: bool) -> float:
        """The measured host ms a step adds beside its program (observe_host); a verifying step
        not yet measured is priced as a plain one, 0 before any step."""
        ms = self.host_ms[int(verified)]
        if ms is None:
            ms = self.host_ms[0]
        return 0.0 if ms is None else ms

    def ready(self, track: SpecTrack) -> bool:
        """Whether the sequence may propose this step; while it pauses, False and one step less
        to wait (the planner then leaves its row out of the step's pricing)."""
        if track.pause > 0:
            track.pause -= 1
            return False
        return True

    def propose(self, track: SpecTrack, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to min(limit, max_tokens) guesses to follow `tokens`; none while the sequence pauses."""
        if track.pause > 0:
            track.pause -= 1
            return []
        k = min(limit, self.max_tokens)
        if k <= 0:
            return []
        return track.proposer.propose(tokens, k)[:k]

    def record(self, track: SpecTrack, proposed: int, accepted: int) -> None:
        """The step verified `proposed` guesses of this sequence and accepted the first `accepted`."""
        if proposed <= 0:
            return
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        self.verify_rows += 1
        self.hist[min(accepted, self.max_tokens)] += 1
        trials = accepted + (1 if accepted < proposed else 0)
        prior = self.prior[track.greedy]
        if track.explored:             # an exploration is a fresh estimate, not one more sample
            # (one that saw no failure only bounds q from below: the prior weighs in)
            track.rate = (accepted / trials if accepted < proposed else
                          (accepted + EXPLORE_PRIOR * prior) / (trials + EXPLORE_PRIOR))
            track.explored = False
        else:
            track.rate = (1 - EMA) * track.rate + EMA * accepted / trials
        self.prior[track.greedy] = (1 - PRIOR_EMA) * prior + PRIOR_EMA * accepted / trials
        if track.rate < self.min_accept_rate:
            track.pause = track.backoff
            track.backoff = min(MAX_BACKOFF, track.backoff * 2)
            track.rate = self.min_accept_rate          # the probe after the pause decides afresh
        elif accepted == proposed:
            track.backoff = MIN_BACKOFF

    def choose(self, proposals: Sequence[Sequence[int]], tracks: Sequence[SpecTrack], decode_tokens: int,
               room: int, cost: Callable[[int, bool], float], chunk_tokens: int = 0,
               widths: Optional[Sequence[int]] = None, ends: Optional[Sequence[int]] = None) -> list[int]:
        """How many of each row's guesses to verify (see the module docstring): the prefix of all
        guesses, in order of expected gain q^i, that maximises (work + expected accepted) /
        cost(base + guesses, True), against work / cost(base, False) without any (raised by
        MARGIN against noise; the caller's cost includes the measured host time), where the base
        is the step's decode tokens and its `chunk_tokens` prefill tokens and the work counts each
        of them once (a prompt token done now is one not done later); at most `room` guesses.

        `widths` (the runner's token buckets, the points where the cost can change): the cost is
        flat between them and the gain grows with every guess, so only the last guess count
        within each width is priced -- 6-10 cost lookups instead of one per guess (this runs
        twice before every step; on 8 rows x 8 guesses it took ~50 us a call).

        `ends` (per row, the number of guesses after which its request is complete; given when
        no prompt would share the next step): see _finish."""
        take = [0] * len(proposals)
        for tr in tracks:
            tr.explored = False
        if room <= 0:
            return take
        if self.exploring():
            for r, (g, tr) in enumerate(zip(proposals, tracks)):
                take[r] = min(len(g), EXPLORE_GUESSES, room)
                room -= take[r]
                tr.explored = take[r] > 0
            return take
        items: list[tuple[float, int, int]] = []
        for r, (g, tr) in enumerate(zip(proposals, tracks)):
            q, v = tr.rate, tr.rate
            if q <= 0:
                continue
            for i in range(len(g)):
                items.append((v, -i, r))
                v *= q
        if not items:
            return take
        items.sort(reverse=True)
        del items[room:]
        base = decode_tokens + chunk_tokens
        M = len(items)
        if widths is None:
            ms: Sequence[int] = range(1, M + 1)
        else:
            ms = sorted({w - base for w in widths if 0 < w - base < M} | {M})
        gains = list(accumulate((g for g, _, _ in items), initial=float(base)))
        best, best_val = 0, base / max(cost(base, False), 1e-9) * (1 + MARGIN)
        for m in ms:
            val = gains[m] / max(cost(base + m, True), 1e-9)
            if val > best_val:
                best, best_val = m, val
        if ends is not None and M == sum(len(g) for g in proposals):
            best = self._finish(items, best, proposals, [t.rate for t in tracks], ends, base, cost)
        for _, _, r in items[:best]:
            take[r] += 1
        return take

    @staticmethod
    def _finish(items: list[tuple[float, int, int]], best: int, proposals: Sequence[Sequence[int]],
                rates: Sequence[float], ends: Sequence[int], base: int, cost: Callable[[int, bool], float]) -> int:
        """The guess count to verify when every row's proposal runs to its request's end and no
        prompt would share the next step: all of them, where what that adds to this step is less than
        the expected cost of the step the rows' leftovers would otherwise need on their own (its
        cost times the chance that every row ends now: every guess accepted, the product of each
        row's q^guesses). The one-step pricing does not see that step: 8 rows of a repeated
        answer (trained model, K = 16, 2-vCPU Zen 4) verified 13 of their last 14 guesses (112
        tokens instead of 119, one bucket narrower) and left one token each, a 7-token step of
        2.0-2.6 ms and ~0.7 ms of host work per wave of 8 answers (~80 ms) with nothing beside it."""
        M = len(items)
        if best >= M or any(len(g) != e for g, e in zip(proposals, ends)):
            return best
        left = [len(g) for g in proposals]
        for _, _, r in items[:best]:
            left[r] -= 1
        chance = math.prod(q ** len(g) for q, g in zip(rates, proposals))
        # the leftover step: each row with guesses left, its base token and the rest as guesses
        tail = cost(sum(left), any(n > 1 for n in left))
        extra = cost(base + M, True) - cost(base + best, best > 0)
        return M if extra < chance * tail else best

    def finish(self, track: SpecTrack, tokens: Optional[Sequence[int]]) -> None:
        """The sequence ended with `tokens` (prompt + output), or was aborted or failed (None)."""
        track.proposer.finish(tokens)

    def stats(self) -> SpecStats:
        return SpecStats(method=self.method, num_speculative_tokens=self.max_tokens,
                         proposed_tokens=self.proposed_tokens, accepted_tokens=self.accepted_tokens,
                         verify_rows=self.verify_rows, accepted_histogram=list(self.hist))
