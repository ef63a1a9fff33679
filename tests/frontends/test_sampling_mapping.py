"""Issue 13 §3: every sampling field of every protocol changes what the engine does, end to end.

Each protocol is driven over a real socket: OpenAI chat and completions (HTTP), SGLang Generate
and AllSpark StartRequest / Get, both over gRPC and over the JSON mirror (POST
/{package}.{Service}/{Method}). A `Protocol` adapter translates one set of canonical field
names into the protocol's own message, so one test per field runs on every protocol that
carries it. Every test compares against the behaviour WITHOUT the field (the greedy tokens the
engine itself produces for the same prompt, or the same request without the field): a front
that dropped the field would fail it.

The demo generator has random weights, so its tokens are arbitrary but deterministic. Facts of
this model the tests rely on (each is asserted where used, so a changed model fails loudly):
the greedy continuation of a repetitive prompt repeats itself (so any penalty changes it), and
at temperature 1 a seeded draw differs from the greedy tokens.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf.message import Message

from frontends.grpc.gen.allspark import allspark_service_pb2 as apb
from frontends.grpc.gen.sglang import sglang_scheduler_pb2 as spb
from jax_engine.types import GenerateRequest, SamplingParams
from tests.helpers.protocol_clients import (
    HIGH_BITS,
    PROMPT,
    SEEDS,
    SGLANG,
    AllSpark,
    GrpcTransport,
    MirrorTransport,
    N,
    OpenAIChat,
    OpenAICompletions,
    Protocol,
    Sglang,
    TokenKey,
)

# ============================================================================================
# which protocol carries which field; fixtures
# ============================================================================================
FIELDS: dict[str, frozenset[str]] = {
    "chat": OpenAIChat.fields, "completions": OpenAICompletions.fields,
    "sglang-grpc": Sglang.fields, "sglang-mirror": Sglang.fields,
    "allspark-grpc": AllSpark.fields, "allspark-mirror": AllSpark.fields,
}


def carrying(*names: str) -> list[str]:
    """The protocols whose messages carry every one of `names`."""
    return [proto for proto, fields in FIELDS.items() if set(names) <= fields]


@pytest.fixture(scope="module")
def protocols(tok, http, grpc_channel) -> dict[str, Protocol]:
    grpc_t, mirror_t = GrpcTransport(grpc_channel), MirrorTransport(http)
    return {
        "chat": OpenAIChat(tok, http),
        "completions": OpenAICompletions(tok, http),
        "sglang-grpc": Sglang(tok, grpc_t, "sglang-grpc"),
        "sglang-mirror": Sglang(tok, mirror_t, "sglang-mirror"),
        "allspark-grpc": AllSpark(tok, grpc_t, "allspark-grpc"),
        "allspark-mirror": AllSpark(tok, mirror_t, "allspark-mirror"),
    }


@pytest.fixture(scope="module")
def engine_greedy(server_loop, serving_engine) -> Callable[[list[int], int], list[int]]:
    """The engine's own greedy ids (in process, no front), memoised per (prompt, length)."""
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(prompt: list[int], n: int = N) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = server_loop.run(_engine_tokens(serving_engine, prompt, n))
        return cache[key]

    return greedy


async def _engine_tokens(engine: Any, prompt: list[int], n: int) -> list[int]:
    req = GenerateRequest(request_id=f"greedy-{uuid.uuid4().hex}", prompt_ids=list(prompt),
                          params=SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True))
    toks: list[int] = []
    async for out in engine.generate(req):
        toks += out.new_token_ids
    return toks


def _greedy(p: Protocol, engine_greedy: Callable[..., list[int]], n: int = N) -> list[TokenKey]:
    return [p.key(t) for t in engine_greedy(p.prompt_ids(), n)]


def _sampled_differs(p: Protocol, greedy: list[TokenKey]) -> list[int]:
    """Seeds (or, without a seed field, attempts) whose temperature-1 draw is not the greedy
    continuation; at least one must exist or the fields below could not be told apart."""
    differing = []
    for s in SEEDS:
        seed = {"seed": s} if "seed" in p.fields else {}
        if p.one(temperature=1.0, **seed).tokens != greedy:
            differing.append(s)
    assert differing, f"{p.name}: temperature 1 reproduced the greedy tokens for every seed"
    return differing


# ============================================================================================
# temperature, top_k, top_p, min_p: each alone turns a temperature-1 draw into the greedy one
# ============================================================================================
@pytest.mark.parametrize("proto", carrying("temperature"))
def test_temperature_zero_is_greedy_and_one_samples(protocols, engine_greedy, proto):
    p = protocols[proto]
    greedy = _greedy(p, engine_greedy)
    differing = _sampled_differs(p, greedy)           # without temperature 0: not greedy
    for s in differing:
        seed = {"seed": s} if "seed" in p.fields else {}
        assert p.one(temperature=0.0, **seed).tokens == greedy


@pytest.mark.parametrize("proto,field_name,value", [
    (proto, name, value) for name, value in (("top_k", 1), ("top_p", 1e-6), ("min_p", 1.0)) for proto in carrying(name)])
def test_truncation_to_one_token_is_greedy(protocols, engine_greedy, proto, field_name, value):
    p = protocols[proto]
    greedy = _greedy(p, engine_greedy)
    for s in _sampled_differs(p, greedy):
        seed = {"seed": s} if "seed" in p.fields else {}
        assert p.one(temperature=1.0, **seed, **{field_name: value}).tokens == greedy, (field_name, s)


# ============================================================================================
# penalties change a greedy continuation that repeats itself
# ============================================================================================
@pytest.mark.parametrize("proto,field_name,value", [
    (proto, name, value) for name, value in (("repetition_penalty", 1.5), ("frequency_penalty", 1.0),
                                             ("presence_penalty", 1.0)) for proto in carrying(name)])
def test_penalties_change_a_repetitive_greedy_continuation(protocols, engine_greedy, proto, field_name, value):
    p = protocols[proto]
    greedy = _greedy(p, engine_greedy)
    assert len(set(greedy)) < len(greedy), "the greedy continuation should repeat a token"
    assert p.one(temperature=0.0).tokens == greedy            # without the penalty
    penalised = p.one(temperature=0.0, **{field_name: value}).tokens
    assert penalised != greedy
    assert len(set(penalised)) > len(set(greedy))             # fewer repeats, as a penalty should


# ============================================================================================
# logit_bias, stop_token_ids, ignore_eos, min_tokens, max_tokens
# ============================================================================================
def _letter(tok: Any) -> int:
    ids = tok.encode("a", add_special_tokens=False)
    assert len(ids) == 1
    return ids[0]


@pytest.mark.parametrize("proto", carrying("logit_bias"))
def test_logit_bias_forces_a_token(protocols, engine_greedy, tok, proto):
    p = protocols[proto]
    forced = _letter(tok)
    greedy = _greedy(p, engine_greedy)
    assert p.key(forced) not in greedy
    assert p.one(temperature=0.0, logit_bias={forced: 100.0}).tokens == [p.key(forced)] * N
    # -100 on the greedy first token removes it from the first position
    first = engine_greedy(p.prompt_ids())[0]
    assert p.one(temperature=0.0, logit_bias={first: -100.0}).tokens[0] != p.key(first)


@pytest.mark.parametrize("proto", carrying("stop_token_ids"))
def test_stop_token_ids_end_generation(protocols, engine_greedy, proto):
    p = protocols[proto]
    ids = engine_greedy(p.prompt_ids())
    stop = ids[1]
    cut = ids.index(stop) + 1
    plain = p.one(temperature=0.0)
    assert len(plain.tokens) == N                              # without the field: all N
    out = p.one(temperature=0.0, stop_token_ids=[stop])
    assert out.tokens == [p.key(t) for t in ids[:cut]]        # the stop token is included
    if out.finish is not None:
        assert (plain.finish, out.finish) == ("length", "stop") and out.matched == stop


@pytest.mark.parametrize("proto", carrying("logit_bias", "ignore_eos", "min_tokens"))
def test_ignore_eos_and_min_tokens_with_a_forced_eos(protocols, tok, proto):
    p = protocols[proto]
    eos = tok.eos_token_id
    force_eos = {"temperature": 0.0, "logit_bias": {eos: 100.0}}
    out = p.one(**force_eos)
    assert out.tokens == [p.key(eos)] and out.finish == "stop"
    ignored = p.one(**force_eos, ignore_eos=True)
    assert ignored.tokens == [p.key(eos)] * N and ignored.finish == "length"
    held = p.one(**force_eos, min_tokens=3)
    assert len(held.tokens) == 4 and held.tokens[-1] == p.key(eos) and p.key(eos) not in held.tokens[:3]


@pytest.mark.parametrize("proto", ("allspark-grpc", "allspark-mirror"))
def test_allspark_min_length_and_ignore_eos_via_eos_token_id(protocols, engine_greedy, proto):
    """AllSpark has no logit_bias: the configured eos_token_id is set to a greedy token instead."""
    p = protocols[proto]
    ids = engine_greedy(p.prompt_ids())
    eos = ids[0]
    assert p.one(temperature=0.0, eos_token_id=eos).tokens == [eos]           # early_stopping on
    assert p.one(temperature=0.0, eos_token_id=eos, ignore_eos=True).tokens == ids  # early_stopping off
    held = p.one(temperature=0.0, eos_token_id=eos, min_tokens=3).tokens
    assert len(held) >= 4 and eos not in held[:3]


@pytest.mark.parametrize("proto", carrying("max_tokens"))
def test_max_tokens_bounds_the_length(protocols, engine_greedy, proto):
    p = protocols[proto]
    greedy = _greedy(p, engine_greedy)
    for n in (3, 5):
        out = p.one(temperature=0.0, max_tokens=n, ignore_eos=True)
        assert out.tokens == greedy[:n]
        assert out.finish in (None, "length")


# ============================================================================================
# stop strings, skip_special_tokens (text the engine detokenizes)
# ============================================================================================
@pytest.mark.parametrize("proto", carrying("stop"))
def test_stop_string_ends_generation(protocols, engine_greedy, tok, proto):
    p = protocols[proto]
    ids = engine_greedy(p.prompt_ids())
    stop = tok.decode(ids[1:3])
    plain = p.one(temperature=0.0)
    out = p.one(temperature=0.0, stop=[stop])
    assert plain.finish == "length" and out.finish == "stop" and out.matched == stop
    assert len(out.tokens) < len(plain.tokens) and out.tokens == plain.tokens[:len(out.tokens)]
    if out.text is not None:
        full = plain.text
        assert out.text == full[:full.index(stop)]
        kept = p.one(temperature=0.0, stop=[stop], include_stop_str_in_output=True)
        assert kept.text == full[:full.index(stop) + len(stop)]


@pytest.mark.parametrize("proto", carrying("skip_special_tokens"))
def test_skip_special_tokens_decides_whether_special_text_exists(protocols, tok, proto):
    """A forced <|pad|> (special, not EOS) is text only with skip_special_tokens false: OpenAI
    returns that text; SGLang (ids only) shows it through a stop string matching it."""
    p = protocols[proto]
    pad = tok.pad_token_id
    pad_text = tok.convert_ids_to_tokens(pad)
    assert pad != tok.eos_token_id and pad_text in tok.all_special_tokens
    base = {"temperature": 0.0, "logit_bias": {pad: 100.0}}
    skipped = p.one(**base, stop=[pad_text])                      # default: skip_special_tokens true
    kept = p.one(**base, stop=[pad_text], skip_special_tokens=False)
    assert skipped.tokens == [p.key(pad)] * N and skipped.finish == "length"
    assert kept.tokens == [p.key(pad)] and kept.finish == "stop" and kept.matched == pad_text
    if skipped.text is not None:
        assert skipped.text == ""
        assert p.one(**base, skip_special_tokens=False).text == pad_text * N


# ============================================================================================
# seeds and n
# ============================================================================================
@pytest.mark.parametrize("proto", carrying("seed"))
def test_seed_reproduces_and_distinguishes_draws(protocols, proto):
    p = protocols[proto]
    a = p.one(temperature=1.0, seed=SEEDS[0]).tokens
    assert p.one(temperature=1.0, seed=SEEDS[0]).tokens == a
    assert p.one(temperature=1.0, seed=SEEDS[1]).tokens != a


@pytest.mark.parametrize("proto", carrying("seed"))
def test_seeds_differing_only_in_the_high_32_bits_draw_differently(protocols, proto):
    p = protocols[proto]
    low = p.one(temperature=1.0, seed=5).tokens
    assert p.one(temperature=1.0, seed=5).tokens == low
    assert p.one(temperature=1.0, seed=5 + HIGH_BITS).tokens != low


def test_openai_negative_seed_is_its_twos_complement(protocols):
    p = protocols["completions"]
    minus_one = p.one(temperature=1.0, seed=-1).tokens
    assert p.one(temperature=1.0, seed=2**64 - 1).tokens == minus_one
    assert p.one(temperature=1.0, seed=1).tokens != minus_one


@pytest.mark.parametrize("proto", carrying("n"))
def test_n_returns_n_sequences(protocols, engine_greedy, proto):
    p = protocols[proto]
    greedy = _greedy(p, engine_greedy)
    assert len(p.run(temperature=0.0)) == 1
    outs = p.run(temperature=0.0, n=3)
    assert [o.tokens for o in outs] == [greedy] * 3


# ============================================================================================
# protocol-specific fields
# ============================================================================================
def test_allspark_do_sample_false_is_greedy_whatever_the_temperature(protocols, engine_greedy):
    p = protocols["allspark-grpc"]
    greedy = _greedy(p, engine_greedy)
    for s in _sampled_differs(p, greedy):
        assert p.one(temperature=1.0, seed=s, do_sample=False).tokens == greedy
        assert p.one(temperature=1e-4, seed=s).tokens == greedy   # a near-zero temperature too


@pytest.mark.parametrize("proto", ("allspark-grpc", "allspark-mirror"))
def test_allspark_stop_words_single_and_multi_token(protocols, engine_greedy, proto):
    p = protocols[proto]
    ids = engine_greedy(p.prompt_ids())
    assert p.one(temperature=0.0).tokens == ids                   # no stop words: all N
    single = ids[2]
    assert p.one(temperature=0.0, stop_words=[[single]]).tokens == ids[:ids.index(single) + 1]
    pair = ids[2:4]
    end = next(k for k in range(2, len(ids) + 1) if ids[k - 2:k] == pair)
    assert p.one(temperature=0.0, stop_words=[pair]).tokens == ids[:end]


@pytest.mark.parametrize("proto", ("allspark-grpc", "allspark-mirror"))
def test_allspark_max_length_is_a_total(protocols, engine_greedy, proto):
    p = protocols[proto]
    ids = engine_greedy(p.prompt_ids())
    cfg = p.config({"temperature": 0.0, "ignore_eos": True})
    cfg.max_length = len(p.prompt_ids()) + 2
    resp, _ = p.start(cfg)
    assert resp.as_status == apb.ALLSPARK_SUCCESS
    try:
        assert p.drain(cfg.uuid) == ids[:2]
    finally:
        p.release(cfg.uuid)


@pytest.mark.parametrize("proto", ("sglang-grpc", "sglang-mirror"))
def test_sglang_absent_sampling_params_samples_at_temperature_one(protocols, engine_greedy, proto):
    """No sampling_params at all = SGLang's semantic defaults: temperature 1 (sampled), not the
    proto zeros (which would read as greedy). With no max_new_tokens it would run to the
    context, so each stream is read for its first tokens and then cancelled."""
    p = protocols[proto]
    count = 16
    greedy = engine_greedy(p.prompt_ids(), count)
    explicit_zero = p.request({"temperature": 0.0, "max_tokens": count})
    assert list(p.messages(explicit_zero)[0].complete.output_ids) == greedy
    outs = [_first_tokens(p, spb.GenerateRequest(request_id=f"absent-{uuid.uuid4().hex}", stream=True,
                                                 tokenized=spb.TokenizedInput(input_ids=p.prompt_ids())), count)
            for _ in range(3)]
    assert any(o != greedy[:len(o)] for o in outs), outs


def _first_tokens(p: Sglang, req: spb.GenerateRequest, count: int) -> list[int]:
    def ids(msgs: list[Message]) -> list[int]:
        return [t for m in msgs if m.WhichOneof("response") == "chunk" for t in m.chunk.token_ids]

    def enough(msgs: list[Message]) -> bool:
        return len(ids(msgs)) >= count or msgs[-1].WhichOneof("response") == "complete"

    return ids(p.transport.stream_until(SGLANG, "Generate", req, spb.GenerateResponse, enough))[:count]


@pytest.mark.parametrize("proto", ("sglang-grpc", "sglang-mirror"))
def test_sglang_stream_interval_batches_tokens(protocols, proto):
    p = protocols[proto]
    per_token = p.messages(p.request({"temperature": 0.0, "max_tokens": 7}, stream=True))
    batched = p.messages(p.request({"temperature": 0.0, "max_tokens": 7, "stream_interval": 3}, stream=True))

    def sizes(msgs: list[spb.GenerateResponse]) -> list[int]:
        return [len(m.chunk.token_ids) for m in msgs if m.WhichOneof("response") == "chunk"]

    assert sizes(per_token) == [1] * 7 and sizes(batched) == [3, 3, 1]


@pytest.mark.parametrize("proto", ("sglang-grpc", "sglang-mirror"))
def test_sglang_logprob_fields(protocols, proto):
    p = protocols[proto]
    plain = p.messages(p.request({"temperature": 0.0, "max_tokens": 4}))[0].complete
    assert not plain.HasField("output_logprobs") and not plain.HasField("input_logprobs")
    c = p.messages(p.request({"temperature": 0.0, "max_tokens": 4}, return_logprob=True, top_logprobs_num=2,
                             logprob_start_len=3))[0].complete
    assert list(c.output_logprobs.token_ids) == list(c.output_ids) and len(c.output_logprobs.token_logprobs) == 4
    assert [len(t.values) for t in c.output_logprobs.top_logprobs] == [2] * 4
    assert len(c.input_logprobs.token_ids) == len(PROMPT) - 3
    no_input = p.messages(p.request({"temperature": 0.0, "max_tokens": 4}, return_logprob=True,
                                    logprob_start_len=-1))[0].complete
    assert not no_input.HasField("input_logprobs") and not no_input.output_logprobs.top_logprobs


@pytest.mark.parametrize("proto", ("chat", "completions"))
def test_openai_logprobs_fields(protocols, proto):
    p = protocols[proto]
    assert isinstance(p, OpenAICompletions)
    body = p.body({"temperature": 0.0, "max_tokens": 3})
    body.pop("logprobs")
    assert all(c["logprobs"] is None for c in p.post(body)["choices"])
    if proto == "chat":
        top = p.post({**body, "logprobs": True, "top_logprobs": 2})["choices"][0]["logprobs"]["content"]
        assert [len(e["top_logprobs"]) for e in top] == [2, 2, 2]
    else:
        top = p.post({**body, "logprobs": 2})["choices"][0]["logprobs"]["top_logprobs"]
        assert len(top) == 3 and all(len(t) >= 2 for t in top)


def test_openai_max_completion_tokens_and_its_alias(protocols, engine_greedy):
    p = protocols["chat"]
    greedy = _greedy(p, engine_greedy)
    assert p.one(temperature=0.0, max_tokens=None, max_completion_tokens=3).tokens == greedy[:3]
    assert p.one(temperature=0.0, max_tokens=4).tokens == greedy[:4]
    assert p.one(temperature=0.0, max_tokens=5, max_completion_tokens=5).tokens == greedy[:5]
