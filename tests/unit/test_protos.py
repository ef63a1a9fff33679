"""The committed generated code matches protos/, and protos/ match the seed protocols.

Regenerate after editing a .proto:  python -m frontends.grpc.gen.regen
"""
from __future__ import annotations

import os
import re

import pytest

from frontends.grpc.gen import regen
from frontends.grpc.gen.allspark import allspark_service_pb2
from frontends.grpc.gen.arctic_inference import inference_pb2
from frontends.grpc.gen.sglang import sglang_scheduler_pb2

SEED_DIRS = [os.environ.get("XLASERVE_SEEDS_DIR", ""), "/work/shared/seeds",
             os.path.join(regen.REPO, "..", "shared", "seeds")]


def test_generated_code_is_up_to_date(tmp_path):
    regen.generate(str(tmp_path))
    fresh = regen.generated_files(str(tmp_path))
    committed = regen.generated_files(regen.GEN_DIR)
    assert sorted(fresh) == sorted(committed), "generated file set differs; run python -m frontends.grpc.gen.regen"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated files {stale}; run python -m frontends.grpc.gen.regen"
    # the generated code's grpcio floor is the install's (regen.MIN_GRPC)
    with open(os.path.join(regen.REPO, "pyproject.toml")) as f:
        assert f'"grpcio>={regen.MIN_GRPC}"' in f.read()
    assert all(f"GRPC_GENERATED_VERSION = '{regen.MIN_GRPC}'" in text
               for name, text in committed.items() if name.endswith("_pb2_grpc.py"))


# ---------------------------------------------------------------------- seed text parsing
def _seed(fragment: str) -> str:
    for d in SEED_DIRS:
        if d and os.path.isdir(d):
            for name in sorted(os.listdir(d)):
                with open(os.path.join(d, name), encoding="utf-8") as f:
                    text = f.read()
                if fragment in text.splitlines()[0]:
                    return text
    pytest.skip(f"seed text for {fragment} not found in {SEED_DIRS}")


_FIELD = re.compile(r"^\s*(?:optional\s+|repeated\s+)?(map<[^>]+>|[\w.]+)\s+(\w+)\s*=\s*(\d+)\s*;")


def _proto_messages(text: str) -> dict[str, dict[str, int]]:
    """Top-level `message X { ... }` -> {field name: number} (oneof members included)."""
    text = re.sub(r"//[^\n]*", "", text)
    out: dict[str, dict[str, int]] = {}
    current, depth = None, 0
    for line in text.splitlines():
        m = re.match(r"^message\s+(\w+)\s*\{", line)
        if m and depth == 0:
            current, fields = m.group(1), {}
            out[current] = fields
        if current is not None:
            f = _FIELD.match(line)
            if f and depth >= 1:
                out[current][f.group(2)] = int(f.group(3))
        depth += line.count("{") - line.count("}")
        if depth == 0:
            current = None
    return out


def _proto_rpcs(text: str) -> list[tuple[str, str, str, bool]]:
    return [(m[0], m[1], m[3], bool(m[2])) for m in
            re.findall(r"rpc\s+(\w+)\s*\(\s*([\w.]+)\s*\)\s*returns\s*\(\s*(stream\s+)?([\w.]+)\s*\)", text)]


def _check_against(text: str, module, package: str) -> None:
    fd = module.DESCRIPTOR
    assert fd.package == package
    seed_msgs = _proto_messages(text)
    assert set(seed_msgs) == set(fd.message_types_by_name)
    for name, fields in seed_msgs.items():
        desc = fd.message_types_by_name[name]
        assert {f.name: f.number for f in desc.fields} == fields, name
    (service,) = fd.services_by_name.values()
    got = [(m.name, m.input_type.name, m.output_type.name, m.server_streaming) for m in service.methods]
    assert got == _proto_rpcs(text)


def test_arctic_matches_seed():
    _check_against(_seed("inference.proto"), inference_pb2, "arctic_inference")


def test_sglang_matches_seed():
    text = _seed("sglang_scheduler.proto")
    _check_against(text, sglang_scheduler_pb2, "sglang.grpc.scheduler")
    fd = sglang_scheduler_pb2.DESCRIPTOR
    assert [d.name for d in fd.dependencies] == ["google/protobuf/timestamp.proto", "google/protobuf/struct.proto"]
    sp = fd.message_types_by_name["SamplingParams"]
    assert sp.fields_by_name["max_new_tokens"].has_presence  # proto3 `optional`
    assert not sp.fields_by_name["temperature"].has_presence


def test_allspark_matches_rendered_seed():
    """Every `type name = N` the rendered page lists exists with that number; gaps kept."""
    text = _seed("package allspark.allspark_service")
    fd = allspark_service_pb2.DESCRIPTOR
    assert fd.package == "allspark.allspark_service"
    numbers: dict[str, set[int]] = {}
    for msg in _all_messages(fd):
        for f in msg.fields:
            numbers.setdefault(f.name, set()).add(f.number)
    for enum in _all_enums(fd):
        for v in enum.values:
            numbers.setdefault(v.name, set()).add(v.number)
    field = r"^\s*•\s+(?:optional\s+|repeated\s+)?(?:map<[^>]+>|[\w.]+)\s+(\w+)\s*=\s*(\d+)\s*$"
    listed = re.findall(field, text, re.M)
    listed += re.findall(r"^\s*•\s+(\w+)\s*=\s*(\d+)\s*$", text, re.M)
    assert len(listed) > 150
    missing = [(n, v) for n, v in listed if int(v) not in numbers.get(n, set())]
    assert not missing
    rendered_rpcs = re.findall(r"^•\s+rpc\s+(\w+)\s+\((\w+),\s*(\w+)\)", text, re.M)
    service = fd.services_by_name["AllSpark"]
    assert [(m.name, m.input_type.name, m.output_type.name) for m in service.methods] == rendered_rpcs
    start = fd.message_types_by_name["StartRequestRequest"]
    assert sorted(f.number for f in start.fields) == [1, 2, 3, 4, 6]
    assert 6 not in [v.number for v in fd.enum_types_by_name["AS_STATUS"].values]
    assert not any(f.has_presence for m in _all_messages(fd) for f in m.fields
                   if f.type != f.TYPE_MESSAGE)  # no `optional` scalars


def _all_messages(fd):
    stack = list(fd.message_types_by_name.values())
    while stack:
        m = stack.pop()
        yield m
        stack.extend(m.nested_types)


def _all_enums(fd):
    yield from fd.enum_types_by_name.values()
    for m in _all_messages(fd):
        yield from m.enum_types
