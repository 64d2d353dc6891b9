"""Every failure answers in OpenAI's envelope with OpenAI's status, in-process."""

from __future__ import annotations

from typing import Any

from tests.api.conftest import CheckedClient, Team
from tests.contract.spec import validate


def _error(r: Any, status: int) -> dict[str, object]:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    validate(body, "ErrorResponse")
    assert list(body["error"]) == ["message", "type", "param", "code"]
    return body["error"]  # type: ignore[no-any-return]


def test_401_without_a_key_with_a_bad_one_or_a_revoked_one(
    api: CheckedClient, team: Team, admin_headers: dict[str, str]
) -> None:
    for headers in ({}, {"Authorization": "Bearer sk-nope"}, {"Authorization": "Basic abc"}):
        for method, path in (("GET", "/v1/files"), ("POST", "/v1/batches"), ("GET", "/v1/models")):
            r = api.request(method, path, headers=headers, json={})
            err = _error(r, 401)
            assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
    keys = api.get(f"/v1/organization/projects/{team.project_id}/api_keys", headers=admin_headers).json()
    api.delete(f"/v1/organization/projects/{team.project_id}/api_keys/{keys['data'][0]['id']}", headers=admin_headers)
    _error(api.get("/v1/files", headers=team.headers), 401)


def test_403_for_admin_routes_with_a_project_key(api: CheckedClient, team: Team) -> None:
    err = _error(api.get("/v1/organization/projects", headers=team.headers), 403)
    assert err["type"] == "permission_error"


def test_400s(api: CheckedClient, team: Team) -> None:
    h = team.headers
    assert _error(api.get("/v1/batches", headers=h, params={"limit": 0}), 400)["param"] == "limit"
    assert _error(api.get("/v1/batches", headers=h, params={"limit": 101}), 400)["param"] == "limit"
    assert _error(api.get("/v1/files", headers=h, params={"order": "sideways"}), 400)["param"] == "order"
    _error(api.post("/v1/batches", headers={**h, "Content-Type": "application/json"}, content=b"{oops"), 400)
    _error(api.post("/v1/files", headers=h, content=b"{}"), 400)


def test_404s(api: CheckedClient, team: Team) -> None:
    for method, path in (
        ("GET", "/v1/files/file-doesnotexist"),
        ("GET", "/v1/files/garbage"),
        ("GET", "/v1/files/file-doesnotexist/content"),
        ("DELETE", "/v1/files/file-doesnotexist"),
        ("GET", "/v1/batches/batch_doesnotexist"),
        ("GET", "/v1/batches/nonsense"),
        ("POST", "/v1/batches/batch_doesnotexist/cancel"),
    ):
        assert _error(api.request(method, path, headers=team.headers), 404)["type"] == "invalid_request_error"
    err = _error(api.get("/nowhere", headers=team.headers), 404)
    assert err["message"] == "Invalid URL (GET /nowhere)" and err["code"] is None


def test_413_for_an_oversize_json_body(api: CheckedClient, team: Team) -> None:
    body = {"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    r = api.post("/v1/batches", headers=team.headers, json={**body, "metadata": {"k": "v" * (2 * 1024 * 1024)}})
    assert _error(r, 413)["code"] == "request_too_large"


def test_503_when_the_fleet_is_unreachable(api: CheckedClient, team: Team) -> None:
    for path in ("/v1/models", "/v1/models/tiny-chat"):
        err = _error(api.get(path, headers=team.headers), 503)
        assert err["type"] == "server_error" and err["code"] == "fleet_unavailable"
