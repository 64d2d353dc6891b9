"""The request index written at validation (COPY on Postgres, multi-row INSERTs on SQLite):
every column as the rows say, the same rows when redone, and nothing left by a write that
died midway, so the next attempt starts clean."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs.models import Batch, BatchRequest, BatchStatus, RequestState
from backfill.jobs.validation.outcome import apply_validation
from backfill.jobs.validation.request_index import INDEX_COLUMNS, RequestIndex
from backfill.jobs.validation.scan import Limits, ValidationResult, validate_lines
from tests.factories import make_submitted_batch, make_team

CHAT = "/v1/chat/completions"
SHARED = "You are a careful assistant who reads the whole attached document before answering. " * 8


def _file(lines: int) -> bytes:
    rows = []
    for i in range(lines):
        # Tabs, newlines, CRs, backslashes, quotes and non-ASCII in custom_ids: what COPY's text
        # format escapes (and `\\N`, its NULL, as a custom_id's own text).
        custom_id = f'id\t{i}\\n"é{i}\r\n\\N' if i % 3 == 0 else f"r{i}"
        # Shared prefixes, and prompts extending others (whose lines then run after them).
        content = SHARED * 2 if i % 7 == 1 else SHARED + f"question {i}" if i % 2 else f"short {i}"
        body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": content}]}
        if i % 5 == 0:
            body["n"] = 2
        rows.append(orjson.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}))
    return b"\n".join(rows[:5]) + b"\n\n" + b"\n".join(rows[5:]) + b"\n"  # a blank line: gaps in line numbers


def _validated(lines: int) -> ValidationResult:
    result = validate_lines(
        [_file(lines)],
        endpoint=CHAT,
        served_models=None,
        limits=Limits(max_requests=lines, max_line_bytes=1 << 20, max_errors=10),
    )
    assert not result.errors and len(result.requests) == lines
    return result


def _new_batch(db: sessionmaker[Session]) -> str:
    with db.begin() as s:
        return make_submitted_batch(s, make_team(s)).id


def _stored(db: sessionmaker[Session], batch_id: str) -> list[dict[str, Any]]:
    with db() as s:
        rows = s.execute(select(BatchRequest).where(BatchRequest.batch_id == batch_id).order_by(BatchRequest.line))
        return [
            {**{c: getattr(r, c) for c in INDEX_COLUMNS}, "state": r.state, "attempts": r.attempts}
            for r in rows.scalars()
        ]


class _Dies(RequestIndex):
    """An index whose row stream fails partway, as a worker killed during the write would."""

    def __init__(self, inner: RequestIndex, after: int) -> None:
        super().__init__()
        self.inner, self.after = inner, after

    def __len__(self) -> int:
        return len(self.inner)

    def rows(self, ranks: range | None = None) -> Iterator[tuple[Any, ...]]:
        for n, row in enumerate(self.inner.rows(ranks)):
            if n == self.after:
                raise RuntimeError("worker killed")
            yield row


def test_index_rows_are_stored_as_validated(db: sessionmaker[Session]) -> None:
    result = _validated(1200)
    batch_id = _new_batch(db)
    with db.begin() as s:
        assert apply_validation(s, batch_id=batch_id, result=result) == BatchStatus.in_progress
    stored = _stored(db, batch_id)
    expected = [{**row, "state": RequestState.pending, "attempts": 0} for row in result.requests]
    assert stored == expected
    # The plan's columns went through too.
    assert any(r["after_line"] for r in stored) and any(r["prefix_tokens"] for r in stored)
    assert any("\t" in r["custom_id"] and "\\" in r["custom_id"] and "\r\n" in r["custom_id"] for r in stored)


def test_a_write_killed_midway_leaves_nothing_and_the_next_attempt_starts_clean(db: sessionmaker[Session]) -> None:
    result = _validated(1200)
    batch_id = _new_batch(db)
    died = ValidationResult(requests=_Dies(result.requests, after=700), model=result.model)
    with pytest.raises(RuntimeError, match="worker killed"), db.begin() as s:
        apply_validation(s, batch_id=batch_id, result=died)
    assert _stored(db, batch_id) == []
    with db() as s:
        batch = s.get(Batch, batch_id)
        assert batch is not None and batch.status == BatchStatus.validating and batch.total == 0
    for _ in range(2):  # the retry, then a redelivered message: the same rows, once
        with db.begin() as s:
            apply_validation(s, batch_id=batch_id, result=result)
        assert [r["line"] for r in _stored(db, batch_id)] == [r["line"] for r in result.requests]
    with db() as s:
        batch = s.get(Batch, batch_id)
        assert batch is not None and batch.status == BatchStatus.in_progress and batch.total == 1200
