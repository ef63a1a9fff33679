"""Suffix decoding: speculate from what this request and earlier requests of the model wrote.

The method is SuffixDecoding (Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding for
Emerging AI Applications", arXiv:2411.04975; Snowflake's Arctic Inference ships it). Agent
loops, code edits and RL rollouts repeat themselves: a request re-sends a prompt seen before
and the model answers it the way it did last time, or an answer quotes its own prompt. Two
indexes find those continuations without a draft model:

  * a per-request index over this request's prompt and output so far;
  * a global cache over recent finished outputs of the same model (each with the tail of its
    prompt, so a repeated prompt predicts the answer's first tokens too), least recently used
    request first out when its token budget is exceeded.

Each step, the sequence's last tokens (the pattern) are matched in both; among the occurrences
of the pattern the proposal follows, token by token, the most frequent next token (the paper's
greedy expansion by frequency, as a single path since our verifier checks one chain per row).
Token j's estimated probability is its count over the occurrences still alive, and the path's
probability the product of those; the path stops when that product falls below
`min_token_prob`, so a pattern whose continuations disagree proposes little or nothing. Its
length is also capped at `spec_factor` x the match length (a long match earns a long guess), and
at k. The score of a path is the sum of its prefix probabilities (the expected number of accepted
tokens under the counts); the per-request and global candidates, and every match length, compete
on that score.

Data structure (why not a literal suffix tree): the paper's trees are depth-bounded suffix tries
whose node counts are the number of occurrences of the path's string. A node is therefore just
the set of positions where its string occurs, and its children's counts are the histogram of the
tokens that follow those positions. `SuffixIndex` stores exactly that, implicitly: for a few
anchor lengths (2, 4, 8, 16 by default) a dict from the hash of each n-gram to its most recent
occurrences, and the token lists themselves. Matching the pattern is one dict look-up per anchor,
the match then extended backwards past the anchor, up to MAX_MATCH (64) tokens, keeping the
occurrences that match longest (the deepest node, the paper's longest matching suffix);
following a child is filtering the occurrence list by the next token. Why past what the length
cap needs (k / spec_factor tokens): degenerate or formulaic text repeats 8-16-token contexts
across many outputs, and frequency over all of them picked the wrong continuation for a
repeated prompt whose own earlier answer was in the cache (spec_decode, 8 repeated streams of
the trained model: 86 % of guesses accepted with the match cut at k, 98-99 % with 64).
That holds for greedy sequences; a sampled one keeps the match at the length cap's depth and
the frequency over all its occurrences, since rejection sampling accepts the most frequent
continuation more often than one earlier sample of it (spec_decode, sampled workload, guesses
accepted: 0.41-0.47 at that depth, 0.28-0.41 with the deep match).
An exact repeat of a cached output (prompt tail and answer) is kept once with a count that
weighs it in that frequency (SuffixCache.add). This costs O(anchors) entries per
token instead of the trie's O(depth) nodes, which in Python is the difference between tens and
hundreds of megabytes for the global cache, and keeps updates to O(anchors) dict operations per
token. Occurrence lists keep the `max_occurrences` most recent positions (frequent n-grams such
as indentation would otherwise make each look-up scan thousands); a long exact repeat is still
found through the longer anchors, whose lists are short.

Cost (2-core reference machine, others busy on it; a 2000-token Python source as bytes, k = 8,
one token appended per call): propose ~15-25 us median (p90 ~40-60 us) with the per-request index
alone, ~45 us (p90 ~80 us) with a full 65536-token global cache; start() indexes a 2000-token
prompt in ~5 ms (at its first proposal); caching a 144-token output (16 prompt tokens + 128;
2-vCPU Intel Xeon) takes ~0.23 ms, ~0.46 ms when it
evicts an older one from a full cache (1.13 ms before evictions cut runs out by bisection). The
global cache holds ~420 bytes per cached token (~26 MB at the default budget).

Keys are Python's hash of the n-gram tuple (deterministic for ints); a 64-bit collision could
only make a wrong proposal, which verification rejects. Not thread-safe: one scheduler thread
owns a cache and its proposers.
"""
from __future__ import annotations

import math
from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Optional

_SHIFT = 32                 # an occurrence is packed as doc_id << 32 | end (ends < 2**32)
_MASK = (1 << _SHIFT) - 1
DEFAULT_ANCHORS = (2, 4, 8, 16)
MAX_MATCH = 64              # how far back a match is followed to pick among occurrences (see best_path)


def max_spec_len(match_len: int, k: int, spec_factor: float) -> int:
    """How many tokens a match of `match_len` may propose (the paper's MAX_SPEC = alpha x p), at most k."""
    return max(0, min(k, math.floor(spec_factor * match_len)))


class SuffixIndex:
    """Token sequences ("docs") and, per anchor length, the recent occurrences of every n-gram.

    An occurrence of n-gram g in doc d is recorded by its end e (exclusive): d[e - n:e] == g, and
    only when d[e] exists, so every recorded occurrence has a next token to propose."""

    def __init__(self, anchors: Sequence[int] = DEFAULT_ANCHORS, max_occurrences: int = 32):
        if not anchors or min(anchors) < 1:
            raise ValueError(f"anchors must be positive lengths, got {anchors!r}")
        self.anchors = tuple(sorted(set(anchors)))
        self.max_occurrences = max_occurrences
        # n-gram hash -> occurrences, oldest first, as int64 arrays: 8 bytes an entry instead of a
        # list slot plus an int object, and not containers the garbage collector walks (with lists,
        # collections over a full global cache made single proposals take 3-6 ms)
        self._tables: list[dict[int, array]] = [{} for _ in self.anchors]
        self.docs: dict[int, list[int]] = {}
        self._ends: dict[int, int] = {}      # doc id -> ends indexed so far (a growing doc)
        self._keys: dict[int, list[array]] = {}  # doc id -> per anchor, its n-gram hashes (for remove)
        # every occurrence list is in ascending order (doc id, then end) while docs are only ever
        # extended in ascending id order: the global cache adds each output whole under a new id,
        # a per-request index has one doc; remove then cuts a doc's run out by bisection
        self._sorted = True
        self._top = -1                       # the largest doc id extended so far
        self.weight: dict[int, int] = {}     # doc id -> how many times it was seen (absent: once)

    def __len__(self) -> int:
        return len(self.docs)

    def extend(self, doc_id: int, tokens: Sequence[int]) -> None:
        """Append `tokens` to doc `doc_id` (created when new) and index what became indexable."""
        doc = self.docs.setdefault(doc_id, [])
        doc.extend(tokens)
        if doc_id < self._top:
            self._sorted = False
        self._top = max(self._top, doc_id)
        start = self._ends.get(doc_id, 1)
        hi = len(doc)                               # ends with a next token: e <= len - 1
        cap = self.max_occurrences
        doc_keys = self._keys.setdefault(doc_id, [array("q") for _ in self.anchors])
        base = doc_id << _SHIFT
        for a, table, keys in zip(self.anchors, self._tables, doc_keys):
            lo = max(start, a)
            if lo >= hi:
                continue
            # the n-grams ending at lo..hi-1, built by zip in C (a tuple slice per end and anchor
            # made indexing a 150-token output 1.45x slower: 0.57 vs 0.39 ms)
            grams = zip(*[doc[lo - a + i:hi - a + i] for i in range(a)])
            for e, key in enumerate(map(hash, grams), lo):
                keys.append(key)
                occ = table.get(key)
                if occ is None:
                    table[key] = array("q", (base | e,))
                else:
                    occ.append(base | e)
                    if len(occ) > 2 * cap:          # trim in batches: amortized O(1)
                        del occ[:-cap]
        self._ends[doc_id] = max(start, hi)

    def remove(self, doc_id: int) -> int:
        """Forget a doc and its occurrences; returns its length."""
        doc = self.docs.pop(doc_id, None)
        if doc is None:
            return 0
        self._ends.pop(doc_id, None)
        self.weight.pop(doc_id, None)
        lo, hi = doc_id << _SHIFT, (doc_id + 1) << _SHIFT
        for table, keys in zip(self._tables, self._keys.pop(doc_id)):
            for key in set(keys):                   # a frequent n-gram is filtered once
                occ = table.get(key)
                if occ is None:
                    continue
                if len(occ) == 1:                   # most long n-grams occur once
                    if occ[0] >> _SHIFT == doc_id:
                        del table[key]
                    continue
                if self._sorted:
                    # the doc's occurrences are one run: cut it out. Filtering every entry in
                    # Python made evicting a 144-token output from a full cache 1.1 ms of a
                    # 1.3 ms add; at 8 sampled streams of the trained model each finished
                    # request then held the scheduler for ~2.7 ms, ~7 % of the run
                    i = bisect_left(occ, lo)
                    j = bisect_left(occ, hi, i)
                    if j - i == len(occ):
                        del table[key]
                    elif j > i:
                        del occ[i:j]
                    continue
                kept = array("q", (p for p in occ if p >> _SHIFT != doc_id))
                if kept:
                    table[key] = kept
                else:
                    del table[key]
        return len(doc)

    def occurrences(self, pattern: Sequence[int]) -> Iterator[tuple[int, Sequence[int]]]:
        """(anchor, occurrences most recent first) for each anchor whose last-`anchor` tokens of
        `pattern` occur, longest anchor first (lazily: a caller that stops early hashes less)."""
        n = len(pattern)
        for a, table in zip(reversed(self.anchors), reversed(self._tables)):
            if a > n:
                continue
            occ = table.get(hash(tuple(pattern[n - a:])))
            if occ:
                yield a, occ[:-self.max_occurrences - 1:-1]

    def best_path(self, pattern: Sequence[int], k: int, spec_factor: float, min_token_prob: float,
                  self_doc: Optional[int] = None, max_match: int = MAX_MATCH, floor: float = 0.0
                  ) -> tuple[list[int], float, set[int], Optional[tuple[int, int]]]:
        """The highest-scoring proposal after `pattern`: (tokens, score, ids of the docs it came from,
        the (doc, end) of an occurrence it copies or None; see _walk).

        Per anchor, the node walked from is the deepest one among that anchor's occurrences: the
        match is extended backwards past the anchor as far as it can still raise the length cap
        (k / spec_factor tokens), or up to `max_match` tokens to choose among several
        occurrences (0: frequency at the cap's depth, as for sampled sequences; see the module
        doc), and the occurrences with the longest match are kept. `pattern` should hold at
        least max(anchors, k / spec_factor, max_match) tokens. `self_doc` names the doc that
        *is* the sequence being extended (the per-request index): its occurrences may run into the
        sequence's end, where the proposal itself continues it.

        `floor`: the caller only wants a path scoring at least this much (the other index's score:
        SuffixProposer.propose), so nodes and walks that cannot reach it are cut short; the best
        path is the same whenever it scores >= floor, and below floor some path under floor
        (perhaps not the best) comes back."""
        best: tuple[list[int], float, set[int], Optional[tuple[int, int]]] = ([], 0.0, set(), None)
        if k <= 0 or spec_factor <= 0:
            return best
        need = min(len(pattern), math.ceil(k / spec_factor))   # a longer match would not allow more tokens
        most = max_spec_len(max(need, self.anchors[-1]), k, spec_factor)
        deep = min(len(pattern), max(need, max_match))
        floor -= 1e-9           # a path's score is a sum of floats: keep a path that ties the floor
        # the shortest match whose length cap reaches the floor (max_spec_len: floor(spec_factor x match))
        min_depth = 0 if floor <= 0 else math.ceil(math.ceil(floor) / spec_factor - 1e-9)
        if floor > most:
            return best         # no path is that long
        for anchor, occ in self.occurrences(pattern):
            if best[1] >= most:
                break           # no node can beat it: a path's score is at most its length
            depth, node = anchor, occ
            if anchor < deep and (anchor < need or len(occ) > 1):
                depth, node = self._deepest(pattern, anchor, occ, deep, min_depth)
            limit = max_spec_len(depth, k, spec_factor)
            if not node or limit <= best[1] or limit < floor:
                continue        # a path's score is at most its length
            found = self._walk(node, limit, min_token_prob, self_doc, floor)
            if found[1] > best[1]:
                best = found
        return best

    def _deepest(self, pattern: Sequence[int], anchor: int, occ: Sequence[int], need: int,
                 min_depth: int = 0) -> tuple[int, list[int]]:
        """(match length, occurrences matching that long) for the longest match among `occ`, the
        match counted up to `need` tokens; occurrences matching fewer than `min_depth` tokens are
        passed over (one slice comparison each), and none left gives (anchor, [])."""
        n, depth, node = len(pattern), anchor, []
        for p in occ:
            doc, e = self.docs[p >> _SHIFT], p & _MASK
            m, top = anchor, min(need, e)
            if min_depth > m:
                if top < min_depth or doc[e - min_depth:e - m] != pattern[n - min_depth:n - m]:
                    continue
                m = min_depth
            while m + 8 <= top and doc[e - m - 8:e - m] == pattern[n - m - 8:n - m]:
                m += 8          # eight tokens a slice comparison (in C) while they all match
            while m < top and doc[e - m - 1] == pattern[n - m - 1]:
                m += 1
            if m > depth:
                depth, node = m, [p]
            elif m == depth:
                node.append(p)
        return depth, node

    def _walk(self, node: Sequence[int], limit: int, min_token_prob: float, self_doc: Optional[int],
              floor: float = 0.0) -> tuple[list[int], float, set[int], Optional[tuple[int, int]]]:
        """Follow the most frequent next token from the occurrences in `node` (see the module doc).
        Also returns the path's origin: (doc, end) of an occurrence it copies (path ==
        doc[end:end + len(path)]), None when there is none or the path runs past a doc. Stops
        early, with a path scoring under `floor`, once the score cannot reach `floor` (every later
        token adding at most the path probability so far)."""
        if len(node) == 1:          # one occurrence: every step has probability 1, copy it
            d, e = node[0] >> _SHIFT, node[0] & _MASK
            doc = self.docs[d]
            path = doc[e:e + limit]
            origin: Optional[tuple[int, int]] = (d, e) if path else None
            if d == self_doc:
                if len(path) < limit:
                    origin = None
                while len(path) < limit:            # the sequence continues with this proposal
                    path.append(path[e + len(path) - len(doc)])
            return path, float(len(path)), {d} if path else set(), origin
        wt = self.weight
        live = [(self.docs[p >> _SHIFT], p & _MASK, p >> _SHIFT) for p in node]
        total = sum(wt.get(d, 1) for _, _, d in live) if wt else len(live)
        path = []
        prob, score = 1.0, 0.0
        for j in range(limit):
            nxt = []
            for doc, e, d in live:
                i = e + j
                if i < len(doc):
                    nxt.append(doc[i])
                elif d == self_doc:
                    nxt.append(path[i - len(doc)])  # the sequence continues with this proposal
                else:
                    nxt.append(None)                # that earlier output ended here
            tok = nxt[0]
            if tok is not None and nxt.count(tok) == len(nxt):
                path.append(tok)                    # all agree: probability 1, nothing to filter
                score += prob
                continue
            counts: dict[int, int] = {}
            for (_, _, d), t in zip(live, nxt):
                if t is not None:
                    counts[t] = counts.get(t, 0) + (wt.get(d, 1) if wt else 1)
            if not counts:
                break
            tok = max(counts, key=counts.__getitem__)   # ties: the most recent occurrence's token
            prob *= counts[tok] / total
            if prob < min_token_prob or score + prob * (limit - len(path)) < floor:
                break
            path.append(tok)
            score += prob
            live = [x for x, t in zip(live, nxt) if t == tok]
            total = counts[tok]
        if not path:
            return path, score, set(), None
        doc, e, d = live[0]
        return path, score, {d for _, _, d in live}, (d, e) if e + len(path) <= len(doc) else None


class SuffixCache:
    """The global cache of one model's recent outputs and the factory of per-request proposers.

    Finished requests' (prompt tail + output) are kept, least recently used first out, while
    their total stays within `max_cached_tokens`; a request counts as used when a proposal came
    from it."""

    def __init__(self, max_cached_tokens: int = 1 << 16, anchors: Sequence[int] = DEFAULT_ANCHORS,
                 max_occurrences: int = 32, spec_factor: float = 1.0, min_token_prob: float = 0.1,
                 prompt_context: Optional[int] = None, max_match: int = MAX_MATCH):
        if max_cached_tokens < 0:
            raise ValueError("max_cached_tokens must be >= 0")
        self.max_cached_tokens = max_cached_tokens
        self.anchors = tuple(sorted(set(anchors)))
        self.max_occurrences = max_occurrences
        self.max_match = max_match
        self.spec_factor = spec_factor
        self.min_token_prob = min_token_prob
        # how much of a cached request's prompt is kept in front of its output: enough for the
        # longest anchor to match a repeated prompt's end and propose the answer's first tokens
        self.prompt_context = max(self.anchors) if prompt_context is None else prompt_context
        self.index = SuffixIndex(self.anchors, max_occurrences)
        self._lru: OrderedDict[int, int] = OrderedDict()   # doc id -> length, least recent first
        self._same: dict[int, int] = {}      # hash of a cached doc's tokens -> its doc id (see add)
        self._key_of: dict[int, int] = {}    # doc id -> that hash
        self._next_id = 1
        self.cached_tokens = 0

    def __len__(self) -> int:
        return len(self._lru)

    def start(self, prompt: Sequence[int], greedy: bool = True) -> SuffixProposer:
        """A sequence's proposer. Greedy sequences follow the deepest match (up to max_match
        tokens back); sampled ones the most frequent continuation among the occurrences that
        match as far as the proposal's length cap needs (see best_path: why)."""
        return SuffixProposer(self, prompt, max_match=self.max_match if greedy else 0)

    def add(self, prompt: Sequence[int], output: Sequence[int]) -> Optional[int]:
        """Cache a finished request's output (after the tail of its prompt); returns its doc id,
        None when there is nothing to keep."""
        if not output or self.max_cached_tokens == 0:
            return None
        ctx = list(prompt[max(0, len(prompt) - self.prompt_context):]) if self.prompt_context else []
        doc = (ctx + list(output))[-self.max_cached_tokens:]
        key = hash(tuple(doc))
        same = self._same.get(key)
        if same is not None and self.index.docs.get(same) == doc:
            # an exact repeat (an agent loop asking again): one more count on the cached doc
            # instead of a copy. Indexing a 144-token output took ~1 ms (2-vCPU Xeon, the trained
            # model's answers, a full cache evicting), 8 % of the scheduler thread at 8 repeated
            # streams, and copies filled the token budget with duplicates; the walk weighs each
            # doc by its count, so the proposals are those of the copies.
            self.index.weight[same] = self.index.weight.get(same, 1) + 1
            self._lru.move_to_end(same)
            return same
        doc_id, self._next_id = self._next_id, self._next_id + 1
        self.index.extend(doc_id, doc)
        self._lru[doc_id] = len(doc)
        self._same[key], self._key_of[doc_id] = doc_id, key
        self.cached_tokens += len(doc)
        while self.cached_tokens > self.max_cached_tokens:
            old, n = self._lru.popitem(last=False)
            self.index.remove(old)
            k = self._key_of.pop(old)
            if self._same.get(k) == old:
                del self._same[k]
            self.cached_tokens -= n
        return doc_id

    def best_path(self, pattern: Sequence[int], k: int, max_match: int = MAX_MATCH, floor: float = 0.0
                  ) -> tuple[list[int], float, Optional[tuple[int, int]]]:
        """(tokens, score, (doc, end) of an occurrence the tokens copy or None): see SuffixIndex.best_path.
        The docs of a path scoring above `floor` count as used."""
        path, score, docs, origin = self.index.best_path(pattern, k, self.spec_factor, self.min_token_prob,
                                                         max_match=max_match, floor=floor)
        if score > floor:
            for d in docs:
                self._lru.move_to_end(d)
        return path, score, origin

    def follow(self, doc_id: int, end: int, context: Sequence[int], depth: int, k: int) -> Optional[list[int]]:
        """doc[end:end + k] (fewer where the doc ends, at least one) when cached doc `doc_id` still
        matches the end of `context` (a list) as deep as it can: its min(depth, end) tokens before
        `end` equal the last ones of `context`; else None. Counts as a use."""
        doc = self.index.docs.get(doc_id)
        if doc is None or not 0 < end < len(doc):
            return None
        m = min(depth, end)
        if len(context) < m or doc[end - m:end] != context[len(context) - m:]:
            return None
        self._lru.move_to_end(doc_id)
        return doc[end:end + k]


class SuffixProposer:
    """One request's proposer: its own index over prompt + output, and the model's global cache."""

    def __init__(self, cache: SuffixCache, prompt: Sequence[int], max_match: Optional[int] = None):
        self.cache = cache
        self.prompt_len = len(prompt)
        self.max_match = cache.max_match if max_match is None else max_match
        self._pattern_len = max(max(cache.anchors), self.max_match)
        # the per-request index is built at the first proposal: a sequence the planner never asks
        # (its guesses could not pay, or planning paused) costs nothing but its caching at the end
        self._index: Optional[SuffixIndex] = None
        self._tokens: list[int] = []
        # greedy sequences: (cached doc, its position minus the sequence's) of the occurrence the
        # last cache proposal copied, to follow while the sequence keeps matching it (see propose)
        self._follow: Optional[tuple[int, int]] = None
        self._own_first = False     # the last proposal came from the own index: ask it first (see propose)

    def _rebuild(self, tokens: Sequence[int]) -> None:
        self._index = SuffixIndex(self.cache.anchors, self.cache.max_occurrences)
        self._index.extend(0, tokens)
        self._tokens = self._index.docs[0]

    def _sync(self, tokens: Sequence[int]) -> None:
        """Index the tokens that arrived since the last call (the whole sequence when `tokens` is
        not a continuation of what this proposer has seen)."""
        mine = self._tokens
        if self._index is None or len(tokens) < len(mine) or (mine and tokens[len(mine) - 1] != mine[-1]):
            self._rebuild(tokens)
        elif len(tokens) > len(mine):
            self._index.extend(0, tokens[len(mine):])

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens to follow `tokens` (prompt + output so far), the better scoring of this
        request's own index and the global cache; on a tie, the one the last proposal came from
        (the cache at first: its match is as deep and it is a finished answer).

        That one is also asked first, and when its path is k tokens long (a path scores at most
        its length) the other is not asked. The cache first (a request repeating an earlier
        answer): the own index is then not brought up to date either (it catches up on the next
        call that asks it), which at 8 repeated streams saved ~20 us a row and step. The own index
        first (an answer repeating its prompt or itself): its score is the floor the cache's path
        must beat, and nodes and walks of the cache that cannot are cut short (best_path's
        `floor`). Why: spec_decode's copy workload (8 streams of the trained model, whose answers
        repeat their own recent text; 2-vCPU Zen 3) spent 0.3-0.7 ms a call in propose, 80 % of
        it searching the cache (dozens of occurrences of indentation and other short matches over
        earlier outputs of the same source text) while the own index won: 148-233 ms a round,
        14-18 % of its time; 59-94 ms with this order (old and new code alternating)."""
        if k <= 0:
            return []
        c = self.cache
        if self._follow is not None:
            d, off = self._follow
            got = c.follow(d, len(tokens) + off, tokens, self.max_match, k)
            if got is not None:
                return got
            self._follow = None
        pattern = tokens[-max(self._pattern_len, math.ceil(k / c.spec_factor) if c.spec_factor > 0 else 0):]
        if self._own_first:
            own, own_score = self._own_path(tokens, pattern, k, 0.0)
            if own_score >= k or not len(c):
                return own
            glob, glob_score, origin = c.best_path(pattern, k, self.max_match, own_score)
            if own_score >= glob_score:
                return own
            self._own_first = False
            self._remember(origin, len(tokens))
            return glob
        glob, glob_score, origin = c.best_path(pattern, k, self.max_match) if len(c) else ([], 0.0, None)
        if glob_score >= k:
            self._remember(origin, len(tokens))
            return glob         # a path scores at most its length
        own, own_score = self._own_path(tokens, pattern, k, glob_score)
        if glob_score >= own_score:
            self._remember(origin, len(tokens))
            return glob
        self._own_first = True
        return own

    def _own_path(self, tokens: Sequence[int], pattern: Sequence[int], k: int, floor: float) -> tuple[list[int], float]:
        """(tokens, score) of the own index's best path (paths under `floor` may be cut short)."""
        self._sync(tokens)
        assert self._index is not None
        c = self.cache
        own, score, _, _ = self._index.best_path(pattern, k, c.spec_factor, c.min_token_prob, self_doc=0,
                                                 max_match=self.max_match, floor=floor)
        return own, score

    def _remember(self, origin: Optional[tuple[int, int]], n: int) -> None:
        """Follow the cached occurrence a greedy sequence's proposal copied: while the sequence's
        last max_match tokens (or all the doc has before that point) equal those before the
        matching position of that doc, the doc matches as deep as best_path counts or as it can,
        and the next proposal is read off it without a search. On 8 repeated greedy streams of the trained
        model with K = 16 a search took 0.08 -> 0.18 ms as the cache filled with ~300 answers
        (18 % of the pass at a full cache); following is a slice comparison."""
        if self.max_match > 0 and origin is not None:
            self._follow = (origin[0], origin[1] - n)

    def finish(self, tokens: Optional[Sequence[int]] = None) -> None:
        """The request ended: cache its output (tokens = the final prompt + output; None, e.g. for an
        aborted request, caches nothing) and drop the per-request index."""
        if tokens is not None:
            self.cache.add(tokens[:self.prompt_len], tokens[self.prompt_len:])
        self._index, self._tokens = None, []
