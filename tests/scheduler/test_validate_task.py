"""The validation task in-process on the real Postgres, Redis and fleet: one attempt at a time
per batch, transient failures wait for the scheduler's nudge, anything else fails the batch."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from jobs.models import Batch, BatchStatus, File, utcnow
from jobs.teams import get_or_create_team


def _lines(n: int) -> bytes:
    return b"".join(
        b'{"custom_id": "c%d", "method": "POST", "url": "/v1/chat/completions", '
        b'"body": {"model": "tiny-chat", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}}\n' % i
        for i in range(n)
    )


def _reset() -> None:
    from jobs import catalog
    from scheduler import leases
    from storage.db import _session_factory, get_engine
    from storage.objects import get_object_store
    from storage.settings import get_settings

    if get_engine.cache_info().currsize:
        get_engine().dispose()
    for cached in (get_settings, get_engine, _session_factory, get_object_store):
        cached.cache_clear()
    catalog._catalog = None
    leases._store = None


@pytest.fixture
def env(scratch_pg_url: str, redis_url: str, fleet: object, tmp_path: Path) -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BACKFILL_DATABASE_URL", scratch_pg_url)
        mp.setenv("BACKFILL_REDIS_URL", redis_url)
        mp.setenv("BACKFILL_HOME", str(tmp_path))
        mp.setenv("BACKFILL_S3_ENDPOINT_URL", "")
        mp.setenv("BACKFILL_FLEET_URLS", fleet.base_url)  # type: ignore[attr-defined]
        _reset()
        yield mp
    _reset()


def _batch(content: bytes | None) -> str:
    from storage.db import unit_of_work
    from storage.objects import get_object_store

    with unit_of_work() as s:
        team = get_or_create_team(s, name=f"t-{secrets.token_hex(4)}").id
        key = f"files/{team}/in-{secrets.token_hex(4)}"
        if content is not None:
            get_object_store().put(key, [content])
        f = File(team_id=team, purpose="batch", filename="in.jsonl", bytes=len(content or b""), object_key=key)
        s.add(f)
        s.flush()
        b = Batch(
            team_id=team,
            input_file_id=key.rsplit("/", 1)[1],
            endpoint="/v1/chat/completions",
            completion_window="24h",
            expires_at=utcnow() + timedelta(hours=1),
        )
        s.add(b)
        s.flush()
        return b.id


def _status(batch_id: str) -> tuple[BatchStatus, list[dict[str, object]] | None]:
    from storage.db import unit_of_work

    with unit_of_work() as s:
        b = s.get(Batch, batch_id)
        assert b is not None
        return b.status, b.errors


def test_validates_and_a_second_message_while_one_runs_does_nothing(env: pytest.MonkeyPatch) -> None:
    from scheduler.leases import exclusive_lease, get_lease_store
    from scheduler.tasks import validate_batch

    batch_id = _batch(_lines(3))
    with exclusive_lease(get_lease_store(), f"validate:{batch_id}", ttl_s=30) as mine:
        assert mine
        assert validate_batch(batch_id) == "busy"  # a redelivered or re-nudged message
    assert _status(batch_id)[0] == BatchStatus.validating
    assert validate_batch(batch_id) == BatchStatus.in_progress


def test_an_unexpected_failure_fails_the_batch_with_a_clear_error(env: pytest.MonkeyPatch) -> None:
    from scheduler.tasks import validate_batch

    batch_id = _batch(None)  # the input object is gone: no retry can bring it back
    assert validate_batch(batch_id) == BatchStatus.failed
    status, errors = _status(batch_id)
    assert status == BatchStatus.failed
    assert errors and errors[0]["code"] == "validation_failed", errors


def test_an_unreachable_fleet_leaves_the_batch_to_the_next_nudge(env: pytest.MonkeyPatch) -> None:
    from scheduler.tasks import validate_batch

    batch_id = _batch(_lines(1))
    env.setenv("BACKFILL_FLEET_URLS", "http://127.0.0.1:9/v1")
    _reset()
    assert validate_batch(batch_id) == "waiting"
    assert _status(batch_id) == (BatchStatus.validating, None)
