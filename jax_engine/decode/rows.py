"""The typed rows a scheduler hands its ModelRunner for one ragged step."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingRow:
    """One sequence's sampling settings for a step (what sampling.host_arrays packs)."""

    temperature: float = 0.0
    top_k: int = 0                      # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    rep_pen: float = 1.0
    freq_pen: float = 0.0
    pres_pen: float = 0.0
    seeds: int = 0                      # the request's 64-bit seed
    steps: int = 0                      # tokens generated so far (advances the random stream)
    bias: list = field(default_factory=list)   # [(token id, logit bias)]
    ban: list = field(default_factory=list)    # token ids banned until min_new_tokens
    logprobs: bool = True               # whether the step computes its logprob and top-N (False:
                                        # zeros, when no row of the step asks: runner's step)

    def at_step(self, steps: int, ban: list) -> "SamplingRow":
        """These settings for a later token of the same sequence (speculation's guesses): a copy
        with `steps` and `ban` replaced, without dataclasses.replace's per-field work."""
        row = object.__new__(SamplingRow)
        row.__dict__.update(self.__dict__)
        row.steps, row.ban = steps, ban
        return row


@dataclass
class SampleRow:
    """A token to draw from a step row's logits, for the sequence owning penalty slot `slot_id`
    (a prompt's n > 1 sequences draw their first tokens from the same row).

    Speculative decoding verifies a row's proposed tokens d1..dk with one sample per position:
    sample j sits at row token `at` = j, is checked against `draft` = d(j+1) (-1 for the last
    position: a free draw) and counts `prior` = d1..dj as already generated (penalties). The
    samples of one row are consecutive; the first failed check ends what the row emits."""

    slot_id: int
    sampling: SamplingRow
    at: int = -1                        # index into the row's tokens (-1: its last token)
    draft: int = -1                     # the proposed next token this sample verifies (-1: none)
    prior: list = field(default_factory=list)   # proposed tokens before this position (penalty counts)


@dataclass
class StepRow:
    """One sequence's query tokens in a ragged step: a running sequence's last token (decode) or
    a chunk of its prompt (prefill), whose KV the step writes at positions start, start + 1, ..."""

    tokens: list[int]
    start: int                          # position of tokens[0]
    pages: list[int]                    # the sequence's page table (covers start + len(tokens))
    samples: list[SampleRow] = field(default_factory=list)   # none for a chunk that does not end a prompt
    lora_slot: int = 0                  # the LoRA adapter slot its tokens run under (0 = the base model)
    cached: int = 0                     # leading tokens whose KV the cache already holds in a page other
                                        # requests may share: the step computes their queries and reads
                                        # that KV but does not write it (a fully cached prompt's last token)


ROW_TYPES = {t.__name__: t for t in (SamplingRow, SampleRow, StepRow)}   # multihost.decode rebuilds these
