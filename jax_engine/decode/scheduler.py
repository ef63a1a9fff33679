"""Continuous batching for one decoder replica, on its own thread (owns the device state).

Each step: take new requests and aborts from the control queue; admit waiting sequences by
(priority, arrival) while rows, slots and pages allow; then ONE ragged step program (runner.step)
over one token budget: every running sequence's next token first, then prefill chunks (FIFO) in
what is left, so decode streams never wait for a separate prefill program and each step reads
the weights once. A chunk that ends a prompt draws the first token(s) in the same step (n > 1
forks draw from the same row). When a sequence needs a page and none is left, the newest running
sequence is preempted: its pages are freed and it is requeued to be recomputed later (never
dropped).
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable, Optional

import numpy as np

from jax_engine.constrain.state import fill_masks
from jax_engine.decode.latency_guard import LatencyGuard
from jax_engine.decode.page_pool import PagePool, chain_hashes
from jax_engine.decode.rows import SampleRow, SamplingRow, StepRow
from jax_engine.decode.runner import ModelRunner, StepResult, pick
from jax_engine.decode.sequence import Request, SeqState, Sequence
from jax_engine.decode.speculate import Drafter
from jax_engine.types import GenerateOutput, TokenLogprob

log = logging.getLogger("xlaserve.scheduler")


class Scheduler:
    def __init__(self, runner: ModelRunner, pool: PagePool, eos_ids: set[int], max_model_len: int, name: str,
                 drafter: Optional[Drafter] = None, burst_min_prompts: int = 4,
                 guard: Optional[LatencyGuard] = None):
        self.runner, self.pool, self.eos_ids, self.max_model_len = runner, pool, eos_ids, max_model_len
        self.name = name
        self.drafter = drafter          # speculative decoding (None: off)
        rc = runner.rc
        self.max_running = rc.max_running
        self.budget = runner.budget_tokens      # the latency budget of a step
        # the burst budget (0 = off) and the backlog that switches a step to it (see step())
        self.burst = runner.max_tokens if runner.max_tokens > runner.budget_tokens else 0
        self.burst_min_prompts = burst_min_prompts
        self.burst_steps = 0
        # how far past the latency budget a prompt may go beside decoding streams (None: not at all)
        self.guard = guard if self.burst else None
        self.page_size = rc.page_size
        self.free_slots = list(range(rc.max_running - 1, -1, -1))
        self.waiting: list[Sequence] = []
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self._control: "queue.SimpleQueue" = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self.thread: Optional[threading.Thread] = None
        self.failed: Optional[str] = None
        # statistics
        self.preemptions = 0
        self.total_prompt_tokens = 0
        self.total_generated_tokens = 0
        self._tp_window: deque = deque()   # (time, prefill_tokens, decode_tokens)
        self.last_progress = time.monotonic()
        # the last step that ran, for the drafter's host-time measure: (its start, ms inside
        # runner.step, whether it verified guesses); None after an idle wait (see step())
        self._last_step: Optional[tuple[float, float, bool]] = None

    # ------------------------------------------------------------------ thread API
    def start(self) -> None:
        self._stop = False
        self.thread = threading.Thread(target=self._loop, name=f"scheduler-{self.name}", daemon=True)
        self.thread.start()

    def stop(self, timeout: float) -> None:
        """Finish in-flight work (up to timeout), then abort the rest and join."""
        deadline = time.monotonic() + timeout
        while self.load() > 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        for rid in list(self.requests):
            self.abort(rid)
        self._stop = True
        self._wake.set()
        if self.thread is not None:
            self.thread.join(timeout=max(1.0, timeout))

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive() and self.failed is None

    def submit(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self._control.put(("add", req))
        self._wake.set()

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._control.put(("abort", request_id))
        self._wake.set()
        return True

    def load(self) -> int:
        return len(self.requests)

    def call_between_steps(self, fn: Callable[[], None]) -> "Future[None]":
        """Run `fn` on the scheduler thread between two steps (device-state changes such as a LoRA
        slot write must not race a step that reads the same arrays); directly when not running."""
        fut: "Future[None]" = Future()
        if self.thread is None or not self.thread.is_alive():
            _settle(fut, fn)
        else:
            self._control.put(("call", (fn, fut)))
            self._wake.set()
        return fut

    # ------------------------------------------------------------------ loop
    def _loop(self) -> None:
        while not self._stop:
            if not (self.waiting or self.prefilling or self.running) and self._control.empty():
                self._last_step = None
                self._wake.wait(0.5)
                self._wake.clear()
                self.last_progress = time.monotonic()
                continue
            try:
                self._drain_control()
                self.step()
            except Exception as e:  # pragma: no cover - last-resort guard; step() contains its own
                log.exception("scheduler %s crashed", self.name)
                self.failed = repr(e)
                for rid in list(self.requests):
                    self._finish_request(self.requests[rid], "error", f"engine failure: {e}")
                return
            self.last_progress = time.monotonic()

    def _drain_control(self) -> None:
        while True:
            try:
                kind, arg = self._control.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                req: Request = arg
                if req.aborted:
                    continue
                leader = req.seqs[0]
                leader.followers = req.seqs[1:]
                for f in leader.followers:
                    f.leader = leader
                self.waiting.append(leader)
            elif kind == "call":
                _settle(*arg[::-1])
            elif kind == "abort":
                req = self.requests.get(arg)
                if req is not None:
                    self._finish_request(req, "abort", None)

    # ------------------------------------------------------------------ step
    def step(self) -> None:
        t0 = time.perf_counter()
        last, self._last_step = self._last_step, None
        if last is not None and self.drafter is not None:
            # the scheduler thread's own time for the step before this one: its planning, building
            # rows and handling results, and whatever else held the GIL meanwhile
            self.drafter.observe_host(last[2], (t0 - last[0]) * 1000.0 - last[1])
        self._admit()
        decoding = self._reserve_decode_pages()
        chunks = self._plan_chunks(self._step_budget(len(decoding)) - len(decoding))
        chunk_tokens = sum(n for _, n in chunks)
        guesses = self._plan_drafts(decoding, chunk_tokens, self._guessing_prompts(chunks))
        if decoding or chunks:
            tokens = len(decoding) + guesses + chunk_tokens
            if tokens - guesses > self.budget:
                self.burst_steps += 1
            self._run_step(decoding, chunks, t0, guesses > 0)
            if self.guard is not None:
                buckets = self.runner.token_buckets
                self.guard.observe(pick(buckets, min(max(1, tokens), buckets[-1])),
                                   (time.perf_counter() - t0) * 1000.0, len(decoding))

    def _step_budget(self, decoding: int) -> int:
        """The latency budget, or more: the burst budget when no sequence decodes (no stream's next
        token waits for the step: a prompt is prefilled in one step instead of several) or while
        at least burst_min_prompts admitted prompts wait for their first token (a backlog:
        prefilled in large steps, the decoding streams wait longer for those steps, and then
        decode together in full steps instead of one after another in small ones;
        config.burst_budget_default has the measurement); otherwise, while prompts wait beside
        decoding streams, what the latency guard allows between the budget and the step that
        finishes them all (latency_guard.py: why)."""
        if self.burst and (decoding == 0 or len(self.prefilling) >= self.burst_min_prompts):
            return self.burst
        if self.guard is not None and self.prefilling:
            want = min(self.burst, decoding + self._prompt_tokens_left())
            if want > self.budget:
                buckets = self.runner.token_buckets
                top = pick(buckets, want)
                b = self.guard.choose([x for x in buckets if self.budget < x <= top], decoding)
                if b is not None:
                    return min(b, want)
        return self.budget

    def _prompt_tokens_left(self) -> int:
        """Prompt (or recompute) tokens the admitted prefilling sequences still have to compute."""
        return sum(s.target_computed - s.num_computed for s in self.prefilling)

    def _plan_chunks(self, budget: int) -> list[tuple[Sequence, int]]:
        """Prefill chunks in what the decode tokens left of the budget, FIFO."""
        batch: list[tuple[Sequence, int]] = []
        for seq in self.prefilling:
            if budget <= 0:
                break
            n = min(seq.target_computed - seq.num_computed, budget)
            batch.append((seq, n))
            budget -= n
        return batch

    def _guessing_prompts(self, chunks: list[tuple[Sequence, int]]) -> list[Sequence]:
        """The prompts whose chunk this step ends and whose first token may come with guesses
        after it (see _plan_drafts): a fresh prompt of one sequence, without prompt logprobs,
        embedding or grammar (their rows keep the plain chunk form)."""
        if self.drafter is None:
            return []
        return [seq for seq, n in chunks
                if self._draws_first_token(seq, n) and not seq.followers
                and seq.req.params.prompt_logprobs_start is None and seq.grammar is None]

    @staticmethod
    def _draws_first_token(seq: Sequence, n: int) -> bool:
        """Whether a chunk of n tokens ends seq's prompt and the step draws its first token there
        (not for an embedding request, nor for a recompute after preemption, which resumes)."""
        return seq.num_computed + n >= seq.target_computed and not seq.output_ids and seq.req.on_embedding is None

    def _plan_drafts(self, decoding: list[Sequence], chunk_tokens: int = 0, prompts: Optional[list[Sequence]] = None) -> int:
        """Speculation: each decoding sequence's guesses for this step (seq.drafts). Every row
        proposes within its request's max_new_tokens, the model length and what its grammar
        allows; the Drafter keeps the guesses worth their cost (speculate.py) within what the
        decode tokens and the step's `chunk_tokens` prefill tokens left of the token budget; their
        pages come only from free ones (a guess never preempts anyone). Returns the number of
        guesses.

        Prefill chunks are planned first and guesses get what they leave: a prompt token is work
        that must be done anyway, a guess only maybe saves some. When guesses were planned first
        they displaced prompt chunks (the step ran at the budget's bucket either way), prompts took
        more steps, and at 8 concurrent sampled streams on the trained model (prompts arriving as
        others finish) most prefill steps became verifying steps (59 of 64 in one profile) and
        speculation ran at ~0.8-0.9x the speed without it; after the change see README §
        Speculative decoding.

        A step of decode rows alone may hold guesses past the latency budget, up to the largest
        step program (runner.max_tokens: the burst budget on CPU): the budget bounds how long the
        decoding streams wait while prompts are prefilled beside them, and a verifying step gives
        the waiting streams their tokens instead; the pricing still keeps only guesses that pay.
        So may a step whose chunks end every admitted prompt (no prompt tokens left after it): no
        later chunk waits behind its width, and its prompts' first tokens come with it either way.
        Capped at the 64-token budget, 8 rows verified 7 guesses each at most (a repeated answer of
        the trained model, 98 % of guesses accepted) and with K = 16, 3; up to 144 tokens, K = 16
        rows verified ~11 a step and 8 such streams ran 2.6x faster than without speculation
        instead of 2.2x (2-vCPU Xeon).

        `prompts` (_guessing_prompts): prompts this step ends may guess too, after their last
        token, priced as the decoding rows are: a repeated request (or one whose answer starts by
        copying its prompt) otherwise spent its first step on one token and guessed from the
        next. Beside decoding streams they share what the budget leaves; in a step where no
        stream decodes, nobody waits on its width and guesses may fill it up to the largest step
        program. The code before and after, alternating on the 2-vCPU Zen 4 (trained model,
        K = 16, suffix, tok/s, 2 pairs of 3-round medians): 8 repeated streams 14,348 / 13,085 ->
        15,008 / 13,719 (the first replacement of each wave, prefilled alone, came back with 17
        tokens instead of 1); batch-1 copy prompts 3,976 / 4,006 -> 4,629 / 4,320; batch-1
        repeats unchanged (9,505 / 8,575 -> 9,468 / 8,621: a 16-token prompt chunk and 16 guesses
        need the 32-token program, 2.3 ms against 1.3, which the pricing takes only at q > ~0.97)."""
        rows = decoding + (prompts or [])
        for seq in rows:
            seq.drafts = []
        d = self.drafter
        if d is None:
            return 0
        for seq in rows:                # every sequence gets its proposer (it learns at the end)
            if seq.spec is None:
                seq.spec = d.start(seq.req.prompt_ids, seq.req.params.temperature <= 0)
        # a step without prompt chunks, without decoding streams to keep waiting, or that ends
        # every admitted prompt may verify guesses past the latency budget, up to the largest
        # step program (see the docstring)
        held = chunk_tokens > 0 and bool(decoding) and self._prompt_tokens_left() > chunk_tokens
        cap = self.budget if held else self.runner.max_tokens
        room = cap - len(decoding) - chunk_tokens
        if room <= 0 or not d.gate():
            return 0
        total = self._draft(d, rows, len(decoding), room, chunk_tokens)
        d.planned(total)
        return total

    def _draft(self, d: Drafter, rows: list[Sequence], decode_tokens: int, room: int, chunk_tokens: int) -> int:
        """_plan_drafts' planning, once the drafter's gate is open (rows: the decoding sequences,
        then the prompts that may guess; decode_tokens: how many of them decode)."""
        limits, ends = [], []
        for seq in rows:
            assert seq.spec is not None
            ends.append(max(0, min(seq.req.max_new_tokens - len(seq.output_ids) - 1,
                                   self.max_model_len - seq.total_len - 1)))
            limits.append(min(room, d.max_tokens, ends[-1]) if d.ready(seq.spec) else 0)
        if not any(limits):
            return 0
        # the rows' ends matter to the pricing only when no prompt would share the next step
        # (Drafter._finish): beside a prompt's chunk the leftover tokens ride along; a request
        # still waiting is waiting for these rows' slots or pages, and gets them sooner
        alone = None if chunk_tokens or self.prefilling else ends
        # rows whose guesses could not pay even if every guess came: skip their proposer's work
        tracks = [s.spec for s in rows]
        greedy = all(s.req.params.temperature <= 0 for s in rows)     # which cost table prices it

        def cost(tokens: int, spec: bool) -> float:
            return self.runner.step_cost(tokens, spec, greedy) + d.host_cost(spec)
        widths = self.runner.token_buckets
        could = d.choose([[0] * k for k in limits], tracks, decode_tokens, room, cost, chunk_tokens, widths, alone)
        # a row is asked for as many guesses as that pricing would verify of it (its later ones
        # could not pay even if they came): a proposer's work grows with the guesses asked, and a
        # sampled row's search over k tokens is ~0.15 ms (the match is followed up to k tokens
        # back among every occurrence); 8 sampled streams of the trained model asked for 16 guesses
        # a row to verify 2-3 of them
        props: list[list[int]] = []
        for seq, c in zip(rows, could):
            g = d.propose(seq.spec, seq.tokens, c) if c > 0 else []
            if g and seq.grammar is not None:
                g = g[:seq.grammar.valid_prefix(g)]
            props.append(g)
        if not any(props):
            return 0
        take = d.choose(props, tracks, decode_tokens, room, cost, chunk_tokens, widths, alone)
        total, ps = 0, self.page_size
        for seq, g, k in zip(rows, props, take):
            g, n = g[:k], seq.total_len
            while g and (n - 1 + len(g)) // ps >= len(seq.pages):
                page = self.pool.allocate()
                if page is None:
                    g = g[:len(seq.pages) * ps - n]
                    break
                seq.pages.append(page)
            seq.drafts = g
            total += len(g)
        return total

    def _rows_in_use(self) -> int:
        return len(self.running) + sum(1 + len(s.followers) for s in self.prefilling)

    def _admit(self) -> None:
        ps = self.page_size
        while self.waiting:
            self.waiting.sort(key=lambda s: (s.req.sort_key(), s.index))
            seq = self.waiting[0]
            group = [seq] + seq.followers
            if self._rows_in_use() + len(group) > self.max_running or len(self.free_slots) < len(group):
                return
            target = seq.target_computed
            use_cache = seq.req.params.prompt_logprobs_start is None
            hashes = chain_hashes(seq.tokens[:target], ps, seq.req.hash_root) if use_cache else []
            matched = self.pool.match(hashes)
            extra = len(seq.followers) if len(seq.req.prompt_ids) % ps else 0
            need = math.ceil(target / ps) - len(matched) + extra
            if need > self.pool.num_free():
                self.pool.release(matched)
                if not (self.running or self.prefilling):
                    if need > self.pool.usable:
                        self.waiting.pop(0)
                        self._finish_request(seq.req, "error",
                                             f"request needs {need} KV pages but the pool has {self.pool.usable}")
                        continue
                return
            self.waiting.pop(0)
            seq.pages = matched + self.pool.allocate_many(math.ceil(target / ps) - len(matched))
            seq.page_hashes = hashes[: len(matched)]
            # every page cached (a page-aligned prompt asked again): only the last token is
            # computed, for its logits, reading its KV from the shared page (_cached_lead)
            seq.num_computed = max(0, min(len(matched) * ps, target - 1))
            if not seq.output_ids:
                seq.cached_tokens = seq.num_computed
                self.pool.hit_tokens += seq.num_computed
                self.pool.miss_tokens += target - seq.num_computed
            for f in seq.followers:         # the copy-on-write page each n>1 fork will need
                f.pages = [self.pool.allocate()] if extra else []
            for s in group:
                s.slot = self.free_slots.pop()
                s.state = SeqState.PREFILL
            self.prefilling.append(seq)
            try:
                for s in group:
                    self.runner.set_slot(s.slot, s.req.prompt_ids, s.output_ids)
            except Exception as e:
                self._step_failed(group, e)

    def _run_step(self, decoding: list[Sequence], chunks: list[tuple[Sequence, int]], t0: float,
                  verifies: bool) -> None:
        """Build the step's rows, run it, hand each row its results (t0: when step() began;
        verifies: whether any row carries guesses)."""
        rows: list[StepRow] = []
        # each group of sample rows, in the step's sample order: (its sequence, the guesses it verifies)
        owners: list[tuple[Sequence, list[int]]] = []
        for seq in decoding:
            g = seq.drafts
            rows.append(StepRow(tokens=[seq.last_token] + g, start=seq.total_len - 1, pages=seq.pages,
                                samples=self._verify_samples(seq, 0, g), lora_slot=seq.req.lora_slot))
            owners.append((seq, g))
        for seq, n in chunks:
            start, g = seq.num_computed, seq.drafts
            group = [seq] + seq.followers if self._draws_first_token(seq, n) else []
            samples = (self._verify_samples(seq, n - 1, g) if g else
                       [SampleRow(s.slot, self._sampling_row(s)) for s in group])
            rows.append(StepRow(tokens=seq.tokens[start:start + n] + g, start=start, pages=seq.pages,
                                samples=samples, lora_slot=seq.req.lora_slot, cached=self._cached_lead(seq, start, n)))
            owners += [(s, g) for s in group]
        greedy = all(smp.sampling.temperature <= 0 for r in rows for smp in r.samples)
        try:
            masks = self._masks(owners)
            t_call = time.perf_counter()
            res = self.runner.step(rows, greedy, masks)
        except Exception as e:
            self._step_failed(decoding + [seq for seq, _ in chunks], e)
            return
        self._last_step = (t0, (time.perf_counter() - t_call) * 1000.0, verifies)
        j = emitted = 0
        for seq in decoding:
            emitted += self._after_decode(seq, res, j)
            j += 1 + len(seq.drafts)
            seq.drafts = []
        self._record(decode=emitted)
        h: Optional[np.ndarray] = None
        for i, (seq, n) in enumerate(chunks):
            k = len(rows[len(decoding) + i].samples)
            if seq.state is not SeqState.PREFILL:
                j += k
                continue                    # failed together with an earlier row of this step
            needs_h = seq.req.on_embedding is not None or (
                seq.req.params.prompt_logprobs_start is not None and not seq.output_ids)
            if needs_h and h is None:
                h = res.hidden()
            start = res.starts[len(decoding) + i]
            try:
                self._after_chunk(seq, n, res, j, h[start:start + n] if needs_h else None)
            except Exception as e:
                self._step_failed([seq], e)
            j += k

    def _cached_lead(self, seq: Sequence, start: int, n: int) -> int:
        """How many of a chunk's first tokens lie in pages seq shares from the prefix cache (a
        fully cached prompt recomputes its last token only; its KV stays as cached). Recomputing
        the whole last page instead, as vLLM does, cost a repeated page-aligned prompt 16 tokens
        of prefill where 1 does (spec_decode's 96-token prompts: 8 x 16 tokens each wave of 8
        repeated answers). Old and new code alternating, 8 repeated streams without speculation,
        3-round medians (2-vCPU Zen 4): 5,285 / 5,386 -> 5,834 / 6,431 tok/s."""
        return max(0, min(n, len(seq.page_hashes) * self.page_size - start))

    def _verify_samples(self, seq: Sequence, at: int, g: list[int]) -> list[SampleRow]:
        """The sample rows of seq's next token at row token `at` and, after it, of each guess in
        g: sample j checks g[j] (the last, none: a free draw) and counts g[:j] as generated."""
        first = self._sampling_row(seq)
        samples = [SampleRow(seq.slot, first, at, g[0] if g else -1)]
        if g:           # one sample row per guess (a verifying step: up to max_running x (K + 1) rows)
            n0, lo = first.steps, seq.req.params.min_new_tokens
            samples += [SampleRow(seq.slot, first.at_step(n0 + j, first.ban if n0 + j < lo else []), at + j,
                                  g[j] if j < len(g) else -1, g[:j]) for j in range(1, len(g) + 1)]
        return samples

    def _after_decode(self, seq: Sequence, res: StepResult, j: int) -> int:
        """Emit what a decode row produced (sample rows j.. of res): its token, or with guesses the
        accepted ones and the token after them; the pages past its new length go back to the pool
        (a rejected guess's KV is simply never read: attention stops at the sequence's length).
        Returns the number of tokens emitted."""
        g = seq.drafts
        acc = 0
        if g:
            assert res.accepted is not None
            while acc < len(g) and res.accepted[j + acc]:
                acc += 1
            assert self.drafter is not None and seq.spec is not None
            self.drafter.record(seq.spec, len(g), acc)
        out = self._on_tokens(seq, res, j, acc + 1)
        if seq.state is not SeqState.RUNNING:
            return out
        keep = (seq.total_len - 1) // self.page_size + 1
        if len(seq.pages) > keep:
            self.pool.release(seq.pages[keep:])
            del seq.pages[keep:]
        return out

    def _masks(self, owners: list[tuple[Sequence, list[int]]]) -> Optional[np.ndarray]:
        """The grammar bitmask of every sample row (owners: each group's sequence and the guesses it
        verifies, one sample row per guess plus one), or None when no row is constrained. The next
        token of a row depends on the token this step draws, so the masks are computed between
        steps, all rows at once on llguidance's threads (a speculating row's positions in turn)."""
        rows, ahead, j = [], [], 0
        for s, g in owners:
            if s.grammar is not None:
                (ahead if g else rows).append((s.grammar, j, g))
            j += 1 + len(g)
        if not rows and not ahead:
            return None
        out = np.full((j, (rows or ahead)[0][0].words), -1, np.int32)
        if rows:
            fill_masks([(st, i) for st, i, _ in rows], out)
        for st, i, g in ahead:
            st.fill_ahead(g, out, i)
        return out

    def _after_chunk(self, seq: Sequence, n: int, res: StepResult, j: int, h: Optional[np.ndarray]) -> None:
        """Book-keeping for one computed chunk: prompt logprobs, cache pages, and for the chunk
        that ends a prompt the first tokens (res rows j.. for the sequence and its n > 1 forks)."""
        start = seq.num_computed
        target = seq.target_computed
        toks = seq.tokens
        seq.num_computed += n
        self.total_prompt_tokens += n
        self._record(prefill=n)
        if seq.req.params.prompt_logprobs_start is not None and not seq.output_ids:
            lp = self.runner.prompt_logprobs(h, toks[start + 1:start + n + 1], n)
            self._collect_prompt_lps(seq, start, n, *lp)
        self._register_pages(seq)
        if start + n < target:
            return
        if seq.req.on_embedding is not None:   # decoder embedding: last-token pooling, no generation
            self._retire(seq)
            self._maybe_forget(seq.req)
            try:
                seq.req.on_embedding(np.asarray(h[n - 1], dtype=np.float32))
            except Exception:
                log.exception("embedding consumer failed")
            return
        self.prefilling.remove(seq)
        if seq.output_ids:                  # recompute after preemption: resume decoding
            seq.state = SeqState.RUNNING
            self.running.append(seq)
            return
        group = [seq] + seq.followers
        for s in group:
            if s is not seq:
                self._fork(seq, s)
            s.state = SeqState.RUNNING
            self.running.append(s)
        seq.followers = []
        if seq.drafts:                      # its guesses rode after the prompt (_plan_drafts)
            self._record(decode=self._after_decode(seq, res, j) - 1)
            seq.drafts = []
            return
        for i, s in enumerate(group):
            self._on_tokens(s, res, j + i, 1)

    def _fork(self, leader: Sequence, s: Sequence) -> None:
        """n > 1: share the leader's full prompt pages; copy the partial last page."""
        ps = self.page_size
        plen = len(leader.req.prompt_ids)
        full = plen // ps
        reserved = s.pages                  # allocated at admission
        s.pages = list(leader.pages[:full])
        for p in s.pages:
            self.pool.incref(p)
        if plen % ps:
            self.runner.copy_page(leader.pages[full], reserved[0])
            s.pages.append(reserved[0])
        s.num_computed = leader.num_computed
        s.cached_tokens = leader.cached_tokens
        s.page_hashes = list(leader.page_hashes[:full])
        s.leader = None

    def _reserve_decode_pages(self) -> list[Sequence]:
        """The running sequences that decode this step, each holding the page of its next position
        (position total_len - 1). When the pool runs dry the newest admitted sequence, running or
        still prefilling, is preempted, so the oldest always progresses. (Choosing only among
        running ones livelocked: a running sequence preempted itself while a newer recompute held
        the pages, then that one did the same; 65k preemptions in 2 minutes, no token.)"""
        ps = self.page_size
        for seq in sorted(self.running, key=lambda s: (s.req.arrival, s.index)):
            if seq.state is not SeqState.RUNNING:
                continue
            while (seq.total_len - 1) // ps >= len(seq.pages):
                page = self.pool.allocate()
                if page is not None:
                    seq.pages.append(page)
                    continue
                victim = max(self.running + self.prefilling, key=lambda s: (s.req.arrival, s.index))
                self._preempt(victim)
                if victim is seq:
                    break
        return list(self.running)

    def _preempt(self, seq: Sequence) -> None:
        """Free a running or prefilling sequence's pages and slot (and those of the n > 1 forks
        it still carries) and requeue it, to be recomputed from its tokens."""
        if seq.state is SeqState.RUNNING:
            self.running.remove(seq)
        else:
            self.prefilling.remove(seq)
        if not seq.output_ids:
            seq.prompt_lps = []             # a prompt preempted mid-prefill collects them again
        for s in [seq] + seq.followers:
            self.pool.release(s.pages)
            s.pages, s.page_hashes, s.num_computed, s.drafts = [], [], 0, []
            self.free_slots.append(s.slot)
            s.slot = -1
            s.state = SeqState.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.append(seq)

    # ------------------------------------------------------------------ tokens and outputs
    def _sampling_row(self, s: Sequence) -> SamplingRow:
        """The sampling settings of s's next token (a guess's are this row at a later step: at_step)."""
        p = s.req.params
        n_out = len(s.output_ids)
        ban = []
        if n_out < p.min_new_tokens:
            ban = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids))
        return SamplingRow(temperature=p.temperature, top_k=p.top_k if p.top_k > 0 else 0, top_p=p.top_p,
                           min_p=p.min_p, rep_pen=p.repetition_penalty, freq_pen=p.frequency_penalty,
                           pres_pen=p.presence_penalty, seeds=s.seed, steps=n_out,
                           bias=list(p.logit_bias.items()), ban=ban, logprobs=bool(p.logprobs or p.top_logprobs))

    def _on_tokens(self, seq: Sequence, res: StepResult, j: int, n: int) -> int:
        """Append sample rows j .. j + n - 1 of `res` to seq (n > 1: a row's accepted guesses and
        the token after them) up to the first that finishes it, and hand the consumer ONE output
        with them (an output per token cost ~50 us each on the host). Returns how many were taken."""
        req, p = seq.req, seq.req.params
        toks: list[int] = []
        lps: list[TokenLogprob] = []
        finish: Optional[str] = None
        matched = error = None
        want_lp = p.logprobs or p.top_logprobs
        detok = seq.detok
        # text a token at a time only where a stop string may end at any token; otherwise the
        # run is detokenized once after the loop (two decodes instead of two per token: a
        # verifying step emits up to k + 1 tokens a row)
        per_token = detok is not None and bool(detok.stops)
        stop_str = None
        # the loop's lookups as locals and the tokens as Python ints in one call: a verifying row
        # hands over up to k + 1 tokens a step; 17 tokens took 8.3 us a call, 4.0 so (2-vCPU Zen 4,
        # without a detokenizer)
        out_ids, plen, grammar = seq.output_ids, len(req.prompt_ids), seq.grammar
        stop_ids, min_new, max_new, max_len = p.stop_token_ids, p.min_new_tokens, req.max_new_tokens, self.max_model_len
        eos = () if p.ignore_eos else self.eos_ids
        for i, tok in enumerate(res.tokens[j:j + n].tolist(), j):
            seq.num_computed = plen + len(out_ids)    # the KV of every token before this one (guesses included)
            out_ids.append(tok)
            toks.append(tok)
            if per_token:
                stop_str = detok.add(tok)
            n_out = len(out_ids)
            if tok in stop_ids and n_out > min_new - 1:
                finish, matched = "stop", tok
            elif tok in eos:
                finish, matched = "stop", tok
            elif stop_str is not None:
                finish, matched = "stop", stop_str
            elif n_out >= max_new or plen + n_out >= max_len:
                finish = "length"
            if grammar is not None:
                if not grammar.consume(tok):
                    # only a min_new_tokens ban on the one token the grammar allows can get here
                    finish, matched = "error", None
                    error = f"constraint: token {tok} is outside the grammar ({grammar.error()})"
                elif finish is None and grammar.stopped():
                    finish = "stop"             # the grammar is complete: nothing more may follow
            if want_lp:
                top_v, top_i = res.top_values[i], res.top_ids[i]
                top = [(int(top_i[m]), float(top_v[m])) for m in range(p.top_logprobs)]
                lps.append(TokenLogprob(tok, float(res.logprobs[i]), top))
            if finish is not None:
                break
        self.total_generated_tokens += len(toks)
        if detok is not None and not per_token:
            detok.add_many(toks)
        out = self._output(seq, toks, lps if want_lp else None, finish is not None)
        out.finish_reason, out.matched_stop = finish, matched
        if error is not None:
            out.error, out.error_kind = error, "internal"
        if finish is not None:
            self._retire(seq, learn=error is None)
            self._maybe_forget(req)     # before the consumer sees the end: its adapter is released by then
        self._emit(req, out)
        return len(toks)

    def _output(self, seq: Sequence, toks: list[int], logprobs, final: bool) -> GenerateOutput:
        out = GenerateOutput(
            request_id=seq.req.request_id, index=seq.index, new_token_ids=toks,
            new_text=seq.detok.take(final) if seq.detok is not None else "", logprobs=logprobs,
            finished=final, prompt_tokens=len(seq.req.prompt_ids), completion_tokens=len(seq.output_ids),
            cached_tokens=seq.cached_tokens,
        )
        if seq.req.params.prompt_logprobs_start is not None and not seq.emitted_prompt_lp:
            src = seq if seq.prompt_lps else seq.req.seqs[0]
            out.prompt_logprobs = src.prompt_lps
            seq.emitted_prompt_lp = True
        return out

    def _collect_prompt_lps(self, seq: Sequence, start: int, n: int, chosen, top_v, top_i) -> None:
        p = seq.req.params
        first = p.prompt_logprobs_start or 0
        prompt = seq.req.prompt_ids
        if start == 0 and first == 0:
            seq.prompt_lps.append(None)     # the first prompt token has no logprob
        for j in range(n):
            pos = start + j + 1             # logprob of prompt[pos] given prompt[:pos]
            if pos >= len(prompt):
                break
            if pos >= first:
                top = [(int(top_i[j][m]), float(top_v[j][m])) for m in range(p.top_logprobs)]
                seq.prompt_lps.append(TokenLogprob(prompt[pos], float(chosen[j]), top))

    def _register_pages(self, seq: Sequence) -> None:
        ps = self.page_size
        full = seq.num_computed // ps
        if full <= len(seq.page_hashes) or not self.pool.enable_prefix_cache:
            return
        hashes = chain_hashes(seq.tokens[: full * ps], ps, seq.req.hash_root)
        for i in range(len(seq.page_hashes), full):
            self.pool.register(seq.pages[i], hashes[i])
        seq.page_hashes = hashes

    def _retire(self, seq: Sequence, learn: bool = False) -> None:
        """Return a finished sequence's pages (full ones stay in the prefix cache) and slot; its
        proposer learns the output (`learn`: it ended normally) or forgets it."""
        if seq.spec is not None and self.drafter is not None:
            self.drafter.finish(seq.spec, seq.tokens if learn else None)
            seq.spec = None
        if seq.state is SeqState.RUNNING:
            self.running.remove(seq)
        elif seq.state is SeqState.PREFILL and seq in self.prefilling:
            self.prefilling.remove(seq)
        elif seq.state is SeqState.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if seq.pages:
            self._register_pages(seq)
            self.pool.release(seq.pages)
            seq.pages = []
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            seq.slot = -1
        seq.state = SeqState.FINISHED

    def _finish_request(self, req: Request, reason: str, error: Optional[str]) -> None:
        """End every unfinished sequence of `req` (abort or error)."""
        req.aborted = True
        outs = []
        for seq in req.seqs:
            if seq.state is SeqState.FINISHED:
                continue
            leader = seq.leader
            self._retire(seq)
            if leader is not None and seq in leader.followers:
                leader.followers.remove(seq)
            out = self._output(seq, [], None, True)
            out.finish_reason = reason
            if error is not None:
                out.error, out.error_kind = error, "internal"
            outs.append(out)
        self._maybe_forget(req)         # before the consumer sees the end (as _on_tokens)
        for out in outs:
            self._emit(req, out)

    def _emit(self, req: Request, out: GenerateOutput) -> None:
        """Hand an output to the request's consumer; a consumer that is gone aborts the request."""
        try:
            req.sink(out)
        except Exception:
            if not req.aborted:
                req.aborted = True
                self._control.put(("abort", req.request_id))

    def _maybe_forget(self, req: Request) -> None:
        if all(s.state is SeqState.FINISHED for s in req.seqs):
            if self.requests.pop(req.request_id, None) is not None and req.on_release is not None:
                req.on_release()

    def _step_failed(self, seqs: list[Sequence], err: Exception) -> None:
        """Fault containment: fail only the requests of the failed step and keep serving."""
        log.error("model step failed on %s: %r", self.name, err)
        reqs = {id(s.req): s.req for s in seqs}
        if self.runner.state_lost():
            # the donated KV cache went with the failed program: every admitted sequence lost its KV
            for s in self.running + self.prefilling:
                reqs[id(s.req)] = s.req
            self.runner.reset_state()
        for req in reqs.values():
            self._finish_request(req, "error", f"model step failed: {err}")

    # ------------------------------------------------------------------ stats
    def _record(self, prefill: int = 0, decode: int = 0) -> None:
        now = time.monotonic()
        self._tp_window.append((now, prefill, decode))
        while self._tp_window and now - self._tp_window[0][0] > 10.0:
            self._tp_window.popleft()

    def throughput(self) -> tuple[float, float]:
        w = list(self._tp_window)
        if len(w) < 2:
            return 0.0, 0.0
        span = max(1e-3, w[-1][0] - w[0][0])
        return sum(x[1] for x in w) / span, sum(x[2] for x in w) / span


def _settle(fut: "Future[None]", fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as e:
        fut.set_exception(e)
    else:
        fut.set_result(None)
