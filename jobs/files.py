"""Files: uploads streamed to the object store at a deterministic key, owned by a team."""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, get_args

from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session

from backfill.jobs.errors import InvalidRequest, NotFound, TooLarge, quote
from backfill.jobs.models import TERMINAL_STATUSES, Batch, File, column_length, utcnow
from backfill.storage.objects import ObjectStore, ObjectTooLarge

# What a file's purpose can be: OpenAI's list, plus "evals", which OpenAI accepts at upload
# (CreateFileRequest) though its File object schema leaves it out. The *_output purposes are
# written by the service (a batch's results), never uploaded.
FilePurpose = Literal[
    "assistants",
    "assistants_output",
    "batch",
    "batch_output",
    "fine-tune",
    "fine-tune-results",
    "vision",
    "user_data",
    "evals",
]
OUTPUT_PURPOSES = frozenset({"assistants_output", "batch_output", "fine-tune-results"})
UPLOAD_PURPOSES = frozenset(get_args(FilePurpose)) - OUTPUT_PURPOSES
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 24 * 3600


MAX_FILENAME_CHARS = column_length(File, "filename")
DEFAULT_FILENAME = "upload.jsonl"


class UploadInterrupted(InvalidRequest):
    """The upload's body ended (client gone, idle too long, a later field refused) before its
    end was seen: raised inside the object store's write so that it fails instead of
    completing with truncated data."""

    code = "upload_interrupted"


@dataclass(frozen=True)
class UploadOptions:
    """The checked non-file fields of `POST /v1/files`."""

    purpose: str
    expires_after_s: int | None


def file_key(team_id: str, file_id: str) -> str:
    return f"files/{team_id}/{file_id}"


def stored_size(session: Session, file_id: str) -> int:
    """The bytes of a stored file; 0 if its row is gone (reading it then says it no longer exists)."""
    return session.execute(select(File.bytes).where(File.id == file_id)).scalar() or 0


def validate_expiry(anchor: str | None, seconds: int | None, *, param: str) -> int | None:
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise InvalidRequest("Only the 'created_at' anchor is supported.", param=f"{param}.anchor")
    if seconds is None or not MIN_EXPIRY_S <= seconds <= MAX_EXPIRY_S:
        raise InvalidRequest(f"'seconds' must be between {MIN_EXPIRY_S} and {MAX_EXPIRY_S}.", param=f"{param}.seconds")
    return seconds


def store_upload(store: ObjectStore, key: str, chunks: Iterable[bytes], *, max_bytes: int) -> int:
    """Stream an upload into the store at its key; the cap is enforced while streaming."""
    try:
        return store.put(key, chunks, max_bytes=max_bytes)
    except ObjectTooLarge as exc:
        store.delete(key)
        raise TooLarge(f"File is larger than the maximum of {exc.limit} bytes.", param="file") from exc
    except UploadInterrupted:
        # A store that wrote in place must not keep the truncated part (atomic stores kept nothing).
        store.delete(key)
        raise


def check_purpose(purpose: str | None) -> str:
    if not purpose:
        raise InvalidRequest("Missing required parameter: 'purpose'.", param="purpose")
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidRequest(f"{quote(purpose)} is not one of {sorted(UPLOAD_PURPOSES)} - 'purpose'", param="purpose")
    return purpose


def check_filename(filename: str) -> str:
    """Refuse a name the files table cannot hold or a download header could be bent by; an
    empty name gets the default. Checked before the object store write begins."""
    if len(filename) > MAX_FILENAME_CHARS:
        raise InvalidRequest(
            f"The file name is {len(filename)} characters long; the limit is {MAX_FILENAME_CHARS}.",
            param="file",
            code="invalid_filename",
        )
    # Cc covers NUL (which Postgres text refuses), the other C0 controls, DEL and C1 controls.
    if any(unicodedata.category(c) == "Cc" for c in filename):
        raise InvalidRequest(
            f"The file name {quote(filename)} contains control characters.", param="file", code="invalid_filename"
        )
    return filename or DEFAULT_FILENAME


def _parse_expiry_seconds(text: str) -> int:
    # int() also takes "1_000", " 12 " and other scripts' digits; the form takes ASCII digits only.
    if not (text.isascii() and text.isdigit()) or len(text) > 12:
        raise InvalidRequest(
            f"'expires_after[seconds]' must be an integer, got {quote(text)}.",
            param="expires_after.seconds",
            code="invalid_value",
        )
    return int(text)


def check_upload_field(name: str, value: str) -> None:
    """Check one non-file field as soon as it has arrived, so a bad value stops the upload
    before (or while) the file streams, never after it is stored."""
    if name == "purpose":
        check_purpose(value)
    elif name == "expires_after[anchor]":
        validate_expiry(value, MIN_EXPIRY_S, param="expires_after")
    elif name == "expires_after[seconds]":
        validate_expiry("created_at", _parse_expiry_seconds(value), param="expires_after")


def upload_options(fields: Mapping[str, str]) -> UploadOptions:
    """All non-file fields of an upload, checked together (a missing purpose, half an expiry)."""
    purpose = check_purpose(fields.get("purpose"))
    anchor = fields.get("expires_after[anchor]")
    seconds = fields.get("expires_after[seconds]")
    secs = _parse_expiry_seconds(seconds) if seconds is not None else None
    return UploadOptions(purpose=purpose, expires_after_s=validate_expiry(anchor, secs, param="expires_after"))


def record_upload(
    session: Session,
    *,
    file_id: str,
    team_id: str,
    purpose: str,
    filename: str,
    size: int,
    expires_after_s: int | None,
    default_batch_expiry_s: int,
) -> File:
    """Record a stored upload. Called after the bytes are in place: a crash in between leaves
    an unreferenced object, never a row pointing at nothing."""
    now = utcnow()
    if expires_after_s is None and purpose == "batch":
        expires_after_s = default_batch_expiry_s
    purpose = check_purpose(purpose)
    row = File(
        id=file_id,
        team_id=team_id,
        purpose=purpose,
        filename=check_filename(filename),
        bytes=size,
        object_key=file_key(team_id, file_id),
        created_at=now,
        expires_at=now + timedelta(seconds=expires_after_s) if expires_after_s else None,
    )
    session.add(row)
    session.flush()
    return row


def get_file(session: Session, *, team_id: str | None, file_id: str) -> File:
    """team_id None means an admin looking across teams."""
    row = session.get(File, file_id)
    if row is None or row.deleted_at is not None or (team_id is not None and row.team_id != team_id):
        raise NotFound(f"No such File object: {file_id}", param="file_id")
    if row.expires_at is not None and row.expires_at <= utcnow():
        raise NotFound(f"No such File object: {file_id} (it expired)", param="file_id")
    return row


def list_files(
    session: Session,
    *,
    team_id: str | None,
    purpose: str | None,
    limit: int,
    order: str,
    after: str | None,
) -> tuple[list[File], bool]:
    query = select(File).where(File.deleted_at.is_(None))
    now = utcnow()
    query = query.where((File.expires_at.is_(None)) | (File.expires_at > now))
    if team_id is not None:
        query = query.where(File.team_id == team_id)
    if purpose:
        query = query.where(File.purpose == purpose)
    key = tuple_(File.created_at, File.id)
    if after:
        cursor = get_file(session, team_id=team_id, file_id=after)
        bound = tuple_(cursor.created_at, cursor.id)
        query = query.where(key < bound if order == "desc" else key > bound)
    ordering = (File.created_at.desc(), File.id.desc()) if order == "desc" else (File.created_at, File.id)
    rows = list(session.execute(query.order_by(*ordering).limit(limit + 1)).scalars())
    return rows[:limit], len(rows) > limit


def delete_file(session: Session, store: ObjectStore, *, team_id: str | None, file_id: str) -> File:
    row = get_file(session, team_id=team_id, file_id=file_id)
    row.deleted_at = utcnow()
    session.flush()
    # A running batch still reads its input lines from this object: keep the bytes until it ends.
    in_use = session.execute(
        select(Batch.id)
        .where(Batch.input_file_id == row.id, Batch.status.not_in([s.value for s in TERMINAL_STATUSES]))
        .limit(1)
    ).first()
    if in_use is None:
        store.delete(row.object_key)
    return row


def file_content(store: ObjectStore, row: File) -> Iterator[bytes]:
    return store.open(row.object_key)
