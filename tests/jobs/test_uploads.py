"""Uploads on a real database and both real object stores (a directory, SeaweedFS over S3): the
direct path (the store completes its own multipart upload), the server-side concatenation (a
small part in the middle, parts named out of order), md5, and the clean-up of what never completes."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, cast

import pytest
from sqlalchemy import select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs import uploads
from backfill.jobs.errors import Conflict
from backfill.jobs.models import File, Upload, UploadPart, utcnow
from backfill.jobs.teams import get_or_create_team
from backfill.storage.db import UnitOfWork
from backfill.storage.objects import MIN_PART_BYTES, PART_BYTES, LocalObjectStore, ObjectStore
from tests.storage.test_objects import store as store  # the fixture: a local directory, and SeaweedFS

MiB = 1024 * 1024


def _team(db: sessionmaker[Session]) -> str:
    with db.begin() as session:
        return get_or_create_team(session, name=f"t-{secrets.token_hex(4)}").id


def _upload(db: sessionmaker[Session], store: ObjectStore, team_id: str, size: int) -> Upload:
    with db.begin() as session:
        return uploads.create_upload(
            session,
            store,
            team_id=team_id,
            filename="in.jsonl",
            purpose="batch",
            mime_type="text/jsonl",
            size=size,
            expires_after_s=None,
            max_upload_bytes=8 * 1024**3,
        )


def _part(db: sessionmaker[Session], store: ObjectStore, team_id: str, upload_id: str, data: bytes) -> str:
    with db.begin() as session:
        target = uploads.begin_part(session, team_id=team_id, upload_id=upload_id, declared_bytes=len(data) + 300)
    # Fed in uneven chunks, as a multipart body arrives.
    stored = uploads.store_part(store, target, (data[i : i + 70_001] for i in range(0, len(data), 70_001)))
    with db.begin() as session:
        return uploads.record_part(session, store, target=target, stored=stored).id


def _pieces(*sizes: int) -> list[bytes]:
    return [bytes([65 + i]) * n for i, n in enumerate(sizes)]


def _complete(
    db: sessionmaker[Session], store: ObjectStore, team_id: str, sizes: list[int], order: list[int] | None = None
) -> tuple[bool, bytes]:
    """Upload parts of `sizes`, complete them in `order`; (whether the direct path made it, its bytes)."""
    pieces = _pieces(*sizes)
    order = order if order is not None else list(range(len(sizes)))
    data = b"".join(pieces[i] for i in order)
    up = _upload(db, store, team_id, len(data))
    ids = [_part(db, store, team_id, up.id, p) for p in pieces]
    row, file = uploads.complete_upload(
        db.begin,
        store,
        team_id=team_id,
        upload_id=up.id,
        part_ids=[ids[i] for i in order],
        md5=hashlib.md5(data).hexdigest(),
        default_batch_expiry_s=3600,
    )
    assert row.status == "completed" and file.bytes == len(data)
    got = b"".join(store.open(file.object_key))
    assert got == data
    return file.id == up.file_id, got


def test_store_blocks_are_never_small_but_alone() -> None:
    for size in (1, MIN_PART_BYTES - 1, PART_BYTES, PART_BYTES + 1, PART_BYTES + MIN_PART_BYTES, 3 * PART_BYTES - 1):
        out = list(uploads.store_blocks([b"x" * size], size=PART_BYTES, min_bytes=MIN_PART_BYTES))
        assert sum(map(len, out)) == size
        assert len(out) == 1 or all(len(b) >= MIN_PART_BYTES for b in out)
        assert len(out) <= -(-size // PART_BYTES)


def test_large_parts_in_order_go_the_direct_way(db: sessionmaker[Session], store: ObjectStore) -> None:
    team_id = _team(db)
    # 9 MiB (one store part: its 1 MiB tail merged), 6 MiB, then a small last part.
    direct, _ = _complete(db, store, team_id, [9 * MiB, 6 * MiB, 1000])
    assert direct


def test_small_parts_in_the_middle_and_parts_out_of_order_are_concatenated(
    db: sessionmaker[Session], store: ObjectStore
) -> None:
    team_id = _team(db)
    direct, _ = _complete(db, store, team_id, [1000, 6 * MiB, 2000])
    assert direct is isinstance(store, LocalObjectStore)  # a directory takes parts of any size
    direct, _ = _complete(db, store, team_id, [6 * MiB, 5 * MiB, 300], order=[1, 0, 2])
    assert not direct
    direct, _ = _complete(db, store, team_id, [10, 20, 30], order=[2, 0, 1])
    assert not direct


def test_cancel_and_expiry_remove_the_parts(db: sessionmaker[Session], store: ObjectStore) -> None:
    team_id = _team(db)
    cancelled = _upload(db, store, team_id, 10)
    _part(db, store, team_id, cancelled.id, b"x" * 5)
    expired = _upload(db, store, team_id, 10)
    _part(db, store, team_id, expired.id, b"y" * 5)
    with db.begin() as session:
        uploads.cancel_upload(session, store, team_id=team_id, upload_id=cancelled.id)
    with pytest.raises(Conflict):
        with db.begin() as session:
            uploads.begin_part(session, team_id=team_id, upload_id=cancelled.id, declared_bytes=None)
    later = utcnow() + uploads.UPLOAD_TTL + timedelta(seconds=1)
    assert uploads.clean_up_uploads(db.begin, store, now=later, limit=100) >= 1
    with db.begin() as session:
        for upload_id, status in ((cancelled.id, "cancelled"), (expired.id, "expired")):
            row = session.get(Upload, upload_id)
            assert row is not None and row.status == status and row.cleaned_at is not None
            assert session.execute(select(UploadPart).where(UploadPart.upload_id == upload_id)).first() is None
    assert list(store.list(f"uploads/{team_id}/")) == []
    # A second pass finds nothing left to do.
    with db.begin() as session:
        assert session.get(Upload, expired.id) is not None
    assert uploads.clean_up_uploads(db.begin, store, now=later, limit=100) == 0


# -- a completion that dies half-way ---------------------------------------------------------------


class _DatabaseDown(OperationalError):
    def __init__(self) -> None:
        super().__init__("COMMIT", {}, Exception("the database went away"))


def _failing(db: sessionmaker[Session], fail: Callable[[int], bool]) -> UnitOfWork:
    """`db.begin`, but the transactions numbered (from 1) where `fail` says so roll back and raise
    where they would have committed, as when the database or the process goes."""
    calls = 0

    @contextmanager
    def transaction() -> Iterator[Session]:
        nonlocal calls
        calls += 1
        with db.begin() as session:
            yield session
            if fail(calls):
                raise _DatabaseDown

    return transaction


# (sizes, order): the direct path (the store completes its own multipart upload; its last part
# kept apart on S3), then the concatenation with a staging object (parts named out of order).
PATHS = [([6 * MiB, 1000], [0, 1]), ([6 * MiB, 5 * MiB, 300], [1, 0, 2])]


def _parts(
    db: sessionmaker[Session], store: ObjectStore, team_id: str, sizes: list[int], order: list[int]
) -> tuple[Upload, list[str], bytes]:
    pieces = _pieces(*sizes)
    data = b"".join(pieces[i] for i in order)
    up = _upload(db, store, team_id, len(data))
    ids = [_part(db, store, team_id, up.id, p) for p in pieces]
    return up, [ids[i] for i in order], data


def _complete_parts(
    transaction: UnitOfWork,
    store: ObjectStore,
    team_id: str,
    upload_id: str,
    part_ids: list[str],
    data: bytes,
    now: datetime | None = None,
) -> tuple[Upload, File]:
    return uploads.complete_upload(
        transaction,
        store,
        team_id=team_id,
        upload_id=upload_id,
        part_ids=part_ids,
        md5=hashlib.md5(data).hexdigest(),
        default_batch_expiry_s=3600,
        **({"now": now} if now is not None else {}),
    )


def _made_once(db: sessionmaker[Session], store: ObjectStore, team_id: str, upload_id: str, data: bytes) -> str:
    """The upload made one file of `data`, and nothing else of it is left in the store."""
    with db.begin() as session:
        row = session.get(Upload, upload_id)
        assert row is not None and row.status == "completed"
        files = list(session.execute(select(File).where(File.team_id == team_id)).scalars())
        assert [f.id for f in files] == [row.file_id]
        assert session.execute(select(UploadPart).where(UploadPart.upload_id == upload_id)).first() is None
    assert b"".join(store.open(files[0].object_key)) == data
    assert [o.key for o in store.list(f"files/{team_id}/")] == [files[0].object_key]
    assert list(store.list(f"uploads/{team_id}/")) == []
    return files[0].id


@pytest.mark.parametrize(("sizes", "order"), PATHS, ids=["direct", "concatenated"])
def test_a_completion_whose_record_failed_is_retried(
    db: sessionmaker[Session], store: ObjectStore, sizes: list[int], order: list[int]
) -> None:
    """The store made the file, then recording it failed (the process lives on): a retry at once
    finds the file made and records it; a second retry returns the same upload and file."""
    team_id = _team(db)
    up, part_ids, data = _parts(db, store, team_id, sizes, order)
    with pytest.raises(_DatabaseDown):  # the second transaction records the file
        _complete_parts(_failing(db, lambda n: n == 2), store, team_id, up.id, part_ids, data)
    row, file = _complete_parts(db.begin, store, team_id, up.id, part_ids, data)
    assert row.status == "completed" and file.bytes == len(data)
    assert _made_once(db, store, team_id, up.id, data) == file.id
    # The answer to the first retry lost: the next one gets the same file, made nothing again.
    again, same = _complete_parts(db.begin, store, team_id, up.id, part_ids, data)
    assert again.status == "completed" and same.id == file.id
    _made_once(db, store, team_id, up.id, data)


@pytest.mark.parametrize(("sizes", "order"), PATHS, ids=["direct", "concatenated"])
def test_a_completion_killed_before_recording_is_taken_over_once_stale(
    db: sessionmaker[Session], store: ObjectStore, sizes: list[int], order: list[int]
) -> None:
    """Killed after the store made the file: nothing of the process runs again, its claim stays.
    While the claim is live a retry is refused (409); once stale, a retry of the same parts takes
    it over and records the file; one of other parts never does."""
    team_id = _team(db)
    up, part_ids, data = _parts(db, store, team_id, sizes, order)
    with pytest.raises(_DatabaseDown):
        _complete_parts(_failing(db, lambda n: n >= 2), store, team_id, up.id, part_ids, data)
    with pytest.raises(Conflict) as live:
        _complete_parts(db.begin, store, team_id, up.id, part_ids, data)
    assert live.value.code == "upload_completing"
    stale = utcnow() + uploads.COMPLETION_LEASE + timedelta(seconds=1)
    with pytest.raises(Conflict) as other:
        _complete_parts(db.begin, store, team_id, up.id, part_ids[::-1], data, now=stale)
    assert other.value.code == "upload_completing"
    row, file = _complete_parts(db.begin, store, team_id, up.id, part_ids, data, now=stale)
    assert row.status == "completed" and file.bytes == len(data)
    assert _made_once(db, store, team_id, up.id, data) == file.id


class _Reentrant:
    """A store that, while it assembles the file, lets `during` run once (a second completion)."""

    def __init__(self, store: ObjectStore, during: Callable[[], None]) -> None:
        self._store, self._during = store, during
        self.min_part_bytes = store.min_part_bytes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def complete_multipart(self, key: str, upload_id: str, parts: Sequence[tuple[int, str]]) -> int:
        self._during()
        return self._store.complete_multipart(key, upload_id, parts)


def test_a_second_completion_while_the_first_is_live_is_refused(db: sessionmaker[Session], store: ObjectStore) -> None:
    team_id = _team(db)
    up, part_ids, data = _parts(db, store, team_id, [6 * MiB, 1000], [0, 1])
    refused: list[Conflict] = []

    def second() -> None:
        if refused:
            return
        try:
            _complete_parts(db.begin, store, team_id, up.id, part_ids, data)
        except Conflict as exc:
            refused.append(exc)

    row, file = _complete_parts(db.begin, cast(ObjectStore, _Reentrant(store, second)), team_id, up.id, part_ids, data)
    assert [exc.code for exc in refused] == ["upload_completing"]
    assert row.status == "completed"
    assert _made_once(db, store, team_id, up.id, data) == file.id


@pytest.mark.parametrize(("sizes", "order"), PATHS, ids=["direct", "concatenated"])
def test_an_upload_whose_completion_failed_can_be_cancelled(
    db: sessionmaker[Session], store: ObjectStore, sizes: list[int], order: list[int]
) -> None:
    """A failed completion lets go of the upload: cancelling it removes what the completion made too."""
    team_id = _team(db)
    up, part_ids, data = _parts(db, store, team_id, sizes, order)
    with pytest.raises(_DatabaseDown):
        _complete_parts(_failing(db, lambda n: n == 2), store, team_id, up.id, part_ids, data)
    with db.begin() as session:
        assert uploads.cancel_upload(session, store, team_id=team_id, upload_id=up.id).status == "cancelled"
    with pytest.raises(Conflict) as cancelled:
        _complete_parts(db.begin, store, team_id, up.id, part_ids, data)
    assert cancelled.value.code == "upload_cancelled"
    assert list(store.list(f"files/{team_id}/")) == []
    assert list(store.list(f"uploads/{team_id}/")) == []


@pytest.mark.parametrize(("sizes", "order"), PATHS, ids=["direct", "concatenated"])
def test_a_slow_completion_taken_over_ends_with_the_same_file(
    db: sessionmaker[Session], store: ObjectStore, sizes: list[int], order: list[int]
) -> None:
    """A completion still running past the lease is taken over by a retry, which makes the file,
    records it and removes the parts; the slow one then finds it recorded and answers with it."""
    team_id = _team(db)
    up, part_ids, data = _parts(db, store, team_id, sizes, order)
    stale = utcnow() + uploads.COMPLETION_LEASE + timedelta(seconds=1)
    taken: list[File] = []

    def retry() -> None:
        if not taken:
            taken.append(_complete_parts(db.begin, store, team_id, up.id, part_ids, data, now=stale)[1])

    slow = cast(ObjectStore, _Reentrant(store, retry))
    row, file = _complete_parts(db.begin, slow, team_id, up.id, part_ids, data)
    assert row.status == "completed" and [f.id for f in taken] == [file.id]
    assert _made_once(db, store, team_id, up.id, data) == file.id


class _PutBreaksOnce:
    """A store whose first `put` breaks off after its first chunk, as a connection does."""

    def __init__(self, store: ObjectStore) -> None:
        self._store, self.broke = store, False
        self.min_part_bytes = store.min_part_bytes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def put(self, key: str, chunks: Iterable[bytes], *, max_bytes: int | None = None) -> int:
        if self.broke:
            return self._store.put(key, chunks, max_bytes=max_bytes)
        self.broke = True

        def breaking() -> Iterator[bytes]:
            yield next(iter(chunks))
            raise ConnectionResetError("the store went away")

        return self._store.put(key, breaking(), max_bytes=max_bytes)


def test_a_concatenation_broken_off_is_written_again_at_the_same_key(
    db: sessionmaker[Session], store: ObjectStore
) -> None:
    team_id = _team(db)
    up, part_ids, data = _parts(db, store, team_id, [6 * MiB, 5 * MiB, 300], [1, 0, 2])
    flaky = _PutBreaksOnce(store)
    with pytest.raises(ConnectionResetError):
        _complete_parts(db.begin, cast(ObjectStore, flaky), team_id, up.id, part_ids, data)
    with db.begin() as session:
        row = session.get(Upload, up.id)
        assert row is not None
        claimed = row.file_id
    _, file = _complete_parts(db.begin, cast(ObjectStore, flaky), team_id, up.id, part_ids, data)
    assert file.id == claimed
    assert _made_once(db, store, team_id, up.id, data) == file.id
