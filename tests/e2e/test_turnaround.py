"""A batch's steps wake each other: creating it enqueues its validation, validation's end starts a
drain, and the last recorded line starts its finalization. The scheduler's tick is only the
safety net, so with no scheduler running at all a small batch still goes from created to
completed, on the production adapters (Postgres, Redis as broker) and on the embedded ones
(SQLite, Celery's filesystem broker, a local object directory)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from backfill.devfleet.instant_fleet import InstantFleet
from backfill.devfleet.s3 import SeaweedS3
from backfill.devfleet.stack import Stack, launch_stack
from backfill.storage.leases import RedisLeaseStore
from tests.e2e.helpers import chat_line, jsonl, read_lines, upload, wait_for

pytestmark = pytest.mark.e2e

LEASE_TTL_S = 3.0
# What the embedded mode leaves unset (each falls back to its embedded default).
EMBEDDED = {
    "BACKFILL_DATABASE_URL": "",
    "BACKFILL_BROKER_URL": "",
    "BACKFILL_REDIS_URL": "",
    "BACKFILL_S3_ENDPOINT_URL": "",
}


@pytest.fixture(scope="module")
def instant_fleet() -> Iterator[InstantFleet]:
    with InstantFleet(model="tiny-chat") as fleet:
        yield fleet


@pytest.fixture(params=["production", "embedded"])
def no_scheduler(
    request: pytest.FixtureRequest, instant_fleet: InstantFleet, s3: SeaweedS3, tmp_path: Path
) -> Iterator[Stack]:
    """The API and a worker, and no scheduler: nothing ticks."""
    settings = {
        "BACKFILL_CAPACITY_CONTROL": "off",
        "BACKFILL_LEASE_TTL_S": str(LEASE_TTL_S),
        **(EMBEDDED if request.param == "embedded" else {}),
    }
    with launch_stack(
        tmp_path, settings=settings, processes=(), s3=s3, fleet_url=instant_fleet.base_url, name="wakeups"
    ) as stack:
        if request.param == "embedded":
            migrated = subprocess.run(
                [sys.executable, "-m", "backfill", "migrate"], env=stack.env, capture_output=True, text=True
            )
            assert migrated.returncode == 0, migrated.stdout + migrated.stderr
        else:
            # A Redis first used takes no leases for a TTL (it may have lost holders' data): the
            # scheduler, first to use it in a deployment, is not here to spend that time.
            RedisLeaseStore(stack.redis_url).acquire("first-use", limit=1, n=1, ttl_s=1.0, settle=False)
            time.sleep(LEASE_TTL_S)
        for process in ("api", "worker"):
            stack.start(process)
        stack.wait_healthy()
        yield stack


def test_small_batches_complete_with_no_scheduler_ticking(no_scheduler: Stack) -> None:
    client = openai.OpenAI(base_url=no_scheduler.base_url, api_key=no_scheduler.key, max_retries=0, timeout=60)
    for n in range(3):  # one after another, as an RL submitter sends them
        lines = [chat_line(i, prefix=f"round {n} ") for i in range(10)]
        f = upload(client, jsonl(lines))
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        done = wait_for(client, b.id, {"completed", "failed", "expired", "cancelled"}, timeout_s=60)
        assert done.status == "completed", (done.status, done.errors, no_scheduler.log("worker")[-3000:])
        out = read_lines(client, done.output_file_id)
        assert sorted(o["custom_id"] for o in out) == sorted(line["custom_id"] for line in lines)
    assert "scheduler" not in no_scheduler.procs and os.path.exists(no_scheduler.logdir / "worker.log")
