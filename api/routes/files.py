"""OpenAI Files API."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from backfill.api.deps import CurrentPrincipal, DbSession, Store
from backfill.api.errors import COMMON_ERRORS, error_responses
from backfill.api.protocol import FileDeleted, FileList, FileObject
from backfill.api.upload import parse_upload, streamed_form
from backfill.api.wire import file_deleted_out, file_id_in, file_out, file_page
from backfill.jobs import files as file_service
from backfill.jobs.errors import NotFound
from backfill.jobs.models import new_id
from backfill.storage.settings import get_settings

router = APIRouter(prefix="/v1/files", tags=["files"], responses=error_responses(*COMMON_ERRORS))
UPLOAD_FORM = streamed_form(
    {
        "file": {"type": "string", "format": "binary"},
        "purpose": {"type": "string", "enum": sorted(file_service.UPLOAD_PURPOSES)},
        "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
        "expires_after[seconds]": {
            "type": "integer",
            "minimum": file_service.MIN_EXPIRY_S,
            "maximum": file_service.MAX_EXPIRY_S,
        },
    },
    required=["file", "purpose"],
)


@router.post("", openapi_extra=UPLOAD_FORM)
async def create_file(request: Request, principal: CurrentPrincipal, session: DbSession, store: Store) -> FileObject:
    settings = get_settings()  # the body's size cap is enforced by `api.limits.BodyLimit`, also without Content-Length
    file_id = new_id()
    key = file_service.file_key(principal.team_id, file_id)

    def consume(chunks: Iterator[bytes]) -> int:
        return file_service.store_upload(store, key, chunks, max_bytes=settings.max_file_bytes)

    # Returns only once the whole form was received and checked (purpose, expiry); on any
    # failure it raises and nothing stays stored.
    form = await parse_upload(request.headers.get("content-type", ""), request.stream(), consume)

    def record() -> FileObject:
        try:
            row = file_service.record_upload(
                session,
                file_id=file_id,
                team_id=principal.team_id,
                purpose=form.purpose,
                filename=form.filename or "",
                size=int(form.file_result or 0),
                expires_after_s=form.expires_after_s,
                default_batch_expiry_s=settings.file_expiry_default_s,
            )
        except BaseException:
            store.delete(key)  # no row, no object (retention would collect it later anyway)
            raise
        return file_out(row)

    return await run_in_threadpool(record)


@router.get("")
def list_files(
    principal: CurrentPrincipal,
    session: DbSession,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> FileList:
    rows, has_more = file_service.list_files(
        session,
        team_id=principal.team_id,
        purpose=purpose,
        limit=limit,
        order=order,
        after=file_id_in(after, param="after") if after else None,
    )
    return file_page(rows, has_more=has_more)


@router.get("/{file_id}")
def retrieve_file(file_id: str, principal: CurrentPrincipal, session: DbSession) -> FileObject:
    return file_out(file_service.get_file(session, team_id=principal.team_id, file_id=file_id_in(file_id)))


@router.delete("/{file_id}")
def delete_file(file_id: str, principal: CurrentPrincipal, session: DbSession, store: Store) -> FileDeleted:
    row = file_service.delete_file(session, store, team_id=principal.team_id, file_id=file_id_in(file_id))
    return file_deleted_out(row)


def _attachment(filename: str) -> str:
    # The name is the client's: quote it (RFC 6266) so it can never break out of the header.
    ascii_name = "".join(c if c.isascii() and c.isprintable() and c not in '"\\' else "_" for c in filename)
    return f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(filename, safe='')}"


@router.get(
    "/{file_id}/content",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/jsonl": {}, "application/octet-stream": {}}, "description": "The bytes."}
    },
)
def file_content(file_id: str, principal: CurrentPrincipal, session: DbSession, store: Store) -> StreamingResponse:
    row = file_service.get_file(session, team_id=principal.team_id, file_id=file_id_in(file_id))
    try:
        chunks = file_service.file_content(store, row)
    except FileNotFoundError:
        raise NotFound(f"The content of file {file_id} is no longer available.", param="file_id") from None
    return StreamingResponse(
        chunks,
        media_type="application/jsonl" if row.filename.endswith(".jsonl") else "application/octet-stream",
        headers={"Content-Length": str(row.bytes), "Content-Disposition": _attachment(row.filename)},
    )
