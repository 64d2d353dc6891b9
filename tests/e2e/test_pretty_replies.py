"""A fleet whose replies span several lines (pretty-printed JSON ending in a newline, as some
engines and proxies write it): the batch's output file still holds exactly one line per
request, each a JSON object. A result line embeds the stored body as it is, so the fleet's own
line breaks used to split result lines in two.

backfill runs as real processes on a database and a Redis of their own, reaching the session's
fleet through a fault proxy that pretty-prints every reply."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from backfill.devfleet.faultproxy import Fault, FaultProxy
from backfill.devfleet.stack import Stack, launch_stack
from tests.e2e.helpers import chat_line, jsonl, upload, wait_for

pytestmark = pytest.mark.e2e

LINES = 8
TERMINAL = {"completed", "failed", "expired", "cancelled"}


@pytest.fixture(scope="module")
def pretty_proxy(fleet: Any) -> Iterator[FaultProxy]:
    with FaultProxy(fleet.origin) as proxy:
        proxy.inject(Fault.pretty, for_s=3600.0)
        yield proxy


@pytest.fixture(scope="module")
def pretty_stack(pretty_proxy: FaultProxy, s3: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir: Path = tmp_path_factory.mktemp("pretty")
    settings = {"BACKFILL_TICK_INTERVAL_S": "0.5", "BACKFILL_DRAIN_SLICE_S": "10"}
    with launch_stack(workdir, s3=s3, fleet_url=pretty_proxy.base_url, name="pretty", settings=settings) as stack:
        yield stack


def test_pretty_printed_replies_keep_one_output_line_per_request(pretty_stack: Stack, pretty_proxy: FaultProxy) -> None:
    client = openai.OpenAI(base_url=pretty_stack.base_url, api_key=pretty_stack.key, max_retries=0, timeout=60)
    lines = [chat_line(i, max_tokens=24) for i in range(LINES)]
    batch = client.batches.create(
        input_file_id=upload(client, jsonl(lines)).id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_for(client, batch.id, TERMINAL, timeout_s=240)
    assert done.status == "completed", done
    assert done.request_counts is not None and done.request_counts.completed == LINES, done.request_counts
    assert pretty_proxy.stats.get("pretty", 0) >= LINES  # the fleet's replies really were pretty-printed

    assert done.output_file_id is not None
    raw = client.files.content(done.output_file_id).content
    rows = raw.split(b"\n")
    assert rows[-1] == b"", "the output file ends with a newline"
    assert len(rows) - 1 == LINES, f"{len(rows) - 1} lines for {LINES} requests:\n{raw[:2000]!r}"
    results = [json.loads(row) for row in rows[:-1]]
    assert sorted(r["custom_id"] for r in results) == sorted(line["custom_id"] for line in lines)
    for r in results:
        assert r["response"]["status_code"] == 200 and r["response"]["body"]["choices"], r
