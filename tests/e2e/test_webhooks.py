"""Webhooks end to end: an endpoint registered with the OpenAI SDK's `client.webhooks.create`,
batches that complete and fail on the real stack, and a real receiving HTTP server that fails
each event's first delivery (500): every event arrives, is retried once after the backoff,
verifies with the Standard Webhooks reference library and OpenAI's SDK, and the team's
delivery log shows both attempts."""

from __future__ import annotations

import http.server
import secrets
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from standardwebhooks import Webhook

from backfill.devfleet.stack import Stack
from tests.e2e.helpers import chat_line, jsonl, upload, wait_for

pytestmark = pytest.mark.e2e


class FlakyReceiver:
    """Answers 500 to the first delivery of each webhook-id, 200 to the rest."""

    def __init__(self) -> None:
        self.received: list[tuple[dict[str, str], bytes]] = []
        self.seen: Counter[str] = Counter()
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                headers = {k.lower(): v for k, v in self.headers.items()}
                with receiver.lock:
                    receiver.received.append((headers, body))
                    receiver.seen[headers.get("webhook-id", "")] += 1
                    first = receiver.seen[headers.get("webhook-id", "")] == 1
                self.send_response(500 if first else 200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/openai-webhooks"

    def events(self, secret: str) -> dict[str, list[dict[str, Any]]]:
        """Verified events by webhook-id, one entry per delivery; raises on a bad signature."""
        with self.lock:
            received = list(self.received)
        out: dict[str, list[dict[str, Any]]] = {}
        for headers, body in received:
            out.setdefault(headers["webhook-id"], []).append(Webhook(secret).verify(body, headers))
        return out


@pytest.fixture
def receiver() -> Iterator[FlakyReceiver]:
    r = FlakyReceiver()
    threading.Thread(target=r.server.serve_forever, daemon=True).start()
    try:
        yield r
    finally:
        r.server.shutdown()
        r.server.server_close()


def _new_team_client(stack: Stack) -> openai.OpenAI:
    """A team of its own, so no other test's batch ever notifies this endpoint."""
    admin = {"Authorization": f"Bearer {stack.env['BACKFILL_ADMIN_API_KEY']}"}
    project = httpx.post(
        f"{stack.base_url}/organization/projects", headers=admin, json={"name": f"hooks-{secrets.token_hex(4)}"}
    ).json()
    key = httpx.post(f"{stack.base_url}/organization/projects/{project['id']}/api_keys", headers=admin, json={}).json()
    return openai.OpenAI(base_url=stack.base_url, api_key=key["value"], max_retries=0, timeout=60)


def test_batch_events_are_signed_retried_and_logged(stack: Stack, receiver: FlakyReceiver) -> None:
    client = _new_team_client(stack)
    hook = client.webhooks.create(name="ci", url=receiver.url, event_types=["batch.completed", "batch.failed"])
    assert hook.id.startswith("wh_") and hook.signing_secret.startswith("whsec_")

    good = client.batches.create(
        input_file_id=upload(client, jsonl([chat_line(i) for i in range(5)])).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    bad = client.batches.create(
        input_file_id=upload(client, b'{"custom_id": "x", not json}\n').id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    assert wait_for(client, good.id, {"completed", "failed", "expired", "cancelled"}).status == "completed"
    assert wait_for(client, bad.id, {"completed", "failed", "expired", "cancelled"}).status == "failed"

    deadline = time.monotonic() + 60  # the first retry comes 5 s after each 500
    events = receiver.events(hook.signing_secret)
    while time.monotonic() < deadline and not (len(events) == 2 and all(len(v) == 2 for v in events.values())):
        time.sleep(0.5)
        events = receiver.events(hook.signing_secret)

    # Two logical events, each delivered twice (the 500, then the retry), the same bytes each time.
    assert sorted((v[0]["type"], v[0]["data"]["id"]) for v in events.values()) == sorted(
        [("batch.completed", good.id), ("batch.failed", bad.id)]
    )
    for event_id, deliveries in events.items():
        assert len(deliveries) == 2 and deliveries[0] == deliveries[1]
        assert deliveries[0]["id"] == event_id and event_id.startswith("evt_") and deliveries[0]["object"] == "event"
    for headers, body in receiver.received:  # OpenAI's SDK accepts them as its own webhooks
        unwrapped = client.webhooks.unwrap(body, headers, secret=hook.signing_secret)
        assert unwrapped.id == headers["webhook-id"] and unwrapped.type in ("batch.completed", "batch.failed")

    log = httpx.get(
        f"{stack.base_url}/webhook_endpoints/{hook.id}/deliveries",
        headers={"Authorization": f"Bearer {client.api_key}"},
    ).json()
    assert {d["batch_id"] for d in log["data"]} == {good.id, bad.id}
    for d in log["data"]:
        assert d["status"] == "delivered" and d["attempts"] == 2 and d["next_attempt_at"] is None
        assert [a["status_code"] for a in d["history"]] == [500, 200]
        assert d["history"][1]["at"] - d["history"][0]["at"] >= 4  # the backoff, give or take a second


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",
        "http://10.0.0.5:5432/",
        "http://0x0a000005/",
        "http://localhost:6379/",
    ],
)
def test_the_production_stack_refuses_private_targets(stack: Stack, url: str) -> None:
    """The stack runs as production with only 127.0.0.1 allow-listed: other internal targets,
    and loopback under other names or spellings, are refused when registered."""
    client = _new_team_client(stack)
    with pytest.raises(openai.BadRequestError) as refused:
        client.webhooks.create(name="ssrf", url=url, event_types=["batch.completed"])
    assert refused.value.code == "webhook_url_not_allowed"
