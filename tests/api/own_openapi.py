"""Hold a response to what the app's own OpenAPI document declares for its route and status."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

import jsonschema


@lru_cache
def _route_patterns(paths: tuple[str, ...]) -> list[tuple[re.Pattern[str], str]]:
    patterns = []
    for path in paths:
        regex = re.sub(r"\{[^}]+\}", "[^/]+", path)
        if path.endswith("{model_id}"):  # declared `{model_id:path}`: a model id may hold slashes
            regex = regex[: -len("[^/]+")] + ".+"
        patterns.append((re.compile(f"^{regex}$"), path))
    # Literal segments first, so /files/{file_id}/content never matches as /files/{file_id}.
    return sorted(patterns, key=lambda p: p[1].count("{"))


def route_of(document: dict[str, Any], method: str, path: str) -> str | None:
    for pattern, template in _route_patterns(tuple(document["paths"])):
        if pattern.match(path) and method.lower() in document["paths"][template]:
            return template
    return None


def check_response(document: dict[str, Any], response: Any) -> None:
    """The status is one the route declares, and a JSON body matches the declared schema.
    `response` is an httpx-style response (Starlette's TestClient brings its own httpx)."""
    method, path = response.request.method, response.request.url.path
    template = route_of(document, method, path)
    if template is None:
        assert response.status_code in (404, 405), f"{method} {path} is not in the OpenAPI document"
        return
    declared = document["paths"][template][method.lower()]["responses"]
    status = str(response.status_code)
    assert status in declared, f"{method} {template} answered {status}, which it does not declare: {sorted(declared)}"
    schema = declared[status].get("content", {}).get("application/json", {}).get("schema")
    if schema is None:
        return
    root = {**schema, "components": document.get("components", {})}
    jsonschema.Draft202012Validator(root).validate(response.json())
