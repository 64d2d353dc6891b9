"""Real services for the tests: Postgres and Redis on this machine, a SeaweedFS S3 server and
the Dynamo frontend + mocker fleet started here, and backfill's own processes."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.stack import RedisServer, Stack, create_database, drop_database, service_env

PG_ADMIN_URL = os.environ.get("TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379")
ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    from devfleet.processes import free_port

    return free_port()


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A fresh Postgres database for this test session, migrated to head."""
    name = f"backfill_test_{secrets.token_hex(4)}"
    yield create_database(PG_ADMIN_URL, name)
    drop_database(PG_ADMIN_URL, name)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer | None]:
    """A private redis-server for this test session (the machine's own binary): sessions running
    side by side never take each other's broker messages, and fault tests may restart it."""
    if os.environ.get("TEST_REDIS_URL") or not RedisServer.available():
        yield None
        return
    server = RedisServer(port=_free_port(), workdir=tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer | None) -> str:
    import redis

    if redis_server is not None:
        return redis_server.url + "/0"
    db = 11 + secrets.randbelow(5)
    url = f"{REDIS_URL}/{db}"
    redis.Redis.from_url(url).flushdb()
    return url


@pytest.fixture(scope="session")
def s3() -> Iterator[object]:
    from devfleet.s3 import SeaweedS3

    with SeaweedS3() as server:
        server.create_bucket("backfill-test")
        yield server


@pytest.fixture(scope="session")
def fleet() -> Iterator[object]:
    from devfleet.fleet import Fleet

    with Fleet(num_workers=2, speedup_ratio=5.0, model_name="tiny-chat") as f:
        yield f


@pytest.fixture(scope="session")
def stack(
    pg_url: str, redis_url: str, s3: object, fleet: object, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    logdir = tmp_path_factory.mktemp("stack-logs")
    env = {
        **service_env(
            home=tmp_path_factory.mktemp("backfill-home"),
            pg_url=pg_url,
            redis_url=redis_url,
            s3=s3,
            fleet_url=fleet.base_url,  # type: ignore[attr-defined]
        ),
        "BACKFILL_BOOTSTRAP_API_KEY": "sk-test-" + secrets.token_hex(16),
        "BACKFILL_ADMIN_API_KEY": "sk-admin-" + secrets.token_hex(16),
        "BACKFILL_COMPLETION_WINDOWS": "1h,8s",
        "BACKFILL_MAX_FILE_BYTES": str(8 * 1024 * 1024),
        "BACKFILL_MAX_REQUESTS_PER_BATCH": "3000",
        "BACKFILL_MAX_INFLIGHT": "32",
        "BACKFILL_LEASE_TTL_S": "4",
        "BACKFILL_DRAIN_SLICE_S": "10",
        "BACKFILL_TICK_INTERVAL_S": "0.5",
        "BACKFILL_FLEET_MAX_RETRIES": "4",
        # Tests poll fast with one key; the rate limit has tests of its own (tests/api).
        "BACKFILL_RATE_LIMIT": "off",
    }
    s = Stack(env=env, logdir=logdir, api_port=_free_port())
    for name in ("api", "worker", "scheduler"):
        s.start(name)
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


@pytest.fixture
def client(stack: Stack):  # type: ignore[no-untyped-def]
    import openai

    return openai.OpenAI(base_url=stack.base_url, api_key=stack.key, max_retries=0, timeout=60)
