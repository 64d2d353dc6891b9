"""Finalization: output.jsonl and error.jsonl in OpenAI's line format, then the terminal status.

Three short units of work, so no row lock is held while bytes move:
1. in_progress -> finalizing by compare-and-set once no line is left to run, committed at once;
2. the files, both streamed from one read-only pass over the rows into the object store at once;
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
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, closing, contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from itertools import islice
from typing import Any

import orjson
from sqlalchemy import Connection, Engine, Exists, bindparam, case, exists, func, select, update
from sqlalchemy.orm import Session

from backfill.jobs.models import Batch, BatchRequest, BatchStatus, File, RequestState, utcnow
from backfill.jobs.sweeps import has_running
from backfill.jobs.webhooks import record_batch_event
from backfill.storage.objects import ObjectStore

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


# The usage a batch reports: sums over its succeeded lines (only answered lines carry any).
_USAGE = ("prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens")
# The two files one read of the rows writes at once: the states of the lines in each.
_Files = tuple[Sequence[str], Sequence[str]]


@dataclass(frozen=True)
class _Page:
    """A page of lines, read once: each file's bytes and line count, and the page's usage."""

    lines: tuple[bytes, bytes]
    counts: tuple[int, int]
    usage: tuple[int, int, int, int]


def _pg_page_sql() -> str:
    """The Postgres statement that reads a page once for both files: each file's lines as one
    string (the bytes `_format_page` writes: `to_json` of a text escapes exactly as orjson does,
    tests/jobs/test_output.py holds them to it), each file's line count and the page's usage.
    One round trip a page and no Python per line. The database's time per line is what bounds
    finalization, so a line is built with few concatenations: an error line's constant tail is
    one parameter (`_pg_tails`), a line id with no result id needs no escaping, the file tests
    are made once a row (in the subquery), and FILTER is tested before an aggregate's argument,
    so a line's text is built only for the file it goes to."""
    tails = " ".join(f"WHEN '{state}' THEN %(tail_{state})s" for state in error_bodies(RequestState.expired))
    line = f"""
        CASE WHEN coalesce(result_id, '') = '' THEN '{{"id":"batch_req_' || line::text || '","custom_id":'
            ELSE '{{"id":' || to_json('batch_req_' || result_id)::text || ',"custom_id":' END
        || to_json(custom_id)::text
        || CASE state {tails}
            ELSE ',"response":{{"status_code":' || coalesce(status_code::text, 'null')
                || ',"request_id":' || to_json(coalesce(request_id, ''))::text
                || ',"body":' || coalesce(nullif(response_body, ''), 'null') || E'}},"error":null}}\\n'
            END"""
    usage = ", ".join(f"coalesce(sum({c}) FILTER (WHERE succeeded), 0)" for c in _USAGE)
    return f"""
        SELECT
            string_agg({line}, '' ORDER BY line) FILTER (WHERE in_0),
            string_agg({line}, '' ORDER BY line) FILTER (WHERE in_1),
            count(*) FILTER (WHERE in_0),
            count(*) FILTER (WHERE in_1),
            {usage}
        FROM (
            SELECT line, result_id, custom_id, state, status_code, request_id, response_body, {", ".join(_USAGE)},
                state = ANY(%(states_0)s) AS in_0, state = ANY(%(states_1)s) AS in_1,
                state = '{RequestState.succeeded}' AS succeeded
            FROM batch_requests
            WHERE batch_id = %(batch_id)s AND line > %(start)s AND line <= %(end)s
            OFFSET 0
        ) AS page
    """


def _pg_tails(pending_as: RequestState) -> dict[str, str]:
    """`_PG_PAGE_SQL`'s parameters for the error lines: all of a line after its custom_id."""
    return {
        f"tail_{state}": f',"response":null,"error":{body.decode()}}}\n'
        for state, body in error_bodies(pending_as).items()
    }


_PG_PAGE_SQL = _pg_page_sql()


def result_lines(
    session: Session, batch_id: str, states: Sequence[str], *, pending_as: RequestState = RequestState.expired
) -> Iterator[bytes]:
    """One file's bytes in input order (the lines in `states`), one chunk per page: `_pages`
    with nothing asked of its second file."""
    with closing(_pages(session, batch_id, (states, ()), pending_as=pending_as)) as pages:
        for page in pages:
            if page.lines[0]:
                yield page.lines[0]


def _pages(session: Session, batch_id: str, files: _Files, *, pending_as: RequestState) -> Generator[_Page, None, None]:
    """Every page of the batch's rows in input order, each read once for both `files`.

    Pages are ranges of _ROWS_PER_FETCH line numbers read through the primary key (batch_id,
    line): each reads and sorts at most a page of rows whatever plan the statistics give. The
    state is tested on the page (a subquery with OFFSET 0, which the planner keeps as written):
    given to the scan, stale statistics right after a large run led the planner to the
    (batch_id, state, ...) indexes and to reading and sorting every row of the batch for each page.

    On Postgres the database writes each page's lines (`_PG_PAGE_SQL`); elsewhere (SQLite, the
    embedded mode) they are formatted here from Core rows.
    """
    connection = session.connection()
    c = BatchRequest.__table__.c
    last = connection.execute(select(func.max(c.line)).where(c.batch_id == batch_id)).scalar() or 0
    errors = error_bodies(pending_as)
    if connection.dialect.name == "postgresql":
        params: dict[str, Any] = {"batch_id": batch_id, "states_0": list(files[0]), "states_1": list(files[1])}
        params.update(_pg_tails(pending_as))
        return _pg_pages(connection.engine, params, last)
    return _core_pages(connection, batch_id, files, errors, last)


def _pg_pages(engine: Engine, params: dict[str, Any], last: int) -> Generator[_Page, None, None]:
    """The pages in order, PG_READERS read at once on connections of their own: Postgres writes
    the lines, a page at a time on one backend, and one backend is what limits finalization.
    The lines of a finalizing batch are settled, so the connections need no shared snapshot;
    each reader keeps its connection for all its pages (a checkout and a rollback per page
    cost a tenth of the read)."""
    local = threading.local()
    held: list[Connection] = []

    def page(start: int) -> _Page:
        if (connection := getattr(local, "connection", None)) is None:
            connection = local.connection = engine.connect()
            held.append(connection)
        driver = connection.connection.driver_connection
        assert driver is not None
        with driver.cursor() as cursor:
            cursor.execute(_PG_PAGE_SQL, {**params, "start": start, "end": start + _ROWS_PER_FETCH})
            row = cursor.fetchone()
        assert row is not None  # an aggregate without GROUP BY answers one row, even for no lines
        first, second, n_first, n_second, *usage = row
        return _Page(
            lines=((first or "").encode(), (second or "").encode()),
            counts=(int(n_first), int(n_second)),
            usage=(int(usage[0]), int(usage[1]), int(usage[2]), int(usage[3])),
        )

    starts = iter(range(0, last, _ROWS_PER_FETCH))
    try:
        with ThreadPoolExecutor(PG_READERS, thread_name_prefix="finalize-read") as pool:
            ahead = deque(pool.submit(page, start) for start in islice(starts, 2 * PG_READERS))
            try:
                while ahead:
                    done = ahead.popleft().result()
                    for start in islice(starts, 1):
                        ahead.append(pool.submit(page, start))
                    yield done
            finally:
                for future in ahead:  # a consumer that stopped early: read no further than what runs
                    future.cancel()
    finally:
        for connection in held:  # the readers have stopped: back to the pool, rolled back
            connection.close()


def _core_pages(
    connection: Connection, batch_id: str, files: _Files, errors: dict[str, bytes], last: int
) -> Generator[_Page, None, None]:
    c = BatchRequest.__table__.c
    page_rows = (
        select(c.line, c.result_id, c.custom_id, c.state, c.status_code, c.request_id, c.response_body)
        .add_columns(*(c[name] for name in _USAGE))
        .where(c.batch_id == batch_id, c.line > bindparam("start"), c.line <= bindparam("end"))
        .offset(0)
        .subquery()
    )
    query = select(page_rows).where(page_rows.c.state.in_([*files[0], *files[1]])).order_by(page_rows.c.line)
    for start in range(0, last, _ROWS_PER_FETCH):
        rows = connection.execute(query, {"start": start, "end": start + _ROWS_PER_FETCH}).all()
        yield _split_page(rows, files, errors)


def _split_page(rows: Sequence[Any], files: _Files, errors: dict[str, bytes]) -> _Page:
    """A page of Core rows (`_core_pages`'s columns) as both files' lines, counts and usage."""
    first = [row for row in rows if row.state in files[0]]
    second = [row for row in rows if row.state in files[1]]
    succeeded = [row for row in rows if row.state == RequestState.succeeded]
    usage = [sum(getattr(row, name) or 0 for row in succeeded) for name in _USAGE]
    return _Page(
        lines=(_format_page(first, errors), _format_page(second, errors)),
        counts=(len(first), len(second)),
        usage=(usage[0], usage[1], usage[2], usage[3]),
    )


def _format_page(rows: Iterable[Any], errors: dict[str, bytes]) -> bytes:
    """The lines of `rows` (line, result_id, custom_id, state, status_code, request_id,
    response_body, then any further columns, unread here)."""
    dumps = orjson.dumps
    answer_line, error_line = _ANSWER_LINE, _ERROR_LINE
    out = []
    for line, result_id, custom_id, state, status_code, request_id, body, *_ in rows:
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

    def add(self, page: _Page) -> None:
        self.succeeded += page.counts[0]
        self.errored += page.counts[1]
        self.usage = (
            self.usage[0] + page.usage[0],
            self.usage[1] + page.usage[1],
            self.usage[2] + page.usage[2],
            self.usage[3] + page.usage[3],
        )


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
            .where(
                Batch.id == batch_id,
                Batch.status == BatchStatus.in_progress,
                Batch.unindexed == 0,
                ~_unfinished(batch_id),
            )
            .values(status=BatchStatus.finalizing, finalizing_at=utcnow())
            .execution_options(synchronize_session=False)
        )
        session.refresh(batch)
    if batch.status not in (BatchStatus.finalizing, BatchStatus.cancelling):
        return batch.status
    if batch.unindexed or has_running(session, batch_id):
        # Lines still to be written by validation (`write_index_parts`), or a cancelling batch
        # still draining its running lines.
        return batch.status
    return _Plan(
        batch_id=batch_id,
        team_id=batch.team_id,
        status=batch.status,
        expired=batch.expired_at is not None,
        output_expires_after_s=batch.output_expires_after_s,
    )


def _write_files(session: Session, store: ObjectStore, plan: _Plan) -> _Written:
    """Read-only: the lines of a finalizing batch are settled, so no lock is taken or needed.

    One read of the rows: each page gives both files' lines (put concurrently, `_uploads`) and
    the counts and usage, which only succeeded lines carry."""
    kinds = ("output", "error")
    written = _Written()
    pages = _pages(session, plan.batch_id, (OUTPUT_STATES, ERROR_STATES), pending_as=plan.pending_as)
    with closing(pages), _uploads(store, [output_key(plan.team_id, plan.batch_id, kind) for kind in kinds]) as puts:
        for page in pages:
            for put, lines in zip(puts, page.lines, strict=True):
                put.send(lines)
            written.add(page)
    for kind, put in zip(kinds, puts, strict=True):
        if (size := put.size()) is not None:
            written.sizes[kind] = size
    return written


_QUEUED_PAGES = 2  # pages waiting for each file's put: with the readers' look-ahead, a bounded backlog
_WAIT_S = 0.2  # how long a hand-off waits before it looks again whether its put has stopped
_END, _ABORT = object(), object()  # what a put is handed last: all lines sent, or the read failed


class _ReadFailed(Exception):
    """Ends a put whose lines stopped coming: the object must not be completed."""


class _Upload:
    """One file's `store.put` on a thread of its own, fed a page of lines at a time through a
    bounded queue. It starts with the file's first line, so a file without lines is never created.

    Neither side can wait for good on the other: the put waits only for what the reader always
    hands it last (`end`), and the reader's waits on a full queue look again every _WAIT_S whether
    the put has stopped (a failed put: the reader raises its error at the next page, `send`)."""

    def __init__(self, pool: ThreadPoolExecutor, store: ObjectStore, key: str) -> None:
        self._pool, self._store, self._key = pool, store, key
        self._queue: queue.Queue[object] = queue.Queue(_QUEUED_PAGES)
        self._put: Future[int] | None = None

    def send(self, lines: bytes) -> None:
        if not lines:
            return
        if self._put is None:
            self._put = self._pool.submit(self._store.put, self._key, self._chunks())
        if self._put.done() or not self._hand(lines):
            self._put.result()  # its failure, now: no point reading further
            raise RuntimeError(f"the put of {self._key} returned before its last line")

    def end(self, *, abort: bool = False) -> None:
        """Tell the put there is no more, or (`abort`) that it must fail; never raises its error."""
        if self._put is not None:
            self._hand(_ABORT if abort else _END)

    def size(self) -> int | None:
        """The bytes written (None when the file had no line), or the put's failure; after `end`."""
        return None if self._put is None else self._put.result()

    def _hand(self, item: object) -> bool:
        """Queue `item` for the put; False if the put stopped before taking it."""
        assert self._put is not None
        while True:
            try:
                self._queue.put(item, timeout=_WAIT_S)
                return True
            except queue.Full:
                if self._put.done():
                    return False

    def _chunks(self) -> Iterator[bytes]:
        while (item := self._queue.get()) is not _END:
            if item is _ABORT:
                raise _ReadFailed(f"the lines of {self._key} stopped coming")
            assert isinstance(item, bytes)
            yield item


@contextmanager
def _uploads(store: ObjectStore, keys: Sequence[str]) -> Iterator[list[_Upload]]:
    """An `_Upload` per key; on leaving, each is ended (aborted if the block raised) and waited
    for, so no put is left running or lands later. A put's failure is raised by its `size`."""
    with ThreadPoolExecutor(len(keys), thread_name_prefix="finalize-put") as pool:
        uploads = [_Upload(pool, store, key) for key in keys]
        try:
            yield uploads
        except BaseException:
            for upload in uploads:
                upload.end(abort=True)
            raise
        for upload in uploads:
            upload.end()


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
