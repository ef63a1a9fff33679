"""One sequence's place in its grammar, and the batch mask fill for a step."""
from __future__ import annotations

import os
import threading
from typing import Optional

import llguidance
import llguidance.numpy
import numpy as np

_executor: Optional[llguidance.LLExecutor] = None
_executor_lock = threading.Lock()


def _pool() -> llguidance.LLExecutor:
    """llguidance's own thread pool (Rust, no GIL) for computing a step's masks in parallel."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor(num_threads=max(1, min(8, os.cpu_count() or 1)))
        return _executor


class GrammarState:
    """A sequence's matcher: which tokens may come next, and the token the step drew."""

    __slots__ = ("matcher", "words")

    def __init__(self, matcher: llguidance.LLMatcher, words: int):
        self.matcher = matcher
        self.words = words          # mask width in int32 words: ceil(the tokenizer's vocabulary / 32)

    def consume(self, token: int) -> bool:
        """Advance past a drawn token; False if the grammar does not allow it (the matcher is then
        in its error state, which only a min_new_tokens ban against the grammar's end can cause)."""
        return bool(self.matcher.consume_token(token)) and not self.matcher.is_error()

    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (its EOS, if drawn, was consumed too)."""
        return bool(self.matcher.is_stopped())

    def error(self) -> str:
        return self.matcher.get_error()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (proposed continuations) the grammar accepts in a row, without
        moving this state."""
        return int(self.matcher.validate_tokens(tokens)) if tokens else 0

    def fill_ahead(self, tokens: list[int], out: np.ndarray, row: int) -> None:
        """Rows row, row + 1, ... row + len(tokens) of out: the next-token bitmask here and after
        each prefix of `tokens` (a speculating row's positions; tokens must be a valid prefix),
        leaving this state where it was."""
        m = self.matcher
        for j in range(len(tokens) + 1):
            if j:
                m.consume_token(tokens[j - 1])
            llguidance.numpy.fill_next_token_bitmask(m, out, row + j)
        if tokens:
            m.rollback(len(tokens))


def fill_masks(rows: list[tuple[GrammarState, int]], out: np.ndarray) -> None:
    """Write each state's next-token bitmask into row j of out ([n, words] int32, bit t of word
    t // 32 = token t allowed), all rows at once on llguidance's pool."""
    if len(rows) == 1:   # one row: skip the pool's hand-off
        state, j = rows[0]
        llguidance.numpy.fill_next_token_bitmask(state.matcher, out, j)
        return
    llguidance.numpy.fill_next_token_bitmask_par(_pool(), [(s.matcher, j) for s, j in rows], out)
