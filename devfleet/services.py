"""The backing services of a development stack: a private Redis, a private PostgreSQL cluster,
and databases created (migrated to head) and dropped on a Postgres server."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .processes import free_port

# The Postgres server a stack's databases are created on (the tests and benchmarks read the
# same variable).
PG_ADMIN_URL = os.environ.get("TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


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


@contextmanager
def private_redis(workdir: Path, *, shared_url: str) -> Iterator[str]:
    """The URL of a Redis no one else uses: a redis-server of its own where the machine has the
    binary, else `shared_url` (a database number on a shared server), emptied first."""
    if not RedisServer.available():
        flush_redis(shared_url)
        yield shared_url
        return
    server = RedisServer(port=free_port(), workdir=workdir)
    server.start()
    try:
        yield server.url + "/0"
    finally:
        server.stop()


def flush_redis(url: str) -> None:
    import redis

    redis.Redis.from_url(url).flushdb()


def database_url(admin_url: str, name: str) -> str:
    """The SQLAlchemy URL of database `name` on `admin_url`'s server."""
    return admin_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://") + f"/{name}"


def create_database(admin_url: str, name: str) -> str:
    """Create a Postgres database, migrate it to head, return its SQLAlchemy URL."""
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = database_url(admin_url, name)
    subprocess.run(
        [sys.executable, "-m", "backfill", "migrate"],
        env={**os.environ, "BACKFILL_DATABASE_URL": url},
        check=True,
    )
    return url


def drop_database(admin_url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


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
        self.bindir = self.bindir or self.find_bindir()
        # Under /tmp, not a test's own folder: the postgres user must be able to reach it.
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
