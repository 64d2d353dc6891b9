"""backfill's own processes (API, worker, scheduler) as real subprocesses, for tests and benchmarks."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


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
        for proc in list(self.procs.values()):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for name in list(self.procs):
            proc = self.procs[name]
            try:
                proc.wait(timeout=30)  # a drain's shutdown grace is 20 s
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


@dataclass
class RedisServer:
    """A private redis-server process (the machine's binary), nothing kept on disk."""

    port: int
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available() -> bool:
        return shutil.which("redis-server") is not None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=(self.workdir / "redis.log").open("ab"),
            stderr=subprocess.STDOUT,
        )
        import redis

        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


def create_database(admin_url: str, name: str) -> str:
    """Create a Postgres database, migrate it to head, return its SQLAlchemy URL."""
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = admin_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://") + f"/{name}"
    subprocess.run(
        [sys.executable, "-m", "backfill", "migrate"], env={**os.environ, "BACKFILL_DATABASE_URL": url}, check=True
    )
    return url


def drop_database(admin_url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def service_env(*, home: Path, pg_url: str, redis_url: str, s3: object, fleet_url: str) -> dict[str, str]:
    """Environment for backfill processes on the production adapters."""
    return {
        **os.environ,
        "BACKFILL_HOME": str(home),
        "BACKFILL_DATABASE_URL": pg_url,
        "BACKFILL_BROKER_URL": redis_url,
        "BACKFILL_REDIS_URL": redis_url,
        "BACKFILL_S3_ENDPOINT_URL": s3.endpoint_url,  # type: ignore[attr-defined]
        "BACKFILL_S3_BUCKET": "backfill-test",
        "BACKFILL_S3_ACCESS_KEY": s3.access_key,  # type: ignore[attr-defined]
        "BACKFILL_S3_SECRET_KEY": s3.secret_key,  # type: ignore[attr-defined]
        "BACKFILL_FLEET_URLS": fleet_url,
    }
