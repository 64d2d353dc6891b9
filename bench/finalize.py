"""Finalization's write path: an S3 put of a stream of ~600-byte lines (one chunk per line, the
way `jobs.output` feeds it), the store's streaming put next to the reader it replaced (kept
inline below: a `bytes +=` buffer under boto3's managed transfer), against SeaweedFS.

Then, with `--lines`, the whole `finalize_batch` on a scratch Postgres database: a batch of
that many succeeded lines with ~600-byte bodies, read with a streaming query and written to S3.

    .venv/bin/python -m bench.finalize                       # 64 MB, old and new
    .venv/bin/python -m bench.finalize --old-mb 16 --lines 100000

The old reader's cost is per 8 MiB part (quadratic in the part, not in the object), so its MB/s
on a shorter stream (`--old-mb`) is its MB/s on a long one.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import time
import tracemalloc
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import orjson

from storage.objects import CHUNK, S3ObjectStore

PG_ADMIN_URL = os.environ.get("TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
MB = 1024 * 1024
BUCKET = "bench-finalize"


def lines(total: int, width: int = 600) -> Iterator[bytes]:
    """`total` bytes of output-file-like lines of about `width` bytes, each its own chunk."""
    n = i = 0
    while n < total:
        head = b'{"id":"batch_req_%d","custom_id":"r%d","response":{"status_code":200,"body":"' % (i, i)
        line = (head + b"x" * max(0, width - len(head) - 18) + b'"},"error":null}\n')[: total - n]
        n += len(line)
        i += 1
        yield line


class OldCountingReader:
    """The reader `S3ObjectStore.put` used before: a `bytes` buffer grown by `+=` per chunk."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._it = iter(chunks)
        self._buf = b""
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self._buf) < size:
            try:
                chunk = next(self._it)
            except StopIteration:
                break
            self.count += len(chunk)
            self._buf += chunk
        if size < 0:
            out, self._buf = self._buf, b""
        else:
            out, self._buf = self._buf[:size], self._buf[size:]
        return out


def old_put(store: S3ObjectStore, key: str, chunks: Iterable[bytes]) -> int:
    from boto3.s3.transfer import TransferConfig

    reader = OldCountingReader(chunks)
    config = TransferConfig(multipart_threshold=8 * CHUNK, multipart_chunksize=8 * CHUNK)
    store.client.upload_fileobj(reader, store.bucket, key, Config=config)
    return reader.count


def digest(chunks: Iterable[bytes]) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def timed_put(store: S3ObjectStore, put: Any, nbytes: int, key: str) -> tuple[float, float]:
    """(MB/s of wall time, this process's CPU seconds per 64 MB): the CPU figure is the steadier
    one on a shared machine, and the S3 server's own CPU is not in it."""
    started, cpu = time.perf_counter(), time.process_time()
    assert put(store, key, lines(nbytes)) == nbytes
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    assert digest(store.open(key)) == digest(lines(nbytes)), "round trip changed the bytes"
    store.delete(key)
    return nbytes / MB / seconds, cpu / (nbytes / MB) * 64


def peak_memory_mb(store: S3ObjectStore, nbytes: int) -> float:
    """Python heap peak of one new-style put (tracemalloc slows it: a separate, untimed run)."""
    tracemalloc.start()
    store.put("bench/peak", lines(nbytes))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    store.delete("bench/peak")
    return peak / MB


def bench_finalize(store: S3ObjectStore, n_lines: int) -> tuple[float, float, float, float]:
    """(seconds, MB/s of the two files, MB written, this process's CPU seconds) for finalize_batch
    on a fresh Postgres batch of succeeded lines (one in 50 failed, for an error file too)."""
    from sqlalchemy import insert
    from sqlalchemy.orm import sessionmaker

    from jobs.models import Batch, BatchRequest, BatchStatus, Team, utcnow
    from jobs.output import finalize_batch
    from storage.db import make_engine
    from tests.stack import create_database, drop_database

    name = f"backfill_bench_{secrets.token_hex(4)}"
    engine = make_engine(create_database(PG_ADMIN_URL, name))
    try:
        db = sessionmaker(bind=engine, expire_on_commit=False)
        body = orjson.dumps({"choices": [{"message": {"content": "y" * 480}}], "usage": {"prompt_tokens": 9}})
        with db.begin() as s:
            team = Team(name="bench")
            s.add(team)
            s.flush()
            now = utcnow()
            batch = Batch(
                team_id=team.id,
                input_file_id="f",
                endpoint="/v1/chat/completions",
                completion_window="24h",
                status=BatchStatus.in_progress,
                created_at=now,
                expires_at=now + timedelta(hours=24),
                total=n_lines,
            )
            s.add(batch)
            s.flush()
            batch_id = batch.id
            for start in range(0, n_lines, 10_000):
                s.execute(
                    insert(BatchRequest),
                    [
                        dict(
                            batch_id=batch_id,
                            line=i,
                            custom_id=f"r{i}",
                            offset=0,
                            length=1,
                            state="succeeded" if i % 50 else "failed",
                            result_id=f"res{i}",
                            status_code=200 if i % 50 else 400,
                            request_id=f"q{i}",
                            response_body=body.decode(),
                            prompt_tokens=9,
                        )
                        for i in range(start + 1, min(start + 10_000, n_lines) + 1)
                    ],
                )
        started, cpu = time.perf_counter(), time.process_time()
        assert finalize_batch(db.begin, store, batch_id=batch_id) == BatchStatus.completed
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        written = sum(o.size for o in store.list(f"batches/{team.id}/{batch_id}/"))
        return seconds, written / MB / seconds, written / MB, cpu
    finally:
        engine.dispose()
        drop_database(PG_ADMIN_URL, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=64, help="stream size for the new put")
    parser.add_argument("--old-mb", type=int, default=64, help="stream size for the old put (0 skips it)")
    parser.add_argument("--lines", type=int, default=0, help="also time finalize_batch on this many lines")
    args = parser.parse_args()

    from devfleet.s3 import SeaweedS3

    with SeaweedS3() as s3:
        s3.create_bucket(BUCKET)
        store = S3ObjectStore(
            endpoint_url=s3.endpoint_url,
            bucket=BUCKET,
            access_key=s3.access_key,
            secret_key=s3.secret_key,
            region=s3.region,
        )
        new, new_cpu = timed_put(store, S3ObjectStore.put, args.mb * MB, "bench/new")
        nan = float("nan")
        old, old_cpu = timed_put(store, old_put, args.old_mb * MB, "bench/old") if args.old_mb else (nan, nan)
        peak = peak_memory_mb(store, args.mb * MB)
        print(f"{'S3 put, 600-byte lines':<28}{'MB':>6}{'MB/s':>10}{'CPU s/64 MB':>14}")
        print(f"{'old (bytes += reader)':<28}{args.old_mb:>6}{old:>10.2f}{old_cpu:>14.2f}")
        print(f"{'new (streaming multipart)':<28}{args.mb:>6}{new:>10.2f}{new_cpu:>14.2f}")
        print(f"new/old: {new / old:.0f}x the speed, {old_cpu / new_cpu:.0f}x less CPU; new heap peak {peak:.1f} MB")
        line = (
            f"finalize_put: old_mb_s={old:.2f} new_mb_s={new:.1f} ratio={new / old:.0f}"
            f" old_cpu_s={old_cpu:.2f} new_cpu_s={new_cpu:.2f} peak_heap_mb={peak:.1f}"
        )
        if args.lines:
            seconds, mb_s, written, cpu = bench_finalize(store, args.lines)
            print(
                f"finalize_batch, {args.lines} lines on Postgres: {written:.1f} MB in {seconds:.2f} s"
                f" = {mb_s:.1f} MB/s, {cpu:.2f} CPU s here (Postgres and S3 servers not counted)"
            )
            line += f" finalize_batch_mb_s={mb_s:.1f} finalize_batch_cpu_s={cpu:.2f}"
        print(line)


if __name__ == "__main__":
    main()
