"""Validate responses against the official OpenAI OpenAPI schemas (Files + Batches subset).

OpenAI's live API sends null for unset optional fields although the schemas type them
non-nullable (the spec file says so); optional properties therefore also accept null.
Required properties are checked exactly as written.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SPEC_PATH = Path(__file__).with_name("openai-batch-openapi.yaml")


@lru_cache
def _components() -> dict[str, Any]:
    spec = yaml.safe_load(SPEC_PATH.read_text())
    schemas = copy.deepcopy(spec["components"]["schemas"])
    for schema in schemas.values():
        _allow_null_optionals(schema)
    return schemas


def _allow_null_optionals(schema: Any) -> None:
    if isinstance(schema, dict):
        props = schema.get("properties")
        if isinstance(props, dict):
            required = set(schema.get("required", []))
            for name, sub in list(props.items()):
                _allow_null_optionals(sub)
                if name not in required:
                    props[name] = {"anyOf": [sub, {"type": "null"}]}
        for key in ("items", "anyOf", "oneOf", "allOf"):
            sub = schema.get(key)
            if isinstance(sub, list):
                for s in sub:
                    _allow_null_optionals(s)
            elif isinstance(sub, dict):
                _allow_null_optionals(sub)


def validate(instance: Any, schema_name: str) -> None:
    components = _components()
    root = {"$ref": f"#/components/schemas/{schema_name}", "components": {"schemas": components}}
    jsonschema.Draft202012Validator(root).validate(instance)
