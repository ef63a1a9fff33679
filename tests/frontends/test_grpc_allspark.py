"""allspark.allspark_service.AllSpark over a real socket (service_semantics.md §3)."""
from __future__ import annotations

import json
import os
import re
import threading
import time

import numpy as np
import pytest

from frontends.grpc.gen.allspark import allspark_service_pb2 as pb
from frontends.grpc.gen.allspark import allspark_service_pb2_grpc as pb_grpc
from tests.helpers.engines import engine_greedy
from tests.helpers.shared import EMBED, GEN, start_grpc_server, stop_grpc_server, wait_for

PROMPT = [1, 60, 61, 62, 63, 64]
TERMINAL = (pb.GenerateFinished, pb.GenerateInterrupted)


@pytest.fixture(scope="module")
def stub(grpc_channel):
    return pb_grpc.AllSparkStub(grpc_channel)


def ids_tensor(ids, dtype=pb.INT64, shape=None, data=None) -> pb.TensorMap:
    arr = np.asarray(ids, dtype="<i8")
    t = pb.Tensor(name="tensor", shape=pb.Tensor.Shape(dims=shape if shape is not None else [1, len(ids)]),
                  device_type=pb.DeviceType(dev_type=pb.CPU), data_type=dtype, data_mode=pb.DENSE,
                  data=arr.tobytes() if data is None else data)
    return pb.TensorMap(tensor_map={"input_ids": t})


def config(uuid: str = "", new_tokens: int = 6, prompt=PROMPT, **kw) -> pb.GenerateConfig:
    """What the C++ client sends: every field explicit (greedy, no EOS stop unless asked)."""
    base = dict(do_sample=False, early_stopping=False, num_beams=1, num_return_sequences=1, temperature=1.0,
                top_k=50, top_p=1.0, repetition_penalty=1.0, length_penalty=1.0,
                max_length=len(prompt) + new_tokens, eos_token_id=2, seed=7, uuid=uuid)
    base.update(kw)
    return pb.GenerateConfig(**base)


def start(stub, uuid: str, prompt=PROMPT, model=GEN, **kw) -> pb.StartRequestResponse:
    inputs = kw.pop("inputs", None) or ids_tensor(prompt)
    return stub.StartRequest(pb.StartRequestRequest(model_name=model, inputs=inputs,
                                                    config=config(uuid, prompt=prompt, **kw)))


def drain(stub, uuid: str, timeout: float = 30.0) -> list[int]:
    """The C++ example's loop: GenerateStatus + Get until terminal and nothing left."""
    out: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = stub.GenerateStatus(pb.UUID(uuid=uuid)).status
        if status in TERMINAL:
            return out
        got = stub.Get(pb.UUID(uuid=uuid))
        assert got.empty == 0 and got.HasField("tensors_from_model_inference")
        assert got.ids_from_generate, "Get returned no ids while the status is not terminal"
        out += list(got.ids_from_generate)
    raise AssertionError("request did not finish")


def release(stub, uuid: str) -> None:
    resp = stub.ReleaseRequest(pb.StopRequestRequest(model_name=GEN, uuid=uuid))
    assert resp.as_status == pb.ALLSPARK_SUCCESS and resp.uuid == uuid


# ---------------------------------------------------------------------- generation
def test_greedy_request_life_cycle(stub, server_loop, serving_engine):
    expected = engine_greedy(server_loop, serving_engine, PROMPT, 6)
    resp = start(stub, "as-1")
    assert resp.as_status == pb.ALLSPARK_SUCCESS and resp.uuid == "as-1"
    assert drain(stub, "as-1") == expected
    assert stub.GeneratedLength(pb.UUID(uuid="as-1")).len == 6
    assert stub.GenerateStatus(pb.UUID(uuid="as-1")).status == pb.GenerateFinished
    tail = stub.Get(pb.UUID(uuid="as-1"))  # terminal and drained: an empty element, no blocking
    assert tail.empty == 0 and not tail.ids_from_generate
    assert stub.StopRequest(pb.StopRequestRequest(model_name=GEN, uuid="as-1")).as_status == pb.ALLSPARK_SUCCESS
    release(stub, "as-1")
    assert stub.GenerateStatus(pb.UUID(uuid="as-1")).status == pb.Init  # unknown again
    assert stub.GeneratedLength(pb.UUID(uuid="as-1")).len == 0


def test_sync_then_get_no_wait(stub, server_loop, serving_engine):
    expected = engine_greedy(server_loop, serving_engine, PROMPT, 6)
    assert start(stub, "as-sync").as_status == pb.ALLSPARK_SUCCESS
    resp = stub.SyncRequest(pb.StopRequestRequest(model_name=GEN, uuid="as-sync"))
    assert resp.as_status == pb.ALLSPARK_SUCCESS and resp.uuid == "as-sync"
    assert stub.GenerateStatus(pb.UUID(uuid="as-sync")).status == pb.Generating  # tokens not fetched yet
    got = stub.GetNoWait(pb.UUID(uuid="as-sync"))
    assert list(got.ids_from_generate) == expected
    assert stub.GenerateStatus(pb.UUID(uuid="as-sync")).status == pb.GenerateFinished
    assert not stub.GetNoWait(pb.UUID(uuid="as-sync")).ids_from_generate
    release(stub, "as-sync")


def test_empty_uuid_gets_one_made_and_sync_all(stub):
    resp = start(stub, "")
    assert resp.as_status == pb.ALLSPARK_SUCCESS and resp.uuid
    assert stub.SyncRequest(pb.StopRequestRequest(model_name=GEN, uuid="")).as_status == pb.ALLSPARK_SUCCESS
    assert stub.GenerateStatus(pb.UUID(uuid=resp.uuid)).status == pb.Generating
    assert len(stub.GetNoWait(pb.UUID(uuid=resp.uuid)).ids_from_generate) == 6
    release(stub, resp.uuid)


def test_lengths_are_totals_and_stop_words(stub, server_loop, serving_engine):
    expected = engine_greedy(server_loop, serving_engine, PROMPT, 12)
    assert start(stub, "as-len", new_tokens=3).as_status == pb.ALLSPARK_SUCCESS
    assert drain(stub, "as-len") == expected[:3]
    release(stub, "as-len")
    # a single-token stop word (kept in the output), found where greedy decoding produces it
    k = 4
    single = pb.StopWordIds(ids=[pb.StopWordIds.Array(word=[expected[k]])])
    assert start(stub, "as-sw1", new_tokens=12, stop_words_ids=single).as_status == pb.ALLSPARK_SUCCESS
    assert drain(stub, "as-sw1") == expected[: expected.index(expected[k]) + 1]
    release(stub, "as-sw1")
    # a multi-token stop word
    multi = pb.StopWordIds(ids=[pb.StopWordIds.Array(word=expected[5:7])])
    assert start(stub, "as-sw2", new_tokens=12, stop_words_ids=multi).as_status == pb.ALLSPARK_SUCCESS
    got = drain(stub, "as-sw2")
    assert got[-2:] == expected[5:7] and len(got) <= 7
    assert stub.GenerateStatus(pb.UUID(uuid="as-sw2")).status == pb.GenerateFinished
    release(stub, "as-sw2")
    assert wait_for(lambda: serving_engine.stats(GEN).pages_used == 0)


def test_eos_token_id_stops_when_early_stopping(stub, server_loop, serving_engine):
    expected = engine_greedy(server_loop, serving_engine, PROMPT, 8)
    eos = expected[3]
    assert start(stub, "as-eos", new_tokens=8, early_stopping=True, eos_token_id=eos).as_status == pb.ALLSPARK_SUCCESS
    assert drain(stub, "as-eos") == expected[: expected.index(eos) + 1]
    release(stub, "as-eos")
    # min_length (a total) bans the EOS until that many tokens exist
    eos = expected[0]
    assert start(stub, "as-min", new_tokens=8, early_stopping=True, eos_token_id=eos,
                 min_length=len(PROMPT) + 3).as_status == pb.ALLSPARK_SUCCESS
    got = drain(stub, "as-min")
    assert len(got) >= 3 and eos not in got[:2]
    release(stub, "as-min")


def test_stop_request_finishes_and_frees_pages(stub, serving_engine):
    assert start(stub, "as-stop", new_tokens=200).as_status == pb.ALLSPARK_SUCCESS
    first = stub.Get(pb.UUID(uuid="as-stop"))
    assert first.ids_from_generate
    resp = stub.StopRequest(pb.StopRequestRequest(model_name=GEN, uuid="as-stop"))
    assert resp.as_status == pb.ALLSPARK_SUCCESS and resp.uuid == "as-stop"
    assert wait_for(lambda: serving_engine.stats(GEN).pages_used == 0)
    stub.GetNoWait(pb.UUID(uuid="as-stop"))
    assert stub.GenerateStatus(pb.UUID(uuid="as-stop")).status == pb.GenerateFinished
    assert stub.GeneratedLength(pb.UUID(uuid="as-stop")).len < 200
    release(stub, "as-stop")


def test_release_while_running_aborts(stub, serving_engine):
    assert start(stub, "as-rel", new_tokens=200).as_status == pb.ALLSPARK_SUCCESS
    stub.Get(pb.UUID(uuid="as-rel"))
    release(stub, "as-rel")
    assert wait_for(lambda: serving_engine.stats(GEN).pages_used == 0)


def test_unknown_uuid_defaults(stub):
    u = pb.UUID(uuid="nope")
    assert stub.GenerateStatus(u).status == pb.Init
    assert stub.GeneratedLength(u).len == 0
    got = stub.Get(u, timeout=5)  # does not block
    assert got.empty == 0 and not got.ids_from_generate
    for call in (stub.StopRequest, stub.ReleaseRequest, stub.SyncRequest):
        resp = call(pb.StopRequestRequest(model_name=GEN, uuid="nope"))
        assert resp.as_status == pb.ALLSPARK_ILLEGAL_REQUEST_ID and resp.uuid == "nope"


def test_concurrent_get_loops_and_control_calls_progress(stub):
    n = 16
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def loop(i: int) -> None:
        try:
            uid = f"as-par-{i}"
            assert start(stub, uid, new_tokens=12).as_status == pb.ALLSPARK_SUCCESS
            results[i] = drain(stub, uid, timeout=60)
            release(stub, uid)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    # progress, not a wall-clock bound (a loaded host stretches every call): control calls must
    # complete while the Get loops are still running, not queue behind them
    worst, during = 0.0, 0
    while any(t.is_alive() for t in threads):
        t0 = time.monotonic()
        stub.GetAsEngineStat(pb.ModelName(model_name=GEN))
        stub.GetVersionFull(pb.Empty())
        worst = max(worst, time.monotonic() - t0)
        during += any(t.is_alive() for t in threads)
        time.sleep(0.02)
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == n and all(len(v) == 12 for v in results.values())
    assert len({tuple(v) for v in results.values()}) == 1  # same prompt, greedy
    assert during >= 1, f"control calls starved: {during} completed while the loops ran (slowest {worst:.2f}s)"


@pytest.mark.parametrize("kw,status", [
    (dict(model="no-such-model"), pb.ALLSPARK_PARAM_ERROR),
    (dict(model=EMBED), pb.ALLSPARK_INVALID_CALL_ERROR),
    (dict(inputs=ids_tensor(PROMPT, dtype=pb.INT32)), pb.ALLSPARK_PARAM_ERROR),
    (dict(inputs=ids_tensor(PROMPT, shape=[len(PROMPT)])), pb.ALLSPARK_PARAM_ERROR),
    (dict(inputs=ids_tensor(PROMPT, shape=[2, 3])), pb.ALLSPARK_PARAM_ERROR),
    (dict(inputs=ids_tensor(PROMPT, data=b"\x01" * 13)), pb.ALLSPARK_PARAM_ERROR),
    (dict(inputs=pb.TensorMap()), pb.ALLSPARK_PARAM_ERROR),
    (dict(inputs=ids_tensor([1, 10 ** 6])), pb.ALLSPARK_PARAM_ERROR),
    (dict(inputs=ids_tensor([])), pb.ALLSPARK_EXCEED_LIMIT_ERROR),
    (dict(max_length=10_000), pb.ALLSPARK_EXCEED_LIMIT_ERROR),
    (dict(max_length=3), pb.ALLSPARK_PARAM_ERROR),
    (dict(num_beams=2), pb.ALLSPARK_PARAM_ERROR),
    (dict(num_return_sequences=2), pb.ALLSPARK_PARAM_ERROR),
    (dict(no_repeat_ngram_size=3), pb.ALLSPARK_PARAM_ERROR),
    (dict(bad_words_ids=pb.BadWordIds(ids=[pb.BadWordIds.Array(word=[5])])), pb.ALLSPARK_PARAM_ERROR),
    (dict(response_format={"type": "xml"}), pb.ALLSPARK_PARAM_ERROR),
    (dict(lora_name="adapter"), 13),   # ALLSPARK_LORA_NOT_LOADED (not in the proto enum: a raw number)
    (dict(top_p=1.5), pb.ALLSPARK_PARAM_ERROR),
], ids=["unknown-model", "embedding-model", "int32", "1d", "batch2", "bytes", "no-input_ids", "oov", "empty",
        "max_length-over-limit", "max_length-under-prompt", "beams", "num_return_sequences", "ngram",
        "bad_words", "response_format", "lora", "top_p"])
def test_start_request_refusals_in_band(stub, kw, status, serving_engine):
    resp = start(stub, "as-bad", **kw)
    assert resp.as_status == status and resp.uuid == "as-bad"
    assert stub.GenerateStatus(pb.UUID(uuid="as-bad")).status == pb.Init  # not registered


def test_duplicate_uuid_refused(stub):
    assert start(stub, "as-dup", new_tokens=3).as_status == pb.ALLSPARK_SUCCESS
    assert start(stub, "as-dup", new_tokens=3).as_status == pb.ALLSPARK_PARAM_ERROR
    drain(stub, "as-dup")
    release(stub, "as-dup")


# ---------------------------------------------------------------------- information
def test_engine_stat_from_page_pool(stub):
    s = stub.GetAsEngineStat(pb.ModelName(model_name=GEN))
    assert s.model_name == GEN and s.span_size == 16 and s.total_span == 127
    assert s.used_span + s.free_span == s.total_span and s.free_token == s.free_span * 16
    assert s.total_generated_token > 0 and s.total_prefill_token > 0
    assert stub.GetAsEngineStat(pb.ModelName(model_name="nope")).total_span == 0


def test_version_rank_and_model_information(stub):
    v = stub.GetVersionFull(pb.Empty()).version_info
    assert re.fullmatch(r"\d+\.\d+\.\d+/\(GitSha1:[^)]+\)", v), v
    assert stub.GetRankId(pb.Empty()).rank_id == 0
    assert stub.GetRankNums(pb.Empty()).rank_id == 1
    info = json.loads(stub.GetModelInformation(pb.ModelName(model_name=GEN)).model_info)
    assert info["name"] == GEN and info["task"] == "generate"
    assert stub.GetModelInformation(pb.ModelName(model_name="nope")).model_info == ""
    assert stub.GetOpProfilingInfo(pb.ModelName(model_name=GEN)).op_profiling_info == ""


def test_file_information_never_crashes(stub, model_root, minilm_path):
    folder = os.path.join(model_root, "versioned")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"transformers_version": "4.99.0"}, f)
    good = stub.GetFileInformation(pb.FileInformationRequest(model_path=folder, param_path=folder))
    assert good.create_version_graph == good.create_version_param == "4.99.0"
    assert re.fullmatch(r"\d+\.\d+\.\d+", good.current_version_engine)
    for path in ("/definitely/not/here", "", "\x00bad", minilm_path, os.path.join(model_root, "..", "..")):
        resp = stub.GetFileInformation(pb.FileInformationRequest(model_path=path))
        assert resp.create_version_graph == "" and resp.current_version_engine


# ---------------------------------------------------------------------- model life cycle
def build_config(name: str, path: str, **kw) -> pb.ModelStructConfig:
    base = dict(model_name=name, model_path=path, compute_unit="CPU:0", matmul_precision="highest",
                engine_max_length=256, engine_max_batch=8, cache_span_size=16, enable_prefix_cache=True,
                swap_threshold=-1)
    base.update(kw)
    return pb.ModelStructConfig(**base)


def test_model_life_cycle(stub, demo_generator_path, model_root, serving_engine):
    assert stub.BuildModelFromConfigStruct(build_config("gen2", demo_generator_path)).as_status == pb.ALLSPARK_SUCCESS
    try:
        assert start(stub, "as-gen2", model="gen2").as_status == pb.ALLSPARK_REQUEST_DENIED  # not started
        assert stub.StartModel(pb.ModelName(model_name="gen2")).as_status == pb.ALLSPARK_SUCCESS
        assert start(stub, "as-gen2", model="gen2").as_status == pb.ALLSPARK_SUCCESS
        assert len(drain(stub, "as-gen2")) == 6
        release(stub, "as-gen2")
        assert stub.GetAsEngineStat(pb.ModelName(model_name="gen2")).span_size == 16
        assert stub.ReloadModelToDeviceMemory(pb.ModelName(model_name="gen2")).as_status == pb.ALLSPARK_SUCCESS
        assert stub.UnloadModelFromDeviceMemory(pb.ModelName(model_name="gen2")).as_status == pb.ALLSPARK_SUCCESS
        assert stub.StopModel(pb.ModelName(model_name="gen2")).as_status == pb.ALLSPARK_SUCCESS
        assert start(stub, "as-gen2b", model="gen2").as_status == pb.ALLSPARK_REQUEST_DENIED
    finally:
        assert stub.ReleaseModel(pb.ModelName(model_name="gen2")).as_status == pb.ALLSPARK_SUCCESS
    assert start(stub, "as-gen2c", model="gen2").as_status == pb.ALLSPARK_PARAM_ERROR
    assert "gen2" not in [m.name for m in serving_engine.models()]


@pytest.mark.parametrize("kw,status", [
    (dict(model_path="/etc"), pb.ALLSPARK_INVALID_CALL_ERROR),  # outside --model-root
    (dict(model_path="MISSING"), pb.ALLSPARK_IO_ERROR),
    (dict(matmul_precision="lowest"), pb.ALLSPARK_PARAM_ERROR),
    (dict(model_name=""), pb.ALLSPARK_PARAM_ERROR),
    (dict(model_name=GEN), pb.ALLSPARK_PARAM_ERROR),  # already served
    (dict(lora_names=pb.LoraNames(names=["a"])), pb.ALLSPARK_PARAM_ERROR),  # LoRA is not enabled here
    (dict(is_lora_cfg=True), pb.ALLSPARK_PARAM_ERROR),
], ids=["outside-root", "missing", "precision", "no-name", "duplicate", "lora", "is_lora_cfg"])
def test_build_refusals(stub, demo_generator_path, model_root, kw, status):
    if kw.get("model_path") == "MISSING":
        kw = dict(kw, model_path=os.path.join(model_root, "missing"))
    cfg = build_config("gen3", demo_generator_path, **kw)
    assert stub.BuildModelFromConfigStruct(cfg).as_status == status


def test_shutdown_service_runs_hook(server_loop, serving_engine):
    import grpc

    called = threading.Event()
    srv = start_grpc_server(server_loop, serving_engine, enable_admin=True, on_shutdown=called.set)
    try:
        with grpc.insecure_channel(srv.target) as ch:
            resp = pb_grpc.AllSparkStub(ch).ShutdownService(pb.Empty())
        assert resp.as_status == pb.ALLSPARK_SUCCESS
        assert called.wait(5)
    finally:
        stop_grpc_server(server_loop, srv)
