"""The validation task in-process on the real Postgres, Redis and fleet: one attempt at a time
per batch, transient failures wait for the scheduler's nudge, anything else fails the batch."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from backfill.jobs.models import Batch, BatchRequest, BatchStatus, File, utcnow
from backfill.jobs.teams import get_or_create_team
from backfill.storage.process_state import reset as reset_process_state
from tests.factories import make_submitted_batch


def _lines(n: int) -> bytes:
    return b"".join(
        b'{"custom_id": "c%d", "method": "POST", "url": "/v1/chat/completions", '
        b'"body": {"model": "tiny-chat", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}}\n' % i
        for i in range(n)
    )


@pytest.fixture
def env(scratch_pg_url: str, redis_url: str, fleet: object, tmp_path: Path) -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BACKFILL_DATABASE_URL", scratch_pg_url)
        mp.setenv("BACKFILL_REDIS_URL", redis_url)
        mp.setenv("BACKFILL_HOME", str(tmp_path))
        mp.setenv("BACKFILL_S3_ENDPOINT_URL", "")
        mp.setenv("BACKFILL_FLEET_URLS", fleet.base_url)  # type: ignore[attr-defined]
        reset_process_state()
        yield mp
    reset_process_state()


def _batch(content: bytes | None) -> str:
    from backfill.storage.db import unit_of_work
    from backfill.storage.objects import get_object_store

    with unit_of_work() as s:
        team = get_or_create_team(s, name=f"t-{secrets.token_hex(4)}").id
        key = f"files/{team}/in-{secrets.token_hex(4)}"
        if content is not None:
            get_object_store().put(key, [content])
        f = File(team_id=team, purpose="batch", filename="in.jsonl", bytes=len(content or b""), object_key=key)
        s.add(f)
        s.flush()
        return make_submitted_batch(s, team, input_file_id=key.rsplit("/", 1)[1], expires_in_s=3600).id


def _status(batch_id: str) -> tuple[BatchStatus, list[dict[str, object]] | None]:
    from backfill.storage.db import unit_of_work

    with unit_of_work() as s:
        b = s.get(Batch, batch_id)
        assert b is not None
        return b.status, b.errors


def test_validates_and_a_second_message_while_one_runs_does_nothing(env: pytest.MonkeyPatch) -> None:
    from backfill.scheduler.tasks import validate_batch
    from backfill.storage.leases import exclusive_lease, get_lease_store

    batch_id = _batch(_lines(3))
    with exclusive_lease(get_lease_store(), f"validate:{batch_id}", ttl_s=30) as mine:
        assert mine
        assert validate_batch(batch_id) == "busy"  # a redelivered or re-nudged message
    assert _status(batch_id)[0] == BatchStatus.validating
    assert validate_batch(batch_id) == BatchStatus.in_progress


def test_an_unexpected_failure_fails_the_batch_with_a_clear_error(env: pytest.MonkeyPatch) -> None:
    from backfill.scheduler.tasks import validate_batch

    batch_id = _batch(None)  # the input object is gone: no retry can bring it back
    assert validate_batch(batch_id) == BatchStatus.failed
    status, errors = _status(batch_id)
    assert status == BatchStatus.failed
    assert errors and errors[0]["code"] == "validation_failed", errors


def test_an_unreachable_fleet_leaves_the_batch_to_the_next_nudge(env: pytest.MonkeyPatch) -> None:
    from backfill.scheduler.tasks import validate_batch

    batch_id = _batch(_lines(1))
    env.setenv("BACKFILL_FLEET_URLS", "http://127.0.0.1:9/v1")
    reset_process_state()
    assert validate_batch(batch_id) == "waiting"
    assert _status(batch_id) == (BatchStatus.validating, None)


def test_a_validation_stopped_while_writing_its_index_is_resumed_by_the_next_nudge(env: pytest.MonkeyPatch) -> None:
    from contextlib import contextmanager

    from backfill.jobs import sweeps
    from backfill.jobs.validation import outcome as validation
    from backfill.scheduler.tasks import validate_batch
    from backfill.storage.db import unit_of_work

    env.setattr(validation, "FIRST_INDEX_PART", 5)
    env.setattr(validation, "INDEX_PART", 10)
    batch_id = _batch(_lines(60))
    real = validation.write_index_parts

    def killed_after_one_part(units: object, **kwargs: object) -> int:
        commits = {"n": 0}

        @contextmanager
        def dying() -> Iterator[object]:
            with unit_of_work() as s:
                yield s
                commits["n"] += 1
                if commits["n"] > 1:
                    raise RuntimeError("worker killed")

        return real(dying, **kwargs)  # type: ignore[arg-type]

    env.setattr(validation, "write_index_parts", killed_after_one_part)
    validate_batch(batch_id)
    with unit_of_work() as s:
        b = s.get(Batch, batch_id)
        assert b is not None and (b.status, b.total - b.unindexed, b.total) == (BatchStatus.in_progress, 15, 60)
        # What the scheduler loop nudges again (once the batch has been in progress a while).
        assert batch_id in sweeps.indexing_batches(s, started_before=utcnow() + timedelta(seconds=1))

    env.setattr(validation, "write_index_parts", real)
    assert validate_batch(batch_id) == "resumed"
    with unit_of_work() as s:
        b = s.get(Batch, batch_id)
        assert b is not None and (b.status, b.unindexed, b.total) == (BatchStatus.in_progress, 0, 60)
        lines = s.execute(select(BatchRequest.line).where(BatchRequest.batch_id == batch_id)).scalars().all()
        assert sorted(lines) == list(range(1, 61))  # each line once
        assert batch_id not in sweeps.indexing_batches(s, started_before=utcnow() + timedelta(seconds=1))
    assert validate_batch(batch_id) == BatchStatus.in_progress  # nothing left to do


def test_a_batch_cancelled_while_it_validates_ends_cancelled_and_its_index_stops(env: pytest.MonkeyPatch) -> None:
    from backfill.jobs import batches
    from backfill.jobs.output import finalize as output
    from backfill.jobs.validation import outcome as validation
    from backfill.scheduler.tasks import validate_batch
    from backfill.storage.db import unit_of_work
    from backfill.storage.objects import get_object_store

    def cancel(batch_id: str) -> None:
        with unit_of_work() as s:
            batches.cancel_batch(s, team_id=None, batch_id=batch_id)

    # A file with errors, the batch cancelled while it is checked: not `failed`.
    with_errors = _batch(_lines(3) + b"not json\n")
    real_apply = validation.apply_validation

    def cancelled_first(session: object, **kwargs: object) -> str:
        cancel(with_errors)
        return real_apply(session, **kwargs)  # type: ignore[arg-type]

    env.setattr(validation, "apply_validation", cancelled_first)
    assert validate_batch(with_errors) == BatchStatus.cancelling
    env.setattr(validation, "apply_validation", real_apply)
    assert _status(with_errors) == (BatchStatus.cancelling, None)
    assert output.finalize_batch(unit_of_work, get_object_store(), batch_id=with_errors) == BatchStatus.cancelled

    # A valid batch cancelled after its first index part: no part after it.
    env.setattr(validation, "FIRST_INDEX_PART", 5)
    env.setattr(validation, "INDEX_PART", 10)
    running = _batch(_lines(60))
    real_parts = validation.write_index_parts

    def cancelled_after_first_part(units: object, **kwargs: object) -> int:
        cancel(running)
        return real_parts(units, **kwargs)  # type: ignore[arg-type]

    env.setattr(validation, "write_index_parts", cancelled_after_first_part)
    assert validate_batch(running) == BatchStatus.in_progress
    with unit_of_work() as s:
        b = s.get(Batch, running)
        assert b is not None and (b.status, b.total, b.unindexed) == (BatchStatus.cancelling, 5, 0)
        assert len(s.execute(select(BatchRequest.line).where(BatchRequest.batch_id == running)).all()) == 5
    assert output.finalize_batch(unit_of_work, get_object_store(), batch_id=running) == BatchStatus.cancelled
