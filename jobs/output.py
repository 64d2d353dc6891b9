"""Finalization: output.jsonl and error.jsonl in OpenAI's line format, then the terminal status.

Three short units of work, so no row lock is held while bytes move:
1. in_progress -> finalizing by compare-and-set once no line is left to run, committed at once;
2. the files, streamed from a read-only query straight into the object store;
3. a compare-and-set to the terminal status that, when it wins, creates the File rows.

Once a batch is finalizing (or cancelling with nothing running) its lines no longer change, and
object keys and file ids derive from the batch id, so a finalization redone after a crash (or
run twice at once) rewrites the same bytes at the same keys; only the step-3 winner writes rows.

A cancel that arrives while the files are written answers at once: a `finalizing` batch is past
cancelling, so `cancel_batch` refuses it with a conflict (as before) and the batch completes; a
batch that was already `cancelling` stays so and ends `cancelled`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import timedelta
from itertools import islice
from typing import Any

import orjson
from sqlalchemy import Engine, Exists, bindparam, case, exists, func, select, update
from sqlalchemy.orm import Session

from jobs.models import Batch, BatchRequest, BatchStatus, File, RequestState, utcnow
from jobs.sweeps import has_running
from jobs.webhooks import record_batch_event
from storage.objects import ObjectStore

log = logging.getLogger("backfill.finalization")

UnitOfWork = Callable[[], AbstractContextManager[Session]]

ERROR_MESSAGES = {
    RequestState.cancelled: ("batch_cancelled", "This request was not executed because the batch was cancelled."),
    RequestState.expired: (
        "batch_expired",
        "This request could not be executed before the completion window expired.",
    ),
}
OUTPUT_STATES = (RequestState.succeeded,)
# Pending lines of a settled batch (expired, or cancelled) are written as the batch ended: see
# `_Plan.pending_as`. No claim takes a line of a batch that is not in progress.
ERROR_STATES = (RequestState.failed, RequestState.cancelled, RequestState.expired, RequestState.pending)
_ROWS_PER_FETCH = 5000  # lines a page: at most about 3 MB of 600-byte answers
PG_READERS = 2  # pages read at once (each on a connection of its own): see _pg_pages


def derived_file_id(batch_id: str, kind: str) -> str:
    return hashlib.blake2b(f"{batch_id}:{kind}".encode(), digest_size=12).hexdigest()


def output_key(team_id: str, batch_id: str, kind: str) -> str:
    return f"batches/{team_id}/{batch_id}/{kind}.jsonl"


_ANSWER_LINE = b'{"id":%b,"custom_id":%b,"response":{"status_code":%b,"request_id":%b,"body":%b},"error":null}\n'
_ERROR_LINE = b'{"id":%b,"custom_id":%b,"response":null,"error":%b}\n'
# Keyed by the states' strings: rows carry plain strings, and a StrEnum member hashes as its value.
_ERROR_BODIES: dict[str, bytes] = {
    state: orjson.dumps({"code": code, "message": message}) for state, (code, message) in ERROR_MESSAGES.items()
}


def error_bodies(pending_as: RequestState) -> dict[str, bytes]:
    """The error body of each error state, a pending line written as `pending_as`."""
    return {**_ERROR_BODIES, RequestState.pending: _ERROR_BODIES[pending_as]}


def _pg_line_sql() -> str:
    """The Postgres statement that writes a page's lines itself: the bytes `_format_page` writes
    (`to_json` of a text escapes exactly as orjson does: tests/jobs/test_output.py holds them
    to it), as one string, so a page costs one round trip and no Python per line."""
    errors = " ".join(
        f"WHEN state = '{state}' THEN ',\"response\":null,\"error\":' || %(error_{state})s"
        for state in error_bodies(RequestState.expired)
    )
    return f"""
        SELECT string_agg(
            '{{"id":' || to_json('batch_req_' || coalesce(nullif(result_id, ''), line::text))::text
            || ',"custom_id":' || to_json(custom_id)::text
            || CASE {errors}
                ELSE ',"response":{{"status_code":' || coalesce(status_code::text, 'null')
                    || ',"request_id":' || to_json(coalesce(request_id, ''))::text
                    || ',"body":' || coalesce(nullif(response_body, ''), 'null') || '}},"error":null'
                END
            || '}}' || chr(10),
            '' ORDER BY line)
        FROM (
            SELECT line, result_id, custom_id, state, status_code, request_id, response_body
            FROM batch_requests
            WHERE batch_id = %(batch_id)s AND line > %(start)s AND line <= %(end)s
            OFFSET 0
        ) AS page
        WHERE state = ANY(%(states)s)
    """


_PG_PAGE_SQL = _pg_line_sql()


def result_lines(
    session: Session, batch_id: str, states: Sequence[str], *, pending_as: RequestState = RequestState.expired
) -> Iterator[bytes]:
    """The file's bytes in input order, one chunk per page of _ROWS_PER_FETCH lines.

    Pages are ranges of line numbers read through the primary key (batch_id, line): each reads
    and sorts at most a page of rows whatever plan the statistics give. The state is tested on
    the page (a subquery with OFFSET 0, which the planner keeps as written): given to the scan,
    stale statistics right after a large run led the planner to the (batch_id, state, ...)
    indexes and to reading and sorting every row of the batch for each page.

    On Postgres the database writes each page's lines (`_PG_PAGE_SQL`); elsewhere (SQLite, the
    embedded mode) they are formatted here from Core rows.
    """
    connection = session.connection()
    c = BatchRequest.__table__.c
    last = connection.execute(select(func.max(c.line)).where(c.batch_id == batch_id)).scalar() or 0
    wanted = [str(s) for s in states]
    errors = error_bodies(pending_as)
    if connection.dialect.name == "postgresql":
        params: dict[str, Any] = {"batch_id": batch_id, "states": wanted}
        params.update({f"error_{state}": body.decode() for state, body in errors.items()})
        yield from _pg_pages(connection.engine, params, last)
        return
    page_rows = (
        select(c.line, c.result_id, c.custom_id, c.state, c.status_code, c.request_id, c.response_body)
        .where(c.batch_id == batch_id, c.line > bindparam("start"), c.line <= bindparam("end"))
        .offset(0)
        .subquery()
    )
    query = select(page_rows).where(page_rows.c.state.in_(wanted)).order_by(page_rows.c.line)
    for start in range(0, last, _ROWS_PER_FETCH):
        if chunk := _format_page(connection.execute(query, {"start": start, "end": start + _ROWS_PER_FETCH}), errors):
            yield chunk


def _pg_pages(engine: Engine, params: dict[str, Any], last: int) -> Iterator[bytes]:
    """The pages in order, PG_READERS read at once on connections of their own: Postgres writes
    the lines, a page at a time on one backend, and one backend is what limits finalization.
    The lines of a finalizing batch are settled, so the connections need no shared snapshot."""

    def page(start: int) -> bytes:
        with engine.connect() as connection:
            driver = connection.connection.driver_connection
            assert driver is not None
            with driver.cursor() as cursor:
                cursor.execute(_PG_PAGE_SQL, {**params, "start": start, "end": start + _ROWS_PER_FETCH})
                row = cursor.fetchone()
            connection.rollback()
        return row[0].encode() if row is not None and row[0] else b""

    starts = iter(range(0, last, _ROWS_PER_FETCH))
    with ThreadPoolExecutor(PG_READERS, thread_name_prefix="finalize-read") as pool:
        ahead = deque(pool.submit(page, start) for start in islice(starts, 2 * PG_READERS))
        while ahead:
            chunk = ahead.popleft().result()
            for start in islice(starts, 1):
                ahead.append(pool.submit(page, start))
            if chunk:
                yield chunk


def _format_page(rows: Iterable[Any], errors: dict[str, bytes]) -> bytes:
    dumps = orjson.dumps
    answer_line, error_line = _ANSWER_LINE, _ERROR_LINE
    out = []
    for line, result_id, custom_id, state, status_code, request_id, body in rows:
        line_id = dumps(f"batch_req_{result_id}") if result_id else b'"batch_req_%d"' % line
        error = errors.get(state)
        if error is not None:
            out.append(error_line % (line_id, dumps(custom_id), error))
        else:
            out.append(
                answer_line
                % (
                    line_id,
                    dumps(custom_id),
                    b"null" if status_code is None else b"%d" % status_code,
                    dumps(request_id or ""),
                    (body or "null").encode(),
                )
            )
    return b"".join(out)


@dataclass(frozen=True)
class _Plan:
    batch_id: str
    team_id: str
    status: BatchStatus  # finalizing or cancelling: what step 3 compares against
    expired: bool
    output_expires_after_s: int | None

    @property
    def pending_as(self) -> RequestState:
        """What a line still pending is written as: the batch was cancelled, or it expired (a
        finalizing batch that did not expire has no pending line)."""
        return RequestState.cancelled if self.status == BatchStatus.cancelling else RequestState.expired


@dataclass
class _Written:
    succeeded: int = 0
    errored: int = 0
    usage: tuple[int, int, int, int] = (0, 0, 0, 0)
    sizes: dict[str, int] = field(default_factory=dict)  # kind -> bytes, for the files written


def _unfinished(batch_id: str) -> Exists:
    return exists().where(
        BatchRequest.batch_id == batch_id,
        BatchRequest.state.in_([RequestState.pending, RequestState.running]),
    )


def _begin(session: Session, batch_id: str) -> _Plan | BatchStatus | None:
    batch = session.get(Batch, batch_id)
    if batch is None:
        return None
    if batch.status == BatchStatus.in_progress:
        session.execute(
            update(Batch)
            .where(Batch.id == batch_id, Batch.status == BatchStatus.in_progress, ~_unfinished(batch_id))
            .values(status=BatchStatus.finalizing, finalizing_at=utcnow())
            .execution_options(synchronize_session=False)
        )
        session.refresh(batch)
    if batch.status not in (BatchStatus.finalizing, BatchStatus.cancelling):
        return batch.status
    if has_running(session, batch_id):
        return batch.status  # a cancelling batch still draining its running lines
    return _Plan(
        batch_id=batch_id,
        team_id=batch.team_id,
        status=batch.status,
        expired=batch.expired_at is not None,
        output_expires_after_s=batch.output_expires_after_s,
    )


def _write_files(session: Session, store: ObjectStore, plan: _Plan) -> _Written:
    """Read-only: the lines of a finalizing batch are settled, so no lock is taken or needed."""
    # One scan for the counts and the usage (which only answered lines carry).
    totals = session.execute(
        select(
            BatchRequest.state,
            func.count(),
            func.coalesce(func.sum(BatchRequest.prompt_tokens), 0),
            func.coalesce(func.sum(BatchRequest.cached_tokens), 0),
            func.coalesce(func.sum(BatchRequest.completion_tokens), 0),
            func.coalesce(func.sum(BatchRequest.reasoning_tokens), 0),
        )
        .where(BatchRequest.batch_id == plan.batch_id)
        .group_by(BatchRequest.state)
    ).all()
    counts = {state: int(n) for state, n, *_ in totals}
    usage = next((sums for state, _, *sums in totals if state == RequestState.succeeded), [0, 0, 0, 0])
    written = _Written(
        succeeded=sum(counts.get(s, 0) for s in OUTPUT_STATES),
        errored=sum(counts.get(s, 0) for s in ERROR_STATES),
        usage=(int(usage[0]), int(usage[1]), int(usage[2]), int(usage[3])),
    )
    for kind, n, states in (("output", written.succeeded, OUTPUT_STATES), ("error", written.errored, ERROR_STATES)):
        if n:
            key = output_key(plan.team_id, plan.batch_id, kind)
            lines = result_lines(session, plan.batch_id, states, pending_as=plan.pending_as)
            written.sizes[kind] = store.put(key, lines)
    return written


def _complete(session: Session, plan: _Plan, written: _Written) -> BatchStatus | None:
    now = utcnow()
    stamp: str | None
    if plan.status == BatchStatus.cancelling:
        terminal, stamp = BatchStatus.cancelled, "cancelled_at"
    elif plan.expired:
        terminal, stamp = BatchStatus.expired, None  # expired_at was set when the window closed
    else:
        terminal, stamp = BatchStatus.completed, "completed_at"
    file_ids = {kind: derived_file_id(plan.batch_id, kind) for kind in written.sizes}
    values: dict[str, Any] = {
        "status": terminal,
        "output_file_id": file_ids.get("output"),
        "error_file_id": file_ids.get("error"),
        "completed": written.succeeded,
        "failed": written.errored,
        "input_tokens": written.usage[0],
        "cached_tokens": written.usage[1],
        "output_tokens": written.usage[2],
        "reasoning_tokens": written.usage[3],
        "finalizing_at": case((Batch.finalizing_at.is_(None), now), else_=Batch.finalizing_at),
    }
    if stamp:
        values[stamp] = now
    won = session.execute(
        update(Batch)
        .where(Batch.id == plan.batch_id, Batch.status == plan.status)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if won.rowcount == 0:  # type: ignore[attr-defined]
        # Another finalization got there first (its rows name the same files), or the batch is gone.
        return session.execute(select(Batch.status).where(Batch.id == plan.batch_id)).scalar()
    record_batch_event(session, batch_id=plan.batch_id, status=terminal)  # the webhook outbox, same transaction
    expires = now + timedelta(seconds=plan.output_expires_after_s) if plan.output_expires_after_s else None
    for kind, size in written.sizes.items():
        session.merge(
            File(
                id=file_ids[kind],
                team_id=plan.team_id,
                purpose="batch_output",
                filename=f"batch_{plan.batch_id}_{kind}.jsonl",
                bytes=size,
                object_key=output_key(plan.team_id, plan.batch_id, kind),
                created_at=now,
                expires_at=expires,
            )
        )
    session.flush()
    return terminal


def finalize_batch(units: UnitOfWork, store: ObjectStore, *, batch_id: str) -> BatchStatus | None:
    """Write the result files, then move the batch to its terminal status. Idempotent.

    `units` opens one committed transaction per call (`storage.db.unit_of_work`, or a
    sessionmaker's `begin`). Returns the batch's status afterwards, None for an unknown batch.
    """
    started = time.monotonic()
    with units() as session:
        plan = _begin(session, batch_id)
    if not isinstance(plan, _Plan):
        return plan
    planned = time.monotonic()
    with units() as session:
        written = _write_files(session, store, plan)
    wrote = time.monotonic()
    with units() as session:
        status = _complete(session, plan, written)
    ended = time.monotonic()
    log.info(
        "finalized batch %s: %s, %d lines, %.1f MB in %.2f s (begin %.2f s, files %.2f s, status %.2f s)",
        batch_id,
        status,
        written.succeeded + written.errored,
        sum(written.sizes.values()) / 1e6,
        ended - started,
        planned - started,
        wrote - planned,
        ended - wrote,
    )
    return status
