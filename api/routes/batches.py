"""OpenAI Batches API."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict

from api.auth import CurrentPrincipal
from api.wire import batch_id_in, batch_out, file_id_in, page
from jobs import batches as batch_service
from storage.db import unit_of_work
from storage.settings import get_settings

log = logging.getLogger("backfill.api")
router = APIRouter(prefix="/v1/batches", tags=["batches"])


class CreateBatchBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, Any] | None = None
    output_expires_after: dict[str, Any] | None = None


def _enqueue(request: Request, batch_id: str) -> None:
    enqueue: Callable[[str], None] | None = request.app.state.enqueue_validation
    if enqueue is None:
        return
    try:
        enqueue(batch_id)
    except Exception:
        log.warning("could not enqueue validation of batch %s; the scheduler will pick it up", batch_id, exc_info=True)


@router.post("")
def create_batch(body: CreateBatchBody, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    with unit_of_work() as session:
        batch = batch_service.create_batch(
            session,
            team_id=principal.team_id,
            input_file_id=file_id_in(body.input_file_id, param="input_file_id"),
            endpoint=body.endpoint,
            completion_window=body.completion_window,
            windows=get_settings().completion_window_seconds,
            metadata=body.metadata,
            output_expires_after=body.output_expires_after,
        )
        wire = batch_out(batch)
    _enqueue(request, batch.id)  # only after the commit: a worker must find the row
    return wire


@router.get("")
def list_batches(
    principal: CurrentPrincipal,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> dict[str, Any]:
    with unit_of_work() as session:
        rows, has_more = batch_service.list_batches(
            session, team_id=principal.team_id, limit=limit, after=batch_id_in(after) if after else None
        )
        return page([batch_out(b) for b in rows], has_more)


@router.get("/{batch_id}")
def retrieve_batch(batch_id: str, principal: CurrentPrincipal) -> dict[str, Any]:
    with unit_of_work() as session:
        return batch_out(batch_service.get_batch(session, team_id=principal.team_id, batch_id=batch_id_in(batch_id)))


@router.post("/{batch_id}/cancel")
def cancel_batch(batch_id: str, principal: CurrentPrincipal) -> dict[str, Any]:
    with unit_of_work() as session:
        return batch_out(batch_service.cancel_batch(session, team_id=principal.team_id, batch_id=batch_id_in(batch_id)))
