"""Uploads: a file sent in parts (OpenAI's Uploads API), for files larger than one request.

An upload is created with the size it will have; it expires an hour later unless completed.
Each part (up to 64 MiB) streams straight into the object store's multipart upload at the key of
the file the upload becomes, never held in memory whole: it is cut into store parts of
PART_BYTES (the last one of a part merged with its predecessor when it would be smaller than the
store's minimum), so a part takes a run of store part numbers, reserved when it begins. A part
smaller than the store's minimum middle part (S3: 5 MiB, the last part excepted; a directory:
none) is kept as an object of its own instead, as is a part that finds the 10,000 store numbers
taken.

Completion makes the file of the parts named, in the order named:
- the direct path, when the named parts' runs are in ascending number order and only the last
  part may be one kept apart: the store's multipart upload is completed with those runs (the part
  kept apart, under 5 MiB, becomes its last store part), no byte passes through the service;
- otherwise a server-side concatenation: the runs named are completed (ascending) into the
  object at the upload's key, which then serves as staging, and the file is written at a new key
  by streaming the staging object's ranges and the parts kept apart in the order named (bounded
  memory: the store's streaming `put`); the staging object is removed afterwards.
An `md5` given at completion is checked by streaming the file once it is assembled (in the
concatenation, while writing it): a mismatch discards the file and cancels the upload.

The upload's row is the lock: parts are counted with a compare-and-set on its pending status and
its byte total, completion claims it (pending -> completing) before touching the store. Any step
of a completion may die; each is done again by a retry of the same parts: the claim fixes the
file's id (so its key) and the parts named, a completion that failed lets go of its claim and
one that died leaves a claim a retry takes over once older than COMPLETION_LEASE; the store's
multipart upload found already completed is the object at its key at its size, a file found
written is not written again, and the file is recorded once (a retry of a completed upload
answers with it). The parts of an upload cancelled or expired are removed from the store by
retention (`clean_up_uploads`), as are those of a completion that died and was never retried.
"""

from __future__ import annotations

import hashlib
import re
from _hashlib import HASH
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from itertools import chain, pairwise

from sqlalchemy import ColumnElement, delete, or_, select, update
from sqlalchemy.orm import Session

from backfill.jobs import files as file_service
from backfill.jobs.errors import Conflict, InvalidRequest, NotFound, TooLarge, quote
from backfill.jobs.models import File, Upload, UploadPart, UploadStatus, new_id, utcnow
from backfill.storage.db import UnitOfWork
from backfill.storage.objects import MAX_PART_NUMBER, PART_BYTES, NoSuchMultipart, ObjectStore, blocks

UPLOAD_TTL = timedelta(hours=1)
MAX_PART_BYTES = 64 * 1024 * 1024  # OpenAI's: the SDK's chunked upload sends parts of exactly this
MAX_PARTS = MAX_PART_NUMBER
MAX_MIME_TYPE_CHARS = 255
# A completion still assembling past its upload's expiry is left alone this much longer.
COMPLETING_GRACE = timedelta(hours=1)
# A completion's claim older than this was left by a process that died (assembling the largest
# upload takes a few minutes): a retry of the same parts takes it over. Were the first still
# running, both make the same bytes at the same key and the file is recorded once.
COMPLETION_LEASE = timedelta(minutes=10)
_MD5 = re.compile(r"^[0-9a-fA-F]{32}$")


def part_object_key(team_id: str, upload_id: str, part_id: str) -> str:
    """Where a part kept apart from the multipart upload lives (outside `files/`: no file row names it)."""
    return f"uploads/{team_id}/{upload_id}/{part_id}"


def upload_status(row: Upload, now: datetime) -> UploadStatus:
    """The status a client sees: an upload never completed is expired once its hour is over
    (retention marks it so when it removes its parts); a completion in progress is still pending."""
    status = UploadStatus(row.status)
    if status in (UploadStatus.pending, UploadStatus.completing) and row.expires_at <= now:
        return UploadStatus.expired
    return UploadStatus.pending if status is UploadStatus.completing else status


def _require_pending(row: Upload, now: datetime) -> None:
    status = UploadStatus(row.status)
    if status is UploadStatus.completing and row.expires_at > now:
        raise Conflict(f"Upload {row.id} is being completed.", param="upload_id", code="upload_completing")
    status = upload_status(row, now)
    if status is not UploadStatus.pending:
        raise Conflict(
            f"Upload {row.id} is {status.value}: it takes no more parts and cannot be completed.",
            param="upload_id",
            code=f"upload_{status.value}",
        )


def get_upload(session: Session, *, team_id: str, upload_id: str) -> Upload:
    row = session.get(Upload, upload_id)
    if row is None or row.team_id != team_id:
        raise NotFound(f"No such Upload object: {upload_id}", param="upload_id")
    return row


def check_mime_type(mime_type: str) -> str:
    if not mime_type or len(mime_type) > MAX_MIME_TYPE_CHARS or not mime_type.isprintable():
        raise InvalidRequest(
            f"Invalid mime_type {quote(mime_type)}: a MIME type of 1 to {MAX_MIME_TYPE_CHARS} printable characters.",
            param="mime_type",
            code="invalid_value",
        )
    return mime_type


def create_upload(
    session: Session,
    store: ObjectStore,
    *,
    team_id: str,
    filename: str,
    purpose: str,
    mime_type: str,
    size: int,
    expires_after_s: int | None,
    max_upload_bytes: int,
    now: datetime | None = None,
) -> Upload:
    now = now or utcnow()
    file_service.check_purpose(purpose)
    check_mime_type(mime_type)
    if not filename:
        raise InvalidRequest("Missing required parameter: 'filename'.", param="filename")
    try:
        filename = file_service.check_filename(filename)
    except InvalidRequest as exc:
        raise InvalidRequest(exc.message, param="filename", code=exc.code) from None
    if size < 1:
        raise InvalidRequest("'bytes' must be at least 1.", param="bytes", code="invalid_value")
    if size > max_upload_bytes:
        raise TooLarge(
            f"An upload is at most {max_upload_bytes} bytes; this one would be {size}.",
            param="bytes",
            code="upload_too_large",
        )
    file_id = new_id()
    key = file_service.file_key(team_id, file_id)
    row = Upload(
        id=new_id(),
        team_id=team_id,
        filename=filename,
        purpose=purpose,
        mime_type=mime_type,
        bytes=size,
        status=UploadStatus.pending.value,
        created_at=now,
        expires_at=now + UPLOAD_TTL,
        file_expires_after_s=expires_after_s,
        file_id=file_id,
        multipart_key=key,
        # Started before the row is written: a failure in between leaves an empty multipart
        # upload, which the bucket's lifecycle rule for incomplete uploads reaps.
        multipart_id=store.start_multipart(key),
        next_part_number=1,
        part_count=0,
        received_bytes=0,
    )
    session.add(row)
    session.flush()
    return row


# -- parts -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PartTarget:
    """Where one part goes, decided (and its store numbers reserved) before its bytes are read."""

    upload_id: str
    part_id: str
    multipart_key: str
    multipart_id: str
    numbers: range  # empty: no numbers left, the part is kept apart
    object_key: str
    max_bytes: int
    # The cap is the upload's remaining bytes rather than the part limit.
    capped_by_upload: bool


@dataclass(frozen=True)
class StoredPart:
    size: int
    tags: tuple[str, ...]  # one per store part of the run; empty when kept apart
    object_key: str | None  # the object of a part kept apart


def begin_part(session: Session, *, team_id: str, upload_id: str, declared_bytes: int | None) -> PartTarget:
    """Check the upload takes a part and reserve the store numbers it may need. `declared_bytes`
    (the request's Content-Length) only narrows the reservation: the stream is capped anyway."""
    now = utcnow()
    row = get_upload(session, team_id=team_id, upload_id=upload_id)
    _require_pending(row, now)
    remaining = row.bytes - row.received_bytes
    if remaining <= 0:
        raise TooLarge(
            f"The upload already holds all of its {row.bytes} bytes.", param="data", code="upload_size_exceeded"
        )
    if row.part_count >= MAX_PARTS:
        raise InvalidRequest(f"An upload has at most {MAX_PARTS} parts.", param="data", code="too_many_parts")
    bound = min(MAX_PART_BYTES, remaining, declared_bytes if declared_bytes is not None else MAX_PART_BYTES)
    want = max(1, -(-bound // PART_BYTES))
    end = session.execute(
        update(Upload)
        .where(Upload.id == row.id, Upload.next_part_number + want - 1 <= MAX_PART_NUMBER)
        .values(next_part_number=Upload.next_part_number + want)
        .returning(Upload.next_part_number)
        .execution_options(synchronize_session=False)
    ).scalar()
    part_id = new_id()
    return PartTarget(
        upload_id=row.id,
        part_id=part_id,
        multipart_key=row.multipart_key,
        multipart_id=row.multipart_id,
        numbers=range(end - want, end) if end is not None else range(0),
        object_key=part_object_key(team_id, row.id, part_id),
        max_bytes=min(MAX_PART_BYTES, remaining),
        capped_by_upload=remaining < MAX_PART_BYTES,
    )


def _capped(chunks: Iterable[bytes], target: PartTarget) -> Iterator[bytes]:
    seen = 0
    for chunk in chunks:
        seen += len(chunk)
        if seen > target.max_bytes:
            if target.capped_by_upload:
                raise TooLarge(
                    "The part would take the upload past its declared size.",
                    param="data",
                    code="upload_size_exceeded",
                )
            raise TooLarge(f"A part is at most {MAX_PART_BYTES} bytes.", param="data", code="part_too_large")
        yield chunk


def store_blocks(chunks: Iterable[bytes], *, size: int, min_bytes: int) -> Iterator[bytes]:
    """Blocks of `size` bytes, the last one merged into its predecessor when shorter than
    `min_bytes`, so every block is at least `min_bytes` unless there is only one. Holds at most
    two blocks: one is kept back until the next shows whether it is the last."""
    held: bytes | None = None
    for block in blocks(chunks, size):
        if held is not None:
            if len(block) < min_bytes:  # only the last block is short
                yield held + block
                return
            yield held
        held = block
    if held is not None:
        yield held


def store_part(store: ObjectStore, target: PartTarget, chunks: Iterable[bytes]) -> StoredPart:
    """Stream one part into the store (in the upload's thread; no database). The store parts
    written before a failure stay unnamed in the multipart upload, which drops them."""
    pieces = store_blocks(_capped(chunks, target), size=PART_BYTES, min_bytes=max(1, store.min_part_bytes))
    first = next(pieces)
    if not first:
        raise InvalidRequest("The part is empty.", param="data", code="empty_part")
    if not target.numbers or len(first) < store.min_part_bytes:
        size = store.put(target.object_key, chain([first], pieces))
        return StoredPart(size=size, tags=(), object_key=target.object_key)
    tags: list[str] = []
    size = 0
    numbers = iter(target.numbers)
    for piece in chain([first], pieces):
        number = next(numbers, None)
        if number is None:  # more bytes than the reservation allowed for: a bug, never a client's doing
            raise RuntimeError(f"part {target.part_id} outgrew its {len(target.numbers)} store parts")
        tags.append(store.upload_part(target.multipart_key, target.multipart_id, number, piece))
        size += len(piece)
    return StoredPart(size=size, tags=tuple(tags), object_key=None)


def record_part(session: Session, store: ObjectStore, *, target: PartTarget, stored: StoredPart) -> UploadPart:
    """Count the part in with a compare-and-set on the upload (still pending, not past its size),
    so parts sent at once can never add up to more than the upload declared."""
    now = utcnow()
    counted = session.execute(
        update(Upload)
        .where(
            Upload.id == target.upload_id,
            Upload.status == UploadStatus.pending.value,
            Upload.expires_at > now,
            Upload.received_bytes + stored.size <= Upload.bytes,
            Upload.part_count < MAX_PARTS,
        )
        .values(received_bytes=Upload.received_bytes + stored.size, part_count=Upload.part_count + 1)
        .execution_options(synchronize_session=False)
    ).rowcount  # type: ignore[attr-defined]
    if not counted:
        if stored.object_key:
            store.delete(stored.object_key)
        row = session.get(Upload, target.upload_id)
        assert row is not None
        session.refresh(row)
        _require_pending(row, now)
        raise TooLarge(
            f"The part would take the upload past its declared {row.bytes} bytes.",
            param="data",
            code="upload_size_exceeded",
        )
    part = UploadPart(
        id=target.part_id,
        upload_id=target.upload_id,
        bytes=stored.size,
        first_number=target.numbers.start if target.numbers else 0,
        tags=list(stored.tags),
        object_key=stored.object_key,
        created_at=now,
    )
    session.add(part)
    session.flush()
    return part


# -- completion ----------------------------------------------------------------------------------


class Md5Mismatch(InvalidRequest):
    code = "md5_mismatch"


class PartsGone(Conflict):
    """The store no longer holds the parts a completion named, nor what they made."""

    code = "upload_parts_gone"


@dataclass(frozen=True)
class _Part:
    first_number: int
    tags: tuple[str, ...]
    object_key: str | None
    size: int


@dataclass(frozen=True)
class _Plan:
    upload_id: str
    team_id: str
    # Fixed when the upload is first claimed, kept by every completion that takes the claim
    # over: what an earlier one made in the store is found where this one would make it.
    file_id: str
    multipart_key: str
    multipart_id: str
    parts: list[_Part]  # in the order named
    claimed_at: datetime  # the claim's token: only its holder lets go of it

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)

    @property
    def file_key(self) -> str:
        return file_service.file_key(self.team_id, self.file_id)


def _claim_is_live(row: Upload, now: datetime) -> bool:
    return row.completing_since is not None and row.completing_since > now - COMPLETION_LEASE


def _completed(session: Session, row: Upload, part_ids: list[str]) -> File | None:
    """The file of an upload already completed of these parts (a retry whose answer was lost)."""
    if row.status != UploadStatus.completed.value or row.completion_part_ids != part_ids:
        return None
    try:
        return file_service.get_file(session, team_id=row.team_id, file_id=row.file_id)
    except NotFound:
        return None


def _claim(
    session: Session, *, team_id: str, upload_id: str, part_ids: list[str], md5: str | None, now: datetime
) -> _Plan | File:
    """Claim the upload for a completion of `part_ids`: a pending one, or one whose completion
    of the same parts died (its claim let go of, or older than the lease). Returns the file
    instead when the upload is already completed of these parts."""
    row = get_upload(session, team_id=team_id, upload_id=upload_id)
    done = _completed(session, row, part_ids)
    if done is not None:
        return done
    taking_over = row.status == UploadStatus.completing.value and row.expires_at > now
    if not taking_over:
        _require_pending(row, now)
    if md5 is not None and not _MD5.match(md5):
        raise InvalidRequest(f"'md5' must be 32 hexadecimal digits, got {quote(md5)}.", param="md5")
    if not part_ids:
        raise InvalidRequest("'part_ids' names no part.", param="part_ids")
    if len(set(part_ids)) != len(part_ids):
        raise InvalidRequest("'part_ids' names a part more than once.", param="part_ids", code="duplicate_part")
    if taking_over and row.completion_part_ids != part_ids:
        raise Conflict(
            f"Upload {row.id} is being completed of other parts: a retry names the same parts in the same order.",
            param="upload_id",
            code="upload_completing",
        )
    if taking_over and _claim_is_live(row, now):
        raise Conflict(f"Upload {row.id} is being completed.", param="upload_id", code="upload_completing")
    found = {
        p.id: p
        for p in session.execute(
            select(UploadPart).where(UploadPart.upload_id == row.id, UploadPart.id.in_(part_ids))
        ).scalars()
    }
    for part_id in part_ids:
        if part_id not in found:
            raise NotFound(f"No such Part object: part_{part_id}", param="part_ids")
    total = sum(found[p].bytes for p in part_ids)
    if total != row.bytes:
        raise InvalidRequest(
            f"The parts named hold {total} bytes; the upload was created for {row.bytes}.",
            param="part_ids",
            code="upload_size_mismatch",
        )
    parts = [_Part(found[p].first_number, tuple(found[p].tags), found[p].object_key, found[p].bytes) for p in part_ids]
    # The direct path makes the file at the multipart upload's key (the upload's file id); a
    # concatenation writes a new one, named now so that a retry writes (or finds) the same.
    file_id = row.file_id if taking_over or _direct(parts) else new_id()
    held = (
        (Upload.status == UploadStatus.completing.value)
        & (
            Upload.completing_since.is_(None)
            if row.completing_since is None
            else Upload.completing_since == row.completing_since
        )
        if taking_over
        else Upload.status == UploadStatus.pending.value
    )
    claimed = session.execute(
        update(Upload)
        .where(Upload.id == row.id, Upload.expires_at > now, held)
        .values(
            status=UploadStatus.completing.value, completing_since=now, completion_part_ids=part_ids, file_id=file_id
        )
        .execution_options(synchronize_session=False)
    ).rowcount  # type: ignore[attr-defined]
    if not claimed:
        session.refresh(row)
        _require_pending(row, now)
        raise Conflict(f"Upload {row.id} is being completed.", param="upload_id", code="upload_completing")
    return _Plan(row.id, team_id, file_id, row.multipart_key, row.multipart_id, parts, now)


def _direct(parts: list[_Part]) -> bool:
    """Whether the store can complete its own multipart upload into the file as named."""
    numbers = [p.first_number for p in parts]
    return all(n > 0 for n in numbers) and all(a < b for a, b in pairwise(numbers)) and all(p.tags for p in parts[:-1])


def _hashed(chunks: Iterable[bytes], digest: HASH | None) -> Iterator[bytes]:
    for chunk in chunks:
        if digest is not None:
            digest.update(chunk)
        yield chunk


def _check_md5(digest: HASH | None, md5: str | None) -> None:
    if digest is not None and md5 is not None and digest.hexdigest() != md5.lower():
        raise Md5Mismatch(
            f"The file's MD5 is {digest.hexdigest()}, not the {md5} given: the upload is cancelled.", param="md5"
        )


def _size_at(store: ObjectStore, key: str) -> int | None:
    return next((o.size for o in store.list(key) if o.key == key), None)


def _complete_multipart(store: ObjectStore, plan: _Plan, runs: list[_Part], last: _Part | None) -> None:
    """Complete the multipart upload of `runs` (ascending), then `last`, a part kept apart, as its
    last store part; unless an earlier completion of the same claim already did: then the object
    is at its key, at its size."""
    size = sum(p.size for p in runs) + (last.size if last else 0)
    if _size_at(store, plan.multipart_key) == size:
        return
    store_parts = [(p.first_number + i, tag) for p in runs for i, tag in enumerate(p.tags)]
    try:
        if last is not None and last.object_key:
            body = b"".join(store.open(last.object_key))
            store_parts.append(
                (last.first_number, store.upload_part(plan.multipart_key, plan.multipart_id, last.first_number, body))
            )
        store.complete_multipart(plan.multipart_key, plan.multipart_id, store_parts)
    except NoSuchMultipart:  # completed by a completion beside this one, or gone
        if _size_at(store, plan.multipart_key) != size:
            raise PartsGone(
                f"The parts of upload {plan.upload_id} are no longer stored: the upload is cancelled.",
                param="upload_id",
            ) from None


def _assemble(store: ObjectStore, plan: _Plan, md5: str | None) -> list[str]:
    """Make the file at the plan's key (idempotent: a retry finds what an earlier attempt made,
    or makes it again at the same key); returns the objects to remove once it is recorded."""
    apart = [p.object_key for p in plan.parts if p.object_key]
    if _direct(plan.parts):
        last = plan.parts[-1] if plan.parts[-1].object_key else None
        _complete_multipart(store, plan, [p for p in plan.parts if p.tags], last)
        digest = hashlib.md5(usedforsecurity=False) if md5 else None
        if digest is not None:
            for _ in _hashed(store.open(plan.file_key), digest):
                pass
        try:
            _check_md5(digest, md5)
        except Md5Mismatch:
            store.delete(plan.file_key)
            raise
        return apart
    runs = sorted((p for p in plan.parts if p.tags), key=lambda p: p.first_number)
    leftovers = [*apart, plan.multipart_key] if runs else apart
    digest = hashlib.md5(usedforsecurity=False) if md5 else None
    if _size_at(store, plan.file_key) == plan.size:  # an earlier attempt wrote it
        if digest is not None:
            for _ in _hashed(store.open(plan.file_key), digest):
                pass
    else:
        # Server-side concatenation: the runs named become the staging object, in number order.
        offsets: dict[int, int] = {}
        at = 0
        for p in runs:
            offsets[p.first_number] = at
            at += p.size
        if runs:
            _complete_multipart(store, plan, runs, None)
        else:
            store.abort_multipart(plan.multipart_key, plan.multipart_id)

        def in_order() -> Iterator[bytes]:
            for p in plan.parts:
                if p.object_key:
                    yield from store.open(p.object_key)
                else:
                    start = offsets[p.first_number]
                    yield from store.open(plan.multipart_key, start=start, end=start + p.size)

        # A failure leaves nothing at the key (a put appears whole or not at all) and the staging
        # object in place: the retry needs it.
        store.put(plan.file_key, _hashed(in_order(), digest))
    try:
        _check_md5(digest, md5)
    except Md5Mismatch:
        for key in (plan.file_key, plan.multipart_key) if runs else (plan.file_key,):
            store.delete(key)
        raise
    return leftovers


def _record(
    transaction: UnitOfWork, plan: _Plan, *, part_ids: list[str], default_batch_expiry_s: int
) -> tuple[Upload, File]:
    """Record the file, once: a completion that took the claim over may have recorded it already."""
    with transaction() as session:
        row = session.execute(select(Upload).where(Upload.id == plan.upload_id).with_for_update()).scalar_one()
        done = _completed(session, row, part_ids)
        if done is not None:
            return row, done
        if row.status != UploadStatus.completing.value or row.file_id != plan.file_id:
            _require_pending(row, utcnow())
            raise Conflict(f"Upload {row.id} is being completed.", param="upload_id", code="upload_completing")
        file = session.get(File, plan.file_id) or file_service.record_upload(
            session,
            file_id=plan.file_id,
            team_id=plan.team_id,
            purpose=row.purpose,
            filename=row.filename,
            size=plan.size,
            expires_after_s=row.file_expires_after_s,
            default_batch_expiry_s=default_batch_expiry_s,
        )
        now = utcnow()
        row.status, row.completed_at, row.cleaned_at = UploadStatus.completed.value, now, now
        row.completing_since = None
        session.execute(delete(UploadPart).where(UploadPart.upload_id == plan.upload_id))
    return row, file


def _after_failure(
    transaction: UnitOfWork, plan: _Plan, part_ids: list[str], error: BaseException
) -> tuple[Upload, File] | None:
    """After a completion failed: the upload and its file when a completion beside it recorded
    them; otherwise let go of the claim, so that a retry takes it over at once. Best effort: the
    database may be what failed, and then the claim goes stale after the lease."""
    try:
        with transaction() as session:
            row = session.get(Upload, plan.upload_id)
            assert row is not None
            done = _completed(session, row, part_ids)
            if done is not None:
                return row, done
            session.execute(
                update(Upload)
                .where(
                    Upload.id == plan.upload_id,
                    Upload.status == UploadStatus.completing.value,
                    Upload.completing_since == plan.claimed_at,
                )
                .values(completing_since=None)
                .execution_options(synchronize_session=False)
            )
    except Exception as exc:  # noqa: BLE001 - the first failure is the one to answer with
        error.add_note(f"letting go of the claim failed too: {exc!r}")
    return None


def _cancel(
    transaction: UnitOfWork, store: ObjectStore, plan: _Plan, part_ids: list[str]
) -> tuple[Upload, File] | None:
    """Cancel the upload whose completion cannot succeed; unless a completion beside this one
    recorded the file: then the upload and its file."""
    with transaction() as session:
        row = session.execute(select(Upload).where(Upload.id == plan.upload_id).with_for_update()).scalar_one()
        done = _completed(session, row, part_ids)
        if done is not None:
            return row, done
        if row.status == UploadStatus.completing.value and row.file_id == plan.file_id:
            row.status, row.cancelled_at, row.completing_since = UploadStatus.cancelled.value, utcnow(), None
            _discard_parts(session, store, row)
    return None


def complete_upload(
    transaction: UnitOfWork,
    store: ObjectStore,
    *,
    team_id: str,
    upload_id: str,
    part_ids: list[str],
    md5: str | None,
    default_batch_expiry_s: int,
    now: datetime | None = None,
) -> tuple[Upload, File]:
    """Make the file of the parts named, in that order. Short transactions: claim the upload,
    (none while the store assembles the file), record the file. Each step may be done again: a
    completion that failed or died half-way is retried by completing the same parts again,
    which finds what it had made in the store (or makes it again at the same key) and records
    the file once; a retry of a completed upload answers with its file. An md5 mismatch, or
    parts the store no longer holds, cancel the upload."""
    with transaction() as session:
        claim = _claim(session, team_id=team_id, upload_id=upload_id, part_ids=part_ids, md5=md5, now=now or utcnow())
        if isinstance(claim, File):
            row = session.get(Upload, upload_id)
            assert row is not None
            return row, claim
    plan = claim
    try:
        leftovers = _assemble(store, plan, md5)
        row, file = _record(transaction, plan, part_ids=part_ids, default_batch_expiry_s=default_batch_expiry_s)
    except (Md5Mismatch, PartsGone) as exc:
        done = _cancel(transaction, store, plan, part_ids)
        if done is None or isinstance(exc, Md5Mismatch):
            raise
        return done  # a completion beside this one made the file, then removed its parts
    except Exception as exc:
        done = _after_failure(transaction, plan, part_ids, exc)
        if done is None:
            raise
        return done
    for key in leftovers:  # recorded: only now may what the file was made of go
        store.delete(key)
    return row, file


# -- cancellation and expiry -------------------------------------------------------------------


def _discard_parts(session: Session, store: ObjectStore, row: Upload) -> None:
    """Drop the upload's parts from the store and the database. The store goes first: should it
    fail, the rows say what is left and the next retention pass tries again."""
    apart = session.execute(
        select(UploadPart.object_key).where(UploadPart.upload_id == row.id, UploadPart.object_key.is_not(None))
    ).scalars()
    store.abort_multipart(row.multipart_key, row.multipart_id)
    for key in apart:
        if key:
            store.delete(key)
    # What a completion that died may have made: the multipart upload's object (the file of the
    # direct path, or a concatenation's staging) and the concatenation's file. No file row names
    # either: the upload never completed.
    for key in {row.multipart_key, file_service.file_key(row.team_id, row.file_id)}:
        store.delete(key)
    session.execute(delete(UploadPart).where(UploadPart.upload_id == row.id))
    row.cleaned_at = utcnow()


def cancel_upload(session: Session, store: ObjectStore, *, team_id: str, upload_id: str) -> Upload:
    row = get_upload(session, team_id=team_id, upload_id=upload_id)
    if row.status == UploadStatus.cancelled.value:
        return row
    session.refresh(row, with_for_update=True)  # a completion claims it under the same lock
    now = utcnow()
    # A completion that failed or died (its claim let go of, or stale) does not hold the upload.
    if not (row.status == UploadStatus.completing.value and row.expires_at > now and not _claim_is_live(row, now)):
        _require_pending(row, now)
    row.status, row.cancelled_at, row.completing_since = UploadStatus.cancelled.value, now, None
    session.flush()
    _discard_parts(session, store, row)
    session.flush()
    return row


def _to_clean(now: datetime) -> ColumnElement[bool]:
    return Upload.cleaned_at.is_(None) & or_(
        (Upload.status == UploadStatus.pending.value) & (Upload.expires_at <= now),
        Upload.status == UploadStatus.cancelled.value,
        (Upload.status == UploadStatus.completing.value) & (Upload.expires_at <= now - COMPLETING_GRACE),
    )


def clean_up_uploads(transaction: UnitOfWork, store: ObjectStore, *, now: datetime, limit: int) -> int:
    """Remove the parts of uploads that will never complete (expired, cancelled, or a completion
    that died): each upload in a short transaction of its own that checks it again. Returns how many."""
    with transaction() as session:
        upload_ids = list(session.execute(select(Upload.id).where(_to_clean(now)).limit(limit)).scalars())
    cleaned = 0
    for upload_id in upload_ids:
        with transaction() as session:
            row = session.execute(
                select(Upload).where(Upload.id == upload_id, _to_clean(now)).with_for_update()
            ).scalar_one_or_none()
            if row is None:
                continue
            if row.status != UploadStatus.cancelled.value:
                row.status = UploadStatus.expired.value
            _discard_parts(session, store, row)
            cleaned += 1
    return cleaned
