"""arctic_inference.InferenceService over a real socket (service_semantics.md §1)."""
from __future__ import annotations

import numpy as np
import pytest

from frontends.grpc.gen.arctic_inference import inference_pb2 as pb
from frontends.grpc.gen.arctic_inference import inference_pb2_grpc as pb_grpc
from tests.helpers.shared import EMBED

TEXTS = ["A man is eating food.", "The weather is nice today.", "serving models with jax and xla"]


@pytest.fixture(scope="module")
def stub(grpc_channel):
    return pb_grpc.InferenceServiceStub(grpc_channel)


def vectors(resp: pb.EncodeResponse) -> np.ndarray:
    assert resp.error == ""
    assert all(len(b) == 4 * resp.embedding_dim for b in resp.embedding_bytes_fp32)
    return np.stack([np.frombuffer(b, dtype="<f4") for b in resp.embedding_bytes_fp32])


def test_encode_prompts_matches_sentence_transformers(stub, minilm_path):
    resp = stub.Encode(pb.EncodeRequest(request_id="enc-1", n_prompts=3, prompts=TEXTS, model_name=EMBED))
    assert resp.request_id == "enc-1" and resp.n_prompts == 3 and resp.embedding_dim == 384
    got = vectors(resp)
    from sentence_transformers import SentenceTransformer

    ref = SentenceTransformer(minilm_path, device="cpu").encode(TEXTS, normalize_embeddings=False)
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.9999, cos


def test_encode_token_ids_equal_prompts_and_win(stub, serving_engine):
    tok = serving_engine.tokenizer(EMBED)
    ids = [np.asarray(tok(t)["input_ids"], dtype="<i4").tobytes() for t in TEXTS[:2]]
    by_ids = stub.Encode(pb.EncodeRequest(n_prompts=2, token_id_bytes_i32=ids, prompts=["ignored"], model_name=EMBED))
    by_text = stub.Encode(pb.EncodeRequest(n_prompts=2, prompts=TEXTS[:2], model_name=EMBED))
    assert by_ids.request_id  # generated when empty
    np.testing.assert_allclose(vectors(by_ids), vectors(by_text), atol=1e-5)


def test_empty_model_name_is_default_and_priority_accepted(stub):
    resp = stub.Encode(pb.EncodeRequest(n_prompts=1, prompts=["hello"], priority=5))
    assert vectors(resp).shape == (1, 384)


@pytest.mark.parametrize("req,needle", [
    (pb.EncodeRequest(request_id="r", n_prompts=2, prompts=["one"], model_name=EMBED), "Expected 2 prompts, got 1"),
    (pb.EncodeRequest(request_id="r", n_prompts=1, token_id_bytes_i32=[b"\x01\x00\x00"], model_name=EMBED),
     "multiple of 4"),
    (pb.EncodeRequest(request_id="r", n_prompts=2, token_id_bytes_i32=[b"\x01\x00\x00\x00"], model_name=EMBED),
     "Expected 2 prompts, got 1"),
    (pb.EncodeRequest(request_id="r", n_prompts=1, token_id_bytes_i32=[np.array([101, 10 ** 6], "<i4").tobytes()],
                      model_name=EMBED), "vocabulary"),
    (pb.EncodeRequest(request_id="r", n_prompts=1, prompts=["x"], model_name="gen"), "Expected model name minilm"),
    (pb.EncodeRequest(request_id="r", n_prompts=1, prompts=["x"], model_name="nope"), "got nope"),
    (pb.EncodeRequest(request_id="r", n_prompts=1, prompts=[""], model_name=EMBED), "empty"),
], ids=["count", "bytes", "ids-count", "oov", "generator-name", "unknown-name", "empty-text"])
def test_validation_errors_in_band_with_status_ok(stub, req, needle):
    resp = stub.Encode(req)  # raises on a non-OK status
    assert needle in resp.error and resp.request_id == "r"
    assert resp.n_prompts == 0 and not resp.embedding_bytes_fp32


def test_zero_prompts_is_an_empty_success(stub):
    resp = stub.Encode(pb.EncodeRequest(request_id="z", n_prompts=0, model_name=EMBED))
    assert resp.error == "" and resp.n_prompts == 0 and not resp.embedding_bytes_fp32


def test_abort_answers_success(stub):
    resp = stub.Abort(pb.AbortRequest(request_id="whatever"))
    assert resp.success and "whatever" in resp.message


def test_replica_info_one_entry_per_replica(stub):
    resp = stub.GetReplicaInfo(pb.ReplicaInfoRequest())
    assert resp.n_replicas == len(resp.replica_infos) == 1 and resp.n_healthy_replicas == 1
    info = resp.replica_infos[0]
    assert info.model_name == EMBED and info.task == "embed" and info.ready and info.dtype


def test_health_check(stub, serving_engine, monkeypatch):
    assert stub.HealthCheck(pb.HealthCheckRequest()).healthy
    monkeypatch.setattr(serving_engine, "_draining", True)
    resp = stub.HealthCheck(pb.HealthCheckRequest())
    assert not resp.healthy and "draining" in resp.message
    refused = stub.Encode(pb.EncodeRequest(request_id="d", n_prompts=1, prompts=["x"], model_name=EMBED))
    assert "draining" in refused.error
