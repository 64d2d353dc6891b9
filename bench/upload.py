"""Upload: a large batch file sent through the Uploads API by the official SDK, then validated.

A generated JSONL batch file (2 GB by default) goes through `client.uploads.upload_file_chunked`
(the SDK's 64 MiB parts, one after another) into backfill's real processes on the production
adapters (Postgres, Redis, SeaweedFS over S3, a mocker fleet); a batch is then created from the
uploaded file and timed until its validation ends (the batch is cancelled then: running its lines
is another benchmark's subject). The API process and its children are sampled for RSS: a part
streams into the store, so the API never holds a part, let alone the file, in memory. The Celery
worker and its children are sampled from the batch's creation to its validation's end: validation
streams the file, so the process validating it never holds the file either.

    .venv/bin/python -m bench.upload                 # 2048 MB, 50,000 lines
    .venv/bin/python -m bench.upload --mb 256        # a smaller file where disk or time is short
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import psycopg

from bench.scale import ProcessSampler

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/8")
MODEL = "tiny-chat"
MB = 1024 * 1024
RSS_LIMIT_MB = 300


def write_input(path: Path, total_bytes: int, lines: int) -> int:
    """`lines` chat requests of distinct prompts, padded so the file is about `total_bytes`."""
    line_bytes = total_bytes // lines
    filler = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu " * (line_bytes // 60 + 2)
    with path.open("wb", buffering=8 * MB) as f:
        for i in range(lines):
            head = {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": ""}]},
            }
            room = max(8, line_bytes - len(json.dumps(head)) - 1 - len(str(i)) - 7)
            head["body"]["messages"][0]["content"] = f"item {i}: " + filler[i % 50 : i % 50 + room - 2]  # type: ignore[index]
            f.write(json.dumps(head).encode() + b"\n")
    return path.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=2048, help="size of the generated file, in MiB")
    ap.add_argument("--lines", type=int, default=50_000, help="lines of the file (OpenAI's per-batch limit)")
    args = ap.parse_args()

    def _stop(*_: object) -> None:
        raise KeyboardInterrupt  # so the finally blocks stop every process this run started

    signal.signal(signal.SIGTERM, _stop)

    import openai

    from backfill.devfleet.stack import launch_stack

    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        path = tmp / "upload.jsonl"
        size = write_input(path, args.mb * MB, args.lines)
        print(f"input: {args.lines} lines, {size / MB:.1f} MiB")
        settings = {
            "BACKFILL_CAPACITY_CONTROL": "off",
            "BACKFILL_MAX_UPLOAD_BYTES": str(max(size, 8 * 1024**3)),
            "BACKFILL_MAX_REQUESTS_PER_BATCH": str(max(args.lines, 50_000)),
            "BACKFILL_LOG_LEVEL": "WARNING",
        }
        with launch_stack(
            tmp / "stack",
            settings=settings,
            processes=("api", "worker", "scheduler"),
            fleet_speedup=0.0,
            model=MODEL,
            more_models=(),
            name="upload",
            redis_url=REDIS_URL,
            flush=True,
        ) as stack:
            client = openai.OpenAI(base_url=stack.base_url, api_key=stack.key, timeout=600, max_retries=0)
            api = ProcessSampler({"api": stack.procs["api"].pid})
            api.sample()
            api.start()
            start = time.perf_counter()
            upload = client.uploads.upload_file_chunked(file=path, mime_type="text/jsonl", purpose="batch")
            upload_s = time.perf_counter() - start
            assert upload.status == "completed" and upload.file is not None and upload.file.bytes == size, upload

            worker = ProcessSampler({"worker": stack.procs["worker"].pid})
            worker.sample()
            worker.start()
            start = time.perf_counter()
            batch = client.batches.create(
                input_file_id=upload.file.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            raw_id = batch.id.removeprefix("batch_")
            with psycopg.connect(stack.database_url.replace("+psycopg", ""), autocommit=True) as conn:
                status = "validating"
                while status == "validating":
                    time.sleep(0.05)
                    row = conn.execute("SELECT status FROM batches WHERE id = %s", (raw_id,)).fetchone()
                    status = str(row[0]) if row else status
            validate_s = time.perf_counter() - start
            worker.stop()
            api.stop()
            batch = client.batches.retrieve(batch.id)
            if status == "failed":
                raise RuntimeError(f"validation failed: {batch.errors}")
            client.batches.cancel(batch.id)
            total = batch.request_counts.total if batch.request_counts else 0

    peak = max(api.peak_rss.values()) / MB
    worker_peak = max(worker.peak_rss.values()) / MB  # the largest of the worker's processes
    load = max(api.loads)
    print(f"\n{'phase':<12}{'seconds':>10}{'MB/s':>10}")
    print(f"{'upload':<12}{upload_s:>10.1f}{size / MB / upload_s:>10.1f}")
    print(f"{'validation':<12}{validate_s:>10.1f}{size / MB / validate_s:>10.1f}")
    print(f"\nbatch: {total} lines valid; API peak RSS {peak:.0f} MB (limit {RSS_LIMIT_MB} MB)")
    print(
        f"validating worker: peak RSS {worker_peak:.0f} MB (limit {RSS_LIMIT_MB} MB), the largest of its "
        f"{len(worker.peak_rss)} processes"
    )
    print(f"load average (1 min): {api.loads[0]:.1f} at the start, {load:.1f} at most")
    print(
        f"upload: file_mb={size / MB:.0f} upload_mb_s={size / MB / upload_s:.1f} "
        f"validate_mb_s={size / MB / validate_s:.1f} api_peak_rss_mb={peak:.0f} worker_peak_rss_mb={worker_peak:.0f}"
    )
    for who, mb in (("API", peak), ("validating worker", worker_peak)):
        if mb > RSS_LIMIT_MB:
            raise SystemExit(f"the {who}'s peak RSS {mb:.0f} MB is over {RSS_LIMIT_MB} MB")


if __name__ == "__main__":
    main()
