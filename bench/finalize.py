"""Finalization's write path: an S3 put of a stream of ~600-byte lines (one chunk per line, the
way `jobs.output.finalize` feeds it), the store's streaming put next to the reader it replaced (kept
inline below: a `bytes +=` buffer under boto3's managed transfer), against SeaweedFS.

Then, with `--lines`, the whole `finalize_batch` on a scratch Postgres database, for git
revision `--before`'s jobs/output/{finalize,pages}.py (HEAD by default) and the working tree's, interleaved,
`--repeat` runs each (median, min and max MB/s: the machine is shared; each round's speed-up of
the working tree over `--before`; the CPU seconds of this process, of the scratch database's
Postgres backends and of the S3 server; the 1-minute load average), every run checked to
write the same files and counters. `--shape succeeded`: every line ran (~600-byte bodies, one
in 50 failed); `--shape expired`: the batch expired after `--ran` lines, the rest are written
as batch_expired error lines.

    .venv/bin/python -m bench.finalize                       # 64 MB, old and new
    .venv/bin/python -m bench.finalize --old-mb 16 --lines 100000
    .venv/bin/python -m bench.finalize --mb 0 --lines 1000000 --shape expired --repeat 5

The old reader's cost is per 8 MiB part (quadratic in the part, not in the object), so its MB/s
on a shorter stream (`--old-mb`) is its MB/s on a long one.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson
import psutil

from backfill.storage.objects import CHUNK, S3ObjectStore

PG_ADMIN_URL = os.environ.get("TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
MB = 1024 * 1024
ROOT = Path(__file__).resolve().parent.parent
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


# The batches `--lines` finalizes. `ran` lines ran (one in 50 of them failed), `running` more
# were running when the window closed (expired), and the rest were never claimed (pending,
# written as batch_expired): the shape a 1,000,000-line batch has when it expires.
SHAPES = {
    "succeeded": "every line ran, one in 50 failed: a large output file and a small error file",
    "expired": "the batch expired with --ran lines run: a small output file and a large error file",
}
RUNNING_AT_EXPIRY = 32
_INSERT_LINES = """
    INSERT INTO batch_requests (batch_id, line, custom_id, "offset", length, prefix_hash, token_estimate,
        prefix_rank, prefix_tokens, kv_tokens, state, attempts, result_id, status_code, request_id,
        response_body, prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens)
    SELECT %(batch_id)s, i, 'r' || i, 0, 1, '', 0, 0, 0, 0, s.state, 0,
        CASE WHEN s.answered THEN 'res' || i END,
        CASE WHEN s.answered THEN CASE WHEN s.state = 'failed' THEN 400 ELSE 200 END END,
        CASE WHEN s.answered THEN 'q' || i END,
        CASE WHEN s.answered THEN %(body)s END,
        CASE WHEN s.state = 'succeeded' THEN 9 ELSE 0 END, CASE WHEN s.state = 'succeeded' THEN 2 ELSE 0 END,
        CASE WHEN s.state = 'succeeded' THEN 120 ELSE 0 END, 0
    FROM generate_series(%(start)s, %(end)s) AS i,
    LATERAL (SELECT CASE
        WHEN i <= %(ran)s AND i %% 50 = 0 THEN 'failed'
        WHEN i <= %(ran)s THEN 'succeeded'
        WHEN i <= %(ran)s + %(running)s THEN 'expired'
        ELSE 'pending' END AS state) AS st,
    LATERAL (SELECT st.state, st.state IN ('succeeded', 'failed') AS answered) AS s
"""


def _module_at(rev: str, file: str, name: str) -> ModuleType:
    source = subprocess.run(["git", "show", f"{rev}:{file}"], cwd=ROOT, check=True, capture_output=True)
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_bytes(source.stdout)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


def load_output_revision(rev: str) -> ModuleType:
    """`jobs/output/finalize.py` as it is at git revision `rev`, reading its pages with that
    revision's `jobs/output/pages.py`, as modules of their own (the rest of the package is the
    working tree's), the way bench.validate_speed loads validation."""
    module = _module_at(rev, "jobs/output/finalize.py", "output_before")
    setattr(module, "pages", _module_at(rev, "jobs/output/pages.py", "output_pages_before").pages)  # noqa: B010
    return module


def _make_batch(engine: Any, n_lines: int, shape: str, ran: int, *, vacuum: bool = True) -> tuple[str, str, str]:
    """(batch id, team id, the status finalization starts from) of a fresh batch in `shape`;
    unless `vacuum`, its rows are as just written (no hint bits, no statistics)."""
    from sqlalchemy.orm import Session

    from backfill.jobs.models import Batch, BatchStatus, Team, utcnow

    expired = shape == "expired"
    ran = min(ran, n_lines) if expired else n_lines
    body = orjson.dumps({"choices": [{"message": {"content": "y" * 480}}], "usage": {"prompt_tokens": 9}})
    with Session(engine) as s, s.begin():
        team = Team(name=f"bench-{secrets.token_hex(4)}")
        s.add(team)
        s.flush()
        now = utcnow()
        status = BatchStatus.finalizing if expired else BatchStatus.in_progress  # as expire_overdue leaves it
        batch = Batch(
            team_id=team.id,
            input_file_id="f",
            endpoint="/v1/chat/completions",
            completion_window="24h",
            status=status,
            created_at=now,
            expires_at=now + timedelta(hours=24),
            expired_at=now if expired else None,
            finalizing_at=now if expired else None,
            total=n_lines,
        )
        s.add(batch)
        s.flush()
        batch_id, team_id = batch.id, team.id
        driver = s.connection().connection.driver_connection
        assert driver is not None
        with driver.cursor() as cursor:
            for start in range(1, n_lines + 1, 100_000):
                params = {"batch_id": batch_id, "body": body.decode(), "ran": ran, "running": RUNNING_AT_EXPIRY}
                cursor.execute(_INSERT_LINES, {**params, "start": start, "end": min(start + 99_999, n_lines)})
    if vacuum:
        with engine.connect() as connection:  # settled pages and fresh statistics: every run reads the same
            connection.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("VACUUM ANALYZE batch_requests")
    return batch_id, team_id, status


def _reset(engine: Any, store: S3ObjectStore, batch_id: str, team_id: str, status: str) -> None:
    """The batch back to where finalization starts, its files gone."""
    from sqlalchemy import update
    from sqlalchemy.orm import Session

    from backfill.jobs.models import Batch

    with Session(engine) as s, s.begin():
        s.execute(
            update(Batch).where(Batch.id == batch_id).values(status=status, output_file_id=None, error_file_id=None)
        )
    for obj in list(store.list(f"batches/{team_id}/{batch_id}/")):
        store.delete(obj.key)


def _cpu_seconds(processes: Iterable[Any]) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:  # it ended: what it used is no longer told
            continue
        total += times.user + times.system
    return total


def _database_backends(database: str) -> list[Any]:
    """The Postgres backends serving `database` (their title names it), when Postgres runs on
    this machine: its CPU, the finalization's other half, is in no process of this one."""
    return [
        p for p in psutil.process_iter(["cmdline"]) if any(f" {database} " in arg for arg in p.info["cmdline"] or ())
    ]


def _finalize_once(
    module: Any, engine: Any, store: S3ObjectStore, batch: tuple[str, str, str], s3_server: list[Any]
) -> dict[str, Any]:
    """One `module.finalize_batch` of the batch: wall and CPU seconds (here, in the database's
    backends, in the S3 server), bytes, and what it wrote (each file's digest and the batch's
    counters), for comparing the two revisions."""
    from sqlalchemy.orm import Session, sessionmaker

    from backfill.jobs.models import Batch, BatchStatus

    batch_id, team_id, status = batch
    _reset(engine, store, batch_id, team_id, status)
    db = sessionmaker(bind=engine, expire_on_commit=False)
    database = engine.url.database
    pg_cpu, s3_cpu = _cpu_seconds(_database_backends(database)), _cpu_seconds(s3_server)
    started, cpu = time.perf_counter(), time.process_time()
    final = module.finalize_batch(db.begin, store, batch_id=batch_id)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    pg_cpu = _cpu_seconds(_database_backends(database)) - pg_cpu  # the pool's backends outlive the run
    s3_cpu = _cpu_seconds(s3_server) - s3_cpu
    assert final in (BatchStatus.completed, BatchStatus.expired), final
    objects = sorted(store.list(f"batches/{team_id}/{batch_id}/"))
    with Session(engine) as s:
        b = s.get(Batch, batch_id)
        assert b is not None
        # (whether each file is named, not its id: the id derives from the batch's, one a run with --fresh)
        counters: tuple[Any, ...] = (b.status, b.output_file_id is not None, b.error_file_id is not None)
        counters += (b.completed, b.failed)
        counters += (b.input_tokens, b.cached_tokens, b.output_tokens, b.reasoning_tokens)
    return {
        "seconds": seconds,
        "cpu": cpu,
        "pg_cpu": pg_cpu,
        "s3_cpu": s3_cpu,
        "load": os.getloadavg()[0],
        "bytes": sum(o.size for o in objects),
        "files": {o.key.rsplit("/", 1)[1]: (o.size, digest(store.open(o.key))) for o in objects},
        "counters": counters,
    }


def bench_finalize(
    store: S3ObjectStore,
    n_lines: int,
    *,
    shape: str,
    ran: int,
    repeat: int,
    before: str,
    s3_server: list[Any],
    fresh: bool = False,
) -> None:
    """`finalize_batch` of one fresh Postgres batch, `repeat` times for git revision `before`'s
    jobs/output/finalize.py and for the working tree's, interleaved (the order swapped every round, so a
    slow stretch of the shared machine falls on both); each run checked to write the same."""
    import backfill.jobs.output.finalize as after
    from backfill.devfleet.services import create_database, drop_database
    from backfill.storage.db import make_engine

    name = f"backfill_bench_{secrets.token_hex(4)}"
    engine = make_engine(create_database(PG_ADMIN_URL, name))
    try:
        batch = _make_batch(engine, n_lines, shape, ran, vacuum=not fresh)
        revisions = {f"before ({before})": load_output_revision(before), "after (working tree)": after}
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label in revisions}
        for round_ in range(repeat):
            for label in list(revisions)[:: 1 if round_ % 2 == 0 else -1]:
                if fresh and any(runs.values()):  # the first run reads the batch made above
                    batch = _make_batch(engine, n_lines, shape, ran, vacuum=False)  # never read before
                runs[label].append(run := _finalize_once(revisions[label], engine, store, batch, s3_server))
                print(
                    f"  round {round_ + 1} {label:<22} {run['seconds']:6.2f} s {run['bytes'] / MB / run['seconds']:7.1f} MB/s"
                    f"  CPU s: here {run['cpu']:.2f}, Postgres {run['pg_cpu']:.2f}, S3 {run['s3_cpu']:.2f};"
                    f" load {run['load']:.1f}"
                )
        every = [run for results in runs.values() for run in results]
        written = {(repr(run["files"]), run["counters"]) for run in every}
        assert len(written) == 1, "the revisions wrote different files or counters"
        files = ", ".join(f"{kind} {size / MB:.1f} MB" for kind, (size, _) in every[0]["files"].items())
        print(
            f"finalize_batch, {n_lines} lines on Postgres, shape {shape} ({files}; same bytes and counters every run):"
        )
        print("median CPU seconds: here (the finalizing process), Postgres (the database's backends), S3 (the server)")
        print(f"{'':<22}{'median MB/s':>12}{'min':>8}{'max':>8}{'median s':>10}{'here':>7}{'Postgres':>10}{'S3':>6}")
        summary = []
        for label, results in runs.items():
            rates = [r["bytes"] / MB / r["seconds"] for r in results]
            median = statistics.median(rates)
            seconds = statistics.median(r["seconds"] for r in results)
            cpu = {side: statistics.median(r[side] for r in results) for side in ("cpu", "pg_cpu", "s3_cpu")}
            print(
                f"{label:<22}{median:>12.1f}{min(rates):>8.1f}{max(rates):>8.1f}{seconds:>10.2f}"
                f"{cpu['cpu']:>7.2f}{cpu['pg_cpu']:>10.2f}{cpu['s3_cpu']:>6.2f}"
            )
            summary.append(
                f"{label.split()[0]}_mb_s={median:.1f} {label.split()[0]}_range={min(rates):.1f}-{max(rates):.1f}"
            )
        # Each round runs both back to back: a round's speed-up (the before's seconds over the
        # after's) is the steadier figure on a shared machine.
        before_runs, after_runs = runs.values()
        speedups = [b["seconds"] / a["seconds"] for b, a in zip(before_runs, after_runs, strict=True)]
        loads = [r["load"] for r in every]
        summary.append(
            f"speedup={statistics.median(speedups):.2f} speedup_range={min(speedups):.2f}-{max(speedups):.2f}"
        )
        summary.append(f"load_1min={min(loads):.1f}-{max(loads):.1f}")
        print(f"finalize_batch: shape={shape} fresh={fresh} lines={n_lines} repeat={repeat} " + " ".join(summary))
    finally:
        engine.dispose()
        drop_database(PG_ADMIN_URL, name)


def bench_put(store: S3ObjectStore, mb: int, old_mb: int) -> None:
    new, new_cpu = timed_put(store, S3ObjectStore.put, mb * MB, "bench/new")
    nan = float("nan")
    old, old_cpu = timed_put(store, old_put, old_mb * MB, "bench/old") if old_mb else (nan, nan)
    peak = peak_memory_mb(store, mb * MB)
    print(f"{'S3 put, 600-byte lines':<28}{'MB':>6}{'MB/s':>10}{'CPU s/64 MB':>14}")
    print(f"{'old (bytes += reader)':<28}{old_mb:>6}{old:>10.2f}{old_cpu:>14.2f}")
    print(f"{'new (streaming multipart)':<28}{mb:>6}{new:>10.2f}{new_cpu:>14.2f}")
    print(f"new/old: {new / old:.0f}x the speed, {old_cpu / new_cpu:.0f}x less CPU; new heap peak {peak:.1f} MB")
    print(
        f"finalize_put: old_mb_s={old:.2f} new_mb_s={new:.1f} ratio={new / old:.0f}"
        f" old_cpu_s={old_cpu:.2f} new_cpu_s={new_cpu:.2f} peak_heap_mb={peak:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=64, help="stream size for the new put (0 skips the put bench)")
    parser.add_argument("--old-mb", type=int, default=64, help="stream size for the old put (0 skips it)")
    parser.add_argument("--lines", type=int, default=0, help="also time finalize_batch on this many lines")
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), default="succeeded", help="; ".join(f"{k}: {v}" for k, v in SHAPES.items())
    )
    parser.add_argument("--ran", type=int, default=3000, help="lines that ran before an expired batch expired")
    parser.add_argument("--repeat", type=int, default=3, help="finalize_batch runs of each revision")
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="each run finalizes a batch of its own, just written and never read or vacuumed (as after a real run)",
    )
    parser.add_argument(
        "--before", default="HEAD", help="git revision of jobs/output/{finalize,pages}.py to compare with"
    )
    args = parser.parse_args()

    from backfill.devfleet.s3 import SeaweedS3

    with SeaweedS3() as s3:
        s3.create_bucket(BUCKET)
        store = S3ObjectStore(
            endpoint_url=s3.endpoint_url,
            bucket=BUCKET,
            access_key=s3.access_key,
            secret_key=s3.secret_key,
            region=s3.region,
        )
        if args.mb:
            bench_put(store, args.mb, args.old_mb)
        if args.lines:
            s3_server = [*(top := psutil.Process()).children(recursive=True)]  # weed, started by SeaweedS3
            assert top not in s3_server
            bench_finalize(
                store,
                args.lines,
                shape=args.shape,
                ran=args.ran,
                repeat=args.repeat,
                before=args.before,
                s3_server=s3_server,
                fresh=args.fresh,
            )


if __name__ == "__main__":
    main()
