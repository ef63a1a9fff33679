"""The constraint helpers on their own: grammar text, tool choice shapes, the compile cache."""
from __future__ import annotations

import json

import pytest

from jax_engine.api import tool_constraint
from jax_engine.constrain import grammar
from jax_engine.constrain.compiler import GrammarCompiler
from jax_engine.errors import InvalidRequest
from jax_engine.models.demo import build_demo_generator
from jax_engine.types import Constraint, FunctionTool


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("demo"))
    build_demo_generator(path)
    c = GrammarCompiler(AutoTokenizer.from_pretrained(path), 512, {2}, cache_size=2, max_bytes=1000)
    yield c
    c.close()


def test_json_is_compact_unless_asked():
    compact = grammar.to_grammar(Constraint("json_schema", '{"type": "object"}'))
    free = grammar.to_grammar(Constraint("json_schema", '{"type": "object"}', any_whitespace=True))
    assert '"whitespace_flexible": false' in compact and "whitespace_flexible" not in free
    own = grammar.to_grammar(Constraint("json_schema", '{"type": "object", "x-guidance": {"whitespace_flexible": true}}'))
    assert '"whitespace_flexible": true' in own


def test_compile_cache_hits_and_evicts(compiler):
    a = compiler.compile(Constraint("regex", "a+")).result()
    assert compiler.compile(Constraint("regex", "a+")).result() is a       # cached: no second compile
    compiler.compile(Constraint("regex", "b+")).result()
    compiler.compile(Constraint("regex", "c+")).result()                  # cache_size 2: "a+" is evicted
    assert compiler.compile(Constraint("regex", "a+")).result() is not a
    assert compiler.queued == 0
    s1, s2 = a.new_state(), a.new_state()
    assert s1.consume(compiler_token(compiler, "a")) and not s2.stopped()  # states are independent copies
    with pytest.raises(InvalidRequest, match="exceeds the limit of 1000"):
        compiler.compile(Constraint("regex", "x" * 1001))


def test_a_full_grammar_queue_is_overloaded(compiler, monkeypatch):
    import threading

    from jax_engine.errors import Overloaded

    gate = threading.Event()
    real = grammar.to_grammar
    monkeypatch.setattr(grammar, "to_grammar", lambda c: (gate.wait(10), real(c))[1])
    monkeypatch.setattr(compiler, "max_queued", 2)
    futs = [compiler.compile(Constraint("regex", f"q{i}")) for i in range(2)]
    with pytest.raises(Overloaded, match="grammar queue is full"):
        compiler.compile(Constraint("regex", "q2"))
    gate.set()
    assert all(f.result().words == compiler.words for f in futs) and compiler.queued == 0


def compiler_token(compiler, text: str) -> int:
    return compiler._tokenizer.result().tokenize_str(text)[0]


def test_tool_constraint_shapes():
    tools = [FunctionTool("f", {"type": "object", "properties": {"x": {"type": "integer"}}}), FunctionTool("g")]
    req = json.loads(tool_constraint(tools, "required").spec)
    assert req["type"] == "array" and req["minItems"] == 1 and "maxItems" not in req
    assert [b["properties"]["name"]["enum"] for b in req["items"]["anyOf"]] == [["f"], ["g"]]
    assert json.loads(tool_constraint(tools, "required", parallel=False).spec)["maxItems"] == 1
    assert json.loads(tool_constraint(tools, "function", function="f").spec) == tools[0].parameters
    for bad, match in [(([], "required"), "needs at least one tool"), ((tools + tools[:1], "required"), "unique"),
                       ((tools, "sometimes"), "expected none, auto")]:
        with pytest.raises(InvalidRequest, match=match):
            tool_constraint(*bad)
