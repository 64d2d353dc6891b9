"""OpenAI Uploads API: a file sent in parts (`client.uploads.upload_file_chunked`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from backfill.api.deps import CurrentPrincipal, DbSession, Store
from backfill.api.errors import COMMON_ERRORS, error_responses
from backfill.api.protocol import Upload, UploadPart
from backfill.api.upload import PART_FORM, parse_upload, streamed_form
from backfill.api.wire import part_ids_in, part_out, upload_id_in, upload_out
from backfill.jobs import files as file_service
from backfill.jobs import uploads as upload_service
from backfill.jobs.models import utcnow
from backfill.storage.db import unit_of_work
from backfill.storage.settings import get_settings

router = APIRouter(prefix="/v1/uploads", tags=["uploads"], responses=error_responses(*COMMON_ERRORS))

PART_FORM_SCHEMA = streamed_form({"data": {"type": "string", "format": "binary"}}, required=["data"])


class ExpiresAfter(BaseModel):
    anchor: Literal["created_at"]
    seconds: int


class CreateUploadBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    bytes: int = Field(description="The size of the file, in bytes (at most BACKFILL_MAX_UPLOAD_BYTES).")
    filename: str
    mime_type: str
    # Checked by the service, so that a bad value gets its OpenAI error.
    purpose: str
    expires_after: ExpiresAfter | None = None


class CompleteUploadBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    part_ids: list[str] = Field(max_length=upload_service.MAX_PARTS)
    md5: str | None = None


@router.post("")
def create_upload(body: CreateUploadBody, principal: CurrentPrincipal, session: DbSession, store: Store) -> Upload:
    settings = get_settings()
    expiry = body.expires_after
    row = upload_service.create_upload(
        session,
        store,
        team_id=principal.team_id,
        filename=body.filename,
        purpose=body.purpose,
        mime_type=body.mime_type,
        size=body.bytes,
        expires_after_s=file_service.validate_expiry(
            expiry.anchor if expiry else None, expiry.seconds if expiry else None, param="expires_after"
        ),
        max_upload_bytes=settings.max_upload_bytes,
    )
    return upload_out(row, status="pending")


@router.post("/{upload_id}/parts", openapi_extra=PART_FORM_SCHEMA)
async def add_upload_part(upload_id: str, request: Request, principal: CurrentPrincipal, store: Store) -> UploadPart:
    raw_id = upload_id_in(upload_id)
    length = request.headers.get("content-length", "")
    declared = int(length) if length.isdigit() else None

    # Each step its own short transaction: none is open while the part streams.
    def begin() -> upload_service.PartTarget:
        with unit_of_work() as session:
            return upload_service.begin_part(
                session, team_id=principal.team_id, upload_id=raw_id, declared_bytes=declared
            )

    target = await run_in_threadpool(begin)

    def consume(chunks: Iterator[bytes]) -> upload_service.StoredPart:
        return upload_service.store_part(store, target, chunks)

    form = await parse_upload(request.headers.get("content-type", ""), request.stream(), consume, spec=PART_FORM)

    def record() -> UploadPart:
        with unit_of_work() as session:
            return part_out(upload_service.record_part(session, store, target=target, stored=form.file_result))

    return await run_in_threadpool(record)


@router.post("/{upload_id}/complete")
def complete_upload(upload_id: str, body: CompleteUploadBody, principal: CurrentPrincipal, store: Store) -> Upload:
    row, file = upload_service.complete_upload(
        unit_of_work,
        store,
        team_id=principal.team_id,
        upload_id=upload_id_in(upload_id),
        part_ids=part_ids_in(body.part_ids),
        md5=body.md5,
        default_batch_expiry_s=get_settings().file_expiry_default_s,
    )
    return upload_out(row, status="completed", file=file)


@router.post("/{upload_id}/cancel")
def cancel_upload(upload_id: str, principal: CurrentPrincipal, session: DbSession, store: Store) -> Upload:
    row = upload_service.cancel_upload(session, store, team_id=principal.team_id, upload_id=upload_id_in(upload_id))
    return upload_out(row, status=upload_service.upload_status(row, utcnow()).value)
