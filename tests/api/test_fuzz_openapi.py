"""Schemathesis against the app's own OpenAPI document: generated requests (valid and not) to
every route, on the real Postgres, must never get a 5xx (but the documented 503 of an
unreachable fleet), and every response must be what the
document says (status code declared, body matching its schema)."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import response_schema_conformance, status_code_conformance

from tests.api.conftest import ApiEnv, CheckedClient, _new_team
from tests.api.test_batches import create

EXAMPLES_PER_ROUTE = 25


def test_no_route_answers_5xx_or_off_schema(api: CheckedClient, api_env: ApiEnv) -> None:
    team = _new_team(api, api_env.admin_key)
    schema = schemathesis.openapi.from_asgi("/openapi.json", api.fastapi_app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20, [op.label for op in operations]
    failures: list[str] = []
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_ROUTE, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        def run(case: schemathesis.Case) -> None:
            case.headers = {**(case.headers or {}), **team.headers}
            response = case.call()
            case.validate_response(response, checks=[status_code_conformance, response_schema_conformance])
            # These tests run with the fleet unreachable: /v1/models must say so (503, documented).
            # Any other 5xx is a bug.
            if response.status_code >= 500:
                assert response.status_code == 503 and response.json()["error"]["code"] == "fleet_unavailable", (
                    f"{case.method} {case.formatted_path} -> {response.status_code} {response.text[:500]}"
                )

        try:
            run()
        except Exception as exc:  # noqa: BLE001 - collected, so one report names every failing route
            failures.append(f"{operation.label}: {str(exc)[:1500]}")
    assert not failures, "\n\n".join(failures)


# Path parameters that name a team's own objects: team B is fuzzed with team A's.
OWNED_PATH_PARAMETERS = ("file_id", "batch_id", "webhook_endpoint_id", "project_id", "key_id")


def test_one_team_never_reaches_anothers_objects(api: CheckedClient, api_env: ApiEnv) -> None:
    """Team A creates a file, a batch and a webhook endpoint; generated requests as team B, with
    A's ids in every path parameter that names an object, never succeed and never fail with a
    5xx; and A's objects are all still there afterwards."""
    owner, intruder = _new_team(api, api_env.admin_key), _new_team(api, api_env.admin_key)
    batch = create(api, owner)
    endpoint = api.post(
        "/v1/webhook_endpoints",
        headers=owner.headers,
        json={"name": "a", "url": "http://127.0.0.1:9/hooks", "event_types": ["batch.failed"]},
    )
    assert endpoint.status_code == 200, endpoint.text
    admin = {"Authorization": f"Bearer {api_env.admin_key}"}
    keys = api.get(f"/v1/organization/projects/{owner.project_id}/api_keys", headers=admin).json()["data"]
    owned = {
        "file_id": str(batch["input_file_id"]),
        "batch_id": str(batch["id"]),
        "webhook_endpoint_id": str(endpoint.json()["id"]),
        "project_id": owner.project_id,
        "key_id": str(keys[0]["id"]),
    }
    schema = schemathesis.openapi.from_asgi("/openapi.json", api.fastapi_app)
    operations = [result.ok() for result in schema.get_all_operations()]
    targeted = [op for op in operations if {p.name for p in op.path_parameters} & set(OWNED_PATH_PARAMETERS)]
    assert len(targeted) >= 10, [op.label for op in targeted]
    failures: list[str] = []
    seen: set[tuple[str, int]] = set()
    for operation in targeted:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_ROUTE, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        def run(case: schemathesis.Case) -> None:
            case.path_parameters = {
                name: owned.get(name, value) for name, value in (case.path_parameters or {}).items()
            }
            case.headers = {**(case.headers or {}), **intruder.headers}
            response = case.call()
            seen.add((case.operation.label, response.status_code))
            case.validate_response(response, checks=[status_code_conformance, response_schema_conformance])
            where = f"{case.method} {case.formatted_path} -> {response.status_code} {response.text[:300]}"
            assert response.status_code < 500, where
            assert not 200 <= response.status_code < 300, where

        try:
            run()
        except Exception as exc:  # noqa: BLE001 - collected, so one report names every failing route
            failures.append(f"{operation.label}: {str(exc)[:1500]}")
    assert not failures, "\n\n".join(failures)
    # A's ids reached the routes: every targeted route refused some request as not found
    # (objects) or forbidden (the organization's routes need an admin key).
    refused = {label for label, status in seen if status in (403, 404)}
    assert refused == {op.label for op in targeted}, sorted(seen)
    for path in (
        f"/v1/files/{owned['file_id']}",
        f"/v1/batches/{owned['batch_id']}",
        f"/v1/webhook_endpoints/{owned['webhook_endpoint_id']}",
    ):
        assert api.get(path, headers=owner.headers).status_code == 200, path
    assert api.get(f"/v1/organization/projects/{owner.project_id}/api_keys", headers=admin).json()["data"] == keys
