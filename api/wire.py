"""OpenAI wire conversions. Ids get their prefixes and timestamps become Unix seconds only here."""

from __future__ import annotations

from datetime import datetime
from typing import overload

from backfill.api import protocol
from backfill.jobs.errors import NotFound
from backfill.jobs.models import Batch, File

FILE_PREFIX = "file-"
BATCH_PREFIX = "batch_"


@overload
def ts(value: datetime) -> int: ...
@overload
def ts(value: datetime | None) -> int | None: ...
def ts(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


def file_id_out(raw: str) -> str:
    return FILE_PREFIX + raw


def file_id_in(wire: str, *, param: str = "file_id") -> str:
    if not wire.startswith(FILE_PREFIX) or len(wire) <= len(FILE_PREFIX):
        raise NotFound(f"No such File object: {wire}", param=param)
    return wire[len(FILE_PREFIX) :]


def batch_id_out(raw: str) -> str:
    return BATCH_PREFIX + raw


def batch_id_in(wire: str) -> str:
    if not wire.startswith(BATCH_PREFIX) or len(wire) <= len(BATCH_PREFIX):
        raise NotFound(f"No batch found with id '{wire}'.", param="batch_id")
    return wire[len(BATCH_PREFIX) :]


def file_out(row: File) -> protocol.FileObject:
    return protocol.FileObject(
        id=file_id_out(row.id),
        object="file",
        bytes=row.bytes,
        created_at=ts(row.created_at),
        expires_at=ts(row.expires_at),
        filename=row.filename,
        purpose=row.purpose,  # type: ignore[arg-type]  # a str column; pydantic checks it against FilePurpose
        status="processed",
        status_details=None,
    )


def file_deleted_out(row: File) -> protocol.FileDeleted:
    return protocol.FileDeleted(id=file_id_out(row.id), object="file", deleted=True)


def batch_out(b: Batch) -> protocol.Batch:
    return protocol.Batch(
        id=batch_id_out(b.id),
        object="batch",
        endpoint=b.endpoint,
        model=b.model,
        errors=(
            protocol.BatchErrors(object="list", data=[protocol.BatchError.model_validate(e) for e in b.errors])
            if b.errors
            else None
        ),
        input_file_id=file_id_out(b.input_file_id),
        completion_window=b.completion_window,
        status=b.status,
        output_file_id=file_id_out(b.output_file_id) if b.output_file_id else None,
        error_file_id=file_id_out(b.error_file_id) if b.error_file_id else None,
        created_at=ts(b.created_at),
        in_progress_at=ts(b.in_progress_at),
        expires_at=ts(b.expires_at),
        finalizing_at=ts(b.finalizing_at),
        completed_at=ts(b.completed_at),
        failed_at=ts(b.failed_at),
        expired_at=ts(b.expired_at),
        cancelling_at=ts(b.cancelling_at),
        cancelled_at=ts(b.cancelled_at),
        request_counts=protocol.BatchRequestCounts(total=b.total, completed=b.completed, failed=b.failed),
        usage=protocol.BatchUsage(
            input_tokens=b.input_tokens,
            input_tokens_details=protocol.InputTokensDetails(cached_tokens=b.cached_tokens),
            output_tokens=b.output_tokens,
            output_tokens_details=protocol.OutputTokensDetails(reasoning_tokens=b.reasoning_tokens),
            total_tokens=b.input_tokens + b.output_tokens,
        ),
        metadata=b.metadata_,
    )


def file_page(rows: list[File], *, has_more: bool) -> protocol.FileList:
    return protocol.FileList.of([file_out(r) for r in rows], has_more=has_more)


def batch_page(rows: list[Batch], *, has_more: bool) -> protocol.BatchList:
    return protocol.BatchList.of([batch_out(b) for b in rows], has_more=has_more)
