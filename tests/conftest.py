"""Real services for the tests: Postgres and Redis on this machine, a SeaweedFS S3 server and
the Dynamo frontend + mocker fleet started here, and backfill's own processes."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from alembic import command
from sqlalchemy.orm import Session, sessionmaker

from backfill.devfleet.fleet import Fleet, large_model
from backfill.devfleet.processes import free_port
from backfill.devfleet.s3 import SeaweedS3
from backfill.devfleet.services import PG_ADMIN_URL, RedisServer, create_database, database_url, drop_database
from backfill.devfleet.stack import BUCKET, Stack, launch_stack
from backfill.migrate import alembic_config
from backfill.storage.db import make_engine

if TYPE_CHECKING:
    import openai

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379")
ROOT = Path(__file__).resolve().parent.parent
# The tests pin admission to the fixed bound (BACKFILL_MAX_INFLIGHT) unless they test the
# controller, which they then set up themselves: the default, `auto`, would steer every stack
# by the mocker's load and make counts and limits depend on timing.
# (tests/scheduler/test_capacity_auto.py covers the default.)
os.environ.setdefault("BACKFILL_CAPACITY_CONTROL", "off")


@pytest.fixture(scope="session", autouse=True)
def _scratch_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Processes that do not set a home of their own keep their state (metrics files, the
    embedded database) in a scratch folder, never in the developer's ~/.backfill."""
    saved = {k: os.environ.get(k) for k in ("BACKFILL_HOME", "BACKFILL_METRICS_DIR")}
    home = tmp_path_factory.mktemp("default-home")
    os.environ.setdefault("BACKFILL_HOME", str(home))
    os.environ.setdefault("BACKFILL_METRICS_DIR", str(home / "metrics"))
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """The Postgres database of this session's running stack (`stack`), migrated to head."""
    name = f"backfill_test_{secrets.token_hex(4)}"
    yield create_database(PG_ADMIN_URL, name)
    drop_database(PG_ADMIN_URL, name)


@pytest.fixture(scope="session")
def scratch_pg_url() -> Iterator[str]:
    """A Postgres database for in-process tests, apart from the stack's: the stack's scheduler
    and drains must never pick up (and fail on) batches these tests write."""
    name = f"backfill_scratch_{secrets.token_hex(4)}"
    yield create_database(PG_ADMIN_URL, name)
    drop_database(PG_ADMIN_URL, name)


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    """The one scratch database of the unit and in-process tests: migrated to head, on SQLite
    (the embedded mode) and on Postgres, never the database a running stack uses."""
    name = None
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'jobs.db'}"
    else:
        import psycopg

        name = f"backfill_jobs_{secrets.token_hex(4)}"
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        url = database_url(PG_ADMIN_URL, name)
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
        yield sessionmaker(bind=engine, expire_on_commit=False)
    finally:
        engine.dispose()
        if name is not None:
            drop_database(PG_ADMIN_URL, name)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer | None]:
    """A private redis-server for this test session (the machine's own binary): sessions running
    side by side never take each other's broker messages, and fault tests may restart it."""
    if os.environ.get("TEST_REDIS_URL") or not RedisServer.available():
        yield None
        return
    server = RedisServer(port=free_port(), workdir=tmp_path_factory.mktemp("redis"))
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
def s3() -> Iterator[SeaweedS3]:
    with SeaweedS3() as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture(scope="session")
def fleet() -> Iterator[Fleet]:
    # Two models, as `backfill up` serves them: tiny-chat on two workers, tiny-chat-large on one.
    with Fleet(num_workers=2, speedup_ratio=5.0, model_name="tiny-chat", more_models=[large_model(5.0)]) as f:
        yield f


@pytest.fixture(scope="session")
def stack(
    pg_url: str, redis_url: str, s3: SeaweedS3, fleet: Fleet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    settings = {
        "BACKFILL_COMPLETION_WINDOWS": "1h,8s",
        "BACKFILL_MAX_FILE_BYTES": str(8 * 1024 * 1024),
        "BACKFILL_MAX_REQUESTS_PER_BATCH": "3000",
        "BACKFILL_MAX_INFLIGHT": "32",
        "BACKFILL_LEASE_TTL_S": "4",
        "BACKFILL_DRAIN_SLICE_S": "10",
        "BACKFILL_TICK_INTERVAL_S": "0.5",
        "BACKFILL_FLEET_MAX_RETRIES": "4",
        # A production stack sends webhooks to public addresses only: the e2e receivers listen
        # on loopback, which the operator's allow-list names.
        "BACKFILL_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1/32",
    }
    with launch_stack(
        tmp_path_factory.mktemp("stack"),
        settings=settings,
        s3=s3,
        fleet_url=fleet.base_url,
        database_url=pg_url,
        redis_url=redis_url,
    ) as s:
        yield s


@pytest.fixture
def client(stack: Stack) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=stack.base_url, api_key=stack.key, max_retries=0, timeout=60)
