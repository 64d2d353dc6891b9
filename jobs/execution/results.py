"""Recording the fleet's final answers: each exactly once, with its usage billed in the same
transaction.

Every write is a compare-and-set on the line's state and claim token, so a step done twice
(a worker killed, a message redelivered, a slow worker presumed dead) changes nothing, and
the ledger entry exists exactly when the result does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from sqlalchemy import Integer, String, Table, Text, TextClause, bindparam, text, update
from sqlalchemy.orm import Session

from backfill.jobs.billing.ledger import record_usage
from backfill.jobs.errors import error_bytes
from backfill.jobs.execution.replies import Outcome, Usage
from backfill.jobs.models import Batch, BatchRequest, BatchStatus, RequestState, new_id, utcnow

ATTEMPTS_EXCEEDED = "max_attempts_exceeded"
# The columns of a group's answers, in the order `record_outcomes` lists them.
_GIVEN = (
    ("batch_id", String()),
    ("line", Integer()),
    ("state", String()),
    ("result_id", String()),
    ("status_code", Integer()),
    ("request_id", String()),
    ("response_body", Text()),
    ("prompt_tokens", Integer()),
    ("cached_tokens", Integer()),
    ("completion_tokens", Integer()),
    ("reasoning_tokens", Integer()),
)


def attempts_exceeded(attempts: int, why: str) -> Outcome:
    """The failed result of a line tried `attempts` times without an answer to record: a 500 with
    OpenAI's error envelope, so it lands in the error file like any failed request."""
    message = f"This request was tried {attempts} times and never finished ({why}); it will not be tried again."
    body = error_bytes(message, type_="server_error", code=ATTEMPTS_EXCEEDED)
    return Outcome(status_code=500, body=body, request_id=None, usage=Usage())


def record_outcome(session: Session, *, batch_id: str, line: int, claim_token: str, outcome: Outcome) -> bool:
    """Store the fleet's final answer once. False if this claim no longer owns the line."""
    return record_outcomes(session, claim_token=claim_token, results=[(batch_id, line, outcome)]) == 1


def record_outcomes(session: Session, *, claim_token: str, results: Sequence[tuple[str, int, Outcome]]) -> int:
    """Store a group of final answers, each exactly once; returns how many this claim still owned."""
    return record_group(session, claim_token=claim_token, results=results).recorded


@dataclass(frozen=True)
class Recorded:
    recorded: int  # answers this claim still owned, now stored
    complete: list[str]  # batches running whose every line now has its answer: ready to finalize


def record_group(session: Session, *, claim_token: str, results: Sequence[tuple[str, int, Outcome]]) -> Recorded:
    """Store a group of final answers, each exactly once, and say which of their batches are
    now complete.

    Lines are written in (batch, line) order and each batch's counters once per group, so
    concurrent drains take row locks in one order and a group costs one counter update per batch.
    The batch row read after that update (the ledger needs it) tells whether every line has its
    answer: read in the same transaction after the update, which waited for the row, it sees every
    other recorder's commit, so of two recorders that write a batch's last lines at once, the
    later one sees the batch complete. (A batch none of whose lines this claim still owned is
    not looked at: the claim that owns them records them.)
    """
    if not results:
        return Recorded(0, [])
    # A line given twice is recorded once (the first answer), as a second compare-and-set fails.
    ordered = sorted({(b, n): (b, n, o) for b, n, o in reversed(results)}.values(), key=lambda r: (r[0], r[1]))
    rows: list[tuple[object, ...]] = []
    for batch_id, line, outcome in ordered:
        u = outcome.usage if outcome.succeeded else Usage()  # a failed request costs nothing
        rows.append(
            (
                batch_id,
                line,
                (RequestState.succeeded if outcome.succeeded else RequestState.failed).value,
                new_id(),
                outcome.status_code,
                outcome.request_id[:128] if outcome.request_id else None,  # the column's size
                outcome.body.decode(),
                u.prompt_tokens,
                u.cached_tokens,
                u.completion_tokens,
                u.reasoning_tokens,
            )
        )
    owned = _write_results(session, claim_token, rows)
    recorded: dict[str, list[tuple[int, Outcome]]] = {}
    for batch_id, line, outcome in ordered:
        if (batch_id, line) in owned:
            recorded.setdefault(batch_id, []).append((line, outcome))
    complete: list[str] = []
    for batch_id, items in recorded.items():
        ok = [o.usage for _, o in items if o.succeeded]
        session.execute(
            update(Batch)
            .where(Batch.id == batch_id)
            .values(
                completed=Batch.completed + len(ok),
                failed=Batch.failed + (len(items) - len(ok)),
                input_tokens=Batch.input_tokens + sum(u.prompt_tokens for u in ok),
                cached_tokens=Batch.cached_tokens + sum(u.cached_tokens for u in ok),
                output_tokens=Batch.output_tokens + sum(u.completion_tokens for u in ok),
                reasoning_tokens=Batch.reasoning_tokens + sum(u.reasoning_tokens for u in ok),
            )
            .execution_options(synchronize_session=False)
        )
        # populate_existing: the row as the update left it, whatever this session held before.
        batch = session.get(Batch, batch_id, populate_existing=True)
        assert batch is not None
        record_usage(session, batch, items)
        if (
            batch.status == BatchStatus.in_progress
            and batch.unindexed == 0
            and batch.completed + batch.failed >= batch.total
        ):
            complete.append(batch_id)
    return Recorded(sum(len(items) for items in recorded.values()), complete)


def _write_results(session: Session, claim_token: str, rows: list[tuple[object, ...]]) -> set[tuple[str, int]]:
    """Write the answers on the lines `claim_token` still holds; returns those lines.

    On Postgres one statement for the group, not one per line: the answers as arrays
    unnested and joined to their rows (a drain's CPU per line is mostly per-statement work). The claim's
    compare-and-set stays per row (state and token in the WHERE); RETURNING says which lines
    matched. SQLite (tests, embedded mode) has no column list on VALUES: one UPDATE a line."""
    table = cast(Table, BatchRequest.__table__)
    held = (table.c.state == RequestState.running.value, table.c.claim_token == claim_token)
    done = {"finished_at": utcnow(), "claim_token": None}
    if session.get_bind().dialect.name != "postgresql":
        owned: set[tuple[str, int]] = set()
        for row in rows:
            batch_id, line = str(row[0]), int(row[1])  # type: ignore[call-overload]
            result = session.execute(
                update(table)
                .where(table.c.batch_id == batch_id, table.c.line == line, *held)
                .values({**{name: value for (name, _), value in zip(_GIVEN[2:], row[2:], strict=True)}, **done})
            )
            if result.rowcount == 1:  # type: ignore[attr-defined]
                owned.add((batch_id, line))
        return owned
    # One array per column, unnested: the statement's text is the same for every group size, so
    # it is compiled once and prepared by the server, not rendered afresh with a VALUES row each.
    columns = {name: [row[k] for row in rows] for k, (name, _) in enumerate(_GIVEN)}
    found = session.execute(_RECORD_GROUP, {**columns, "finished_at": done["finished_at"], "claim_token": claim_token})
    return {(str(b), int(n)) for b, n in found}


def _record_group_statement() -> TextClause:
    """`_write_results`'s Postgres statement: the answers unnested from one array per column,
    joined to their rows, the claim's compare-and-set per row, RETURNING the lines it held."""
    sql_type = {"String": "varchar", "Integer": "integer", "Text": "text"}
    arrays = ", ".join(f"CAST(:{name} AS {sql_type[type(t).__name__]}[])" for name, t in _GIVEN)
    names = ", ".join(name for name, _ in _GIVEN)
    sets = ", ".join(f"{name} = given.{name}" for name, _ in _GIVEN[2:])
    return text(
        f"UPDATE batch_requests SET {sets}, finished_at = :finished_at, claim_token = NULL "
        f"FROM unnest({arrays}) AS given({names}) "
        "WHERE batch_requests.batch_id = given.batch_id AND batch_requests.line = given.line "
        f"AND batch_requests.state = '{RequestState.running.value}' AND batch_requests.claim_token = :claim_token "
        "RETURNING batch_requests.batch_id, batch_requests.line"
    ).bindparams(bindparam("finished_at", type_=BatchRequest.__table__.c.finished_at.type))


_RECORD_GROUP = _record_group_statement()
