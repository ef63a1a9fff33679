"""The typed rows a scheduler hands its ModelRunner: one per decoding sequence, with its sampling."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


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


@dataclass
class DecodeRow:
    """One running sequence in a decode step."""

    token: int                          # the last token, whose KV this step writes
    position: int                       # its position
    kv_slot: int                        # its cell in the paged KV cache (page * page_size + offset)
    pages: list[int]                    # the sequence's page table
    slot_id: int                        # its row of the penalty state
    sampling: Optional[SamplingRow] = None


ROW_TYPES = {t.__name__: t for t in (SamplingRow, DecodeRow)}   # multihost.decode rebuilds these
