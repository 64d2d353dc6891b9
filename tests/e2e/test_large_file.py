"""A large input file through the real worker: validated by several processes started from a
Celery pool process (which multiprocessing would refuse as a daemon), each reading its range
from SeaweedFS; the batch runs with every line indexed, and a custom_id repeated across the
ranges is reported at its later line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from backfill.devfleet.fleet import Fleet
from backfill.devfleet.s3 import SeaweedS3
from backfill.devfleet.stack import Stack, launch_stack
from tests.e2e.helpers import MODEL, wait_for

LINES = 180_000  # ~36 MB: past the 32 MB at which validation spreads over processes
# Every status a batch can take once validation is over, one way or the other.
VALIDATED = {"failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"}


@pytest.fixture(scope="module")
def big_stack(redis_url: str, s3: SeaweedS3, fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = {
        "BACKFILL_MAX_FILE_BYTES": str(64 * 1024 * 1024),
        "BACKFILL_MAX_REQUESTS_PER_BATCH": str(2 * LINES),
        "BACKFILL_VALIDATION_PROCESSES": "2",
        "BACKFILL_MAX_INFLIGHT": "4",
    }
    with launch_stack(
        tmp_path_factory.mktemp("large"),
        settings=settings,
        processes=("api", "worker"),
        s3=s3,
        fleet_url=fleet.base_url,
        name="large",
        redis_url=redis_url.rsplit("/", 1)[0] + "/7",  # a broker of its own: not the session stack's
    ) as s:
        yield s


def _file(path: Path, repeat_at: int | None = None) -> Path:
    with path.open("wb") as f:
        for i in range(LINES):
            custom_id = f"r{0 if i == repeat_at else i}"
            body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": f"q{i} " + "w" * 120}]}
            f.write(
                json.dumps(
                    {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
                ).encode()
                + b"\n"
            )
    return path


def test_a_large_file_is_validated_on_several_processes(big_stack: Stack, tmp_path: Path) -> None:
    client = openai.OpenAI(base_url=big_stack.base_url, api_key=big_stack.key, max_retries=0, timeout=120)
    with _file(tmp_path / "big.jsonl").open("rb") as f:
        uploaded = client.files.create(file=f, purpose="batch")
    assert uploaded.bytes > 32 * 1024 * 1024
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = wait_for(client, batch.id, VALIDATED)
    assert batch.status == "in_progress", batch.errors
    assert batch.request_counts is not None and batch.request_counts.total == LINES
    log = (big_stack.logdir / "worker.log").read_text()
    assert f"{LINES} requests, 0 errors" in log and "on 2 processes" in log, log[-3000:]
    client.batches.cancel(batch.id)

    # The same file with line 150,001 repeating line 1's custom_id: only another range sees both.
    with _file(tmp_path / "dup.jsonl", repeat_at=150_000).open("rb") as f:
        uploaded = client.files.create(file=f, purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = wait_for(client, batch.id, VALIDATED)
    assert batch.status == "failed"
    assert batch.errors is not None and batch.errors.data is not None
    assert [(e.code, e.line) for e in batch.errors.data] == [("duplicate_custom_id", 150_001)]
