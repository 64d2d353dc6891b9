"""The failed-auth limit behind a proxy (every client shares the proxy's address): bogus keys
from one address must not lock out any valid key, even one this process has never seen, while
a made-up key from a limited address gets 429 without an authentication (and, repeated, without
even a lookup). IPv6 clients count per /64. And `backfill api` hands uvicorn the proxies it may
trust, so the limit counts the real client address behind them."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from backfill.storage.process_state import reset as reset_process_state
from tests.api.test_upload import api_key, build_app
from tests.api.test_upload import service as service  # the fixture: env and caches for an in-process server

PROXY = ("10.42.0.17", 41000)  # the ingress pod every client appears as


def _get(client: TestClient, key: str) -> httpx.Response:
    return client.get("/v1/files", headers={"Authorization": f"Bearer {key}"})


@pytest.mark.usefixtures("service")
def test_a_valid_key_always_passes_a_limited_address_and_guesses_get_429_without_authentication(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from backfill.jobs.teams import authenticate

    monkeypatch.setenv("BACKFILL_AUTH_FAILURE_LIMIT", "5/minute")
    lookups: list[str | None] = []

    def counted(session: object, raw_key: str | None) -> object:
        lookups.append(raw_key)
        return authenticate(session, raw_key)  # type: ignore[arg-type]

    monkeypatch.setattr("backfill.api.deps.authenticate", counted)
    _, known = api_key()
    _, brand_new = api_key()
    with TestClient(build_app(), client=PROXY) as proxy:
        assert _get(proxy, known).status_code == 200  # it authenticated before, from this address
        flood = [_get(proxy, f"sk-made-up-{n:04d}").status_code for n in range(12)]
        lookups.clear()
        known_again = [_get(proxy, known) for _ in range(3)]
        lookups_for_known = len(lookups)
        unknown = _get(proxy, "sk-made-up-9999")
        new_valid = _get(proxy, brand_new)  # never seen by this process: looked up, and passes
        lookups_after = len(lookups)
    assert flood == [401] * 5 + [429] * 7
    assert [r.status_code for r in known_again] == [200] * 3, known_again[0].text
    assert lookups_for_known == 3  # it is still authenticated by the keys table, every time
    assert unknown.status_code == 429 and unknown.json()["error"]["code"] == "rate_limit_exceeded"
    assert new_valid.status_code == 200, new_valid.text
    assert lookups_after == lookups_for_known + 1  # the refused guess cost no authentication


@pytest.mark.usefixtures("service")
def test_a_revoked_key_leaves_the_recent_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    from backfill.jobs.teams import revoke_key, visible_prefix
    from backfill.storage.db import unit_of_work

    monkeypatch.setenv("BACKFILL_AUTH_FAILURE_LIMIT", "2/minute")
    _, key = api_key()
    with TestClient(build_app(), client=PROXY) as proxy:
        assert _get(proxy, key).status_code == 200
        with unit_of_work() as session:
            revoke_key(session, key_id_or_prefix=visible_prefix(key))
        # Looked up (it was known), refused, counted as a failure and forgotten.
        assert [_get(proxy, key).status_code for _ in range(2)] == [401, 401]
        assert _get(proxy, key).status_code == 429


def test_recent_keys_are_bounded_and_expire() -> None:
    from backfill.api.recent_keys import RecentKeys

    clock = [1000.0]
    recent = RecentKeys(max_entries=3, ttl_s=60.0, clock=lambda: clock[0])
    for digest in ("a", "b", "c"):
        recent.add(digest)
    assert recent.contains("a")  # touches "a": "b" is now the least recent
    recent.add("d")
    assert [recent.contains(d) for d in ("a", "b", "c", "d")] == [True, False, True, True]
    assert len(recent) == 3
    clock[0] += 30.0
    recent.add("c")  # authenticated again: a fresh minute for it alone
    clock[0] += 31.0
    assert [recent.contains(d) for d in ("a", "c", "d")] == [False, True, False]
    assert len(recent) == 1
    recent.discard("c")
    assert not recent.contains("c") and len(recent) == 0


def test_backfill_api_trusts_the_configured_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    from backfill.cli import app

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: calls.append(kwargs))
    monkeypatch.setenv("BACKFILL_FORWARDED_ALLOW_IPS", "10.42.0.0/16,192.0.2.7")
    reset_process_state()
    try:
        result = CliRunner().invoke(app, ["api"])
        monkeypatch.setenv("BACKFILL_FORWARDED_ALLOW_IPS", "")
        reset_process_state()
        unset = CliRunner().invoke(app, ["api"])
    finally:
        reset_process_state()
    assert result.exit_code == 0 and unset.exit_code == 0, (result.output, unset.output)
    assert calls[0]["forwarded_allow_ips"] == "10.42.0.0/16,192.0.2.7" and calls[0]["proxy_headers"] is True
    # Unset: uvicorn's own default (loopback only, or its FORWARDED_ALLOW_IPS variable).
    assert calls[1]["forwarded_allow_ips"] is None and calls[1]["proxy_headers"] is True


@pytest.mark.usefixtures("service")
def test_a_repeated_guess_costs_one_lookup_and_ipv6_counts_per_64(monkeypatch: pytest.MonkeyPatch) -> None:
    from backfill.api import ratelimit

    monkeypatch.setenv("BACKFILL_AUTH_FAILURE_LIMIT", "3/minute")
    checked: list[str] = []
    real = ratelimit._digest_is_live

    def counted(digest: str) -> bool:
        checked.append(digest)
        return real(digest)

    monkeypatch.setattr(ratelimit, "_digest_is_live", counted)
    _, valid = api_key()
    app = build_app()
    with (
        TestClient(app, client=("2001:db8:1:2::10", 40000)) as one,
        TestClient(app, client=("2001:db8:1:2:ffff::99", 40001)) as same_64,
        TestClient(app, client=("2001:db8:1:3::10", 40002)) as next_64,
    ):
        assert [_get(one, f"sk-made-up-{n}").status_code for n in range(3)] == [401] * 3
        repeated = [_get(same_64, "sk-made-up-again").status_code for _ in range(5)]
        assert _get(same_64, valid).status_code == 200
        assert _get(next_64, "sk-made-up-elsewhere").status_code == 401
    assert repeated == [429] * 5  # another address of the same /64: the same count
    assert len(checked) == 2  # the repeated guess was looked up once; the valid key once
    assert ratelimit.counted_address("::ffff:198.51.100.7") == "198.51.100.7"
    assert ratelimit.counted_address("2001:db8::1") == "2001:db8::/64"
