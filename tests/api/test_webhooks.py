"""Webhook endpoints over HTTP (OpenAI's `/v1/webhook_endpoints` shapes), the Standard Webhooks
signature, and the outbox row written with a batch's terminal status, in-process on Postgres."""

from __future__ import annotations

import base64
import secrets
from collections.abc import Iterator
from datetime import UTC, datetime

import orjson
import pytest
from sqlalchemy import select
from standardwebhooks import Webhook

from backfill.api.wire import batch_id_in
from backfill.jobs.models import BatchStatus
from backfill.jobs.validation.outcome import fail_batch_validation
from backfill.jobs.webhooks.events import (
    MAX_ENDPOINTS_PER_TEAM,
    new_signing_secret,
    record_batch_event,
    sign,
    signature_header,
)
from backfill.jobs.webhooks.models import WebhookDelivery, WebhookEvent
from backfill.storage.db import unit_of_work
from backfill.storage.process_state import reset as reset_process_state
from tests.api.conftest import CheckedClient, Team
from tests.api.test_batches import create

# Nothing listens on the discard port: these tests never need a receiver.
NOWHERE = "http://127.0.0.1:9/hooks"


def new_endpoint(api: CheckedClient, team: Team, **extra: object) -> dict[str, object]:
    body = {"name": "ci", "url": NOWHERE, "event_types": ["batch.completed", "batch.failed"], **extra}
    r = api.post("/v1/webhook_endpoints", headers=team.headers, json=body)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_signature_reproduces_the_standard_webhooks_test_vector() -> None:
    # The spec's published vector: a receiver's library must verify exactly what we send.
    signature = sign(
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        msg_id="msg_p5jXN8AQM9LWM0D4loKWxJek",
        timestamp=1614265330,
        body=b'{"test": 2432232314}',
    )
    assert signature == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_signatures_verify_with_the_reference_library_for_every_active_secret() -> None:
    old, new = new_signing_secret(), new_signing_secret()
    assert old.startswith("whsec_") and len(base64.b64decode(old.removeprefix("whsec_"))) == 32
    body, msg_id, now = b'{"id": "evt_1", "type": "batch.completed"}', "evt_1", int(datetime.now(UTC).timestamp())
    header = signature_header([new, old], msg_id=msg_id, timestamp=now, body=body)
    headers = {"webhook-id": msg_id, "webhook-timestamp": str(now), "webhook-signature": header}
    for secret in (new, old):  # during a rotation's overlap either secret verifies
        assert Webhook(secret).verify(body, headers) == orjson.loads(body)
    with pytest.raises(Exception, match="No matching signature"):
        Webhook(new_signing_secret()).verify(body, headers)


def test_endpoint_lifecycle_shows_the_secret_only_at_creation_and_rotation(api: CheckedClient, team: Team) -> None:
    created = new_endpoint(api, team, event_types=["batch.failed", "batch.completed", "batch.failed"])
    assert str(created["id"]).startswith("wh_") and created["object"] == "webhook_endpoint"
    assert created["event_types"] == ["batch.completed", "batch.failed"]  # deduplicated, in a fixed order
    secret = str(created["signing_secret"])
    assert secret.startswith("whsec_") and created["signing_secret_hint"] == f"whsec_****{secret[-4:]}"
    path = f"/v1/webhook_endpoints/{created['id']}"

    read = api.get(path, headers=team.headers).json()
    assert "signing_secret" not in read and read == {k: v for k, v in created.items() if k != "signing_secret"}
    listed = api.get("/v1/webhook_endpoints", headers=team.headers).json()
    assert [e["id"] for e in listed["data"]] == [created["id"]] and listed["has_more"] is False

    updated = api.post(path, headers=team.headers, json={"url": "https://example.test/h", "name": "renamed"}).json()
    assert updated["url"] == "https://example.test/h" and updated["name"] == "renamed"
    assert updated["event_types"] == created["event_types"]

    rotated = api.post(f"{path}/rotate_secret", headers=team.headers, json={}).json()
    assert rotated["signing_secret"] not in (secret, None) and rotated["id"] == created["id"]

    deleted = api.delete(path, headers=team.headers).json()
    assert deleted == {"id": created["id"], "object": "webhook_endpoint.deleted", "deleted": True}
    assert api.get(path, headers=team.headers).status_code == 404


def test_another_team_sees_nothing(api: CheckedClient, team: Team, other_team: Team) -> None:
    created = new_endpoint(api, team)
    path = f"/v1/webhook_endpoints/{created['id']}"
    for method, url in (
        ("get", path),
        ("delete", path),
        ("get", f"{path}/deliveries"),
        ("post", f"{path}/rotate_secret"),
    ):
        r = api.request(method, url, headers=other_team.headers)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (method, url)
    assert api.get("/v1/webhook_endpoints", headers=other_team.headers).json()["data"] == []
    assert api.get(path, headers=team.headers).status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"url": "ftp://example.test/h"}, "url"),
        ({"url": "http://user:pw@example.test/h"}, "url"),
        ({"url": "http:///no-host"}, "url"),
        ({"event_types": []}, "event_types"),
        ({"event_types": ["batch.exploded"]}, "event_types"),
        ({"name": ""}, "name"),
    ],
)
def test_bad_endpoints_are_refused_with_the_param(
    api: CheckedClient, team: Team, body: dict[str, object], param: str
) -> None:
    full = {"name": "x", "url": NOWHERE, "event_types": ["batch.completed"], **body}
    r = api.post("/v1/webhook_endpoints", headers=team.headers, json=full)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text


def test_a_team_holds_a_bounded_number_of_endpoints(api: CheckedClient, team: Team) -> None:
    for _ in range(MAX_ENDPOINTS_PER_TEAM):
        new_endpoint(api, team)
    r = api.post(
        "/v1/webhook_endpoints",
        headers=team.headers,
        json={"name": "one more", "url": NOWHERE, "event_types": ["batch.completed"]},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_webhook_endpoints"


def test_event_types_are_openais_batch_events(api: CheckedClient, team: Team) -> None:
    listed = api.get("/v1/webhook_event_types", headers=team.headers).json()
    assert listed == {"object": "list", "data": ["batch.completed", "batch.failed", "batch.expired", "batch.cancelled"]}


def test_terminal_status_writes_one_outbox_event_in_its_own_transaction(
    api: CheckedClient, team: Team, other_team: Team
) -> None:
    failed_hook = new_endpoint(api, team, event_types=["batch.failed"])
    completed_hook = new_endpoint(api, team, event_types=["batch.completed"])
    new_endpoint(api, other_team, event_types=["batch.failed"])  # another team's: never told
    wire_id = str(create(api, team)["id"])
    batch_id = batch_id_in(wire_id)

    # Rolled back with the status change: no event without the terminal status.
    with pytest.raises(RuntimeError), unit_of_work() as session:
        fail_batch_validation(session, batch_id=batch_id, message="boom")
        raise RuntimeError("the transaction fails after the status change")
    with unit_of_work() as session:
        assert session.execute(select(WebhookEvent).where(WebhookEvent.batch_id == batch_id)).first() is None

    for _ in range(2):  # the second is a no-op: the batch is no longer validating
        with unit_of_work() as session:
            fail_batch_validation(session, batch_id=batch_id, message="boom")
    with unit_of_work() as session:
        assert record_batch_event(session, batch_id=batch_id, status=BatchStatus.failed) is None  # idempotent
        events = list(session.execute(select(WebhookEvent).where(WebhookEvent.batch_id == batch_id)).scalars())
        assert len(events) == 1
        deliveries = list(
            session.execute(select(WebhookDelivery).where(WebhookDelivery.event_id == events[0].id)).scalars()
        )
    body = orjson.loads(events[0].body)
    assert body == {
        "id": f"evt_{events[0].id}",
        "object": "event",
        "created_at": body["created_at"],
        "type": "batch.failed",
        "data": {"id": wire_id},
    }
    assert [d.endpoint_id for d in deliveries] == [str(failed_hook["id"]).removeprefix("wh_")]

    log = api.get(f"/v1/webhook_endpoints/{failed_hook['id']}/deliveries", headers=team.headers).json()
    (entry,) = log["data"]
    assert entry["event_id"] == body["id"] and entry["batch_id"] == wire_id and entry["event_type"] == "batch.failed"
    assert entry["status"] == "pending" and entry["object"] == "webhook_endpoint.delivery"
    empty = api.get(f"/v1/webhook_endpoints/{completed_hook['id']}/deliveries", headers=team.headers).json()
    assert empty["data"] == []


def test_no_endpoint_no_event(api: CheckedClient, team: Team) -> None:
    batch_id = batch_id_in(str(create(api, team)["id"]))
    with unit_of_work() as session:
        fail_batch_validation(session, batch_id=batch_id, message="boom")
    with unit_of_work() as session:
        assert session.execute(select(WebhookEvent).where(WebhookEvent.batch_id == batch_id)).first() is None


def test_unknown_ids_answer_404(api: CheckedClient, team: Team) -> None:
    for wire in ("wh_" + secrets.token_hex(8), "nope", "wh_"):
        r = api.get(f"/v1/webhook_endpoints/{wire}", headers=team.headers)
        assert r.status_code == 404, wire


@pytest.fixture
def production(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The API's settings as in production for one test (the package runs in development)."""

    monkeypatch.setenv("BACKFILL_ENVIRONMENT", "production")
    monkeypatch.setenv("BACKFILL_WEBHOOK_ALLOWED_HOSTS", "")
    reset_process_state()
    yield
    monkeypatch.undo()
    reset_process_state()


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:6379/",
        "http://2130706433:5432/",
        "http://0x7f000001/",
        "http://127.1/",
        "http://[::ffff:127.0.0.1]/",
        "http://169.254.169.254/latest/meta-data/",
        "http://metadata.google.internal/computeMetadata/v1/",
        "http://10.0.0.5:9000/",
        "http://localhost./",
    ],
)
def test_production_refuses_non_public_targets_with_a_400(
    api: CheckedClient, team: Team, production: None, url: str
) -> None:
    r = api.post(
        "/v1/webhook_endpoints", headers=team.headers, json={"name": "x", "url": url, "event_types": ["batch.failed"]}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "url",
        "webhook_url_not_allowed",
    )
    assert "public address" in error["message"]
    assert api.get("/v1/webhook_endpoints", headers=team.headers).json()["data"] == []


def test_production_refuses_moving_an_endpoint_to_a_private_target(
    api: CheckedClient, team: Team, production: None
) -> None:
    created = new_endpoint(api, team, url="https://93.184.215.14/hooks")  # a literal: nothing is resolved
    moved = api.post(f"/v1/webhook_endpoints/{created['id']}", headers=team.headers, json={"url": "http://0/"})
    assert moved.status_code == 400 and moved.json()["error"]["code"] == "webhook_url_not_allowed", moved.text
    kept = api.get(f"/v1/webhook_endpoints/{created['id']}", headers=team.headers).json()
    assert kept["url"] == "https://93.184.215.14/hooks"
