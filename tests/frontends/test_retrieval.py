"""Retrieval and tokenizer routes of the HTTP front (issue 21): TEI's `/rerank`, vLLM's
`/v1/rerank` and `/v1/score` over tiny BERT cross-encoders, Matryoshka `dimensions` on
/v1/embeddings, and vLLM's `/tokenize` / `/detokenize`.

The cross-encoders and Matryoshka encoders are loaded into the shared serving engine for this
module only (released at its end), and served by the shared HTTP app over a real socket.
References: sentence-transformers' `CrossEncoder.predict` on the same folder, and the models'
own HF tokenizers.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from tests.helpers.encoders import build_bert_cross_encoder, build_xlmr_encoder
from tests.helpers.shared import EMBED, GEN

CE = "ce1"          # one-label cross-encoder (a reranker)
CE3 = "ce3"         # three-label classifier: not a reranker
MRL = "mrl"         # encoder declaring matryoshka_dimensions [8, 16], L2-normalised
MRL_ANY = "mrl-any"  # encoder declaring only is_matryoshka: true, not normalised

QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the quick brown fox", "a river bank with money",
        "the capital city of france is paris", "night and day", "the lazy dog sleeps"]


def _matryoshka_encoder(path: str, config_extra: dict, normalize: bool) -> None:
    build_xlmr_encoder(path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(config_extra)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    if normalize:
        with open(os.path.join(path, "modules.json")) as f:
            modules = json.load(f)
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        with open(os.path.join(path, "modules.json"), "w") as f:
            json.dump(modules, f)


@pytest.fixture(scope="module")
def models(serving_engine, tmp_path_factory):
    """{name: folder} of the models this module adds to the serving engine (released at the end)."""
    from jax_engine.config import ModelSpec

    root = tmp_path_factory.mktemp("retrieval")
    paths = {name: str(root / name) for name in (CE, CE3, MRL, MRL_ANY)}
    build_bert_cross_encoder(paths[CE], num_labels=1)
    build_bert_cross_encoder(paths[CE3], num_labels=3)
    _matryoshka_encoder(paths[MRL], {"matryoshka_dimensions": [16, 8, 16]}, normalize=True)
    _matryoshka_encoder(paths[MRL_ANY], {"is_matryoshka": True}, normalize=False)
    loaded = []
    try:
        for name, path in paths.items():  # CE first: the default cross-encoder
            serving_engine.load_model_sync(ModelSpec(name=name, path=path), progress=False)
            loaded.append(name)
            serving_engine.start_model_sync(name)
        yield paths
    finally:
        for name in loaded:
            serving_engine.release_model_sync(name)


@pytest.fixture(scope="module")
def cross_encoder(models):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(models[CE], device="cpu")


def _predict(ce, pairs, raw: bool = False) -> np.ndarray:
    import torch

    kwargs = {"activation_fn": torch.nn.Identity()} if raw else {}
    return np.asarray(ce.predict(pairs, batch_size=len(pairs), **kwargs), dtype=np.float64).reshape(-1)


# ============================================================================ TEI /rerank


def test_tei_rerank_matches_cross_encoder(client, models, cross_encoder):
    r = client.post("/rerank", json={"query": QUERY, "texts": DOCS})
    assert r.status_code == 200, r.text
    ranks = r.json()
    assert isinstance(ranks, list) and sorted(x["index"] for x in ranks) == list(range(len(DOCS)))
    assert all(set(x) == {"index", "score"} for x in ranks)           # no text unless return_text
    scores = [x["score"] for x in ranks]
    assert scores == sorted(scores, reverse=True)
    want = _predict(cross_encoder, [(QUERY, d) for d in DOCS])      # sigmoid: num_labels 1 default
    for x in ranks:
        assert x["score"] == pytest.approx(want[x["index"]], abs=1e-4)
    assert [x["index"] for x in ranks] == sorted(range(len(DOCS)), key=lambda i: -want[i])


def test_tei_rerank_raw_scores_and_return_text(client, models, cross_encoder):
    body = {"query": QUERY, "texts": DOCS, "raw_scores": True, "return_text": True}
    ranks = client.post("/rerank", json=body).json()
    logits = _predict(cross_encoder, [(QUERY, d) for d in DOCS], raw=True)
    for x in ranks:
        assert x["text"] == DOCS[x["index"]]
        assert x["score"] == pytest.approx(logits[x["index"]], abs=1e-4)
    assert [x["score"] for x in ranks] == sorted((x["score"] for x in ranks), reverse=True)
    probs = {x["index"]: x["score"] for x in client.post("/rerank", json={"query": QUERY, "texts": DOCS}).json()}
    for x in ranks:  # really the logits: their sigmoid is the default score
        assert 1 / (1 + math.exp(-x["score"])) == pytest.approx(probs[x["index"]], abs=1e-6) != x["score"]


def test_tei_client_shape_is_accepted(client, models, cross_encoder):
    """Every field TEI's RerankRequest has, as TEI clients send them (both spellings of the direction)."""
    for direction in ("Right", "right"):
        body = {"query": QUERY, "texts": DOCS[:3], "truncate": False, "truncation_direction": direction,
                "raw_scores": False, "return_text": False}
        r = client.post("/rerank", json=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 200, r.text
        assert [set(x) for x in r.json()] == [{"index", "score"}] * 3
    assert client.post("/rerank", json={"query": QUERY, "texts": DOCS[:2], "truncate": None}).status_code == 200


def test_tei_rerank_truncation(client, models, cross_encoder):
    long = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)  # > 64 tokens with the query
    texts = ["paris", long]
    r = client.post("/rerank", json={"query": QUERY, "texts": texts})  # truncate defaults to false, as TEI
    assert r.status_code == 400
    err = r.json()
    assert err["error_type"] == "Validation" and err["error"].startswith("texts[1] has ") and "truncate" in err["error"]
    r = client.post("/rerank", json={"query": QUERY, "texts": texts, "truncate": True})
    assert r.status_code == 200, r.text
    want = cross_encoder.predict([(QUERY, t) for t in texts])  # CrossEncoder truncates (longest first) too
    for x in r.json():
        assert x["score"] == pytest.approx(float(want[x["index"]]), abs=1e-4)
    r = client.post("/rerank", json={"query": QUERY, "texts": texts, "truncate": True, "truncation_direction": "Left"})
    assert r.status_code == 400 and "truncation_direction" in r.json()["error"]


@pytest.mark.parametrize("body, status, kind, needle", [
    ({"query": QUERY, "texts": []}, 400, "Empty", "`texts` cannot be empty"),
    ({"query": QUERY, "texts": ["a"], "top_n": 1}, 400, "Validation", "'top_n'"),
    ({"query": QUERY}, 400, "Validation", "texts is required"),
    ({"query": "", "texts": ["a"]}, 400, "Validation", "query is an empty string"),
    ({"query": QUERY, "texts": ["a", ""]}, 400, "Validation", "texts[1]"),
    ({"query": QUERY, "texts": ["a"], "model": CE3}, 400, "Validation", "'ce3' has 3 labels"),
    ({"query": QUERY, "texts": ["a"], "model": EMBED}, 400, "Validation", f"'{EMBED}' is not a cross-encoder"),
    ({"query": QUERY, "texts": ["a"], "model": "nope"}, 404, "Validation", "'nope'"),
    ({"query": QUERY, "texts": ["a"], "truncation_direction": "up"}, 400, "Validation", "truncation_direction"),
])
def test_tei_rerank_errors_in_tei_shape(client, models, body, status, kind, needle):
    r = client.post("/rerank", json=body)
    assert r.status_code == status, r.text
    err = r.json()
    assert set(err) == {"error", "error_type"} and err["error_type"] == kind and needle in err["error"], err


def test_tei_rerank_malformed_json_and_limits(client, models, serving_engine):
    r = client.post("/rerank", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error_type"] == "Validation"
    many = ["a"] * (serving_engine.args.max_embed_inputs + 1)
    r = client.post("/rerank", json={"query": QUERY, "texts": many})
    assert r.status_code == 400 and "at most" in r.json()["error"]


# ============================================================================ vLLM /v1/rerank


def test_v1_rerank_shape_order_and_scores(client, models, cross_encoder):
    r = client.post("/v1/rerank", json={"model": CE, "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"id", "model", "usage", "results"} and out["model"] == CE and out["id"].startswith("rerank-")
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] > len(DOCS)
    want = _predict(cross_encoder, [(QUERY, d) for d in DOCS])
    results = out["results"]
    assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    for x in results:
        assert set(x) == {"index", "document", "relevance_score"}
        assert x["document"] == {"text": DOCS[x["index"]]}
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-4)


def test_v1_rerank_top_n_and_default_model(client, models):
    full = client.post("/v1/rerank", json={"query": QUERY, "documents": DOCS}).json()
    assert full["model"] == CE and len(full["results"]) == len(DOCS)  # omitted model: the first cross-encoder
    top = client.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2}).json()
    assert top["results"] == full["results"][:2]
    big = client.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 100}).json()
    assert big["results"] == full["results"]


@pytest.mark.parametrize("body, param, needle", [
    ({"model": EMBED, "query": QUERY, "documents": ["a"]}, "model", f"'{EMBED}' is not a cross-encoder"),
    ({"model": CE3, "query": QUERY, "documents": ["a"]}, "model", "'ce3' has 3 labels"),
    ({"query": QUERY, "documents": []}, "documents", "documents must not be empty"),
    ({"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n", "top_n"),
    ({"query": QUERY, "documents": ["a"], "return_documents": True}, "return_documents", "unsupported field"),
    ({"query": QUERY, "documents": ["a", ""]}, "documents[1]", "documents[1] is an empty string"),
])
def test_v1_rerank_errors_in_openai_envelope(client, models, body, param, needle):
    r = client.post("/v1/rerank", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and needle in err["message"], err


# ============================================================================ vLLM /v1/score


def _scores(client, text_1, text_2, model=CE):
    r = client.post("/v1/score", json={"model": model, "text_1": text_1, "text_2": text_2})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "list" and out["model"] == model and out["id"].startswith("score-")
    assert isinstance(out["created"], int) and out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] > 0
    assert [d["index"] for d in out["data"]] == list(range(len(out["data"])))
    assert all(d["object"] == "score" for d in out["data"])
    return [d["score"] for d in out["data"]]


def test_v1_score_pairing_rules(client, models, cross_encoder):
    q2 = "a quick brown fox"
    one = _scores(client, QUERY, DOCS[0])                                    # 1:1
    assert one == pytest.approx(_predict(cross_encoder, [(QUERY, DOCS[0])]), abs=1e-4)
    many = _scores(client, QUERY, DOCS)                                      # 1:N
    assert many == pytest.approx(_predict(cross_encoder, [(QUERY, d) for d in DOCS]), abs=1e-4)
    assert _scores(client, [QUERY], DOCS) == pytest.approx(many, abs=1e-6)   # a one-element list broadcasts too
    nn = _scores(client, [QUERY, q2], DOCS[:2])                              # N:N, element-wise
    assert nn == pytest.approx(_predict(cross_encoder, [(QUERY, DOCS[0]), (q2, DOCS[1])]), abs=1e-4)


@pytest.mark.parametrize("text_1, text_2, param, needle", [
    (["a", "b"], ["c", "d", "e"], "text_1", "1:1, 1:N or N:N (got 2:3)"),
    (["a", "b"], "c", "text_1", "(got 2:1)"),
    ([], ["c"], "text_1", "text_1 must not be empty"),
    ("a", [], "text_2", "text_2 must not be empty"),
    ("", "c", "text_1", "text_1 is an empty string"),
    ("a", ["c", ""], "text_2[1]", "text_2[1] is an empty string"),
])
def test_v1_score_errors(client, models, text_1, text_2, param, needle):
    r = client.post("/v1/score", json={"text_1": text_1, "text_2": text_2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


# ============================================================================ Matryoshka dimensions


def _embed(client, model, texts, dimensions=None):
    body = {"model": model, "input": texts}
    if dimensions is not None:
        body["dimensions"] = dimensions
    return client.post("/v1/embeddings", json=body)


def test_model_info_declares_matryoshka_dimensions(models, serving_engine):
    assert serving_engine.model_info(MRL).matryoshka_dimensions == [8, 16]
    assert serving_engine.model_info(MRL_ANY).matryoshka_dimensions == list(range(1, 33))
    assert serving_engine.model_info(EMBED).matryoshka_dimensions == []
    assert serving_engine.model_info(CE).matryoshka_dimensions == []


def test_dimensions_truncate_and_renormalise(client, models):
    texts = DOCS[:3]
    full = np.asarray([d["embedding"] for d in _embed(client, MRL, texts).json()["data"]])
    assert full.shape == (3, 32) and np.allclose(np.linalg.norm(full, axis=1), 1, atol=1e-5)
    for dims in (8, 16, 32):
        r = _embed(client, MRL, texts, dims)
        assert r.status_code == 200, r.text
        got = np.asarray([d["embedding"] for d in r.json()["data"]])
        by_hand = full[:, :dims] / np.linalg.norm(full[:, :dims], axis=1, keepdims=True)
        assert got.shape == (3, dims) and np.allclose(got, by_hand, atol=1e-5)
    r = _embed(client, MRL, texts, 12)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "dimensions" and "supports dimensions 8, 16, 32; got 12" in err["message"], err


def test_dimensions_any_size_without_normalisation(client, models):
    texts = DOCS[:2]
    full = np.asarray([d["embedding"] for d in _embed(client, MRL_ANY, texts).json()["data"]])
    got = np.asarray([d["embedding"] for d in _embed(client, MRL_ANY, texts, 5).json()["data"]])
    assert got.shape == (2, 5) and np.allclose(got, full[:, :5], atol=1e-6)  # the model does not normalise
    r = _embed(client, MRL_ANY, texts, 33)
    assert r.status_code == 400 and "supports dimensions 1 to 32; got 33" in r.json()["error"]["message"]


def test_dimensions_refused_without_matryoshka(client, models):
    r = _embed(client, EMBED, ["hello"], 128)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "dimensions" and "declares no Matryoshka dimensions" in err["message"], err
    assert _embed(client, EMBED, ["hello"], 384).status_code == 200  # the full size, as before


# ============================================================================ /tokenize, /detokenize


def test_tokenize_prompt_and_round_trip(client, serving_engine):
    tok = serving_engine.tokenizer(GEN)
    prompt = "Hello tokenizer, round trip me: ünïcode ✓"
    r = client.post("/tokenize", json={"model": GEN, "prompt": prompt})
    assert r.status_code == 200, r.text
    out = r.json()
    ids = tok.encode(prompt, add_special_tokens=True)
    assert out == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    plain = client.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False,
                                           "return_token_strs": True}).json()  # default model: the generator
    assert plain["tokens"] == tok.encode(prompt, add_special_tokens=False)
    assert plain["token_strs"] == tok.convert_ids_to_tokens(plain["tokens"])
    back = client.post("/detokenize", json={"model": GEN, "tokens": plain["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": prompt}
    assert client.post("/detokenize", json={"tokens": out["tokens"]}).json() == {"prompt": tok.decode(ids)}


def test_tokenize_encoder_model(client, models, serving_engine):
    tok = serving_engine.tokenizer(EMBED)
    out = client.post("/tokenize", json={"model": EMBED, "prompt": "Paris is nice"}).json()
    assert out["tokens"] == tok.encode("Paris is nice") and out["max_model_len"] == serving_engine.model_info(EMBED).max_model_len
    back = client.post("/detokenize", json={"model": EMBED, "tokens": out["tokens"]}).json()
    assert back == {"prompt": tok.decode(out["tokens"])} and back["prompt"] == "[CLS] paris is nice [SEP]"


def test_tokenize_chat_messages(client, serving_engine):
    tok = serving_engine.tokenizer(GEN)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]

    def rendered(msgs, **kw):
        return tok.encode(tok.apply_chat_template(msgs, tokenize=False, **kw), add_special_tokens=False)

    out = client.post("/tokenize", json={"model": GEN, "messages": messages}).json()
    assert out["tokens"] == rendered(messages, add_generation_prompt=True) and out["count"] == len(out["tokens"])
    # the ids the chat route itself prefills
    chat = client.post("/v1/chat/completions", json={"model": GEN, "messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == out["count"]
    no_gen = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_gen["tokens"] == rendered(messages, add_generation_prompt=False)
    partial = messages + [{"role": "assistant", "content": "Hel"}]
    cont = client.post("/tokenize", json={"messages": partial, "add_generation_prompt": False,
                                          "continue_final_message": True}).json()
    assert cont["tokens"] == rendered(partial, continue_final_message=True)
    text = client.post("/detokenize", json={"tokens": cont["tokens"]}).json()["prompt"]
    assert text.endswith("Hel")
    special = client.post("/tokenize", json={"messages": messages, "add_special_tokens": True}).json()
    assert special["tokens"] == tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


@pytest.mark.parametrize("path, body, needle", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "exactly one of prompt and messages"),
    ("/tokenize", {}, "exactly one of prompt and messages"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt applies to messages only"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "continue_final_message": True},
     "cannot both be true"),
    ("/tokenize", {"prompt": "a", "chat_template": "x"}, "unsupported field 'chat_template'"),
    ("/tokenize", {"messages": []}, "messages must not be empty"),
    ("/tokenize", {"model": EMBED, "messages": [{"role": "user", "content": "a"}]}, "has no chat template"),
    ("/detokenize", {"tokens": [1, 512]}, "tokens[1] = 512 is outside the vocabulary [0, 512)"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0] = -1"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_tokenizer_errors(client, path, body, needle):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert set(err) == {"code", "message"} and err["code"] == "invalid_argument" and needle in err["message"], err


def test_tokenizer_unknown_model(client):
    r = client.post("/detokenize", json={"model": "nope", "tokens": [1]})
    assert r.status_code == 404 and "'nope'" in r.json()["message"]


# ============================================================================ documentation


def test_new_fields_in_openapi(client):
    spec = client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]

    def props(path):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        return set(schemas[ref.rsplit("/", 1)[1]]["properties"])

    assert props("/rerank") == {"query", "texts", "truncate", "truncation_direction", "raw_scores", "return_text", "model"}
    assert props("/v1/rerank") == {"model", "query", "documents", "top_n"}
    assert props("/v1/score") == {"model", "text_1", "text_2"}
    assert props("/tokenize") == {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                                  "continue_final_message", "return_token_strs"}
    assert props("/detokenize") == {"model", "tokens"}
    assert "dimensions" in props("/v1/embeddings")
    for path in ("/rerank", "/v1/rerank", "/v1/score", "/tokenize", "/detokenize"):
        responses = spec["paths"][path]["post"]["responses"]
        assert "200" in responses and "400" in responses and "422" not in responses
