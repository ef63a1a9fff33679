"""Tool choice as a constraint, with vLLM's output shapes (so its tool parsers read our output):

- a named function: the answer is that function's arguments, a JSON object valid for its schema;
- "required": the answer is a JSON array of at least one {"name": ..., "parameters": {...}} call,
  each call's parameters valid for its own function's schema (at most one call when parallel tool
  calls are off);
- "auto" / "none": no constraint (the model may or may not call a tool; "none" never asks).

Pure data: no grammar library here, so the HTTP front can use it through jax_engine.api.
"""
from __future__ import annotations

import json
from typing import Optional

from jax_engine.errors import InvalidRequest
from jax_engine.types import Constraint, FunctionTool


def tool_constraint(tools: list[FunctionTool], choice: str, function: Optional[str] = None,
                    parallel: bool = True) -> Optional[Constraint]:
    """The constraint for `choice` ("none" | "auto" | "required" | "function", the last with the
    function's name in `function`) over `tools`; None when the output is free."""
    if choice in ("none", "auto"):
        return None
    if not tools:
        raise InvalidRequest(f"tool_choice: {choice!r} needs at least one tool in tools")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools: function names must be unique")
    for t in tools:
        if not isinstance(t.parameters, dict):
            raise InvalidRequest(f"tools: the parameters of {t.name!r} must be a JSON schema object")
    if choice == "function":
        match = [t for t in tools if t.name == function]
        if not match:
            raise InvalidRequest(f"tool_choice: function {function!r} is not among the tools ({', '.join(names)})")
        return Constraint("json_schema", json.dumps(match[0].parameters))
    if choice != "required":
        raise InvalidRequest(f"tool_choice: expected none, auto, required or a named function, got {choice!r}")
    call = {"anyOf": [{"type": "object",
                       "properties": {"name": {"type": "string", "enum": [t.name]}, "parameters": t.parameters},
                       "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}
    schema: dict = {"type": "array", "minItems": 1, "items": call}
    if not parallel:
        schema["maxItems"] = 1
    return Constraint("json_schema", json.dumps(schema))
