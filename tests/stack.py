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

    def start(
        self,
        name: str,
        *,
        kind: str | None = None,
        port: int | None = None,
        home: Path | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        """Start `kind` (api, worker or scheduler; by default `name`) as `name`, logging to
        `name.log`; an API on `port` (by default `api_port`), with its own BACKFILL_HOME if given
        (two processes of a kind, as on two hosts)."""
        kind = kind or name
        port = port or self.api_port
        args = {"api": ["api", "--port", str(port)], "worker": ["worker"], "scheduler": ["scheduler"]}[kind]
        env = (
            self.env
            if home is None
            else {**self.env, "BACKFILL_HOME": str(home), "BACKFILL_METRICS_DIR": str(home / "metrics")}
        )
        env = {**env, **(extra_env or {})}
        log = (self.logdir / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "backfill", *args],
            env=env,
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


@dataclass
class PostgresCluster:
    """A private PostgreSQL cluster (the machine's own binaries) in a folder of its own, on a port
    of its own: a test may stop it hard and start it again without touching anyone else's
    database. initdb refuses to run as root, so as root it runs as the `postgres` user."""

    port: int
    datadir: Path | None = None
    bindir: Path | None = None

    @staticmethod
    def find_bindir() -> Path | None:
        found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: p.parent.parent.name)
        return found[-1].parent if found else None

    @classmethod
    def available(cls) -> bool:
        if cls.find_bindir() is None:
            return False
        if os.geteuid() != 0:
            return True
        import pwd

        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return False
        return shutil.which("runuser") is not None

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        assert self.bindir is not None
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, check=check, capture_output=True, timeout=120)

    def init(self) -> PostgresCluster:
        import tempfile

        self.bindir = self.bindir or self.find_bindir()
        # Under /tmp, not pytest's folder: the postgres user must be able to reach it.
        self.datadir = Path(tempfile.mkdtemp(prefix="backfill-pg-"))
        if os.geteuid() == 0:
            shutil.chown(self.datadir, "postgres", "postgres")
        self._run("initdb", "-D", str(self.datadir), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        return self

    def start(self, timeout_s: float = 60.0) -> None:
        assert self.datadir is not None
        opts = (
            f"-c port={self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='{self.datadir}' "
            # fsync off only spares the disk: a killed server loses nothing the OS was handed. (Not
            # synchronous_commit=off: a commit it acknowledged could then vanish in the crash.)
            "-c fsync=off -c max_connections=200"
        )
        done = self._run("pg_ctl", "start", "-D", str(self.datadir), "-l", str(self.datadir / "log"), "-o", opts, "-w")
        assert done.returncode == 0, done.stderr
        import psycopg

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                psycopg.connect(self.admin_url, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self, mode: str = "fast") -> None:
        """`immediate`: every backend killed at once, no shutdown checkpoint (crash recovery at the
        next start), as when the database's machine dies."""
        if self.datadir is not None:
            self._run("pg_ctl", "stop", "-D", str(self.datadir), "-m", mode, "-w", check=False)

    def remove(self) -> None:
        self.stop("immediate")
        if self.datadir is not None:
            shutil.rmtree(self.datadir, ignore_errors=True)
            self.datadir = None
