"""Per-key rate limit over real HTTP: in memory, and shared through the real Redis."""

from __future__ import annotations

import hashlib
import time

import httpx
import pytest
import redis

from backfill.api.ratelimit import KEY_PREFIX
from tests.api.test_upload import api_key, build_app, serve
from tests.api.test_upload import service as service  # the fixture: env and caches for an in-process server

pytestmark = pytest.mark.usefixtures("service")


def _get(port: int, key: str, path: str = "/v1/files") -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=10)


def test_requests_over_the_limit_get_openai_429(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BACKFILL_RATE_LIMIT", "5/minute")
    _, key = api_key()
    _, other = api_key()
    with serve(build_app()) as port:
        assert [_get(port, key).status_code for _ in range(5)] == [200] * 5
        refused = _get(port, key)
        # The probes are never limited, and another key has its own window.
        health = [_get(port, key, "/health").status_code for _ in range(10)]
        other_status = _get(port, other).status_code
    assert refused.status_code == 429, refused.text
    assert set(refused.json()) == {"error"}
    error = refused.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("requests", "rate_limit_exceeded", None)
    assert "5 per minute" in error["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert refused.headers["x-ratelimit-limit-requests"] == "5"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert health == [200] * 10
    assert other_status == 200


def test_window_moves_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BACKFILL_RATE_LIMIT", "3/2seconds")
    _, key = api_key()
    with serve(build_app()) as port:
        assert [_get(port, key).status_code for _ in range(4)] == [200, 200, 200, 429]
        time.sleep(2.2)
        assert _get(port, key).status_code == 200


def test_limit_is_shared_through_redis_and_never_holds_the_key(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BACKFILL_RATE_LIMIT", "4/minute")
    monkeypatch.setenv("BACKFILL_REDIS_URL", redis_url)
    _, key = api_key()
    # Two API processes' worth of middleware: each counts the other's requests.
    with serve(build_app()) as port_a, serve(build_app()) as port_b:
        statuses = [_get(port, key).status_code for port in (port_a, port_b, port_a, port_b, port_a, port_b)]
    assert statuses == [200, 200, 200, 200, 429, 429]
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    stored = [str(k) for k in client.scan_iter(f"{KEY_PREFIX}*")]
    digest = hashlib.sha256(key.encode()).hexdigest()
    assert any(digest in k for k in stored)
    for k in stored:
        assert key not in k
        if client.type(k) == "list":
            assert not any(key in str(member) for member in client.lrange(k, 0, -1))


def test_broken_redis_lets_requests_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BACKFILL_RATE_LIMIT", "1/minute")
    monkeypatch.setenv("BACKFILL_REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens there
    _, key = api_key()
    with serve(build_app()) as port:
        started = time.monotonic()
        assert [_get(port, key).status_code for _ in range(3)] == [200] * 3
        assert time.monotonic() - started < 10


def test_requests_without_a_key_are_left_to_authentication(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BACKFILL_RATE_LIMIT", "1/minute")
    with serve(build_app()) as port:
        statuses = [httpx.get(f"http://127.0.0.1:{port}/v1/files", timeout=10).status_code for _ in range(3)]
    assert statuses == [401] * 3


def test_failed_authentications_are_limited_by_client_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flood of made-up keys from one address: each costs an authentication until the address
    has failed too often, then 429 without one; a valid key from that address still passes (it
    is looked up by its digest), and other addresses are not affected."""
    from fastapi.testclient import TestClient

    from backfill.jobs.teams import authenticate

    monkeypatch.setenv("BACKFILL_AUTH_FAILURE_LIMIT", "5/minute")
    lookups: list[str | None] = []

    def counted(session: object, raw_key: str | None) -> object:
        lookups.append(raw_key)
        return authenticate(session, raw_key)  # type: ignore[arg-type]

    monkeypatch.setattr("backfill.api.deps.authenticate", counted)
    _, good = api_key()
    app = build_app()
    with (
        TestClient(app, client=("198.51.100.7", 40000)) as attacker,
        TestClient(app, client=("203.0.113.9", 40001)) as other,
    ):
        statuses = [_bad(attacker, n).status_code for n in range(5)]
        refused = [_bad(attacker, n) for n in range(5, 25)]
        lookups_after_flood = len(lookups)
        good_from_attacker = attacker.get("/v1/files", headers={"Authorization": f"Bearer {good}"})
        good_from_other = other.get("/v1/files", headers={"Authorization": f"Bearer {good}"})
        bad_from_other = _bad(other, 99)
    assert statuses == [401] * 5
    assert {r.status_code for r in refused} == {429}
    assert lookups_after_flood == 5  # the refused ones never reached the keys table
    error = refused[0].json()["error"]
    assert set(refused[0].json()) == {"error"} and error["code"] == "rate_limit_exceeded"
    assert 1 <= int(refused[0].headers["retry-after"]) <= 60
    assert good_from_attacker.status_code == 200  # never refused for the address it shares
    assert good_from_other.status_code == 200 and bad_from_other.status_code == 401


def _bad(client: object, n: int) -> httpx.Response:
    return client.get("/v1/files", headers={"Authorization": f"Bearer sk-made-up-{n:04d}"})  # type: ignore[attr-defined, no-any-return]
