"""Finalization on SQLite and Postgres with a real object store: OpenAI's line format, the same
bytes when redone, one set of File rows, and no row lock held while the files are written."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from sqlalchemy import event, func, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs.batches import cancel_batch
from backfill.jobs.errors import Conflict
from backfill.jobs.models import Batch, BatchRequest, BatchStatus, File, RequestState, utcnow
from backfill.jobs.output import finalize as output
from backfill.jobs.output import format as output_format
from backfill.jobs.output import pages as output_pages
from backfill.jobs.output.finalize import derived_file_id, finalize_batch, output_key
from backfill.storage.objects import LocalObjectStore
from tests.factories import formatter_rows, make_batch, make_team

# line -> state; answered lines (succeeded, failed) carry the fleet's reply.
LINES = {
    1: RequestState.succeeded,
    2: RequestState.failed,
    3: RequestState.succeeded,
    4: RequestState.expired,
    5: RequestState.succeeded,
}


def answered_line(batch_id: str, line: int, *, failed: bool, body: object, **columns: Any) -> BatchRequest:
    """A line the fleet answered (400 when `failed`), its reply `body` as JSON."""
    return BatchRequest(
        batch_id=batch_id,
        line=line,
        custom_id=f"req-{line}",
        offset=0,
        length=1,
        state=RequestState.failed if failed else RequestState.succeeded,
        result_id=f"r{line}",
        status_code=400 if failed else 200,
        request_id=f"fleet-{line}",
        response_body=orjson.dumps(body).decode(),
        **columns,
    )


def _batch(session: Session, *, status: BatchStatus, states: dict[int, RequestState]) -> Batch:
    batch = make_batch(
        session, make_team(session), lines=0, status=status, total=len(states), output_expires_after_s=3600
    )
    for line, state in states.items():
        if state in (RequestState.succeeded, RequestState.failed):
            ok = state == RequestState.succeeded
            row = answered_line(
                batch.id,
                line,
                failed=not ok,
                body={"n": line, "text": "x" * 700},
                prompt_tokens=10 * line if ok else 0,
                completion_tokens=line if ok else 0,
            )
        else:
            row = BatchRequest(
                batch_id=batch.id,
                line=line,
                custom_id=f"req-{line}",
                offset=0,
                length=1,
                state=state,
                prompt_tokens=0,
                completion_tokens=0,
            )
        session.add(row)
    session.flush()
    return batch


class PausingStore(LocalObjectStore):
    """A local store whose writes stop at their first chunk (the first page of lines, read from
    an open query) until the test lets them go on."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.writing = threading.Event()
        self.resume = threading.Event()
        self.puts = 0

    def put(self, key: str, chunks: Iterable[bytes], *, max_bytes: int | None = None) -> int:
        def paused() -> Iterator[bytes]:
            for n, chunk in enumerate(chunks):
                if n == 0:
                    self.writing.set()
                    assert self.resume.wait(60), "the test never resumed the write"
                yield chunk

        self.puts += 1
        return super().put(key, paused(), max_bytes=max_bytes)


def _files(store: LocalObjectStore, team_id: str, batch_id: str) -> dict[str, bytes]:
    prefix = f"batches/{team_id}/{batch_id}/"
    # Finished objects only: a write in progress shows as a `.tmp-` file beside them.
    return {o.key: b"".join(store.open(o.key)) for o in store.list(prefix) if "/.tmp-" not in o.key}


def _lock_timeout(session: Session) -> None:
    """Fail fast instead of queueing behind a lock, so a held lock shows up as an error."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SET LOCAL lock_timeout = '3s'"))
    else:
        session.execute(text("PRAGMA busy_timeout = 3000"))


def test_lines_follow_openai_format_and_a_redone_finalization_writes_the_same_bytes(
    db: sessionmaker[Session], tmp_path: Path
) -> None:
    store = LocalObjectStore(tmp_path / "objects")
    with db.begin() as s:
        batch = _batch(s, status=BatchStatus.in_progress, states=LINES)
        batch_id, team_id = batch.id, batch.team_id

    # The worker dies after writing both files, before the status change commits.
    def dying_units() -> AbstractContextManager[Session]:
        if len(_files(store, team_id, batch_id)) == 2:
            raise RuntimeError("worker killed")
        return db.begin()

    with pytest.raises(RuntimeError):
        finalize_batch(dying_units, store, batch_id=batch_id)
    first = _files(store, team_id, batch_id)
    assert set(first) == {output_key(team_id, batch_id, "output"), output_key(team_id, batch_id, "error")}
    with db() as s:
        assert s.get(Batch, batch_id).status == BatchStatus.finalizing  # type: ignore[union-attr]
        assert s.execute(select(func.count()).select_from(File)).scalar() == 0

    assert finalize_batch(db.begin, store, batch_id=batch_id) == BatchStatus.completed
    assert _files(store, team_id, batch_id) == first
    assert finalize_batch(db.begin, store, batch_id=batch_id) == BatchStatus.completed  # a no-op now
    assert _files(store, team_id, batch_id) == first

    out = [orjson.loads(x) for x in first[output_key(team_id, batch_id, "output")].splitlines()]
    assert [(x["id"], x["custom_id"], x["response"]["status_code"], x["error"]) for x in out] == [
        ("batch_req_r1", "req-1", 200, None),
        ("batch_req_r3", "req-3", 200, None),
        ("batch_req_r5", "req-5", 200, None),
    ]
    assert out[1]["response"]["body"] == {"n": 3, "text": "x" * 700}
    assert out[1]["response"]["request_id"] == "fleet-3"
    err = [orjson.loads(x) for x in first[output_key(team_id, batch_id, "error")].splitlines()]
    assert [(x["custom_id"], x["response"] and x["response"]["status_code"]) for x in err] == [
        ("req-2", 400),
        ("req-4", None),
    ]
    assert err[1]["error"]["code"] == "batch_expired" and err[1]["id"] == "batch_req_4"

    with db() as s:
        batch = s.get(Batch, batch_id)  # type: ignore[assignment]
        assert batch is not None and batch.completed_at is not None
        assert (batch.completed, batch.failed, batch.input_tokens, batch.output_tokens) == (3, 2, 90, 9)
        files = {f.id: f for f in s.execute(select(File)).scalars()}
        assert set(files) == {derived_file_id(batch_id, "output"), derived_file_id(batch_id, "error")}
        assert batch.output_file_id == derived_file_id(batch_id, "output")
        assert batch.error_file_id == derived_file_id(batch_id, "error")
        for f in files.values():
            assert f.bytes == len(first[f.object_key]) and f.purpose == "batch_output"
            assert f.expires_at is not None and f.created_at is not None


def test_a_batch_with_lines_left_to_run_is_not_finalized(db: sessionmaker[Session], tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "objects")
    with db.begin() as s:
        batch = _batch(s, status=BatchStatus.in_progress, states={**LINES, 6: RequestState.running})
        batch_id, team_id = batch.id, batch.team_id
    assert finalize_batch(db.begin, store, batch_id=batch_id) == BatchStatus.in_progress
    assert _files(store, team_id, batch_id) == {}
    assert finalize_batch(db.begin, store, batch_id="missing") is None


def _start(
    pool: ThreadPoolExecutor, db: sessionmaker[Session], store: PausingStore, batch_id: str
) -> Future[BatchStatus | None]:
    running = pool.submit(finalize_batch, db.begin, store, batch_id=batch_id)
    assert store.writing.wait(30), "finalization never started writing"
    return running


def test_a_cancel_during_the_file_write_answers_at_once(db: sessionmaker[Session], tmp_path: Path) -> None:
    store = PausingStore(tmp_path / "objects")
    with db.begin() as s:
        batch_id = _batch(s, status=BatchStatus.in_progress, states=LINES).id
    with ThreadPoolExecutor(1) as pool:
        running = _start(pool, db, store, batch_id)
        # The output file is half written. The batch row is free: a cancel is refused at once
        # (a finalizing batch is past cancelling) and any other write to the row commits.
        with pytest.raises(Conflict), db.begin() as s:
            _lock_timeout(s)
            cancel_batch(s, team_id=None, batch_id=batch_id)
        with db.begin() as s:
            _lock_timeout(s)
            s.execute(update(Batch).where(Batch.id == batch_id).values(metadata_={"touched": "yes"}))
        assert not running.done()
        store.resume.set()
        assert running.result(timeout=60) == BatchStatus.completed
    with db() as s:
        batch = s.get(Batch, batch_id)
        assert batch is not None and batch.metadata_ == {"touched": "yes"} and batch.completed == 3


def test_a_cancelling_batch_ends_cancelled_and_a_repeated_cancel_is_not_blocked(
    db: sessionmaker[Session], tmp_path: Path
) -> None:
    store = PausingStore(tmp_path / "objects")
    # A line still pending when the batch was cancelled is written as cancelled.
    states = {1: RequestState.succeeded, 2: RequestState.cancelled, 3: RequestState.pending}
    with db.begin() as s:
        batch = _batch(s, status=BatchStatus.cancelling, states=states)
        batch_id, team_id = batch.id, batch.team_id
    with ThreadPoolExecutor(1) as pool:
        running = _start(pool, db, store, batch_id)  # pauses inside the output file
        with db.begin() as s:
            _lock_timeout(s)
            assert cancel_batch(s, team_id=None, batch_id=batch_id).status == BatchStatus.cancelling
        store.resume.set()
        assert running.result(timeout=60) == BatchStatus.cancelled
    err = _files(store, team_id, batch_id)[output_key(team_id, batch_id, "error")]
    assert [orjson.loads(x)["error"]["code"] for x in err.splitlines()] == ["batch_cancelled"] * 2
    with db() as s:
        batch = s.get(Batch, batch_id)  # type: ignore[assignment]
        assert batch is not None and batch.cancelled_at is not None and batch.completed_at is None
        assert batch.output_file_id == derived_file_id(batch_id, "output")  # the line that ran before the cancel
        assert batch.error_file_id == derived_file_id(batch_id, "error")


def test_two_finalizations_at_once_write_the_same_files_and_one_set_of_rows(
    db: sessionmaker[Session], tmp_path: Path
) -> None:
    slow = PausingStore(tmp_path / "objects")
    with db.begin() as s:
        batch = _batch(s, status=BatchStatus.in_progress, states=LINES)
        batch_id, team_id = batch.id, batch.team_id
    with ThreadPoolExecutor(1) as pool:
        running = _start(pool, db, slow, batch_id)
        # A redelivered message finalizes the batch while the first worker is still writing.
        assert finalize_batch(db.begin, LocalObjectStore(tmp_path / "objects"), batch_id=batch_id) == "completed"
        done = _files(slow, team_id, batch_id)
        slow.resume.set()
        assert running.result(timeout=60) == BatchStatus.completed  # lost the compare-and-set
    assert slow.puts == 2 and _files(slow, team_id, batch_id) == done
    with db() as s:
        rows = list(s.execute(select(File.id, File.bytes)).all())
    assert sorted(rows) == sorted(
        (derived_file_id(batch_id, kind), len(done[output_key(team_id, batch_id, kind)]))
        for kind in ("output", "error")
    )


HOSTILE = ['q"uote', "back\\slash", "tab\tnew\nline\r", "\b\f\x01\x1f\x7f", "é€😀\u2028\ufeff", "</script>", ""]


def _without_index_scans(db: sessionmaker[Session]) -> Any:
    """Units of work whose reads Postgres plans without index scans: rows come from the heap in
    the order they were inserted, so only the page's own ORDER BY puts them in line order."""

    @contextmanager
    def units() -> Iterator[Session]:
        with db.begin() as session:
            session.execute(text("SET LOCAL enable_indexscan = off"))
            session.execute(text("SET LOCAL enable_indexonlyscan = off"))
            yield session

    return units


@pytest.mark.parametrize("plan", ["planner's", "no index scan"])
@pytest.mark.parametrize("page", [output_pages.ROWS_PER_FETCH, 400])
def test_the_pages_write_the_same_bytes_as_one_formatting_of_all_rows(
    db: sessionmaker[Session], page: int, plan: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read a page at a time, the lines are the bytes the formatter writes for all the rows at
    once, whatever the values, in order across pages (two, or twenty with a small page) and
    with gaps in the line numbers. On Postgres the pages are formatted by the database
    (`jobs.output.pages._pg_page_sql`): this holds that second formatter to the Python one.
    The rows are inserted out of line order, and read with or without the primary key's index
    (the one plan that hands them over in line order by itself)."""
    postgres = db.kw["bind"].dialect.name == "postgresql"
    if plan == "no index scan" and not postgres:
        pytest.skip("a Postgres planner setting")
    units = _without_index_scans(db) if plan == "no index scan" else db.begin
    with db.begin() as s:
        batch = _batch(s, status=BatchStatus.finalizing, states={})
        states = [
            RequestState.succeeded,
            RequestState.failed,
            RequestState.expired,
            RequestState.cancelled,
            RequestState.pending,  # settled by the batch: written as it ended
        ]
        count = 3 * output_pages.ROWS_PER_FETCH // 2
        for n in random.Random(29).sample(range(count), count):  # the heap out of line order
            line = 1 + n + n // 7  # some line numbers unused (blank lines in the input)
            text = HOSTILE[n % len(HOSTILE)]
            s.add(
                BatchRequest(
                    batch_id=batch.id,
                    line=line,
                    custom_id=f"{text}-{n}",
                    offset=0,
                    length=1,
                    state=states[n % len(states)],
                    result_id=None if n % 3 == 0 else "" if n % 3 == 1 else f"res-{text}",
                    status_code=None if n % 5 == 0 else 200,
                    request_id=None if n % 4 == 0 else text,
                    response_body=None if n % 6 == 0 else "" if n % 6 == 1 else orjson.dumps({"t": text}).decode(),
                    prompt_tokens=n % 11,
                    cached_tokens=n % 3,
                    completion_tokens=n % 13,
                    reasoning_tokens=n % 2,
                )
            )
        s.flush()
        batch_id = batch.id
    monkeypatch.setattr(output_pages, "ROWS_PER_FETCH", page)
    with db() as s:
        rows = formatter_rows(s, batch_id)
        for kind_states, pending_as in (
            (output_format.OUTPUT_STATES, RequestState.expired),
            (output_format.ERROR_STATES, RequestState.expired),
            (output_format.ERROR_STATES, RequestState.cancelled),
        ):
            written = b"".join(output_pages.result_lines(units, batch_id, kind_states, pending_as=pending_as))
            errors = output_format.error_bodies(pending_as)
            assert written == output_format.format_lines((r for r in rows if r.state in kind_states), errors)
            lines = [orjson.loads(x) for x in written.splitlines()]
            if kind_states == output_format.ERROR_STATES:
                pending = [x for x in lines if int(x["custom_id"].rsplit("-", 1)[1]) % len(states) == 4]
                assert pending and {x["error"]["code"] for x in pending} == {f"batch_{pending_as}"}
        # Finalization's one read: both files from the same pages, with the counts and the usage
        # a GROUP BY over the rows gives.
        files = (output_format.OUTPUT_STATES, output_format.ERROR_STATES)
        pages = list(output_pages.pages(units, batch_id, files, pending_as=RequestState.expired))
        errors = output_format.error_bodies(RequestState.expired)
        for n, file_states in enumerate(files):
            assert b"".join(p.lines[n] for p in pages) == output_format.format_lines(
                (r for r in rows if r.state in file_states), errors
            )
            assert sum(p.counts[n] for p in pages) == sum(r.state in file_states for r in rows)
        usage = s.execute(
            select(*(func.sum(getattr(BatchRequest, c)) for c in output_format.USAGE_COLUMNS)).where(
                BatchRequest.batch_id == batch_id, BatchRequest.state == RequestState.succeeded
            )
        ).one()
        assert tuple(sum(p.usage[i] for p in pages) for i in range(4)) == tuple(usage) != (0, 0, 0, 0)


def _statements(db: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int | None]]:
    """Every statement sent from now on, with the first line of the page it reads (None for
    others): on Postgres as psycopg's cursors send them (the pages are read on the driver's
    cursor, for their bytes), on SQLite through SQLAlchemy's cursor event."""
    seen: list[tuple[str, int | None]] = []
    if db.kw["bind"].dialect.name == "postgresql":
        import psycopg

        execute = psycopg.Cursor.execute

        def recorded(cursor: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
            start = params.get("start") if isinstance(params, dict) else None
            seen.append((query if isinstance(query, str) else repr(query), start))
            return execute(cursor, query, params, **kwargs)

        monkeypatch.setattr(psycopg.Cursor, "execute", recorded)
        return seen

    def record(conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        seen.append((statement, context.compiled_parameters[0].get("start")))

    event.listen(db.kw["bind"], "before_cursor_execute", record)
    return seen


def test_both_files_come_from_one_read_of_the_rows(
    db: sessionmaker[Session], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each page of lines is read by one statement, which gives both files' lines and the
    totals: no second read for the other file, no scan for the counts and the usage. On
    Postgres no statement plans the pages either: short lines, so each range is one page, which
    its statement says while it reads it."""
    store = LocalObjectStore(tmp_path / "objects")
    with db.begin() as s:
        batch = _batch(s, status=BatchStatus.in_progress, states=LINES)
        batch_id, team_id = batch.id, batch.team_id
    monkeypatch.setattr(output_pages, "ROWS_PER_FETCH", 2)  # lines 1-5: three pages
    seen = _statements(db, monkeypatch)
    assert finalize_batch(db.begin, store, batch_id=batch_id) == BatchStatus.completed
    rows_read = [(sql, start) for sql, start in seen if "batch_requests" in sql]
    # Pages: on Postgres the statements that join the lines (`string_agg`); on SQLite those that
    # read the answers, not only their sizes (`length`: the plans of the pages).
    postgres = db.kw["bind"].dialect.name == "postgresql"
    reads = [(sql, start) for sql, start in rows_read if ("string_agg" in sql if postgres else "length(" not in sql)]
    plans = [sql for sql, _ in rows_read if "length(" in sql and "string_agg" not in sql]
    assert not plans if postgres else plans
    pages = sorted(start for sql, start in reads if "response_body" in sql and start is not None)
    assert len(pages) == sum("response_body" in sql for sql, _ in reads)
    assert pages == [0, 2, 4]
    probes = [sql for sql, start in reads if "response_body" not in sql]
    # The rest only probe indexes: whether a line is left to run (`begin`), the last line's number.
    assert len(probes) <= 3, probes
    assert all("EXISTS" in sql or "'running'" in sql or "max(batch_requests.line)" in sql for sql in probes), probes
    assert set(_files(store, team_id, batch_id)) == {output_key(team_id, batch_id, k) for k in ("output", "error")}
    with db() as s:
        done = s.get(Batch, batch_id)
        assert done is not None and (done.completed, done.failed, done.input_tokens, done.output_tokens) == (
            3,
            2,
            90,
            9,
        )


class FailingStore(LocalObjectStore):
    """A local store whose put of one kind of file fails at its first chunk (the store went away)."""

    def __init__(self, root: Path, kind: str) -> None:
        super().__init__(root)
        self.kind = kind

    def put(self, key: str, chunks: Iterable[bytes], *, max_bytes: int | None = None) -> int:
        if key.endswith(f"/{self.kind}.jsonl"):
            next(iter(chunks))
            raise ConnectionError("object store unreachable")
        return super().put(key, chunks, max_bytes=max_bytes)


def _finalize_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(("finalize-put", "finalize-read"))]


@pytest.mark.parametrize("kind", ["output", "error"])
def test_a_failed_put_of_either_file_fails_the_finalization_and_a_later_one_completes(
    db: sessionmaker[Session], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The failure surfaces while pages are still being read (one line a page here), no thread is
    left behind, the batch stays finalizing with no File row, and the redo writes what a
    finalization that never failed writes."""
    with db.begin() as s:
        batch = _batch(s, status=BatchStatus.in_progress, states=LINES)
        batch_id, team_id = batch.id, batch.team_id
    monkeypatch.setattr(output_pages, "ROWS_PER_FETCH", 1)
    with ThreadPoolExecutor(1) as pool:
        failing = pool.submit(finalize_batch, db.begin, FailingStore(tmp_path / "objects", kind), batch_id=batch_id)
        with pytest.raises(ConnectionError):
            failing.result(timeout=60)
    assert _finalize_threads() == []
    with db() as s:
        assert s.get(Batch, batch_id).status == BatchStatus.finalizing  # type: ignore[union-attr]
        assert s.execute(select(func.count()).select_from(File)).scalar() == 0
    assert output_key(team_id, batch_id, kind) not in _files(LocalObjectStore(tmp_path / "objects"), team_id, batch_id)

    store = LocalObjectStore(tmp_path / "objects")
    assert finalize_batch(db.begin, store, batch_id=batch_id) == BatchStatus.completed
    with db.begin() as s:
        again = _batch(s, status=BatchStatus.in_progress, states=LINES)
    assert finalize_batch(db.begin, LocalObjectStore(tmp_path / "fresh"), batch_id=again.id) == BatchStatus.completed
    fresh = _files(LocalObjectStore(tmp_path / "fresh"), again.team_id, again.id)
    # The lines name no batch: a batch of the same lines finalized without a failure, same bytes.
    assert [v for _, v in sorted(fresh.items())] == [v for _, v in sorted(_files(store, team_id, batch_id).items())]


def test_a_failed_read_ends_both_puts_without_an_object(
    db: sessionmaker[Session], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows stop coming mid-read (the database went away): both puts are ended unfinished,
    so neither file appears at its key, and no thread is left behind."""
    store = LocalObjectStore(tmp_path / "objects")
    with db.begin() as s:
        batch = _batch(s, status=BatchStatus.in_progress, states=LINES)
        batch_id, team_id = batch.id, batch.team_id
    pages = output_pages.pages  # what `output` reads its pages with

    def failing_pages(*args: Any, **kwargs: Any) -> Iterator[output_pages.Page]:
        yield next(pages(*args, **kwargs))
        raise OSError("server closed the connection")

    monkeypatch.setattr(output_pages, "ROWS_PER_FETCH", 1)
    monkeypatch.setattr(output, "pages", failing_pages)
    with pytest.raises(OSError, match="server closed"):
        finalize_batch(db.begin, store, batch_id=batch_id)
    assert _finalize_threads() == []
    assert list(store.list(f"batches/{team_id}/{batch_id}/")) == []  # not even a `.tmp-` file
    with db() as s:
        assert s.get(Batch, batch_id).status == BatchStatus.finalizing  # type: ignore[union-attr]


def test_expiry_writes_only_the_running_lines_and_finalization_settles_the_pending_ones(
    db: sessionmaker[Session], tmp_path: Path
) -> None:
    """Expiring a batch is not one write per line: its running lines become expired (so their
    late answers are dropped), its pending lines stay pending, and finalization writes every
    one of them as batch_expired; nothing claims a line of the finalizing batch meanwhile."""
    from backfill.jobs.execution.claims import claim_requests
    from backfill.jobs.sweeps import expire_overdue

    store = LocalObjectStore(tmp_path / "objects")
    states = {1: RequestState.succeeded, 2: RequestState.running, 3: RequestState.pending, 4: RequestState.pending}
    with db.begin() as s:
        batch = _batch(s, status=BatchStatus.in_progress, states=states)
        batch_id, team_id = batch.id, batch.team_id
        s.execute(
            update(BatchRequest)
            .where(BatchRequest.batch_id == batch_id, BatchRequest.line == 2)
            .values(claim_token="c")
        )
        s.execute(update(Batch).where(Batch.id == batch_id).values(expires_at=utcnow() - timedelta(seconds=1)))
    with db.begin() as s:
        assert expire_overdue(s) == [batch_id]
    with db() as s:
        rows = s.execute(
            select(BatchRequest.line, BatchRequest.state, BatchRequest.claim_token)
            .where(BatchRequest.batch_id == batch_id)
            .order_by(BatchRequest.line)
        ).all()
        assert [tuple(r) for r in rows] == [
            (1, RequestState.succeeded, None),
            (2, RequestState.expired, None),
            (3, RequestState.pending, None),
            (4, RequestState.pending, None),
        ]
    with db.begin() as s:
        assert claim_requests(s, batch_id=batch_id, limit=10, claim_token="late") == []
    assert finalize_batch(db.begin, store, batch_id=batch_id) == BatchStatus.expired
    err = _files(store, team_id, batch_id)[output_key(team_id, batch_id, "error")]
    assert [(x["custom_id"], x["error"]["code"]) for x in map(orjson.loads, err.splitlines())] == [
        ("req-2", "batch_expired"),
        ("req-3", "batch_expired"),
        ("req-4", "batch_expired"),
    ]
    with db() as s:
        done = s.get(Batch, batch_id)
        assert done is not None and (done.completed, done.failed) == (1, 3)


def test_a_claim_in_flight_when_the_batch_expires_is_waited_for_and_its_lines_expire(
    db: sessionmaker[Session],
) -> None:
    """A claim that read the batch as in progress and has not committed yet: the expiry waits
    for it (the claim holds FOR KEY SHARE on the batch row, the expiry takes FOR UPDATE), then
    sees its lines running and expires them; a claim after the expiry takes nothing. Without
    the wait the claim's lines would stay running in a finalizing batch, run after the
    window closed, and hold its finalization back."""
    from backfill.jobs.execution.claims import claim_requests

    if db.kw["bind"].dialect.name != "postgresql":
        pytest.skip("SQLite has one writer at a time: a claim and an expiry cannot overlap there")
    states = {n: RequestState.pending for n in range(1, 6)}
    with db.begin() as s:
        batch = _batch(s, status=BatchStatus.in_progress, states=states)
        batch_id = batch.id
        s.execute(update(Batch).where(Batch.id == batch_id).values(expires_at=utcnow() - timedelta(seconds=1)))
    claiming = db()
    claiming.begin()
    claimed = [c.line for c in claim_requests(claiming, batch_id=batch_id, limit=2, claim_token="in-flight")]
    assert claimed == [1, 2]
    with ThreadPoolExecutor(1) as pool:
        expiring = pool.submit(lambda: _expire(db))
        with pytest.raises(TimeoutError):
            expiring.result(timeout=1.0)  # waits for the claim
        claiming.commit()
        claiming.close()
        assert expiring.result(timeout=30) == [batch_id]
    with db.begin() as s:
        assert claim_requests(s, batch_id=batch_id, limit=5, claim_token="after") == []
        rows = s.execute(
            select(BatchRequest.line, BatchRequest.state)
            .where(BatchRequest.batch_id == batch_id)
            .order_by(BatchRequest.line)
        ).all()
    assert [tuple(r) for r in rows] == [(1, "expired"), (2, "expired"), (3, "pending"), (4, "pending"), (5, "pending")]


def _expire(db: sessionmaker[Session]) -> list[str]:
    from backfill.jobs.sweeps import expire_overdue

    with db.begin() as s:
        return expire_overdue(s)
