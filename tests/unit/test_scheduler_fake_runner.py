"""The decode Scheduler (jax_engine/decode/scheduler.py) driven step by step over a fake
ModelRunner that returns deterministic tokens (next token = the row's last token + 1) and
compiles nothing: admission and prefill chunks under the token budget, prefix reuse, preemption
when pages run out (recomputed, never dropped), abort, and a request larger than the pool.

Every test also checks the ragged-step contract on every step the fake recorded (check_contract):
decode rows first, one token and one sample per running sequence; then prefill chunks FIFO
under the token budget, only the last one cut by it; a chunk that ends a prompt samples for the
sequence and its n > 1 followers. tests/engine/test_scheduler.py covers the same scheduler
through the Engine with a real model."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import numpy as np

from jax_engine.decode.latency_guard import LatencyGuard
from jax_engine.decode.page_pool import PagePool
from jax_engine.decode.rows import SampleRow, StepRow
from jax_engine.decode.runner import StepResult
from jax_engine.decode.scheduler import Scheduler
from jax_engine.decode.sequence import Request, Sequence
from jax_engine.types import SamplingParams, TokenLogprob

VOCAB = 1000
HIDDEN = 4


@dataclass
class Decoding:
    """A running sequence as the scheduler held it when it called runner.step."""

    rid: str
    index: int
    slot: int
    last: int           # its last token (the decode row's one token)
    position: int       # that token's position


@dataclass
class Prefilling:
    """A prefilling sequence (FIFO order) as the scheduler held it when it called runner.step."""

    rid: str
    tokens: list[int]
    computed: int       # tokens whose KV is already cached
    target: int         # KV needed before it decodes
    slots: list[int]    # its own slot, then its n > 1 followers'
    resumes: bool       # recompute after preemption: no first token to draw


@dataclass
class Step:
    rows: list[StepRow]
    greedy: bool
    running: list[Decoding]
    prefilling: list[Prefilling]

    @property
    def decode_rows(self) -> list[StepRow]:
        return self.rows[:len(self.running)]

    @property
    def chunks(self) -> list[tuple[Prefilling, StepRow]]:
        return list(zip(self.prefilling, self.rows[len(self.running):]))

    @property
    def num_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)

    def decoded(self, rid: str) -> bool:
        return any(d.rid == rid for d in self.running)


class FakeRunner:
    """The members of ModelRunner the scheduler uses; records every step with the scheduler's
    running and prefilling sequences at the time of the call (`sched` is set by make())."""

    def __init__(self, max_running: int = 4, max_batched_tokens: int = 16, page_size: int = 4):
        self.rc = SimpleNamespace(max_running=max_running, max_batched_tokens=max_batched_tokens, page_size=page_size)
        self.max_tokens = max(max_batched_tokens, max_running)      # as ModelRunner: a decode row each
        self.budget_tokens = self.max_tokens                          # no burst budget (tested with the engine)
        self.token_buckets = [1, 2, 4, 8, 16, 32, 64]                  # speculation's cost widths
        self.sched: Optional[Scheduler] = None
        self.steps: list[Step] = []
        self.copies: list[tuple[int, int]] = []
        self.slot_sets: list[tuple[int, list[int], list[int]]] = []
        self.prompt_lp_calls: list[tuple[int, list[int], int]] = []   # (hidden rows, next tokens, n)

    def _snapshot(self) -> tuple[list[Decoding], list[Prefilling]]:
        s = self.sched
        running = [Decoding(q.req.request_id, q.index, q.slot, q.tokens[-1], q.total_len - 1) for q in s.running]
        prefilling = [Prefilling(q.req.request_id, list(q.tokens), q.num_computed, q.target_computed,
                                 [q.slot] + [f.slot for f in q.followers], bool(q.output_ids)) for q in s.prefilling]
        return running, prefilling

    def step(self, rows: list[StepRow], greedy: bool, masks=None) -> StepResult:
        assert masks is None                 # no request here is constrained (tests/engine/test_constraints.py)
        running, prefilling = self._snapshot()
        rows = [StepRow(list(r.tokens), r.start, list(r.pages), list(r.samples), cached=r.cached) for r in rows]
        self.steps.append(Step(rows, greedy, running, prefilling))
        toks = [(r.tokens[-1] + 1) % VOCAB for r in rows for _ in r.samples]
        n, T = len(toks), sum(len(r.tokens) for r in rows)
        starts = np.cumsum([0] + [len(r.tokens) for r in rows])[:-1].tolist()
        return StepResult(np.array(toks, np.int64), np.zeros(n, np.float32), np.zeros((n, 0), np.float32),
                          np.zeros((n, 0), np.int64), starts, lambda: np.zeros((T, HIDDEN), np.float32))

    def prompt_logprobs(self, h_rows, next_tokens, n):
        """Logprob -t for next token t (so a test can tell positions apart); no top-N."""
        self.prompt_lp_calls.append((len(h_rows), list(next_tokens), n))
        chosen = np.zeros(n, np.float32)
        chosen[:len(next_tokens[:n])] = [-t for t in next_tokens[:n]]
        return chosen, np.zeros((n, 0), np.float32), np.zeros((n, 0), np.int64)

    def set_slot(self, slot, prompt_ids, output_ids):
        self.slot_sets.append((slot, list(prompt_ids), list(output_ids)))

    def copy_page(self, src, dst):
        self.copies.append((src, dst))

    def state_lost(self) -> bool:
        return False

    def reset_state(self) -> None:
        pass


def make(num_pages: int = 64, **runner_kw) -> Scheduler:
    runner = FakeRunner(**runner_kw)
    sched = Scheduler(runner, PagePool(num_pages, runner.rc.page_size), eos_ids=set(), max_model_len=256, name="fake")
    runner.sched = sched
    return sched


def submit(sched: Scheduler, rid: str, prompt: list[int], new: int, n: int = 1, **params) -> list:
    outs: list = []
    sp = SamplingParams(temperature=0.0, ignore_eos=True, n=n, **params)
    req = Request(request_id=rid, prompt_ids=list(prompt), params=sp, sink=outs.append, max_new_tokens=new)
    req.seqs.extend(Sequence(req=req, index=i) for i in range(n))
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


def tokens(outs: list, index: int = 0) -> list[int]:
    return [t for o in outs if o.index == index for t in o.new_token_ids]


def check_contract(sched: Scheduler) -> None:
    """The ragged-step contract, on every step the fake runner saw."""
    r = sched.runner
    ps = r.rc.page_size
    for i, st in enumerate(r.steps):
        where = f"step {i}: {st}"
        assert 0 < st.num_tokens <= r.max_tokens, where
        # decode rows first: one per running sequence, in order, its last token at its position
        assert len(st.rows) >= len(st.running), where
        for d, row in zip(st.running, st.decode_rows):
            assert row.tokens == [d.last] and row.start == d.position, where
            assert [s.slot_id for s in row.samples] == [d.slot], where
        # then prefill chunks, FIFO over the prefilling sequences; only the budget cuts them
        chunks = st.chunks
        assert len(st.rows) - len(st.running) == len(chunks) <= len(st.prefilling), where
        for k, (p, row) in enumerate(chunks):
            end = row.start + len(row.tokens)
            assert row.start == p.computed and 0 < len(row.tokens) and end <= p.target, where
            assert row.tokens == p.tokens[row.start:end], where
            if end < p.target:              # a cut chunk is the last one and the budget is spent
                assert k == len(chunks) - 1 and st.num_tokens == r.max_tokens, where
            ends_prompt = end == p.target and not p.resumes
            assert [s.slot_id for s in row.samples] == (p.slots if ends_prompt else []), where
        if len(chunks) < len(st.prefilling):
            assert st.num_tokens == r.max_tokens, where
        # every row's page table covers its tokens; every sample is a distinct sequence's slot
        for row in st.rows:
            assert len(row.pages) * ps >= row.start + len(row.tokens) and 0 not in row.pages, where
            assert all(isinstance(s, SampleRow) for s in row.samples), where
        slots = [s.slot_id for row in st.rows for s in row.samples]
        assert len(set(slots)) == len(slots) and all(0 <= s < sched.max_running for s in slots), where
        assert st.greedy                    # every request here is greedy


def assert_idle_and_clean(sched: Scheduler) -> None:
    assert sched.load() == 0 and not (sched.waiting or sched.prefilling or sched.running)
    assert sched.pool.num_used() == 0, "pages leaked"
    assert sorted(sched.free_slots) == list(range(sched.max_running)), "slots leaked"
    check_contract(sched)


def test_deterministic_tokens_length_finish_and_clean_pool():
    sched = make()
    outs = submit(sched, "a", [1, 2, 3, 4, 5], 4)
    assert run(sched) == 4                          # the prompt's step draws the first token
    assert tokens(outs) == [6, 7, 8, 9]
    assert [o.finished for o in outs] == [False, False, False, True] and outs[-1].finish_reason == "length"
    assert outs[-1].prompt_tokens == 5 and outs[-1].completion_tokens == 4
    assert sched.total_prompt_tokens == 5 and sched.total_generated_tokens == 4
    steps = sched.runner.steps
    assert [(len(s.running), [len(r.tokens) for r in s.rows]) for s in steps] == [(0, [5]), (1, [1]), (1, [1]), (1, [1])]
    assert [r.start for s in steps for r in s.rows] == [0, 5, 6, 7]
    assert_idle_and_clean(sched)


def test_a_long_prompt_is_chunked_under_the_budget_while_decoding_goes_on_in_the_same_steps():
    sched = make(max_batched_tokens=16)
    r = sched.runner
    short = submit(sched, "short", [10, 11, 12], 12)
    sched._drain_control()
    sched.step()                                    # "short": prompt and first token in one step
    assert sched.running and len(r.steps) == 1 and tokens(short) == [13]
    long_prompt = list(range(100, 140))             # 40 tokens: more than one chunk
    longer = submit(sched, "long", long_prompt, 3)
    other = submit(sched, "other", [200] * 12, 3)
    run(sched)
    assert all(s.num_tokens <= r.max_tokens == 16 for s in r.steps)
    # the long prompt went in chunks at increasing start positions, one per step, filling the budget
    # that "short"'s decode token left, and "short" decoded in every one of those steps
    long_steps = [(i, row) for i, s in enumerate(r.steps) for p, row in s.chunks if p.rid == "long"]
    assert [row.start for _, row in long_steps] == [0, 15, 30]
    assert [len(row.tokens) for _, row in long_steps] == [15, 15, 10]
    assert [i for i, _ in long_steps] == [1, 2, 3]
    assert all(r.steps[i].decoded("short") and r.steps[i].decode_rows[0].tokens == [tokens(short)[i - 1]]
               for i, _ in long_steps)
    # the decode stream never skipped a step: one token per step from its first to its last
    short_steps = [i for i, s in enumerate(r.steps) if s.decoded("short")]
    assert short_steps == list(range(1, 12))
    # the chunk ending the long prompt sampled its first token; "other"'s first chunk shared its step
    last = r.steps[3]
    assert [(p.rid, row.start, len(row.tokens), len(row.samples)) for p, row in last.chunks] == [
        ("long", 30, 10, 1), ("other", 0, 5, 0)]
    assert [len(row.tokens) for row in last.rows] == [1, 10, 5] and last.num_tokens == 16
    # the step after: two decode rows, then the rest of "other"'s prompt with its first token
    nxt = r.steps[4]
    assert [d.rid for d in nxt.running] == ["short", "long"]
    assert [(p.rid, row.start, len(row.tokens), len(row.samples)) for p, row in nxt.chunks] == [("other", 5, 7, 1)]
    assert tokens(short) == list(range(13, 25))
    assert tokens(longer) == [140, 141, 142] and tokens(other) == [201, 202, 203]
    assert_idle_and_clean(sched)


def test_chunks_of_several_prompts_share_one_step():
    sched = make(max_batched_tokens=16, max_running=4)
    outs = [submit(sched, f"p{i}", [i * 100 + j for j in range(4)], 2) for i in range(3)]
    assert run(sched) == 2
    first = sched.runner.steps[0]
    assert not first.running
    assert [(p.rid, row.start, row.tokens, len(row.samples)) for p, row in first.chunks] == [
        (f"p{i}", 0, [i * 100 + j for j in range(4)], 1) for i in range(3)]
    second = sched.runner.steps[1]
    assert [(d.rid, row.tokens) for d, row in zip(second.running, second.decode_rows)] == [
        (f"p{i}", [i * 100 + 4]) for i in range(3)]
    assert [tokens(o) for o in outs] == [[i * 100 + 4, i * 100 + 5] for i in range(3)]
    assert_idle_and_clean(sched)


def test_the_chunk_ending_an_n3_prompt_samples_all_three_sequences():
    sched = make(max_batched_tokens=4, max_running=4, page_size=4)
    prompt = list(range(1, 7))                      # 6 tokens: two chunks; the last page is partial
    outs = submit(sched, "n3", prompt, 3, n=3)
    run(sched)
    r = sched.runner
    chunks = [(i, row) for i, s in enumerate(r.steps) for _, row in s.chunks]
    assert [(i, row.start, row.tokens) for i, row in chunks] == [(0, 0, [1, 2, 3, 4]), (1, 4, [5, 6])]
    assert chunks[0][1].samples == []               # the first chunk ends nothing
    samples = chunks[1][1].samples
    assert len(samples) == 3 and len({s.slot_id for s in samples}) == 3
    # each fork copied the leader's partial page; then three decode rows per step
    assert len(r.copies) == 2 and len({dst for _, dst in r.copies}) == 2
    assert [len(s.running) for s in r.steps[2:]] == [3, 3]
    assert [d.index for d in r.steps[2].running] == [0, 1, 2]
    assert [tokens(outs, i) for i in range(3)] == [[7, 8, 9]] * 3
    assert sum(o.finished for o in outs) == 3
    assert_idle_and_clean(sched)


def test_rows_limit_admission():
    sched = make(max_running=2)
    outs = [submit(sched, f"r{i}", [i * 10 + 1, i * 10 + 2], 3) for i in range(4)]
    sched._drain_control()
    sched.step()
    assert len(sched.running) + len(sched.prefilling) == 2 and len(sched.waiting) == 2
    run(sched)
    assert [tokens(o) for o in outs] == [[i * 10 + 3, i * 10 + 4, i * 10 + 5] for i in range(4)]
    assert max(len(s.rows) for s in sched.runner.steps) == 2
    assert_idle_and_clean(sched)


def test_prefix_pages_are_reused_by_a_later_request():
    sched = make(page_size=4)
    first = submit(sched, "a", list(range(1, 13)), 2)           # 12 tokens: 3 full pages
    run(sched)
    assert first[-1].cached_tokens == 0
    n_before = len(sched.runner.steps)
    second = submit(sched, "b", list(range(1, 9)) + [70, 71, 72, 73, 74], 2)
    run(sched)
    assert second[-1].cached_tokens == 8                         # the two shared full pages
    chunks = [row for s in sched.runner.steps[n_before:] for _, row in s.chunks]
    assert [(row.start, row.tokens) for row in chunks] == [(8, [70, 71, 72, 73, 74])]   # only the new tokens
    assert chunks[0].pages[:2] == sched.runner.steps[0].rows[0].pages[:2]                # the cached pages
    assert tokens(second) == [75, 76]
    assert sched.pool.hit_tokens == 8
    assert_idle_and_clean(sched)


def test_a_fully_cached_prompt_computes_only_its_last_token_without_writing_its_kv():
    sched = make(page_size=4)
    prompt = list(range(1, 13))                                  # 12 tokens: 3 full pages
    first = submit(sched, "a", prompt, 2)
    run(sched)
    n_before = len(sched.runner.steps)
    again = submit(sched, "b", prompt, 2, n=2)                   # n = 2: both forks share every page
    run(sched)
    chunks = [row for s in sched.runner.steps[n_before:] for _, row in s.chunks]
    # one row: the last prompt token at its position, its KV left as cached (row.cached), all 3 pages shared
    assert [(row.start, row.tokens, row.cached) for row in chunks] == [(11, [12], 1)]
    assert chunks[0].pages == sched.runner.steps[0].chunks[0][1].pages
    leader, _ = sched.runner.steps[n_before].chunks[0]
    assert [s.slot_id for s in chunks[0].samples] == leader.slots                   # both forks draw there
    assert tokens(again, 0) == tokens(again, 1) == tokens(first) == [13, 14]
    assert again[-1].cached_tokens == 11 and sched.pool.hit_tokens == 11
    # a chunk that computes new tokens never marks any of them cached
    assert all(row.cached == 0 for s in sched.runner.steps[:n_before] for row in s.rows)
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
    b_chunks = [(p, row) for s in sched.runner.steps for p, row in s.chunks if p.rid == "b"]
    assert [row.start for _, row in b_chunks].count(0) >= 2
    recomputes = [(p, row) for p, row in b_chunks if p.resumes]
    assert recomputes and all(row.samples == [] for _, row in recomputes)             # no token drawn twice
    assert all(row.tokens == p.tokens[row.start:row.start + len(row.tokens)] and len(row.tokens) > 8
               for p, row in recomputes if row.start == 0)                           # prompt + outputs
    assert_idle_and_clean(sched)


def test_a_recompute_holding_the_pages_is_preempted_for_an_older_running_sequence():
    """Four requests that each grow to 9 of the 11 usable pages: whenever the pool runs dry the
    newest admitted sequence gives way, prefilling or not, so the oldest always progresses (when
    only running sequences were victims, a running one preempted itself while a newer recompute
    held the pages, and so on for ever). Prompt logprobs collected before a mid-prefill
    preemption are not doubled."""
    sched = make(num_pages=12, page_size=8, max_batched_tokens=64, max_running=4)
    outs = [submit(sched, f"r{i}", [20 + i] * 9, 60) for i in range(3)]
    lp = submit(sched, "lp", list(range(30, 39)), 60, prompt_logprobs_start=0)
    run(sched, max_steps=3000)
    assert sched.preemptions > 0
    for o in outs + [lp]:
        assert len(tokens(o)) == 60 and o[-1].finish_reason == "length"
    prompt_lps = next(o.prompt_logprobs for o in lp if o.prompt_logprobs is not None)
    assert len(prompt_lps) == 9 and prompt_lps[0] is None
    assert_idle_and_clean(sched)


def test_abort_while_waiting_and_while_running_returns_everything():
    sched = make()
    waiting = submit(sched, "w", [1, 2, 3], 5)
    assert sched.abort("w") and not sched.abort("nope")
    run(sched)
    assert [(o.finish_reason, o.new_token_ids) for o in waiting] == [("abort", [])]
    assert sched.runner.steps == []
    running = submit(sched, "r", [1, 2, 3, 4, 5, 6], 100)
    sched._drain_control()
    for _ in range(3):
        sched.step()
    assert sched.running and sched.pool.num_used() > 0
    assert sched.abort("r")
    sched._drain_control()
    assert running[-1].finished and running[-1].finish_reason == "abort"
    assert tokens(running) == [7, 8, 9]                  # step 1 prefills and draws the first token
    assert_idle_and_clean(sched)


def test_a_request_larger_than_the_pool_fails_alone():
    sched = make(num_pages=4, page_size=4)                      # 3 usable pages
    big = submit(sched, "big", list(range(1, 21)), 2)           # needs 5 pages
    small = submit(sched, "small", [1, 2], 2)
    run(sched)
    assert big[-1].finish_reason == "error" and "needs 5 KV pages but the pool has 3" in big[-1].error
    assert tokens(small) == [3, 4]
    assert all(p.rid == "small" for s in sched.runner.steps for p, _ in s.chunks)
    assert_idle_and_clean(sched)


def test_prompt_logprobs_follow_the_chunks():
    sched = make(max_batched_tokens=4)
    prompt = [11, 12, 13, 14, 15, 16, 17]                       # chunks of 4 + 3
    outs = submit(sched, "lp", prompt, 2, prompt_logprobs_start=0)
    run(sched)
    # each chunk's hidden rows, with the next prompt token of every position (none after the last)
    assert sched.runner.prompt_lp_calls == [(4, [12, 13, 14, 15], 4), (3, [16, 17], 3)]
    assert outs[0].prompt_logprobs == [None] + [TokenLogprob(t, float(-t), []) for t in prompt[1:]]
    assert tokens(outs) == [18, 19]
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


def test_the_budget_is_never_below_one_decode_row_per_running_sequence():
    sched = make(max_running=4, max_batched_tokens=2)           # the runner raises the budget to 4
    outs = [submit(sched, f"q{i}", [i + 1] * 3, 8) for i in range(4)]
    run(sched)
    r = sched.runner
    assert sched.budget == r.max_tokens == 4
    assert any(len(s.running) == 4 for s in r.steps)         # four decode rows fill a step
    assert [tokens(o) for o in outs] == [list(range(i + 2, i + 10)) for i in range(4)]
    assert all(s.num_tokens <= 4 for s in r.steps)
    assert_idle_and_clean(sched)


class SpecFakeRunner(FakeRunner):
    """FakeRunner that verifies guesses: a sample at row token `at` draws that token + 1, and a
    guess is accepted when it equals the draw before it; every step width costs the same, so the
    planner verifies every guess the budget has room for."""

    def step(self, rows, greedy, masks=None):
        res = super().step(rows, greedy, masks)
        toks = [(r.tokens[s.at] + 1) % VOCAB for r in rows for s in r.samples]
        drafts = [s.draft for r in rows for s in r.samples]
        res.tokens = np.array(toks, np.int64)
        if any(d >= 0 for d in drafts):
            res.accepted = np.array([d >= 0 and d == t for d, t in zip(drafts, toks)], bool)
        return res

    def step_cost(self, tokens, spec, greedy=True):
        return 1.0


class _CountingProposer:
    """Guesses the fake model's continuation (last + 1, last + 2, ...): always right."""

    def propose(self, tokens, k):
        return [(tokens[-1] + 1 + i) % VOCAB for i in range(k)]

    def finish(self, tokens=None):
        pass


def spec_scheduler(runner: SpecFakeRunner, k: int, proposer=_CountingProposer):
    """A Scheduler over `runner` with an n-gram Drafter of K = k whose sequences get `proposer()`."""
    from jax_engine.decode.speculate import Drafter

    drafter = Drafter("ngram", k, speculator=SimpleNamespace(start=lambda prompt, greedy=True: proposer()))
    sched = Scheduler(runner, PagePool(64, runner.rc.page_size), eos_ids=set(), max_model_len=256, name="fake",
                      drafter=drafter)
    runner.sched = sched
    return sched, drafter


def guesses(row: StepRow) -> int:
    """How many proposed tokens ride at the end of a step row (a sample row checks each)."""
    return sum(smp.draft >= 0 for smp in row.samples)


def test_guesses_take_only_the_room_prompt_chunks_leave():
    """Prefill chunks are planned before guesses: a prompt arriving while a sequence speculates
    is chunked exactly as without speculation (budget minus the decode tokens), and the
    guesses fill what is left of the budget (scheduler._plan_drafts)."""
    runner = SpecFakeRunner(max_batched_tokens=16)
    sched, drafter = spec_scheduler(runner, 4)
    short = submit(sched, "short", [10, 11, 12], 30)
    sched._drain_control()
    sched.step()                                    # prompt + first token
    sched.step()                                    # nothing else to do: the row verifies 4 guesses
    assert [len(r.tokens) for r in runner.steps[1].rows] == [5]
    longer = submit(sched, "long", list(range(100, 140)), 3)
    run(sched)
    long_steps = [(st, row) for st in runner.steps for p, row in st.chunks if p.rid == "long"]
    assert [len(row.tokens) - guesses(row) for _, row in long_steps] == [15, 15, 10]    # as without speculation
    # the step with the last, 10-token chunk has room for the decode row's 4 guesses + 1 = 5 tokens,
    # and the prompt it ends takes the budget's last token for a guess after its first token
    st, row = long_steps[-1]
    assert [len(r.tokens) for r in st.rows][:1] == [5] and guesses(row) == 1 and st.num_tokens == 16
    assert all(len(st.rows[0].tokens) == 1 for st, _ in long_steps[:2])  # full chunks: no room
    assert tokens(short) == list(range(13, 43)) and tokens(longer) == [140, 141, 142]
    assert drafter.accepted_tokens == drafter.proposed_tokens > 0
    assert sched.pool.num_used() == 0 and sorted(sched.free_slots) == list(range(sched.max_running))


def test_guesses_of_a_decode_only_step_may_pass_the_latency_budget():
    """Three rows at K = 8 want 27 tokens, over the 16-token latency budget: with no prompt in the
    step they get them (up to the largest step program, 32 here); while a prompt is chunked beside
    them, guesses only get what the chunks leave of the budget, except in the step whose chunk
    ends the last admitted prompt (no chunk waits behind it)."""
    runner = SpecFakeRunner(max_batched_tokens=16)
    runner.max_tokens = 32                          # a burst budget above the latency budget
    sched, drafter = spec_scheduler(runner, 8)
    outs = [submit(sched, f"r{i}", [10 * i + 1, 10 * i + 2], 40) for i in range(3)]
    run(sched)
    assert [tokens(o) for o in outs] == [list(range(10 * i + 3, 10 * i + 43)) for i in range(3)]
    decode_only = [st for st in runner.steps if not st.chunks and len(st.rows) == 3]
    assert max(st.num_tokens for st in decode_only) == 27 > sched.budget
    more = [submit(sched, f"s{i}", [10 * i + 1, 10 * i + 2], 80) for i in range(2)]
    sched._drain_control()
    for _ in range(3):                              # both decode (and guess) before the prompt comes
        sched.step()
    n = len(runner.steps)
    longer = submit(sched, "long", list(range(100, 160)), 3)
    run(sched)
    assert tokens(longer) == [160, 161, 162] and all(tokens(o) for o in more)
    mixed = [st for st in runner.steps[n:] if st.chunks and st.running]
    # 60 prompt tokens: four 14-token chunks beside the 2 decode rows, then the last 4 with guesses
    assert [[len(r.tokens) - guesses(r) for _, r in st.chunks] for st in mixed] == [[14]] * 4 + [[4]]
    assert all(st.num_tokens == sched.budget for st in mixed[:-1])
    assert mixed[-1].num_tokens > sched.budget and all(guesses(r) for r in mixed[-1].decode_rows)


def test_rows_that_can_end_together_do_so_instead_of_leaving_a_step_of_leftovers():
    """Two answers with 7 tokens left each (6 guesses a row, 14 tokens) and a cost table where the
    one-step pricing stops at 8 tokens (8 / 1.0 ms beats 14 / 1.8): with no prompt to share the
    next step, the step verifies every guess left (Drafter._finish) rather than leave 3 tokens a
    row for a 6-token step of their own; so also while a third request waits for their slots."""
    for waiting in (False, True):
        runner = SpecFakeRunner(max_running=2, max_batched_tokens=16)
        runner.max_tokens = 32
        cost = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.8, 32: 3.0}
        runner.step_cost = lambda T, spec, greedy=True: next(v for b, v in sorted(cost.items()) if b >= T)
        sched, drafter = spec_scheduler(runner, 8)
        drafter.prior[True] = 0.999                 # the guesses have always been right
        drafter.observe_host = lambda verified, ms: None      # price the table alone (no host time)
        outs = [submit(sched, f"r{i}", [10 * i + 1, 10 * i + 2], 46) for i in range(2 + waiting)]
        run(sched)
        shape = [(len(st.rows), st.num_tokens) for st in runner.steps]
        # the prompts with 6 guesses each (_plan_drafts: 7 tokens a row), 4 steps of 8 tokens a
        # row, then the last 7 of each row in one step
        assert shape[:6] == [(2, 16), (2, 16), (2, 16), (2, 16), (2, 16), (2, 14)], shape
        if waiting:
            assert runner.steps[6].chunks and tokens(outs[2]) == list(range(23, 69))
        assert [tokens(o) for o in outs[:2]] == [list(range(3, 49)), list(range(13, 59))]
        assert sched.pool.num_used() == 0 and sorted(sched.free_slots) == list(range(sched.max_running))


def test_a_row_is_asked_only_for_the_guesses_the_pricing_could_verify():
    """A proposer's work grows with the guesses it is asked for; a row is asked for as many as the
    pricing with every row offering all it may would verify of it (scheduler._draft), not K:
    here a step wider than 4 tokens costs 10x, so two decoding rows verify one guess each and
    are asked for one each, not 8."""
    asked: list[int] = []

    class Recording(_CountingProposer):
        def propose(self, tokens, k):
            asked.append(k)
            return super().propose(tokens, k)

    runner = SpecFakeRunner(max_running=2, max_batched_tokens=16)
    runner.step_cost = lambda T, spec, greedy=True: 1.0 if T <= 4 else 10.0
    sched, drafter = spec_scheduler(runner, 8, Recording)
    drafter.observe_host = lambda verified, ms: None          # price the table alone (no host time)
    outs = [submit(sched, f"r{i}", [10 * i + 1, 10 * i + 2], 20) for i in range(2)]
    run(sched)
    assert [tokens(o) for o in outs] == [list(range(3, 23)), list(range(13, 33))]
    assert asked and set(asked) == {1}
    assert drafter.verify_rows > 0 and max(st.num_tokens for st in runner.steps if not st.chunks) == 4


def test_a_prompt_verifies_guesses_in_the_step_that_ends_it():
    """The step that ends a prompt may carry guesses after it (_plan_drafts' prompts): with no
    decoding stream waiting, a prompt of 6 tokens comes back with 1 + 8 tokens from its first step,
    the same tokens as without speculation, and no page leaks. Prompts with n > 1 sequences or
    prompt logprobs keep the plain chunk (their first tokens come alone)."""
    runner = SpecFakeRunner(max_batched_tokens=16)
    runner.max_tokens = 32
    sched, drafter = spec_scheduler(runner, 8)
    outs = submit(sched, "a", [1, 2, 3, 4, 5, 6], 20)
    sched._drain_control()
    sched.step()
    first = runner.steps[0]
    assert [len(r.tokens) for r in first.rows] == [6 + 8] and guesses(first.rows[0]) == 8
    assert [smp.at for smp in first.rows[0].samples] == list(range(5, 14))
    assert tokens(outs) == list(range(7, 16)) and drafter.accepted_tokens == 8
    run(sched)
    assert tokens(outs) == list(range(7, 27)) and outs[-1].finish_reason == "length"
    for kw in (dict(n=2), dict(prompt_logprobs_start=0)):
        n = len(runner.steps)
        other = submit(sched, "b", [1, 2, 3, 4, 5, 6], 20, **kw)
        sched._drain_control()
        sched.step()
        assert [guesses(r) for r in runner.steps[n].rows] == [0], kw
        assert tokens(other) == [7]
        run(sched)
        assert tokens(other) == list(range(7, 27))
    assert sched.pool.num_used() == 0 and sorted(sched.free_slots) == list(range(sched.max_running))


def test_host_time_of_verifying_steps_is_measured_and_priced(monkeypatch):
    """The scheduler measures its own time per step outside the step program's call, apart for
    steps with and without guesses, and the planner prices guesses with it (on a fake clock: the
    program takes 2 ms, proposing 12 ms: a verifying step's 5 tokens come in 14 ms against 1 in 2
    ms without guesses). Every width costs the same on the program table, so only the measured
    host time can stop guessing, though every guess is right: it does once the verifying steps'
    average (from 0, growing at most ~15 % + HOST_EMA x HOST_JUMP_MS a step: Drafter.observe_host)
    has learnt most of the cost, and the steps after it are plain."""
    import time as real_time

    from jax_engine.decode import scheduler as scheduler_mod

    clock = [0.0]
    monkeypatch.setattr(scheduler_mod, "time", SimpleNamespace(perf_counter=lambda: clock[0],
                                                               monotonic=real_time.monotonic))

    class SlowProposer(_CountingProposer):
        def propose(self, tokens, k):
            clock[0] += 0.012
            return super().propose(tokens, k)

    class TimedRunner(SpecFakeRunner):
        def step(self, rows, greedy, masks=None):
            clock[0] += 0.002
            return super().step(rows, greedy, masks)

    runner = TimedRunner(max_batched_tokens=16)
    sched, drafter = spec_scheduler(runner, 4, SlowProposer)
    outs = submit(sched, "a", [10, 11, 12], 150)
    run(sched)
    assert tokens(outs) == list(range(13, 163))
    verifying = [i for i, st in enumerate(runner.steps)
                 if any(smp.draft >= 0 for r in st.rows for smp in r.samples)]
    assert verifying == list(range(len(verifying))) and 5 < len(verifying) < 40
    assert len(runner.steps) - len(verifying) > 40          # the rest came one token a step
    assert drafter.host_ms[0] == 0.0 and 3.0 < drafter.host_ms[1] < 12.0


# ------------------------------------------------------------------ the latency guard
def make_guarded(guard: LatencyGuard) -> Scheduler:
    """A scheduler over the fake runner with a 16-token budget and a 64-token burst budget."""
    runner = FakeRunner(max_running=4, max_batched_tokens=16, page_size=4)
    runner.budget_tokens, runner.max_tokens = 16, 64
    runner.token_buckets = [1, 2, 4, 8, 16, 20, 24, 28, 32, 40, 48, 56, 64]
    sched = Scheduler(runner, PagePool(64, 4), eos_ids=set(), max_model_len=256, name="fake",
                      burst_min_prompts=4, guard=guard)
    runner.sched = sched
    return sched


def steps_beside_a_stream(guard: LatencyGuard) -> tuple[list[int], list[int]]:
    """Stream a decodes; a 40-token prompt b arrives: the token counts of the steps while b
    prefills, and b's tokens."""
    sched = make_guarded(guard)
    submit(sched, "a", [5, 6, 7], new=30)
    sched._drain_control()
    for _ in range(3):
        sched.step()                                  # a prefilled, then decoding
    outs = submit(sched, "b", list(range(100, 140)), new=4)
    sched._drain_control()
    before = len(sched.runner.steps)
    sched.step()
    while any(s.req.request_id == "b" for s in sched.prefilling):
        sched.step()
    sizes = [st.num_tokens for st in sched.runner.steps[before:]]
    run(sched)
    return sizes, tokens(outs)


def test_the_scheduler_prefills_in_one_step_when_the_guard_allows_and_chunks_when_not():
    allow, b_tokens = steps_beside_a_stream(LatencyGuard(4.0))        # nothing measured: allowed
    assert allow == [41], allow                                        # a's token + the whole prompt (bucket 48)
    refuse = LatencyGuard(4.0)
    for _ in range(50):
        refuse.observe(1, 1.0, 1)                                      # 1 ms gaps: line 3.6 ms
    for b in (20, 24, 28, 32, 40, 48, 56, 64):
        refuse.observe(b, 50.0, 0)                                     # every step above 16 is long
    refuse.share = 0.0                                                 # and none may be spent
    chunked, b_tokens2 = steps_beside_a_stream(refuse)
    assert chunked == [16, 16, 11], chunked                            # a's token + 15 of the prompt per step
    assert b_tokens == b_tokens2 == list(range(140, 144))              # the fake runner's next = last + 1
    partial = LatencyGuard(4.0)
    for _ in range(50):
        partial.observe(1, 10.0, 1)                                    # line 36 ms
    for b, ms in ((20, 20.0), (24, 25.0), (28, 30.0), (32, 35.0), (40, 45.0), (48, 50.0)):
        partial.observe(b, ms, 0)
    partial.share = 0.0
    sizes, _ = steps_beside_a_stream(partial)
    assert sizes == [32, 10], sizes                                    # the largest step under the line, then the rest
