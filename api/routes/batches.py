"""OpenAI Batches API."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field

from backfill.api.deps import CurrentPrincipal, DbSession
from backfill.api.errors import COMMON_ERRORS, error_responses
from backfill.api.protocol import Batch, BatchList
from backfill.api.wire import batch_id_in, batch_out, batch_page, file_id_in
from backfill.jobs import batches as batch_service
from backfill.storage.broker import TaskName, send_task
from backfill.storage.settings import get_settings

log = logging.getLogger("backfill.api")
router = APIRouter(prefix="/v1/batches", tags=["batches"], responses=error_responses(*COMMON_ERRORS))


def _accepted_windows(schema: dict[str, Any]) -> None:
    # The document lists the configured set (read when it is generated, at the app's first
    # /openapi.json); the value stays a plain string to the parser, so that an unknown window is
    # refused by `jobs.billing.windows.check_window` with OpenAI's 400, not by the schema with a 422.
    schema["enum"] = list(get_settings().completion_windows)


class CreateBatchBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input_file_id: str
    endpoint: str
    completion_window: str = Field(
        description="How soon the batch must finish: one of the configured windows (BACKFILL_COMPLETION_WINDOWS; "
        "OpenAI's 24h always). The batch expires this long after its creation; shorter windows cost more.",
        json_schema_extra=_accepted_windows,
    )
    # Checked by the service, so that a bad value gets its OpenAI error (param "metadata.k", ...).
    metadata: dict[str, object] | None = None
    output_expires_after: dict[str, object] | None = None


def _enqueue_validation(batch_id: str) -> None:
    """Only after the commit, so a worker finds the row. The broker only nudges: if it is down,
    the scheduler loop nudges again for every batch left validating."""
    try:
        send_task(TaskName.validate_batch, batch_id)
    except Exception:
        log.warning("could not enqueue validation of batch %s; the scheduler will nudge it", batch_id, exc_info=True)


@router.post("")
def create_batch(body: CreateBatchBody, principal: CurrentPrincipal, session: DbSession) -> Batch:
    batch = batch_service.create_batch(
        session,
        team_id=principal.team_id,
        input_file_id=file_id_in(body.input_file_id, param="input_file_id"),
        endpoint=body.endpoint,
        completion_window=body.completion_window,
        windows=get_settings().completion_windows,
        multipliers=get_settings().window_price_multipliers,
        metadata=body.metadata,
        output_expires_after=body.output_expires_after,
        api_key_id=principal.key_id,
    )
    wire = batch_out(batch)
    session.commit()  # here rather than at the request's end: validation is enqueued after it
    _enqueue_validation(batch.id)
    return wire


@router.get("")
def list_batches(
    principal: CurrentPrincipal,
    session: DbSession,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> BatchList:
    rows, has_more = batch_service.list_batches(
        session, team_id=principal.team_id, limit=limit, after=batch_id_in(after) if after else None
    )
    return batch_page(rows, has_more=has_more)


@router.get("/{batch_id}")
def retrieve_batch(batch_id: str, principal: CurrentPrincipal, session: DbSession) -> Batch:
    return batch_out(batch_service.get_batch(session, team_id=principal.team_id, batch_id=batch_id_in(batch_id)))


@router.post("/{batch_id}/cancel")
def cancel_batch(batch_id: str, principal: CurrentPrincipal, session: DbSession) -> Batch:
    return batch_out(batch_service.cancel_batch(session, team_id=principal.team_id, batch_id=batch_id_in(batch_id)))
