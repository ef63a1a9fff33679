"""A request's Constraint as llguidance grammar text. Shape errors are InvalidRequest naming the
constraint's field; grammar errors are found when the grammar is compiled (compiler.py)."""
from __future__ import annotations

import json

import llguidance

from jax_engine.errors import InvalidRequest
from jax_engine.types import CONSTRAINT_KINDS, Constraint


def field_name(c: Constraint) -> str:
    """How refusals name the constraint (the fronts' own field names map onto these kinds)."""
    return f"constraint.{c.kind}"


def check(c: Constraint, max_bytes: int) -> None:
    """Cheap checks before anything is compiled: a known kind, a spec under the size cap."""
    if c.kind not in CONSTRAINT_KINDS:
        raise InvalidRequest(f"constraint: unknown kind {c.kind!r}; expected one of {', '.join(CONSTRAINT_KINDS)}")
    size = len(c.spec.encode()) + sum(len(s.encode()) for s in c.choices)
    if size > max_bytes:
        raise InvalidRequest(f"{field_name(c)}: {size} bytes exceeds the limit of {max_bytes} (--max-grammar-bytes)")
    if c.kind == "choice":
        if not c.choices:
            raise InvalidRequest("constraint.choice: at least one choice is required")
        if any(not isinstance(s, str) for s in c.choices):
            raise InvalidRequest("constraint.choice: every choice must be a string")
    elif c.kind != "json_object" and not c.spec.strip():
        raise InvalidRequest(f"{field_name(c)}: must not be empty")


def to_grammar(c: Constraint) -> str:
    """llguidance grammar text for a checked constraint."""
    try:
        if c.kind == "json_schema":
            return llguidance.grammar_from("json_schema", _json_text(c.spec, field_name(c), c.any_whitespace))
        if c.kind == "json_object":
            return llguidance.grammar_from("json_schema", _json_text('{"type": "object"}', field_name(c), c.any_whitespace))
        if c.kind == "regex":
            return llguidance.grammar_from("regex", c.spec)
        if c.kind == "ebnf":
            return llguidance.grammar_from("ebnf", c.spec)
        if c.kind == "lark":
            return llguidance.grammar_from("lark", c.spec)
        if c.kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(list(c.choices)))
        return _structural_tag(c.spec)
    except InvalidRequest:
        raise
    except Exception as e:   # llguidance's converters raise ValueError / RuntimeError on bad text
        raise InvalidRequest(f"{field_name(c)}: {first_lines(e)}") from None


def _json_text(text: str, name: str, any_whitespace: bool) -> str:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"{name}: not valid JSON: {e}") from None
    if not isinstance(value, (dict, bool)):
        raise InvalidRequest(f"{name}: a JSON schema must be an object or a boolean")
    return json.dumps(value if any_whitespace else _compact(value))


def _compact(schema):
    """Compact JSON (no whitespace between tokens) unless the schema sets llguidance's own
    "x-guidance" options (e.g. {"whitespace_flexible": true}): with free whitespace a model can
    pad a document with blanks until it runs out of tokens (vLLM grew disable_any_whitespace)."""
    if isinstance(schema, dict) and "x-guidance" not in schema:
        return {**schema, "x-guidance": {"whitespace_flexible": False}}
    return schema


def _structural_tag(text: str) -> str:
    """SGLang's structural tag: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}.
    Free text until a trigger; from a structure's `begin` its schema is enforced up to its `end`.
    Each structure's trigger is the longest trigger its `begin` starts with (SGLang's rule)."""
    name = "constraint.structural_tag"
    try:
        tag = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"{name}: not valid JSON: {e}") from None
    if not isinstance(tag, dict) or not isinstance(tag.get("structures"), list) or not isinstance(tag.get("triggers"), list):
        raise InvalidRequest(f"{name}: expected an object with 'structures' and 'triggers' lists "
                             "(SGLang's structural_tag format)")
    triggers = [t for t in tag["triggers"] if isinstance(t, str) and t]
    if len(triggers) != len(tag["triggers"]) or not triggers:
        raise InvalidRequest(f"{name}: triggers must be non-empty strings")
    if not tag["structures"]:
        raise InvalidRequest(f"{name}: at least one structure is required")
    tags = []
    for i, s in enumerate(tag["structures"]):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise InvalidRequest(f"{name}: structures[{i}] needs string 'begin' and 'end'")
        schema = s.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest(f"{name}: structures[{i}].schema must be a JSON schema object")
        owners = [t for t in triggers if s["begin"].startswith(t)]
        if not owners:
            raise InvalidRequest(f"{name}: structures[{i}].begin {s['begin']!r} starts with none of the triggers")
        tags.append(llguidance.StructTag(trigger=max(owners, key=len), begin=s["begin"],
                                         grammar=_compact(schema if isinstance(schema, dict) else {}), end=s["end"]))
    return llguidance.grammar_from("lark", llguidance.StructTag.to_grammar(tags, assume_special=False))


def first_lines(e: object) -> str:
    """An error's first lines, for a client-facing message."""
    text = str(e).strip() or type(e).__name__
    return " ".join(text.splitlines()[:3])[:500]
