"""Both object stores against real backends: a directory, and SeaweedFS over S3.

Streams are fed in small chunks (as finalization feeds one per output line) and span several
S3 parts, so the multipart path, its abort and the regrouping of chunks are all exercised.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from backfill.storage.objects import PART_BYTES, LocalObjectStore, ObjectStore, ObjectTooLarge, S3ObjectStore, blocks

BUCKET = "backfill-test"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return LocalObjectStore(tmp_path / "objects")
    server: Any = request.getfixturevalue("s3")
    return S3ObjectStore(
        endpoint_url=server.endpoint_url,
        bucket=BUCKET,
        access_key=server.access_key,
        secret_key=server.secret_key,
        region=server.region,
    )


def _key(name: str) -> str:
    return f"test-objects/{secrets.token_hex(4)}/{name}"


def _lines(total: int, width: int = 600) -> Iterator[bytes]:
    """`total` bytes as JSONL-ish lines of `width` bytes, each one chunk."""
    n = 0
    while n < total:
        line = (f'{{"line":{n // width}}}'.encode().ljust(min(width, total - n) - 1, b" ") + b"\n")[: total - n]
        n += len(line)
        yield line


def _read(store: ObjectStore, key: str) -> bytes:
    return b"".join(store.open(key))


class Boom(Exception):
    pass


def _failing(chunks: Iterator[bytes], after: int) -> Iterator[bytes]:
    sent = 0
    for chunk in chunks:
        if sent >= after:
            raise Boom
        sent += len(chunk)
        yield chunk


def test_blocks_regroup_any_chunking_exactly() -> None:
    data = bytes(range(256)) * 100
    for sizes in ([1], [7, 300, 1], [25_600], [4096, 4096, 17_408], [30_000]):
        chunks, i, k = [], 0, 0
        while i < len(data):
            chunks.append(data[i : i + sizes[k % len(sizes)]])
            i += sizes[k % len(sizes)]
            k += 1
        out = list(blocks(chunks, 4096))
        assert b"".join(out) == data
        assert all(len(b) == 4096 for b in out[:-1]) and 0 < len(out[-1]) <= 4096
    assert list(blocks([], 10)) == [b""]
    assert list(blocks([b"", b""], 10)) == [b""]
    assert list(blocks([b"x" * 20], 10)) == [b"x" * 10, b"x" * 10]


def test_a_multipart_stream_of_small_chunks_round_trips(store: ObjectStore) -> None:
    """> 2 S3 parts fed 64 KiB at a time, then a stream of 600-byte lines: bytes and count exact."""
    key = _key("big.bin")
    data = secrets.token_bytes(2 * PART_BYTES + 12_345)
    assert store.put(key, (data[i : i + 65_536] for i in range(0, len(data), 65_536))) == len(data)
    assert _read(store, key) == data
    assert store.read_range(key, PART_BYTES - 3, 6) == data[PART_BYTES - 3 : PART_BYTES + 3]

    key = _key("lines.jsonl")
    expected = b"".join(_lines(PART_BYTES + 5_000))
    assert store.put(key, _lines(PART_BYTES + 5_000)) == len(expected)
    assert _read(store, key) == expected


@pytest.mark.parametrize("size", [0, 1, PART_BYTES - 1, PART_BYTES, PART_BYTES + 1])
def test_sizes_around_a_part_boundary_round_trip(store: ObjectStore, size: int) -> None:
    key = _key(f"edge-{size}")
    data = secrets.token_bytes(size)
    assert store.put(key, [data[: size // 3], data[size // 3 :]]) == size
    assert _read(store, key) == data


def test_a_failure_mid_stream_leaves_nothing_at_the_key(store: ObjectStore, tmp_path: Path) -> None:
    # After more than one part has gone out, so on S3 the multipart upload must be aborted.
    key = _key("broken.jsonl")
    with pytest.raises(Boom):
        store.put(key, _failing(_lines(3 * PART_BYTES), after=PART_BYTES + 100_000))
    with pytest.raises(FileNotFoundError):
        _read(store, key)
    assert list(store.list(key)) == []

    # Over an existing object, the previous version stays whole.
    store.put(key, [b"v1\n"])
    with pytest.raises(Boom):
        store.put(key, _failing(_lines(3 * PART_BYTES), after=PART_BYTES + 100_000))
    assert _read(store, key) == b"v1\n"

    if isinstance(store, S3ObjectStore):
        uploads = store.client.list_multipart_uploads(Bucket=BUCKET, Prefix=key).get("Uploads", [])
        assert uploads == []
    else:
        assert isinstance(store, LocalObjectStore)
        assert [p.name for p in store._path(key).parent.iterdir()] == [Path(key).name]  # no temp files left


KILLED_WRITER = """
import os, sys
from pathlib import Path
from backfill.storage.objects import LocalObjectStore, S3ObjectStore, PART_BYTES
kind, key, where = sys.argv[1], sys.argv[2], sys.argv[3:]
if kind == "local":
    store = LocalObjectStore(Path(where[0]))
else:
    url, bucket, access, secret, region = where
    store = S3ObjectStore(endpoint_url=url, bucket=bucket, access_key=access, secret_key=secret, region=region)
def chunks():
    for n in range(3 * PART_BYTES // 65536):
        if n * 65536 > PART_BYTES + 200_000:
            os._exit(9)  # killed: no exception handler, no cleanup
        yield b"k" * 65535 + b"\\n"
store.put(key, chunks())
"""


def test_a_write_killed_mid_stream_leaves_nothing_at_the_key(
    store: ObjectStore, request: pytest.FixtureRequest
) -> None:
    key = _key("killed.jsonl")
    if isinstance(store, LocalObjectStore):
        kind, where = "local", [str(store.root)]
    else:
        server: Any = request.getfixturevalue("s3")
        kind, where = "s3", [server.endpoint_url, BUCKET, server.access_key, server.secret_key, server.region]
    done = subprocess.run([sys.executable, "-c", KILLED_WRITER, kind, key, *where], cwd=ROOT, timeout=120)
    assert done.returncode == 9
    with pytest.raises(FileNotFoundError):
        _read(store, key)
    if isinstance(store, LocalObjectStore):
        # The half-written temporary file is listed, so orphan collection can remove it.
        (leftover,) = store.list(key.rsplit("/", 1)[0] + "/")
        assert "/.tmp-" in leftover.key and leftover.size > 0
    else:
        assert list(store.list(key)) == []


def test_the_size_cap_stops_the_stream_and_stores_nothing(store: ObjectStore) -> None:
    key = _key("capped.jsonl")
    consumed = 0

    def counting() -> Iterator[bytes]:
        nonlocal consumed
        for line in _lines(4 * PART_BYTES):
            consumed += len(line)
            yield line

    with pytest.raises(ObjectTooLarge):
        store.put(key, counting(), max_bytes=PART_BYTES + 1000)
    assert consumed <= PART_BYTES + 1000 + 600  # stopped at the cap, not after the whole body
    with pytest.raises(FileNotFoundError):
        _read(store, key)


def test_list_yields_keys_sizes_and_times_under_a_prefix(store: ObjectStore) -> None:
    root = _key("")
    before = datetime.now(UTC) - timedelta(minutes=5)
    store.put(root + "batches/t1/b1/output.jsonl", [b"abc"])
    store.put(root + "batches/t1/b1/error.jsonl", [b"de"])
    store.put(root + "batches/t10/b2/output.jsonl", [b"f"])
    store.put(root + "files/t1/file-1", [b"ghij"])

    listed = {o.key: o for o in store.list(root + "batches/")}
    assert {k: o.size for k, o in listed.items()} == {
        root + "batches/t1/b1/output.jsonl": 3,
        root + "batches/t1/b1/error.jsonl": 2,
        root + "batches/t10/b2/output.jsonl": 1,
    }
    for obj in listed.values():
        assert before < obj.last_modified < datetime.now(UTC) + timedelta(minutes=5)
    # A prefix is a string prefix, not a folder: "t1" also matches "t10", "t1/" does not.
    assert len(list(store.list(root + "batches/t1"))) == 3
    assert len(list(store.list(root + "batches/t1/"))) == 2
    assert [o.key for o in store.list(root + "files/t1/file-")] == [root + "files/t1/file-1"]
    assert list(store.list(root + "nothing/")) == []

    store.delete(root + "files/t1/file-1")
    assert list(store.list(root + "files/")) == []


def test_s3_list_pages_past_a_thousand_keys(s3: Any) -> None:
    store = S3ObjectStore(
        endpoint_url=s3.endpoint_url,
        bucket=BUCKET,
        access_key=s3.access_key,
        secret_key=s3.secret_key,
        region=s3.region,
    )
    root = _key("")
    keys = {f"{root}k{i:05d}" for i in range(1_005)}
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: store.client.put_object(Bucket=BUCKET, Key=k, Body=b"x"), keys))
    listed = [o.key for o in store.list(root)]
    assert len(listed) == 1_005 and set(listed) == keys


# A worker preloads the S3 client before its pool forks (`preload_s3_client`); a child then
# makes its store without parsing a description file, and the store it makes works.
FORKED_AFTER_PRELOAD = """
import os, sys
from botocore import loaders
from backfill.storage.objects import S3ObjectStore, preload_s3_client
preload_s3_client()
loaded = []
read = loaders.JSONFileLoader.load_file
loaders.JSONFileLoader.load_file = lambda self, path: loaded.append(path) or read(self, path)
pid = os.fork()
if pid == 0:
    url, bucket, access, secret, region, key = sys.argv[1:]
    store = S3ObjectStore(endpoint_url=url, bucket=bucket, access_key=access, secret_key=secret, region=region)
    store.put(key, [b"forked\\n"])
    os._exit(0 if b"".join(store.open(key)) == b"forked\\n" and not loaded else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_child_forked_after_the_preload_makes_a_working_store_from_what_was_loaded(s3: Any) -> None:
    env = {
        **os.environ,
        "BACKFILL_S3_ENDPOINT_URL": s3.endpoint_url,
        "BACKFILL_S3_REGION": s3.region,
        # The preload uses placeholder keys, never these: a credential lookup must not run in it.
        "BACKFILL_S3_ACCESS_KEY": "",
        "BACKFILL_S3_SECRET_KEY": "",
    }
    key = _key("forked.jsonl")
    args = [s3.endpoint_url, BUCKET, s3.access_key, s3.secret_key, s3.region, key]
    done = subprocess.run([sys.executable, "-c", FORKED_AFTER_PRELOAD, *args], cwd=ROOT, env=env, timeout=120)
    assert done.returncode == 0


def test_without_an_s3_endpoint_the_preload_loads_nothing() -> None:
    env = {**os.environ, "BACKFILL_S3_ENDPOINT_URL": ""}
    script = "import sys; from backfill.storage.objects import preload_s3_client; preload_s3_client(); "
    script += "sys.exit('boto3' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, timeout=60).returncode == 0
