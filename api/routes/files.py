"""OpenAI Files API."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal
from urllib.parse import quote

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from api.auth import CurrentPrincipal
from api.upload import parse_upload
from api.wire import file_id_in, file_id_out, file_out, page
from jobs import files as file_service
from jobs.errors import InvalidRequest, NotFound, TooLarge
from jobs.models import new_id
from storage.db import unit_of_work
from storage.objects import get_object_store
from storage.settings import get_settings

router = APIRouter(prefix="/v1/files", tags=["files"])
MULTIPART_OVERHEAD = 64 * 1024


def _expiry_from_form(fields: dict[str, str]) -> int | None:
    anchor = fields.get("expires_after[anchor]")
    seconds = fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    try:
        secs = int(seconds) if seconds is not None else None
    except ValueError:
        raise InvalidRequest("'expires_after[seconds]' must be an integer.", param="expires_after.seconds") from None
    return file_service.validate_expiry(anchor, secs, param="expires_after")


@router.post("")
async def create_file(request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    settings = get_settings()
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > settings.max_file_bytes + MULTIPART_OVERHEAD:
        raise TooLarge(f"File is larger than the maximum of {settings.max_file_bytes} bytes.", param="file")
    store = get_object_store()
    file_id = new_id()
    key = file_service.file_key(principal.team_id, file_id)

    def consume(chunks: Iterator[bytes]) -> int:
        return file_service.store_upload(store, key, chunks, max_bytes=settings.max_file_bytes)

    form = await parse_upload(request.headers.get("content-type", ""), request.stream(), consume)
    if form.filename is None:
        raise InvalidRequest("Missing required parameter: 'file'.", param="file")
    try:
        purpose = file_service.check_purpose(form.fields.get("purpose"))
        expires_after_s = _expiry_from_form(form.fields)
    except InvalidRequest:
        await run_in_threadpool(store.delete, key)
        raise

    def record() -> dict[str, Any]:
        with unit_of_work() as session:
            row = file_service.record_upload(
                session,
                file_id=file_id,
                team_id=principal.team_id,
                purpose=purpose,
                filename=form.filename or "",
                size=int(form.file_result or 0),
                expires_after_s=expires_after_s,
                default_batch_expiry_s=settings.file_expiry_default_s,
            )
            return file_out(row)

    return await run_in_threadpool(record)


@router.get("")
def list_files(
    principal: CurrentPrincipal,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    with unit_of_work() as session:
        rows, has_more = file_service.list_files(
            session,
            team_id=principal.team_id,
            purpose=purpose,
            limit=limit,
            order=order,
            after=file_id_in(after, param="after") if after else None,
        )
        return page([file_out(r) for r in rows], has_more)


@router.get("/{file_id}")
def retrieve_file(file_id: str, principal: CurrentPrincipal) -> dict[str, Any]:
    with unit_of_work() as session:
        return file_out(file_service.get_file(session, team_id=principal.team_id, file_id=file_id_in(file_id)))


@router.delete("/{file_id}")
def delete_file(file_id: str, principal: CurrentPrincipal) -> dict[str, Any]:
    with unit_of_work() as session:
        row = file_service.delete_file(
            session, get_object_store(), team_id=principal.team_id, file_id=file_id_in(file_id)
        )
        return {"id": file_id_out(row.id), "object": "file", "deleted": True}


def _attachment(filename: str) -> str:
    # The name is the client's: quote it (RFC 6266) so it can never break out of the header.
    ascii_name = "".join(c if c.isascii() and c.isprintable() and c not in '"\\' else "_" for c in filename)
    return f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(filename, safe='')}"


@router.get("/{file_id}/content")
def file_content(file_id: str, principal: CurrentPrincipal) -> StreamingResponse:
    with unit_of_work() as session:
        row = file_service.get_file(session, team_id=principal.team_id, file_id=file_id_in(file_id))
    try:
        chunks = file_service.file_content(get_object_store(), row)
    except FileNotFoundError:
        raise NotFound(f"The content of file {file_id} is no longer available.", param="file_id") from None
    return StreamingResponse(
        chunks,
        media_type="application/jsonl" if row.filename.endswith(".jsonl") else "application/octet-stream",
        headers={"Content-Length": str(row.bytes), "Content-Disposition": _attachment(row.filename)},
    )
