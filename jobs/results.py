"""Recording the fleet's final answers: each exactly once, with its usage billed in the same
transaction.

Every write is a compare-and-set on the line's state and claim token, so a step done twice
(a worker killed, a message redelivered, a slow worker presumed dead) changes nothing, and
the ledger entry exists exactly when the result does.
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson
from sqlalchemy import update
from sqlalchemy.orm import Session

from backfill.jobs.billing import record_usage
from backfill.jobs.models import Batch, BatchRequest, RequestState, new_id, utcnow
from backfill.jobs.replies import Outcome, Usage

ATTEMPTS_EXCEEDED = "max_attempts_exceeded"


def attempts_exceeded(attempts: int, why: str) -> Outcome:
    """The failed result of a line tried `attempts` times without an answer to record: a 500 with
    OpenAI's error envelope, so it lands in the error file like any failed request."""
    message = f"This request was tried {attempts} times and never finished ({why}); it will not be tried again."
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": ATTEMPTS_EXCEEDED}}
    return Outcome(status_code=500, body=orjson.dumps(body), request_id=None, usage=Usage())


def record_outcome(session: Session, *, batch_id: str, line: int, claim_token: str, outcome: Outcome) -> bool:
    """Store the fleet's final answer once. False if this claim no longer owns the line."""
    return record_outcomes(session, claim_token=claim_token, results=[(batch_id, line, outcome)]) == 1


def record_outcomes(session: Session, *, claim_token: str, results: Sequence[tuple[str, int, Outcome]]) -> int:
    """Store a group of final answers, each exactly once; returns how many this claim still owned.

    Lines are written in (batch, line) order and each batch's counters once per group, so
    concurrent drains take row locks in one order and a group costs one counter update per batch.
    """
    recorded: dict[str, list[tuple[int, Outcome]]] = {}
    now = utcnow()
    for batch_id, line, outcome in sorted(results, key=lambda r: (r[0], r[1])):
        u = outcome.usage if outcome.succeeded else Usage()  # a failed request costs nothing
        result = session.execute(
            update(BatchRequest)
            .where(
                BatchRequest.batch_id == batch_id,
                BatchRequest.line == line,
                BatchRequest.state == RequestState.running,
                BatchRequest.claim_token == claim_token,
            )
            .values(
                state=RequestState.succeeded if outcome.succeeded else RequestState.failed,
                result_id=new_id(),
                status_code=outcome.status_code,
                request_id=outcome.request_id[:128] if outcome.request_id else None,  # the column's size
                response_body=outcome.body.decode(),
                prompt_tokens=u.prompt_tokens,
                cached_tokens=u.cached_tokens,
                completion_tokens=u.completion_tokens,
                reasoning_tokens=u.reasoning_tokens,
                finished_at=now,
                claim_token=None,
            )
            .execution_options(synchronize_session=False)
        )
        if result.rowcount == 1:  # type: ignore[attr-defined]
            recorded.setdefault(batch_id, []).append((line, outcome))
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
        batch = session.get(Batch, batch_id)
        assert batch is not None
        record_usage(session, batch, items)
    return sum(len(items) for items in recorded.values())
