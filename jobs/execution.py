"""Execution records: claiming lines, recording results exactly once, retries, sweeps.

Every write is a compare-and-set on the request's state and claim token, so a step done
twice (a worker killed, a message redelivered, a slow worker presumed dead) changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
from sqlalchemy import and_, or_, select, update
from sqlalchemy.orm import Session

from jobs.models import Batch, BatchRequest, BatchStatus, RequestState, new_id, utcnow


@dataclass(frozen=True)
class ClaimedRequest:
    batch_id: str
    line: int
    custom_id: str
    offset: int
    length: int
    attempts: int
    input_key: str
    endpoint: str
    token_estimate: int


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0


@dataclass(frozen=True)
class Outcome:
    """What the fleet answered for one request."""

    status_code: int
    body: bytes
    request_id: str | None
    usage: Usage

    @property
    def succeeded(self) -> bool:
        return 200 <= self.status_code < 300


# Billing and other observers record inside the same transaction as the results: called once
# per batch per group with the (line, outcome) pairs whose compare-and-set succeeded.
ResultHook = Callable[[Session, Batch, Sequence[tuple[int, Outcome]]], None]
_result_hooks: list[ResultHook] = []


def on_result(hook: ResultHook) -> ResultHook:
    _result_hooks.append(hook)
    return hook


def usage_from_body(body: Any) -> Usage:
    """Token usage of a chat/completions/embeddings (prompt_*) or responses (input_*) body."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return Usage()

    def num(obj: Any, *keys: str) -> int:
        for key in keys:
            if not isinstance(obj, dict):
                return 0
            obj = obj.get(key)
        return obj if isinstance(obj, int) and obj >= 0 else 0

    return Usage(
        prompt_tokens=num(usage, "prompt_tokens") or num(usage, "input_tokens"),
        cached_tokens=num(usage, "prompt_tokens_details", "cached_tokens")
        or num(usage, "input_tokens_details", "cached_tokens"),
        completion_tokens=num(usage, "completion_tokens") or num(usage, "output_tokens"),
        reasoning_tokens=num(usage, "completion_tokens_details", "reasoning_tokens")
        or num(usage, "output_tokens_details", "reasoning_tokens"),
    )


def normalise_body(raw: bytes) -> tuple[bytes, Any]:
    """The fleet's body as JSON bytes (non-JSON is wrapped as an error object) and parsed."""
    try:
        parsed = orjson.loads(raw)
        return raw, parsed
    except orjson.JSONDecodeError:
        parsed = {"error": {"message": raw.decode("utf-8", "replace")[:4000], "type": "fleet_error"}}
        return orjson.dumps(parsed), parsed


def claim_requests(
    session: Session, *, batch_id: str, limit: int, claim_token: str, now: datetime | None = None
) -> list[ClaimedRequest]:
    """Move up to `limit` pending lines of one batch to running under `claim_token`.

    Lines sharing a prompt prefix are taken together so the fleet's KV cache stays hot.
    """
    now = now or utcnow()
    batch = session.get(Batch, batch_id)
    if batch is None or batch.status != BatchStatus.in_progress or limit <= 0:
        return []
    from jobs.files import file_key  # local: files imports models only, no cycle, but keep the edge visible

    pick = (
        select(BatchRequest.line)
        .where(
            BatchRequest.batch_id == batch_id,
            BatchRequest.state == RequestState.pending,
            or_(BatchRequest.not_before.is_(None), BatchRequest.not_before <= now),
        )
        .order_by(BatchRequest.prefix_hash, BatchRequest.line)
        .limit(limit)
    )
    if session.get_bind().dialect.name == "postgresql":
        pick = pick.with_for_update(skip_locked=True)
    lines = list(session.execute(pick).scalars())
    if not lines:
        return []
    session.execute(
        update(BatchRequest)
        .where(
            BatchRequest.batch_id == batch_id,
            BatchRequest.line.in_(lines),
            BatchRequest.state == RequestState.pending,
        )
        .values(state=RequestState.running, claim_token=claim_token, claimed_at=now)
        .execution_options(synchronize_session=False)
    )
    rows = session.execute(
        select(BatchRequest)
        .where(
            BatchRequest.batch_id == batch_id,
            BatchRequest.line.in_(lines),
            BatchRequest.claim_token == claim_token,
            BatchRequest.state == RequestState.running,
        )
        .order_by(BatchRequest.line)
    ).scalars()
    key = file_key(batch.team_id, batch.input_file_id)
    return [
        ClaimedRequest(
            batch_id=batch_id,
            line=r.line,
            custom_id=r.custom_id,
            offset=r.offset,
            length=r.length,
            attempts=r.attempts,
            input_key=key,
            endpoint=batch.endpoint,
            token_estimate=r.token_estimate,
        )
        for r in rows
    ]


def record_outcome(session: Session, *, batch_id: str, line: int, claim_token: str, outcome: Outcome) -> bool:
    """Store the fleet's final answer once. False if this claim no longer owns the line."""
    return record_outcomes(session, claim_token=claim_token, results=[(batch_id, line, outcome)]) == 1


def record_outcomes(
    session: Session, *, claim_token: str, results: Sequence[tuple[str, int, Outcome]]
) -> int:
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
                request_id=outcome.request_id,
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
        if _result_hooks:
            batch = session.get(Batch, batch_id)
            assert batch is not None
            for hook in _result_hooks:
                hook(session, batch, items)
    return sum(len(items) for items in recorded.values())


def release_for_retry(session: Session, *, batch_id: str, line: int, claim_token: str, not_before: datetime) -> bool:
    """Put a line back to pending after a transient failure, with a backoff time."""
    result = session.execute(
        update(BatchRequest)
        .where(
            BatchRequest.batch_id == batch_id,
            BatchRequest.line == line,
            BatchRequest.state == RequestState.running,
            BatchRequest.claim_token == claim_token,
        )
        .values(
            state=RequestState.pending,
            attempts=BatchRequest.attempts + 1,
            not_before=not_before,
            claim_token=None,
        )
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def requeue_unstarted(session: Session, *, batch_id: str, lines: Sequence[int], claim_token: str) -> None:
    """Give back claimed lines that were never sent (capacity withdrawn): no attempt spent."""
    if lines:
        session.execute(
            update(BatchRequest)
            .where(
                BatchRequest.batch_id == batch_id,
                BatchRequest.line.in_(list(lines)),
                BatchRequest.state == RequestState.running,
                BatchRequest.claim_token == claim_token,
            )
            .values(state=RequestState.pending, claim_token=None)
            .execution_options(synchronize_session=False)
        )


def running_claim_tokens(session: Session) -> list[str]:
    rows = session.execute(
        select(BatchRequest.claim_token).where(BatchRequest.state == RequestState.running).distinct()
    ).scalars()
    return [t for t in rows if t]


def reclaim_orphans(session: Session, *, dead_tokens: Sequence[str]) -> int:
    """Lines held by claims whose holder's heartbeat lapsed go back to pending."""
    if not dead_tokens:
        return 0
    result = session.execute(
        update(BatchRequest)
        .where(BatchRequest.state == RequestState.running, BatchRequest.claim_token.in_(list(dead_tokens)))
        .values(state=RequestState.pending, claim_token=None)
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


def sweep_cancelling(session: Session) -> list[str]:
    """Pending lines of cancelling batches become cancelled; returns batches ready to finish."""
    ready = []
    for batch_id in session.execute(select(Batch.id).where(Batch.status == BatchStatus.cancelling)).scalars():
        session.execute(
            update(BatchRequest)
            .where(BatchRequest.batch_id == batch_id, BatchRequest.state == RequestState.pending)
            .values(state=RequestState.cancelled, finished_at=utcnow())
            .execution_options(synchronize_session=False)
        )
        if not _has_running(session, batch_id):
            ready.append(batch_id)
    return ready


def expire_overdue(session: Session, *, now: datetime | None = None) -> list[str]:
    """Batches past expires_at: unfinished lines become batch_expired, the batch goes to finalize."""
    now = now or utcnow()
    overdue = list(
        session.execute(
            select(Batch.id).where(
                Batch.status.in_([BatchStatus.validating, BatchStatus.in_progress]), Batch.expires_at <= now
            )
        ).scalars()
    )
    for batch_id in overdue:
        # Lines first, then the batch row: the same lock order as recording a result, so an
        # expiry never deadlocks with a drain. In-flight answers arriving later fail their
        # compare-and-set and are dropped.
        session.execute(
            update(BatchRequest)
            .where(
                BatchRequest.batch_id == batch_id,
                BatchRequest.state.in_([RequestState.pending, RequestState.running]),
            )
            .values(state=RequestState.expired, claim_token=None, finished_at=now)
            .execution_options(synchronize_session=False)
        )
        session.execute(
            update(Batch)
            .where(Batch.id == batch_id, Batch.status.in_([BatchStatus.validating, BatchStatus.in_progress]))
            .values(status=BatchStatus.finalizing, expired_at=now, finalizing_at=now)
            .execution_options(synchronize_session=False)
        )
    return overdue


def _has_running(session: Session, batch_id: str) -> bool:
    return (
        session.execute(
            select(BatchRequest.line)
            .where(BatchRequest.batch_id == batch_id, BatchRequest.state == RequestState.running)
            .limit(1)
        ).first()
        is not None
    )


def batches_to_finalize(session: Session) -> list[str]:
    """In-progress batches with nothing left to run, and batches already finalizing."""
    unfinished = (
        select(BatchRequest.line)
        .where(
            BatchRequest.batch_id == Batch.id,
            BatchRequest.state.in_([RequestState.pending, RequestState.running]),
        )
        .exists()
    )
    rows = session.execute(
        select(Batch.id).where(
            or_(
                and_(Batch.status == BatchStatus.in_progress, ~unfinished),
                Batch.status == BatchStatus.finalizing,
            )
        )
    ).scalars()
    return list(rows) + sweep_cancelling(session)


@dataclass(frozen=True)
class PendingBatch:
    """What the dispatch policy needs to know about a batch with work left."""

    batch_id: str
    team_id: str
    created_at: datetime
    expires_at: datetime
    total: int
    remaining: int  # pending or running
    remaining_tokens: int


def pending_batches(session: Session) -> list[PendingBatch]:
    """In-progress batches with work left, from their live counters: no scan of the lines."""
    rows = session.execute(
        select(Batch).where(Batch.status == BatchStatus.in_progress, Batch.total > Batch.completed + Batch.failed)
    ).scalars()
    out = []
    for b in rows:
        remaining = b.total - b.completed - b.failed
        out.append(
            PendingBatch(
                batch_id=b.id,
                team_id=b.team_id,
                created_at=b.created_at,
                expires_at=b.expires_at,
                total=b.total,
                remaining=remaining,
                remaining_tokens=b.token_estimate * remaining // max(b.total, 1),
            )
        )
    return out
