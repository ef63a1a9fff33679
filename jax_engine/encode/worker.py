"""One served encoder (embeddings or cross-encoder scores) and the thread that owns its device work.

Flow: `submit` validates and tokenizes on the caller's thread, so every input error is raised
synchronously, then queues the request. The worker thread takes queued inputs in priority order
under a token budget (TEI's batcher), sorts them by length and cuts them into groups that each
fit one static (batch, seq_len) bucket (`plan_groups`: the cuts of least modelled cost, so short
inputs are not padded to a long neighbour and no program is mostly padding rows), runs the
groups and scatters their rows back to each request's input order. Where the CPU attention
kernel serves every program size (`--cpu-matmul auto` timed it faster, or `kernel`), inputs are
instead packed back to back into token-bucket programs (TEI's layout, `packed_buckets`): no
padding row runs through the matrices, and there are far fewer programs. Every bucket program is
compiled at `warmup`; a request whose inputs are all done gets its `done` callback, on the
worker thread.

Callback contract: `done(EmbedOutput)` on success, `done(EngineError)` on failure, and
`done(None)` when the request was aborted (there is no abort error kind; the caller that
aborted already knows why).
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import jax
import numpy as np
from flax import nnx
from tokenizers import Tokenizer
from tqdm import tqdm

from jax_engine.checkpoint.hf import load_tokenizer, read_config
from jax_engine.config import EngineArgs, ModelSpec, ResolvedSpec, resolve
from jax_engine.errors import AlreadyExists, EngineError, Internal, InvalidRequest, Overloaded, Unavailable
from jax_engine.executor import backend
from jax_engine.executor.compilation import FlatState, ProgramCache, install_compile_listener
from jax_engine.executor.program_store import stable_repr
from jax_engine.kernels import choose as cpu_matmul
from jax_engine.models import bert
from jax_engine.types import EmbedOutput, EmbedRequest, MatmulRoute, ModelInfo, ModelStats

log = logging.getLogger(__name__)

DoneCallback = Callable[[Optional[Union[EmbedOutput, EngineError]]], None]
MIN_SEQ_BUCKET = 16
PACKED_FINE_STEP = 8        # packed token buckets: every 8 tokens up to PACKED_FINE_UNTIL
PACKED_FINE_UNTIL = 64
# Fixed cost of one program launch in the planner's cost model, in padded-token units
# (measured on XLA:CPU with MiniLM: a batch-1 program costs about this many tokens more than
# its share of a large batch).
DISPATCH_COST_TOKENS = 24
# On CPU the largest program XLA runs well is far below the default token budget: past this
# many tokens the activations leave the caches and tokens/s drops (see _program_token_cap).
CPU_PROGRAM_TOKENS = 2048


# ---------------------------------------------------------------------------------------------
# buckets


class EncoderBuckets:
    """Static (batch, seq_len) shapes and the cost model the planner uses to fill them.

    seq_len: 16, 32, then steps of 1.5x / 2x alternately (16, 32, 48, 64, 96, 128, 192, 256,
    384, 512, ...), the model's max closing the list, so a bucket wastes at most a third of its
    width on padding instead of half. batch: powers of two with batch * seq_len <= the program
    token cap (`max_program_tokens`, by default the whole token budget), and at least 1.
    """

    def __init__(self, max_len: int, max_batch_tokens: int, max_program_tokens: Optional[int] = None,
                 attn_tokens: Optional[int] = None, dispatch_tokens: int = 0):
        if max_batch_tokens < max_len:
            raise InvalidRequest(  # TEI #723: a budget below one input would never schedule it
                f"embed_max_batch_tokens ({max_batch_tokens}) must be >= max_model_len ({max_len})")
        self.max_batch_tokens = max_batch_tokens
        self.max_program_tokens = min(max_program_tokens or max_batch_tokens, max_batch_tokens)
        self.attn_tokens = attn_tokens
        self.dispatch_tokens = dispatch_tokens
        seq, s = [], MIN_SEQ_BUCKET
        while s < max_len:
            seq.append(s)
            pow2 = s & (s - 1) == 0
            s = s * 3 // 2 if pow2 and s >= 2 * MIN_SEQ_BUCKET else (2 * s if pow2 else 1 << s.bit_length())
        self.seq_lens = seq + [max_len]

    def seq_bucket(self, n: int) -> int:
        return next(s for s in self.seq_lens if s >= n)

    def max_batch(self, seq_len: int) -> int:
        # batch 1 always: one input of the longest length must still run (the budget holds it)
        return 1 << int(math.log2(max(1, self.max_program_tokens // seq_len)))

    @staticmethod
    def batch_bucket(n: int) -> int:
        return 1 << max(n - 1, 0).bit_length()

    def keys(self) -> list[tuple[int, int]]:
        """Every (batch, seq_len) program, smallest first."""
        out = []
        for s in self.seq_lens:
            b = 1
            while b <= self.max_batch(s):
                out.append((b, s))
                b *= 2
        return out

    def cost(self, batch: int, seq_len: int) -> float:
        """Modelled time of one (batch, seq_len) program, in token-layer units: every padded
        token costs as much as a real one, attention grows with seq_len (its share of a token's
        work is seq_len / attn_tokens), and each dispatch has a fixed cost."""
        per_token = 1.0 + (seq_len / self.attn_tokens if self.attn_tokens else 0.0)
        return batch * seq_len * per_token + self.dispatch_tokens

    def padded_tokens(self, groups: list[tuple[int, int, list[int]]]) -> int:
        return sum(b * s for b, s, _ in groups)


def packed_buckets(cap: int) -> list[int]:
    """Token buckets of packed programs up to `cap`: every 8 tokens to 64, then 96, 128, 192, 256
    (a third of a small program padding at most), then steps of 128 to 1024 and of 256 beyond (a
    request of 32 sentences, ~1,200 tokens, pads by 7% instead of the 20% a length-sorted padded
    batch does), `cap` closing the list. all-MiniLM-L6-v2 on CPU: 22 programs instead of 45.
    Why steps of 8 below 64: a single sentence is one program of its bucket, and there a program
    costs ~0.07 ms a token on top of ~2.5 ms (MiniLM, 2-vCPU Zen 5: 16 tokens 3.5 ms, 32 4.3,
    64 6.2), so steps of 16 padded a 12-63-token sentence by 7.5 tokens (~0.5 ms) on average."""
    out, t = [], PACKED_FINE_STEP
    while t < cap:
        out.append(t)
        if t < PACKED_FINE_UNTIL:
            t += PACKED_FINE_STEP
        elif t < 256:
            t = t * 3 // 2 if t & (t - 1) == 0 else 1 << t.bit_length()
        else:
            t += 128 if t < 1024 else 256
    return out + [cap]


def pack_groups(lengths: Sequence[int], buckets: Sequence[int]) -> list[tuple[int, list[int]]]:
    """Inputs in order, packed greedily into programs of at most buckets[-1] tokens:
    [(token bucket, indices)]."""
    cap = buckets[-1]
    groups: list[tuple[int, list[int]]] = []
    cur: list[int] = []
    tokens = 0
    for k, n in enumerate(lengths):
        if n > cap:
            raise InvalidRequest(f"an input of {n} tokens exceeds the longest bucket {cap}")
        if cur and tokens + n > cap:
            groups.append((next(b for b in buckets if b >= tokens), cur))
            cur, tokens = [], 0
        cur.append(k)
        tokens += n
    if cur:
        groups.append((next(b for b in buckets if b >= tokens), cur))
    return groups


def plan_groups(lengths: Sequence[int], buckets: EncoderBuckets) -> list[tuple[int, int, list[int]]]:
    """Cut inputs into bucket programs of least total modelled cost: [(batch, seq_len, indices)].

    Inputs are sorted by length (a group is a run of neighbours in that order) and an exact
    dynamic program over the sorted list picks the cuts. Only maximal runs need trying: a group
    in bucket (b, s) starting at input i takes min(b, inputs up to length s) inputs, since
    taking fewer leaves longer inputs to later groups for the same bucket cost. `indices` keep
    each group's positions in `lengths`, shortest first; every group fits a key of `buckets`.
    """
    n = len(lengths)
    if n == 0:
        return []
    order = sorted(range(n), key=lengths.__getitem__)
    sl = [lengths[k] for k in order]
    if sl[-1] > buckets.seq_lens[-1]:
        raise InvalidRequest(f"an input of {sl[-1]} tokens exceeds the longest bucket {buckets.seq_lens[-1]}")
    ends = {s: bisect.bisect_right(sl, s) for s in buckets.seq_lens}  # inputs of length <= s
    best = [0.0] * (n + 1)
    step: list[tuple[int, int, int]] = [(0, 0, 0)] * n          # (end, batch, seq_len) per start
    for i in range(n - 1, -1, -1):
        top, choice = math.inf, (0, 0, 0)
        for s in buckets.seq_lens:
            end = ends[s]
            if end <= i:
                continue                                       # input i is longer than s
            b = 1
            while b <= buckets.max_batch(s):
                j = min(i + b, end)
                bb = buckets.batch_bucket(j - i)
                c = buckets.cost(bb, s) + best[j]
                if c < top:
                    top, choice = c, (j, bb, s)
                if j == end:
                    break                                      # a bigger batch adds only padding
                b *= 2
            if end == n:
                break                                          # wider buckets only add padding
        best[i], step[i] = top, choice
    groups, i = [], 0
    while i < n:
        j, bb, s = step[i]
        groups.append((bb, s, order[i:j]))
        i = j
    return groups


# ---------------------------------------------------------------------------------------------
# queued work


@dataclass(eq=False)  # identity equality: jobs are looked up in the heap by identity
class _Job:
    """One accepted request: its tokenized inputs and the rows computed so far."""

    req: EmbedRequest
    done: DoneCallback
    ids: list[np.ndarray]
    types: list[np.ndarray]
    normalize: bool
    seq: int
    results: np.ndarray
    next_input: int = 0          # inputs before this index have been taken by the worker
    remaining: int = 0
    finished: bool = False       # done already called (result, error or abort)

    def __lt__(self, other: "_Job") -> bool:  # heap order: priority, then arrival
        return (self.req.priority, self.seq) < (other.req.priority, other.seq)


@dataclass
class _Group:
    """Inputs that run as one (batch, seq_len) bucket program."""

    items: list[tuple[_Job, int]] = field(default_factory=list)
    batch: int = 0
    seq_len: int = 0              # packed: the token bucket (batch 1)
    packed: bool = False


class EmbedWorker:
    """Serves one encoder model; `submit` is thread-safe, device work stays on one thread.
    `spec` is resolved against `args` here unless it already is."""

    def __init__(self, spec: Union[ModelSpec, ResolvedSpec], args: EngineArgs):
        install_compile_listener()
        spec = spec if isinstance(spec, ResolvedSpec) else resolve(spec, args)
        self.spec, self.args = spec, args
        dtype = spec.dtype
        self.cfg, model = bert.load_encoder(spec.path, dtype, task=spec.task)
        self.tokenizer = load_tokenizer(spec.path)
        # Fast tokenizers mutate their truncation state per call and fail ("Already borrowed")
        # when two threads call at once; submit runs on callers' threads, so serialize it.
        self._tok_lock = threading.Lock()
        # resolve(): a pinned length, else sentence-transformers' max_seq_length, else --max-model-len
        cap = spec.max_model_len
        self.max_len = min(self.cfg.max_len, cap) if cap else self.cfg.max_len
        # two private copies of the fast tokenizer's backend, truncating at max_len and not: never
        # mutated after this, so encoding through them takes no lock (a small request tokenized
        # inline on the event loop never waits behind a large one on an executor thread)
        self._backends = _backend_tokenizers(self.tokenizer, self.max_len)
        self.buckets = EncoderBuckets(
            self.max_len, args.embed_max_batch_tokens, max_program_tokens=_program_token_cap(),
            attn_tokens=2 * self.cfg.hidden_size + self.cfg.intermediate_size,
            dispatch_tokens=DISPATCH_COST_TOKENS)
        # --cpu-matmul: auto times XLA's dot against the packed-panel kernel per layer matrix and
        # program size (jax_engine/kernels/choose.py, configure_encoder); kernel / xla force a path
        self.cfg.matmul_plan = cpu_matmul.configure_encoder(
            args.cpu_matmul, backend.platform(), backend.DTYPE_NAMES[dtype], 1, bert.matrix_dims(self.cfg),
            layers=self.cfg.num_layers, max_rows=self.buckets.max_program_tokens, attention=bert.attention_dims(self.cfg),
            gelu=bert.fused_gelu_matrix(self.cfg))
        self.num_params = bert.count_params(model)               # the checkpoint's, before any packed copy
        # split once: the bucket programs close over the graph definition and take the state's leaves
        self.graphdef, self.params = nnx.split(bert.pack_for_kernel(model, self.cfg))
        self.flat = FlatState.of(self.params)                  # what the programs take (FlatState: why)
        self.programs = ProgramCache(f"embed:{spec.name}", context=stable_repr(
            (self.cfg, dtype, str(self.flat.treedef), backend.platform())))
        self.programs.register("forward", jax.jit(self._forward))
        self.packed = bert.attention_on_kernel(self.cfg)       # the varlen attention kernel at every size
        self.token_buckets = packed_buckets(max(self.buckets.max_program_tokens, self.max_len)) if self.packed else []
        self.programs.register("forward_packed", jax.jit(self._forward_packed))
        self.matryoshka_dims = _matryoshka_dimensions(spec.path, self.cfg) if self.cfg.task == "embed" else []
        self.info = self._build_info(dtype)

        self._cv = threading.Condition()
        self._queue: list[_Job] = []                 # heap of jobs with inputs not yet taken
        self._jobs: dict[str, _Job] = {}             # unfinished jobs by request id
        self._arrivals = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._stopped = False
        self._total_tokens = 0
        self._busy_s = 0.0
        self.padded_tokens = 0      # batch * seq_len summed over the programs run (real + padding)
        self.programs_run = 0

    # --- setup --------------------------------------------------------------------------------

    def _forward(self, leaves: tuple[jax.Array, ...], ids: jax.Array, types: jax.Array, mask: jax.Array) -> jax.Array:
        return bert.forward(nnx.merge(self.graphdef, self.flat.unflatten(leaves)), self.cfg, ids, types, mask)

    def _forward_packed(self, leaves: tuple[jax.Array, ...], p: bert.Packed) -> jax.Array:
        return bert.forward_packed(nnx.merge(self.graphdef, self.flat.unflatten(leaves)), self.cfg, p)

    def model(self) -> bert.EncoderModel:
        """The encoder module over the served parameters (for inspection)."""
        return nnx.merge(self.graphdef, self.params)

    def _build_info(self, dtype: str) -> ModelInfo:
        if self.spec.tp > 1 or self.spec.replicas > 1:
            log.warning("%s: encoders run on one device (this process's first); --tp %d / --replicas %d "
                        "apply to decoders only", self.spec.name, self.spec.tp, self.spec.replicas)
        c, tok = self.cfg, self.tokenizer
        eos = tok.sep_token_id if tok.sep_token_id is not None else (tok.eos_token_id or c.eos_token_id)
        bos = tok.cls_token_id if tok.cls_token_id is not None else (tok.bos_token_id or c.bos_token_id)
        pad = tok.pad_token_id if tok.pad_token_id is not None else c.pad_token_id
        return ModelInfo(
            name=self.spec.name, path=self.spec.path, tokenizer_path=self.spec.path,
            task=c.task, architecture=c.architecture, model_type=c.model_type, dtype=dtype,
            vocab_size=c.vocab_size, max_model_len=self.max_len,
            num_params=self.num_params,
            eos_token_ids=[eos] if eos is not None else [], bos_token_id=bos, pad_token_id=pad,
            id2label=dict(c.id2label), hidden_size=c.hidden_size, embedding_dim=c.output_dim,
            matryoshka_dimensions=list(self.matryoshka_dims),
            tp=1, replicas=1, state="built",     # encoders run on one device (below)
            random_weights=self.spec.random_weights,
        )

    def warmup(self, progress: bool = True) -> None:
        """Compile every bucket program now so serving never compiles.

        XLA compiles release the GIL, so a few threads cut warmup roughly by the core count.
        """
        def compile_one(key: tuple[int, ...]) -> None:
            shape = jax.ShapeDtypeStruct(key, np.int32)
            if self.packed:
                self.programs.compile("forward_packed", key, (self.flat.leaves, bert.Packed(*[shape] * 6)))
            else:
                self.programs.compile("forward", key, (self.flat.leaves, shape, shape, shape))

        keys: list[tuple[int, ...]] = [(t,) for t in self.token_buckets] if self.packed else list(self.buckets.keys())
        workers = max(1, min(8, os.cpu_count() or 1, len(keys)))
        with ThreadPoolExecutor(workers, thread_name_prefix="compile") as pool, \
                tqdm(total=len(keys), desc=f"compile {self.spec.name}", unit="prog", disable=not progress) as bar:
            for fut in as_completed([pool.submit(compile_one, k) for k in keys]):
                fut.result()
                bar.update(1)
        self.programs.warm = True
        log.info("%s: %d encoder programs compiled (%s)", self.spec.name, len(keys),
                 f"inputs packed back to back, token buckets {self.token_buckets}" if self.packed
                 else f"padded (batch, seq_len) buckets, seq_len {self.buckets.seq_lens}")
        self.info.ready = True

    @property
    def compilations_after_warmup(self) -> int:
        return self.programs.compilations_after_warmup

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        with self._cv:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = self._stopped = False
            self._thread = threading.Thread(target=self._loop, name=f"embed-{self.spec.name}", daemon=True)
            self._thread.start()
            self.info.state = "running"

    def stop(self, timeout: Optional[float] = None) -> None:
        """Finish the step in progress, then fail what is still queued with Unavailable."""
        with self._cv:
            self._stopping = self._stopped = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._cv:
            left = [j for j in self._jobs.values() if not j.finished]
            for j in left:
                j.finished = True
            self._jobs.clear()
            self._queue.clear()
            self.info.state = "stopped"
        for j in left:
            _call(j.done, Unavailable(f"model {self.spec.name!r} stopped"))

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --- requests -----------------------------------------------------------------------------

    def submit(self, req: EmbedRequest, done: DoneCallback) -> None:
        """Validate, tokenize and queue; raises InvalidRequest / Overloaded / Unavailable.

        Texts and token_ids are accepted by both kinds of model (a classifier scores single
        texts too); pairs only by classifiers. `normalize` applies to embeddings, not scores.
        """
        ids, types = self._tokenize(req)
        normalize = self.cfg.normalize if req.normalize is None else bool(req.normalize)
        results = np.zeros((len(ids), self.cfg.output_dim), np.float32)
        with self._cv:
            if self._stopped:
                raise Unavailable(f"model {self.spec.name!r} is stopped")
            if req.request_id in self._jobs:
                raise AlreadyExists(f"request_id {req.request_id!r} is already in flight")
            if self._waiting_count() >= self.args.max_waiting_requests:
                raise Overloaded(
                    f"model {self.spec.name!r} has {self.args.max_waiting_requests} requests waiting "
                    f"(max_waiting_requests); retry later")
            job = _Job(req, done, ids, types, normalize, next(self._arrivals), results, remaining=len(ids))
            self._jobs[req.request_id] = job
            heapq.heappush(self._queue, job)
            self._cv.notify()

    submit_embed = submit  # the name Engine calls for every worker kind

    def abort(self, request_id: str) -> bool:
        """Drop a request's queued inputs and call its `done(None)`; False if it is not in flight."""
        with self._cv:
            job = self._jobs.pop(request_id, None)
            if job is None or job.finished:
                return False
            job.finished = True
            if job in self._queue:
                self._queue.remove(job)
                heapq.heapify(self._queue)
        _call(job.done, None)
        return True

    def stats(self) -> ModelStats:
        with self._cv:
            waiting = self._waiting_count()
            running = len(self._jobs) - waiting
            tps = self._total_tokens / self._busy_s if self._busy_s > 0 else 0.0
            return ModelStats(
                name=self.spec.name, running_requests=running, waiting_requests=waiting,
                prefill_tokens_per_s=tps, total_prompt_tokens=self._total_tokens,
                compilations_after_warmup=self.compilations_after_warmup,
                max_running_requests=self.buckets.max_batch(self.buckets.seq_lens[0]),
                matmul_routes=self._matmul_routes(),
            )

    def _matmul_routes(self) -> list[MatmulRoute]:
        plan = self.cfg.matmul_plan
        if plan is None:
            return [MatmulRoute("all", "all", "xla")]
        return [MatmulRoute(r["weight"], r["shape_class"], r["path"]) for r in plan.summary()]

    def _waiting_count(self) -> int:
        return sum(1 for j in self._queue if j.next_input == 0)

    # --- validation and tokenization ----------------------------------------------------------

    def _tokenize(self, req: EmbedRequest) -> tuple[list[np.ndarray], list[np.ndarray]]:
        given = [f for f in ("texts", "token_ids", "pairs") if getattr(req, f) is not None]
        if len(given) != 1:
            raise InvalidRequest(f"exactly one of texts, token_ids, pairs must be set (got {given or 'none'})")
        field_name = given[0]
        inputs = getattr(req, field_name)
        if not isinstance(inputs, (list, tuple)) or len(inputs) == 0:
            raise InvalidRequest(f"{field_name} must be a non-empty list")
        if len(inputs) > self.args.max_embed_inputs:
            raise InvalidRequest(
                f"{field_name} has {len(inputs)} inputs; the limit is {self.args.max_embed_inputs} "
                "(max_embed_inputs)")
        if req.token_type_ids is not None and field_name != "token_ids":
            raise InvalidRequest("token_type_ids may only accompany token_ids")
        if field_name == "pairs" and self.cfg.task != "classify":
            raise InvalidRequest(f"pairs need a cross-encoder; model {self.spec.name!r} is an embedding model")
        if req.dimensions is not None and req.dimensions != self.cfg.output_dim \
                and req.dimensions not in self.matryoshka_dims:
            dims = self.matryoshka_dims
            sizes = "none" if not dims else f"1..{dims[-1]}" if dims == list(range(1, dims[-1] + 1)) else str(dims)
            raise InvalidRequest(f"dimensions: model {self.spec.name!r} cannot produce {req.dimensions}-dimensional "
                                 f"vectors (sizes: {sizes} besides {self.cfg.output_dim})")
        if field_name == "token_ids":
            return self._check_token_ids(inputs, req.token_type_ids)
        return self._encode_texts(field_name, inputs, req.truncate)

    def _check_token_ids(self, seqs: list, type_seqs: Optional[list]) -> tuple[list, list]:
        if type_seqs is not None and len(type_seqs) != len(seqs):
            raise InvalidRequest(f"token_type_ids has {len(type_seqs)} rows, token_ids has {len(seqs)}")
        ids_out, types_out = [], []
        for i, seq in enumerate(seqs):
            ids = _int_array(seq, f"token_ids[{i}]")
            if ids.size == 0:
                raise InvalidRequest(f"token_ids[{i}] is empty")
            if ids.size > self.max_len:
                raise InvalidRequest(
                    f"token_ids[{i}] has {ids.size} tokens; the model's maximum is {self.max_len}")
            if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
                bad = int(ids[(ids < 0) | (ids >= self.cfg.vocab_size)][0])
                raise InvalidRequest(
                    f"token_ids[{i}] contains id {bad}, outside the vocabulary [0, {self.cfg.vocab_size})")
            ids = ids.astype(np.int32)
            types = np.zeros_like(ids)
            if type_seqs is not None:
                types = _int_array(type_seqs[i], f"token_type_ids[{i}]")
                if types.shape != ids.shape:
                    raise InvalidRequest(f"token_type_ids[{i}] has {types.size} entries, token_ids[{i}] has {ids.size}")
                if types.size and (types.min() < 0 or types.max() >= self.cfg.type_vocab_size):
                    raise InvalidRequest(
                        f"token_type_ids[{i}] must lie in [0, {self.cfg.type_vocab_size})")
            ids_out.append(ids)
            types_out.append(types.astype(np.int32))
        return ids_out, types_out

    def _encode_texts(self, field_name: str, inputs: list, truncate: bool) -> tuple[list, list]:
        if field_name == "pairs":
            for i, p in enumerate(inputs):
                if not (isinstance(p, (list, tuple)) and len(p) == 2
                        and all(isinstance(t, str) for t in p)):
                    raise InvalidRequest(f"pairs[{i}] must be a (query, document) pair of strings")
                if not p[0] or not p[1]:
                    raise InvalidRequest(f"pairs[{i}] has an empty {'query' if not p[0] else 'document'}")
            args = ([p[0] for p in inputs], [p[1] for p in inputs])
        else:
            for i, t in enumerate(inputs):
                if not isinstance(t, str):
                    raise InvalidRequest(f"texts[{i}] must be a string")
                if not t:
                    raise InvalidRequest(f"texts[{i}] is empty")
            args = (list(inputs),)
        if self._backends is not None:
            rows, type_rows = self._encode_backend(args, truncate)
        else:
            trunc: Union[bool, str] = "longest_first" if truncate else False
            with self._tok_lock:
                enc = self.tokenizer(*args, truncation=trunc, max_length=self.max_len if truncate else None,
                                     return_attention_mask=False, verbose=False)
            rows, type_rows = enc["input_ids"], enc.get("token_type_ids")
        ids_out, types_out = [], []
        for i, row in enumerate(rows):
            ids = np.asarray(row, np.int32)
            if ids.size > self.max_len:
                raise InvalidRequest(
                    f"{field_name}[{i}] has {ids.size} tokens; the model's maximum is {self.max_len} "
                    "(set truncate to cut it)")
            if ids.size and int(ids.max()) >= self.cfg.vocab_size:
                raise Internal(f"tokenizer of {self.spec.name!r} produced ids beyond the model's vocabulary")
            types = np.asarray(type_rows[i], np.int32) if type_rows is not None else np.zeros_like(ids)
            if self.cfg.type_vocab_size == 1:
                types = np.zeros_like(ids)  # RoBERTa-style tokenizers may still emit segment ids
            ids_out.append(ids)
            types_out.append(types)
        return ids_out, types_out

    def _encode_backend(self, args: tuple, truncate: bool) -> tuple[list, list]:
        """Token ids and type ids through the fast tokenizer's Rust backend (the private copy with
        truncation at max_len, longest first, or the one without): the same ids as the
        transformers call (whose own work is this encode_batch), without its per-call Python.
        Why: at batch 1, right after a program (caches cold), the transformers call took 0.45 ms a
        sentence and this 0.27 ms (all-MiniLM-L6-v2, 2-vCPU Zen 5, medians of 200)."""
        batch = list(zip(*args)) if len(args) == 2 else args[0]
        encs = self._backends[truncate].encode_batch(batch)
        return [e.ids for e in encs], [e.type_ids for e in encs]

    # --- worker thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._queue:
                    self._cv.wait()
                if self._stopping:
                    return
                taken = self._take_inputs()
            self._run(taken)

    def _take_inputs(self) -> list[tuple[_Job, int]]:
        """Inputs from the head of the queue up to the token budget (at least one). Holds the lock."""
        taken: list[tuple[_Job, int]] = []
        tokens = 0
        while self._queue:
            job = self._queue[0]
            while job.next_input < len(job.ids):
                n = job.ids[job.next_input].size
                if taken and tokens + n > self.buckets.max_batch_tokens:
                    return taken
                taken.append((job, job.next_input))
                tokens += n
                job.next_input += 1
            heapq.heappop(self._queue)
        return taken

    def _plan(self, taken: list[tuple[_Job, int]]) -> list[_Group]:
        """Packed programs (`pack_groups`), or length-sorted groups, one bucket program each, of
        least modelled cost (`plan_groups`)."""
        if self.packed:
            return [_Group([taken[k] for k in idx], 1, t, packed=True)
                    for t, idx in pack_groups([job.ids[i].size for job, i in taken], self.token_buckets)]
        plan = plan_groups([job.ids[i].size for job, i in taken], self.buckets)
        return [_Group([taken[k] for k in idx], b, s) for b, s, idx in plan]

    def _run(self, taken: list[tuple[_Job, int]]) -> None:
        t0 = time.perf_counter()
        try:
            groups = self._plan(taken)
            # Dispatch every group before reading any result: host padding overlaps device work.
            pending = [(g, self._launch(g)) for g in groups]
            outputs = [(g, np.asarray(out)) for g, out in pending]
        except Exception as e:  # a device failure fails these requests, not the worker
            log.exception("encoder step failed for %s", self.spec.name)
            self._fail({job for job, _ in taken}, Internal(f"encoder step failed: {e}"))
            return
        finished: list[_Job] = []
        with self._cv:
            self._busy_s += time.perf_counter() - t0
            self.padded_tokens += sum(g.batch * g.seq_len for g in groups)
            self.programs_run += len(groups)
            for g, out in outputs:
                for row, (job, i) in enumerate(g.items):
                    if job.finished:
                        continue
                    job.results[i] = out[row]
                    self._total_tokens += job.ids[i].size
                    job.remaining -= 1
                    if job.remaining == 0:
                        job.finished = True
                        self._jobs.pop(job.req.request_id, None)
                        finished.append(job)
        for job in finished:
            _call(job.done, self._output(job))

    def _launch(self, g: _Group) -> jax.Array:
        if g.packed:
            return self._launch_packed(g)
        b = g.batch
        ids = np.full((b, g.seq_len), self.cfg.pad_token_id, np.int32)
        types = np.zeros((b, g.seq_len), np.int32)
        mask = np.zeros((b, g.seq_len), np.int32)
        for row, (job, i) in enumerate(g.items):
            n = job.ids[i].size
            ids[row, :n] = job.ids[i]
            types[row, :n] = job.types[i]
            mask[row, :n] = 1
        exe = self.programs.get("forward", (b, g.seq_len), (self.flat.leaves, ids, types, mask))
        return exe(self.flat.leaves, ids, types, mask)

    def _launch_packed(self, g: _Group) -> jax.Array:
        T = g.seq_len
        ids = np.full(T, self.cfg.pad_token_id, np.int32)
        types = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        segments = np.full(T, T, np.int32)
        starts = np.zeros(T, np.int32)
        lens = np.zeros(T, np.int32)
        off = 0
        for k, (job, i) in enumerate(g.items):
            x = job.ids[i]
            n = x.size
            ids[off:off + n] = x
            types[off:off + n] = job.types[i]
            positions[off:off + n] = bert.packed_positions(self.cfg, x)
            segments[off:off + n] = k
            starts[k], lens[k] = off, n
            off += n
        p = bert.Packed(ids, types, positions, segments, starts, lens)
        exe = self.programs.get("forward_packed", (T,), (self.flat.leaves, p))
        return exe(self.flat.leaves, p)

    def _output(self, job: _Job) -> EmbedOutput:
        counts = [int(x.size) for x in job.ids]
        out = EmbedOutput(request_id=job.req.request_id, prompt_tokens=sum(counts), token_counts=counts)
        if self.cfg.task == "classify":
            out.scores = job.results
        else:
            vecs = job.results
            dims = job.req.dimensions
            if dims is not None and dims < vecs.shape[1]:
                vecs = np.ascontiguousarray(vecs[:, :dims])  # Matryoshka: truncate, then renormalise
            out.embeddings = bert.l2_normalize(vecs) if job.normalize else vecs
        return out

    def _fail(self, jobs: set, err: EngineError) -> None:
        with self._cv:
            failed = [j for j in jobs if not j.finished]
            for j in failed:
                j.finished = True
                self._jobs.pop(j.req.request_id, None)
                if j in self._queue:
                    self._queue.remove(j)
            heapq.heapify(self._queue)
        for j in failed:
            _call(j.done, err)


# ---------------------------------------------------------------------------------------------
# helpers


def _call(done: DoneCallback, value: Optional[Union[EmbedOutput, EngineError]]) -> None:
    """A failing callback must not take the worker thread down with it."""
    try:
        done(value)
    except Exception:
        log.exception("embed done-callback raised")


def _backend_tokenizers(tok: object, max_len: int) -> Optional[dict[bool, Tokenizer]]:
    """Private copies of a fast tokenizer's backend (padding off) by truncation: True truncates at
    max_len, longest first; False does not. None for a tokenizer without a backend (a slow,
    Python tokenizer keeps the transformers call)."""
    backend = getattr(tok, "_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        return None
    out: dict[bool, Tokenizer] = {}
    for truncate in (True, False):
        copy = Tokenizer.from_str(backend.to_str())
        copy.no_padding()
        if truncate:
            copy.enable_truncation(max_len, strategy="longest_first")
        else:
            copy.no_truncation()
        out[truncate] = copy
    return out


def _int_array(seq: object, name: str) -> np.ndarray:
    """int64 view of a list of token ids (wide, so range checks see the caller's real values)."""
    try:
        arr = np.asarray(seq)
    except Exception as e:
        raise InvalidRequest(f"{name} must be a list of integers") from e
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidRequest(f"{name} must be a list of integers")
    return arr.astype(np.int64)


def _matryoshka_dimensions(path: str, cfg: bert.EncoderConfig) -> list[int]:
    """Sizes a Matryoshka encoder's vectors may be cut to, read from config.json as vLLM reads it:
    `matryoshka_dimensions` (the sizes it was trained at), else every size 1..hidden when it says
    only `is_matryoshka: true`; [] for any other model. sentence-transformers keeps no such key of
    its own (its `truncate_dim` is a load-time argument), so config.json is the one source."""
    raw = read_config(path)
    full = cfg.output_dim
    declared = raw.get("matryoshka_dimensions")
    if declared:
        if not isinstance(declared, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in declared):
            log.warning("%s: config.json matryoshka_dimensions %r is not a list of integers; ignored", path, declared)
            return []
        dims = sorted({d for d in declared if 1 <= d <= full})
        if len(dims) != len(set(declared)):
            log.warning("%s: matryoshka_dimensions outside 1..%d ignored: %s", path, full,
                        sorted(set(declared) - set(dims)))
        return dims
    if raw.get("is_matryoshka") is True:
        return list(range(1, full + 1))
    return []


def _program_token_cap() -> Optional[int]:
    """Largest batch * seq_len of one program: CPU_PROGRAM_TOKENS on CPU; on accelerators the
    whole token budget (None), where bigger programs only fill the device better."""
    return None if backend.is_accelerator() else CPU_PROGRAM_TOKENS
