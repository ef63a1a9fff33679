"""The decode Scheduler (jax_engine/decode/scheduler.py) driven step by step over a fake
ModelRunner that returns deterministic tokens (next token = last token + 1) and compiles nothing:
admission and prefill chunks under the token budget, prefix reuse, preemption when pages run
out (recomputed, never dropped), abort, and a request larger than the pool. tests/engine/
test_scheduler.py covers the same scheduler through the Engine with a real model."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from jax_engine.decode.page_pool import PagePool
from jax_engine.decode.scheduler import Scheduler
from jax_engine.decode.sequence import Request, Sequence
from jax_engine.types import SamplingParams

VOCAB = 1000


def _pick(buckets: list[int], n: int) -> int:
    return next(b for b in buckets if b >= n)


class FakeRunner:
    """The members of ModelRunner the scheduler calls; records every prefill and decode call."""

    def __init__(self, max_running: int = 4, max_batched_tokens: int = 16, page_size: int = 4):
        self.rc = SimpleNamespace(max_running=max_running, max_batched_tokens=max_batched_tokens, page_size=page_size)
        self.token_buckets = [b for b in (4, 8, 16, 32, 64) if b <= max_batched_tokens]
        self.prefill_batch_buckets = [b for b in (1, 2, 4, 8) if b * self.token_buckets[0] <= max_batched_tokens]
        self.prefills: list[list[tuple[list[int], int, list[int]]]] = []
        self.decodes: list[list] = []
        self.events: list[str] = []

    def prefill_shape(self, lens, kv_lens):
        return _pick(self.prefill_batch_buckets, len(lens)), _pick(self.token_buckets, max(lens)), 0

    def set_slot(self, slot, prompt_ids, output_ids):
        pass

    def prefill(self, chunks):
        self.prefills.append([(list(t), start, list(pages)) for t, start, pages in chunks])
        self.events.append("prefill")
        return [t[-1] for t, _, _ in chunks], lambda: None

    def first_tokens(self, raw, rows, slots):
        n = len(rows)
        return np.full(n, (raw + 1) % VOCAB), np.zeros(n), np.zeros((n, 0)), np.zeros((n, 0), np.int64)

    def decode(self, rows, greedy):
        self.decodes.append(rows)
        self.events.append("decode")
        n = len(rows)
        return np.array([(r.token + 1) % VOCAB for r in rows]), np.zeros(n), np.zeros((n, 0)), np.zeros((n, 0), np.int64)

    def copy_page(self, src, dst):
        pass

    def state_lost(self) -> bool:
        return False

    def reset_state(self) -> None:
        pass


def make(num_pages: int = 64, **runner_kw) -> Scheduler:
    runner = FakeRunner(**runner_kw)
    return Scheduler(runner, PagePool(num_pages, runner.rc.page_size), eos_ids=set(), max_model_len=256, name="fake")


def submit(sched: Scheduler, rid: str, prompt: list[int], n: int) -> list:
    outs: list = []
    req = Request(request_id=rid, prompt_ids=list(prompt), params=SamplingParams(temperature=0.0, ignore_eos=True),
                  sink=outs.append, max_new_tokens=n)
    req.seqs.append(Sequence(req=req, index=0))
    sched.submit(req)
    return outs


def run(sched: Scheduler, max_steps: int = 500) -> int:
    steps = 0
    sched._drain_control()
    while sched.waiting or sched.prefilling or sched.running:
        sched.step()
        sched._drain_control()
        steps += 1
        assert steps < max_steps, "the scheduler made no progress"
    return steps


def tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def assert_idle_and_clean(sched: Scheduler) -> None:
    assert sched.load() == 0 and not (sched.waiting or sched.prefilling or sched.running)
    assert sched.pool.num_used() == 0, "pages leaked"
    assert sorted(sched.free_slots) == list(range(sched.max_running)), "slots leaked"


def test_deterministic_tokens_length_finish_and_clean_pool():
    sched = make()
    outs = submit(sched, "a", [1, 2, 3, 4, 5], 4)
    run(sched)
    assert tokens(outs) == [6, 7, 8, 9]
    assert [o.finished for o in outs] == [False, False, False, True] and outs[-1].finish_reason == "length"
    assert outs[-1].prompt_tokens == 5 and outs[-1].completion_tokens == 4
    assert sched.total_prompt_tokens == 5 and sched.total_generated_tokens == 4
    assert_idle_and_clean(sched)


def test_prefill_stays_under_the_token_budget_and_a_long_prompt_does_not_stall_decoding():
    sched = make(max_batched_tokens=16)
    r = sched.runner
    short = submit(sched, "short", [10, 11, 12], 12)
    sched._drain_control()
    sched.step()                                    # "short" is prefilled and decoding
    assert sched.running and r.events == ["prefill", "decode"]
    long_prompt = list(range(100, 140))             # 40 tokens: more than one chunk
    longer = submit(sched, "long", long_prompt, 3)
    other = submit(sched, "other", [200] * 12, 3)
    run(sched)
    for call in r.prefills:
        lens = [len(t) for t, _, _ in call]
        rows, width, _ = r.prefill_shape(lens, lens)
        assert rows * width <= r.rc.max_batched_tokens, call
        assert max(lens) <= r.token_buckets[-1]
    # the long prompt went in several chunks at increasing start positions, each followed by a decode
    starts = [start for call in r.prefills for t, start, _ in call if t[0] in long_prompt]
    assert len(starts) >= 3 and starts == sorted(starts) and starts[0] == 0
    first, last = r.events.index("prefill", 2), len(r.events) - 1 - r.events[::-1].index("prefill")
    assert all(b == "decode" for a, b in zip(r.events[first:last], r.events[first + 1:last + 1]) if a == "prefill")
    assert tokens(short) == list(range(13, 25))
    assert tokens(longer) == [140, 141, 142] and tokens(other) == [201, 202, 203]
    assert_idle_and_clean(sched)


def test_rows_limit_admission():
    sched = make(max_running=2)
    outs = [submit(sched, f"r{i}", [i * 10 + 1, i * 10 + 2], 3) for i in range(4)]
    sched._drain_control()
    sched.step()
    assert len(sched.running) + len(sched.prefilling) == 2 and len(sched.waiting) == 2
    run(sched)
    assert [tokens(o) for o in outs] == [[i * 10 + 3, i * 10 + 4, i * 10 + 5] for i in range(4)]
    assert_idle_and_clean(sched)


def test_prefix_pages_are_reused_by_a_later_request():
    sched = make(page_size=4)
    first = submit(sched, "a", list(range(1, 13)), 2)           # 12 tokens: 3 full pages
    run(sched)
    assert first[-1].cached_tokens == 0
    second = submit(sched, "b", list(range(1, 9)) + [70, 71, 72, 73, 74], 2)
    run(sched)
    assert second[-1].cached_tokens == 8                         # the two shared full pages
    starts = [start for t, start, _ in sched.runner.prefills[-1]]
    assert starts == [8]                                         # only the new tokens were computed
    assert tokens(second) == [75, 76]
    assert sched.pool.hit_tokens == 8
    assert_idle_and_clean(sched)


def test_pages_running_out_preempt_the_newest_and_it_is_recomputed():
    # 6 usable pages of 4 tokens; two requests that each grow to 5 pages cannot both fit
    sched = make(num_pages=7, page_size=4, max_batched_tokens=16)
    a = submit(sched, "a", list(range(1, 9)), 12)
    b = submit(sched, "b", list(range(50, 58)), 12)
    run(sched)
    assert sched.preemptions >= 1
    assert tokens(a) == list(range(9, 21)) and tokens(b) == list(range(58, 70))
    assert a[-1].finish_reason == b[-1].finish_reason == "length"
    # the victim is the newer request; its prompt and generated tokens were computed again
    recomputed = [start for call in sched.runner.prefills for t, start, _ in call if t[0] == 50]
    assert len(recomputed) >= 2
    assert_idle_and_clean(sched)


def test_abort_while_waiting_and_while_running_returns_everything():
    sched = make()
    waiting = submit(sched, "w", [1, 2, 3], 5)
    assert sched.abort("w") and not sched.abort("nope")
    run(sched)
    assert [(o.finish_reason, o.new_token_ids) for o in waiting] == [("abort", [])]
    running = submit(sched, "r", [1, 2, 3, 4, 5, 6], 100)
    sched._drain_control()
    for _ in range(3):
        sched.step()
    assert sched.running and sched.pool.num_used() > 0
    assert sched.abort("r")
    sched._drain_control()
    assert running[-1].finished and running[-1].finish_reason == "abort"
    assert tokens(running) == [7, 8, 9, 10]              # step 1 prefills and decodes: 2 tokens
    assert_idle_and_clean(sched)


def test_a_request_larger_than_the_pool_fails_alone():
    sched = make(num_pages=4, page_size=4)                      # 3 usable pages
    big = submit(sched, "big", list(range(1, 21)), 2)           # needs 5 pages
    small = submit(sched, "small", [1, 2], 2)
    run(sched)
    assert big[-1].finish_reason == "error" and "needs 5 KV pages but the pool has 3" in big[-1].error
    assert tokens(small) == [3, 4]
    assert_idle_and_clean(sched)


def test_a_consumer_that_raises_aborts_its_request():
    sched = make()
    req = Request(request_id="x", prompt_ids=[1, 2], params=SamplingParams(temperature=0.0, ignore_eos=True),
                  sink=lambda out: (_ for _ in ()).throw(RuntimeError("client gone")), max_new_tokens=50)
    req.seqs.append(Sequence(req=req, index=0))
    sched.submit(req)
    run(sched)
    assert req.aborted and sched.total_generated_tokens < 50
    assert_idle_and_clean(sched)
