"""Webhook delivery against a real receiving HTTP server, on a scratch database (SQLite and
Postgres) that no running scheduler reads: retries with backoff, one logical event, signatures
the reference verifier and OpenAI's SDK accept, the delivery log, giving up, a dead sender."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import openai
import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker
from standardwebhooks import Webhook

from backfill.jobs.models import BatchStatus, utcnow
from backfill.jobs.webhooks.events import (
    EVENT_TYPES,
    GIVE_UP_AFTER,
    HISTORY_KEPT,
    claim_due,
    create_endpoint,
    delete_endpoint,
    list_deliveries,
    record_attempt,
    record_batch_event,
)
from backfill.jobs.webhooks.models import DeliveryStatus, WebhookDelivery, WebhookEndpoint, WebhookEvent
from backfill.jobs.webhooks.targets import REFUSED, TargetPolicy
from backfill.scheduler.webhook_delivery import WebhookSender
from backfill.storage.process_state import reset as reset_process_state
from tests.factories import make_submitted_batch, make_team


@pytest.fixture(autouse=True)
def _development(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """These receivers listen on loopback, which development allows (production refuses it)."""

    monkeypatch.setenv("BACKFILL_ENVIRONMENT", "development")
    reset_process_state()
    yield
    monkeypatch.undo()
    reset_process_state()


@dataclass
class Receiver:
    """A real HTTP server answering each POST with the next scripted status (then 200)."""

    statuses: list[int]
    location: str | None = None  # sent with every answer (a redirect, when the status is 3xx)
    received: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    server: http.server.ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks"

    def __enter__(self) -> Receiver:
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                receiver.received.append(({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(receiver.statuses.pop(0) if receiver.statuses else 200)
                if receiver.location:
                    self.send_header("location", receiver.location)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.shutdown()
        self.server.server_close()


def _event(session: Session, url: str, status: BatchStatus = BatchStatus.completed) -> tuple[str, str]:
    """A team with an endpoint at `url` and a batch that just reached `status`: (secret, batch id)."""
    team = make_team(session)
    endpoint = create_endpoint(
        session,
        team_id=team.id,
        name="r",
        url=url,
        event_types=list(EVENT_TYPES),
        policy=TargetPolicy.of(["127.0.0.1/32"], allow_loopback=True),
    )
    batch = make_submitted_batch(session, team, status=status)
    assert record_batch_event(session, batch_id=batch.id, status=status) is not None
    return endpoint.secret, batch.id


def _delivery(db: sessionmaker[Session]) -> WebhookDelivery:
    with db.begin() as session:
        return session.execute(select(WebhookDelivery)).scalar_one()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver(statuses=[500]) as r:
        yield r


def test_a_failed_delivery_is_retried_with_backoff_and_lands_once(
    db: sessionmaker[Session],
    receiver: Receiver,
) -> None:
    with db.begin() as session:
        secret, batch_id = _event(session, receiver.url)
    sender = WebhookSender(units=db.begin)

    assert sender.deliver_due() == 1  # answered 500
    first = _delivery(db)
    assert first.status == DeliveryStatus.pending and first.attempts == 1 and first.last_status_code == 500
    assert first.next_attempt_at is not None and first.last_attempt_at is not None
    delay = (first.next_attempt_at - first.last_attempt_at).total_seconds()
    assert 5.0 <= delay <= 5.6, delay  # the first backoff step
    assert sender.deliver_due() == 0 and len(receiver.received) == 1  # not due yet

    with db.begin() as session:  # the backoff has passed
        session.execute(update(WebhookDelivery).values(next_attempt_at=utcnow()))
    assert sender.deliver_due() == 1  # answered 200
    assert sender.deliver_due() == 0

    done = _delivery(db)
    assert done.status == DeliveryStatus.delivered and done.attempts == 2 and done.next_attempt_at is None
    assert [a["status_code"] for a in done.history] == [500, 200] and done.delivered_at is not None

    # One logical event: both attempts carry the same id and bytes, each freshly signed.
    (h1, b1), (h2, b2) = receiver.received
    assert h1["webhook-id"] == h2["webhook-id"] and b1 == b2
    for headers, body in receiver.received:
        event = Webhook(secret).verify(body, headers)
        assert event == {
            "id": headers["webhook-id"],
            "object": "event",
            "created_at": event["created_at"],
            "type": "batch.completed",
            "data": {"id": f"batch_{batch_id}"},
        }
        assert headers["content-type"] == "application/json"
        # OpenAI's own SDK verifies and parses what we send.
        unwrapped = openai.OpenAI(api_key="unused").webhooks.unwrap(body, headers, secret=secret)
        assert unwrapped.type == "batch.completed" and unwrapped.data.id == f"batch_{batch_id}"

    with db.begin() as session:
        endpoint_id = session.execute(select(WebhookEndpoint.id)).scalar_one()
        team_id = session.execute(select(WebhookEndpoint.team_id)).scalar_one()
        ((logged, event),), has_more = list_deliveries(
            session, team_id=team_id, endpoint_id=endpoint_id, limit=10, after=None
        )
    assert not has_more and logged.attempts == 2 and event.type == "batch.completed"


def test_an_unreachable_endpoint_is_logged_and_retried(db: sessionmaker[Session]) -> None:
    with db.begin() as session:
        _event(session, "http://127.0.0.1:9/hooks", BatchStatus.failed)  # nothing listens there
    assert WebhookSender(units=db.begin).deliver_due() == 1
    row = _delivery(db)
    assert row.status == DeliveryStatus.pending and row.last_status_code is None
    assert row.last_error is not None and row.last_error.startswith("ConnectError")


def test_the_backoff_doubles_to_an_hour_and_gives_up_after_a_day(db: sessionmaker[Session]) -> None:
    with db.begin() as session:
        _event(session, "http://127.0.0.1:9/hooks")
        created = session.execute(select(WebhookEvent.created_at)).scalar_one()
    now, gaps = created, []
    for _ in range(100):
        with db.begin() as session:
            (due,) = claim_due(session, now=now)
            status = record_attempt(session, due=due, status_code=503, error=None, now=now)
        row = _delivery(db)
        if status == DeliveryStatus.failed:
            break
        assert row.next_attempt_at is not None
        gaps.append((row.next_attempt_at - now).total_seconds())
        now = row.next_attempt_at
    assert row.status == DeliveryStatus.failed and row.next_attempt_at is None
    assert 25 <= row.attempts <= 36, row.attempts
    assert timedelta(hours=22) < now - created <= GIVE_UP_AFTER
    assert 5.0 <= gaps[0] <= 5.5 and 10.0 <= gaps[1] <= 11.0 and 3600 <= max(gaps) <= 3960
    assert len(row.history) == HISTORY_KEPT  # the log is capped


def test_a_sender_that_dies_mid_attempt_only_delays_the_delivery(db: sessionmaker[Session]) -> None:
    with db.begin() as session:
        _event(session, "http://127.0.0.1:9/hooks")
    now = utcnow()
    with db.begin() as session:
        (lost,) = claim_due(session, now=now, hold_s=60)  # its sender never records
    with db.begin() as session:
        assert claim_due(session, now=now + timedelta(seconds=30)) == []  # still held
    with db.begin() as session:
        (again,) = claim_due(session, now=now + timedelta(seconds=61))
    assert again.msg_id == lost.msg_id and again.attempt == lost.attempt == 1
    with db.begin() as session:
        assert record_attempt(session, due=again, status_code=204, error=None) == DeliveryStatus.delivered
    with db.begin() as session:  # the first sender coming back late records nothing
        assert record_attempt(session, due=lost, status_code=500, error=None) is None
    assert _delivery(db).status == DeliveryStatus.delivered and _delivery(db).attempts == 1


def test_deleting_the_endpoint_drops_what_it_had_left_to_receive(db: sessionmaker[Session]) -> None:
    with db.begin() as session:
        _event(session, "http://127.0.0.1:9/hooks")
        endpoint = session.execute(select(WebhookEndpoint)).scalar_one()
        delete_endpoint(session, team_id=endpoint.team_id, endpoint_id=endpoint.id)
    with db.begin() as session:
        assert session.execute(select(WebhookDelivery)).first() is None
        assert claim_due(session, now=utcnow() + timedelta(days=1)) == []


def test_delivery_refuses_a_name_that_resolves_to_a_private_address_now(
    db: sessionmaker[Session], receiver: Receiver
) -> None:
    port = receiver.url.split(":")[2].split("/")[0]
    with db.begin() as session:  # registered while the name did not resolve (so it passed)
        _event(session, f"http://hooks.example:{port}/hooks")
    rebound = WebhookSender(units=db.begin, policy=TargetPolicy(), resolve=lambda host, port: ["127.0.0.1"])
    assert rebound.deliver_due() == 1
    row = _delivery(db)
    # Refused, and nothing about what the network said: no status, no connection error.
    assert (row.status, row.last_status_code, row.last_error) == (DeliveryStatus.pending, None, REFUSED)
    assert receiver.received == []


def test_delivery_in_production_refuses_loopback_unless_allow_listed(
    db: sessionmaker[Session], receiver: Receiver
) -> None:
    with db.begin() as session:
        _event(session, receiver.url.replace("127.0.0.1", "localhost"))
    assert WebhookSender(units=db.begin, policy=TargetPolicy()).deliver_due() == 1  # the real resolver
    assert _delivery(db).last_error == REFUSED and receiver.received == []

    with db.begin() as session:
        session.execute(update(WebhookDelivery).values(next_attempt_at=utcnow()))
    allowed = WebhookSender(units=db.begin, policy=TargetPolicy.of(["localhost"]))
    assert allowed.deliver_due() == 1
    row = _delivery(db)
    assert row.last_status_code == 500 and len(receiver.received) == 1  # the receiver's scripted 500
    assert receiver.received[0][0]["host"] == receiver.url.split("/")[2].replace("127.0.0.1", "localhost")


def test_a_redirect_is_never_followed(db: sessionmaker[Session]) -> None:
    with Receiver(statuses=[]) as second, Receiver(statuses=[302], location="") as first:
        first.location = second.url
        with db.begin() as session:
            _event(session, first.url)
        assert WebhookSender(units=db.begin, policy=TargetPolicy.of(["127.0.0.1/32"])).deliver_due() == 1
    row = _delivery(db)
    assert (row.status, row.last_status_code) == (DeliveryStatus.pending, 302)  # not delivered: retried later
    assert len(first.received) == 1 and second.received == []


class Trickler:
    """A receiver that reads the POST, then sends its answer's headers a byte at a time, each
    byte well inside the read timeout, for `seconds` in all: per-operation timeouts never end it."""

    def __init__(self, seconds: float) -> None:
        import socket

        self.seconds = seconds
        self.finished = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hooks"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import time

        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.recv(65536)
            header = b"HTTP/1.1 200 OK\r\nx-slow: " + b"a" * int(self.seconds / 0.25) + b"\r\ncontent-length: 0\r\n\r\n"
            try:
                for i in range(len(header)):
                    conn.sendall(header[i : i + 1])
                    if header[i : i + 1] == b"a":
                        time.sleep(0.25)
            except OSError:
                return  # the sender gave up on it
            self.finished.set()

    def close(self) -> None:
        self.sock.close()


def test_a_trickling_receiver_is_cut_at_the_deadline_and_holds_back_no_other_delivery(
    db: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One team's receiver trickles its answer's headers (a byte every quarter second, for 30 s);
    another team's answers at once. The other team's delivery is recorded while the slow one is
    still being sent, and the slow one ends at the delivery's deadline as a timeout, long before
    the receiver would have finished."""
    from backfill.scheduler import webhook_delivery
    from tests.e2e.helpers import wait_until

    monkeypatch.setattr(webhook_delivery, "DEADLINE_S", 3.0)
    slow = Trickler(seconds=30)
    try:
        with Receiver(statuses=[]) as fast:
            with db.begin() as session:
                _event(session, slow.url)
                _event(session, fast.url)
            with db.begin() as session:
                slow_id, fast_id = (
                    session.execute(
                        select(WebhookDelivery.id).join(WebhookEndpoint).where(WebhookEndpoint.url == url)
                    ).scalar_one()
                    for url in (slow.url, fast.url)
                )

            def delivery(delivery_id: str) -> WebhookDelivery:
                with db.begin() as session:
                    row = session.get(WebhookDelivery, delivery_id)
                    assert row is not None
                    return row

            sender = WebhookSender(units=db.begin)
            passing = threading.Thread(target=sender.deliver_due)
            passing.start()
            wait_until(
                "the fast receiver's delivery recorded",
                lambda: delivery(fast_id).status == DeliveryStatus.delivered,
                timeout_s=60,
                every_s=0.05,
            )
            assert delivery(slow_id).attempts == 0, "the fast delivery waited for the slow one"
            passing.join(timeout=60)
        slow_row = delivery(slow_id)
        assert slow_row.attempts == 1 and slow_row.status == DeliveryStatus.pending
        assert slow_row.last_status_code is None and "Timeout" in (slow_row.last_error or ""), slow_row.last_error
        assert not slow.finished.is_set(), "the receiver trickled its whole answer: no deadline held it"
    finally:
        slow.close()
