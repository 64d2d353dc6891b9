"""Object store: S3 through boto3 in production, a local directory when embedded.

Writes take an iterator of byte chunks and a size cap, so uploads are streamed and the cap
is enforced while streaming (never after buffering the whole body). Chunks may be of any
size (a finalization feeds one per output line): they are regrouped in linear time into
bounded blocks, and an object appears at its key only once it is complete, so a failed or
interrupted write leaves nothing (or the previous version) there.
"""

from __future__ import annotations

import hashlib
import os
import queue
import secrets
import shutil
import tempfile
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import IO, Any, NamedTuple, Protocol

from backfill.storage.settings import get_settings

CHUNK = 1024 * 1024
# S3 parts are at least 5 MiB (all but the last); 8 MiB parts cap an object at 80 GB
# (10,000 parts), far above any file limit, while one upload holds only three parts in memory.
PART_BYTES = 8 * CHUNK
PARTS_IN_FLIGHT = 2
# S3's own bounds on a multipart upload: every part but the last at least 5 MiB, numbers 1-10,000.
MIN_PART_BYTES = 5 * CHUNK
MAX_PART_NUMBER = 10_000


class ObjectTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"object exceeds {limit} bytes")
        self.limit = limit


class StoredObject(NamedTuple):
    key: str
    size: int
    last_modified: datetime  # timezone-aware, UTC


class NoSuchMultipart(Exception):
    """The multipart upload was completed or aborted (or never existed)."""


class ObjectStore(Protocol):
    # The smallest part a multipart upload takes anywhere but last (S3: 5 MiB; a directory: any).
    min_part_bytes: int

    def put(self, key: str, chunks: Iterable[bytes], *, max_bytes: int | None = None) -> int: ...
    def open(self, key: str, *, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """The object's bytes from offset `start` to `end` (its end when None), a chunk at a time."""
        ...

    def read_range(self, key: str, offset: int, length: int) -> bytes: ...
    def delete(self, key: str) -> None: ...
    def list(self, prefix: str) -> Iterator[StoredObject]: ...

    # A multipart upload: parts sent one request at a time (numbered 1 to MAX_PART_NUMBER, any
    # gaps), none readable until `complete_multipart` makes the object of the parts it names,
    # in ascending number order; the parts it does not name are dropped.
    def start_multipart(self, key: str) -> str: ...
    def upload_part(self, key: str, upload_id: str, number: int, body: bytes) -> str:
        """Store one part; returns its tag, which `complete_multipart` is given back."""
        ...

    def complete_multipart(self, key: str, upload_id: str, parts: Sequence[tuple[int, str]]) -> int:
        """Make the object at `key` of `parts` ((number, tag), ascending); returns its size."""
        ...

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """Drop the upload and its parts; a no-op for one already completed or aborted."""
        ...


class _Counted:
    """Passes chunks through, counting bytes and stopping as soon as the total passes the cap."""

    def __init__(self, chunks: Iterable[bytes], max_bytes: int | None) -> None:
        self._chunks = chunks
        self._max = max_bytes
        self.count = 0

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._chunks:
            self.count += len(chunk)
            if self._max is not None and self.count > self._max:
                raise ObjectTooLarge(self._max)
            yield chunk


def blocks(chunks: Iterable[bytes], size: int) -> Iterator[bytes]:
    """Regroup chunks of any size into blocks of exactly `size` bytes; the last may be shorter.

    Appending to a bytearray is amortised linear and each block is cut once, so the cost is
    linear in the bytes whatever the chunk sizes (a `bytes +=` buffer re-copies itself per
    chunk: quadratic). Yields one empty block for an empty stream, none otherwise.
    """
    buf = bytearray()
    yielded = False
    for chunk in chunks:
        buf += chunk
        if len(buf) < size:
            continue
        whole = len(buf) - len(buf) % size
        with memoryview(buf) as view:
            ready = [view[i : i + size].tobytes() for i in range(0, whole, size)]
        del buf[:whole]  # moves the remainder only: less than one block
        yielded = True
        yield from ready
    if buf or not yielded:
        yield bytes(buf)


class LocalObjectStore:
    # Parts are files concatenated at completion: any size will do.
    min_part_bytes = 0
    # Multipart uploads in progress, one folder each: outside every key prefix the service lists.
    MULTIPART_DIR = ".multipart"

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents:
            raise ValueError(f"bad key {key!r}")
        return path

    def put(self, key: str, chunks: Iterable[bytes], *, max_bytes: int | None = None) -> int:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        counted = _Counted(chunks, max_bytes)
        # Write beside, then rename: a reader never sees half an object, a crash leaves none at
        # the key (a killed process leaves a `.tmp-` file, which orphan collection removes).
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb", buffering=CHUNK) as out:
                for chunk in counted:
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())  # the rename must not outlive the bytes after a power cut
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return counted.count

    def open(self, key: str, *, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        path = self._path(key)
        if not path.exists():
            raise FileNotFoundError(key)
        return _read_file(path, start, end)

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        with self._path(key).open("rb") as fh:
            fh.seek(offset)
            return fh.read(length)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def _multipart(self, upload_id: str) -> Path:
        if not upload_id.isalnum():
            raise NoSuchMultipart(upload_id)
        return self.root / self.MULTIPART_DIR / upload_id

    def start_multipart(self, key: str) -> str:
        self._path(key)  # a bad key is refused now, not at completion
        upload_id = secrets.token_hex(16)
        self._multipart(upload_id).mkdir(parents=True)
        return upload_id

    def upload_part(self, key: str, upload_id: str, number: int, body: bytes) -> str:
        folder = self._multipart(upload_id)
        if not folder.is_dir():
            raise NoSuchMultipart(upload_id)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(body)
            os.replace(tmp, folder / f"{number:05d}")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return hashlib.md5(body, usedforsecurity=False).hexdigest()

    def complete_multipart(self, key: str, upload_id: str, parts: Sequence[tuple[int, str]]) -> int:
        """Concatenate the named part files into the object, streaming (`put`: written beside,
        then renamed), then drop the folder with every part, named or not."""
        folder = self._multipart(upload_id)
        if not folder.is_dir():
            raise NoSuchMultipart(upload_id)
        files = [folder / f"{number:05d}" for number, _ in parts]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise NoSuchMultipart(f"{upload_id}: no part {missing[0]}")
        size = self.put(key, (block for f in files for block in _read_file(f, 0, None)))
        shutil.rmtree(folder, ignore_errors=True)
        return size

    def abort_multipart(self, key: str, upload_id: str) -> None:
        try:
            folder = self._multipart(upload_id)
        except NoSuchMultipart:
            return
        shutil.rmtree(folder, ignore_errors=True)

    def list(self, prefix: str) -> Iterator[StoredObject]:
        """Objects whose key starts with `prefix` (a string prefix, as in S3), in no set order.

        The `.tmp-` files of writes in progress or killed are listed too: they hold space, and
        orphan collection (past its grace period) is what removes a killed one.
        """
        root = self.root.resolve()
        base = (root / prefix.rpartition("/")[0]).resolve()
        if base != root and root not in base.parents:
            raise ValueError(f"bad prefix {prefix!r}")
        for dirpath, dirnames, filenames in os.walk(base):
            here = Path(dirpath).relative_to(root).as_posix()
            here = "" if here == "." else here + "/"
            # Only descend where a key under the folder could still start with the prefix.
            dirnames[:] = [d for d in dirnames if _may_hold(here + d + "/", prefix)]
            for name in filenames:
                key = here + name
                if not key.startswith(prefix):
                    continue
                try:
                    stat = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:  # deleted or renamed since the walk saw it
                    continue
                yield StoredObject(key, stat.st_size, datetime.fromtimestamp(stat.st_mtime, UTC))


def _may_hold(folder: str, prefix: str) -> bool:
    return folder.startswith(prefix) or prefix.startswith(folder)


def _read_file(path: Path, start: int, end: int | None) -> Iterator[bytes]:
    fh: IO[bytes] = path.open("rb")  # opened now: a missing file fails the call, not the first read
    fh.seek(start)
    left = None if end is None else max(0, end - start)

    def gen() -> Iterator[bytes]:
        nonlocal left
        with fh:
            while left is None or left > 0:
                block = fh.read(CHUNK if left is None else min(CHUNK, left))
                if not block:
                    return
                if left is not None:
                    left -= len(block)
                yield block

    return gen()


class S3ObjectStore:
    min_part_bytes = MIN_PART_BYTES

    def __init__(self, *, endpoint_url: str, bucket: str, access_key: str, secret_key: str, region: str) -> None:
        self.bucket = bucket
        self.client = _s3_client(endpoint_url, access_key or None, secret_key or None, region)

    def ensure_bucket(self) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError:
            try:
                self.client.create_bucket(Bucket=self.bucket)
            except ClientError as exc:
                if exc.response["Error"]["Code"] not in ("BucketAlreadyExists", "BucketAlreadyOwnedByYou"):
                    raise

    def put(self, key: str, chunks: Iterable[bytes], *, max_bytes: int | None = None) -> int:
        """One PUT for an object smaller than a part, else a multipart upload aborted on any failure.

        Parts upload on helper threads while the caller produces the next one (a finalization
        reads the database meanwhile): up to PARTS_IN_FLIGHT uploading and one filling, so the
        store's latency per part overlaps and memory stays at (PARTS_IN_FLIGHT + 1) x PART_BYTES.
        """
        counted = _Counted(chunks, max_bytes)
        parts = blocks(counted, PART_BYTES)
        first = next(parts)
        if len(first) < PART_BYTES:  # the whole object
            self.client.put_object(Bucket=self.bucket, Key=key, Body=first)
            return counted.count
        upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        try:
            with ThreadPoolExecutor(PARTS_IN_FLIGHT, thread_name_prefix="s3-part") as uploader:
                in_flight = deque([uploader.submit(self._upload_part, key, upload_id, 1, first)])
                del first
                done = []
                for number, body in enumerate(parts, start=2):
                    if len(in_flight) >= PARTS_IN_FLIGHT:
                        done.append(in_flight.popleft().result())
                    in_flight.append(uploader.submit(self._upload_part, key, upload_id, number, body))
                    del body
                done.extend(f.result() for f in in_flight)
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done}
            )
        except BaseException:
            self._abort(key, upload_id)  # after the helper threads have stopped: no part lands later
            raise
        return counted.count

    def _upload_part(self, key: str, upload_id: str, number: int, body: bytes) -> dict[str, Any]:
        answer = self.client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body)
        return {"PartNumber": number, "ETag": answer["ETag"]}

    def _abort(self, key: str, upload_id: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except (BotoCoreError, ClientError):
            pass  # the original failure matters more; a bucket lifecycle rule reaps what is left

    def open(self, key: str, *, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        from botocore.exceptions import ClientError

        if end is not None and end <= start:
            return iter(())
        last = "" if end is None else str(end - 1)
        try:
            ranged = {"Range": f"bytes={start}-{last}"} if start or last else {}
            body = self.client.get_object(Bucket=self.bucket, Key=key, **ranged)["Body"]
        except ClientError as exc:
            if exc.response["Error"]["Code"] in ("NoSuchKey", "404"):
                raise FileNotFoundError(key) from exc
            raise
        return iter(body.iter_chunks(CHUNK))

    def start_multipart(self, key: str) -> str:
        upload_id: str = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        return upload_id

    def upload_part(self, key: str, upload_id: str, number: int, body: bytes) -> str:
        from botocore.exceptions import ClientError

        try:
            tag: str = self._upload_part(key, upload_id, number, body)["ETag"]
        except ClientError as exc:
            if exc.response["Error"]["Code"] == "NoSuchUpload":
                raise NoSuchMultipart(upload_id) from exc
            raise
        return tag

    def complete_multipart(self, key: str, upload_id: str, parts: Sequence[tuple[int, str]]) -> int:
        from botocore.exceptions import ClientError

        try:
            self.client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": [{"PartNumber": n, "ETag": tag} for n, tag in parts]},
            )
        except ClientError as exc:
            if exc.response["Error"]["Code"] == "NoSuchUpload":
                raise NoSuchMultipart(upload_id) from exc
            raise
        size: int = self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"]
        return size

    def abort_multipart(self, key: str, upload_id: str) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except ClientError as exc:
            if exc.response["Error"]["Code"] not in ("NoSuchUpload", "404"):
                raise

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        obj = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}")
        data: bytes = obj["Body"].read()
        return data

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=key)

    def list(self, prefix: str) -> Iterator[StoredObject]:
        """Objects whose key starts with `prefix`, in key order, a page of up to 1,000 at a time."""
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents", ()):
                yield StoredObject(item["Key"], int(item["Size"]), item["LastModified"])


def is_transient(exc: BaseException) -> bool:
    """Whether an object store call that raised `exc` may succeed if tried again later: S3
    answering 5xx or throttling, or the connection failing while connecting, reading or
    streaming. Not configuration, credentials or parameters, nor a missing object."""
    try:
        from botocore import exceptions as s3
    except ImportError:  # the embedded mode's local object store needs no botocore
        return False
    if isinstance(exc, s3.ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return status >= 500 or exc.response.get("Error", {}).get("Code") in ("SlowDown", "Throttling")
    return isinstance(exc, s3.ConnectionError | s3.HTTPClientError | s3.IncompleteReadError)


def _s3_client(endpoint_url: str, access_key: str | None, secret_key: str | None, region: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name=region,
        # Without payload signing botocore hashes no body with SHA-256 on a plain-HTTP endpoint
        # (an in-cluster SeaweedFS or MinIO; over HTTPS it never does): a finalization's
        # parts cost a third less client CPU. Each body still carries its CRC32 checksum.
        config=Config(
            s3={"addressing_style": "path", "payload_signing_enabled": False},
            retries={"max_attempts": 5, "mode": "standard"},
        ),
    )


def preload_s3_client() -> None:
    """Import boto3 and load the S3 client's descriptions (its service model, endpoint rules)
    into boto3's default session, in a process about to fork its workers: each forked worker
    then makes its own client from them in milliseconds, where importing boto3 and parsing
    those JSON files cost every Celery pool child ~0.17 s of CPU on its first use of the
    object store. The client made here is thrown away: it never connects (fork-safe), and it
    is given placeholder keys so that no credential lookup (instance metadata) runs here."""
    s = get_settings()
    if s.s3_endpoint_url:
        _s3_client(s.s3_endpoint_url, "preload", "preload", s.s3_region)


@lru_cache
def get_object_store() -> ObjectStore:
    s = get_settings()
    if s.s3_endpoint_url:
        store = S3ObjectStore(
            endpoint_url=s.s3_endpoint_url,
            bucket=s.s3_bucket,
            access_key=s.s3_access_key,
            secret_key=s.s3_secret_key,
            region=s.s3_region,
        )
        store.ensure_bucket()
        return store
    return LocalObjectStore(s.objects_dir)


# Feeding an object store's streaming `put` from a producer on another thread.
#
# A producer that reads its bytes a page at a time (finalization reading rows) hands each page to
# a put running on a thread of its own, so reading and uploading overlap, through a bounded queue,
# so no more than a few pages wait in memory. A put starts with its first bytes, so a stream that
# turns out empty creates no object; a producer that fails aborts the put, so no object appears.

QUEUED_CHUNKS = 2  # chunks waiting for each put: with the producer's own, a bounded backlog
_WAIT_S = 0.2  # how long a hand-off waits before it looks again whether its put has stopped
_END, _ABORT = object(), object()  # what a put is handed last: all bytes sent, or the producer failed


class ProducerFailed(Exception):
    """Ends a put whose bytes stopped coming: the object must not be completed."""


class Upload:
    """One object's `store.put` on a thread of its own, fed a chunk at a time through a bounded
    queue. It starts with the first non-empty chunk, so an object without bytes is never created.

    Neither side can wait for good on the other: the put waits only for what the producer always
    hands it last (`end`), and the producer's waits on a full queue look again every _WAIT_S
    whether the put has stopped (a failed put: the producer raises its error at the next `send`)."""

    def __init__(self, pool: ThreadPoolExecutor, store: ObjectStore, key: str) -> None:
        self._pool, self._store, self._key = pool, store, key
        self._queue: queue.Queue[object] = queue.Queue(QUEUED_CHUNKS)
        self._put: Future[int] | None = None

    def send(self, chunk: bytes) -> None:
        if not chunk:
            return
        if self._put is None:
            self._put = self._pool.submit(self._store.put, self._key, self._chunks())
        if self._put.done() or not self._hand(chunk):
            self._put.result()  # its failure, now: no point producing further
            raise RuntimeError(f"the put of {self._key} returned before its last chunk")

    def end(self, *, abort: bool = False) -> None:
        """Tell the put there is no more, or (`abort`) that it must fail; never raises its error."""
        if self._put is not None:
            self._hand(_ABORT if abort else _END)

    def size(self) -> int | None:
        """The bytes written (None when nothing was sent), or the put's failure; after `end`."""
        return None if self._put is None else self._put.result()

    def _hand(self, item: object) -> bool:
        """Queue `item` for the put; False if the put stopped before taking it."""
        assert self._put is not None
        while True:
            try:
                self._queue.put(item, timeout=_WAIT_S)
                return True
            except queue.Full:
                if self._put.done():
                    return False

    def _chunks(self) -> Iterator[bytes]:
        while (item := self._queue.get()) is not _END:
            if item is _ABORT:
                raise ProducerFailed(f"the bytes of {self._key} stopped coming")
            assert isinstance(item, bytes)
            yield item


@contextmanager
def uploads(store: ObjectStore, keys: Sequence[str], *, thread_name_prefix: str = "upload") -> Iterator[list[Upload]]:
    """An `Upload` per key; on leaving, each is ended (aborted if the block raised) and waited
    for, so no put is left running or lands later. A put's failure is raised by its `size`."""
    with ThreadPoolExecutor(len(keys), thread_name_prefix=thread_name_prefix) as pool:
        started = [Upload(pool, store, key) for key in keys]
        try:
            yield started
        except BaseException:
            for upload in started:
                upload.end(abort=True)
            raise
        for upload in started:
            upload.end()
