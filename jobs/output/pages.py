"""Reading a batch's finished lines a page at a time, formatted for its output and error files.

Pages are cut by bytes, not by line count: a page ends once its lines' answers reach PAGE_BYTES
(a line larger than that is a page of its own), and holds at most ROWS_PER_FETCH lines however
small. Answers run from a few hundred bytes (chat) to hundreds of KB (embeddings), so a page of
a fixed number of lines could take gigabytes of the reader's memory. The cut is planned from
the answers' sizes (`octet_length`, which Postgres reads from a stored value's header without
fetching or decompressing it): on SQLite read for ROWS_PER_FETCH lines at once, ahead of the
pages; on Postgres only for lines none of which is small enough that ROWS_PER_FETCH of them fit
a page, which the read of the page itself tells (`_pg_pages`).

Every read is a short transaction of its own (`units`), ended before its page is handed on, so a
reader that stalls between pages (a slow download) holds no connection and no snapshot. The
lines of a finalizing batch are settled, so its pages need no shared snapshot; a running
batch's partial output shows each line once, in input order, as it stood when its page was read.

Pages are ranges of line numbers read through the primary key (batch_id, line): each reads and
sorts at most a page of rows whatever plan the statistics give, and on Postgres is planned as
that key's range scan, which gives the lines in order without a sort (`_PG_RANGE_SCAN`). The
state is tested on the page (a subquery with OFFSET 0, which the planner keeps as written):
given to the scan, stale statistics right after a large run led the planner to the
(batch_id, state, ...) indexes and to reading and sorting every row of the batch for each page.

On Postgres the database writes each page's lines (`_pg_page_sql`: one aggregate row a page, no
Python per line), PG_READERS pages at once on connections of their own, so the next pages are
formatted while one is handed on, and hands them over as bytes. The bytes are
`jobs.output.format.format_lines`'s, which writes them everywhere else (SQLite, the embedded
mode); tests/jobs/test_output.py holds the two to the same bytes for hostile values.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from psycopg.types.numeric import Int4
from psycopg.types.string import ByteaBinaryLoader
from sqlalchemy import ColumnElement, Integer, LargeBinary, bindparam, cast, func, select
from sqlalchemy.orm import Session

from backfill.jobs.models import BatchRequest, RequestState
from backfill.jobs.output.format import USAGE_COLUMNS, error_bodies, format_lines
from backfill.storage.db import UnitOfWork

PAGE_BYTES = 8 * 1024 * 1024  # a page's answers: what a reader holds, a few times over, at once
# Lines a page at most, and the lines whose sizes one plan reads. Larger pages cost Postgres more
# a line (20,000 short lines, 3.5 MB a page: about half as much again), smaller ones more a page.
ROWS_PER_FETCH = 5000
PLAN_RANGES = 10  # ranges of ROWS_PER_FETCH lines whose totals one statement reads (SQLite)
LINE_OVERHEAD = 192  # a line's bytes beside its answer and custom_id (ids, status, error body)
# A line's bytes as a page is cut by (`_line_size`), on Postgres, and the cap of a read that formats all.
PG_LINE_SIZE = f"(coalesce(octet_length(response_body), 0) + coalesce(octet_length(custom_id), 0) + {LINE_OVERHEAD})"
_NO_CAP = 2**31 - 1
# Pages Postgres formats at once (one backend each), and pages read ahead of the one handed on:
# what the reader holds is at most PG_AHEAD + 1 pages. (Three readers, four ahead: no faster on
# two cores.)
PG_READERS, PG_AHEAD = 2, 3

# The two files one read of the rows writes at once: the states of the lines in each.
Files = tuple[Sequence[str], Sequence[str]]


@dataclass(frozen=True)
class Page:
    """A page of lines, read once: each file's bytes and line count, and the page's usage."""

    lines: tuple[bytes, bytes]
    counts: tuple[int, int]
    usage: tuple[int, int, int, int]


def result_lines(
    units: UnitOfWork, batch_id: str, states: Sequence[str], *, pending_as: RequestState = RequestState.expired
) -> Iterator[bytes]:
    """One file's bytes in input order (the lines in `states`), one chunk per page: `pages`
    with nothing asked of its second file."""
    with closing(pages(units, batch_id, (states, ()), pending_as=pending_as)) as read:
        for page in read:
            if page.lines[0]:
                yield page.lines[0]


def pages(units: UnitOfWork, batch_id: str, files: Files, *, pending_as: RequestState) -> Generator[Page, None, None]:
    """Every page of the batch's rows in input order, each read once for both `files`."""
    with units() as session:
        postgres = session.get_bind().dialect.name == "postgresql"
    if postgres:
        yield from _pg_pages(units, batch_id, files, pending_as)
        return
    errors = error_bodies(pending_as)
    query = _page_query(batch_id, files)
    for start, end in _page_ranges(units, batch_id):
        with units() as session:
            rows = session.execute(query, {"start": start, "end": end}).all()
        yield _split_page(rows, files, errors)  # (the transaction has ended)


def _page_ranges(units: UnitOfWork, batch_id: str) -> Iterator[tuple[int, int]]:
    """Each page as (after this line, up to this one), on SQLite. Each ROWS_PER_FETCH line numbers are one
    page when their sizes sum to at most PAGE_BYTES (most batches: answers of a few KB), which
    one aggregate says, read for PLAN_RANGES such ranges by one statement (`_totals_query`);
    only otherwise are their sizes read to cut them (`page_ends`). Ranges of line numbers, not
    LIMIT: a "next 5,000 lines" read under statistics not yet taken after a large run was planned
    as a scan and sort of every line left, for each page. The statements are built once:
    building them again for each range cost the finalizing process more CPU than the reads."""
    c = BatchRequest.__table__.c
    with units() as session:
        last = session.execute(select(func.max(c.line)).where(c.batch_id == batch_id)).scalar() or 0
        totals = _totals_query(session, batch_id)
        line_sizes = _sizes_query(session, batch_id).order_by(c.line)
    planned = 0
    while planned < last:
        starts = range(planned, min(planned + PLAN_RANGES * ROWS_PER_FETCH, last), ROWS_PER_FETCH)
        ranges = [(start, min(start + ROWS_PER_FETCH, last)) for start in starts]
        bounds: dict[str, int] = {}
        for n in range(PLAN_RANGES):
            start, stop = ranges[n] if n < len(ranges) else (last, last)  # (the last statement's: fewer)
            bounds |= {f"start_{n}": start, f"stop_{n}": stop}
        with units() as session:
            sums = session.execute(totals, bounds).one()
        for (start, stop), total in zip(ranges, sums, strict=False):
            ends = [stop]
            if total > PAGE_BYTES:
                with units() as session:
                    ends = list(page_ends(session.execute(line_sizes, {"start": start, "stop": stop}).all()))
            for end in ends:
                yield start, end
                start = end
        planned = ranges[-1][1]


def _pg_pages(units: UnitOfWork, batch_id: str, files: Files, pending_as: RequestState) -> Generator[Page, None, None]:
    """The pages in order, formatted by Postgres PG_READERS at a time, each in a transaction of
    its own (the lines of a finalizing batch are settled: no shared snapshot is needed).

    Each ROWS_PER_FETCH line numbers are read as one page by one statement, unless a line of
    them is larger than PAGE_BYTES / ROWS_PER_FETCH (`line_cap`): so many lines no larger than
    that are a page's bytes at most, and the statement formats no line larger (`_pg_page_sql`)
    and says whether it met one. Only then are that range's sizes read and its pages cut
    (`page_ends`), and the ranges after it (a batch of large answers) are cut before they are
    read. Most batches, answers under a KB or two, are read without any plan: reading every
    line's size beforehand was a second read of the rows, a seventh of the database's time.

    A page comes as the bytes Postgres sent, on psycopg's cursor: read as text, its lines were
    decoded into a str and encoded back, a fifth of the finalizing process's CPU."""
    c = BatchRequest.__table__.c
    with units() as session:
        last = session.execute(select(func.max(c.line)).where(c.batch_id == batch_id)).scalar() or 0
    statement = _pg_page_sql(_file_of_states(files), tuple(str(state) for state in error_bodies(pending_as)))
    params = _pg_params(batch_id, pending_as)
    line_cap = PAGE_BYTES // ROWS_PER_FETCH
    cut_first = False  # whether the ranges not yet asked for are cut before they are read

    def fetch(sql: str, bounds: dict[str, int]) -> list[Any]:
        """The rows of one statement, in a transaction of its own, text columns as their bytes,
        planned as a range scan of the primary key in line order (`_PG_RANGE_SCAN`)."""
        with units() as session:
            connection = session.connection().connection.driver_connection
            assert connection is not None
            with connection.cursor(binary=True) as cursor:
                cursor.adapters.register_loader("text", ByteaBinaryLoader)
                cursor.execute(_PG_RANGE_SCAN)
                # (int4 bounds: one prepared statement whatever their values, not one per int type)
                ints = {name: Int4(value) for name, value in bounds.items()}
                rows: list[Any] = cursor.execute(sql, {**params, **ints}).fetchall()
        return rows

    def read(start: int, end: int, cap: int = _NO_CAP) -> Page | None:
        """The page (start, end]; None if a line of it is larger than `cap` (not all formatted)."""
        [(first, second, n_first, n_second, *usage, fits)] = fetch(
            statement, {"start": start, "end": end, "line_cap": cap}
        )
        if fits is False:
            return None
        return Page(
            lines=(first or b"", second or b""),
            counts=(int(n_first), int(n_second)),
            usage=(int(usage[0]), int(usage[1]), int(usage[2]), int(usage[3])),
        )

    def read_all(start: int, end: int) -> Page:
        page = read(start, end)
        assert page is not None  # (no line is over _NO_CAP: a text is at most 1 GB)
        return page

    def read_range(start: int, end: int, cut: bool) -> Page | list[tuple[int, int]]:
        """The range as one page, or (a line of it over line_cap) its pages, cut by its sizes."""
        if not cut and (page := read(start, end, line_cap)) is not None:
            return page
        ends = list(page_ends(fetch(_PG_SIZES, {"start": start, "end": end})))
        if len(ends) <= 1:
            return read_all(start, end)
        return list(zip([start, *ends[:-1]], [*ends[:-1], end], strict=True))

    ranges = ((start, min(start + ROWS_PER_FETCH, last)) for start in range(0, last, ROWS_PER_FETCH))
    with ThreadPoolExecutor(PG_READERS, thread_name_prefix="finalize-read") as pool:
        ahead: deque[Future[Any]] = deque()  # in line order: a range's page or its cut, or a page of a cut
        try:
            while True:
                while len(ahead) < PG_AHEAD and (range_ := next(ranges, None)) is not None:
                    ahead.append(pool.submit(read_range, *range_, cut_first))
                if not ahead:
                    return
                got = ahead.popleft().result()
                if isinstance(got, Page):
                    yield got
                    continue
                cut_first = True  # large answers: the ranges after this one are cut before they are read
                cut: Iterator[tuple[int, int]] = iter(got)
                pieces: deque[Future[Any]] = deque()
                try:
                    while True:  # its pages in order, ahead of the ranges after it, the reads held bounded
                        while len(pieces) < max(1, PG_AHEAD - len(ahead)) and (piece := next(cut, None)):
                            pieces.append(pool.submit(read_all, *piece))
                        if not pieces:
                            break
                        yield pieces.popleft().result()
                finally:
                    for future in pieces:
                        future.cancel()
        finally:
            for future in ahead:  # a reader that stopped early: read no further than what runs
                future.cancel()


def page_ends(sizes: Sequence[Any]) -> Iterator[int]:
    """The last line of each page, from (line, bytes) in line order: a page ends before the line
    that would take it past PAGE_BYTES (it always holds one) or at ROWS_PER_FETCH lines."""
    held = count = last = 0
    for line, size in sizes:
        if count and (held + size > PAGE_BYTES or count >= ROWS_PER_FETCH):
            yield last
            held = count = 0
        held, count, last = held + size, count + 1, line
    if count:
        yield last


def _byte_length(session: Session, column: Any) -> ColumnElement[Any]:
    if session.get_bind().dialect.name == "postgresql":
        return func.coalesce(func.octet_length(column), 0)
    return func.coalesce(func.length(cast(column, LargeBinary)), 0)  # SQLite: a blob's length is its bytes


def _line_size(session: Session) -> ColumnElement[Any]:
    """What a line's bytes are planned as: its answer, its custom_id and LINE_OVERHEAD."""
    c = BatchRequest.__table__.c
    return cast(_byte_length(session, c.response_body) + _byte_length(session, c.custom_id) + LINE_OVERHEAD, Integer)


def _sizes_query(session: Session, batch_id: str) -> Any:
    c = BatchRequest.__table__.c
    return select(c.line, _line_size(session).label("size")).where(
        c.batch_id == batch_id, c.line > bindparam("start"), c.line <= bindparam("stop")
    )


def _totals_query(session: Session, batch_id: str) -> Any:
    """The sizes' sum of each of PLAN_RANGES ranges (start_n, stop_n]: a subquery each, read
    through the primary key. (One GROUP BY over the ranges sorted their rows, and Postgres gave
    it parallel workers, two processes started for each statement.)"""
    c = BatchRequest.__table__.c
    return select(
        *(
            select(func.coalesce(func.sum(_line_size(session)), 0))
            .where(c.batch_id == batch_id, c.line > bindparam(f"start_{n}"), c.line <= bindparam(f"stop_{n}"))
            .scalar_subquery()
            for n in range(PLAN_RANGES)
        )
    )


def _page_query(batch_id: str, files: Files) -> Any:
    c = BatchRequest.__table__.c
    page_rows = (
        select(c.line, c.result_id, c.custom_id, c.state, c.status_code, c.request_id, c.response_body)
        .add_columns(*(c[name] for name in USAGE_COLUMNS))
        .where(c.batch_id == batch_id, c.line > bindparam("start"), c.line <= bindparam("end"))
        .offset(0)
        .subquery()
    )
    return select(page_rows).where(page_rows.c.state.in_([*files[0], *files[1]])).order_by(page_rows.c.line)


# The order a page's CASEs test the states in: the most common first (each test is a string
# comparison, a row's cost on Postgres), succeeded before all for a batch that ran.
_STATE_ORDER = (
    RequestState.succeeded,
    RequestState.pending,
    RequestState.expired,
    RequestState.failed,
    RequestState.cancelled,
    RequestState.running,
)


def _file_of_states(files: Files) -> tuple[tuple[str, int], ...]:
    """Each state in `files` and the file (0 or 1) its lines go to, in _STATE_ORDER."""
    file_of = {RequestState(state): n for n in (1, 0) for state in files[n]}
    assert not set(files[0]) & set(files[1]), "a line goes to one file"
    return tuple((state.value, file_of[state]) for state in _STATE_ORDER if state in file_of)


def _pg_params(batch_id: str, pending_as: RequestState) -> dict[str, Any]:
    """`_pg_page_sql`'s parameters but the page's range: an error line's tail (all of it after
    its custom_id) is one parameter a state."""
    tails = {
        f"tail_{state}": f',"response":null,"error":{body.decode()}}}\n'
        for state, body in error_bodies(pending_as).items()
    }
    return {"batch_id": batch_id, "answer_tail": '},"error":null}\n', **tails}


@lru_cache
def _pg_page_sql(file_of_states: tuple[tuple[str, int], ...], error_states: tuple[str, ...]) -> str:
    """One page read once for both files (psycopg's placeholders): each file's lines as one
    string (`format_lines`'s bytes: `to_json` of a text escapes as orjson does), each file's line
    count and the page's usage.

    The database's time per line is what bounds finalization, so a line is built with few
    operations: a state is tested by one CASE for its file and one for its error tail (each test
    is a string comparison), with the states as literals in the order most lines match
    (`_STATE_ORDER`); an error line's tail is one parameter, a line id with no result id needs no
    escaping, and FILTER is tested before an aggregate's argument, so a line's text is built only
    for the file it goes to.

    The lines are joined in the order the subquery gives them (ORDER BY line, which the primary
    key's range scan gives without a sort), not by `string_agg(... ORDER BY line)`: Postgres 15
    sorts an ordered aggregate's input whatever order it comes in, a quarter of the database's
    time a page. The subquery keeps its order up to the one Aggregate over it (it has OFFSET,
    so it is not flattened into the aggregate's scan), and its order is the range scan's, not a
    sort's (`_PG_RANGE_SCAN`); the byte-equality test
    (tests/jobs/test_output.py) holds it, over pages of lines out of insertion order."""
    for state in (*(state for state, _ in file_of_states), *error_states):
        assert state in _STATE_ORDER, state  # RequestState values, written into the statement as literals
    order = [state.value for state in _STATE_ORDER]
    file = " ".join(f"WHEN '{state}' THEN {n}" for state, n in file_of_states)
    tails = " ".join(f"WHEN '{state}' THEN %(tail_{state})s" for state in sorted(error_states, key=order.index))
    tail = f"WHEN '{RequestState.succeeded.value}' THEN NULL {tails}"  # (no tail: an answer line)
    line = """
        CASE WHEN result_id <> '' THEN '{"id":' || CAST(to_json('batch_req_' || result_id) AS text) || ',"custom_id":'
            ELSE '{"id":"batch_req_' || CAST(line AS text) || '","custom_id":' END
        || coalesce(CAST(to_json(custom_id) AS text), 'null')
        || coalesce(tail, ',"response":{"status_code":' || coalesce(CAST(status_code AS text), 'null')
            || ',"request_id":' || CAST(to_json(coalesce(request_id, '')) AS text)
            || ',"body":' || coalesce(nullif(response_body, ''), 'null') || CAST(%(answer_tail)s AS text))"""
    usage = ", ".join(f"coalesce(sum({c}) FILTER (WHERE succeeded), 0)" for c in USAGE_COLUMNS)
    return f"""
        SELECT
            string_agg({line}, '') FILTER (WHERE file = 0 AND fits),
            string_agg({line}, '') FILTER (WHERE file = 1 AND fits),
            count(*) FILTER (WHERE file = 0),
            count(*) FILTER (WHERE file = 1),
            {usage},
            bool_and(fits)
        FROM (
            SELECT line, result_id, custom_id, status_code, request_id, response_body, {", ".join(USAGE_COLUMNS)},
                CASE state {file} END AS file,
                CAST(CASE state {tail} END AS text) AS tail,
                state = '{RequestState.succeeded.value}' AS succeeded,
                {PG_LINE_SIZE} <= %(line_cap)s AS fits
            FROM batch_requests
            WHERE batch_id = %(batch_id)s AND line > %(start)s AND line <= %(end)s
            ORDER BY line
            OFFSET 0
        ) AS page
    """


# What a page's and a cut's statements are planned under, for their transaction only: no sort and
# no parallel workers, so the primary key's range scan, which gives the lines in order. Left to
# the planner, the range's rows were read by a bitmap scan and sorted (a fifth of the database's
# time a page: `line` correlates with nothing across batches), or, planned for the parameters'
# values, by two parallel workers started for the statement.
_PG_RANGE_SCAN = (
    "SELECT set_config('enable_sort', 'off', true), set_config('max_parallel_workers_per_gather', '0', true)"
)


# The (line, size) of each line of a range, in line order: what `page_ends` cuts it by.
_PG_SIZES = f"""
    SELECT line, {PG_LINE_SIZE} FROM batch_requests
    WHERE batch_id = %(batch_id)s AND line > %(start)s AND line <= %(end)s
    ORDER BY line
"""


def _split_page(rows: Sequence[Any], files: Files, errors: dict[str, bytes]) -> Page:
    """A page of rows (`_page_query`'s columns) as both files' lines, counts and usage."""
    first = [row for row in rows if row.state in files[0]]
    second = [row for row in rows if row.state in files[1]]
    succeeded = [row for row in rows if row.state == RequestState.succeeded]
    usage = [sum(getattr(row, name) or 0 for row in succeeded) for name in USAGE_COLUMNS]
    return Page(
        lines=(format_lines(first, errors), format_lines(second, errors)),
        counts=(len(first), len(second)),
        usage=(usage[0], usage[1], usage[2], usage[3]),
    )
