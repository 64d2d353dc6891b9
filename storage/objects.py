"""Object store: S3 through boto3 in production, a local directory when embedded.

Writes take an iterator of byte chunks and a size cap, so uploads are streamed and the cap
is enforced while streaming (never after buffering the whole body).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import IO, Protocol

from storage.settings import get_settings

CHUNK = 1024 * 1024


class ObjectTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"object exceeds {limit} bytes")
        self.limit = limit


class ObjectStore(Protocol):
    def put(self, key: str, chunks: Iterable[bytes], *, max_bytes: int | None = None) -> int: ...
    def open(self, key: str) -> Iterator[bytes]: ...
    def read_range(self, key: str, offset: int, length: int) -> bytes: ...
    def delete(self, key: str) -> None: ...
    def exists(self, key: str) -> bool: ...


class _CountingReader:
    """File-like view of a chunk iterator that counts bytes and stops at the cap."""

    def __init__(self, chunks: Iterable[bytes], max_bytes: int | None) -> None:
        self._it = iter(chunks)
        self._buf = b""
        self.count = 0
        self._max = max_bytes

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self._buf) < size:
            try:
                chunk = next(self._it)
            except StopIteration:
                break
            self.count += len(chunk)
            if self._max is not None and self.count > self._max:
                raise ObjectTooLarge(self._max)
            self._buf += chunk
        if size < 0:
            out, self._buf = self._buf, b""
        else:
            out, self._buf = self._buf[:size], self._buf[size:]
        return out


class LocalObjectStore:
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
        reader = _CountingReader(chunks, max_bytes)
        # Write beside, then rename: a reader never sees half an object, a crash leaves none.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as out:
                while block := reader.read(CHUNK):
                    out.write(block)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return reader.count

    def open(self, key: str) -> Iterator[bytes]:
        path = self._path(key)
        if not path.exists():
            raise FileNotFoundError(key)
        fh: IO[bytes] = path.open("rb")

        def gen() -> Iterator[bytes]:
            with fh:
                while block := fh.read(CHUNK):
                    yield block

        return gen()

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        with self._path(key).open("rb") as fh:
            fh.seek(offset)
            return fh.read(length)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def exists(self, key: str) -> bool:
        return self._path(key).exists()


class S3ObjectStore:
    def __init__(self, *, endpoint_url: str, bucket: str, access_key: str, secret_key: str, region: str) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket = bucket
        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            aws_access_key_id=access_key or None,
            aws_secret_access_key=secret_key or None,
            region_name=region,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 5, "mode": "standard"}),
        )
        # boto3's managed transfer does the multipart upload from a stream for us.
        self._transfer = TransferConfig(multipart_threshold=8 * CHUNK, multipart_chunksize=8 * CHUNK)

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
        reader = _CountingReader(chunks, max_bytes)
        self.client.upload_fileobj(reader, self.bucket, key, Config=self._transfer)
        return reader.count

    def open(self, key: str) -> Iterator[bytes]:
        from botocore.exceptions import ClientError

        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
        except ClientError as exc:
            if exc.response["Error"]["Code"] in ("NoSuchKey", "404"):
                raise FileNotFoundError(key) from exc
            raise
        return iter(body.iter_chunks(CHUNK))

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        obj = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}")
        data: bytes = obj["Body"].read()
        return data

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=key)

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=key)
            return True
        except ClientError:
            return False


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
