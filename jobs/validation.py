"""Validation of a batch input file: every line checked, every problem reported with its line.

Valid batches get a compact request index (line, byte offset and length, custom_id, token
estimate, and the prompt's place in the batch's prefix tree: see `jobs.prefixes`) instead of
one queue message per line. Nothing a user can
write makes validation raise; an unexpected failure ends the batch through
`fail_batch_validation` instead of retrying it until it expires.
"""

from __future__ import annotations

import logging
import re
from array import array
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import Enum
from itertools import islice
from struct import Struct
from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session

from backfill.jobs.catalog import FleetUnavailable
from backfill.jobs.models import Batch, BatchRequest, BatchStatus, utcnow
from backfill.jobs.prefixes import (
    BLOCK_TOKENS,
    FINGERPRINT_BYTES,
    PrefixPlan,
    PromptBlocks,
    TextBlocks,
    node_id,
    plan_prefix_order,
)
from backfill.jobs.quotas import quota_errors
from backfill.jobs.validation_lines import (
    INT32_MAX,
    INT64_MAX,
    SeenIds,
    check_line,
    iter_lines,
    iter_lines_bounded,
    line_checker,
    max_output_tokens,
    prompt_text,
    quote,
)
from backfill.jobs.webhooks import record_batch_event

# iter_lines, max_output_tokens and prompt_text are also read by the CLI's local estimate.
UnitOfWork = Callable[[], AbstractContextManager[Session]]

__all__ = [
    "Limits",
    "RequestIndex",
    "ValidationResult",
    "apply_validation",
    "fail_batch_validation",
    "is_transient_validation_error",
    "iter_lines",
    "iter_lines_bounded",
    "max_output_tokens",
    "prompt_text",
    "validate_lines",
    "validation_failure_message",
    "write_index_parts",
]

log = logging.getLogger("backfill.validation")

VALIDATION_FAILED_CODE = "validation_failed"
# Index rows written with the batch's move to in_progress, then per transaction after it: enough
# for the drains' first minutes, and a part a fraction of a second of COPY.
FIRST_INDEX_PART = 20_000
INDEX_PART = 50_000
INSERT_ROWS = 5000
MESSAGE_CHARS = 500


@dataclass
class Limits:
    max_requests: int
    max_line_bytes: int
    max_errors: int


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

    The release order (`jobs.prefixes.plan_prefix_order`) is derived once all lines are in.
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


@dataclass
class ValidationResult:
    errors: list[dict[str, Any]] = field(default_factory=list)
    error_count: int = 0
    requests: RequestIndex = field(default_factory=RequestIndex)
    model: str | None = None
    token_estimate: int = 0

    def add_error(self, limits: Limits, *, code: str, message: str, line: int | None, param: str | None = None) -> None:
        self.error_count += 1
        if len(self.errors) < limits.max_errors:
            self.errors.append({"code": code, "message": message[:MESSAGE_CHARS], "param": param, "line": line})


@dataclass
class LineScan:
    """What one pass over a run of lines found, before the whole-file checks (`finish_validation`).
    A file is one run, or several scanned apart and merged (`jobs.validation_parallel`)."""

    result: ValidationResult
    seen_ids: SeenIds = field(default_factory=SeenIds)
    models: dict[str, int] = field(default_factory=dict)  # model -> first line naming it
    requests: int = 0  # lines that are not blank
    lines: int = 0  # the last line number the run used
    stopped: bool = False  # past max_requests: the rest was not read


def validate_lines(
    chunks: Iterable[bytes],
    *,
    endpoint: str,
    served_models: set[str] | None,
    limits: Limits,
    blocks: PromptBlocks | None = None,
) -> ValidationResult:
    """Check every line. Never raises for anything in the file; errors stay within max_errors.

    `blocks` fingerprints each prompt along its token stream (the model's tokenizer where
    backfill has it); by default a stable text approximation."""
    # One byte of slack for the '\r' of a CRLF line, which is not part of the request.
    numbered = iter_lines_bounded(chunks, max_line_bytes=min(limits.max_line_bytes, INT32_MAX - 1) + 1)
    scan = scan_lines(numbered, endpoint=endpoint, limits=limits, blocks=blocks)
    return finish_validation(scan, limits=limits, served_models=served_models)


def scan_lines(
    numbered: Iterable[tuple[int, int, int, bytes | None]],
    *,
    endpoint: str,
    limits: Limits,
    blocks: PromptBlocks | None = None,
) -> LineScan:
    """Check each line of `numbered` ((number, offset, length, raw or None past the limit), as
    `iter_lines_bounded` gives them) on its own, and index the valid ones.

    A line goes through `line_checker` first, which confirms the common valid line cheaply;
    any other goes through `check_line`, which alone reports errors."""
    blocks = blocks or TextBlocks()
    scan = LineScan(ValidationResult())
    result, index, seen_ids, models = scan.result, scan.result.requests, scan.seen_ids, scan.models
    # Line numbers, lengths and counts go into Integer columns.
    max_requests = min(limits.max_requests, INT32_MAX)
    max_line_bytes = min(limits.max_line_bytes, INT32_MAX - 1)
    count = 0
    number = 0
    token_estimate = 0
    fast = line_checker(endpoint, seen_ids)
    path_of, add = blocks.path, index.add

    def fail(code: str, message: str, param: str | None) -> None:
        result.add_error(limits, code=code, message=message, line=number, param=param)

    line: bytes | None
    for number, offset, length, raw in numbered:
        # The common line (ending in '}': not blank, no '\r' to strip; within the limit) goes on;
        # each other one the checks in order: blank, too many, '\r', too large, check_line.
        if raw and raw[-1] == 125 and len(raw) <= max_line_bytes:  # ends in '}'
            count += 1
            if count > max_requests or number > INT32_MAX:
                fail("too_many_requests", too_many_requests_message(max_requests), None)
                scan.stopped = True
                break
            line = raw
        else:
            if raw is not None and (not raw or raw.isspace()):
                continue  # blank lines are skipped, as OpenAI does
            count += 1
            if count > max_requests or number > INT32_MAX:
                fail("too_many_requests", too_many_requests_message(max_requests), None)
                scan.stopped = True
                break
            line = raw[:-1] if raw is not None and raw.endswith(b"\r") else raw
            if line is None or len(line) > max_line_bytes:
                fail("line_too_large", f"Line is {length} bytes; the limit is {max_line_bytes}.", None)
                continue
        checked = fast(line, number)
        if checked is not None:
            custom_id, model, prompt, estimate, body, output, n = checked
        else:
            request = check_line(line, endpoint=endpoint, seen_ids=seen_ids, fail=fail, number=number)
            if request is None:
                continue
            custom_id, model, prompt, estimate, body, output, n = request.values()
        if model not in models:
            models[model] = number
        token_estimate += estimate
        path, prompt_tokens = path_of(endpoint, body, prompt)
        add(number, offset, length, custom_id, path, estimate, prompt_tokens + output, n)
    result.token_estimate += token_estimate
    scan.requests, scan.lines = count, number
    return scan


def too_many_requests_message(max_requests: int) -> str:
    return f"The file has more than {max_requests} requests, the most a batch may hold."


def finish_validation(scan: LineScan, *, limits: Limits, served_models: set[str] | None) -> ValidationResult:
    """The checks that need the whole file: some request at all, one model that is served, and
    how many errors went unlisted."""
    result = scan.result
    # Cannot overflow with the per-request bound, but the column is what must hold it.
    result.token_estimate = min(result.token_estimate, INT64_MAX)
    if scan.requests == 0:
        result.add_error(limits, code="empty_file", message="The input file has no requests.", line=None)
    _check_models(result, limits, scan.models, served_models)
    if result.error_count > len(result.errors):
        result.errors.append(
            {
                "code": "too_many_errors",
                "message": f"{result.error_count - len(result.errors)} more errors were not listed.",
                "param": None,
                "line": None,
            }
        )
    return result


def _check_models(
    result: ValidationResult, limits: Limits, models: dict[str, int], served_models: set[str] | None
) -> None:
    if len(models) > 1:
        (first, first_line), *others = sorted(models.items(), key=lambda kv: kv[1])
        for model, number in others:
            result.add_error(
                limits,
                code="mismatched_model",
                line=number,
                param="body.model",
                message=f"Model {quote(model)} differs from {quote(first)} on line {first_line}: a batch uses one model.",
            )
    if len(models) == 1:
        result.model = next(iter(models))
        if served_models is not None and result.model not in served_models:
            available = ", ".join(sorted(served_models))
            if len(available) > 150:  # the fleet's own names, but a long list is no help either
                available = available[:150] + "…"
            result.add_error(
                limits,
                code="model_not_found",
                line=models[result.model],
                param="body.model",
                message=f"The model {quote(result.model)} is not served here. Available: {available}.",
            )


def apply_validation(session: Session, *, batch_id: str, result: ValidationResult) -> str:
    """Record the outcome. Idempotent: a redelivered validation replaces its own earlier index."""
    batch = session.get(Batch, batch_id, with_for_update=True)
    if batch is None or batch.status not in (BatchStatus.validating, BatchStatus.cancelling):
        return batch.status if batch else "missing"
    now = utcnow()
    token_estimate = min(result.token_estimate, INT64_MAX)
    if not result.errors and result.model is not None and batch.status == BatchStatus.validating:
        # Over quota fails like any validation error: no request index, so nothing is dispatched.
        result.errors.extend(
            quota_errors(
                session,
                team_id=batch.team_id,
                model=result.model,
                batch_id=batch_id,
                token_estimate=token_estimate,
            )
        )
    if result.errors:
        session.execute(
            update(Batch)
            .where(Batch.id == batch_id, Batch.status.in_([BatchStatus.validating, BatchStatus.cancelling]))
            .values(status=BatchStatus.failed, failed_at=now, errors=result.errors, model=result.model)
        )
        record_batch_event(session, batch_id=batch_id, status=BatchStatus.failed)  # the webhook outbox
        return BatchStatus.failed
    session.execute(delete(BatchRequest).where(BatchRequest.batch_id == batch_id))
    # The first part of the index now, the rest by `write_index_parts` in transactions of their
    # own: the batch runs from its first lines while the rest are written.
    first = min(len(result.requests), FIRST_INDEX_PART)
    write_index(session, batch_id=batch_id, requests=result.requests, ranks=range(first))
    values: dict[str, Any] = {
        "model": result.model,
        "total": len(result.requests),
        "unindexed": len(result.requests) - first,
        "token_estimate": token_estimate,
    }
    if batch.status == BatchStatus.validating:
        values.update(status=BatchStatus.in_progress, in_progress_at=now)
    session.execute(update(Batch).where(Batch.id == batch_id).values(**values))
    return str(values.get("status", batch.status))


def write_index_parts(units: UnitOfWork, *, batch_id: str, requests: RequestIndex) -> int:
    """Write the index rows `apply_validation` left, INDEX_PART rows in release order per
    transaction, each committed with the batch's `unindexed` count. Resumable and idempotent: a
    part starts where the count says (a validation killed midway is picked up by the next,
    which scans the file again and continues), so no row is written twice. Returns how many
    rows are written in all (the batch's `total` once done)."""
    while True:
        with units() as session:
            # FOR NO KEY UPDATE: claims (FOR KEY SHARE) go on; an expiry (FOR UPDATE) waits.
            batch = session.execute(
                select(Batch.total, Batch.unindexed).where(Batch.id == batch_id).with_for_update(key_share=True)
            ).one_or_none()
            if batch is None:
                return 0
            total, unindexed = int(batch.total), int(batch.unindexed)
            if total != len(requests):  # not this index (or none to write)
                log.error("batch %s: index of %d lines does not match its %d; not written", batch_id, len(requests), total)
                return total - unindexed
            start = total - unindexed
            if start >= total:
                return start
            end = min(start + INDEX_PART, total)
            write_index(session, batch_id=batch_id, requests=requests, ranks=range(start, end))
            session.execute(update(Batch).where(Batch.id == batch_id).values(unindexed=total - end))


def _row_columns() -> tuple[tuple[str, ...], tuple[Any, ...]]:
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
    names, constants = _row_columns()
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


def fail_batch_validation(session: Session, *, batch_id: str, message: str) -> str:
    """Move a batch still validating to `failed` with one batch-level error; returns its status.

    Compare-and-set on the status, so it is idempotent and never touches a batch that has
    moved on (validated, cancelled, expired); a cancelling batch is ended by finalization.
    """
    error = {"code": VALIDATION_FAILED_CODE, "message": message[:MESSAGE_CHARS], "param": None, "line": None}
    moved = session.execute(
        update(Batch)
        .where(Batch.id == batch_id, Batch.status == BatchStatus.validating)
        .values(status=BatchStatus.failed, failed_at=utcnow(), errors=[error])
        .execution_options(synchronize_session=False)
    )
    if moved.rowcount:  # type: ignore[attr-defined]
        record_batch_event(session, batch_id=batch_id, status=BatchStatus.failed)  # the webhook outbox
        return BatchStatus.failed
    status = session.execute(select(Batch.status).where(Batch.id == batch_id)).scalar_one_or_none()
    return status if status is not None else "missing"


def is_transient_validation_error(exc: BaseException) -> bool:
    """Whether retrying validation later may succeed: the fleet's model list, the database or
    the object store being unreachable for a while. Anything else fails the batch."""
    if isinstance(exc, FleetUnavailable | OperationalError | PoolTimeout | ConnectionError | TimeoutError):
        return True
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    try:
        from botocore import exceptions as s3
    except ImportError:  # the embedded mode's local object store needs no botocore
        return False
    if isinstance(exc, s3.ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return status >= 500 or exc.response.get("Error", {}).get("Code") in ("SlowDown", "Throttling")
    # Connecting, reading and streaming; not configuration, credentials or parameters.
    return isinstance(exc, s3.ConnectionError | s3.HTTPClientError | s3.IncompleteReadError)


def validation_failure_message(exc: BaseException) -> str:
    """What the user reads when validation ended in a permanent failure (no internals leaked)."""
    if isinstance(exc, FileNotFoundError):
        return "The input file could not be read: it no longer exists."
    if is_transient_validation_error(exc):
        return "The input file could not be validated: a service it needs stayed unavailable. Please try again."
    return (
        f"The input file could not be validated because of an internal error ({type(exc).__name__}). Please try again."
    )
