"""Protocol clients the end-to-end sampling tests share: one canonical set of field names
translated into OpenAI chat / completions, SGLang Generate and AllSpark StartRequest / Get, each
over gRPC or the JSON mirror (tests/frontends/test_sampling_mapping.py, tests/frontends/test_no_silent_drops.py)."""
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
from google.protobuf import json_format
from google.protobuf.message import Message

from frontends.grpc.gen.allspark import allspark_service_pb2 as apb
from frontends.grpc.gen.sglang import sglang_scheduler_pb2 as spb
from tests.helpers.shared import GEN

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
    route = "/v1/completions"
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
        r = self.client.post(self.route, json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def run(self, **params: Any) -> list[Out]:
        resp = self.post(self.body(params))
        return [Out(tokens=c["logprobs"]["tokens"], finish=c["finish_reason"], matched=c["stop_reason"],
                    text=c["text"], raw=c) for c in resp["choices"]]


class OpenAIChat(OpenAICompletions):
    name = "chat"
    route = "/v1/chat/completions"

    def prompt_ids(self) -> list[int]:
        text = self.tok.apply_chat_template([{"role": "user", "content": CHAT_TEXT}], tokenize=False,
                                            add_generation_prompt=True)
        return list(self.tok.encode(text, add_special_tokens=False))

    def body(self, params: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": GEN, "messages": [{"role": "user", "content": CHAT_TEXT}], "logprobs": True}
        body.update(_openai_fields(params))
        return body

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
