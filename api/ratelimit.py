"""Per-key request rate limit for the API, as a pure ASGI middleware (`limits` does the counting).

The key is the SHA-256 of the bearer token (the digest the keys table stores), so neither the
limiter's storage nor a log ever holds a key. Counting is a moving window: no burst of twice
the limit across a window boundary. With `BACKFILL_REDIS_URL` set the windows live in Redis
and every API process shares them; otherwise each process counts in its own memory.

Refusals follow OpenAI: status 429, `Retry-After`, the `x-ratelimit-*-requests` headers and
`{"error": {"type": "requests", "code": "rate_limit_exceeded", ...}}` - the type OpenAI uses
for a requests-per-minute limit (`"tokens"` is its token limit), which the openai SDKs raise
as `RateLimitError` and retry after the given delay.

Failed authentications are limited too, per client address (`BACKFILL_AUTH_FAILURE_LIMIT`;
an IPv6 client counts as its /64, which one host usually holds whole): each made-up key costs
a full authentication and a window of its own in the per-key limit, so past the limit an
address's requests with a key that is not a live key get 429 before either. Many clients can
share one address (a proxy, NAT), so a valid key is never refused for its address: the key is
looked up by its digest (one indexed read; a key this process saw authenticate within the last
minute skips even that, `api.recent_keys`), and a digest just found unknown is remembered for a
minute, so a sender repeating its guesses costs no lookup at all. Behind a proxy the client
address is the proxy's unless uvicorn trusts its `X-Forwarded-For`: `BACKFILL_FORWARDED_ALLOW_IPS`,
which `backfill api` passes on.

Requests without a bearer token are not counted (they are refused by authentication without a
lookup), nor the probes in `exempt`. If the storage fails, requests pass (and a warning is logged at most
once a minute): a broken Redis must not take the API down with it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio
from limits import RateLimitItem, parse
from limits.aio.storage import RedisStorage, Storage
from limits.aio.strategies import MovingWindowRateLimiter
from limits.errors import StorageError
from limits.storage import storage_from_string
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backfill.api.access_log import TEAM_STATE_KEY
from backfill.api.limits import bearer_key_digest, send_error
from backfill.api.recent_keys import RecentKeys
from backfill.jobs.teams import key_digest_is_live
from backfill.storage.db import unit_of_work
from backfill.storage.settings import get_settings

log = logging.getLogger("backfill.api.ratelimit")

DEFAULT_RATE_LIMIT = "600/minute"
KEY_PREFIX = "backfill:ratelimit"
NAMESPACE = "api"
AUTH_FAILURE_NAMESPACE = "auth-failures"
WARN_EVERY_S = 60.0
UNKNOWN_KEY_TTL_S = 10.0


def configured_limit() -> str:
    """`BACKFILL_RATE_LIMIT` in `limits` notation ("600/minute", "20/second"); empty or "off"
    turns the limit off."""
    return get_settings().rate_limit.strip()


def _item(text: str) -> RateLimitItem | None:
    text = text.strip()
    return None if text.lower() in ("", "off", "0") else parse(text)


def configured_storage_uri() -> str:
    redis_url = get_settings().redis_url.strip()
    return f"async+{redis_url}" if redis_url else "async+memory://"


def _make_storage(uri: str) -> tuple[Storage, Callable[[], Awaitable[None]] | None]:
    """The storage and, for Redis, how to close its connections (at lifespan shutdown)."""
    if not uri.startswith("async+redis"):
        storage = storage_from_string(uri, wrap_exceptions=True)
        assert isinstance(storage, Storage)
        return storage, None
    # Our own pool, so shutdown can close it; redis-py is a dependency already (`limits` would
    # otherwise want coredis). Short timeouts: a hung Redis must not hang every request.
    pool = redis.asyncio.ConnectionPool.from_url(
        uri.removeprefix("async+"), socket_timeout=1.0, socket_connect_timeout=1.0
    )
    # `limits` types its pass-through options as scalars; the pool goes to redis-py unchanged.
    passed: dict[str, Any] = {"connection_pool": pool}
    storage = RedisStorage(uri, wrap_exceptions=True, implementation="redispy", key_prefix=KEY_PREFIX, **passed)
    return storage, pool.aclose


def _reset_words(seconds: int) -> str:
    minutes, secs = divmod(seconds, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def counted_address(address: str) -> str:
    """What the failed-auth limit counts a client as: its IPv4 address (an IPv4-mapped IPv6 one
    too), or the /64 of its IPv6 address (a host gets a whole /64 and may use any address in it)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def _digest_is_live(digest: str) -> bool:
    with unit_of_work() as session:
        return key_digest_is_live(session, digest)


def _per(item: RateLimitItem) -> str:
    window = item.GRANULARITY.name if item.multiples == 1 else f"{item.multiples} {item.GRANULARITY.name}s"
    return f"{item.amount} per {window}"


class RateLimit:
    def __init__(
        self,
        app: ASGIApp,
        *,
        limit: str | None = None,
        auth_failure_limit: str | None = None,
        storage_uri: str | None = None,
        exempt: tuple[str, ...] = ("/health", "/ready"),
    ) -> None:
        self.app = app
        self.item = _item(configured_limit() if limit is None else limit)
        self.auth_item = _item(get_settings().auth_failure_limit if auth_failure_limit is None else auth_failure_limit)
        self.storage_uri = storage_uri or configured_storage_uri()
        self.exempt = frozenset(exempt)
        # Built at the first request: the Redis client belongs to the event loop that serves.
        self._limiter: MovingWindowRateLimiter | None = None
        self._close: Callable[[], Awaitable[None]] | None = None
        self._warned_at = -math.inf
        self.recent_keys = RecentKeys()
        # Digests a lookup just found unknown or revoked; briefly, so a key restored since passes soon.
        self.unknown_keys = RecentKeys(ttl_s=UNKNOWN_KEY_TTL_S)
        self.is_live: Callable[[str], bool] = _digest_is_live

    def limiter(self) -> MovingWindowRateLimiter:
        if self._limiter is None:
            storage, self._close = _make_storage(self.storage_uri)
            self._limiter = MovingWindowRateLimiter(storage)
        return self._limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, self._closing_at_shutdown(receive), send)
            return
        if scope["type"] != "http" or scope["path"].rstrip("/") in self.exempt:
            await self.app(scope, receive, send)
            return
        digest = bearer_key_digest(scope)
        if digest is None:
            await self.app(scope, receive, send)
            return
        address = counted_address(str((scope.get("client") or ("unknown", 0))[0]))
        if self.auth_item is not None:
            if await self._refuse_failing_address(address, digest, send):
                return
            send = self._counting_failures(address, digest, scope, send)
        if self.item is None:
            await self.app(scope, receive, send)
            return
        item = self.item
        try:
            allowed = await self.limiter().hit(item, NAMESPACE, digest)
            stats = None if allowed else await self.limiter().get_window_stats(item, NAMESPACE, digest)
        except StorageError as exc:
            self._warn(exc)
            allowed, stats = True, None
        if allowed:
            await self.app(scope, receive, send)
            return
        retry_after = max(1, math.ceil(stats.reset_time - time.time())) if stats else 1
        await send_error(
            send,
            429,
            f"Rate limit reached for requests on this API key: limit {_per(item)}. "
            f"Please try again in {_reset_words(retry_after)}.",
            type_="requests",
            code="rate_limit_exceeded",
            headers=(
                (b"retry-after", str(retry_after).encode()),
                (b"x-ratelimit-limit-requests", str(item.amount).encode()),
                (b"x-ratelimit-remaining-requests", str(stats.remaining if stats else 0).encode()),
                (b"x-ratelimit-reset-requests", _reset_words(retry_after).encode()),
            ),
        )

    async def _refuse_failing_address(self, address: str, digest: str, send: Send) -> bool:
        """Answers 429 when `address` has failed authentication too often and the key is not a
        live one; returns whether it did. A live key always goes on to authentication."""
        assert self.auth_item is not None
        item = self.auth_item
        try:
            if await self.limiter().test(item, AUTH_FAILURE_NAMESPACE, address):
                return False
            if self.recent_keys.contains(digest):
                return False  # known valid: it goes on to authentication (and may be revoked since)
            if not self.unknown_keys.contains(digest):
                try:
                    live = await asyncio.to_thread(self.is_live, digest)
                except Exception:
                    log.warning("could not look a key up for the failed-auth limit", exc_info=True)
                    live = True  # authentication says what it is
                if live:
                    return False
                self.unknown_keys.add(digest)
            stats = await self.limiter().get_window_stats(item, AUTH_FAILURE_NAMESPACE, address)
        except StorageError as exc:
            self._warn(exc)
            return False
        retry_after = max(1, math.ceil(stats.reset_time - time.time()))
        await send_error(
            send,
            429,
            f"Too many requests with an invalid API key from this address: limit {_per(item)}. "
            f"Please try again in {_reset_words(retry_after)}.",
            type_="requests",
            code="rate_limit_exceeded",
            headers=((b"retry-after", str(retry_after).encode()),),
        )
        return True

    def _counting_failures(self, address: str, digest: str, scope: Scope, send: Send) -> Send:
        """`send`, counting a 401 (a key that failed authentication) against the address and
        remembering a key that authenticated (the dependency left its team in the request's state)."""
        assert self.auth_item is not None
        item = self.auth_item

        async def counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                state = scope.get("state")
                if message["status"] == 401:
                    self.recent_keys.discard(digest)
                    try:
                        await self.limiter().hit(item, AUTH_FAILURE_NAMESPACE, address)
                    except StorageError as exc:
                        self._warn(exc)
                elif isinstance(state, dict) and state.get(TEAM_STATE_KEY):
                    self.recent_keys.add(digest)
                    self.unknown_keys.discard(digest)
            await send(message)

        return counting

    def _closing_at_shutdown(self, receive: Receive) -> Receive:
        async def wrapped() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown" and self._close is not None:
                close, self._close, self._limiter = self._close, None, None
                await close()
            return message

        return wrapped

    def _warn(self, exc: StorageError) -> None:
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning("rate limit storage failed, letting requests through: %s", type(exc.storage_error).__name__)
