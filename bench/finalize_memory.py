"""Peak memory of a finalization of large answers: `--lines` lines of `--line-bytes` each (embeddings
run to hundreds of KB a line), on a scratch Postgres database, written to a local object
directory. The finalization runs in a worker process of its own; its peak RSS is sampled with
psutil (and the kernel's own high-water mark, ru_maxrss, is reported beside it).

    .venv/bin/python -m bench.finalize_memory                      # 5,000 lines of ~1 MB
    .venv/bin/python -m bench.finalize_memory --lines 500 --line-bytes 200000

Pages are cut by bytes (`jobs.output.pages.PAGE_BYTES`), so the peak stays near a few pages
however large the lines; pages of 5,000 lines held the whole batch's answers at once.
"""

from __future__ import annotations

import argparse
import os
import resource
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import psutil

PG_ADMIN_URL = os.environ.get("TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
MB = 1024 * 1024

# Answers of `line_bytes` built in the database (a 32-character md5 repeated): nothing that size
# crosses the client while loading. Stored compressed, read back (and written) at full size.
_INSERT_LINES = """
    INSERT INTO batch_requests (batch_id, line, custom_id, "offset", length, prefix_hash, token_estimate,
        prefix_rank, prefix_tokens, kv_tokens, state, attempts, result_id, status_code, request_id,
        response_body, prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens)
    SELECT %(batch_id)s, i, 'r' || i, 0, 1, '', 0, 0, 0, 0, 'succeeded', 0, 'res' || i, 200, 'q' || i,
        '{"data":"' || repeat(md5(i::text), %(repeats)s::int) || '"}', 9, 0, 1, 0
    FROM generate_series(%(start)s::int, %(end)s::int) AS i
"""


def _make_batch(url: str, lines: int, line_bytes: int) -> str:
    from sqlalchemy.orm import Session

    from backfill.jobs.models import Batch, BatchStatus, Team, utcnow
    from backfill.storage.db import make_engine

    engine = make_engine(url)
    with Session(engine) as s, s.begin():
        team = Team(name="bench-memory")
        s.add(team)
        s.flush()
        now = utcnow()
        batch = Batch(
            team_id=team.id,
            input_file_id="f",
            endpoint="/v1/embeddings",
            completion_window="24h",
            status=BatchStatus.in_progress,
            created_at=now,
            expires_at=now + timedelta(hours=24),
            total=lines,
        )
        s.add(batch)
        s.flush()
        driver = s.connection().connection.driver_connection
        assert driver is not None
        with driver.cursor() as cursor:
            for start in range(1, lines + 1, 500):
                params = {"batch_id": batch.id, "repeats": max(1, line_bytes // 32), "start": start}
                cursor.execute(_INSERT_LINES, {**params, "end": min(start + 499, lines)})
        batch_id = batch.id
    engine.dispose()
    return batch_id


def worker(url: str, batch_id: str, root: str) -> None:
    """The finalization, in this process: prints its status, seconds, bytes and ru_maxrss."""
    from sqlalchemy.orm import sessionmaker

    from backfill.jobs.output.finalize import finalize_batch
    from backfill.storage.db import make_engine
    from backfill.storage.objects import LocalObjectStore

    engine = make_engine(url)
    store = LocalObjectStore(Path(root))
    started = time.perf_counter()
    status = finalize_batch(sessionmaker(bind=engine, expire_on_commit=False).begin, store, batch_id=batch_id)
    seconds = time.perf_counter() - started
    written = sum(o.size for o in store.list("batches/"))
    maxrss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"RESULT {status} {seconds:.2f} {written} {maxrss_kb}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=5000)
    parser.add_argument("--line-bytes", type=int, default=1_000_000, help="bytes of each line's answer")
    parser.add_argument("--worker", nargs=3, metavar=("URL", "BATCH", "ROOT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return

    from backfill.devfleet.services import create_database, drop_database

    name = f"backfill_bench_mem_{secrets.token_hex(4)}"
    url = create_database(PG_ADMIN_URL, name)
    root = tempfile.mkdtemp(prefix="bench-finalize-memory-")
    try:
        loading = time.perf_counter()
        batch_id = _make_batch(url, args.lines, args.line_bytes)
        print(f"loaded {args.lines} lines of {args.line_bytes} bytes in {time.perf_counter() - loading:.1f} s")
        child = subprocess.Popen(
            [sys.executable, "-m", "bench.finalize_memory", "--worker", url, batch_id, root],
            stdout=subprocess.PIPE,
            text=True,
        )
        process, peak = psutil.Process(child.pid), 0
        while child.poll() is None:
            try:
                peak = max(peak, process.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)
        out, _ = child.communicate()
        assert child.returncode == 0, out
        _, status, seconds, written, maxrss_kb = next(x for x in out.splitlines() if x.startswith("RESULT")).split()
        print(
            f"finalize_memory: lines={args.lines} line_bytes={args.line_bytes} status={status} seconds={seconds}"
            f" written_mb={int(written) / MB:.0f} peak_rss_mb={peak / MB:.0f} ru_maxrss_mb={int(maxrss_kb) / 1024:.0f}"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
        drop_database(PG_ADMIN_URL, name)


if __name__ == "__main__":
    main()
