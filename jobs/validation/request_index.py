"""The request index of a valid batch, held in memory between validation and the database:
per line its number, byte offset and length, custom_id, token estimate, and its prompt's place
in the batch's prefix tree (`jobs.execution.prefixes`), from which the release order is derived."""

from __future__ import annotations

import re
from array import array
from collections.abc import Collection, Iterable, Iterator, Sequence
from enum import Enum
from itertools import islice
from struct import Struct
from typing import Any

from sqlalchemy import insert
from sqlalchemy.orm import Session

from backfill.jobs.execution.prefixes import BLOCK_TOKENS, FINGERPRINT_BYTES, PrefixPlan, node_id, plan_prefix_order
from backfill.jobs.models import BatchRequest
from backfill.jobs.validation.lines import INT32_MAX

# The columns a request's index row fills, in the order `RequestIndex.rows` gives them.
INDEX_COLUMNS = (
    "line",
    "custom_id",
    "offset",
    "length",
    "prefix_hash",
    "prefix_tokens",
    "kv_tokens",
    "prefix_rank",
    "after_line",
    "token_estimate",
)
_INTS = 5  # line, length, token estimate, KV tokens, completions (n): each fits an int32
_pack_ints = Struct(f"{_INTS}i").pack  # (native: as array("i") holds them)


class RequestIndex(Collection[dict[str, Any]]):
    """The index rows of a valid batch, kept in arrays: about 50 bytes a line plus its custom_id
    and prompt path (4 bytes a block) instead of a dict's 600, so a million-line batch fits a
    worker's memory. Iterating gives dicts (for tests and tools); `rows` gives the tuples the
    database writer streams.

    The release order (`jobs.execution.prefixes.plan_prefix_order`) is derived once all lines are in.
    """

    def __init__(self, block_tokens: int = BLOCK_TOKENS) -> None:
        self.block_tokens = block_tokens
        self._ints = array("i")  # _INTS numbers a line, each within INT32_MAX (checked by validation)
        self._offsets = array("q")
        self._paths = bytearray()  # the prompt paths, one after another
        self._path_ends = array("q")
        self._ids = bytearray()  # the custom_ids in UTF-8, one after another
        self._id_ends = array("q")
        self._plan: PrefixPlan | None = None
        self._order: array[int] | None = None  # see _by_rank

    def add(
        self,
        line: int,
        offset: int,
        length: int,
        custom_id: str,
        path: bytes,
        token_estimate: int,
        kv_tokens: int,
        samples: int = 1,
    ) -> None:
        # One packed call: an array's extend converts each int with PyArg_Parse, 3x the cost.
        self._ints.frombytes(_pack_ints(line, length, token_estimate, min(kv_tokens, INT32_MAX), samples))
        self._offsets.append(offset)
        paths = self._paths
        if path:  # (most short prompts have none)
            paths += path
        self._path_ends.append(len(paths))
        ids = self._ids
        ids += custom_id.encode()
        self._id_ends.append(len(ids))
        self._plan = None

    def __len__(self) -> int:
        return len(self._id_ends)

    def extend(self, other: RequestIndex, *, line_base: int) -> None:
        """Append another index's lines, their numbers shifted by `line_base` (the lines before
        the other's part of the file)."""
        ints = array("i", other._ints)
        if line_base:
            ints[0::_INTS] = array("i", [n + line_base for n in ints[0::_INTS]])
        self._ints.extend(ints)
        self._offsets.extend(other._offsets)
        shift = len(self._paths)
        self._paths += other._paths
        self._path_ends.extend(end + shift for end in other._path_ends)
        shift = len(self._ids)
        self._ids += other._ids
        self._id_ends.extend(end + shift for end in other._id_ends)
        self._plan = None

    def _path(self, i: int) -> bytes:
        return bytes(self._paths[self._path_ends[i - 1] if i else 0 : self._path_ends[i]])

    def plan(self) -> PrefixPlan:
        if self._plan is None:
            paths = [self._path(i) for i in range(len(self))]
            self._plan = plan_prefix_order(paths, self._ints[0::_INTS], self._ints[3::_INTS])
        return self._plan

    def rows(self, ranks: range | None = None) -> Iterator[tuple[Any, ...]]:
        """Each line's index row: the values of INDEX_COLUMNS, in order. All lines in input
        order, or with `ranks` the lines at those places of the release order, in that order."""
        ints, offsets, bt = self._ints, self._offsets, self.block_tokens
        ids, id_ends = self._ids, self._id_ends
        plan = self.plan()
        shared_blocks, session_kv, rank, after = plan.shared_blocks, plan.session_kv, plan.rank, plan.after
        no_blocks = node_id(b"", 0)  # a prompt shorter than one block: the common short line
        if ranks is None:
            lines: Iterable[int] = range(len(self))
        else:
            by_rank = self._by_rank()
            lines = (by_rank[r] for r in ranks)
        for i in lines:
            k = _INTS * i
            custom_id = ids[id_ends[i - 1] if i else 0 : id_ends[i]].decode()
            path, shared = self._path(i), shared_blocks[i]
            blocks = len(path) // FINGERPRINT_BYTES
            if ints[k + 4] > 1:  # n completions share their whole prompt
                shared = max(shared, blocks)
            prefix_tokens = min(shared * bt, INT32_MAX)
            yield (
                ints[k],
                custom_id,
                offsets[i],
                ints[k + 1],
                # The node shared with other lines; a line sharing nothing is its own group.
                node_id(path, shared or blocks) if path else no_blocks,
                prefix_tokens,
                max(session_kv[i], prefix_tokens),
                rank[i],
                after[i] or None,
                ints[k + 2],
            )

    def _by_rank(self) -> array[int]:
        """The lines (their places in this index) in release order: the inverse of the rank."""
        if self._order is None or len(self._order) != len(self):
            rank = self.plan().rank
            order = array("q", bytes(8 * len(self)))
            for i, r in enumerate(rank):
                order[r] = i
            self._order = order
        return self._order

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for row in self.rows():
            yield dict(zip(INDEX_COLUMNS, row, strict=True))

    def __contains__(self, item: object) -> bool:
        return any(row == item for row in self)


# Writing a batch's request index rows to the database: one COPY in Postgres's text format,
# multi-row INSERTs in SQLite (the embedded mode).

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
