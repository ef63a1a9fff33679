"""SglangScheduler over a real socket against the real engine (service_semantics.md §2)."""
from __future__ import annotations

import threading

import grpc
import pytest

from frontends.grpc.gen.sglang import sglang_scheduler_pb2 as pb
from frontends.grpc.gen.sglang import sglang_scheduler_pb2_grpc as pb_grpc
from tests.helpers.engines import engine_greedy
from tests.helpers.shared import EMBED, GEN, wait_for

PROMPT = [1, 40, 41, 42, 43, 44, 45, 46]


@pytest.fixture(scope="module")
def stub(grpc_channel):
    return pb_grpc.SglangSchedulerStub(grpc_channel)


def greedy(max_new: int = 6, **kw) -> pb.SamplingParams:
    base = dict(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, n=1, max_new_tokens=max_new,
                ignore_eos=True)
    base.update(kw)
    return pb.SamplingParams(**base)


def gen_request(rid: str, prompt=PROMPT, stream=False, **kw) -> pb.GenerateRequest:
    sp = kw.pop("sampling_params", greedy())
    return pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=prompt),
                              sampling_params=sp, stream=stream, **kw)


# ---------------------------------------------------------------------- Generate
def test_non_stream_greedy_equals_engine(stub, server_loop, serving_engine):
    expected = engine_greedy(server_loop, serving_engine, PROMPT, 6)
    msgs = list(stub.Generate(gen_request("ns-1")))
    assert len(msgs) == 1 and msgs[0].WhichOneof("response") == "complete"
    c = msgs[0].complete
    assert msgs[0].request_id == "ns-1"
    assert list(c.output_ids) == expected
    assert c.finish_reason == "length" and c.completion_tokens == 6 and c.prompt_tokens == len(PROMPT)
    assert c.WhichOneof("matched_stop") is None and c.index == 0


def test_stream_chunks_then_complete(stub, server_loop, serving_engine):
    expected = engine_greedy(server_loop, serving_engine, PROMPT, 6)
    msgs = list(stub.Generate(gen_request("s-1", stream=True)))
    kinds = [m.WhichOneof("response") for m in msgs]
    assert kinds[-1] == "complete" and set(kinds[:-1]) == {"chunk"}
    streamed = [t for m in msgs[:-1] for t in m.chunk.token_ids]
    assert streamed == expected
    assert [m.chunk.completion_tokens for m in msgs[:-1]] == list(range(1, 7))  # cumulative counts
    done = msgs[-1].complete
    assert list(done.output_ids) == list(msgs[-2].chunk.token_ids)  # the final chunk's delta
    assert done.finish_reason == "length" and done.completion_tokens == 6


def test_stream_interval_batches_chunks(stub):
    msgs = list(stub.Generate(gen_request("s-int", stream=True, sampling_params=greedy(7, stream_interval=3))))
    chunks = [list(m.chunk.token_ids) for m in msgs if m.WhichOneof("response") == "chunk"]
    assert [len(c) for c in chunks] == [3, 3, 1]


def test_n2_stream_and_non_stream_carry_both_indices(stub):
    sp = pb.SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, n=2,
                           max_new_tokens=5, ignore_eos=True)
    msgs = list(stub.Generate(gen_request("n2-s", stream=True, sampling_params=sp)))
    completes = [m.complete for m in msgs if m.WhichOneof("response") == "complete"]
    assert sorted(c.index for c in completes) == [0, 1]
    for i in (0, 1):
        toks = [t for m in msgs if m.WhichOneof("response") == "chunk" and m.chunk.index == i for t in m.chunk.token_ids]
        assert len(toks) == 5
    msgs = list(stub.Generate(gen_request("n2-ns", sampling_params=sp)))
    assert [m.complete.index for m in msgs] == [0, 1]
    assert all(len(m.complete.output_ids) == 5 for m in msgs)


def test_absent_sampling_params_means_semantic_defaults(stub):
    req = pb.GenerateRequest(request_id="defaults", tokenized=pb.TokenizedInput(input_ids=PROMPT))
    msgs = list(stub.Generate(req))
    c = msgs[-1].complete
    assert c.completion_tokens >= 1 and c.finish_reason in ("stop", "length")


def test_stop_token_sets_matched_token_id(stub, server_loop, serving_engine):
    expected = engine_greedy(server_loop, serving_engine, PROMPT, 6)
    stop_tok = expected[2]
    first = expected.index(stop_tok)
    msgs = list(stub.Generate(gen_request("stop-1", sampling_params=greedy(6, stop_token_ids=[stop_tok]))))
    c = msgs[-1].complete
    assert c.finish_reason == "stop" and c.matched_token_id == stop_tok
    assert list(c.output_ids) == expected[: first + 1]  # the stop token is included


def test_logprobs_output_input_and_top(stub):
    req = gen_request("lp-1", return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    c = list(stub.Generate(req))[-1].complete
    assert len(c.output_logprobs.token_logprobs) == 6
    assert list(c.output_logprobs.token_ids) == list(c.output_ids)
    assert all(len(t.values) == 2 for t in c.output_logprobs.top_logprobs)
    inp = c.input_logprobs
    assert list(inp.token_ids) == PROMPT
    assert not inp.token_logprobs[0].HasField("value")  # first prompt token has no logprob
    assert all(t.HasField("value") and t.value <= 0 for t in inp.token_logprobs[1:])
    # -1 = no input logprobs; streaming: input logprobs only in the first chunk
    msgs = list(stub.Generate(gen_request("lp-2", stream=True, return_logprob=True, logprob_start_len=-1)))
    assert all(not m.chunk.HasField("input_logprobs") for m in msgs if m.WhichOneof("response") == "chunk")
    assert all(len(m.chunk.output_logprobs.token_logprobs) == len(m.chunk.token_ids)
               for m in msgs if m.WhichOneof("response") == "chunk")
    msgs = list(stub.Generate(gen_request("lp-3", stream=True, return_logprob=True, logprob_start_len=3)))
    chunks = [m.chunk for m in msgs if m.WhichOneof("response") == "chunk"]
    assert list(chunks[0].input_logprobs.token_ids) == PROMPT[3:]
    assert not any(ch.HasField("input_logprobs") for ch in chunks[1:])


@pytest.mark.parametrize("field,value", [
    ("mm_inputs", pb.MultimodalInputs(image_urls=["http://x/y.png"])),
    ("input_embeds", [0.1, 0.2]),
    ("custom_logit_processor", "serialized"),
    ("return_hidden_states", True),
    ("token_ids_logprob", [3, 4]),
    ("disaggregated_params", pb.DisaggregatedParams(bootstrap_host="h", bootstrap_port=1)),
])
def test_unsupported_fields_are_refused_by_name(stub, field, value):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(gen_request(f"bad-{field}", **{field: value})))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()


def test_unknown_lora_id_is_not_found(stub):
    """lora_id names a loaded LoRA adapter (none is loaded here): NOT_FOUND, naming it."""
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(gen_request("bad-lora", lora_id="adapter-1")))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "lora_id 'adapter-1'" in e.value.details()


@pytest.mark.parametrize("constraint,spec", [("regex", "(a"), ("json_schema", "not json"),
                                             ("ebnf_grammar", "root ::= ("), ("structural_tag", "not json")])
def test_constraint_the_engine_cannot_compile_is_invalid_argument(stub, constraint, spec):
    """The constraint reaches the engine (tests/frontends/test_constraints_fronts.py checks the
    mapping); its refusal names the SGLang field."""
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(gen_request("c", sampling_params=greedy(4, **{constraint: spec}))))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(f"sampling_params.{constraint}:"), e.value.details()


@pytest.mark.parametrize("req", [
    pb.GenerateRequest(request_id="no-tok"),
    pb.GenerateRequest(request_id="empty", tokenized=pb.TokenizedInput(input_ids=[])),
    pb.GenerateRequest(request_id="oov", tokenized=pb.TokenizedInput(input_ids=[1, 999999])),
    pb.GenerateRequest(request_id="long", tokenized=pb.TokenizedInput(input_ids=[5] * 300)),
    pb.GenerateRequest(request_id="n", tokenized=pb.TokenizedInput(input_ids=[5]), sampling_params=greedy(2, n=99)),
], ids=["no-tokenized", "empty", "oov", "too-long", "n-too-big"])
def test_bad_requests_are_invalid_argument(stub, req):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_max_new_tokens_clipped_to_context(stub):
    c = list(stub.Generate(gen_request("clip", prompt=[5] * 250, sampling_params=greedy(100))))[-1].complete
    assert c.finish_reason == "length" and c.completion_tokens == 6


def test_cancelled_stream_aborts_and_frees_pages(stub, serving_engine):
    baseline = serving_engine.stats(GEN).pages_used
    before = serving_engine.counters.snapshot()
    call = stub.Generate(gen_request("cancel-1", stream=True, sampling_params=greedy(200)))
    first = next(call)
    assert first.WhichOneof("response") == "chunk"
    assert serving_engine.stats(GEN).pages_used > baseline
    call.cancel()
    assert wait_for(lambda: serving_engine.stats(GEN).pages_used == baseline)
    assert wait_for(lambda: serving_engine.stats(GEN).running_requests == 0)
    after = serving_engine.counters.snapshot()
    assert after["cancelled"] == before["cancelled"] + 1 and after["completed"] == before["completed"]


def test_abort_ends_stream_frees_pages_and_spares_prefix_ids(stub, serving_engine):
    baseline = serving_engine.stats(GEN).pages_used
    long = greedy(200)
    victim = stub.Generate(gen_request("req-1", stream=True, sampling_params=long))
    bystander = stub.Generate(gen_request("req-12", stream=True, sampling_params=greedy(30)))
    next(victim), next(bystander)
    resp = stub.Abort(pb.AbortRequest(request_id="req-1", reason="test"))
    assert resp.success and "req-1" in resp.message
    rest = list(victim)
    assert rest[-1].complete.finish_reason == "abort"
    other = list(bystander)[-1].complete
    assert other.finish_reason == "length"  # same prefix, different id: untouched
    assert wait_for(lambda: serving_engine.stats(GEN).pages_used == baseline)
    assert stub.Abort(pb.AbortRequest(request_id="never-existed")).success


def test_abort_n2_request_aborts_children(stub, serving_engine):
    sp = pb.SamplingParams(temperature=1.0, top_p=1.0, n=2, max_new_tokens=200, ignore_eos=True)
    call = stub.Generate(gen_request("nabort", stream=True, sampling_params=sp))
    next(call)
    assert stub.Abort(pb.AbortRequest(request_id="nabort")).success
    completes = [m.complete for m in call if m.WhichOneof("response") == "complete"]
    assert sorted(c.index for c in completes) == [0, 1] and {c.finish_reason for c in completes} == {"abort"}
    assert wait_for(lambda: serving_engine.stats(GEN).pages_used == 0)


# ---------------------------------------------------------------------- Embed
def test_embed_seed_layout(stub, serving_engine):
    tok = serving_engine.tokenizer(EMBED)
    ids = tok("a man is eating food")["input_ids"]
    resp = stub.Embed(pb.EmbedRequest(request_id="e1", tokenized=pb.TokenizedInput(input_ids=ids)))
    assert resp.request_id == "e1" and resp.WhichOneof("response") == "complete"
    c = resp.complete
    assert c.embedding_dim == 384 == len(c.embedding) and c.prompt_tokens == len(ids)
    assert abs(sum(v * v for v in c.embedding) - 1.0) < 1e-3


def test_embed_errors(stub):
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(pb.EmbedRequest(request_id="e2"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(pb.EmbedRequest(request_id="e4", is_cross_encoder=True, texts=["odd"]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_cross_encoder_scores(stub, serving_engine, server_loop, tmp_path):
    """texts = (query, document) pairs scored by a served classification model."""
    from jax_engine.config import ModelSpec
    from jax_engine.types import EmbedRequest
    from tests.helpers.encoders import build_bert_cross_encoder

    pairs = ["a man is eating", "a man eats food", "the quick fox", "the lazy dog"]
    with pytest.raises(grpc.RpcError) as e:  # no cross-encoder is served yet
        stub.Embed(pb.EmbedRequest(request_id="ce0", is_cross_encoder=True, texts=pairs))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cross-encoder" in e.value.details()
    build_bert_cross_encoder(str(tmp_path), num_labels=3)
    serving_engine.load_model_sync(ModelSpec(name="ce", path=str(tmp_path), max_model_len=32), progress=False)
    try:
        serving_engine.start_model_sync("ce")
        resp = stub.Embed(pb.EmbedRequest(request_id="ce1", is_cross_encoder=True, texts=pairs))
        c = resp.complete
        assert c.embedding_dim == 3 and [b.index for b in c.batch_embeddings] == [0, 1]
        ref = server_loop.run(serving_engine.embed(EmbedRequest(
            request_id="ce-ref", pairs=[(pairs[0], pairs[1]), (pairs[2], pairs[3])], model="ce")))
        for got, want in zip(c.batch_embeddings, ref.scores):
            assert list(got.values) == pytest.approx(list(want), abs=1e-6)
        assert list(c.embedding) == pytest.approx(list(ref.scores[0]), abs=1e-6)
    finally:
        serving_engine.release_model_sync("ce")


# ---------------------------------------------------------------------- management
def test_health_check(stub):
    resp = stub.HealthCheck(pb.HealthCheckRequest(), timeout=2)
    assert resp.healthy and resp.message


def test_get_model_info(stub, demo_generator_path, serving_engine):
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    mi = serving_engine.model_info(GEN)
    assert info.served_model_name == GEN and info.is_generation
    assert info.model_path == mi.path and info.tokenizer_path == mi.tokenizer_path
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(info.tokenizer_path)  # resolves locally, as the router needs
    assert list(info.eos_token_ids) == mi.eos_token_ids and info.vocab_size == 512
    assert info.max_context_length == 256 and info.max_req_input_len == 255
    assert info.model_type == "llama" and list(info.architectures) == ["LlamaForCausalLM"]
    assert info.weight_version and info.num_labels == 0 and info.id2label_json == ""
    assert info.bos_token_id == mi.bos_token_id and info.pad_token_id == mi.pad_token_id


def test_get_server_info(stub):
    info = stub.GetServerInfo(pb.GetServerInfoRequest())
    assert info.server_type == "grpc" and info.uptime_seconds > 0 and info.start_time.seconds > 0
    assert info.server_args["max_running_requests"] == 8 and info.server_args["tp_size"] == 1
    assert info.scheduler_info["max_total_num_tokens"] == 127 * 16
    assert info.sglang_version


def test_get_loads_sections_and_dp_rank(stub):
    resp = stub.GetLoads(pb.GetLoadsRequest())
    assert resp.dp_rank_count == 1 and len(resp.loads) == 1 and resp.timestamp
    load = resp.loads[0]
    assert load.max_total_num_tokens == 127 * 16 and load.max_running_requests == 8
    assert load.HasField("memory") and load.HasField("queues") and load.HasField("disaggregation")
    assert resp.aggregate.total_reqs == load.num_total_reqs
    core = stub.GetLoads(pb.GetLoadsRequest(include=["core"])).loads[0]
    assert not core.HasField("memory") and not core.HasField("queues")
    assert stub.GetLoads(pb.GetLoadsRequest(dp_rank=0)).dp_rank_count == 1
    assert stub.GetLoads(pb.GetLoadsRequest(dp_rank=3)).dp_rank_count == 0
    with pytest.raises(grpc.RpcError) as e:
        stub.GetLoads(pb.GetLoadsRequest(include=["core", "bogus"]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bogus" in e.value.details()


def test_health_check_not_healthy_while_draining(stub, serving_engine, monkeypatch):
    monkeypatch.setattr(serving_engine, "_draining", True)
    resp = stub.HealthCheck(pb.HealthCheckRequest(), timeout=2)
    assert not resp.healthy and "shutting down" in resp.message
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(gen_request("drain")))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_concurrent_generates_are_independent(stub):
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = list(list(stub.Generate(gen_request(f"par-{i}")))[-1].complete.output_ids)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len({tuple(v) for v in results.values()}) == 1 and len(results) == 6
