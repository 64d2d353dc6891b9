"""Finalization: output.jsonl and error.jsonl in OpenAI's line format, then the terminal status.

Object keys and file ids derive from the batch id, so finalizing twice (a crash between
writing the files and the status change) rewrites the same bytes and the same rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import orjson
from sqlalchemy import case, func, select, update
from sqlalchemy.orm import Session

from jobs.models import Batch, BatchRequest, BatchStatus, File, RequestState, utcnow
from storage.objects import ObjectStore

ERROR_MESSAGES = {
    RequestState.cancelled: ("batch_cancelled", "This request was not executed because the batch was cancelled."),
    RequestState.expired: (
        "batch_expired",
        "This request could not be executed before the completion window expired.",
    ),
}
_ROWS_PER_FETCH = 1000


def derived_file_id(batch_id: str, kind: str) -> str:
    return hashlib.blake2b(f"{batch_id}:{kind}".encode(), digest_size=12).hexdigest()


def output_key(team_id: str, batch_id: str, kind: str) -> str:
    return f"batches/{team_id}/{batch_id}/{kind}.jsonl"


def _line(row: BatchRequest) -> bytes:
    head = (
        b'{"id":'
        + orjson.dumps(f"batch_req_{row.result_id or row.line}")
        + b',"custom_id":'
        + orjson.dumps(row.custom_id)
    )
    if row.state in ERROR_MESSAGES:
        code, message = ERROR_MESSAGES[RequestState(row.state)]
        error = orjson.dumps({"code": code, "message": message})
        return head + b',"response":null,"error":' + error + b"}\n"
    # The fleet's body is embedded as the JSON bytes it sent (normalised when recorded).
    response = (
        b'{"status_code":'
        + str(row.status_code).encode()
        + b',"request_id":'
        + orjson.dumps(row.request_id or "")
        + b',"body":'
        + (row.response_body or "null").encode()
        + b"}"
    )
    return head + b',"response":' + response + b',"error":null}\n'


def _lines(session: Session, batch_id: str, states: Sequence[str]) -> Iterator[bytes]:
    rows = session.execute(
        select(BatchRequest)
        .where(BatchRequest.batch_id == batch_id, BatchRequest.state.in_(states))
        .order_by(BatchRequest.line)
        .execution_options(yield_per=_ROWS_PER_FETCH)
    ).scalars()
    for row in rows:
        yield _line(row)
        session.expunge(row)


def finalize_batch(session: Session, store: ObjectStore, *, batch_id: str) -> str | None:
    """Write the result files and move the batch to its terminal status. Idempotent."""
    batch = session.get(Batch, batch_id)
    if batch is None:
        return None
    if batch.status == BatchStatus.in_progress:
        session.execute(
            update(Batch)
            .where(Batch.id == batch_id, Batch.status == BatchStatus.in_progress)
            .values(status=BatchStatus.finalizing, finalizing_at=utcnow())
        )
        session.refresh(batch)
    if batch.status not in (BatchStatus.finalizing, BatchStatus.cancelling):
        return batch.status
    unfinished = session.execute(
        select(func.count()).where(
            BatchRequest.batch_id == batch_id,
            BatchRequest.state.in_([RequestState.pending, RequestState.running]),
        )
    ).scalar_one()
    if unfinished:
        return batch.status

    counts = dict(
        session.execute(
            select(BatchRequest.state, func.count())
            .where(BatchRequest.batch_id == batch_id)
            .group_by(BatchRequest.state)
        ).all()
    )
    succeeded = counts.get(RequestState.succeeded, 0)
    errored = sum(counts.get(s, 0) for s in (RequestState.failed, RequestState.cancelled, RequestState.expired))
    now = utcnow()
    expires = now + timedelta(seconds=batch.output_expires_after_s) if batch.output_expires_after_s else None
    file_ids: dict[str, str | None] = {"output": None, "error": None}
    for kind, n, states in (
        ("output", succeeded, [RequestState.succeeded]),
        ("error", errored, [RequestState.failed, RequestState.cancelled, RequestState.expired]),
    ):
        if not n:
            continue
        key = output_key(batch.team_id, batch_id, kind)
        size = store.put(key, _lines(session, batch_id, states))
        file_id = derived_file_id(batch_id, kind)
        session.merge(
            File(
                id=file_id,
                team_id=batch.team_id,
                purpose="batch_output",
                filename=f"batch_{batch_id}_{kind}.jsonl",
                bytes=size,
                object_key=key,
                created_at=now,
                expires_at=expires,
            )
        )
        file_ids[kind] = file_id

    usage = session.execute(
        select(
            func.coalesce(func.sum(BatchRequest.prompt_tokens), 0),
            func.coalesce(func.sum(BatchRequest.cached_tokens), 0),
            func.coalesce(func.sum(BatchRequest.completion_tokens), 0),
            func.coalesce(func.sum(BatchRequest.reasoning_tokens), 0),
        ).where(BatchRequest.batch_id == batch_id, BatchRequest.state == RequestState.succeeded)
    ).one()
    terminal = (
        BatchStatus.cancelled
        if batch.status == BatchStatus.cancelling
        else BatchStatus.expired
        if batch.expired_at is not None
        else BatchStatus.completed
    )
    stamp = {BatchStatus.cancelled: "cancelled_at", BatchStatus.completed: "completed_at"}.get(terminal)
    values: dict[str, Any] = {
        "status": terminal,
        "output_file_id": file_ids["output"],
        "error_file_id": file_ids["error"],
        "completed": succeeded,
        "failed": errored,
        "input_tokens": usage[0],
        "cached_tokens": usage[1],
        "output_tokens": usage[2],
        "reasoning_tokens": usage[3],
        "finalizing_at": case((Batch.finalizing_at.is_(None), now), else_=Batch.finalizing_at),
    }
    if stamp:
        values[stamp] = now
    session.execute(
        update(Batch)
        .where(Batch.id == batch_id, Batch.status == batch.status)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    return terminal
