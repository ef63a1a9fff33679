"""Grammar compilation off the scheduler thread, cached per tokenizer by the constraint's text.

A request with a constraint waits here (the grammar queue SGLang's GetLoads reports) until its
grammar is compiled; a grammar that cannot be compiled is an InvalidRequest before the request
reaches a scheduler, so a bad schema never touches the step loop (vLLM's scheduler died on
those: shared/spec/reliability_security.md). Size is capped by --max-grammar-bytes, compile time
by --grammar-compile-timeout (the engine stops waiting) and by llguidance's parser fuel limits.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import numpy as np

from jax_engine.constrain import grammar
from jax_engine.constrain.state import GrammarState, fill_masks
from jax_engine.errors import InvalidRequest, Overloaded
from jax_engine.types import Constraint

# llguidance's defaults, with error messages that do not echo parser internals to clients
LIMITS = llguidance.LLParserLimits(verbose_errors=False)


@dataclass
class CompiledGrammar:
    """A grammar in its start state; every sequence of a request gets its own copy."""

    matcher: llguidance.LLMatcher
    words: int

    def new_state(self) -> GrammarState:
        return GrammarState(self.matcher.deep_copy(), self.words)


class GrammarCompiler:
    """One per served decoder (one tokenizer): compiles constraints on its own threads."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: set[int], cache_size: int, max_bytes: int,
                 max_queued: int = 256, threads: int = 2):
        self.max_bytes, self.cache_size, self.max_queued = max_bytes, cache_size, max_queued
        # the model's vocabulary may be padded past the tokenizer's: those ids are never allowed
        self.vocab_size = max(vocab_size, len(hf_tokenizer))
        self.words = (self.vocab_size + 31) // 32
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        # ~1 s for a 152k vocabulary: built once, in the background, when the model loads
        self._tokenizer: Future = self._pool.submit(
            llguidance.hf.from_tokenizer, hf_tokenizer, self.vocab_size, sorted(eos_ids))
        self._cache: "OrderedDict[tuple, CompiledGrammar]" = OrderedDict()
        self._lock = threading.Lock()
        self._queued = 0

    @property
    def queued(self) -> int:
        """Requests waiting for a grammar to compile."""
        return self._queued

    def compile(self, c: Constraint) -> "Future[CompiledGrammar]":
        """A future of the compiled grammar; shape errors raise InvalidRequest at once."""
        grammar.check(c, self.max_bytes)
        key = (c.kind, c.spec, tuple(c.choices))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                done: Future = Future()
                done.set_result(hit)
                return done
            if self._queued >= self.max_queued:
                raise Overloaded(f"grammar queue is full ({self.max_queued} requests compiling); retry later")
            self._queued += 1
        fut = self._pool.submit(self._compile, c, key)
        fut.add_done_callback(self._dequeue)
        return fut

    def _dequeue(self, _: Future) -> None:
        with self._lock:
            self._queued -= 1

    def _compile(self, c: Constraint, key: tuple) -> CompiledGrammar:
        text = grammar.to_grammar(c)
        m = llguidance.LLMatcher(self._tokenizer.result(), text, log_level=0, limits=LIMITS)
        if not m.is_error():
            # errors in lexemes only surface when the first mask is computed
            fill_masks([(GrammarState(m, self.words), 0)], np.zeros((1, self.words), np.int32))
        if m.is_error():
            raise InvalidRequest(f"{grammar.field_name(c)}: {grammar.first_lines(m.get_error())}")
        out = CompiledGrammar(m, self.words)
        with self._lock:
            self._cache[key] = out
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
