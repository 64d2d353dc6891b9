"""backfill's own processes (API, worker, scheduler) as real subprocesses on real services, for
the tests, the benchmarks and development.

`launch_stack` brings up what it is not handed (a SeaweedFS S3 server, a Dynamo mocker fleet, a
migrated Postgres database, a Redis), starts the processes, waits for the API and takes it all
down again in reverse order. `Stack` is the handle on the processes: a test may kill, stop and
start them again mid-batch.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .fleet import Fleet, ServedModel, large_model
from .processes import free_port, http_get
from .s3 import SeaweedS3
from .services import PG_ADMIN_URL, create_database, drop_database, flush_redis, private_redis

BUCKET = "backfill-test"
# Where a stack that is handed no Redis and finds no redis-server binary keeps its state.
FALLBACK_REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379") + "/9"
PROCESSES = ("api", "worker", "scheduler")


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

    @property
    def admin_key(self) -> str:
        return self.env["BACKFILL_ADMIN_API_KEY"]

    @property
    def database_url(self) -> str:
        return self.env["BACKFILL_DATABASE_URL"]

    @property
    def redis_url(self) -> str:
        return self.env["BACKFILL_REDIS_URL"]

    @property
    def fleet_url(self) -> str:
        return self.env["BACKFILL_FLEET_URLS"]

    def log(self, name: str) -> str:
        """What process `name` has logged so far."""
        return (self.logdir / f"{name}.log").read_text(errors="replace")

    def start(
        self,
        name: str,
        *,
        kind: str | None = None,
        port: int | None = None,
        home: Path | None = None,
        extra_env: Mapping[str, str] | None = None,
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
            if http_get(f"http://127.0.0.1:{self.api_port}/health", timeout=1)[0] == 200:
                return
            time.sleep(0.2)
        raise RuntimeError("API did not start:\n" + self.log("api")[-3000:])


def service_env(*, home: Path, pg_url: str, redis_url: str, s3: SeaweedS3, fleet_url: str) -> dict[str, str]:
    """Environment for backfill processes on the production adapters."""
    return {
        **os.environ,
        "BACKFILL_HOME": str(home),
        "BACKFILL_DATABASE_URL": pg_url,
        "BACKFILL_BROKER_URL": redis_url,
        "BACKFILL_REDIS_URL": redis_url,
        "BACKFILL_S3_ENDPOINT_URL": s3.endpoint_url,
        "BACKFILL_S3_BUCKET": BUCKET,
        "BACKFILL_S3_ACCESS_KEY": s3.access_key,
        "BACKFILL_S3_SECRET_KEY": s3.secret_key,
        "BACKFILL_FLEET_URLS": fleet_url,
    }


@contextmanager
def launch_stack(
    workdir: Path,
    *,
    settings: Mapping[str, str] | None = None,
    processes: Sequence[str] = PROCESSES,
    api_port: int | None = None,
    s3: SeaweedS3 | None = None,
    fleet_url: str | None = None,
    fleet_workers: int = 2,
    fleet_speedup: float = 5.0,
    model: str = "tiny-chat",
    more_models: Sequence[ServedModel] | None = None,
    database_url: str | None = None,
    pg_admin_url: str = PG_ADMIN_URL,
    name: str = "stack",
    redis_url: str | None = None,
    flush: bool = False,
) -> Iterator[Stack]:
    """backfill's processes (`processes`, the API on `api_port`) with their home under `workdir`
    and their logs in `workdir/logs`, with `settings` over the defaults (fresh bootstrap and
    admin keys, no rate limit). Each service not handed in is started here and stopped after:
    - `s3`: a SeaweedS3 server with the bucket;
    - `fleet_url`: a mocker fleet of `fleet_workers` engines at `fleet_speedup` serving `model`,
      and `more_models` on workers of their own (by default `tiny-chat-large` on one, as
      `backfill up` serves it; `()` for one model);
    - `database_url`: a database `backfill_<name>_<random>` on `pg_admin_url`, migrated, dropped
      after;
    - `redis_url`: a redis-server of its own. `flush`: the Redis database is emptied before and
      after (for a database number shared with other stacks).
    The API is waited for when one is among `processes`; start others on the handle."""
    workdir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as held:
        if s3 is None:
            s3 = held.enter_context(SeaweedS3())
            s3.create_bucket(BUCKET)
        if fleet_url is None:
            extra = [large_model(fleet_speedup)] if more_models is None else list(more_models)
            fleet = held.enter_context(
                Fleet(num_workers=fleet_workers, speedup_ratio=fleet_speedup, model_name=model, more_models=extra)
            )
            fleet_url = fleet.base_url
        if redis_url is None:
            (workdir / "redis").mkdir(exist_ok=True)
            redis_url = held.enter_context(private_redis(workdir / "redis", shared_url=FALLBACK_REDIS_URL))
        if flush:
            flush_redis(redis_url)
            held.callback(_flush_if_up, redis_url)
        if database_url is None:
            db_name = f"backfill_{name}_{secrets.token_hex(4)}"
            database_url = create_database(pg_admin_url, db_name)
            held.callback(drop_database, pg_admin_url, db_name)
        logdir, home = workdir / "logs", workdir / "home"
        logdir.mkdir(exist_ok=True)
        home.mkdir(exist_ok=True)
        env = {
            **service_env(home=home, pg_url=database_url, redis_url=redis_url, s3=s3, fleet_url=fleet_url),
            "BACKFILL_BOOTSTRAP_API_KEY": "sk-test-" + secrets.token_hex(16),
            "BACKFILL_ADMIN_API_KEY": "sk-admin-" + secrets.token_hex(16),
            # Tests and benchmarks poll fast with one key; the rate limit has tests of its own.
            "BACKFILL_RATE_LIMIT": "off",
            **(settings or {}),
        }
        stack = Stack(env=env, logdir=logdir, api_port=api_port or free_port())
        held.callback(stack.stop)
        for process in processes:
            stack.start(process)
        if "api" in processes:
            stack.wait_healthy()
        yield stack


def _flush_if_up(redis_url: str) -> None:
    import redis

    try:
        flush_redis(redis_url)
    except redis.ConnectionError:
        pass  # a test that stopped it has nothing left to empty
