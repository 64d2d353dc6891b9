"""Sends due webhook deliveries: claim in one short transaction, POST outside any transaction,
record each outcome in another (see `jobs.webhooks.events` for the state machine and the backoff).

The scheduler loop calls `deliver_in_background()` every tick; one pass at a time runs in a
thread of its own, so a slow or silent receiver never holds up the loop. Within a pass each
delivery is claimed, sent and recorded on its own, SENDERS at a time: a slow receiver holds one
sender, never the others. Each POST has one overall deadline (`DEADLINE_S`, well under the
claim's hold), however its receiver trickles its answer, and starts only while its claim is
fresh enough for that (`SEND_WITHIN_S`: a sender frozen after its claim sends nothing). At
least once: a sender that dies between the POST and the record leaves the delivery claimed for
a minute, after which it is sent again with the same `webhook-id`, which receivers deduplicate
on.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import httpcore
import httpx

from backfill.jobs.webhooks.events import DueDelivery, claim_due, record_attempt, signature_header
from backfill.jobs.webhooks.targets import REFUSED, Address, Resolver, TargetPolicy, TargetRefused, system_resolver
from backfill.storage.db import UnitOfWork, unit_of_work
from backfill.storage.settings import get_settings

log = logging.getLogger("backfill.webhooks")


USER_AGENT = "backfill-webhooks/0.1"
CLAIM_PER_ROUND = 32
SENDERS = 8
# How long a claimed delivery is held before another sender may take it: past every timeout.
HOLD_S = 60.0
# One POST, from connecting to the answer's status, however slowly the receiver trickles it:
# well under HOLD_S, so no delivery is still being sent when another sender may claim it.
DEADLINE_S = 20.0
# A claimed delivery is sent only this soon after its claim, so that it is answered (DEADLINE_S)
# before its hold ends, less a margin for the replicas' clocks: a sender paused between claiming
# and sending (a scheduler frozen past its lease, then resumed) leaves the delivery to the next
# claim rather than sending it while the new leader's round may be sending it too.
SEND_WITHIN_S = HOLD_S - DEADLINE_S - 10.0
# One pass stops after this many rounds' worth of deliveries even if more keep falling due; the
# next tick goes on.
MAX_ROUNDS = 20


class WebhookSender:
    def __init__(
        self,
        *,
        units: UnitOfWork = unit_of_work,
        policy: TargetPolicy | None = None,
        resolve: Resolver = system_resolver,
    ) -> None:
        self.units = units
        self.poster = PinnedPoster(
            policy or TargetPolicy.from_settings(get_settings()), resolve=resolve, user_agent=USER_AGENT
        )

    def send(self, due: DueDelivery) -> tuple[int | None, str | None]:
        """One POST: (status code, None) when the receiver answered, (None, why) when not. A
        refused target is logged as refused and nothing more: what the network said about an
        address a team may not reach is not theirs to read."""
        timestamp = int(time.time())
        headers = {
            "content-type": "application/json",
            "webhook-id": due.msg_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": signature_header(due.secrets, msg_id=due.msg_id, timestamp=timestamp, body=due.body),
        }
        try:
            return self.poster.post(due.url, body=due.body, headers=headers), None
        except TargetRefused:
            return None, REFUSED
        except OSError:  # the name does not resolve (getaddrinfo's own error)
            return None, "ConnectError: the host name does not resolve"
        except (httpcore.TimeoutException, httpcore.NetworkError, httpcore.ProtocolError) as exc:
            return None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        except (httpx.InvalidURL, KeyError, UnicodeError):
            return None, "InvalidURL"

    def deliver(self, item: DueDelivery, *, claimed_at: float | None = None) -> None:
        """Send one claimed delivery and record its outcome at once (not after the others'); not
        if it was claimed (`time.monotonic()` before the claim) longer than SEND_WITHIN_S ago."""
        if claimed_at is not None and (held_s := time.monotonic() - claimed_at) > SEND_WITHIN_S:
            log.warning(
                "webhook delivery %s claimed %.0f s ago, too late to send within its hold: left to the next claim",
                item.delivery_id,
                held_s,
            )
            return
        status_code, error = self.send(item)
        with self.units() as session:
            status = record_attempt(session, due=item, status_code=status_code, error=error)
        if status == "failed":
            log.warning("webhook delivery %s to %s gave up after %d attempts", item.delivery_id, item.url, item.attempt)

    def deliver_due(self) -> int:
        """Send what is due, SENDERS at a time, claiming more as senders free up (a slow receiver
        holds its own sender only); returns how many were sent."""
        total, budget = 0, MAX_ROUNDS * CLAIM_PER_ROUND
        running: set[Future[None]] = set()
        more = True
        with ThreadPoolExecutor(max_workers=SENDERS, thread_name_prefix="webhook") as pool:
            while True:
                room = min(SENDERS - len(running), budget - total)
                if more and room > 0:
                    claimed_at = time.monotonic()
                    with self.units() as session:
                        due = claim_due(session, limit=room, hold_s=HOLD_S)
                    more = len(due) == room  # fewer: nothing else is due now
                    total += len(due)
                    running |= {pool.submit(self.deliver, item, claimed_at=claimed_at) for item in due}
                if not running:
                    return total
                finished, running = wait(running, return_when=FIRST_COMPLETED)
                for f in finished:
                    if f.exception() is not None:
                        log.error("webhook delivery failed", exc_info=f.exception())


class BackgroundDelivery:
    """At most one delivery pass at a time, each in a daemon thread."""

    def __init__(self, sender_factory: Callable[[], WebhookSender] = WebhookSender) -> None:
        self._sender_factory = sender_factory
        self._sender: WebhookSender | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def kick(self) -> bool:
        """Start a pass unless one is running; returns whether one was started."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return False
            if self._sender is None:
                self._sender = self._sender_factory()
            self._thread = threading.Thread(target=self._run, args=(self._sender,), name="webhooks", daemon=True)
            self._thread.start()
            return True

    @staticmethod
    def _run(sender: WebhookSender) -> None:
        try:
            sender.deliver_due()
        except Exception:
            log.exception("webhook delivery pass failed")

    def join(self, timeout_s: float | None = None) -> None:
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)


_background = BackgroundDelivery()


def deliver_in_background() -> None:
    """The scheduler loop's one call: send what is due without waiting for it."""
    _background.kick()


# One HTTP POST to a webhook target, connected to the address its check let through.
#
# The check (`jobs.webhooks.targets`) resolves the host and approves every address; if the
# connection then resolved the name again, a DNS answer that changed in between (rebinding) would
# send the request somewhere never checked. So the connection goes to the approved address,
# through an httpcore network backend that knows that one host and its one address, while the
# request keeps its own Host header and, for https, its SNI and certificate check against the
# host name. No redirect is followed (httpcore never follows one) and no proxy from the
# environment is used.

# A receiver gets this long to answer; its body is never read (only the status counts).
TIMEOUTS = {"connect": 5.0, "read": 10.0, "write": 10.0, "pool": 10.0}
_DEFAULT_PORTS = {"http": 80, "https": 443}


class DeadlineStream(httpcore.NetworkStream):
    """A connection whose every read and write ends by one deadline: per-operation timeouts
    alone let a receiver that sends a byte every few seconds hold a POST for as long as it likes."""

    def __init__(self, inner: httpcore.NetworkStream, deadline: float) -> None:
        self.inner, self.deadline = inner, deadline

    def _left(self, timeout: float | None, error: type[Exception]) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise error("the delivery's deadline passed")
        return left if timeout is None else min(timeout, left)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self.inner.read(max_bytes, self._left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.inner.write(buffer, self._left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self.inner.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        inner = self.inner.start_tls(ssl_context, server_hostname, self._left(timeout, httpcore.ConnectTimeout))
        return DeadlineStream(inner, self.deadline)

    def get_extra_info(self, info: str) -> object:
        return self.inner.get_extra_info(info)


class PinnedBackend(httpcore.NetworkBackend):
    """Connects `host` to `address` and refuses any other host; every connection ends by `deadline`
    (a `time.monotonic()` value)."""

    def __init__(self, host: str, address: Address, deadline: float = float("inf")) -> None:
        self.host, self.address, self.deadline = host, address, deadline
        self._inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        if host != self.host:
            raise httpcore.ConnectError("refused: not the checked host")
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise httpcore.ConnectTimeout("the delivery's deadline passed")
        left = left if timeout is None else min(timeout, left)
        return DeadlineStream(
            self._inner.connect_tcp(str(self.address), port, left, local_address, socket_options), self.deadline
        )

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None
    ) -> httpcore.NetworkStream:
        raise httpcore.ConnectError("refused: no unix sockets")

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class PinnedPoster:
    """POSTs to URLs whose host passes `policy`, each connection made to the checked address."""

    def __init__(
        self,
        policy: TargetPolicy,
        *,
        resolve: Resolver = system_resolver,
        ssl_context: ssl.SSLContext | None = None,
        user_agent: str = "backfill",
    ) -> None:
        self.policy, self.resolve, self.user_agent = policy, resolve, user_agent
        self.ssl_context = ssl_context or httpx.create_ssl_context()

    def post(self, url: str, *, body: bytes, headers: Mapping[str, str]) -> int:
        """The status code of the answer (its body is never read). Raises TargetRefused for a
        host that is not allowed, OSError when it does not resolve, httpcore errors otherwise."""
        deadline = time.monotonic() + DEADLINE_S
        target = httpx.URL(url)
        host = target.raw_host.decode("ascii")
        port = target.port or _DEFAULT_PORTS[target.scheme]
        address = self.policy.check(host, port, resolve=self.resolve)
        request_headers = [
            ("host", target.netloc.decode("ascii")),
            ("user-agent", self.user_agent),
            ("content-length", str(len(body))),
            *headers.items(),
        ]
        with httpcore.ConnectionPool(
            ssl_context=self.ssl_context, network_backend=PinnedBackend(host, address, deadline), retries=0
        ) as pool:
            with pool.stream(
                "POST",
                httpcore.URL(scheme=target.scheme, host=host, port=port, target=target.raw_path),
                headers=request_headers,
                content=body,
                extensions={"timeout": TIMEOUTS},
            ) as response:
                return response.status
