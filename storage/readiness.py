"""Can this process reach what it depends on: the database, the broker, Redis, the object store.

Each check makes one cheap round trip with short timeouts of its own and raises if it fails;
`api.routes.ops` runs them side by side under an overall bound (a probe must answer promptly
even when a dependency hangs instead of refusing).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from sqlalchemy import text

from backfill.storage.db import get_engine
from backfill.storage.objects import get_object_store
from backfill.storage.settings import get_settings

CONNECT_TIMEOUT_S = 2.0
PROBE_PREFIX = "readiness-probe/"  # never written: listing it costs one request and returns nothing


class NotConfigured(Exception):
    """The dependency is not part of this deployment (e.g. no Redis in the embedded mode)."""


def check_database() -> None:
    with get_engine().connect() as connection:
        connection.execute(text("SELECT 1"))


def _ping_redis(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=CONNECT_TIMEOUT_S)
    try:
        client.ping()
    finally:
        client.close()


def check_broker() -> None:
    s = get_settings()
    url = s.resolved_broker_url
    if url.startswith("filesystem"):
        # kombu's file transport: the folders `storage.broker` makes, writable by this process.
        queue = s.broker_folder / "queue"
        if not os.access(queue, os.W_OK):
            raise OSError(f"broker folder {queue} is missing or not writable")
        return
    if url.startswith(("redis://", "rediss://")):
        _ping_redis(url)
        return
    from kombu.connection import Connection

    with Connection(url, connect_timeout=CONNECT_TIMEOUT_S) as connection:  # type: ignore[no-untyped-call]
        connection.ensure_connection(max_retries=1)


def check_redis() -> None:
    url = get_settings().redis_url
    if not url:
        raise NotConfigured("no BACKFILL_REDIS_URL: leases live in the database")
    _ping_redis(url)


def check_object_store() -> None:
    next(iter(get_object_store().list(PROBE_PREFIX)), None)


CHECKS: dict[str, Callable[[], None]] = {
    "database": check_database,
    "broker": check_broker,
    "redis": check_redis,
    "object_store": check_object_store,
}
