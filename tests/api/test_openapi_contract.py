"""The app's own OpenAPI document against OpenAI's published one, for the Files and Batches routes.

For each route the 200 schema must match OpenAI's: the same property names, the same required
set, the same types and enums, all the way down ($refs resolved on both sides). OpenAI's live
API sends null for unset optional properties (see tests/contract/spec.py), so an optional
property of OpenAI's must be `X | null` here. Two differences are allowed: where OpenAI types
a value as any string, this app may pin the one value it sends (`"object": "list"`); and the
short list of KNOWN_DEVIATIONS, each with its reason.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
import yaml

from tests.contract.spec import SPEC_PATH

Schema = dict[str, Any]

ROUTES = [  # (method, OpenAI's path, this app's path)
    ("post", "/files", "/v1/files"),
    ("get", "/files", "/v1/files"),
    ("get", "/files/{file_id}", "/v1/files/{file_id}"),
    ("delete", "/files/{file_id}", "/v1/files/{file_id}"),
    ("post", "/batches", "/v1/batches"),
    ("get", "/batches", "/v1/batches"),
    ("get", "/batches/{batch_id}", "/v1/batches/{batch_id}"),
    ("post", "/batches/{batch_id}/cancel", "/v1/batches/{batch_id}/cancel"),
]
ERROR_STATUSES = ("400", "401", "404", "409", "413", "429", "500")

# (OpenAI's schema, property) -> how this app's may differ, and why.
KNOWN_DEVIATIONS: dict[tuple[str, str], Schema] = {
    # OpenAI accepts purpose "evals" at upload (CreateFileRequest) but its File object's enum omits it.
    ("OpenAIFile", "purpose"): {"extra_enum": {"evals"}},
    # Required strings in OpenAI's schema, yet null on an empty page, as OpenAI's live API sends them.
    ("ListFilesResponse", "first_id"): {"extra_types": {"null"}},
    ("ListFilesResponse", "last_id"): {"extra_types": {"null"}},
}


@cache
def openai_document() -> Schema:
    return yaml.safe_load(SPEC_PATH.read_text())  # type: ignore[no-any-return]


@cache
def app_document() -> Schema:
    from backfill.api.app import create_app

    return create_app().openapi()


def ok_schema(document: Schema, method: str, path: str) -> Schema:
    return document["paths"][path][method]["responses"]["200"]["content"]["application/json"]["schema"]  # type: ignore[no-any-return]


def _types(schema: Schema) -> set[str]:
    declared = schema.get("type")
    if isinstance(declared, list):
        return set(declared)
    if declared is not None:
        return {declared}
    if "properties" in schema:
        return {"object"}
    return {"string"} if "const" in schema or "enum" in schema else set()


@dataclass(frozen=True)
class Comparison:
    """Compares schemas of this app's document (`ours`) with OpenAI's (`theirs`)."""

    ours: Schema
    theirs: Schema

    @staticmethod
    def _alternatives(schema: Schema, document: Schema) -> list[tuple[Schema, str | None]]:
        """The schema's anyOf/oneOf alternatives, flattened, each with the component it came from."""
        name = None
        while "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[-1]
            schema = document["components"]["schemas"][name]
        if "anyOf" in schema or "oneOf" in schema:
            return [
                (alt, alt_name or name)
                for sub in schema.get("anyOf") or schema.get("oneOf") or []
                for alt, alt_name in Comparison._alternatives(sub, document)
            ]
        return [(schema, name)]

    @staticmethod
    def _by_type(schema: Schema, document: Schema) -> dict[str, tuple[Schema, str | None]]:
        return {t: (alt, name) for alt, name in Comparison._alternatives(schema, document) for t in _types(alt)}

    def compare(self, ours: Schema, theirs: Schema, where: str, *, optional: bool = False, allowed: Schema | None = None) -> list[str]:  # fmt: skip
        allowed = allowed or {}
        mine, want = self._by_type(ours, self.ours), self._by_type(theirs, self.theirs)
        expected = set(want) | ({"null"} if optional else set()) | allowed.get("extra_types", set())
        if set(mine) != expected:
            return [f"{where}: types {sorted(mine)}, OpenAI's {sorted(expected)}"]
        problems = []
        for t, (theirs_alt, name) in want.items():
            ours_alt = mine[t][0]
            if t == "object":
                problems += self._objects(ours_alt, theirs_alt, name or where, where)
            elif t == "array":
                problems += self.compare(ours_alt.get("items", {}), theirs_alt.get("items", {}), f"{where}[]")
            elif t != "null":
                problems += self._enums(ours_alt, theirs_alt, where, allowed.get("extra_enum", set()))
        return problems

    @staticmethod
    def _enums(ours: Schema, theirs: Schema, where: str, extra: set[str]) -> list[str]:
        def values(s: Schema) -> set[Any] | None:
            return {s["const"]} if "const" in s else set(s["enum"]) if "enum" in s else None

        want = values(theirs)
        if want is None:
            return []  # any value in OpenAI's schema: pinning the one value sent only narrows it
        mine = values(ours)
        return [] if mine == want | extra else [f"{where}: enum {sorted(mine or [])}, OpenAI's {sorted(want | extra)}"]

    def _objects(self, ours: Schema, theirs: Schema, name: str, where: str) -> list[str]:
        mine, want = ours.get("properties", {}), theirs.get("properties", {})
        problems = []
        if set(mine) != set(want):
            problems.append(
                f"{where}: missing properties {sorted(set(want) - set(mine))}, extra {sorted(set(mine) - set(want))}"
            )
        required = set(theirs.get("required", []))
        if set(ours.get("required", [])) != required:
            problems.append(f"{where}: required {sorted(ours.get('required', []))}, OpenAI's {sorted(required)}")
        if "additionalProperties" in theirs or "additionalProperties" in ours:
            problems += self.compare(
                ours.get("additionalProperties", {}), theirs.get("additionalProperties", {}), f"{where}.*"
            )
        for prop in sorted(set(mine) & set(want)):
            problems += self.compare(
                mine[prop],
                want[prop],
                f"{where}.{prop}",
                optional=prop not in required,
                allowed=KNOWN_DEVIATIONS.get((name, prop)),
            )
        return problems


@pytest.mark.parametrize(("method", "openai_path", "path"), ROUTES, ids=[f"{m.upper()} {p}" for m, _, p in ROUTES])
def test_response_matches_openais_schema(method: str, openai_path: str, path: str) -> None:
    comparison = Comparison(app_document(), openai_document())
    ours, theirs = ok_schema(app_document(), method, path), ok_schema(openai_document(), method, openai_path)
    assert comparison.compare(ours, theirs, f"{method.upper()} {path}") == []


@pytest.mark.parametrize(("method", "path"), [(m, p) for m, _, p in ROUTES] + [("get", "/v1/files/{file_id}/content")])
def test_errors_are_declared_in_openais_envelope(method: str, path: str) -> None:
    responses = app_document()["paths"][path][method]["responses"]
    comparison = Comparison(app_document(), openai_document())
    for status in ERROR_STATUSES:
        ours = responses[status]["content"]["application/json"]["schema"]
        envelope = {"$ref": "#/components/schemas/ErrorResponse"}
        assert comparison.compare(ours, envelope, f"{method.upper()} {path} {status}") == []
    assert "422" not in responses  # a bad request answers 400 in the envelope, never FastAPI's 422


def test_every_route_declares_its_response_model() -> None:
    for path, operations in app_document()["paths"].items():
        for method in operations:
            if path.endswith(("/content", "/partial_output")):  # they stream JSONL or bytes
                continue  # a file's bytes
            assert ok_schema(app_document(), method, path).get("$ref"), f"{method.upper()} {path}: no response model"


def _rename(s: Schema) -> None:
    s["properties"]["file_name"] = s["properties"].pop("filename")
    s["required"] = ["file_name" if r == "filename" else r for r in s["required"]]


def _drop(s: Schema) -> None:
    del s["properties"]["bytes"]
    s["required"].remove("bytes")


def _make_optional(s: Schema) -> None:
    s["required"].remove("created_at")
    s["properties"]["created_at"] = {"anyOf": [{"type": "integer"}, {"type": "null"}]}


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(_rename, id="renamed"),
        pytest.param(_drop, id="dropped"),
        pytest.param(_make_optional, id="made-optional"),
        pytest.param(lambda s: s["required"].remove("purpose"), id="not-required"),
        pytest.param(lambda s: s["properties"].update(bytes={"type": "string"}), id="retyped"),
        pytest.param(lambda s: s["properties"]["status"].update(enum=["processed"]), id="enum-changed"),
        pytest.param(lambda s: s["properties"]["expires_at"].update(anyOf=[{"type": "integer"}]), id="not-nullable"),
    ],
)
def test_the_comparison_catches_a_changed_field(change: Callable[[Schema], None]) -> None:
    changed = copy.deepcopy(app_document())
    change(changed["components"]["schemas"]["FileObject"])
    comparison = Comparison(changed, openai_document())
    for method, openai_path, path in ROUTES[:4]:  # FileObject directly, in a list, and beside a delete
        problems = comparison.compare(ok_schema(changed, method, path), ok_schema(openai_document(), method, openai_path), path)  # fmt: skip
        if path == "/v1/files/{file_id}" and method == "delete":
            assert problems == []  # FileDeleted does not hold a FileObject
        else:
            assert problems, f"{method} {path}: the change went unnoticed"
