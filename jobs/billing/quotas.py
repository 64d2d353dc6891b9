"""Per-team, per-model quotas: enqueued tokens and concurrent batches, checked at validation.

Enqueued tokens are the estimate validation makes for a whole batch (prompt + max output of
every line); a batch counts until it is finished, as in OpenAI's enqueued-token limit.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backfill.jobs.billing.models import Quota
from backfill.jobs.errors import BatchError, InvalidRequest, batch_error
from backfill.jobs.models import Batch, BatchStatus, Team, utcnow

QUOTA_ERROR_CODE = "token_limit_exceeded"
# Validated and not finished. Batches still validating have no model or estimate yet.
_UNFINISHED = (BatchStatus.in_progress, BatchStatus.finalizing, BatchStatus.cancelling)


def set_quota(
    session: Session,
    *,
    team_id: str,
    model: str,
    max_enqueued_tokens: int | None,
    max_concurrent_batches: int | None,
) -> Quota:
    for name, value in (
        ("max_enqueued_tokens", max_enqueued_tokens),
        ("max_concurrent_batches", max_concurrent_batches),
    ):
        if value is not None and value < 0:
            raise InvalidRequest(f"{name} cannot be negative.", param=name)
    if not model:
        raise InvalidRequest("A quota needs a model.", param="model")
    quota = session.get(Quota, (team_id, model))
    if quota is None:
        quota = Quota(team_id=team_id, model=model)
        session.add(quota)
    quota.max_enqueued_tokens = max_enqueued_tokens
    quota.max_concurrent_batches = max_concurrent_batches
    quota.updated_at = utcnow()
    session.flush()
    return quota


def list_quotas(session: Session, *, team_id: str | None = None) -> list[Quota]:
    query = select(Quota).order_by(Quota.team_id, Quota.model)
    if team_id is not None:
        query = query.where(Quota.team_id == team_id)
    return list(session.execute(query).scalars())


def quota_errors(session: Session, *, team_id: str, model: str, batch_id: str, token_estimate: int) -> list[BatchError]:
    """Batch-level validation errors if admitting this batch would break the team's quota."""
    quota = session.get(Quota, (team_id, model))
    if quota is None or (quota.max_enqueued_tokens is None and quota.max_concurrent_batches is None):
        return []
    # Serialise admissions of one team: two batches validated at once must not both fit the
    # last slot. FOR NO KEY UPDATE, so ledger inserts (whose foreign key takes KEY SHARE on the
    # team row) and plain reads (authentication) never wait for it.
    session.get(Team, team_id, with_for_update={"key_share": True})
    running, enqueued = session.execute(
        select(func.count(), func.coalesce(func.sum(Batch.token_estimate), 0)).where(
            Batch.team_id == team_id,
            Batch.model == model,
            Batch.status.in_(_UNFINISHED),
            Batch.id != batch_id,
        )
    ).one()
    errors: list[BatchError] = []
    if quota.max_concurrent_batches is not None and running + 1 > quota.max_concurrent_batches:
        errors.append(
            _error(
                f"Concurrent batch limit reached for {model}: {running} batches are unfinished and the limit is "
                f"{quota.max_concurrent_batches}. Try again once some in_progress batches have completed."
            )
        )
    if quota.max_enqueued_tokens is not None and enqueued + token_estimate > quota.max_enqueued_tokens:
        errors.append(
            _error(
                f"Enqueued token limit reached for {model}: this batch needs about {token_estimate} tokens, "
                f"{enqueued} are already enqueued ({enqueued + token_estimate} in all) and the limit is "
                f"{quota.max_enqueued_tokens}. Try again once some in_progress batches have completed."
            )
        )
    return errors


def _error(message: str) -> BatchError:
    return batch_error(QUOTA_ERROR_CODE, message)
