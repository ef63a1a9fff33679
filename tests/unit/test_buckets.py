"""The encoder bucket planner (jax_engine/encode/worker.py): the (batch, sequence) buckets an
embedding budget allows, and `plan_groups`, which splits one request's inputs into bucketed
groups at least cost. Pure arithmetic: no model, nothing compiled."""
from __future__ import annotations

import random

import pytest

from jax_engine.encode.worker import EncoderBuckets, plan_groups
from jax_engine.errors import InvalidRequest
from tests.helpers.encoders import one_bucket_padded


def test_buckets_cover_budget():
    b = EncoderBuckets(max_len=300, max_batch_tokens=1024)
    assert b.seq_lens == [16, 32, 48, 64, 96, 128, 192, 256, 300]
    assert b.seq_bucket(17) == 32 and b.seq_bucket(33) == 48 and b.seq_bucket(299) == 300
    assert all(bs * s <= 1024 for bs, s in b.keys())
    assert (64, 16) in b.keys() and (2, 300) in b.keys() and (4, 300) not in b.keys()
    capped = EncoderBuckets(max_len=300, max_batch_tokens=1024, max_program_tokens=256)
    assert all(bs * s <= 256 or bs == 1 for bs, s in capped.keys()) and (16, 16) in capped.keys()
    assert (1, 300) in capped.keys() and (32, 16) not in capped.keys()  # the longest input still fits
    with pytest.raises(InvalidRequest, match="embed_max_batch_tokens"):
        EncoderBuckets(max_len=512, max_batch_tokens=256)


def _check_plan(lengths: list[int], b: EncoderBuckets, plan) -> None:
    keys = set(b.keys())
    assert sorted(k for _, _, idx in plan for k in idx) == list(range(len(lengths)))
    for bs, s, idx in plan:
        assert (bs, s) in keys and len(idx) <= bs and b.batch_bucket(len(idx)) == bs
        assert max(lengths[k] for k in idx) <= s


def _brute_force_cost(sl: list[int], b: EncoderBuckets) -> float:
    """Least cost over every split of the sorted lengths into contiguous groups."""
    from functools import lru_cache

    @lru_cache(None)
    def best(i: int) -> float:
        if i == len(sl):
            return 0.0
        out = float("inf")
        for j in range(i + 1, len(sl) + 1):
            for s in b.seq_lens:
                if s >= sl[j - 1] and j - i <= b.max_batch(s):
                    out = min(out, b.cost(b.batch_bucket(j - i), s) + best(j))
        return out

    return best(0)


def test_plan_groups_is_exact_and_beats_one_bucket():
    b = EncoderBuckets(max_len=256, max_batch_tokens=8192, max_program_tokens=2048,
                       attn_tokens=2304, dispatch_tokens=16)
    rng = random.Random(11)
    for n in (1, 2, 5, 9, 14):
        for _ in range(6):
            lengths = [rng.choice([rng.randint(3, 20), rng.randint(20, 70), rng.randint(70, 256)])
                       for _ in range(n)]
            plan = plan_groups(lengths, b)
            _check_plan(lengths, b, plan)
            got = sum(b.cost(bs, s) for bs, s, _ in plan)
            assert got == pytest.approx(_brute_force_cost(sorted(lengths), b))
    # a 57-input request of very different lengths: far less padding than one bucket
    lengths = [rng.choice([rng.randint(4, 14), rng.randint(15, 40), rng.randint(41, 250)]) for _ in range(57)]
    plan = plan_groups(lengths, b)
    _check_plan(lengths, b, plan)
    one = EncoderBuckets(max_len=256, max_batch_tokens=8192)
    assert b.padded_tokens(plan) < 0.6 * one_bucket_padded(lengths, one)
    assert plan_groups([], b) == []
    with pytest.raises(InvalidRequest):
        plan_groups([257], b)
