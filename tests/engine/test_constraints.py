"""Structured generation through the Engine with the random-weight tiny decoder: whatever the
model wants, the answer holds to its grammar (issue 17)."""
from __future__ import annotations

import asyncio
import json
import re
import threading

import jsonschema
import numpy as np
import pytest

from jax_engine.api import tool_constraint
from jax_engine.constrain import compiler as compiler_mod
from jax_engine.constrain import grammar as grammar_mod
from jax_engine.errors import InvalidRequest
from jax_engine.types import Constraint, FunctionTool
from tests.helpers.engines import build_tiny_decoder, make_engine, run

SEEDS = range(50)

NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["cat", "dog", "owl"]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "score": {"type": "number", "minimum": -5, "maximum": 5},
        "owner": {"type": "object",
                  "properties": {"name": {"type": "string", "maxLength": 6}, "vip": {"type": "boolean"}},
                  "required": ["name", "vip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["id", "kind", "code", "owner", "tags"],
    "additionalProperties": False,
}
REGEX = r"(\+|-)?[0-9]{1,4}(\.[0-9]{1,2})? (apples|pears)"
EBNF = 'root ::= "[" num rest "]"\nrest ::= "" | "," num | "," num "," num\nnum ::= [0-9] | [1-9] [0-9]'
EBNF_AS_REGEX = r"\[(?:[0-9]|[1-9][0-9])(?:,(?:[0-9]|[1-9][0-9])){0,2}\]"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_decoder(str(tmp_path_factory.mktemp("demo")))


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = make_engine(model_dir, max_model_len=256, max_running_requests=16)
    yield eng
    eng.shutdown()


def _sampled(engine, constraint: Constraint, max_new: int = 96, **kw) -> list[dict]:
    async def main():
        return await asyncio.gather(*[run(engine, [5, 6, 7, 8], temperature=1.0, seed=s, max_new_tokens=max_new,
                                          constraint=constraint, **kw) for s in SEEDS])
    return [r[0] for r in asyncio.run(main())]


def test_json_schema_answers_validate_for_50_seeds(engine):
    outs = _sampled(engine, Constraint("json_schema", json.dumps(NESTED)), max_new=160)
    for o in outs:
        assert o["final"].finish_reason == "stop", o["text"]
        jsonschema.validate(json.loads(o["text"]), NESTED)
    assert len({o["text"] for o in outs}) > 40          # the model's own choices, not one forced answer


def test_regex_and_ebnf_answers_match_for_50_seeds(engine):
    for c, pattern in [(Constraint("regex", REGEX), REGEX), (Constraint("ebnf", EBNF), EBNF_AS_REGEX)]:
        outs = _sampled(engine, c)
        for o in outs:
            assert o["final"].finish_reason == "stop"
            assert re.fullmatch(pattern, o["text"]), (c.kind, o["text"])
        assert len({o["text"] for o in outs}) > 25


def test_json_object_and_choice(engine, model_dir):
    tok = engine.tokenizer("gen")
    # a nudge towards closing strings and objects so answers end within the budget; the grammar
    # still decides which tokens are possible at every position
    close = {tok.convert_tokens_to_ids('"'): 3.0, tok.convert_tokens_to_ids("}"): 3.0}
    outs = _sampled(engine, Constraint("json_object"), max_new=200, logit_bias=close)
    done = [o for o in outs if o["final"].finish_reason == "stop"]
    assert len(done) >= 40
    for o in done:
        assert isinstance(json.loads(o["text"]), dict)
    picks = _sampled(engine, Constraint("choice", choices=["red", "green", "blue sky"]))
    assert {o["text"] for o in picks} == {"red", "green", "blue sky"}


def test_structural_tag_constrains_only_inside_the_tag(engine):
    tok = engine.tokenizer("gen")
    schema = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["x"], "additionalProperties": False}
    # a one-token trigger, so the random model (pushed towards "<") reaches it often
    tag = {"type": "structural_tag", "triggers": ["<"],
           "structures": [{"begin": "<f=get>", "schema": schema, "end": "</f>"}]}
    lt = tok.convert_tokens_to_ids("<")
    outs = _sampled(engine, Constraint("structural_tag", json.dumps(tag)), max_new=40, logit_bias={lt: 4.0})
    tagged = 0
    for o in outs:
        for m in re.finditer(r"<", o["text"]):
            rest = o["text"][m.start():]
            if rest.startswith("</f>"):
                continue                        # the end of the tag before it
            inner = re.match(r"<f=get>(.*?)</f>", rest, re.S)
            if inner is None:                   # the budget ran out inside the tag
                assert o["final"].finish_reason == "length" and "</f>" not in rest, rest
                continue
            tagged += 1
            jsonschema.validate(json.loads(inner.group(1)), schema)
    assert tagged >= 10


def test_n_stop_logprobs_penalties_with_a_constraint(engine):
    c = Constraint("regex", r"[a-z]{4,12}")

    async def main():
        return await run(engine, [9, 9, 9], temperature=1.0, seed=11, n=3, max_new_tokens=20, constraint=c,
                         logprobs=True, top_logprobs=2, frequency_penalty=1.0, presence_penalty=0.5)

    out = asyncio.run(main())
    assert len(out) == 3
    for i in range(3):
        assert re.fullmatch(r"[a-z]{4,12}", out[i]["text"]), out[i]["text"]
        assert len(out[i]["logprobs"]) == len(out[i]["tokens"])
        assert all(lp.logprob <= 0 for lp in out[i]["logprobs"])
    # a stop string inside the constrained text still stops it (and is trimmed)
    first = out[0]["text"]
    stop = first[2:4]
    again = asyncio.run(run(engine, [9, 9, 9], temperature=1.0, seed=11, n=3, max_new_tokens=20, constraint=c,
                            frequency_penalty=1.0, presence_penalty=0.5, stop=[stop]))
    assert again[0]["text"] == first[:first.find(stop)]
    assert again[0]["final"].matched_stop == stop


def test_greedy_constrained_equals_transformers_with_the_same_mask(engine, model_dir):
    """The bitmask reaches the right tokens: transformers' greedy with llguidance's mask applied by
    hand (a fresh matcher, not the engine's) picks the same tokens."""
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lln
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    htok = AutoTokenizer.from_pretrained(model_dir)
    lltok = llguidance.hf.from_tokenizer(htok, 512, [2])
    prompt = [5, 6, 7, 8, 9, 10]
    for c in [Constraint("json_schema", json.dumps(NESTED)), Constraint("regex", REGEX)]:
        ours = asyncio.run(run(engine, prompt, temperature=0.0, max_new_tokens=80, constraint=c))[0]
        m = llguidance.LLMatcher(lltok, grammar_mod.to_grammar(c), log_level=0)
        ids, ref = list(prompt), []
        mask = lln.allocate_token_bitmask(1, 512)
        with torch.no_grad():
            while len(ref) < 80 and not m.is_stopped():
                logits = hf(torch.tensor([ids])).logits[0, -1].numpy()
                lln.fill_next_token_bitmask(m, mask, 0)
                allowed = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:512].astype(bool)
                t = int(np.argmax(np.where(allowed, logits, -np.inf)))
                assert m.consume_token(t)
                ref.append(t)
                ids.append(t)
        assert ours["tokens"] == ref, (c.kind, htok.decode(ours["tokens"]), htok.decode(ref))


def test_unconstrained_rows_unchanged_beside_constrained_ones(engine):
    free = [[11, 12, 13], [40, 41], list(range(60, 90))]

    async def main():
        alone = [await run(engine, p, temperature=0.0, max_new_tokens=24, ignore_eos=True) for p in free]
        before = engine.compilations_after_warmup()
        mixed = await asyncio.gather(
            *[run(engine, p, temperature=0.0, max_new_tokens=24, ignore_eos=True) for p in free],
            *[run(engine, [5 + s], temperature=1.0, seed=s, max_new_tokens=40,
                  constraint=Constraint("json_schema", json.dumps(NESTED))) for s in range(6)])
        return alone, mixed, engine.compilations_after_warmup() - before

    alone, mixed, compiles = asyncio.run(main())
    for a, b in zip(alone, mixed[:3]):
        assert a[0]["tokens"] == b[0]["tokens"]
    assert compiles == 0
    assert engine.compilations_after_warmup() == 0


def test_preempted_constrained_request_resumes_its_grammar(model_dir):
    """A pool too small for every row forces preemption; recomputed sequences keep their matcher
    state, so the answers are the ones an unpreempted engine gives (greedy) and still validate."""
    eng = make_engine(model_dir, num_pages=12, max_running_requests=4, max_model_len=256)
    try:
        c = Constraint("json_schema", json.dumps(NESTED))
        prompts = [[20 + i] * 9 for i in range(4)]

        async def main():
            together = await asyncio.gather(*[run(eng, p, temperature=0.0, max_new_tokens=60, constraint=c)
                                              for p in prompts])
            alone = [await run(eng, p, temperature=0.0, max_new_tokens=60, constraint=c) for p in prompts]
            return together, alone

        together, alone = asyncio.run(main())
        assert eng.stats("gen").preemptions > 0
        for a, b in zip(together, alone):
            assert a[0]["tokens"] == b[0]["tokens"]
            if a[0]["final"].finish_reason == "stop":
                jsonschema.validate(json.loads(a[0]["text"]), NESTED)
    finally:
        eng.shutdown()


def test_tool_choice_required_gives_valid_calls(engine):
    tools = [FunctionTool("get_weather", {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}},
                                          "required": ["city"], "additionalProperties": False}),
             FunctionTool("add", {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                                  "required": ["a"], "additionalProperties": False})]
    req = tool_constraint(tools, "required", parallel=False)
    named = tool_constraint(tools, "function", function="add")
    assert tool_constraint(tools, "auto") is None and tool_constraint(tools, "none") is None
    tok = engine.tokenizer("gen")
    close = {tok.convert_tokens_to_ids("]"): 2.0}
    for o in _sampled(engine, req, max_new=80, logit_bias=close)[:20]:
        calls = json.loads(o["text"])
        assert len(calls) == 1
        fn = {t.name: t for t in tools}[calls[0]["name"]]
        jsonschema.validate(calls[0]["parameters"], fn.parameters)
    for o in _sampled(engine, named, max_new=40)[:20]:
        jsonschema.validate(json.loads(o["text"]), tools[1].parameters)
    with pytest.raises(InvalidRequest, match="not among the tools"):
        tool_constraint(tools, "function", function="nope")


@pytest.mark.parametrize("c, match", [
    (Constraint("regex", "[a-"), "constraint.regex"),
    (Constraint("json_schema", "{not json"), "constraint.json_schema: not valid JSON"),
    (Constraint("json_schema", json.dumps({"type": "array", "uniqueItems": True})), "uniqueItems"),
    (Constraint("ebnf", "root ::= missing"), "constraint.ebnf"),
    (Constraint("choice"), "at least one choice"),
    (Constraint("structural_tag", json.dumps({"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<b"]})),
     "none of the triggers"),
    (Constraint("xml", "x"), "unknown kind"),
    (Constraint("regex", "a" * 70000), "exceeds the limit of 65536"),
    # hostile nesting within the size cap: refused, never a crash (reliability_security.md row 10)
    (Constraint("json_schema", '{"type": "array", "items": ' * 2000 + '{"type": "integer"}' + "}" * 2000),
     "constraint.json_schema"),
    (Constraint("regex", "(" * 20000 + "a" + ")" * 20000), "constraint.regex"),
    (Constraint("ebnf", "root ::= " + "(" * 20000 + '"a"' + ")" * 20000), "constraint.ebnf"),
])
def test_bad_constraints_are_refused_before_the_scheduler(engine, c, match):
    with pytest.raises(InvalidRequest, match=re.escape(match)):
        asyncio.run(run(engine, [5, 6], max_new_tokens=4, constraint=c))
    assert engine.stats("gen").running_requests == 0
    assert engine.stats("gen").grammar_queue == 0


def test_grammar_queue_counts_compiling_requests_and_timeout_refuses(engine, monkeypatch):
    gate = threading.Event()
    real = grammar_mod.to_grammar

    def slow(c):
        gate.wait(10)
        return real(c)

    monkeypatch.setattr(compiler_mod.grammar, "to_grammar", slow)

    async def main():
        task = asyncio.ensure_future(run(engine, [5, 6], temperature=0.0, max_new_tokens=16,
                                         constraint=Constraint("regex", "queued[0-9]")))
        for _ in range(100):
            await asyncio.sleep(0.02)
            if engine.stats("gen").grammar_queue:
                break
        queued = engine.stats("gen").grammar_queue
        gate.set()
        out = await task
        return queued, out

    queued, out = asyncio.run(main())
    assert queued == 1
    assert re.fullmatch("queued[0-9]", out[0]["text"])
    assert engine.stats("gen").grammar_queue == 0
    gate.clear()
    engine.args.grammar_compile_timeout_s, saved = 0.05, engine.args.grammar_compile_timeout_s
    try:
        with pytest.raises(InvalidRequest, match="did not compile within"):
            asyncio.run(run(engine, [5, 6], max_new_tokens=4, constraint=Constraint("regex", "late[0-9]")))
    finally:
        gate.set()
        engine.args.grammar_compile_timeout_s = saved
