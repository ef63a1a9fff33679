"""The draft-free proposers of jax_engine/spec (issue 20): n-gram prompt lookup and suffix decoding.

What they must do, checked on token lists: a repeated span is proposed, the longest match wins,
k bounds the proposal, text without repeats gets nothing, the global suffix cache proposes an
earlier request's answer to a repeated prompt, its token budget holds under eviction (LRU by
request), proposals follow frequency and stop under the probability threshold, and the same
inputs always give the same proposals (incremental updates included).
"""
from __future__ import annotations

import random

import pytest

from jax_engine.spec import make_speculator
from jax_engine.spec.ngram import NgramProposer, NgramSpeculator
from jax_engine.spec.suffix import SuffixCache, SuffixIndex


def reference_ngram(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Prompt lookup by brute force: longest n first, its most recent earlier occurrence with a
    next token, continued as if the text repeats (ext[L + j] = ext[e + j])."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        for e in range(L - 1, n - 1, -1):
            if tokens[e - n:e] == tokens[L - n:]:
                ext = list(tokens)
                for j in range(k):
                    ext.append(ext[e + j])
                return ext[L:]
    return []


# ---------------------------------------------------------------------------------------------
# n-gram prompt lookup
# ---------------------------------------------------------------------------------------------
def test_ngram_proposes_the_repeated_span():
    seq = list(range(1, 11)) + [50, 51] + [1, 2, 3]
    assert NgramProposer().propose(seq, 4) == [4, 5, 6, 7]


def test_ngram_longest_match_wins_over_a_more_recent_shorter_one():
    # (1, 2, 3) was followed by 40; the more recent (2, 3) by 41
    seq = [5, 1, 2, 3, 40, 8, 2, 3, 41, 9, 1, 2, 3]
    assert NgramProposer(max_n=3, min_n=1).propose(seq, 2) == [40, 8]
    # with only bigrams allowed, the most recent bigram match wins
    assert NgramProposer(max_n=2, min_n=2).propose(seq, 2) == [41, 9]


def test_ngram_respects_k_and_proposes_nothing_without_repeats():
    seq = list(range(20)) * 3
    p = NgramProposer()
    for k in range(0, 9):
        out = p.propose(seq, k)
        assert len(out) == k and out == [(20 + i) % 20 for i in range(k)]
    assert NgramProposer().propose(list(range(200)), 8) == []
    assert NgramProposer().propose([7], 8) == []


def test_ngram_run_of_one_token_continues_past_the_end():
    assert NgramProposer().propose([3, 9, 9, 9, 9], 6) == [9] * 6


def test_ngram_incremental_matches_brute_force_reference():
    rng = random.Random(0)
    for trial in range(6):
        max_n, min_n = rng.choice([(4, 1), (5, 2), (3, 3)])
        seq = [rng.randrange(4) for _ in range(8)]
        p = NgramProposer(max_n=max_n, min_n=min_n)
        for _ in range(150):
            k = rng.randrange(0, 9)
            assert p.propose(seq, k) == reference_ngram(seq, k, max_n, min_n)
            seq += [rng.randrange(4)] * rng.choice([1, 1, 2])


def test_ngram_restarts_on_a_different_sequence():
    p = NgramProposer()
    p.propose([1, 2, 3, 1, 2], 2)
    assert p.propose([8, 9, 8], 2) == reference_ngram([8, 9, 8], 2, 5, 2)
    p.finish([8, 9, 8])
    assert p.propose([4, 5, 4, 5], 3) == [4, 5, 4]


# ---------------------------------------------------------------------------------------------
# suffix decoding: the per-request index
# ---------------------------------------------------------------------------------------------
def test_suffix_proposes_a_span_of_its_own_prompt():
    prompt = list(range(1, 31)) + [99] + list(range(1, 11))
    cache = SuffixCache()
    assert cache.start(prompt).propose(prompt, 8) == list(range(11, 19))


def test_suffix_proposal_length_grows_with_the_match():
    # a 2-token match earns at most 2 tokens (spec_factor 1), an 8-token match 8
    seq = list(range(1, 31)) + [99, 1, 2]
    p = SuffixCache().start(seq)
    assert p.propose(seq, 8) == [3, 4]
    seq = seq + [3, 4, 5, 6, 7, 8]
    assert p.propose(seq, 8) == list(range(9, 17))
    assert SuffixCache(spec_factor=0.5).start(seq).propose(seq, 8) == [9, 10, 11, 12]


def test_suffix_respects_k_and_proposes_nothing_without_repeats():
    seq = list(range(40)) * 2
    p = SuffixCache().start(seq)
    for k in range(0, 10):
        assert p.propose(seq, k) == list(range(k))
    fresh = list(range(300))
    assert SuffixCache().start(fresh).propose(fresh, 8) == []


def test_suffix_follows_the_most_frequent_continuation():
    # (5, 6) was followed by 7 three times and by 8 once: 7 wins, probability 3/4
    seq = [5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 8, 3, 5, 6, 7, 4, 5, 6]
    assert SuffixCache().start(seq).propose(seq, 1) == [7]
    # the next token after 7 is 1, 2 or 4 (1/3 each, the most recent on a tie): path probability 1/4
    assert SuffixCache().start(seq).propose(seq, 2) == [7, 4]
    assert SuffixCache(min_token_prob=0.3).start(seq).propose(seq, 2) == [7]
    # ... and nothing when the threshold asks for more confidence than 3/4
    assert SuffixCache(min_token_prob=0.8).start(seq).propose(seq, 2) == []


def test_suffix_stops_when_continuations_disagree():
    # after (5, 6) twelve different tokens: none has probability >= 0.1
    seq = [t for i in range(12) for t in (5, 6, 100 + i)] + [5, 6]
    assert SuffixCache().start(seq).propose(seq, 4) == []
    assert SuffixCache(min_token_prob=0.05).start(seq).propose(seq, 1) == [111]   # ties: most recent


def test_suffix_incremental_equals_fresh_and_is_deterministic():
    rng = random.Random(1)
    seq = [rng.randrange(6) for _ in range(30)]
    inc = SuffixCache().start(seq)
    for _ in range(120):
        k = rng.randrange(1, 9)
        got = inc.propose(seq, k)
        assert got == SuffixCache().start(seq).propose(seq, k) == SuffixCache().start(seq).propose(seq, k)
        seq += got[:rng.randrange(0, len(got) + 1)] + [rng.randrange(6)]


# ---------------------------------------------------------------------------------------------
# suffix decoding: the global cache of earlier outputs
# ---------------------------------------------------------------------------------------------
PROMPT = [200 + i for i in range(40)]
ANSWER = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 11, 12]


def test_global_cache_proposes_the_earlier_answer_to_a_repeated_prompt():
    cache = SuffixCache()
    first = cache.start(PROMPT)
    assert first.propose(PROMPT, 8) == []                    # nothing seen yet
    first.finish(PROMPT + ANSWER)
    again = cache.start(PROMPT)
    assert again.propose(PROMPT, 8) == ANSWER[:8]             # from the very first output token
    assert again.propose(PROMPT + ANSWER[:5], 8) == ANSWER[5:]   # and on as the answer repeats
    assert cache.start([1, 2, 3]).propose([1, 2, 3], 8) == []   # an unrelated prompt gets nothing


def test_global_cache_with_a_prompt_shorter_than_its_context():
    cache = SuffixCache()
    cache.start([1, 2, 3]).finish([1, 2, 3] + ANSWER)
    # the whole 3-token prompt matches: a 3-token match earns 3 tokens (spec_factor 1)
    assert cache.start([1, 2, 3]).propose([1, 2, 3], 8) == ANSWER[:3]


def test_global_cache_keeps_one_copy_of_a_repeated_answer_and_counts_it():
    cache = SuffixCache()
    other = [8, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    for _ in range(3):
        cache.start(PROMPT).finish(PROMPT + ANSWER)
    assert len(cache) == 1 and cache.cached_tokens == 16 + len(ANSWER)     # one doc, seen three times
    cache.start(PROMPT).finish(PROMPT + other)                             # a different answer, the latest
    assert len(cache) == 2
    # both docs match the prompt equally deep: the answer seen three times wins 3 to 1 (one copy
    # each without the count would tie, and a tie goes to the most recent: `other`)
    assert cache.start(PROMPT).propose(PROMPT, 8) == ANSWER[:8]
    cache.start(PROMPT).finish(PROMPT + other)
    cache.start(PROMPT).finish(PROMPT + other)
    cache.start(PROMPT).finish(PROMPT + other)
    assert cache.start(PROMPT).propose(PROMPT, 8) == other[:8]               # now 4 to 3


def test_suffix_match_runs_past_the_anchors_to_pick_the_occurrence():
    # three cached answers share the 16 tokens before their continuation, so a 16-token anchor
    # matches them all and the most frequent continuation (B) would win; the 40 tokens before
    # those 16 match only A's doc, and the proposal follows A
    shared = list(range(500, 516))
    cache = SuffixCache(prompt_context=0)
    cont_a, cont_b = [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 9, 9, 9, 9]
    ctx_a = list(range(600, 640))
    for i in range(3):
        cache.start([]).finish(list(range(700 + 50 * i, 740 + 50 * i)) + shared + cont_b)
    cache.start([]).finish(ctx_a + shared + cont_a)
    seq = ctx_a + shared
    assert cache.start(seq).propose(seq, 8) == cont_a
    # a sampled sequence follows frequency instead (rejection sampling accepts the mode more often)
    assert cache.start(seq, greedy=False).propose(seq, 8) == cont_b
    # with the match cut at the anchor, frequency decides
    assert SuffixCache(prompt_context=0, max_match=16).start([]).propose(seq, 8) == []  # (empty cache)
    shallow = SuffixCache(prompt_context=0, max_match=16)
    for i in range(3):
        shallow.start([]).finish(list(range(700 + 50 * i, 740 + 50 * i)) + shared + cont_b)
    shallow.start([]).finish(ctx_a + shared + cont_a)
    assert shallow.start(seq).propose(seq, 8) == cont_b


def test_own_index_catches_up_after_calls_the_cache_answered():
    """While the global cache proposes full paths the request's own index is not updated; the
    first call it does not answer must see every token since, as a fresh proposer would."""
    cache = SuffixCache()
    cache.start(PROMPT).finish(PROMPT + ANSWER)
    inc = cache.start(PROMPT)
    seq = list(PROMPT)
    for t in ANSWER[:4]:                                       # the cache answers these calls
        assert inc.propose(seq, 4) == cache.start(seq).propose(seq, 4)
        seq.append(t)
    seq += [900, 901, 902] + [900, 901]                        # diverges: only the own index knows this
    assert inc.propose(seq, 4) == cache.start(seq).propose(seq, 4) == [902, 900]   # a 2-token match earns 2


def test_a_greedy_sequence_follows_the_cached_answer_without_searching(monkeypatch):
    """A greedy sequence repeating a cached answer gets each next proposal read off the
    occurrence its last one copied, as long as it still matches there (the same tokens a fresh
    search proposes, without the search); when it diverges it searches again. A sampled sequence
    always searches (its rule is frequency, not one occurrence)."""
    rng = random.Random(5)
    answer = [rng.randrange(300, 400) for _ in range(150)]
    cache = SuffixCache()
    cache.start(PROMPT).finish(PROMPT + answer)
    searches = []
    search = SuffixIndex.best_path
    monkeypatch.setattr(SuffixIndex, "best_path", lambda self, *a, **k: searches.append(1) or search(self, *a, **k))
    for greedy in (True, False):
        inc = cache.start(PROMPT, greedy=greedy)
        seq = list(PROMPT)
        calls = 0
        while len(seq) < len(PROMPT) + 120:
            n = len(seq) - len(PROMPT)
            before = len(searches)
            got = inc.propose(seq, 8)
            calls += len(searches) > before
            assert got == answer[n:n + 8]
            seq += got + [answer[n + len(got)]]              # all accepted, and the model's next token
        assert calls == (1 if greedy else 14)
    inc = cache.start(PROMPT)
    seq = PROMPT + answer[:20]
    assert inc.propose(seq, 8) == answer[20:28]
    seq += [999, 998]                                         # diverges: no cached occurrence matches
    before = len(searches)
    assert inc.propose(seq, 8) == cache.start(seq).propose(seq, 8)
    assert len(searches) > before


def reference_suffix(cache: SuffixCache, seq: list[int], k: int, max_match: int, own_first: bool) -> list[int]:
    """What a proposer must return (outside its follow shortcut): the better of full searches of
    a fresh own index over `seq` and of the cache, no floor; on a tie, the own index's path when
    the proposer's last proposal came from it, else the cache's."""
    own_index = SuffixIndex(cache.anchors, cache.max_occurrences)
    own_index.extend(0, seq)
    pattern = seq[-max(max(cache.anchors), max_match, k):]
    args = (pattern, k, cache.spec_factor, cache.min_token_prob)
    own, own_score, _, _ = own_index.best_path(*args, self_doc=0, max_match=max_match)
    glob, glob_score, _, _ = cache.index.best_path(*args, max_match=max_match)
    if own_first:
        return own if own_score >= glob_score else glob
    return glob if glob_score >= own_score else own


@pytest.mark.parametrize("greedy", [True, False])
def test_either_search_order_proposes_what_full_searches_do(greedy):
    """A proposer asks first the index its last proposal came from (which also wins ties) and
    searches the other only for a path that can beat it (best_path's floor). On a small alphabet,
    with a cache of earlier outputs that share spans with the sequence and a sequence that copies
    its own prompt and cached spans in turn (so both orders and every pruning run), each proposal
    equals that of full searches of both indexes without a floor."""
    rng = random.Random(11)
    spans = [[rng.randrange(6) for _ in range(rng.randrange(10, 40))] for _ in range(6)]
    cache = SuffixCache(max_occurrences=6)
    for i in range(8):
        out = [t for _ in range(3) for t in rng.choice(spans)[:rng.randrange(4, 30)]] + [rng.randrange(6)]
        cache.start([50 + i]).finish([50 + i] + out)
    seq = [t for sp in spans[:3] for t in sp]
    inc = cache.start(seq, greedy=greedy)
    orders = set()
    for _ in range(300):
        k = rng.randrange(1, 17)
        inc._follow = None                     # the follow shortcut skips searching (its own test)
        own_first = inc._own_first
        got = inc.propose(seq, k)
        assert got == reference_suffix(cache, seq, k, inc.max_match, own_first)
        orders.add((own_first, inc._own_first))
        src = rng.choice([seq, seq, rng.choice(spans)])
        start = rng.randrange(len(src))
        seq += (got[:rng.randrange(len(got) + 1)] if rng.random() < 0.5 else src[start:start + rng.randrange(1, 20)])
        seq.append(rng.randrange(6))
    assert orders == {(False, False), (False, True), (True, False), (True, True)}


def test_aborted_request_is_not_cached():
    cache = SuffixCache()
    cache.start(PROMPT).finish(None)
    assert len(cache) == 0 and cache.cached_tokens == 0
    assert cache.start(PROMPT).propose(PROMPT, 4) == []


def _index_docs(index: SuffixIndex) -> set[int]:
    """Doc ids referenced by any occurrence in the index."""
    return {p >> 32 for table in index._tables for occ in table.values() for p in occ}


def test_global_cache_token_bound_holds_under_eviction():
    cap, tail = 100, 4
    cache = SuffixCache(max_cached_tokens=cap, prompt_context=tail)
    rng = random.Random(2)
    for r in range(25):
        prompt = [1000 + r] * 5 + [rng.randrange(50) for _ in range(10)]
        out = [rng.randrange(50) for _ in range(rng.randrange(1, 40))]
        cache.start(prompt).finish(prompt + out)
        assert cache.cached_tokens <= cap
        assert cache.cached_tokens == sum(len(d) for d in cache.index.docs.values())
        assert _index_docs(cache.index) <= set(cache.index.docs)      # evicted docs left no occurrences
    huge = list(range(5000, 5300))
    cache.start(huge[:10]).finish(huge)                               # longer than the budget: its tail is kept
    assert cache.cached_tokens == cap and len(cache) == 1


def test_global_cache_evicts_the_least_recently_used_request():
    size = 8 + len(ANSWER)                                     # prompt tail + answer per cached request
    cache = SuffixCache(max_cached_tokens=3 * size, prompt_context=8)
    prompts = {name: [base + i for i in range(20)] for name, base in (("a", 300), ("b", 400), ("c", 500), ("d", 600))}
    answers = {name: [base + t for t in ANSWER] for name, base in (("a", 30), ("b", 40), ("c", 50), ("d", 60))}
    for name in "abc":
        cache.start(prompts[name]).finish(prompts[name] + answers[name])
    assert cache.start(prompts["a"]).propose(prompts["a"], 4) == answers["a"][:4]    # a is used: most recent now
    cache.start(prompts["d"]).finish(prompts["d"] + answers["d"])                   # evicts b, the oldest unused
    assert cache.start(prompts["b"]).propose(prompts["b"], 4) == []
    for name in "acd":
        assert cache.start(prompts[name]).propose(prompts[name], 4) == answers[name][:4]


def test_make_speculator():
    assert make_speculator("off") is None
    assert isinstance(make_speculator("ngram", max_n=3), NgramSpeculator)
    suffix = make_speculator("suffix", max_cached_tokens=10)
    assert isinstance(suffix, SuffixCache) and suffix.max_cached_tokens == 10
    with pytest.raises(ValueError):
        make_speculator("medusa")
    with pytest.raises(ValueError):
        NgramProposer(max_n=2, min_n=3)


def test_removal_by_bisection_equals_filtering_every_occurrence():
    """SuffixIndex.remove cuts a doc's run out of each occurrence list by bisection while the lists
    are sorted (docs extended in ascending id order, as the global cache does); the tables it leaves
    equal those of filtering every entry, also when docs leave out of order (LRU) and lists were
    trimmed, on a small alphabet so n-grams repeat across docs."""
    rng = random.Random(5)
    fast, slow = SuffixIndex((2, 4), max_occurrences=3), SuffixIndex((2, 4), max_occurrences=3)
    slow._sorted = False
    live: list[int] = []
    for doc_id in range(1, 120):
        toks = [rng.randrange(4) for _ in range(rng.randrange(3, 30))]
        for ix in (fast, slow):
            ix.extend(doc_id, toks)
        live.append(doc_id)
        if len(live) > 6:
            old = live.pop(rng.randrange(len(live)))       # not always the oldest
            assert fast.remove(old) == slow.remove(old)
        assert fast._sorted
        assert [{k: list(v) for k, v in t.items()} for t in fast._tables] == \
               [{k: list(v) for k, v in t.items()} for t in slow._tables]
    fast.extend(1000, [1, 2, 3])
    fast.extend(999, [1, 2, 3])                            # an older id extended later: filtering again
    assert not fast._sorted
