"""`/metrics` on the API process adds up what the other processes counted: after a batch, the
worker's pool children's dispatch counters and fleet latencies, the ledger's tokens and cost
for the team (to the token, against the output file), and the validation and finalization
durations. Proof that the multiprocess collection works across real processes."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from backfill.devfleet.stack import Stack
from tests.e2e.helpers import MODEL, chat_line, jsonl, read_lines, upload, wait_for

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
LINES = 12


def _scrape(stack: Stack) -> dict[str, list[Sample]]:
    r = httpx.get(f"http://127.0.0.1:{stack.api_port}/metrics", timeout=30)
    assert r.status_code == 200, r.text
    return {f.name: f.samples for f in text_string_to_metric_families(r.text)}


def _value(samples: list[Sample], name: str | None = None, **labels: str) -> float:
    return sum(
        s.value
        for s in samples
        if (name is None or s.name == name) and all(s.labels.get(k) == v for k, v in labels.items())
    )


def _new_team(stack: Stack) -> tuple[str, str]:
    admin = {"Authorization": f"Bearer {stack.env['BACKFILL_ADMIN_API_KEY']}"}
    base = stack.base_url + "/organization"
    name = f"metrics-{secrets.token_hex(4)}"
    project = httpx.post(f"{base}/projects", headers=admin, json={"name": name}, timeout=30).json()
    key = httpx.post(f"{base}/projects/{project['id']}/api_keys", headers=admin, json={}, timeout=30).json()
    # A price of the 1h window only, so no other test's bill changes: $1/M in, $0.5/M cached, $2/M out.
    price = {"model": MODEL, "input": "1", "cached_input": "0.5", "output": "2", "completion_window": "1h"}
    assert httpx.post(f"{base}/prices", headers=admin, json=price, timeout=30).status_code == 200
    return name, key["value"]


def test_the_api_scrape_adds_up_every_process(stack: Stack) -> None:
    team, key = _new_team(stack)
    client = openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0, timeout=60)
    before = _scrape(stack)

    f = upload(client, jsonl([chat_line(i) for i in range(LINES)]))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
    done = wait_for(client, b.id, {"completed", "failed"})
    assert done.status == "completed", done.errors
    usage: list[dict[str, Any]] = [
        line["response"]["body"]["usage"] for line in read_lines(client, done.output_file_id)
    ]
    assert len(usage) == LINES
    after = _scrape(stack)

    # Drains run in the worker's pool children; the API process reads what they wrote.
    sent = _value(after["backfill_dispatched_requests"], code="200") - _value(
        before.get("backfill_dispatched_requests", []), code="200"
    )
    assert sent >= LINES
    latency = after["backfill_fleet_request_duration_seconds"]
    assert _value(latency, "backfill_fleet_request_duration_seconds_count") >= LINES
    assert _value(latency, "backfill_fleet_request_duration_seconds_bucket", le="+Inf") >= LINES

    # The ledger's counters for this team, to the token, against what the output file says.
    tokens = after["backfill_tokens"]
    prompt = sum(u["prompt_tokens"] for u in usage)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usage)
    completion = sum(u["completion_tokens"] for u in usage)
    assert _value(tokens, team=team, model=MODEL, kind="input") == prompt > 0
    assert _value(tokens, team=team, model=MODEL, kind="cached_input") == cached
    assert _value(tokens, team=team, model=MODEL, kind="output") == completion > 0
    bill = httpx.get(
        f"{stack.base_url}/organization/costs",
        headers={"Authorization": f"Bearer {key}"},
        params={"start_time": int(done.created_at) - 86400},
        timeout=30,
    ).json()
    billed = sum(r["amount"]["value"] for bucket in bill["data"] for r in bucket["results"])
    assert billed > 0
    assert _value(after["backfill_cost_usd"], team=team, model=MODEL) == pytest.approx(billed)

    # Validation and finalization ran in the worker too.
    validation = after["backfill_validation_duration_seconds"]
    assert _value(validation, "backfill_validation_duration_seconds_count", result="in_progress") >= 1
    finalization = after["backfill_finalization_duration_seconds"]
    assert _value(finalization, "backfill_finalization_duration_seconds_count", result="completed") >= 1
    # And the API's own requests, with the scrape-time gauges beside them.
    assert _value(after["backfill_http_requests"], method="POST", route="/v1/batches", status="200") >= 1
    assert _value(after["backfill_batches"], status="completed") >= 1
    assert json.dumps(sorted(after)).count("backfill_slo_") == 2
