"""Extension: the finished lines of a batch, while it runs (`GET /v1/batches/{id}/partial_output`).

The bytes are those finalization will write for the same lines (`jobs.output_pages.result_lines`):
`kind=output` gives the lines that succeeded, as in `output.jsonl`; `kind=errors` the lines that
failed (or were cancelled or expired), as in `error.jsonl`. Input order. A line still pending is
an error line only once the batch will never run it (cancelled, or expired): then as written in
its error file; while the batch runs, it is not finished and not listed.
The OpenAI routes are untouched: this is a separate path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from backfill.api.deps import CurrentPrincipal, DbSession
from backfill.api.errors import COMMON_ERRORS, error_responses
from backfill.api.wire import batch_id_in
from backfill.jobs import batches as batch_service
from backfill.jobs.errors import Conflict
from backfill.jobs.models import Batch, BatchStatus, RequestState
from backfill.jobs.output_format import ERROR_STATES, OUTPUT_STATES
from backfill.jobs.output_pages import result_lines
from backfill.storage.db import unit_of_work

router = APIRouter(prefix="/v1/batches", tags=["batches"], responses=error_responses(*COMMON_ERRORS))

_CANCELLED = (BatchStatus.cancelling, BatchStatus.cancelled)


def _lines(batch_id: str, kind: Literal["output", "errors"], batch: Batch) -> Iterator[bytes]:
    states: tuple[RequestState, ...] = OUTPUT_STATES
    pending_as = RequestState.cancelled if batch.status in _CANCELLED else RequestState.expired
    if kind == "errors":
        settled = batch.status in _CANCELLED or batch.expired_at is not None
        states = ERROR_STATES if settled else tuple(s for s in ERROR_STATES if s != RequestState.pending)
    # Its own read transaction: the request's unit of work ends before the response is sent.
    with unit_of_work() as session:
        yield from result_lines(session, batch_id, states, pending_as=pending_as)


@router.get(
    "/{batch_id}/partial_output",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "The finished lines so far, in the batch output file's JSONL line format.",
            "content": {"application/jsonl": {"schema": {"type": "string"}}},
        }
    },
)
def partial_output(
    batch_id: str, principal: CurrentPrincipal, session: DbSession, kind: Literal["output", "errors"] = "output"
) -> StreamingResponse:
    """The lines of a batch that have finished so far: `kind=output` the succeeded ones (as in its
    output file), `kind=errors` the failed ones (as in its error file). Works at any status."""
    batch = batch_service.get_batch(session, team_id=principal.team_id, batch_id=batch_id_in(batch_id))
    if batch.bodies_purged_at is not None:
        raise Conflict(
            "The response bodies of this batch were removed by retention: download its output and error files.",
            param="batch_id",
        )
    name = f"{batch_id}_partial_{kind}.jsonl"
    return StreamingResponse(
        _lines(batch.id, kind, batch),
        media_type="application/jsonl",
        headers={"Content-Disposition": f'attachment; filename="{name}"'},
    )
