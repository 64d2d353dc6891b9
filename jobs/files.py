"""Files: uploads streamed to the object store at a deterministic key, owned by a team."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import timedelta

from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session

from jobs.errors import InvalidRequest, NotFound, TooLarge
from jobs.models import TERMINAL_STATUSES, Batch, File, utcnow
from storage.objects import ObjectStore, ObjectTooLarge

UPLOAD_PURPOSES = frozenset({"batch", "assistants", "fine-tune", "vision", "user_data", "evals"})
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 24 * 3600


def file_key(team_id: str, file_id: str) -> str:
    return f"files/{team_id}/{file_id}"


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


def check_purpose(purpose: str | None) -> str:
    if not purpose:
        raise InvalidRequest("Missing required parameter: 'purpose'.", param="purpose")
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidRequest(f"'{purpose}' is not one of {sorted(UPLOAD_PURPOSES)} - 'purpose'", param="purpose")
    return purpose


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
    row = File(
        id=file_id,
        team_id=team_id,
        purpose=purpose,
        filename=filename or "upload.jsonl",
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
