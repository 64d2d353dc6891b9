"""A production `backfill worker` (Postgres, Redis broker, S3), told twice to stop while its drains
hold requests in flight, as a process manager repeating its SIGTERM does: it and its pool are
gone within the drains' grace plus a margin, and a new worker finishes the batch with no line
lost or written twice."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import openai
import psutil
import pytest

from backfill.devfleet.fleet import Fleet
from backfill.devfleet.s3 import SeaweedS3
from backfill.devfleet.stack import launch_stack
from tests.e2e.helpers import chat_line, jsonl, read_lines, upload, wait_for, wait_until

pytestmark = pytest.mark.e2e

GRACE_S = 5.0
MARGIN_S = 10.0  # the drains' give-back, the pool's exit, a loaded machine


def test_a_worker_sent_sigterm_twice_mid_drain_exits_within_its_grace(
    tmp_path: Path, s3: SeaweedS3, fleet: Fleet
) -> None:
    settings = {"BACKFILL_DRAIN_GRACE_S": str(GRACE_S), "BACKFILL_MAX_INFLIGHT": "8", "BACKFILL_LEASE_TTL_S": "3"}
    with launch_stack(tmp_path, settings=settings, s3=s3, fleet_url=fleet.base_url, name="workerstop") as stack:
        client = openai.OpenAI(base_url=stack.base_url, api_key=stack.key, max_retries=2, timeout=60)
        # Long lines: the drain still holds them when the signals come.
        lines = [chat_line(i, max_tokens=3000, prefix="worker-stop ") for i in range(6)]
        lines += [chat_line(100 + i, max_tokens=8, prefix="worker-stop short ") for i in range(20)]
        batch = client.batches.create(
            input_file_id=upload(client, jsonl(lines)).id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        wait_until(
            "a drain with requests in flight",
            lambda: "claimed" in stack.log("worker") or client.batches.retrieve(batch.id).request_counts.completed > 0,  # type: ignore[union-attr]
            timeout_s=120,
            every_s=0.2,
        )
        worker = psutil.Process(stack.procs["worker"].pid)
        tree = [worker, *worker.children(recursive=True)]
        assert len(tree) >= 2, "expected the worker's pool children"
        os.kill(worker.pid, signal.SIGTERM)
        time.sleep(1.0)
        os.kill(worker.pid, signal.SIGTERM)
        signalled = time.monotonic()
        _, alive = psutil.wait_procs(tree, timeout=GRACE_S + MARGIN_S)
        took = time.monotonic() - signalled
        assert not alive, f"still running {took:.1f} s after two SIGTERMs: {[p.pid for p in alive]}"
        stack.procs.pop("worker").wait(timeout=5)

        stack.start("worker")
        done = wait_for(client, batch.id, {"completed", "failed", "expired"}, timeout_s=240)
        assert done.status == "completed"
        got = [
            ln["custom_id"] for ln in read_lines(client, done.output_file_id) + read_lines(client, done.error_file_id)
        ]
        assert sorted(got) == sorted(ln["custom_id"] for ln in lines)
