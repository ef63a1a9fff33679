"""The decoder's compiled programs and device state; the single owner of static shapes.

Programs (each compiled ahead of time per bucket at warmup, looked up through ProgramCache):
  step[T, P]                  ONE ragged step: T query tokens (every running sequence's next
                              token and prefill chunks, flat) over R = min(T, max_running) rows
                              with P-page tables: writes their KV, attends, and draws the next
                              token for every sample row (a decode row, a chunk that ends a
                              prompt, n > 1 forks of it) with penalties, bias, bans, the grammar
                              bitmask [R, ceil(V / 32)] (structured generation; all ones for free
                              rows, so constraints compile nothing), logprobs and the
                              penalty-count update fused in; also returns the T final hidden
                              states (prompt logprobs, embeddings). Greedy and sampled steps
                              share it: the draw is a lax.cond on "every sample row has
                              temperature 0" (argmax, or the full sampler), so each bucket
                              compiles one program, not two
  prompt_logprobs[T]          logprobs of the next prompt token at every position of a chunk
  copy_page                   copy-on-write of a partially filled page for n > 1 forks
  set_slot                    (re)initialise a row of the penalty state
  lora_write                  (LoRA enabled) write one adapter into a slot of the LoRA bank, so
                              loading an adapter compiles nothing
With speculative decoding enabled (--speculative) each step bucket also has a "spec" variant,
key (T, P[, "lora"], "spec"): it draws one sample row per verified position (S = min(T,
max_running x (1 + K)) sample rows instead of R), checks each position's proposed token
(sampling.verify: greedy = the argmax, sampled = the rejection rule), counts a row's earlier
guesses in its penalties, and adds to the penalty counts only what is emitted; a step in which no
row guesses runs the plain program. Its buckets are x1.25 apart from 32 tokens on (not 64), and
`time_steps` measures every step program at warmup for the scheduler's cost model.
With LoRA enabled each step bucket has a second variant, key (T, P, "lora"), that also takes the
bank and each token's slot (jax_engine/lora/bank.py) and adds the LoRA term; a step with no
adapter row runs the plain program, so base-model traffic runs exactly what a server without
LoRA runs. The alternative, one program with the term behind a `lax.cond`, measured the same
within this host's engine-to-engine noise ('small', batch 16, 4 slots of rank 16: base 421 vs
449 tok/s with LoRA off; with two programs 402 vs 434, where both engines run the identical
base program): the split is for the guarantee, at twice the step programs' compile time, and
only on servers started with LoRA.
Why the draw is fused although it triples a step program's compile time (demo model, T = 16:
0.3 s bare, 0.84 s greedy, 2.51 s sampling): as a program of its own after a bare step it cost
a decode step 1.9 ms greedy ('small' model, 4 rows: 16.1 vs 14.2 ms) and 7.8 ms sampling (16
rows, top-k 50 / top-p 0.9: 36.5 vs 28.7 ms). Why one program with a lax.cond rather than a
greedy and a sampling program per bucket: the trained 3 M model's 7 step buckets compiled in
11.2 s instead of 5.7 + 12.8 s (2-core Zen 4, one at a time), so a cold start of the default
models compiles 16 programs, not 25.
Why the step has a second, small LM head: a token bucket's sample rows are min(T, max_running),
but a step that is mostly one prompt samples a handful. When every real sample row fits in
`few_samples` (min(8, max_running / 4); real rows come first, padding rows name the dummy slot),
a lax.cond runs the LM head over those rows only; penalties, mask and draw still run over all S
rows (the padding rows' logits are zeros). 'small' model, 32 running slots, 2-vCPU AMX Xeon: a
128-token prompt beside 4 decoding streams (the 160 bucket) 95.0 -> 90.9 ms, two 128-token
prompts (256) 143.8 -> 141.9 ms; the 32000 x 768 head alone is 7 ms at 32 rows. Putting the
whole tail (draw included) in the cond saved 1 ms more but compiled every tail twice: the cold
start of the default models went 40.9 -> 48.7 s; with the head alone 36.3 s.
Why logprobs sit behind a lax.cond too (on "a sample row asks": SamplingRow.logprobs, False for
padding rows): most requests want none, and the log-softmax and top-N over the vocabulary were
~5 % of a 32-row decode step ('small' model: 1.7 ms of 42, before sampling.logprobs_of's two-level
form made them 0.7 ms); the false branch is zeros.
P has one bucket (the model's whole span) unless the attention backend's cost grows with the
page table's width (the reference's gather: `page_buckets`), so on CPU the demo generator (token
budget 64, burst budget 256, latency guard on: token buckets 1 .. 64, 80 .. 256 four per octave)
compiles 15 step programs and 7 more (22) instead of the split design's 164.
Device state (donated into every program, so it is updated in place):
  k, v   [L, num_pages * page_size, KVH, D]  the paged KV cache, page 0 reserved
  counts [slots + 1, V] int32 output-token counts; pm [slots + 1, V] prompt-token mask
"""
from __future__ import annotations

import functools
import inspect
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Callable, Optional, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from jax_engine import attention
from jax_engine.decode import sampling
from jax_engine.decode.rows import SampleRow, SamplingRow, StepRow
from jax_engine.executor import backend, huge_pages
from jax_engine.executor.compilation import FlatState, ProgramCache
from jax_engine.executor.program_store import stable_repr
from jax_engine.lora import bank as lora_bank
from jax_engine.models import decoder
from jax_engine.models.llama import LlamaConfig, StepInputs

NUM_BIAS = 64     # static width of the sparse logit-bias arrays (a request may set up to this many)
NUM_BAN = 16      # static width of the min_new_tokens ban list (EOS + stop token ids)
FEW_SAMPLES = 8   # sample rows of a step's small LM-head branch (see the step program)
LIVE_COST_WEIGHT = 0.05   # weight of one served step in the cost model's live offset (_observe): ~20 steps
SPEC_SCALE_WEIGHT = 0.2   # weight of one served verifying step in its kind's live scale (_observe): ~5
                          # steps (they are rare where guesses seldom pay)
SPEC_SCALE_RANGE = (0.5, 4.0)   # one step's ratio counts within this range (a stall is not a price)


def pow2_buckets(lo: int, hi: int) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return sorted(set(out))


def step_buckets(hi: int, fine_from: int = 64) -> list[int]:
    """Token buckets of the step program: powers of two up to `fine_from`, then four per octave
    (x1, x1.25, x1.5, x1.75: 64, 80, 96, 112, 128, 160, ...), and `hi` itself.

    Why the finer steps: a ragged step is usually a prompt chunk plus a few decode tokens, so with
    powers of two a 128-token prompt beside 3 decoding streams (131 tokens) ran in the 256 bucket
    at twice the work; on the 'small' model at 1 req/s that put the inter-token p99 at 230 ms
    against a 24 ms median (9.6x). Padding is now at most 25 % above 64 tokens; a step program
    compiles in ~0.3 s (demo model), so the extra buckets cost little at start-up."""
    out = [b for b in pow2_buckets(1, hi) if b <= fine_from]
    b = fine_from
    while b < hi:
        out += [b + b * i // 4 for i in range(4)]
        b *= 2
    return sorted({x for x in out if x < hi} | {hi})


def burst_buckets(budget: int, burst: int, fine: bool = False) -> list[int]:
    """Token buckets above the latency budget, for burst steps (--burst-batched-tokens): doublings
    of `budget`, and `burst` itself. Coarse on purpose: a burst step runs while a backlog of
    prompts waits, so its chunks fill the bucket and only the backlog's last step is padded.
    `fine` (the latency guard is on): x1.25 steps instead, as below the budget, since the guard
    runs steps of one prompt plus the streams decoding beside it up there (a 128-token prompt
    beside 4 streams, 132 tokens: 160 instead of 256, 104 vs 155 ms on the 'small' model)."""
    if burst <= budget:
        return []
    if fine:
        return [b for b in step_buckets(burst, fine_from=budget) if b > budget]
    return pow2_buckets(budget * 2, burst)


def page_buckets(p_max: int, ratio: int = 2) -> list[int]:
    """Page-count buckets p_max, p_max/ratio, ... 1, for backends whose step cost grows with the
    page table's width (the reference gathers every token's whole bucket). Ratio 2 wastes at most
    half the gathered KV; on CPU it made batch-16 decode at context 192 24% faster (96 -> 73 ms
    per step) than ratio 4, for twice the programs."""
    out, b = [], p_max
    while b >= 1:
        out.append(b)
        if b == 1:
            break
        b = max(1, b // ratio)
    return sorted(set(out))


@dataclass
class StepResult:
    """What one ragged step returns: per sample row (in the order of the rows' samples) the token,
    its logprob and the top-N; `hidden()` fetches the [T, H] final hidden states (only prompt
    logprobs and embeddings need them); row i's tokens are hidden rows starts[i]..."""

    tokens: np.ndarray
    logprobs: np.ndarray
    top_values: np.ndarray
    top_ids: np.ndarray
    starts: list[int]
    hidden: Callable[[], np.ndarray]
    accepted: Optional[np.ndarray] = None     # speculation: per sample row, its proposed token was accepted


def _fetch(x: jax.Array) -> np.ndarray:
    """Host copy of a step output. Outputs are replicated over the mesh, so with more than one
    process (whose arrays are not fully addressable) this process's own copy is the value."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))


def time_passes(rows: dict[tuple[int, bool, bool], list[StepRow]],
                step: Callable[[list[StepRow], bool], object], repeats: int, passes: int = 2,
                clock: Callable[[], float] = time.perf_counter) -> dict[tuple[int, bool, bool], float]:
    """Best ms of step(rows, greedy) per (token bucket, spec, greedy) key: `passes` passes over
    all keys, each timing a key `repeats` times back to back (time_steps: why)."""
    best = {key: math.inf for key in rows}
    for _ in range(passes):
        for key, r in rows.items():
            for _ in range(repeats):
                t0 = clock()
                step(r, key[2])
                best[key] = min(best[key], (clock() - t0) * 1000.0)
    return best


def monotone_costs(ms: dict[tuple[int, bool, bool], float], buckets: list[int]) -> dict[tuple[int, bool, bool], float]:
    """The table made monotone from above (time_steps: why): walking from the widest bucket
    down, an entry is lowered to the cheapest wider one, a plain entry to its spec one."""
    out = dict(ms)
    for greedy in (True, False):
        ceiling = math.inf
        for T in reversed(buckets):
            for spec in (True, False):
                if (T, spec, greedy) in out:
                    ceiling = out[(T, spec, greedy)] = min(ceiling, out[(T, spec, greedy)])
    return out


def pick(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass
class RunnerConfig:
    page_size: int
    num_pages: int
    max_running: int            # decode rows == penalty-state slots
    max_batched_tokens: int     # the step's token budget (decode tokens first, then prefill chunks)
    max_model_len: int
    max_n: int                  # most sequences per request (n)
    top_n: int                  # static top-logprobs width
    min_token_bucket: int = 16
    page_bucket_ratio: int = 2
    lora_slots: int = 0         # LoRA adapter slots (0 = LoRA disabled: no bank, programs as without it)
    lora_rank: int = 0          # every slot padded to this rank
    spec_tokens: int = 0        # most proposed tokens per row (speculative decoding; 0 = off, no spec programs)
    burst_tokens: int = 0       # the step's budget under a backlog of prompts (> max_batched_tokens; 0 = off)
    burst_fine: bool = False    # x1.25 token buckets above the budget (the latency guard's steps)
    huge_pages: bool = False    # CPU: collapse the weights onto 2 MiB pages (executor/huge_pages.py)


class StepPublisher(Protocol):
    """Where process 0 publishes its device calls in a multi-host slice (multihost.StepChannel)."""

    lock: Any                        # held across publish + call, so calls keep one order

    def publish(self, msg: tuple) -> None: ...


MIRRORED: list[str] = []             # the device-touching ModelRunner methods, in definition order


def mirrored(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A device call that process 0 of a multi-host slice publishes before making it, so every
    follower makes the same call (multihost.follow replays it); a no-op with no mirror set."""
    MIRRORED.append(fn.__name__)
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs:                   # published calls are positional: replayed as fn(runner, *args)
            args = sig.bind(self, *args, **kwargs).args[1:]
        if self.mirror is None:
            return fn(self, *args)
        chan, key = self.mirror
        with chan.lock:
            chan.publish((key, fn.__name__, args))
            return fn(self, *args)
    return call


class ModelRunner:
    def __init__(self, cfg: LlamaConfig, model: decoder.CausalLM, rc: RunnerConfig, mesh: Optional[Mesh], dtype: Any):
        if model.cfg != cfg:
            raise ValueError("the model module was built for another config than the runner's")
        self.cfg, self.rc, self.mesh = cfg, rc, mesh
        # split once: every program closes over the graph definition and takes the state's leaves,
        # placed as the parameters' sharding metadata says (a no-op when the loader placed it so)
        self.graphdef, self.params = decoder.split(model)
        if mesh is not None:
            self.params = jax.device_put(self.params, decoder.shardings(self.params, mesh))
        self.flat = FlatState.of(self.params)      # what the programs take (FlatState: why)
        # a batch-1 step streams every weight once; on 2 MiB pages it streams faster (huge_pages.py)
        self.huge_pages: Optional[huge_pages.HugePageReport] = (
            huge_pages.advise(self.flat.leaves) if rc.huge_pages and backend.platform() == "cpu" else None)
        self.mirror: Optional[tuple[StepPublisher, str]] = None     # (channel, key) on process 0 of a slice
        self.dtype = dtype
        # every running row decodes in every step, so the budget is never below the row count
        self.budget_tokens = max(rc.max_batched_tokens, rc.max_running)
        # a step holds at most every row's whole context, so a burst bucket beyond that could never
        # be filled (nor warmed up: 2 rows of 64 tokens cannot make a 256-token step)
        self.max_tokens = max(self.budget_tokens, min(rc.burst_tokens, rc.max_running * rc.max_model_len))
        # speculation puts 1 + K tokens per decoding row in a step (8 rows, K = 4: 40), so its
        # steps get the x1.25 buckets from 32 on instead of from 64 (a 40-token step ran in the
        # 64 bucket at 1.6x the work)
        self.token_buckets = step_buckets(self.budget_tokens, fine_from=32 if rc.spec_tokens > 0 else 64)
        self.token_buckets += burst_buckets(self.budget_tokens, self.max_tokens, rc.burst_fine)
        self.lp_buckets = pow2_buckets(min(rc.min_token_bucket, self.max_tokens), self.max_tokens)
        self.p_max = math.ceil(rc.max_model_len / rc.page_size)
        be = attention.get(cfg.attention_backend)
        self.page_buckets = page_buckets(self.p_max, rc.page_bucket_ratio) if be.page_buckets else [self.p_max]
        self.dummy_slot = rc.max_running
        self.few_samples = max(1, min(FEW_SAMPLES, rc.max_running // 4))
        self.mask_words = (cfg.vocab_size + 31) // 32        # the step's grammar bitmask width
        self._free_masks: dict[int, jax.Array] = {}
        self.programs = ProgramCache("decoder", context=stable_repr(
            (cfg, rc, str(np.dtype(dtype)), mesh, str(self.flat.treedef), backend.platform())))
        self.fault_hook: Optional[Callable[[str], None]] = None  # tests inject step failures here
        self._replicated = NamedSharding(mesh, P()) if mesh is not None else jax.local_devices()[0]
        self.kv_dtype = backend.kv_dtype(dtype)
        self.state = self._new_state()
        self.step_ms: dict[tuple[int, bool, bool], float] = {}   # speculation's cost model (time_steps)
        self.live_offset_ms = 0.0       # what served plain steps cost above step_ms, on average (_observe)
        # served verifying steps' cost over their priced plain equivalent (step_ms + offset), greedy
        # and sampled apart (_observe)
        self.spec_scale: dict[bool, float] = {True: 1.0, False: 1.0}
        self.lora: Optional[lora_bank.Bank] = (
            lora_bank.new_bank(cfg, rc.lora_slots, rc.lora_rank, dtype, mesh) if rc.lora_slots > 0 else None)
        self._register()

    def model(self) -> decoder.CausalLM:
        """The decoder module over the served parameters (for inspection; programs merge their own)."""
        return decoder.merge(self.graphdef, self.params)

    # ------------------------------------------------------------------ state
    def _new_state(self) -> dict:
        c, rc = self.cfg, self.rc
        # the attention backend owns the KV layout; KV heads are sharded over mesh axis "model"
        be = attention.get(c.attention_backend)
        if be.name != "reference" and self.mesh is not None and self.mesh.shape["model"] > 1:
            raise ValueError(f"attention backend {be.name} is not sharded for tensor parallelism; use reference")
        kv = be.cache_specs(c, rc.num_pages, rc.page_size)
        sh = {n: NamedSharding(self.mesh, spec) if self.mesh is not None else self._replicated for n, (_, spec) in kv.items()}
        slots = rc.max_running + 1
        return {
            "k": jnp.zeros(kv["k"][0], self.kv_dtype, device=sh["k"]),
            "v": jnp.zeros(kv["v"][0], self.kv_dtype, device=sh["v"]),
            "counts": jnp.zeros((slots, c.vocab_size), jnp.int32, device=self._replicated),
            "pm": jnp.zeros((slots, c.vocab_size), bool, device=self._replicated),
        }

    def state_lost(self) -> bool:
        """True when a failed program left the donated state deleted."""
        return any(x.is_deleted() for x in self.state.values())

    @mirrored
    def reset_state(self) -> None:
        self.state = self._new_state()

    def kv_bytes_per_page(self) -> int:
        c = self.cfg
        return 2 * c.num_layers * self.rc.page_size * c.num_kv_heads * c.kv_repeat * c.head_dim * self.kv_dtype.itemsize

    # ------------------------------------------------------------------ programs
    def rows_for(self, T: int) -> int:
        """Rows of the step program with T tokens: every row has at least one token, and at most
        max_running rows are admitted (a prompt's n sequences count as n)."""
        return min(T, self.rc.max_running)

    def samples_for(self, T: int, spec: bool) -> int:
        """Sample rows of the step program with T tokens: one per row, or with speculation one per
        verified position (a row's token and each proposed token), still at most one per token."""
        return min(T, self.rc.max_running * (1 + self.rc.spec_tokens)) if spec else self.rows_for(T)

    def _register(self) -> None:
        cfg, ps, top_n, graphdef, unflatten = self.cfg, self.rc.page_size, self.rc.top_n, self.graphdef, self.flat.unflatten
        # Step outputs are replicated over the mesh so any process can read them locally (multihost.py).
        rep = (lambda t: jax.lax.with_sharding_constraint(t, self._replicated)) if self.mesh is not None else (lambda t: t)

        def step(params, state, inp: StepInputs, sample_idx, slot_ids, sa, mask, lora, spec):
            """The model over the step's tokens (KV written; `lora` = (bank, token slots) or None),
            then per sample row: penalties, bias, bans, the grammar mask, the draw (or, with `spec`,
            the verification of each position's proposed token), logprobs and the penalty-count
            update of the emitted tokens; also the final hidden states."""
            model = decoder.merge(graphdef, unflatten(params))
            h, k, v = model(state["k"], state["v"], inp, ps, lora)

            S, few = sample_idx.shape[0], self.few_samples
            if S > few:
                # a step whose real sample rows (always first; padding rows name the dummy slot)
                # fit in `few` runs the LM head over those alone (module docstring); the rest of
                # the tail runs over all S rows, the padding rows' logits zero
                def head(n):
                    return lambda _: jnp.pad(model.logits(h[sample_idx[:n]]), [(0, S - n), (0, 0)])
                raw = jax.lax.cond(jnp.all(slot_ids[few:] == self.dummy_slot), head(few), head(S), None)
            else:
                raw = model.logits(h[sample_idx])                            # [S, V] float32
            counts = state["counts"][slot_ids]
            if spec is not None:     # position j of a row sees its proposals d1..dj as generated
                counts = counts.at[jnp.arange(counts.shape[0])[:, None], spec.prior].add(1, mode="drop")
            logits = sampling.process_logits(raw, sa, counts, state["pm"][slot_ids])
            logits = sampling.apply_token_mask(logits, mask)
            # one program for greedy and sampled steps: the draw runs behind a lax.cond on "every
            # sample row is greedy" (padding rows are temperature 0), the branch the scheduler's
            # greedy flag names; see the module docstring for what two programs cost
            all_greedy = jnp.all(sa.temperature <= 0.0)
            if spec is None:
                tok = jax.lax.cond(all_greedy, sampling.greedy, lambda x: sampling.sample(x, sa), logits)
                inc, acc = 1, jnp.zeros_like(tok)
            else:
                tok, acc = jax.lax.cond(all_greedy, lambda x: sampling.verify(x, sa, spec.draft, greedy_only=True),
                                        lambda x: sampling.verify(x, sa, spec.draft, greedy_only=False), logits)
                inc = sampling.emitted(acc, spec.draft, spec.group_start).astype(jnp.int32)
            # logprobs only when a row of the step asks for them (module docstring)
            chosen, top_v, top_i = jax.lax.cond(
                jnp.any(sa.logprobs), lambda r, t: sampling.logprobs_of(r, t, top_n),
                lambda r, t: (jnp.zeros(S, jnp.float32), jnp.zeros((S, top_n), jnp.float32),
                              jnp.zeros((S, top_n), jnp.int32)), raw, tok)
            counts = state["counts"].at[slot_ids, tok].add(inc)
            bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
            # one [S, 3 + 2N] int32 array (one device-to-host copy instead of five):
            # token, logprob bits, accepted, top-N logprob bits, top-N ids
            small = jnp.concatenate([tok[:, None], bits(chosen)[:, None], acc.astype(jnp.int32)[:, None],
                                     bits(top_v), top_i], axis=1)
            return rep((small, h)), {**state, "k": k, "v": v, "counts": counts}

        def prompt_logprobs(params, h, next_tokens):
            """Logprob (and top-N) of next_tokens[t] after position t, from the chunk's hidden states."""
            return rep(sampling.logprobs_of(decoder.merge(graphdef, unflatten(params)).logits(h), next_tokens, top_n))

        def copy_page(state, src, dst):
            k, v = attention.get(cfg.attention_backend).copy_page(cfg, state["k"], state["v"], src, dst, ps)
            return {**state, "k": k, "v": v}

        def set_slot(state, slot, prompt_ids, output_ids):
            V = cfg.vocab_size
            pm_row = jnp.zeros((V,), bool).at[prompt_ids].set(True, mode="drop")
            c_row = jnp.zeros((V,), jnp.int32).at[output_ids].add(1, mode="drop")
            return {**state, "pm": state["pm"].at[slot].set(pm_row), "counts": state["counts"].at[slot].set(c_row)}

        d = dict(donate_argnums=(1,))
        self.programs.register("step", jax.jit(step, **d))
        self.programs.register("prompt_logprobs", jax.jit(prompt_logprobs))
        self.programs.register("copy_page", jax.jit(copy_page, donate_argnums=(0,)))
        self.programs.register("set_slot", jax.jit(set_slot, donate_argnums=(0,)))
        if self.lora is not None:
            shardings = jax.tree.map(lambda x: x.sharding, self.lora)
            self.programs.register("lora_write", jax.jit(lora_bank.write_slot, donate_argnums=(0,),
                                                         out_shardings=shardings))

    def _put(self, *arrays):
        """A step's host arrays as program arguments. On one device they go as numpy arrays: the
        compiled program's C++ call path copies them in, ~25 us per array cheaper than
        jax.device_put's Python path; with ~25 small arrays per step that made a batch-8 decode
        step of the trained 3 M model (benchmarks/train_tiny.py) 1.49 instead of 2.69 ms on the
        2-core reference machine. On a mesh they are placed replicated explicitly."""
        if self.mesh is None:
            return tuple(np.asarray(a) for a in arrays)
        return jax.device_put(arrays, self._replicated)

    def _sa(self, rows: list, R: int) -> sampling.SamplingArrays:
        host = sampling.host_arrays(rows, R, NUM_BIAS, NUM_BAN)
        names = list(host)
        return sampling.SamplingArrays(**dict(zip(names, self._put(*[host[n] for n in names]))))

    def _run(self, program: str, key: tuple, args: tuple):
        if self.fault_hook is not None:
            self.fault_hook(program)
        exe = self.programs.get(program, key, args)
        return exe(*args)

    # ------------------------------------------------------------------ steps
    def step_shape(self, rows: list[StepRow]) -> tuple[int, int]:
        """(tokens, pages) bucket of a step over these rows."""
        n_tok = sum(len(r.tokens) for r in rows)
        n_samples = sum(len(r.samples) for r in rows)
        T = pick(self.token_buckets, max(1, n_tok, n_samples))
        ps = self.rc.page_size
        need = max((math.ceil((r.start + len(r.tokens)) / ps) for r in rows), default=1)
        return T, pick(self.page_buckets, need)

    def _mask_arg(self, masks: Optional[np.ndarray], R: int) -> jax.Array:
        """The [R, mask_words] grammar bitmask: the sample rows' masks, all-allowed elsewhere; with
        no constrained row, a cached all-ones device array (nothing is transferred)."""
        if masks is None:
            if R not in self._free_masks:
                # on the device once (not through _put's numpy path: 300 KB a step at a 152k vocabulary)
                self._free_masks[R] = jax.device_put(np.full((R, self.mask_words), -1, np.int32), self._replicated)
            return self._free_masks[R]
        out = np.full((R, self.mask_words), -1, np.int32)
        out[:len(masks)] = masks[:, :self.mask_words]
        return self._put(out)[0]

    def _step_args(self, rows: list[StepRow], masks: Optional[np.ndarray] = None) -> tuple[tuple, tuple]:
        """(bucket key, the step program's arguments) for these rows; masks [samples, >= mask_words]
        int32 holds the packed grammar bitmask of each sample row, in the rows' sample order."""
        ps = self.rc.page_size
        T, Pb = self.step_shape(rows)
        R = self.rows_for(T)
        if len(rows) > R:
            raise ValueError(f"{len(rows)} rows exceed the step's {R}")
        spec = any(smp.draft >= 0 for r in rows for smp in r.samples)
        if spec and self.rc.spec_tokens <= 0:
            raise ValueError("a row carries proposed tokens but speculative decoding is not enabled")
        S = self.samples_for(T, spec)
        K = max(1, self.rc.spec_tokens)
        tokens = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slots = np.zeros(T, np.int32)
        row_of = np.zeros(T, np.int32)
        kv_limit = np.zeros(T, np.int32)
        table = np.zeros((R, Pb), np.int32)
        kv_lens = np.zeros(R, np.int32)
        cu = np.zeros(R + 1, np.int32)
        lora_slot = np.zeros(T, np.int32)
        sample_idx = np.zeros(S, np.int32)
        slot_ids = np.full(S, self.dummy_slot, np.int32)
        samp: list[Optional[SamplingRow]] = []
        draft = np.full(S, -1, np.int32)
        group_start = np.arange(S, dtype=np.int32)
        prior = np.full((S, K), self.cfg.vocab_size, np.int32)
        # per sample row as Python lists, into numpy once: a verifying step has up to 64 sample
        # rows, and four numpy element writes each were ~0.15 ms of its host work
        at: list[int] = []
        slot_of: list[int] = []
        verify: list[int] = []           # sample rows that check a guess or count earlier ones
        verify_draft: list[int] = []
        verify_group: list[int] = []
        t = 0
        for i, r in enumerate(rows):
            n = len(r.tokens)
            end = r.start + n
            used = math.ceil(end / ps)
            pages = np.asarray(r.pages[:used], np.int32)
            pos = np.arange(r.start, end, dtype=np.int32)
            tokens[t:t + n] = r.tokens
            positions[t:t + n] = pos
            slots[t:t + n] = pages[pos // ps] * ps + pos % ps
            if r.cached:                 # KV already in a shared page: written to the dummy page 0 instead
                slots[t:t + r.cached] = pos[:r.cached] % ps
            row_of[t:t + n] = i
            kv_limit[t:t + n] = pos + 1
            lora_slot[t:t + n] = r.lora_slot
            table[i, :used] = pages
            kv_lens[i] = end
            g = len(at)
            if g + len(r.samples) > S:
                raise ValueError(f"{sum(len(x.samples) for x in rows)} samples exceed the step's {S}")
            for s in r.samples:
                if s.draft >= 0 or s.prior:
                    verify.append(len(at))
                    verify_draft.append(s.draft)
                    verify_group.append(g)
                    if s.prior:
                        prior[len(at), :len(s.prior)] = s.prior
                at.append(t + (s.at if s.at >= 0 else n - 1))
                slot_of.append(s.slot_id)
                samp.append(s.sampling)
            t += n
            cu[i + 1] = t
        cu[len(rows) + 1:] = t
        sample_idx[:len(at)] = at
        slot_ids[:len(slot_of)] = slot_of
        draft[verify] = verify_draft
        group_start[verify] = verify_group
        samp += [None] * (S - len(samp))
        inp = StepInputs(*self._put(tokens, positions, slots, row_of, kv_limit, table, kv_lens, cu,
                                    np.array([len(rows)], np.int32)))
        sample_idx, slot_ids = self._put(sample_idx, slot_ids)
        key: tuple = (T, Pb)
        lora = None
        if lora_slot.any():
            if self.lora is None:
                raise ValueError("a row carries a LoRA slot but LoRA is not enabled")
            lora, key = (self.lora, self._put(lora_slot)[0]), (T, Pb, "lora")
        spec_arrays = None
        if spec:
            key = key + ("spec",)
            spec_arrays = sampling.SpecArrays(*self._put(draft, group_start, prior))
        return key, (self.flat.leaves, self.state, inp, sample_idx, slot_ids, self._sa(samp, S),
                     self._mask_arg(masks, S), lora, spec_arrays)

    @mirrored
    def step(self, rows: list[StepRow], greedy: bool, masks: Optional[np.ndarray] = None) -> StepResult:
        """One ragged step over `rows` (decode rows and prefill chunks together); `masks` as in
        _step_args (None: no row is constrained). `greedy` (every sample row at temperature 0)
        keys the cost model only: the program picks its draw from the rows' temperatures."""
        t0 = time.perf_counter()
        key, args = self._step_args(rows, masks)
        (small, h), self.state = self._run("step", key, args)
        n = sum(len(r.samples) for r in rows)
        starts = list(accumulate((len(r.tokens) for r in rows), initial=0))[:-1]
        a = _fetch(small)[:n]
        self._observe((key[0], "spec" in key, greedy), (time.perf_counter() - t0) * 1000.0)
        N = self.rc.top_n
        f32 = np.float32
        return StepResult(a[:, 0], a[:, 1].view(f32), a[:, 3:3 + N].view(f32), a[:, 3 + N:], starts,
                          lambda: _fetch(h), a[:, 2].astype(bool) if "spec" in key else None)

    @mirrored
    def prompt_logprobs(self, h_rows: np.ndarray, next_tokens: list[int], n: int) -> tuple[np.ndarray, ...]:
        """Per position t < n of a chunk whose hidden states are h_rows [n, H]: logprob and top-N of
        next_tokens[t]."""
        Tb = pick(self.lp_buckets, n)
        args = self._prompt_lp_args(h_rows, next_tokens, Tb)
        return tuple(_fetch(x)[:n] for x in self._run("prompt_logprobs", (Tb,), args))

    def _prompt_lp_args(self, h_rows: np.ndarray, next_tokens: list[int], Tb: int) -> tuple:
        h = np.zeros((Tb, h_rows.shape[-1]), h_rows.dtype)
        h[:len(h_rows)] = h_rows[:Tb]
        nxt = np.zeros(Tb, np.int32)
        nxt[:len(next_tokens)] = next_tokens[:Tb]
        return (self.flat.leaves, *self._put(h, nxt))

    @mirrored
    def copy_page(self, src: int, dst: int) -> None:
        self.state = self._run("copy_page", (), self._copy_args(src, dst))

    def _copy_args(self, src: int, dst: int) -> tuple:
        return (self.state, *self._put(np.int32(src), np.int32(dst)))

    @mirrored
    def set_slot(self, slot: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        self.state = self._run("set_slot", (), self._slot_args(slot, prompt_ids, output_ids))

    def _slot_args(self, slot: int, prompt_ids: list[int], output_ids: list[int]) -> tuple:
        L = self.rc.max_model_len
        V = self.cfg.vocab_size
        pi = np.full(L, V, np.int32)
        pi[:min(len(prompt_ids), L)] = prompt_ids[:L]
        oi = np.full(L, V, np.int32)
        oi[:min(len(output_ids), L)] = output_ids[:L]
        return (self.state, *self._put(np.int32(slot), pi, oi))

    @mirrored
    def write_lora_slot(self, slot: int, arrays: dict[str, np.ndarray]) -> None:
        """Put one adapter's arrays (jax_engine/lora/adapter.py layout) into bank slot `slot` (0-based)."""
        self.lora = self._run("lora_write", (), self._lora_args(slot, arrays))

    def _lora_args(self, slot: int, arrays: dict[str, np.ndarray]) -> tuple:
        assert self.lora is not None, "LoRA is not enabled"
        return (self.lora, self._put(np.int32(slot))[0], lora_bank.host_slot(arrays, self.mesh))

    # ------------------------------------------------------------------ warmup
    def all_keys(self) -> list[tuple[str, tuple]]:
        keys = []
        ps, mr = self.rc.page_size, self.rc.max_running
        for T in self.token_buckets:
            lower = max([b for b in self.token_buckets if b < T], default=0)
            for Pb in self.page_buckets:
                # a step needing this page bucket holds at most max_running rows of Pb * ps tokens
                if lower < mr * Pb * ps or Pb == self.page_buckets[-1]:
                    base = [(T, Pb)] + ([(T, Pb, "lora")] if self.lora is not None else [])
                    spec = [k + ("spec",) for k in base] if self.rc.spec_tokens > 0 else []
                    for k in base + spec:
                        keys.append(("step", k))
        keys += [("prompt_logprobs", (T,)) for T in self.lp_buckets]
        keys += [("lora_write", ())] if self.lora is not None else []
        return keys + [("copy_page", ()), ("set_slot", ())]

    def _example(self, prog: str, key: tuple) -> tuple:
        """Arguments with the exact shapes the serving path builds for (prog, key)."""
        if prog == "step":
            T, Pb = key[:2]
            span = Pb * self.rc.page_size
            k = min(self.rows_for(T), -(-T // span))         # rows of up to `span` tokens each
            sizes = [T // k + (1 if i < T % k else 0) for i in range(k)]
            draft = 0 if "spec" in key else -1
            rows = [StepRow(tokens=[0] * n, start=max(0, span - n), pages=[0] * Pb,
                            samples=[SampleRow(self.dummy_slot, SamplingRow(temperature=0.0), draft=draft)],
                            lora_slot=1 if "lora" in key else 0) for n in sizes]
            got_key, args = self._step_args(rows)
            assert got_key == key, (got_key, key)
            return args
        if prog == "prompt_logprobs":
            return self._prompt_lp_args(np.zeros((0, self.cfg.hidden_size), self.dtype), [], key[0])
        if prog == "copy_page":
            return self._copy_args(0, 0)
        if prog == "lora_write":
            shapes = lora_bank.array_shapes(self.cfg, self.rc.lora_rank)
            return self._lora_args(0, {k: np.zeros(s, self.dtype) for k, s in shapes.items()})
        return self._slot_args(self.dummy_slot, [], [])

    def warmup(self, progress: bool = True) -> None:
        """Compile every program for every bucket, a few at a time (XLA releases the GIL)."""
        keys = self.all_keys()
        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
            futs = [pool.submit(self.programs.compile, prog, key, self._example(prog, key)) for prog, key in keys]
            for f in tqdm(as_completed(futs), total=len(futs), desc="compiling decoder programs",
                          disable=not progress, unit="prog"):
                f.result()
        self.programs.warm = True
        if self.rc.spec_tokens > 0 and self.mirror is None and jax.process_count() == 1:
            self.time_steps()

    def time_steps(self, repeats: int = 3, context: int = 256) -> None:
        """Speculation's cost model: the wall time of a whole `step` call (argument building,
        transfer, the program, fetching the tokens) per token bucket, plain and "spec", greedy
        and sampled, best of 2 x `repeats`, in ms by (token bucket, spec, greedy), on dummy rows at
        `context` positions: min(T, max_running) rows sharing the bucket's tokens, every position
        sampled in a spec step (as verification does). How many guesses a step should carry
        depends on what a wider step costs on this host: on the 2-core reference machine the
        trained 3 M-parameter model (benchmarks/train_tiny.py, 8 rows) took ~3.3 ms per step of
        8 decode tokens, of which ~1.2 ms building arguments and ~1.4 ms waiting for the device,
        against ~7-8 ms of device time alone for 64 tokens; on an accelerator a step of 40 tokens
        costs what one of 8 does. Sampled steps are timed apart because their spec variant costs
        more: its rejection sampling runs over every verified position (a 2-vCPU Xeon, that
        model, ms greedy / sampled: 8 plain 1.15 / 1.45, 24 + spec 2.02 / 2.87, 40 + spec
        2.61 / 3.52); with the greedy table the planner kept guesses that did not pay for
        sampled rows (8 rows at temperature 0.8: 0.92x the speed without speculation).
        Not run on a multi-host slice (the calls would have to be mirrored); the planner then
        treats every width as equal.

        Timings on a busy host are noisy, and a stall only ever adds time: every width is timed
        in two passes over all widths, `repeats` steps back to back in each (back to back as
        serving runs them: timed one step per pass, the narrow widths ran after wide ones with
        their caches cold, 1.07 against 0.83 ms for one token), so a stall has to hit a width in
        both passes to inflate it; then each table is made monotone from above: no width costs
        more than a wider one, a plain step no more than its "spec" program. Before, one
        back-to-back run per width and a table made monotone from below: one width timed during
        a stall (32 tokens at 3.38 ms against ~1.8) raised every wider one up to 56 tokens to
        that, the planner saw 32- to 56-token verifying steps as costing the same, and 8 streams
        repeating their answers ran 2.31x faster than without speculation in that run, against
        2.56-2.66x in runs with this table (trained model, 2-vCPU Xeon)."""
        compiled = set(self.programs.keys())
        cases = [(T, spec, greedy) for greedy in (True, False) for T in self.token_buckets
                 for spec in ((False, True) if self.rc.spec_tokens > 0 else (False,))]
        rows = {c: r for c in cases if (r := self._timing_rows(c[0], c[1], context, compiled, c[2])) is not None}
        self.step_ms = monotone_costs(time_passes(rows, self.step, repeats),
                                      self.token_buckets)
        self.live_offset_ms = 0.0
        self.spec_scale = {True: 1.0, False: 1.0}

    def _timing_rows(self, T: int, spec: bool, context: int, compiled: set,
                     greedy: bool = True) -> Optional[list[StepRow]]:
        """Dummy rows filling token bucket T exactly (KV written to reserved page 0), sampled at
        temperature 0 or (not greedy) 1, or None when no compiled program fits them."""
        ps, S = self.rc.page_size, self.samples_for(T, spec)
        R = self.rows_for(T)
        sizes = [T // R + (1 if i < T % R else 0) for i in range(R)]
        room = S
        rows = []
        for n in sizes:
            k = min(n, max(1, room - (R - len(rows) - 1))) if spec else 1
            room -= k
            samples = [SampleRow(self.dummy_slot, SamplingRow(temperature=0.0 if greedy else 1.0), at=n - k + j,
                                 draft=0 if spec and j < k - 1 else -1)
                       for j in range(k)]
            if spec and k == 1:
                samples[0].draft = 0
            start = max(0, min(context, self.p_max * ps - n))
            rows.append(StepRow(tokens=[0] * n, start=start, pages=[0] * self.p_max, samples=samples))
        key = self.step_shape(rows) + (("spec",) if spec else ())
        return rows if ("step", key) in compiled else None

    def _observe(self, key: tuple[int, bool, bool], ms: float) -> None:
        """Keep the cost model current with what served steps cost. The warmup table (time_steps)
        is the best of a few steps on an idle process; while serving, the event loop and the
        streams' host work share the cores with the program and every step costs more.

        Plain steps move one live offset for the whole table, by about the same time whatever
        the width (2-vCPU Zen 4, trained model, 8 sampled rows: a plain 8-token step 2.5 ms live
        vs 1.5 at warmup). An earlier version moved each entry toward its own steps, so the
        plain narrow entries the server runs all the time went up while the verifying ones it
        runs rarely kept their idle warmup value.

        Verifying steps move a scale of their kind (greedy or sampled) instead: they cost more
        live than the offset alone says, in proportion to their width. Measured on 8 sampled
        streams of the trained model (2-vCPU Zen 4, same process, ms live / table): 16-token
        verifying steps 3.04 / 2.45, 32-token 4.67 / 3.15, 40-token 4.5-5.5 / 3.03, 64-token
        6.8-7.5 / 4.57, against plain 8-token ones 1.6-2.0 / 1.6 (the warmup times each width back
        to back and keeps the best; served, a verifying step comes alone between plain ones).
        Priced at table + offset, the verifying steps of a sampled pass cost 31-54 % more than
        the planner expected (92.8 ms priced, 122 ms taken in one pass), and it verified guesses
        that did not pay. The offset no longer learns from verifying steps: a rare wide one would move
        every plain price. Before and after (with scheduler._draft asking rows only for the
        guesses the pricing could verify), alternating in one process, suffix, K = 16, tok/s
        over `off`: 8 sampled streams 0.966 -> 1.010 (24 rounds; paired medians 0.993 -> 1.012),
        a second 24-round run 0.917 -> 0.941 (paired 0.946 -> 0.932): a few percent at most on
        this host's noise (rounds move +-15 %); 8 copy streams 1.529 -> 1.524 (16 rounds), 8
        repeated ones 2.48 -> 2.53 (8 rounds): unchanged where guesses pay."""
        old = self.step_ms.get(key)
        if old is None:
            return
        if key[1]:
            base = max(old + self.live_offset_ms, 1e-3)
            lo, hi = SPEC_SCALE_RANGE
            r = min(max(ms / base, lo), hi)
            self.spec_scale[key[2]] += SPEC_SCALE_WEIGHT * (r - self.spec_scale[key[2]])
        else:
            self.live_offset_ms += LIVE_COST_WEIGHT * ((ms - old) - self.live_offset_ms)

    def step_cost(self, tokens: int, spec: bool, greedy: bool = True) -> float:
        """Measured ms of a step over `tokens` tokens (time_steps, plus the live offset; times the
        live scale of its kind for a verifying step: _observe), greedy or sampled; 1.0 when not
        measured."""
        ms = self.step_ms.get((pick(self.token_buckets, max(1, tokens)), spec, greedy))
        if ms is None:
            return 1.0
        return (ms + self.live_offset_ms) * (self.spec_scale[greedy] if spec else 1.0)
