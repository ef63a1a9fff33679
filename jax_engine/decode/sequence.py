"""A generation request and its sequences (one per `n`), as plain dataclasses."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from jax_engine.constrain.state import GrammarState
from jax_engine.decode.detokenizer import IncrementalDetokenizer
from jax_engine.decode.speculate import SpecTrack
from jax_engine.types import GenerateOutput, SamplingParams, TokenLogprob

_arrival = itertools.count()


class SeqState(enum.Enum):
    WAITING = 0     # not admitted, or preempted and requeued
    PREFILL = 1     # admitted, prompt (or recompute) chunks pending
    RUNNING = 2     # decoding
    FINISHED = 3


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[GenerateOutput], None]
    max_new_tokens: int
    priority: int = 0
    seed: int = 0
    arrival: int = field(default_factory=lambda: next(_arrival))
    seqs: list["Sequence"] = field(default_factory=list)
    aborted: bool = False
    # decoder-as-embedder: prefill only, then this receives the last token's final hidden state
    on_embedding: Optional[Callable[[np.ndarray], None]] = None
    # LoRA: the adapter slot every row of this request carries (0 = the base model), the prefix-cache
    # root its pages are keyed under (b"" = base; unique per adapter load), and a callback run once
    # when the scheduler forgets the request (releases the adapter)
    lora_slot: int = 0
    hash_root: bytes = b""
    on_release: Optional[Callable[[], None]] = None

    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)


@dataclass
class Sequence:
    req: Request
    index: int
    detok: Optional[IncrementalDetokenizer] = None
    output_ids: list[int] = field(default_factory=list)
    state: SeqState = SeqState.WAITING
    pages: list[int] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full pages registered
    num_computed: int = 0        # tokens whose KV is in the cache
    cached_tokens: int = 0       # prompt tokens served from the prefix cache
    slot: int = -1               # penalty-state row while admitted
    followers: list["Sequence"] = field(default_factory=list)  # n>1 siblings waiting on this prefill
    leader: Optional["Sequence"] = None
    emitted_prompt_lp: bool = False
    prompt_lps: list[Optional[TokenLogprob]] = field(default_factory=list)
    preemptions: int = 0
    grammar: Optional[GrammarState] = None   # structured generation: the next token's allowed set
    spec: Optional[SpecTrack] = None         # speculative decoding: its proposer and acceptance
    drafts: list[int] = field(default_factory=list)   # the guesses this step verifies

    @property
    def tokens(self) -> list[int]:
        return self.req.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        """tokens[-1] without building tokens (a decode row's query token, every step)."""
        return self.output_ids[-1] if self.output_ids else self.req.prompt_ids[-1]

    @property
    def total_len(self) -> int:
        return len(self.req.prompt_ids) + len(self.output_ids)

    @property
    def target_computed(self) -> int:
        """KV needed before the next step: whole prompt before the first token, else all but the last."""
        return len(self.req.prompt_ids) if not self.output_ids else self.total_len - 1

    @property
    def seed(self) -> int:
        return (self.req.seed + self.index * 0x9E3779B9) & 0xFFFFFFFFFFFFFFFF
