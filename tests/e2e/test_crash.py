"""A worker killed with SIGKILL mid-batch and restarted leaves exactly one line per request."""

from __future__ import annotations

import time

import openai
import pytest

from backfill.devfleet.stack import Stack
from tests.e2e.helpers import chat_line, jsonl, read_lines, upload, wait_for

pytestmark = pytest.mark.e2e


def test_sigkill_worker_mid_batch(client: openai.OpenAI, stack: Stack) -> None:
    lines = [chat_line(i, max_tokens=60) for i in range(1200)]
    f = upload(client, jsonl(lines))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 90
    while client.batches.retrieve(b.id).request_counts.completed < 100:
        assert time.monotonic() < deadline, "batch never got going"
        time.sleep(0.1)
    for _ in range(2):  # twice, to hit different phases
        stack.kill("worker")
        killed_at = client.batches.retrieve(b.id).request_counts.completed
        time.sleep(1.0)
        stack.start("worker")
        deadline = time.monotonic() + 90
        while client.batches.retrieve(b.id).request_counts.completed < killed_at + 150:
            if client.batches.retrieve(b.id).status != "in_progress":
                break
            assert time.monotonic() < deadline, "no progress after restart"
            time.sleep(0.1)
    done = wait_for(client, b.id, {"completed"}, timeout_s=240)
    out = read_lines(client, done.output_file_id)
    assert done.error_file_id is None, read_lines(client, done.error_file_id)[:3]
    ids = [o["custom_id"] for o in out]
    assert len(ids) == len(set(ids)) == 1200
    assert set(ids) == {line["custom_id"] for line in lines}
    assert done.request_counts.completed == 1200
    assert done.usage.output_tokens == 1200 * 60
