"""The pure helpers and README renderer of benchmarks/spec_decode.py (no engine runs here: a fake
stands in where one is called; the benchmark itself is `python -m benchmarks.spec_decode [--quick]`)."""
from __future__ import annotations

from types import SimpleNamespace

from benchmarks import spec_decode as D


def _round(tok_s: float, digest: str = "d", clean: bool = True, acc=None) -> dict:
    r = {"tok_s": tok_s, "digest": digest, "clean": clean, "accept_rate": acc, "accept_length": 1 + 3 * (acc or 0)}
    return r


def test_summarize_medians_speedups_and_identity():
    runs = {"off": [_round(100), _round(110), _round(90, clean=False)],
            "ngram": [_round(150, acc=0.5), _round(160, acc=0.6), _round(10, clean=False, acc=0.1)],
            "suffix": [_round(300, acc=0.9), _round(280, digest="x", acc=0.8), _round(1, clean=False)]}
    s = D.summarize(runs)
    assert s["tok_s"] == {"off": 105.0, "ngram": 155.0, "suffix": 290.0}     # clean rounds only
    assert s["speedup"] == {"ngram": round(155 / 105, 3), "suffix": round(290 / 105, 3)}
    assert s["identical_to_off"] == {"ngram": True, "suffix": False}
    assert (s["rounds"], s["clean_rounds"]) == (3, 2)
    assert s["accept_rate"]["suffix"] == 0.85


def test_prompts_are_held_out_definitions_and_copy_cues_repeat_the_span():
    spans = D.held_out_spans(6, 64)
    assert len(spans) == 6 and len(set(spans)) == 6
    assert all(len(s) == 64 and s.lstrip().startswith("def ") for s in spans)
    prefix, repeat = spans[0][:D.COPY_PREFIX], "    return x\n" * 5
    p = D.copy_prompt(prefix, repeat)
    assert p == prefix + repeat + "\n" + prefix
    assert D.copied_repeat(p) == repeat[:D.COPY_CHECK]       # what an answer that copies starts with


def test_render_shows_every_row_goal_and_the_sample():
    runs = {"off": [_round(100)], "ngram": [_round(130, acc=0.5)], "suffix": [_round(260, acc=0.9)]}
    doc = {"setup": {"k": 4, "rounds": 1, "new_tokens": 128, "token_budget": 64, "step_ms": {"8": 2.0, "8+spec": 2.1}},
           "model": {"params": 3040000, "heldout_loss_nats_per_byte": 1.86,
                     "sample": {"prompt": "import os\n", "greedy_continuation": "def f():"}},
           "machine": {"cpu": "test cpu", "cores": 2}, "cpu": {"cpu_share_of_cores": 0.9, "others_share_of_cores": 0.0},
           "finished": "2026-01-01T00:00:00+0000",
           "summary": {"b1/repeat": D.summarize(runs), "b8/sampled": D.summarize(runs)},
           "compilations": {"off": {"engine_after_warmup": 0}, "suffix": {"engine_after_warmup": 0}}}
    doc["targets"] = {"b1/repeat/suffix": {"met": True}, "b1/repeat/ngram": {"met": False}}
    text = "\n".join(D.render(doc, quick=True))
    assert "| b1/repeat | 100.0 | 130.0 | 1.30× | 260.0 | 2.60× | ≥ 2.5× (not met/met) |" in text
    assert "| b8/sampled |" in text and "≥ 0.97×" in text
    assert "def f():" in text and "Compilations after warmup: off 0, suffix 0" in text


def test_render_says_how_many_copy_answers_went_on_with_the_span():
    """The copy row is only a copying measurement if the model copies: the README line says how
    many answers per round went on with their prompt's span."""
    runs = {"off": [_round(100), _round(100)], "ngram": [_round(130), _round(130)], "suffix": [_round(260), _round(260)]}
    for side, n in (("off", 3), ("ngram", 3), ("suffix", 3)):
        for r in runs[side]:
            r["copied"] = n
    runs["off"][1]["copied"] = 5
    doc = {"setup": {"k": 4, "rounds": 2, "copy_prefix": 32, "copy_repeat": 64}, "model": {},
           "machine": {"cpu": "c", "cores": 2}, "cpu": {},
           "finished": "2026-01-01T00:00:00+0000", "summary": {"b8/copy": D.summarize(runs)}, "compilations": {}}
    text = "\n".join(D.render(doc, quick=True))
    assert "Copy answers that repeated the continuation R in their prompt" in text and "b8/copy 3/5 of 24" in text
    assert "the model's own greedy 64-token continuation R of P" in text
    # a file of the first copy form (a span and its first bytes) keeps its own words
    doc["setup"] = {"k": 4, "rounds": 2, "copy_span": 96, "copy_cue": 24}
    text = "\n".join(D.render(doc, quick=True))
    assert "Copy answers that went on with their prompt's span" in text and "its first 24 bytes" in text


def test_results_name_changes_the_file_not_the_benchmark_field():
    assert D.result_names("trained", "float32", None) == ("spec_decode", "spec_decode")
    assert D.result_names("trained", "float32", "spec_decode_avx2") == ("spec_decode", "spec_decode_avx2")
    assert D.result_names("small", "float32", None) == ("spec_decode_small", "spec_decode_small")
    assert D.result_names("trained", "bfloat16", "x") == ("spec_decode_bf16", "x")


class _EchoEngine:
    """Answers a prompt with its characters reversed (one token per character), recording each
    request; its tokenizer decodes token ids as characters."""

    def __init__(self):
        self.requests = []

    async def generate(self, req):
        self.requests.append(req)
        yield SimpleNamespace(new_token_ids=[ord(c) for c in req.prompt[::-1]][:req.params.max_new_tokens])

    def tokenizer(self, name):
        return SimpleNamespace(decode=lambda ids: "".join(map(chr, ids)))


def test_copy_prompts_hold_the_engines_own_greedy_continuation():
    spans = D.held_out_spans(3, 96)
    engine = _EchoEngine()
    prompts = D.copy_prompts(engine, spans)
    for span, p in zip(spans, prompts):
        prefix = span[:D.COPY_PREFIX]
        assert p == prefix + prefix[::-1] + "\n" + prefix      # P, the engine's answer R to P, newline, P
    assert sorted(r.prompt for r in engine.requests) == sorted(s[:D.COPY_PREFIX] for s in spans)
    assert all(r.params.temperature == 0.0 and r.params.max_new_tokens == D.COPY_REPEAT for r in engine.requests)
    # an answer "copied" when it starts with R
    repeat = spans[0][:D.COPY_PREFIX][::-1]
    assert D._copied(engine, prompts[0], [ord(c) for c in repeat + "tail"])
    assert not D._copied(engine, prompts[0], [ord(c) for c in "x" + repeat])
