"""Reading a batch's finished lines a page at a time, formatted for its output and error files.

Pages are cut by bytes, not by line count: a page ends once its lines' answers reach PAGE_BYTES
(a line larger than that is a page of its own), and holds at most ROWS_PER_FETCH lines however
small. Answers run from a few hundred bytes (chat) to hundreds of KB (embeddings), so a page of
a fixed number of lines could take gigabytes of the reader's memory. The cut is planned from
the answers' sizes (`octet_length`, which Postgres reads from a stored value's header without
fetching or decompressing it), read for ROWS_PER_FETCH lines at once, ahead of the pages.

Every read is a short transaction of its own (`units`), ended before its page is handed on, so a
reader that stalls between pages (a slow download) holds no connection and no snapshot. The
lines of a finalizing batch are settled, so its pages need no shared snapshot; a running
batch's partial output shows each line once, in input order, as it stood when its page was read.

Pages are ranges of line numbers read through the primary key (batch_id, line): each reads and
sorts at most a page of rows whatever plan the statistics give. The state is tested on the page
(a subquery with OFFSET 0, which the planner keeps as written): given to the scan, stale
statistics right after a large run led the planner to the (batch_id, state, ...) indexes and to
reading and sorting every row of the batch for each page.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Integer, LargeBinary, bindparam, cast, func, select
from sqlalchemy.orm import Session

from backfill.jobs.models import BatchRequest, RequestState
from backfill.jobs.output.format import USAGE_COLUMNS, error_bodies, format_lines
from backfill.storage.db import UnitOfWork

PAGE_BYTES = 8 * 1024 * 1024  # a page's answers: what a reader holds, a few times over, at once
ROWS_PER_FETCH = 5000  # lines a page at most, and the lines whose sizes one plan reads
LINE_OVERHEAD = 192  # a line's bytes beside its answer and custom_id (ids, status, error body)

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
    errors = error_bodies(pending_as)
    query = _page_query(batch_id, files)
    start = 0
    while True:
        with units() as session:
            sizes = session.execute(_sizes_query(session, batch_id), {"start": start}).all()
        for end in page_ends(sizes):
            with units() as session:
                rows = session.execute(query, {"start": start, "end": end}).all()
            start = end
            yield _split_page(rows, files, errors)  # (the transaction has ended)
        if len(sizes) < ROWS_PER_FETCH:
            return


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


def _sizes_query(session: Session, batch_id: str) -> Any:
    c = BatchRequest.__table__.c
    size = _byte_length(session, c.response_body) + _byte_length(session, c.custom_id) + LINE_OVERHEAD
    return (
        select(c.line, cast(size, Integer))
        .where(c.batch_id == batch_id, c.line > bindparam("start"))
        .order_by(c.line)
        .limit(ROWS_PER_FETCH)
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
