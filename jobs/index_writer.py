"""Writing a batch's request index rows to the database: one COPY in Postgres's text format,
multi-row INSERTs in SQLite (the embedded mode)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from enum import Enum
from itertools import islice
from typing import Any

from sqlalchemy import insert
from sqlalchemy.orm import Session

from backfill.jobs.models import BatchRequest
from backfill.jobs.request_index import INDEX_COLUMNS, RequestIndex

INSERT_ROWS = 5000


def row_columns() -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """The columns an index row writes (batch_id, INDEX_COLUMNS, then every other column with a
    constant default, since COPY applies no ORM defaults) and the values of those defaults."""
    table = BatchRequest.__table__
    given = {"batch_id", *INDEX_COLUMNS}
    defaults = {
        c.name: c.default.arg
        for c in table.columns
        if c.name not in given and c.default is not None and c.default.is_scalar
    }
    constants = tuple(v.value if isinstance(v, Enum) else v for v in defaults.values())
    return ("batch_id", *INDEX_COLUMNS, *defaults), constants


def write_index(session: Session, *, batch_id: str, requests: RequestIndex, ranks: range | None = None) -> None:
    """Insert a batch's index rows (all, or those at `ranks` of the release order, in that
    order) in the session's transaction, streamed: nothing per line is
    built beyond a chunk of rows. Postgres gets one COPY in its text format, the rows formatted
    here (`copy_text`: psycopg's per-value `write_row` cost more than the database's own work on
    a million rows); SQLite, the embedded mode, multi-row INSERTs.

    All or nothing with the transaction, so a validation killed midway leaves no rows and the
    next attempt (which deletes the batch's rows first) starts clean."""
    names, constants = row_columns()
    connection = session.connection()
    if connection.dialect.name == "postgresql":
        driver = connection.connection.driver_connection
        assert driver is not None
        statement = "COPY batch_requests ({}) FROM STDIN".format(", ".join(f'"{n}"' for n in names))
        with driver.cursor() as cursor, cursor.copy(statement) as copy:
            for chunk in copy_text(batch_id, requests.rows(ranks), constants):
                copy.write(chunk)
        return
    rows = ((batch_id, *row, *constants) for row in requests.rows(ranks))
    insert_rows = insert(BatchRequest)
    while part := [dict(zip(names, row, strict=True)) for row in islice(rows, INSERT_ROWS)]:
        connection.execute(insert_rows, part)


_COPY_SPECIAL = re.compile(r"[\\\t\n\r]")
_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})
_COPY_NULL = "\\N"
COPY_CHUNK_ROWS = 8192


def _copy_field(value: Any) -> str:
    """One value in COPY's text format."""
    if value is None:
        return _COPY_NULL
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, Enum):
        value = value.value
    return str(value).translate(_COPY_ESCAPES)


def copy_text(batch_id: str, rows: Iterable[tuple[Any, ...]], constants: Sequence[Any]) -> Iterator[bytes]:
    """COPY text for `rows` (RequestIndex.rows), COPY_CHUNK_ROWS lines a chunk: batch_id, the
    row, the constants. Only custom_id can hold a character COPY escapes (the other values are
    numbers, hex or NULL); escaping it only when it has one keeps the common line one f-string."""
    head = _copy_field(batch_id) + "\t"
    tail = "".join("\t" + _copy_field(v) for v in constants) + "\n"
    special, escapes, null = _COPY_SPECIAL.search, _COPY_ESCAPES, _COPY_NULL
    out: list[str] = []
    for line, custom_id, offset, length, prefix_hash, prefix_tokens, kv_tokens, rank, after, estimate in rows:
        if special(custom_id):
            custom_id = custom_id.translate(escapes)
        out.append(
            f"{head}{line}\t{custom_id}\t{offset}\t{length}\t{prefix_hash}\t{prefix_tokens}\t{kv_tokens}"
            f"\t{rank}\t{null if after is None else after}\t{estimate}{tail}"
        )
        if len(out) == COPY_CHUNK_ROWS:
            yield "".join(out).encode()
            out.clear()
    if out:
        yield "".join(out).encode()
