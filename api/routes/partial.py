"""Extension: the finished lines of a batch, while it runs (`GET /v1/batches/{id}/partial_output`).

The bytes are those finalization will write for the same lines (`jobs.output.pages.result_lines`):
`kind=output` gives the lines that succeeded, as in `output.jsonl`; `kind=errors` the lines that
failed (or were cancelled or expired), as in `error.jsonl`. Input order. A line still pending is
an error line only once the batch will never run it (cancelled, or expired): then as written in
its error file; while the batch runs, it is not finished and not listed.
The OpenAI routes are untouched: this is a separate path.

A download holds nothing of the database while it waits on its reader: each page is read in a
short transaction of its own, ended before its bytes are sent. Each API key may stream only
`max_partial_downloads_per_key` at once (per API process): a stalled or hoarding client ties up
a thread and a little memory per download, never the others' capacity; past that, 429.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Literal

from fastapi import APIRouter, Response
from fastapi.responses import StreamingResponse
from sqlalchemy import select
from starlette.background import BackgroundTask

from backfill.api.deps import CurrentPrincipal, DbSession
from backfill.api.errors import COMMON_ERRORS, envelope, error_responses
from backfill.api.wire import batch_id_in
from backfill.jobs import batches as batch_service
from backfill.jobs.errors import Conflict
from backfill.jobs.models import Batch, BatchStatus, RequestState
from backfill.jobs.output.format import ERROR_STATES, OUTPUT_STATES
from backfill.jobs.output.pages import result_lines
from backfill.storage.db import unit_of_work
from backfill.storage.settings import get_settings

router = APIRouter(prefix="/v1/batches", tags=["batches"], responses=error_responses(*COMMON_ERRORS))

log = logging.getLogger(__name__)

_CANCELLED = (BatchStatus.cancelling, BatchStatus.cancelled)
RETRY_AFTER_S = 5


class Downloads:
    """The downloads streaming now, per API key. A slot is given back once, whichever comes
    first: the stream ended (or was closed when its client left), or the response is done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the route and its streams run on the thread pool
        self._held: dict[str, int] = {}

    def take(self, key_id: str, cap: int) -> Callable[[], None] | None:
        """A release for a new slot, or None when `key_id` holds `cap` already."""
        with self._lock:
            if self._held.get(key_id, 0) >= cap:
                return None
            self._held[key_id] = self._held.get(key_id, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if released:
                    return
                released = True
                if (left := self._held[key_id] - 1) > 0:
                    self._held[key_id] = left
                else:
                    del self._held[key_id]

        return release

    def held(self, key_id: str) -> int:
        with self._lock:
            return self._held.get(key_id, 0)


DOWNLOADS = Downloads()


def _lines(
    batch_id: str, kind: Literal["output", "errors"], batch: Batch, release: Callable[[], None]
) -> Iterator[bytes]:
    try:
        states: tuple[RequestState, ...] = OUTPUT_STATES
        pending_as = RequestState.cancelled if batch.status in _CANCELLED else RequestState.expired
        if kind == "errors":
            settled = batch.status in _CANCELLED or batch.expired_at is not None
            states = ERROR_STATES if settled else tuple(s for s in ERROR_STATES if s != RequestState.pending)
        # A transaction per page, none held while a page waits for its reader.
        yield from result_lines(unit_of_work, batch_id, states, pending_as=pending_as)
        if _retired(batch_id):
            # Retention deleted the line rows while the pages were read: the pages read after that
            # came back empty. The 200 is sent already: end the body without its last chunk, so the
            # client sees a broken download, not a short one passing for complete.
            log.warning("partial_output of batch %s cut short: the batch was retired while it streamed", batch_id)
            raise RetiredWhileStreaming(batch_id)
    finally:
        release()


class RetiredWhileStreaming(RuntimeError):
    """A partial download outlived its batch's line rows (`jobs.retention`): it is incomplete."""


def _retired(batch_id: str) -> bool:
    """Whether retention has retired the batch. Asked after the last page: not retired then means
    every page was read before (retirement deletes the rows and marks the batch in one commit)."""
    with unit_of_work() as session:
        return session.scalar(select(Batch.bodies_purged_at).where(Batch.id == batch_id)) is not None


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
) -> Response:
    """The lines of a batch that have finished so far: `kind=output` the succeeded ones (as in its
    output file), `kind=errors` the failed ones (as in its error file). Works at any status."""
    batch = batch_service.get_batch(session, team_id=principal.team_id, batch_id=batch_id_in(batch_id))
    if batch.bodies_purged_at is not None:
        raise Conflict(
            "The response bodies of this batch were removed by retention: download its output and error files.",
            param="batch_id",
        )
    cap = max(1, get_settings().max_partial_downloads_per_key)
    release = DOWNLOADS.take(principal.key_id, cap)
    if release is None:
        refused = envelope(
            429,
            f"Too many partial_output downloads in progress for this API key ({cap}): finish or close one, "
            f"then try again in {RETRY_AFTER_S}s.",
            type_="requests",
            code="rate_limit_exceeded",
        )
        refused.headers["Retry-After"] = str(RETRY_AFTER_S)
        return refused
    name = f"{batch_id}_partial_{kind}.jsonl"
    return StreamingResponse(
        _lines(batch.id, kind, batch, release),
        media_type="application/jsonl",
        headers={"Content-Disposition": f'attachment; filename="{name}"'},
        # A stream never started (its client left first) never runs its `finally`: this does.
        background=BackgroundTask(release),
    )
