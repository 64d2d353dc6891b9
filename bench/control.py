"""Control plane: what one batch line costs backfill itself, measured on a fleet that answers at once.

    .venv/bin/python -m bench.control                   # 20,000 lines of ~200 bytes, 500-token answers
    .venv/bin/python -m bench.control --lines 100000
    .venv/bin/python -m bench.control --answer-tokens 1     # the worst case for WAL: one-token answers

The real stack (API, worker, scheduler; `devfleet.stack.launch_stack`) runs on a private Postgres
cluster, a private Redis and SeaweedFS behind a request-counting proxy, against
`devfleet.instant_fleet` (an answer of `--answer-tokens` tokens, at once), so what is measured is
backfill's own: one batch is uploaded, validated, run, finalized, downloaded, and retention
(grace 0) deletes its line rows and rolls up its ledger. Over that whole life it measures:

- cpu_ms_per_line: user+system CPU of the API, worker (with its pool children) and scheduler;
- wal_bytes_per_line: Postgres WAL written (the cluster holds nothing else);
- result_bytes_per_line: the output file's size per line (what WAL is compared with);
- db_bytes_per_finished_line: the database's growth once retention has run (tables rewritten
  by VACUUM FULL before and after, so deleted rows' space does not count);
- rows_per_line: rows inserted, updated and deleted; redis_cmds_per_line; s3_requests_per_line.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path

import psycopg

from backfill.devfleet.instant_fleet import InstantFleet
from backfill.devfleet.processes import free_port
from backfill.devfleet.services import PostgresCluster
from backfill.devfleet.stack import BUCKET, launch_stack
from bench.control_probes import (
    CountedS3,
    CountingProxy,
    DbSnapshot,
    db_snapshot,
    redis_commands,
    table_bytes,
    wal_breakdown,
    wal_bytes,
)
from bench.scale import ProcessSampler, write_input

MODEL = "tiny-chat"
MB = 1024 * 1024
TERMINAL = ("completed", "failed", "expired", "cancelled")


def run_batch(base_url: str, key: str, path: Path, out_dir: Path) -> tuple[str, int, int]:
    """Upload, create, wait, download; returns the batch id, the output's bytes and lines."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=key, timeout=600, max_retries=2)
    with path.open("rb") as f:
        uploaded = client.files.create(file=(path.name, f), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    while batch.status not in TERMINAL:
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    if batch.status != "completed" or not batch.output_file_id:
        raise RuntimeError(f"batch ended {batch.status}: {batch.errors} {batch.request_counts}")
    target = out_dir / "output.jsonl"
    with client.files.with_streaming_response.content(batch.output_file_id) as response:
        response.stream_to_file(target)
    with target.open("rb") as fh:
        lines = sum(1 for _ in fh)
    return batch.id.removeprefix("batch_"), target.stat().st_size, lines


def wait_retained(db_url: str, batch_id: str, timeout_s: float = 300.0) -> float:
    """Wait until retention has deleted the batch's line rows and rolled up its ledger."""
    started = time.monotonic()
    with psycopg.connect(db_url.replace("+psycopg", ""), autocommit=True) as conn:
        while time.monotonic() - started < timeout_s:
            row = conn.execute(
                "SELECT bodies_purged_at IS NOT NULL AND ledger_rolled_up_at IS NOT NULL FROM batches WHERE id = %s",
                (batch_id,),
            ).fetchone()
            if row and row[0]:
                return time.monotonic() - started
            time.sleep(0.5)
    raise RuntimeError("retention did not remove the batch's line rows in time")


def rows_changed(before: DbSnapshot, after: DbSnapshot) -> int:
    return (after.inserted - before.inserted) + (after.updated - before.updated) + (after.deleted - before.deleted)


def print_tables(before: DbSnapshot, after: DbSnapshot, lines: int) -> None:
    print(f"\n{'table (per line)':<24}{'inserted':>10}{'updated':>10}{'HOT':>8}{'deleted':>10}")
    for table, (ins, upd, hot, dele) in sorted(after.tables.items()):
        b = before.tables.get(table, (0, 0, 0, 0))
        d = (ins - b[0], upd - b[1], hot - b[2], dele - b[3])
        if any(d):
            print(f"{table:<24}{d[0] / lines:>10.2f}{d[1] / lines:>10.2f}{d[2] / lines:>8.2f}{d[3] / lines:>10.2f}")


def print_cpu(sampler: ProcessSampler, before: dict[int, float], names: dict[int, str], lines: int) -> None:
    by_name: dict[str, float] = {}
    for pid, seconds in sampler.cpu.items():
        name = names.get(pid, "?")
        by_name[name] = by_name.get(name, 0.0) + seconds - before.get(pid, 0.0)
    print(f"\n{'process':<34}{'CPU s':>8}{'ms/line':>9}")
    for name, seconds in sorted(by_name.items(), key=lambda kv: -kv[1]):
        print(f"{name:<34}{seconds:>8.2f}{seconds * 1000 / lines:>9.3f}")


def process_names(sampler: ProcessSampler) -> dict[int, str]:
    """pid -> `root:kind` (a Celery pool child, a finalization subprocess...) for the breakdown."""
    import psutil

    names: dict[int, str] = {}
    for root, pid in sampler.roots.items():
        try:
            top = psutil.Process(pid)
            names[pid] = f"{root}:main"
            for child in top.children(recursive=True):
                names[child.pid] = f"{root}:child({child.name()[:14]})"
        except psutil.Error:
            continue
    return names


def answer_text(tokens: int) -> str:
    """A completion of `tokens` words drawn (seeded) from a small vocabulary, about as compressible
    as prose, so the database's compression of stored answers is neither flattered nor denied."""
    if tokens <= 1:
        return "ok"
    import random

    rng = random.Random(0)
    vocabulary = [
        "".join(rng.choice("etaoinshrdlucmfwypvbgkqjxz") for _ in range(rng.randint(2, 9))) for _ in range(2000)
    ]
    return " ".join(rng.choice(vocabulary) for _ in range(tokens))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=20_000)
    ap.add_argument("--line-bytes", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument(
        "--answer-tokens",
        type=int,
        default=500,
        # A line of the planned fleet is ~2K tokens, prompt and answer: 500 answer tokens is a
        # middling share; 1 is the worst case for WAL per result byte (the overhead is fixed).
        help="completion tokens of each answer (words of English-like text; 1: the fixed 'ok')",
    )
    args = ap.parse_args()

    def _stop(*_: object) -> None:
        raise KeyboardInterrupt  # so the finally blocks stop every process this run started

    signal.signal(signal.SIGTERM, _stop)
    n = args.lines
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        path = tmp / "control.jsonl"
        size = write_input(path, n, args.line_bytes)
        print(f"input: {n} lines, {size / MB:.1f} MB ({size / n:.0f} bytes a line)")
        cluster = PostgresCluster(port=free_port()).init()
        s3 = CountedS3()
        proxy: CountingProxy | None = None
        try:
            cluster.start()
            s3.__enter__()
            proxy = CountingProxy(upstream_port=int(s3.port or 0)).start()
            s3.proxy = proxy
            s3.create_bucket(BUCKET)
            settings = {
                "BACKFILL_MAX_INFLIGHT": str(args.concurrency),
                "BACKFILL_CAPACITY_CONTROL": "off",  # a fixed bound: backfill's machinery, not the controller
                "BACKFILL_MAX_FILE_BYTES": str(size + MB),
                "BACKFILL_MAX_REQUESTS_PER_BATCH": str(max(n, 50_000)),
                "BACKFILL_LOG_LEVEL": "WARNING",
                # Retention at once: the database's growth a finished batch leaves is measured.
                "BACKFILL_RESULT_BODY_RETENTION_S": "0",
                "BACKFILL_RETENTION_INTERVAL_S": "1",
            }
            with (
                InstantFleet(
                    model=MODEL, completion=answer_text(args.answer_tokens), completion_tokens=args.answer_tokens
                ) as fleet,
                launch_stack(
                    tmp / "stack",
                    settings=settings,
                    s3=s3,
                    fleet_url=fleet.base_url,
                    model=MODEL,
                    name="control",
                    pg_admin_url=cluster.admin_url,
                ) as stack,
            ):
                db_url, redis_url = stack.database_url, stack.redis_url
                time.sleep(2.0)  # the processes' start-up work is not the batch's
                base_bytes = table_bytes(db_url, compact=True)
                sampler = ProcessSampler({name: p.pid for name, p in stack.procs.items()})
                sampler.sample()
                cpu_before = dict(sampler.cpu)
                names = process_names(sampler)
                db_before, redis_before, s3_before = db_snapshot(db_url), redis_commands(redis_url), proxy.total
                s3_methods_before = dict(proxy.counts)
                sampler.start()
                started = time.monotonic()
                batch_id, result_bytes, result_lines = run_batch(stack.base_url, stack.key, path, tmp)
                run_s = time.monotonic() - started
                peak_bytes = sum(table_bytes(db_url).values()) - sum(base_bytes.values())
                retained_s = wait_retained(db_url, batch_id)
                names.update({k: v for k, v in process_names(sampler).items() if k not in names})
                sampler.stop()
                db_after, redis_after, s3_after = db_snapshot(db_url), redis_commands(redis_url), proxy.total
                left_bytes = sum(table_bytes(db_url, compact=True).values()) - sum(base_bytes.values())
                wal = wal_bytes(db_url, db_before, db_after)
                wal_kinds = wal_breakdown(db_url, db_before, db_after)
                fleet_requests = fleet.requests
        finally:
            if proxy is not None:
                proxy.stop()
            s3.__exit__(None, None, None)
            cluster.remove()

    assert result_lines == n, (result_lines, n)
    cpu_s = sampler.cpu_total() - sum(cpu_before.values())
    print(
        f"\nbatch ran in {run_s:.1f} s (upload to download), retention {retained_s:.1f} s after; {fleet_requests} fleet requests"
    )
    print_cpu(sampler, cpu_before, names, n)
    print_tables(db_before, db_after, n)
    print(f"\n{'WAL by kind (per line)':<24}{'records':>10}{'bytes':>10}{'of which FPI':>14}")
    for kind, count, nbytes, fpi in wal_kinds:
        print(f"{kind:<24}{count / n:>10.2f}{nbytes / n:>10.0f}{fpi / n:>14.0f}")
    s3_methods = {m: c - s3_methods_before.get(m, 0) for m, c in (proxy.counts if proxy else {}).items()}
    print(f"\nS3 requests by method: {s3_methods}")
    print(
        f"database growth while the batch's rows were there: {peak_bytes / MB:.1f} MB ({peak_bytes / n:.0f} bytes a line)"
    )
    loads = sampler.loads
    print(f"load average (1 min): mean {sum(loads) / len(loads):.1f}, max {max(loads):.1f} on {os.cpu_count()} CPUs")
    print(
        f"control: cpu_ms_per_line={cpu_s * 1000 / n:.2f} wal_bytes_per_line={wal / n:.0f} "
        f"result_bytes_per_line={result_bytes / n:.0f} db_bytes_per_finished_line={left_bytes / n:.1f} "
        f"redis_cmds_per_line={(redis_after - redis_before - 1) / n:.2f} "
        f"s3_requests_per_line={(s3_after - s3_before) / n:.4f} rows_per_line={rows_changed(db_before, db_after) / n:.2f}"
    )


if __name__ == "__main__":
    main()
