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

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from google.protobuf import json_format
from google.protobuf.message import Message

from frontends.grpc.gen.allspark import allspark_service_pb2 as apb
from frontends.grpc.gen.sglang import sglang_scheduler_pb2 as spb
from jax_engine.types import GenerateRequest, SamplingParams
from tests.conftest import GEN

PROMPT = [1] + [50, 51, 52] * 6            # repetitive: its greedy continuation repeats itself
CHAT_TEXT = "one two one two one two"
N = 8                                      # new tokens per request unless a test says otherwise
SEEDS = (11, 12, 13)
SGLANG = "sglang.grpc.scheduler.SglangScheduler"
ALLSPARK = "allspark.allspark_service.AllSpark"
HIGH_BITS = 2**40                          # a seed difference that only 64-bit seeds see

TokenKey = int | str  # token ids on gRPC protocols, token strings on OpenAI routes


@dataclass
class Out:
    """One sequence of a response, normalised across protocols."""

    tokens: list[TokenKey]
    finish: str | None = None               # "stop" | "length" (AllSpark reports none)
    matched: TokenKey | None = None         # the stop string or stop token id that ended it
    text: str | None = None                 # OpenAI routes only
    raw: Any = None                            # the protocol's own choice / message


# ============================================================================================
# transports: the same servicer methods over gRPC or over the JSON mirror
# ============================================================================================
class GrpcTransport:
    def __init__(self, channel: grpc.Channel):
        self.channel = channel

    def unary(self, service: str, method: str, req: Message, resp_cls: type) -> tuple[Message, dict[str, str]]:
        call = self.channel.unary_unary(f"/{service}/{method}", request_serializer=type(req).SerializeToString,
                                        response_deserializer=resp_cls.FromString)
        resp, info = call.with_call(req, timeout=60)
        return resp, {k: v for k, v in info.trailing_metadata() or ()}

    def stream(self, service: str, method: str, req: Message, resp_cls: type) -> list[Message]:
        call = self.channel.unary_stream(f"/{service}/{method}", request_serializer=type(req).SerializeToString,
                                         response_deserializer=resp_cls.FromString)
        return list(call(req, timeout=60))

    def stream_until(self, service: str, method: str, req: Message, resp_cls: type,
                     enough: Callable[[list[Message]], bool]) -> list[Message]:
        """The first messages of a stream, cancelling the call once `enough` of them arrived."""
        call = self.channel.unary_stream(f"/{service}/{method}", request_serializer=type(req).SerializeToString,
                                         response_deserializer=resp_cls.FromString)(req, timeout=60)
        msgs: list[Message] = []
        for m in call:
            msgs.append(m)
            if enough(msgs):
                break
        call.cancel()
        return msgs


class MirrorTransport:
    def __init__(self, client: httpx.Client):
        self.client = client

    def _post(self, service: str, method: str, req: Message) -> httpx.Response:
        body = json_format.MessageToDict(req, preserving_proto_field_name=False)
        return self.client.post(f"/{service}/{method}", json=body)

    def unary(self, service: str, method: str, req: Message, resp_cls: type) -> tuple[Message, dict[str, str]]:
        r = self._post(service, method, req)
        assert r.status_code == 200, r.text
        trailers = {k[len("trailer-"):]: v for k, v in r.headers.items() if k.startswith("trailer-")}
        return json_format.ParseDict(r.json(), resp_cls()), trailers

    def stream(self, service: str, method: str, req: Message, resp_cls: type) -> list[Message]:
        r = self._post(service, method, req)
        assert r.status_code == 200, r.text
        lines = [json.loads(line) for line in r.text.splitlines() if line.strip()]
        assert all("error" not in line for line in lines), lines
        return [json_format.ParseDict(line, resp_cls()) for line in lines]

    def stream_until(self, service: str, method: str, req: Message, resp_cls: type,
                     enough: Callable[[list[Message]], bool]) -> list[Message]:
        """The first messages of a stream; closing the response early aborts the request."""
        body = json_format.MessageToDict(req, preserving_proto_field_name=False)
        msgs: list[Message] = []
        with self.client.stream("POST", f"/{service}/{method}", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.strip():
                    msgs.append(json_format.ParseDict(json.loads(line), resp_cls()))
                if msgs and enough(msgs):
                    break
        return msgs


Transport = GrpcTransport | MirrorTransport


# ============================================================================================
# protocols: canonical fields -> each protocol's own message
# ============================================================================================
CANONICAL = frozenset({
    "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
    "logit_bias", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "n",
})


class Protocol:
    name: str = ""
    fields: frozenset[str] = frozenset()

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer

    def prompt_ids(self) -> list[int]:
        return list(PROMPT)

    def key(self, token_id: int) -> TokenKey:
        """How this protocol reports a token."""
        return token_id

    def run(self, **params: Any) -> list[Out]:
        """One request; one Out per sequence, in index order."""
        raise NotImplementedError

    def one(self, **params: Any) -> Out:
        outs = self.run(**params)
        assert len(outs) == 1
        return outs[0]


class OpenAICompletions(Protocol):
    name = "completions"
    fields = CANONICAL

    def __init__(self, tokenizer: Any, client: httpx.Client):
        super().__init__(tokenizer)
        self.client = client

    def key(self, token_id: int) -> TokenKey:
        return self.tok.decode([token_id])

    def body(self, params: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": GEN, "prompt": self.prompt_ids(), "logprobs": 0}
        body.update(_openai_fields(params))
        return body

    def post(self, body: dict[str, Any]) -> dict[str, Any]:
        r = self.client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def run(self, **params: Any) -> list[Out]:
        resp = self.post(self.body(params))
        return [Out(tokens=c["logprobs"]["tokens"], finish=c["finish_reason"], matched=c["stop_reason"],
                    text=c["text"], raw=c) for c in resp["choices"]]


class OpenAIChat(OpenAICompletions):
    name = "chat"

    def prompt_ids(self) -> list[int]:
        text = self.tok.apply_chat_template([{"role": "user", "content": CHAT_TEXT}], tokenize=False,
                                            add_generation_prompt=True)
        return list(self.tok.encode(text, add_special_tokens=False))

    def body(self, params: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": GEN, "messages": [{"role": "user", "content": CHAT_TEXT}], "logprobs": True}
        body.update(_openai_fields(params))
        return body

    def post(self, body: dict[str, Any]) -> dict[str, Any]:
        r = self.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def run(self, **params: Any) -> list[Out]:
        resp = self.post(self.body(params))
        return [Out(tokens=[e["token"] for e in c["logprobs"]["content"]], finish=c["finish_reason"],
                    matched=c["stop_reason"], text=c["message"]["content"], raw=c) for c in resp["choices"]]


def _openai_fields(params: dict[str, Any]) -> dict[str, Any]:
    out = {"max_tokens": N, **params}
    if "logit_bias" in out:
        out["logit_bias"] = {str(k): v for k, v in out["logit_bias"].items()}
    return out


class Sglang(Protocol):
    """SGLang Generate as the router sends it: every SamplingParams field explicit."""

    fields = CANONICAL - {"seed"}   # the seed proto has no seed field

    def __init__(self, tokenizer: Any, transport: Transport, name: str):
        super().__init__(tokenizer)
        self.transport = transport
        self.name = name

    def sampling(self, params: dict[str, Any]) -> spb.SamplingParams:
        p = dict(params)
        sp: dict[str, Any] = {"temperature": p.pop("temperature", 1.0), "top_p": p.pop("top_p", 1.0), "top_k": p.pop("top_k", -1),
                  "min_p": p.pop("min_p", 0.0), "repetition_penalty": p.pop("repetition_penalty", 1.0),
                  "n": p.pop("n", 1), "skip_special_tokens": p.pop("skip_special_tokens", True),
                  "spaces_between_special_tokens": p.pop("spaces_between_special_tokens", True),
                  "max_new_tokens": p.pop("max_tokens", N), "min_new_tokens": p.pop("min_tokens", 0),
                  "logit_bias": {str(k): v for k, v in p.pop("logit_bias", {}).items()}}
        for name in ("stop_token_ids", "stop", "ignore_eos", "frequency_penalty", "presence_penalty",
                     "no_stop_trim", "stream_interval"):
            if name in p:
                sp[name] = p.pop(name)
        assert not p, f"not an SGLang field: {sorted(p)}"
        return spb.SamplingParams(**sp)

    def request(self, params: dict[str, Any], **kw: Any) -> spb.GenerateRequest:
        return spb.GenerateRequest(request_id=f"map-{uuid.uuid4().hex}",
                                   tokenized=spb.TokenizedInput(input_ids=self.prompt_ids()),
                                   sampling_params=self.sampling(params), **kw)

    def messages(self, req: spb.GenerateRequest) -> list[spb.GenerateResponse]:
        return self.transport.stream(SGLANG, "Generate", req, spb.GenerateResponse)

    def run(self, **params: Any) -> list[Out]:
        msgs = self.messages(self.request(params))
        outs = []
        for m in msgs:
            assert m.WhichOneof("response") == "complete", m
            c = m.complete
            matched = {"matched_stop_str": c.matched_stop_str, "matched_token_id": c.matched_token_id,
                       None: None}[c.WhichOneof("matched_stop")]
            outs.append(Out(tokens=list(c.output_ids), finish=c.finish_reason, matched=matched, raw=c))
        return sorted(outs, key=lambda o: o.raw.index)


class AllSpark(Protocol):
    """AllSpark StartRequest + Get polling, every GenerateConfig field explicit (the C++ client)."""

    fields = frozenset({"temperature", "top_k", "top_p", "repetition_penalty", "presence_penalty", "seed",
                        "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos"})

    def __init__(self, tokenizer: Any, transport: Transport, name: str):
        super().__init__(tokenizer)
        self.transport = transport
        self.name = name

    def config(self, params: dict[str, Any]) -> apb.GenerateConfig:
        p = dict(params)
        temperature = p.pop("temperature", 1.0)
        prompt_len = len(self.prompt_ids())
        cfg: dict[str, Any] = {"do_sample": temperature > 0, "temperature": temperature, "top_k": p.pop("top_k", 0),
                   "top_p": p.pop("top_p", 1.0), "repetition_penalty": p.pop("repetition_penalty", 1.0),
                   "presence_penalty": p.pop("presence_penalty", 0.0), "length_penalty": 1.0, "num_beams": 1,
                   "num_return_sequences": 1, "early_stopping": not p.pop("ignore_eos", False), "eos_token_id": 0,
                   "seed": p.pop("seed", 0), "max_length": prompt_len + p.pop("max_tokens", N),
                   "min_length": prompt_len + p.pop("min_tokens", 0), "uuid": f"map-{uuid.uuid4().hex}"}
        for name in ("do_sample", "eos_token_id", "length_penalty"):   # AllSpark's own fields
            if name in p:
                cfg[name] = p.pop(name)
        stop_words = [[t] for t in p.pop("stop_token_ids", [])] + p.pop("stop_words", [])
        cfg["stop_words_ids"] = apb.StopWordIds(ids=[apb.StopWordIds.Array(word=w) for w in stop_words])
        assert not p, f"not an AllSpark field: {sorted(p)}"
        return apb.GenerateConfig(**cfg)

    def start(self, cfg: apb.GenerateConfig) -> tuple[apb.StartRequestResponse, dict[str, str]]:
        ids = np.asarray(self.prompt_ids(), dtype="<i8")
        tensor = apb.Tensor(name="tensor", shape=apb.Tensor.Shape(dims=[1, len(ids)]), data_type=apb.INT64,
                            device_type=apb.DeviceType(dev_type=apb.CPU), data_mode=apb.DENSE, data=ids.tobytes())
        req = apb.StartRequestRequest(model_name=GEN, inputs=apb.TensorMap(tensor_map={"input_ids": tensor}),
                                      config=cfg)
        return self.transport.unary(ALLSPARK, "StartRequest", req, apb.StartRequestResponse)

    def drain(self, uid: str, timeout: float = 60.0) -> list[int]:
        out: list[int] = []
        deadline = time.monotonic() + timeout
        key = apb.UUID(uuid=uid)
        while time.monotonic() < deadline:
            status, _ = self.transport.unary(ALLSPARK, "GenerateStatus", key, apb.GenerateRequestStatus)
            if status.status in (apb.GenerateFinished, apb.GenerateInterrupted):
                assert status.status == apb.GenerateFinished
                return out
            got, _ = self.transport.unary(ALLSPARK, "Get", key, apb.GeneratedElements)
            out += list(got.ids_from_generate)
        raise AssertionError("AllSpark request did not finish")

    def release(self, uid: str) -> None:
        resp, _ = self.transport.unary(ALLSPARK, "ReleaseRequest", apb.StopRequestRequest(model_name=GEN, uuid=uid),
                                       apb.StartRequestResponse)
        assert resp.as_status == apb.ALLSPARK_SUCCESS

    def run(self, **params: Any) -> list[Out]:
        cfg = self.config(params)
        resp, trailers = self.start(cfg)
        assert resp.as_status == apb.ALLSPARK_SUCCESS, (resp, trailers)
        try:
            return [Out(tokens=self.drain(cfg.uuid))]
        finally:
            self.release(cfg.uuid)


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
def tok(serving_engine):
    return serving_engine.tokenizer(GEN)


@pytest.fixture(scope="module")
def http(http_url):
    with httpx.Client(base_url=http_url, timeout=120) as c:
        yield c


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
