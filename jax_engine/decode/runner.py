"""The decoder's compiled programs and device state; the single owner of static shapes.

Programs (each compiled ahead of time per bucket at warmup, looked up through ProgramCache):
  decode_{greedy,sample}[B, P]  one token for each of B rows, with sampling fused in
  prefill[Bp, T, P]             chunks of up to T tokens of Bp sequences (Bp * T <= the token
                                budget); last-token logits and hidden states of every row
  first_{greedy,sample}[R]      the first token(s) of a prompt (R = n > 1 samples) from its logits
  prompt_logprobs[T]            logprobs of the next prompt token at every position of a chunk
  copy_page                     copy-on-write of a partially filled page for n > 1 forks
  set_slot                      (re)initialise a row of the penalty state
Device state (donated into every program, so it is updated in place):
  k, v   [L, num_pages * page_size, KVH, D]  the paged KV cache, page 0 reserved
  counts [slots + 1, V] int32 output-token counts; pm [slots + 1, V] prompt-token mask
"""
from __future__ import annotations

import functools
import inspect
import math
import os
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from jax_engine import attention
from jax_engine.decode import sampling
from jax_engine.decode.rows import DecodeRow, SamplingRow
from jax_engine.executor import backend
from jax_engine.executor.compilation import ProgramCache
from jax_engine.models import llama
from jax_engine.models.llama import LlamaConfig, StepInputs

NUM_BIAS = 64     # static width of the sparse logit-bias arrays (a request may set up to this many)
NUM_BAN = 16      # static width of the min_new_tokens ban list (EOS + stop token ids)


def pow2_buckets(lo: int, hi: int) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return sorted(set(out))


def page_buckets(p_max: int, ratio: int = 2) -> list[int]:
    """Page-count buckets p_max, p_max/ratio, ... 1. Ratio 2 wastes at most half the gathered KV
    (ratio 4: three quarters); on CPU it made batch-16 decode at context 192 24% faster
    (96 -> 73 ms per step) for about twice the decode programs (prefill keeps ratio 4)."""
    out, b = [], p_max
    while b >= 1:
        out.append(b)
        if b == 1:
            break
        b = max(1, b // ratio)
    return sorted(set(out))


def _fetch(x: jax.Array) -> np.ndarray:
    """Host copy of a step output. Outputs are replicated over the mesh, so with more than one
    process (whose arrays are not fully addressable) this process's own copy is the value."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))


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
    max_batched_tokens: int     # largest prefill chunk
    max_model_len: int
    max_n: int                  # sample rows of the prefill program
    top_n: int                  # static top-logprobs width
    min_token_bucket: int = 16
    page_bucket_ratio: int = 2


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
    def __init__(self, cfg: LlamaConfig, params: dict, rc: RunnerConfig, mesh: Optional[Mesh], dtype: Any):
        self.cfg, self.params, self.rc, self.mesh = cfg, params, rc, mesh
        self.mirror: Optional[tuple[StepPublisher, str]] = None     # (channel, key) on process 0 of a slice
        self.dtype = dtype
        self.batch_buckets = pow2_buckets(1, rc.max_running)
        self.token_buckets = pow2_buckets(min(rc.min_token_bucket, rc.max_batched_tokens), rc.max_batched_tokens)
        self.p_max = math.ceil(rc.max_model_len / rc.page_size)
        self.page_buckets = page_buckets(self.p_max, rc.page_bucket_ratio)
        # Prefill is compute-bound on its T tokens, so padding its gather costs little there, while
        # every prefill page bucket multiplies the (rows, tokens) grid: keep those coarse (x4).
        self.prefill_page_buckets = page_buckets(self.p_max, max(4, rc.page_bucket_ratio))
        self.sample_buckets = sorted({1, rc.max_n})
        self.prefill_batch_buckets = [b for b in self.batch_buckets
                                      if b * self.token_buckets[0] <= rc.max_batched_tokens]
        self.dummy_slot = rc.max_running
        self.programs = ProgramCache("decoder")
        self.fault_hook: Optional[Callable[[str], None]] = None  # tests inject step failures here
        self._replicated = NamedSharding(mesh, P()) if mesh is not None else jax.local_devices()[0]
        self.kv_dtype = backend.kv_dtype(dtype)
        self.state = self._new_state()
        self._register()

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
    def _register(self) -> None:
        cfg, ps, top_n = self.cfg, self.rc.page_size, self.rc.top_n
        # Step outputs are replicated over the mesh so any process can read them locally (multihost.py).
        rep = (lambda t: jax.lax.with_sharding_constraint(t, self._replicated)) if self.mesh is not None else (lambda t: t)

        def sample_tail(raw, state, slot_ids, sa, mode):
            """Penalties, bias, bans, the draw, logprobs, and the penalty-count update."""
            logits = sampling.process_logits(raw, sa, state["counts"][slot_ids], state["pm"][slot_ids])
            tok = sampling.greedy(logits) if mode == "greedy" else sampling.sample(logits, sa)
            chosen, top_v, top_i = sampling.logprobs_of(raw, tok, top_n)
            return rep((tok, chosen, top_v, top_i)), {**state, "counts": state["counts"].at[slot_ids, tok].add(1)}

        def decode(params, state, tokens, positions, slots, page_table, kv_lens, slot_ids, sa, *, mode):
            h, k, v = llama.forward(params, cfg, state["k"], state["v"],
                                    StepInputs(tokens[:, None], positions[:, None], slots[:, None], page_table, kv_lens), ps)
            raw = llama.lm_head(params, cfg, h[:, 0])
            return sample_tail(raw, {**state, "k": k, "v": v}, slot_ids, sa, mode)

        def prefill(params, state, tokens, positions, slots, page_table, kv_lens, last_idx):
            """KV for Bp chunks (one per row); each row's last raw logits and all hidden states."""
            h, k, v = llama.forward(params, cfg, state["k"], state["v"],
                                    StepInputs(tokens, positions, slots, page_table, kv_lens), ps)
            last = jnp.take_along_axis(h, last_idx[:, None, None], axis=1)[:, 0]
            return rep((llama.lm_head(params, cfg, last), h)), {**state, "k": k, "v": v}

        def first_token(state, raw, slot_ids, sa, *, mode):
            """The first token(s) after a prompt: R rows (n > 1 samples) from the same logits."""
            R = slot_ids.shape[0]
            return sample_tail(jnp.broadcast_to(raw[None], (R, raw.shape[0])), state, slot_ids, sa, mode)

        def prompt_logprobs(params, h, next_tokens):
            """Logprob (and top-N) of next_tokens[t] after position t, from the chunk's hidden states."""
            return rep(sampling.logprobs_of(llama.lm_head(params, cfg, h), next_tokens, top_n))

        def copy_page(state, src, dst):
            k, v = llama.attention.get(cfg.attention_backend).copy_page(cfg, state["k"], state["v"], src, dst, ps)
            return {**state, "k": k, "v": v}

        def set_slot(state, slot, prompt_ids, output_ids):
            V = cfg.vocab_size
            pm_row = jnp.zeros((V,), bool).at[prompt_ids].set(True, mode="drop")
            c_row = jnp.zeros((V,), jnp.int32).at[output_ids].add(1, mode="drop")
            return {**state, "pm": state["pm"].at[slot].set(pm_row), "counts": state["counts"].at[slot].set(c_row)}

        d = dict(donate_argnums=(1,))
        self.programs.register("decode_greedy", jax.jit(functools.partial(decode, mode="greedy"), **d))
        self.programs.register("decode_sample", jax.jit(functools.partial(decode, mode="sample"), **d))
        self.programs.register("prefill", jax.jit(prefill, **d))
        self.programs.register("first_greedy", jax.jit(functools.partial(first_token, mode="greedy"), donate_argnums=(0,)))
        self.programs.register("first_sample", jax.jit(functools.partial(first_token, mode="sample"), donate_argnums=(0,)))
        self.programs.register("prompt_logprobs", jax.jit(prompt_logprobs))
        self.programs.register("copy_page", jax.jit(copy_page, donate_argnums=(0,)))
        self.programs.register("set_slot", jax.jit(set_slot, donate_argnums=(0,)))

    def _put(self, *arrays):
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
    def _decode_args(self, rows: list[DecodeRow], greedy: bool) -> tuple[str, tuple, tuple]:
        n = len(rows)
        B = pick(self.batch_buckets, n)
        Pb = pick(self.page_buckets, max(len(r.pages) for r in rows))
        tokens = np.zeros(B, np.int32)
        positions = np.zeros(B, np.int32)
        slots = np.zeros(B, np.int32)
        table = np.zeros((B, Pb), np.int32)
        kv_lens = np.zeros(B, np.int32)
        slot_ids = np.full(B, self.dummy_slot, np.int32)
        for i, r in enumerate(rows):
            tokens[i], positions[i], slots[i] = r.token, r.position, r.kv_slot
            table[i, :len(r.pages)] = r.pages
            kv_lens[i] = r.position + 1
            slot_ids[i] = r.slot_id
        sa = self._sa([r.sampling for r in rows], B)
        args = (self.params, self.state, *self._put(tokens, positions, slots, table, kv_lens, slot_ids), sa)
        return ("decode_greedy" if greedy else "decode_sample"), (B, Pb), args

    @mirrored
    def decode(self, rows: list[DecodeRow], greedy: bool) -> tuple[np.ndarray, ...]:
        """One token for each row (a running sequence)."""
        prog, key, args = self._decode_args(rows, greedy)
        out, self.state = self._run(prog, key, args)
        return tuple(_fetch(x)[:len(rows)] for x in out)

    def prefill_shape(self, lens: list[int], kv_lens: list[int]) -> tuple[int, int, int]:
        """(rows, tokens, pages) bucket for chunks of these lengths ending at these kv lengths."""
        return (pick(self.prefill_batch_buckets, len(lens)), pick(self.token_buckets, max(lens)),
                pick(self.prefill_page_buckets, math.ceil(max(kv_lens) / self.rc.page_size)))

    def _prefill_args(self, chunks: list[tuple[list[int], int, list[int]]]) -> tuple[str, tuple, tuple]:
        """chunks: (tokens, start position, pages) per sequence."""
        ps = self.rc.page_size
        Bp, T, Pb = self.prefill_shape([len(c[0]) for c in chunks], [c[1] + len(c[0]) for c in chunks])
        tok = np.zeros((Bp, T), np.int32)
        pos = np.zeros((Bp, T), np.int32)
        slots = np.zeros((Bp, T), np.int32)
        table = np.zeros((Bp, Pb), np.int32)
        kv_lens = np.zeros(Bp, np.int32)
        last = np.zeros(Bp, np.int32)
        for i, (tokens, start, pages) in enumerate(chunks):
            n = len(tokens)
            tok[i, :n] = tokens
            p = np.arange(start, start + n)
            pos[i, :n] = p
            slots[i, :n] = np.asarray(pages, np.int32)[p // ps] * ps + p % ps
            table[i, :len(pages)] = pages[:Pb]
            kv_lens[i] = start + n
            last[i] = n - 1
        args = (self.params, self.state, *self._put(tok, pos, slots, table, kv_lens, last))
        return "prefill", (Bp, T, Pb), args

    def _first_args(self, raw: np.ndarray, sample_rows: list[Optional[SamplingRow]],
                    slot_ids: list[int]) -> tuple[str, tuple, tuple]:
        R = pick(self.sample_buckets, len(sample_rows))
        sid = np.full(R, self.dummy_slot, np.int32)
        sid[:len(slot_ids)] = slot_ids
        rows: list[Optional[SamplingRow]] = [*sample_rows, *[None] * (R - len(sample_rows))]
        greedy = all(r is None or r.temperature <= 0 for r in rows)
        args = (self.state, jax.device_put(raw, self._replicated), self._put(sid)[0], self._sa(rows, R))
        return ("first_greedy" if greedy else "first_sample"), (R,), args

    @mirrored
    def prefill(self, chunks: list[tuple[list[int], int, list[int]]]) -> tuple[np.ndarray, Callable[[], np.ndarray]]:
        """Compute the KV of several sequences' chunks in one program.

        Returns the last-token logits [rows, V] on the host and a function fetching the hidden
        states [rows, T, H] (only prompt logprobs and embeddings need them). Rows are sliced on
        the host: slicing on the device would compile a small program per shape.
        """
        prog, key, args = self._prefill_args(chunks)
        (raw, h), self.state = self._run(prog, key, args)
        return _fetch(raw), lambda: _fetch(h)

    @mirrored
    def first_tokens(self, raw_row: np.ndarray, sample_rows: list[SamplingRow], slot_ids: list[int]) -> tuple[np.ndarray, ...]:
        """Sample the first token of each of a prompt's n sequences from its last logits."""
        prog, key, args = self._first_args(raw_row, sample_rows, slot_ids)
        out, self.state = self._run(prog, key, args)
        return tuple(_fetch(x)[:len(sample_rows)] for x in out)

    @mirrored
    def prompt_logprobs(self, h_row: np.ndarray, next_tokens: list[int], n: int) -> tuple[np.ndarray, ...]:
        """Per position t < n: logprob and top-N of next_tokens[t]."""
        return tuple(_fetch(x)[:n] for x in self._prompt_lp(h_row, next_tokens))

    def _prompt_lp_args(self, h: jax.Array, next_tokens: list[int]) -> tuple:
        nxt = np.zeros(h.shape[0], np.int32)
        nxt[:len(next_tokens)] = next_tokens
        return (self.params, jax.device_put(h, self._replicated), self._put(nxt)[0])

    def _prompt_lp(self, h: jax.Array, next_tokens: list[int]):
        return self._run("prompt_logprobs", (h.shape[0],), self._prompt_lp_args(h, next_tokens))

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

    # ------------------------------------------------------------------ warmup
    def all_keys(self) -> list[tuple[str, tuple]]:
        keys = []
        for prog in ("decode_greedy", "decode_sample"):
            keys += [(prog, (B, Pb)) for B in self.batch_buckets for Pb in self.page_buckets]
        # a chunk of n tokens (bucket T: n > T/2) needs kv_len >= n, so smaller page buckets never occur
        # rows x tokens (padding included) never exceeds the step's token budget
        keys += [("prefill", (Bp, T, Pb)) for Bp in self.prefill_batch_buckets for T in self.token_buckets
                 for Pb in self.prefill_page_buckets
                 if Bp * T <= self.rc.max_batched_tokens and (2 * Pb * self.rc.page_size > T or T == self.token_buckets[0])]
        keys += [("prompt_logprobs", (T,)) for T in self.token_buckets]
        keys += [(prog, (R,)) for prog in ("first_greedy", "first_sample") for R in self.sample_buckets]
        return keys + [("copy_page", ()), ("set_slot", ())]

    def _example(self, prog: str, key: tuple) -> tuple:
        """Arguments with the exact shapes the serving path builds for (prog, key)."""
        ps = self.rc.page_size
        if prog.startswith("decode"):
            B, Pb = key
            rows = [DecodeRow(token=0, position=0, kv_slot=0, pages=[0] * Pb, slot_id=self.dummy_slot)] * B
            got = self._decode_args(rows, prog == "decode_greedy")
        elif prog == "prefill":
            Bp, T, Pb = key
            n = min(T, Pb * ps)
            got = self._prefill_args([([0] * n, Pb * ps - n, [0] * Pb)] * Bp)
        elif prog.startswith("first"):
            raw = np.zeros((self.cfg.vocab_size,), np.float32)
            row = SamplingRow(temperature=0.0 if prog == "first_greedy" else 1.0)
            got = self._first_args(raw, [row] * key[0], [self.dummy_slot] * key[0])
        elif prog == "prompt_logprobs":
            h = np.zeros((key[0], self.cfg.hidden_size), self.dtype)
            return self._prompt_lp_args(h, [])
        elif prog == "copy_page":
            return self._copy_args(0, 0)
        else:
            return self._slot_args(self.dummy_slot, [], [])
        assert got[:2] == (prog, key), (got[:2], prog, key)
        return got[2]

    def warmup(self, progress: bool = True) -> None:
        """Compile every program for every bucket, a few at a time (XLA releases the GIL)."""
        keys = self.all_keys()
        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
            futs = [pool.submit(self.programs.compile, prog, key, self._example(prog, key)) for prog, key in keys]
            for f in tqdm(as_completed(futs), total=len(futs), desc="compiling decoder programs",
                          disable=not progress, unit="prog"):
                f.result()
        self.programs.warm = True
