"""Real services for the tests: Postgres and Redis on this machine, a SeaweedFS S3 server and
the Dynamo frontend + mocker fleet started here, and backfill's own processes."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

PG_ADMIN_URL = os.environ.get("TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379")
ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    from devfleet.fleet import free_port

    return free_port()


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A fresh Postgres database for this test session, migrated to head."""
    import psycopg

    name = f"backfill_test_{secrets.token_hex(4)}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://") + f"/{name}"
    subprocess.run(
        [sys.executable, "-m", "backfill", "migrate"], env={**os.environ, "BACKFILL_DATABASE_URL": url}, check=True
    )
    yield url
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def redis_url() -> str:
    import redis

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


@dataclass
class Stack:
    """backfill's own processes (API, worker, scheduler) against the real services."""

    env: dict[str, str]
    logdir: Path
    api_port: int
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}/v1"

    @property
    def key(self) -> str:
        return self.env["BACKFILL_BOOTSTRAP_API_KEY"]

    def start(self, name: str) -> None:
        args = {"api": ["api", "--port", str(self.api_port)], "worker": ["worker"], "scheduler": ["scheduler"]}[name]
        log = (self.logdir / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "backfill", *args],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: kill() reaches the Celery children too
            cwd=ROOT,
        )

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def stop(self) -> None:
        for name, proc in list(self.procs.items()):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for name in list(self.procs):
            proc = self.procs[name]
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill(name)
        self.procs.clear()

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.api_port}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("API did not start:\n" + (self.logdir / "api.log").read_text()[-3000:])


@pytest.fixture(scope="session")
def stack(
    pg_url: str, redis_url: str, s3: object, fleet: object, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    logdir = tmp_path_factory.mktemp("stack-logs")
    env = {
        **os.environ,
        "BACKFILL_HOME": str(tmp_path_factory.mktemp("backfill-home")),
        "BACKFILL_DATABASE_URL": pg_url,
        "BACKFILL_BROKER_URL": redis_url,
        "BACKFILL_REDIS_URL": redis_url,
        "BACKFILL_S3_ENDPOINT_URL": s3.endpoint_url,  # type: ignore[attr-defined]
        "BACKFILL_S3_BUCKET": "backfill-test",
        "BACKFILL_S3_ACCESS_KEY": s3.access_key,  # type: ignore[attr-defined]
        "BACKFILL_S3_SECRET_KEY": s3.secret_key,  # type: ignore[attr-defined]
        "BACKFILL_FLEET_URLS": fleet.base_url,  # type: ignore[attr-defined]
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
