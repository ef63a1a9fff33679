"""Speculative decoding without a draft model: host-side proposers (issue 20).

A proposer guesses the next few tokens of a sequence from text already seen; the step program
verifies the guesses as extra query tokens of the row (greedy rows keep the longest prefix that
matches the argmax, sampled rows use rejection sampling), so the output is what the model would
have produced anyway and only the number of passes over the weights changes. Two methods:

  ngram   prompt lookup: the tokens after the most recent earlier occurrence of the sequence's
          last n tokens, longest n first (jax_engine/spec/ngram.py);
  suffix  SuffixDecoding (Oliaro et al., arXiv:2411.04975): frequency-ranked continuations from
          this request's prompt + output and a bounded cache of the model's recent outputs
          (jax_engine/spec/suffix.py).

Both are plain Python, no JAX: they run on the scheduler thread between steps, so they must be
cheap per call (tens of microseconds; see the modules). The engine talks to them through the
two Protocols below: a `Speculator` per served model starts a `Proposer` per sequence; the
proposer is asked for up to k tokens before each step and told when its sequence ends.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Protocol

METHODS = ("off", "ngram", "suffix")


class Proposer(Protocol):
    """One sequence's source of speculative tokens."""

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens to follow `tokens` (the whole sequence: prompt + output so far); fewer or
        none when nothing looks predictable. Calls for one sequence come with ever longer
        `tokens`, so a proposer may index incrementally."""
        ...

    def finish(self, tokens: Optional[Sequence[int]] = None) -> None:
        """The sequence ended with `tokens` (prompt + output); None: it was aborted, learn nothing."""
        ...


class Speculator(Protocol):
    """A method configured for one model: what is shared across its requests lives here."""

    def start(self, prompt: Sequence[int], greedy: bool = True) -> Proposer:
        """A proposer for a sequence with this prompt; `greedy`: its tokens are argmax draws
        (sampled ones are accepted by rejection sampling, which favours other guesses)."""
        ...


def make_speculator(method: str, **options: Any) -> Optional[Speculator]:
    """The speculator for `--speculative METHOD` (None for "off"); `options` go to its constructor."""
    if method == "off":
        return None
    if method == "ngram":
        from jax_engine.spec.ngram import NgramSpeculator

        return NgramSpeculator(**options)
    if method == "suffix":
        from jax_engine.spec.suffix import SuffixCache

        return SuffixCache(**options)
    raise ValueError(f"unknown speculative method {method!r} (one of {', '.join(METHODS)})")
