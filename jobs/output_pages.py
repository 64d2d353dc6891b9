"""Reading a batch's finished lines a page at a time, formatted for its output and error files.

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

from sqlalchemy import Connection, bindparam, func, select
from sqlalchemy.orm import Session

from backfill.jobs.models import BatchRequest, RequestState
from backfill.jobs.output_format import USAGE_COLUMNS, error_bodies, format_lines

ROWS_PER_FETCH = 5000  # lines a page

# The two files one read of the rows writes at once: the states of the lines in each.
Files = tuple[Sequence[str], Sequence[str]]


@dataclass(frozen=True)
class Page:
    """A page of lines, read once: each file's bytes and line count, and the page's usage."""

    lines: tuple[bytes, bytes]
    counts: tuple[int, int]
    usage: tuple[int, int, int, int]


def result_lines(
    session: Session, batch_id: str, states: Sequence[str], *, pending_as: RequestState = RequestState.expired
) -> Iterator[bytes]:
    """One file's bytes in input order (the lines in `states`), one chunk per page: `pages`
    with nothing asked of its second file."""
    with closing(pages(session, batch_id, (states, ()), pending_as=pending_as)) as read:
        for page in read:
            if page.lines[0]:
                yield page.lines[0]


def pages(session: Session, batch_id: str, files: Files, *, pending_as: RequestState) -> Generator[Page, None, None]:
    """Every page of the batch's rows in input order, each read once for both `files`."""
    connection = session.connection()
    c = BatchRequest.__table__.c
    last = connection.execute(select(func.max(c.line)).where(c.batch_id == batch_id)).scalar() or 0
    return _read(connection, batch_id, files, error_bodies(pending_as), last)


def _read(
    connection: Connection, batch_id: str, files: Files, errors: dict[str, bytes], last: int
) -> Generator[Page, None, None]:
    c = BatchRequest.__table__.c
    page_rows = (
        select(c.line, c.result_id, c.custom_id, c.state, c.status_code, c.request_id, c.response_body)
        .add_columns(*(c[name] for name in USAGE_COLUMNS))
        .where(c.batch_id == batch_id, c.line > bindparam("start"), c.line <= bindparam("end"))
        .offset(0)
        .subquery()
    )
    query = select(page_rows).where(page_rows.c.state.in_([*files[0], *files[1]])).order_by(page_rows.c.line)
    for start in range(0, last, ROWS_PER_FETCH):
        rows = connection.execute(query, {"start": start, "end": start + ROWS_PER_FETCH}).all()
        yield _split_page(rows, files, errors)


def _split_page(rows: Sequence[Any], files: Files, errors: dict[str, bytes]) -> Page:
    """A page of rows (`_read`'s columns) as both files' lines, counts and usage."""
    first = [row for row in rows if row.state in files[0]]
    second = [row for row in rows if row.state in files[1]]
    succeeded = [row for row in rows if row.state == RequestState.succeeded]
    usage = [sum(getattr(row, name) or 0 for row in succeeded) for name in USAGE_COLUMNS]
    return Page(
        lines=(format_lines(first, errors), format_lines(second, errors)),
        counts=(len(first), len(second)),
        usage=(usage[0], usage[1], usage[2], usage[3]),
    )
