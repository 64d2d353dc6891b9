"""Faults a deployment meets, each during a running load of several batches from two teams, on
the real services: SIGTERM of a worker and of the scheduler, Redis restarted empty, Postgres
unreachable for 20 s (its connections cut) and Postgres itself stopped for 20 s and restarted (a
private cluster), a worker SIGKILLed repeatedly, a poison line (one that takes its worker down
every time it runs), SeaweedFS stopped while batches finalize, a mocker engine SIGKILLed, the
fleet frontend stopped, and one of two backfill "hosts" (API + worker, behind one round-robin
address) lost.

After each: every batch is terminal within a minute of the fault clearing; output + error files
hold exactly one line per request; the ledger has one row per executed (succeeded) request; no
line was sent more times than the attempt cap (counted by a proxy in front of the fleet); and the
fleet's own in-flight gauge never exceeded the limit by more than one lease. What was measured
goes to `fault_report` (tests/e2e/conftest.py), which prints the table and the summary line.

backfill runs here on a database, a Redis and an S3 server of its own (so restarting or blocking
them touches no other test's stack), with a fixed admission limit and a short lease TTL and grace
period.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import psycopg
import pytest
import redis

from backfill.devfleet.faultproxy import FaultProxy
from backfill.devfleet.processes import free_port
from tests.conftest import PG_ADMIN_URL
from tests.e2e.conftest import FaultRecord, FaultReport, FleetInflight, SendCounter
from tests.e2e.helpers import chat_line, jsonl, read_lines, upload
from tests.stack import PostgresCluster, RedisServer, Stack, create_database, drop_database, service_env

pytestmark = pytest.mark.e2e

LIMIT = 16  # BACKFILL_MAX_INFLIGHT: the published limit (no capacity controller here)
MAX_ATTEMPTS = 3
GRACE_S = 5.0
TTL_S = 3.0
TERMINAL = ("completed", "failed", "expired", "cancelled")
RECOVER_WITHIN_S = 60.0  # every batch terminal this long after the fault clears
SHORT = 30  # max_tokens of an ordinary line
SLOW = 1500  # max_tokens of a long line: a few seconds at the fleet


@pytest.fixture(scope="module")
def faults_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if not RedisServer.available():
        pytest.skip("redis-server is not installed")
    server = RedisServer(port=free_port(), workdir=tmp_path_factory.mktemp("faults-redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def faults_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """An S3 server of this module's own, its data in a folder that outlives a stop (so it can be
    stopped mid-batch and started again on the same port with every object still there)."""
    from backfill.devfleet.s3 import SeaweedS3

    server = SeaweedS3(data_dir=tmp_path_factory.mktemp("faults-s3"))
    with server:
        server.create_bucket("backfill-test")
        yield server


@pytest.fixture(scope="module")
def faults_db() -> Iterator[str]:
    name = f"backfill_faults_{secrets.token_hex(4)}"
    url = create_database(PG_ADMIN_URL, name)
    yield url
    drop_database(PG_ADMIN_URL, name)


def faults_env(*, home: Any, pg_url: str, redis_url: str, s3: Any, fleet_url: str) -> dict[str, str]:
    return {
        **service_env(home=home, pg_url=pg_url, redis_url=redis_url, s3=s3, fleet_url=fleet_url),
        "BACKFILL_BOOTSTRAP_API_KEY": "sk-test-" + secrets.token_hex(16),
        "BACKFILL_ADMIN_API_KEY": "sk-admin-" + secrets.token_hex(16),
        "BACKFILL_RATE_LIMIT": "off",
        "BACKFILL_MAX_REQUESTS_PER_BATCH": "3000",
        "BACKFILL_MAX_INFLIGHT": str(LIMIT),
        "BACKFILL_LEASE_TTL_S": str(TTL_S),
        "BACKFILL_DRAIN_SLICE_S": "10",
        "BACKFILL_DRAIN_GRACE_S": str(GRACE_S),
        "BACKFILL_TICK_INTERVAL_S": "0.5",
        "BACKFILL_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
        "BACKFILL_STALL_AFTER_S": "10",
        "BACKFILL_DB_OUTAGE_PATIENCE_S": "90",
        "BACKFILL_FLEET_TIMEOUT_S": "120",
    }


@pytest.fixture(scope="module")
def fstack(
    faults_db: str,
    faults_redis: RedisServer,
    faults_s3: Any,
    send_counter: SendCounter,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    env = faults_env(
        home=tmp_path_factory.mktemp("faults-home"),
        pg_url=faults_db,
        redis_url=faults_redis.url + "/0",
        s3=faults_s3,
        fleet_url=send_counter.base_url,
    )
    s = Stack(env=env, logdir=tmp_path_factory.mktemp("faults-logs"), api_port=free_port())
    for name in ("api", "worker", "scheduler"):
        s.start(name)
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def make_teams(stack: Stack) -> list[openai.OpenAI]:
    """Two teams: the bootstrap key's, and one made through the admin API."""
    admin = httpx.Client(
        base_url=stack.base_url,
        headers={"Authorization": f"Bearer {stack.env['BACKFILL_ADMIN_API_KEY']}"},
        timeout=30,
    )
    project = admin.post("/organization/projects", json={"name": f"faults-{secrets.token_hex(3)}"})
    assert project.status_code == 200, project.text
    key = admin.post(f"/organization/projects/{project.json()['id']}/api_keys", json={"name": "faults"})
    assert key.status_code == 200, key.text
    return [
        openai.OpenAI(base_url=stack.base_url, api_key=k, max_retries=2, timeout=60)
        for k in (stack.key, key.json()["value"])
    ]


@pytest.fixture(scope="module")
def teams(fstack: Stack) -> list[openai.OpenAI]:
    return make_teams(fstack)


@pytest.fixture(scope="module")
def fleet_inflight(fleet: Any) -> Iterator[FleetInflight]:
    with FleetInflight(fleet.frontend_metrics_url) as gauge:
        yield gauge


# -- load and checks -----------------------------------------------------------------------


@dataclass
class Load:
    tag: str
    # API batch id -> (its team's client, custom id -> the line's prompt)
    batches: dict[str, tuple[openai.OpenAI, dict[str, str]]] = field(default_factory=dict)

    @property
    def db_ids(self) -> list[str]:
        return [b.removeprefix("batch_") for b in self.batches]

    @property
    def requests(self) -> int:
        return sum(len(lines) for _, lines in self.batches.values())


def submit(
    teams: list[openai.OpenAI],
    tag: str,
    *,
    per_batch: int = 75,
    per_team: int = 2,
    extra: list[dict[str, Any]] | None = None,
    slow_each: int = 0,
) -> Load:
    """`per_team` batches of `per_batch` lines for each team; `extra` lines go to the first batch,
    and every batch ends with `slow_each` long lines (claimed last: same prefix, later lines)."""
    load = Load(tag)
    for t, client in enumerate(teams):
        for b in range(per_team):
            prefix = f"{tag} t{t} b{b} "
            lines = [chat_line(i, max_tokens=SHORT, prefix=prefix) for i in range(per_batch)]
            lines += [chat_line(per_batch + k, max_tokens=SLOW, prefix=prefix) for k in range(slow_each)]
            if extra and t == 0 and b == 0:
                lines += extra
            f = upload(client, jsonl(lines))
            batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
            load.batches[batch.id] = (client, {ln["custom_id"]: ln["body"]["messages"][0]["content"] for ln in lines})
    return load


def _sql(db_url: str, query: str, *args: Any) -> list[tuple[Any, ...]] | None:
    """A query on the stack's database; None while it cannot be reached."""
    try:
        with psycopg.connect(db_url.replace("+psycopg", ""), connect_timeout=2) as conn:
            return list(conn.execute(query, args).fetchall())
    except psycopg.OperationalError:
        return None


def finished(db_url: str, load: Load) -> int | None:
    rows = _sql(db_url, "SELECT coalesce(sum(completed + failed), 0) FROM batches WHERE id = ANY(%s)", load.db_ids)
    return None if rows is None else int(rows[0][0])


def terminal(db_url: str, load: Load) -> bool:
    rows = _sql(db_url, "SELECT status FROM batches WHERE id = ANY(%s)", load.db_ids)
    return rows is not None and all(s in ("completed", "failed", "expired", "cancelled") for (s,) in rows)


def wait_until(what: str, cond: Callable[[], bool], timeout_s: float, every_s: float = 0.2) -> float:
    started = time.monotonic()
    while not cond():
        assert time.monotonic() - started < timeout_s, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(every_s)
    return time.monotonic() - started


def under_way(db_url: str, load: Load, share: float = 0.2) -> None:
    wait_until(
        "the load got going", lambda: (finished(db_url, load) or 0) >= share * load.requests, timeout_s=120, every_s=0.1
    )


@dataclass
class Window:
    """What the fleet saw from the moment the load starts."""

    counter: SendCounter
    gauge: FleetInflight

    def __post_init__(self) -> None:
        self.counter.window()
        self.gauge.window()


def settle(
    name: str,
    did: str,
    load: Load,
    *,
    db_url: str,
    cleared_at: float,
    window: Window,
    report: FaultReport,
    finished_at_clear: int | None = None,
) -> FaultRecord:
    """Wait for the batches after the fault cleared, check the promises, record the figures."""
    resumed_s: float | None = None
    deadline = cleared_at + RECOVER_WITHIN_S
    while time.monotonic() < deadline and not terminal(db_url, load):
        n = finished(db_url, load)
        if resumed_s is None and n is not None and finished_at_clear is not None and n > finished_at_clear:
            resumed_s = time.monotonic() - cleared_at
        time.sleep(0.2)
    terminal_s = time.monotonic() - cleared_at if terminal(db_url, load) else None
    if resumed_s is None and terminal_s is not None:
        resumed_s = terminal_s
    stuck = lost = duplicated = double_billed = over_cap = 0
    for batch_id, (client, lines) in load.batches.items():
        b = client.batches.retrieve(batch_id)
        if b.status not in ("completed", "failed", "expired", "cancelled"):
            stuck += 1
            continue
        got = [ln["custom_id"] for ln in read_lines(client, b.output_file_id) + read_lines(client, b.error_file_id)]
        lost += len(set(lines) - set(got))
        duplicated += len(got) - len(set(got)) + len(set(got) - set(lines))
        succeeded = len(read_lines(client, b.output_file_id))
        ledger = _sql(
            db_url,
            "SELECT count(*), count(DISTINCT line) FROM usage_ledger WHERE batch_id = %s",
            batch_id.removeprefix("batch_"),
        )
        assert ledger is not None
        rows, distinct = ledger[0]
        double_billed += (rows - distinct) + max(0, distinct - succeeded)
        assert distinct == succeeded, f"{batch_id}: {distinct} ledger rows for {succeeded} executed requests"
        over_cap += sum(1 for prompt in lines.values() if window.counter.sends[prompt] > MAX_ATTEMPTS)
    gauge = window.gauge.max_seen
    rec = FaultRecord(
        name=name,
        requests=load.requests,
        lost=lost,
        duplicated=duplicated,
        double_billed=double_billed,
        stuck=stuck,
        over_cap=over_cap,
        max_over_limit=None if gauge is None else max(0, gauge - LIMIT),
        fleet_peak=gauge,
        limit=LIMIT,
        resumed_s=resumed_s,
        terminal_s=terminal_s,
        did=did,
    )
    report.record(rec)
    assert (stuck, lost, duplicated, double_billed, over_cap) == (0, 0, 0, 0, 0), rec
    if rec.max_over_limit is not None:
        assert rec.max_over_limit <= 1, rec
    return rec


def resent(load: Load, counter: SendCounter) -> int:
    """Lines the fleet saw more than once."""
    return sum(1 for _, lines in load.batches.values() for p in lines.values() if counter.sends[p] > 1)


def resent_unaccounted(db_url: str, load: Load, counter: SendCounter) -> int:
    """Lines sent more often than the attempts they spent explain (a retried 5xx spends one)."""
    rows = _sql(
        db_url, "SELECT batch_id, custom_id, attempts FROM batch_requests WHERE batch_id = ANY(%s)", load.db_ids
    )
    assert rows is not None
    attempts = {(b, c): a for b, c, a in rows}
    bad = [
        prompt
        for batch_id, (_, lines) in load.batches.items()
        for cid, prompt in lines.items()
        if counter.sends[prompt] > attempts[(batch_id.removeprefix("batch_"), cid)] + 1
    ]
    for prompt in bad[:12]:
        print("resent without an attempt:", prompt, [e for e in counter.log if e[1] == prompt])
    return len(bad)


def reclaims_logged(stack: Stack, since: int) -> list[str]:
    return [ln for ln in log_of(stack, "scheduler")[since:].splitlines() if "lines back from lapsed drains" in ln]


def log_of(stack: Stack, name: str) -> str:
    return (stack.logdir / f"{name}.log").read_text(errors="replace")


def terminate(stack: Stack, name: str, timeout_s: float) -> float:
    """SIGTERM to the process alone (as a container runtime signals PID 1); seconds to exit."""
    proc = stack.procs.pop(name)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"{name} did not exit within {timeout_s:.0f} s of SIGTERM") from None
    took = time.monotonic() - started
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # nothing of its group may linger into the next start
    except ProcessLookupError:
        pass
    return took


# -- the scenarios -------------------------------------------------------------------------


def test_sigterm_worker_mid_batch(
    fstack: Stack,
    teams: list[openai.OpenAI],
    send_counter: SendCounter,
    fleet_inflight: FleetInflight,
    fault_report: FaultReport,
    faults_db: str,
) -> None:
    window = Window(send_counter, fleet_inflight)
    # A few requests that run far longer than the grace: they are aborted at its end.
    slow = [chat_line(1000 + k, max_tokens=4000, prefix="sigterm-worker slow ") for k in range(4)]
    load = submit(teams, "sigterm-worker", extra=slow)
    under_way(faults_db, load)
    slow_ids = [ln["custom_id"] for ln in slow]
    wait_until(
        "a slow request in flight",
        lambda: bool(
            _sql(faults_db, "SELECT 1 FROM batch_requests WHERE custom_id = ANY(%s) AND state = 'running'", slow_ids)
        ),
        timeout_s=60,
        every_s=0.1,
    )
    log_before = len(log_of(fstack, "worker"))
    took = terminate(fstack, "worker", timeout_s=GRACE_S + 15)
    assert took <= GRACE_S + 5, f"the worker took {took:.1f} s to stop"
    stopped = re.findall(
        r"stopped ([\d.]+) s after the shutdown signal \((\d+) aborted", log_of(fstack, "worker")[log_before:]
    )
    assert stopped, "no drain reported a graceful stop"
    aborted = sum(int(a) for _, a in stopped)
    assert aborted >= 1  # the slow ones did not fit the grace
    rows = _sql(faults_db, "SELECT state, attempts FROM batch_requests WHERE custom_id = ANY(%s)", slow_ids)
    assert rows is not None and all(attempts == 0 for _, attempts in rows), rows
    at_clear = finished(faults_db, load)
    fstack.start("worker")
    cleared = time.monotonic()
    settle(
        "SIGTERM worker",
        f"drains stopped claiming, let in-flight requests finish, exited {took:.1f} s after SIGTERM "
        f"(grace {GRACE_S:.0f} s); {aborted} requests still running at the grace's end aborted and requeued "
        "without spending an attempt",
        load,
        db_url=faults_db,
        cleared_at=cleared,
        window=window,
        report=fault_report,
        finished_at_clear=at_clear,
    )
    # Shutting down spends no attempt: a line sent again was aborted at the grace's end.
    assert resent_unaccounted(faults_db, load, send_counter) <= aborted


def test_sigterm_scheduler_mid_batch(
    fstack: Stack,
    teams: list[openai.OpenAI],
    send_counter: SendCounter,
    fleet_inflight: FleetInflight,
    fault_report: FaultReport,
    faults_db: str,
) -> None:
    window = Window(send_counter, fleet_inflight)
    load = submit(teams, "sigterm-scheduler")
    under_way(faults_db, load)
    log_before = len(log_of(fstack, "scheduler"))
    took = terminate(fstack, "scheduler", timeout_s=15)
    assert took <= 5, f"the scheduler took {took:.1f} s to stop"
    time.sleep(2.0)
    at_clear = finished(faults_db, load)
    fstack.start("scheduler")
    cleared = time.monotonic()
    settle(
        "SIGTERM scheduler",
        f"loop stopped after its tick, exited in {took:.1f} s; running drains carried on; the restarted loop finalized",
        load,
        db_url=faults_db,
        cleared_at=cleared,
        window=window,
        report=fault_report,
        finished_at_clear=at_clear,
    )
    assert reclaims_logged(fstack, log_before) == []
    assert resent_unaccounted(faults_db, load, send_counter) == 0


def test_redis_restarted_mid_batch(
    fstack: Stack,
    teams: list[openai.OpenAI],
    send_counter: SendCounter,
    fleet_inflight: FleetInflight,
    fault_report: FaultReport,
    faults_db: str,
    faults_redis: RedisServer,
) -> None:
    window = Window(send_counter, fleet_inflight)
    load = submit(teams, "redis-restart")
    under_way(faults_db, load)
    log_before = len(log_of(fstack, "scheduler"))
    faults_redis.stop()
    time.sleep(2.0)
    faults_redis.start()  # empty: no heartbeats, no leases, no queued messages
    cleared = time.monotonic()
    at_clear = finished(faults_db, load)
    settle(
        "Redis restarted empty",
        "no line reclaimed from live drains; drains re-asserted heartbeats and leases, no new lease for one TTL; "
        "lost broker messages re-sent by the loop",
        load,
        db_url=faults_db,
        cleared_at=cleared,
        window=window,
        report=fault_report,
        finished_at_clear=at_clear,
    )
    assert reclaims_logged(fstack, log_before) == [], "lines were taken from live drains"
    assert resent_unaccounted(faults_db, load, send_counter) == 0, "a line was sent again without cause"


def _block_database(db_url: str, seconds: float) -> threading.Thread:
    """The database refuses connections and its open ones are cut, for `seconds` (the machine's
    Postgres itself keeps running)."""
    name = db_url.rsplit("/", 1)[1]

    def run() -> None:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            try:
                until = time.monotonic() + seconds
                while time.monotonic() < until:
                    conn.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                        (name,),
                    )
                    time.sleep(0.2)
            finally:
                conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')

    thread = threading.Thread(target=run, name="db-outage")
    thread.start()
    return thread


def test_postgres_unreachable_for_20s_mid_drain(
    fstack: Stack,
    teams: list[openai.OpenAI],
    send_counter: SendCounter,
    fleet_inflight: FleetInflight,
    fault_report: FaultReport,
    faults_db: str,
) -> None:
    window = Window(send_counter, fleet_inflight)
    load = submit(teams, "pg-outage")
    under_way(faults_db, load)
    log_before = len(log_of(fstack, "scheduler"))
    sends_before = sum(send_counter.sends.values())
    outage = _block_database(faults_db, 20.0)
    time.sleep(5.0)
    sends_early = sum(send_counter.sends.values())
    outage.join()
    sends_during = sum(send_counter.sends.values()) - sends_early
    cleared = time.monotonic()
    at_clear = finished(faults_db, load)
    settle(
        "Postgres unreachable 20 s",
        f"drains held their replies and sent nothing new ({sends_during} sends in the last 15 s of the outage, "
        f"{sends_early - sends_before} as it began), wrote them once it answered",
        load,
        db_url=faults_db,
        cleared_at=cleared,
        window=window,
        report=fault_report,
        finished_at_clear=at_clear,
    )
    assert sends_during == 0, f"{sends_during} requests sent while the database was away"
    assert reclaims_logged(fstack, log_before) == [], "lines were taken from live drains"
    assert resent_unaccounted(faults_db, load, send_counter) == 0, "a line was sent again without cause"
    assert "replies given up" not in log_of(fstack, "worker")


@dataclass
class PrivateStack:
    cluster: PostgresCluster
    db_url: str
    stack: Stack


@pytest.fixture
def pg_private_stack(
    faults_redis: RedisServer,
    faults_s3: Any,
    send_counter: SendCounter,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[PrivateStack]:
    """A stack whose database lives on a PostgreSQL cluster of its own, so the test can stop that
    server itself (the machine's shared one keeps running for everyone else)."""
    if not PostgresCluster.available():
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) on this machine")
    cluster = PostgresCluster(port=free_port()).init()
    try:
        cluster.start()
        db_url = create_database(cluster.admin_url, "backfill_faults")
        r = redis.Redis.from_url(faults_redis.url + "/1")
        r.flushdb()
        env = faults_env(
            home=tmp_path_factory.mktemp("pg-restart-home"),
            pg_url=db_url,
            redis_url=faults_redis.url + "/1",  # its own broker and leases, apart from `fstack`'s
            s3=faults_s3,
            fleet_url=send_counter.base_url,
        )
        s = Stack(env=env, logdir=tmp_path_factory.mktemp("pg-restart-logs"), api_port=free_port())
        for name in ("api", "worker", "scheduler"):
            s.start(name)
        try:
            s.wait_healthy()
            yield PrivateStack(cluster, db_url, s)
        finally:
            s.stop()
            r.flushdb()
    finally:
        cluster.remove()


def test_postgres_restarted_and_held_down_20s(
    pg_private_stack: PrivateStack,
    send_counter: SendCounter,
    fleet_inflight: FleetInflight,
    fault_report: FaultReport,
) -> None:
    """The database server itself goes down (`pg_ctl stop -m immediate`: every backend killed, no
    checkpoint), stays down 20 s (connections refused), and starts again with crash recovery."""
    cluster, db, stack = pg_private_stack.cluster, pg_private_stack.db_url, pg_private_stack.stack
    teams = make_teams(stack)
    window = Window(send_counter, fleet_inflight)
    load = submit(teams, "pg-restart")
    under_way(db, load)
    sends_before = sum(send_counter.sends.values())
    cluster.stop("immediate")
    stopped = time.monotonic()
    time.sleep(5.0)
    sends_early = sum(send_counter.sends.values())
    time.sleep(max(0.0, 20.0 - (time.monotonic() - stopped)))
    sends_during = sum(send_counter.sends.values()) - sends_early
    cluster.start()
    cleared = time.monotonic()
    at_clear = finished(db, load)
    settle(
        "Postgres stopped (immediate) 20 s, restarted",
        f"drains held their replies and sent nothing new ({sends_during} sends in the last 15 s of the outage, "
        f"{sends_early - sends_before} as it began); after crash recovery they wrote them once",
        load,
        db_url=db,
        cleared_at=cleared,
        window=window,
        report=fault_report,
        finished_at_clear=at_clear,
    )
    assert sends_during == 0, f"{sends_during} requests sent while the database was down"
    assert reclaims_logged(stack, 0) == [], "lines were taken from live drains"
    assert resent_unaccounted(db, load, send_counter) == 0, "a line was sent again without cause"
    assert "replies given up" not in log_of(stack, "worker")
    assert all(p.poll() is None for p in stack.procs.values()), "a process died of the outage"


def test_sigkill_worker_repeatedly(
    fstack: Stack,
    teams: list[openai.OpenAI],
    send_counter: SendCounter,
    fleet_inflight: FleetInflight,
    fault_report: FaultReport,
    faults_db: str,
) -> None:
    window = Window(send_counter, fleet_inflight)
    load = submit(teams, "sigkill")
    under_way(faults_db, load, share=0.15)
    kills = MAX_ATTEMPTS - 1  # a line in flight at every kill still has an attempt left
    for _ in range(kills):
        fstack.kill("worker")
        time.sleep(1.0)
        fstack.start("worker")
        before = finished(faults_db, load) or 0
        wait_until(
            "progress after a restart",
            lambda b=before: (finished(faults_db, load) or 0) > b + 20 or terminal(faults_db, load),
            90,
        )
    at_clear = finished(faults_db, load)
    cleared = time.monotonic()
    settle(
        f"SIGKILL worker x{kills}",
        f"lines of the dead drains reclaimed after their heartbeat had lapsed a TTL ({resent(load, send_counter)} sent again, "
        "an attempt each); the restarted worker finished",
        load,
        db_url=faults_db,
        cleared_at=cleared,
        window=window,
        report=fault_report,
        finished_at_clear=at_clear,
    )


def test_poison_line_goes_to_the_error_file(
    fstack: Stack,
    teams: list[openai.OpenAI],
    send_counter: SendCounter,
    fleet_inflight: FleetInflight,
    fault_report: FaultReport,
    faults_db: str,
) -> None:
    """A line that takes its worker down every time it runs (played here by SIGKILLing the worker
    whenever that line, and only it, is in flight) ends in the error file after the cap."""
    window = Window(send_counter, fleet_inflight)
    poison = chat_line(9999, max_tokens=20000, prefix="poison ")
    load = submit(teams[:1], "poison", per_batch=20, per_team=1, extra=[poison])
    (batch_id,) = load.db_ids

    def poison_alone_in_flight() -> bool:
        rows = _sql(faults_db, "SELECT custom_id, state FROM batch_requests WHERE batch_id = %s", batch_id)
        states = dict(rows or [])
        return states.get("req-9999") == "running" and all(
            s in ("succeeded", "failed") for c, s in states.items() if c != "req-9999"
        )

    def poison_row() -> tuple[str, int]:
        rows = _sql(
            faults_db,
            "SELECT state, attempts FROM batch_requests WHERE batch_id = %s AND custom_id = 'req-9999'",
            batch_id,
        )
        return (str(rows[0][0]), int(rows[0][1])) if rows else ("unknown", -1)

    kills = 0
    while poison_row()[0] != "failed":
        assert kills < MAX_ATTEMPTS, "the poison line kept coming back"
        wait_until("the poison line runs alone", poison_alone_in_flight, timeout_s=90)
        time.sleep(0.5)  # well into its request
        fstack.kill("worker")
        kills += 1
        fstack.start("worker")
        # The reclaim spends an attempt (and past the cap, fails the line).
        wait_until("the poison line is taken back", lambda k=kills: poison_row()[1] >= k, timeout_s=60)
    cleared = time.monotonic()
    rec = settle(
        "poison line",
        f"the line's worker died {kills} times; each reclaim spent an attempt; at the cap ({MAX_ATTEMPTS}) it went to "
        "the error file as max_attempts_exceeded",
        load,
        db_url=faults_db,
        cleared_at=cleared,
        window=window,
        report=fault_report,
        finished_at_clear=None,
    )
    assert kills == MAX_ATTEMPTS and send_counter.sends[poison["body"]["messages"][0]["content"]] == MAX_ATTEMPTS
    client, _ = load.batches[next(iter(load.batches))]
    b = client.batches.retrieve(next(iter(load.batches)))
    (err,) = read_lines(client, b.error_file_id)
    assert err["custom_id"] == "req-9999" and err["response"]["status_code"] == 500
    assert err["response"]["body"]["error"]["code"] == "max_attempts_exceeded"
    assert len(read_lines(client, b.output_file_id)) == 20 and rec.lost == 0


def _pending(db_url: str, load: Load) -> int | None:
    rows = _sql(
        db_url, "SELECT count(*) FROM batch_requests WHERE batch_id = ANY(%s) AND state = 'pending'", load.db_ids
    )
    return None if rows is None else int(rows[0][0])


def _running(db_url: str, load: Load) -> int | None:
    rows = _sql(
        db_url, "SELECT count(*) FROM batch_requests WHERE batch_id = ANY(%s) AND state = 'running'", load.db_ids
    )
    return None if rows is None else int(rows[0][0])


def _statuses(db_url: str, load: Load) -> dict[str, str]:
    return dict(_sql(db_url, "SELECT id, status FROM batches WHERE id = ANY(%s)", load.db_ids) or [])


def result_objects(s3: Any, load: Load) -> dict[str, list[str]]:
    """Every object under each batch's result folder (whatever its name), by batch id."""
    client = s3.client()
    out: dict[str, list[str]] = {}
    for batch_id in load.db_ids:
        keys: list[str] = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket="backfill-test", Prefix="batches/"):
            keys += [o["Key"] for o in page.get("Contents", []) if f"/{batch_id}/" in o["Key"]]
        out[batch_id] = sorted(keys)
    return out


def test_s3_stopped_during_finalization(
    fstack: Stack,
    teams: list[openai.OpenAI],
    send_counter: SendCounter,
    fleet_inflight: FleetInflight,
    fault_report: FaultReport,
    faults_db: str,
    faults_s3: Any,
) -> None:
    """The object store goes away once every line is claimed, so the batches finish their lines
    and reach finalization while no file can be written; it comes back after a while."""
    window = Window(send_counter, fleet_inflight)
    load = submit(teams, "s3-outage", slow_each=2)

    def all_claimed() -> bool:
        started = _statuses(faults_db, load)
        return all(st not in ("validating", "created") for st in started.values()) and _pending(faults_db, load) == 0

    wait_until("every line claimed", all_claimed, timeout_s=120, every_s=0.05)
    faults_s3.stop()
    stopped = time.monotonic()
    # A finalization whose files were already written when the store stopped may still end in
    # the next moments (its compare-and-set to the terminal status): the batches open 2 s in.
    time.sleep(2.0)
    open_at_stop = [b for b, st in _statuses(faults_db, load).items() if st not in TERMINAL]
    try:
        # Lines already claimed finish without the store; a line sent back for a retry cannot be
        # read again until the store is back (its body lives in the input file), so it waits.
        wait_until("no line running", lambda: _running(faults_db, load) == 0, timeout_s=60)
        time.sleep(max(0.0, 20.0 - (time.monotonic() - stopped)))
        during = _statuses(faults_db, load)
        left = _pending(faults_db, load)
    finally:
        faults_s3.start()
    cleared = time.monotonic()
    waiting = [b for b in open_at_stop if during[b] not in TERMINAL]
    assert open_at_stop and waiting == open_at_stop, (open_at_stop, during)  # nothing finished without its files
    finalizing = [b for b in open_at_stop if during[b] == "finalizing"]
    assert finalizing, during  # at least one batch got as far as its files
    settle(
        "S3 stopped during finalization",
        f"{len(finalizing)} of {len(open_at_stop)} batch(es) reached finalization while the store was down (20 s) "
        f"and waited in `finalizing` ({left} line(s) sent back for a retry waited for their input file); "
        "the next nudge after it was back wrote their files (one PUT each)",
        load,
        db_url=faults_db,
        cleared_at=cleared,
        window=window,
        report=fault_report,
        finished_at_clear=None,
    )
    # Exactly the result files, once each: no partial or stray objects.
    for batch_id, keys in result_objects(faults_s3, load).items():
        names = [k.rsplit("/", 1)[1] for k in keys]
        assert names in (["output.jsonl"], ["error.jsonl", "output.jsonl"]), (batch_id, keys)
    uploads = faults_s3.client().list_multipart_uploads(Bucket="backfill-test").get("Uploads", [])
    assert uploads == [], uploads


def test_mocker_worker_killed_mid_batch(
    fstack: Stack,
    teams: list[openai.OpenAI],
    send_counter: SendCounter,
    fleet_inflight: FleetInflight,
    fault_report: FaultReport,
    faults_db: str,
    fleet: Any,
) -> None:
    """One of the fleet's two engines is SIGKILLed with requests on it, and started again 5 s later
    (its stale registration lingers at the frontend meanwhile)."""
    window = Window(send_counter, fleet_inflight)
    load = submit(teams, "mocker-kill", slow_each=2)
    under_way(faults_db, load, share=0.3)
    log_before = len(log_of(fstack, "worker"))
    fleet.kill_worker(0)
    time.sleep(5.0)
    fleet.restart_worker(0)
    cleared = time.monotonic()
    at_clear = finished(faults_db, load)
    rec = settle(
        "mocker worker SIGKILLed",
        "requests on the dead engine came back as fleet errors and were retried",
        load,
        db_url=faults_db,
        cleared_at=cleared,
        window=window,
        report=fault_report,
        finished_at_clear=at_clear,
    )
    rec.did += f" ({retries_spent(faults_db, load)}); the other engine and the restarted one finished"
    assert "circuit opened" not in log_of(fstack, "worker")[log_before:]


def retries_spent(db_url: str, load: Load) -> str:
    rows = _sql(
        db_url,
        "SELECT count(*) FILTER (WHERE attempts > 0), coalesce(max(attempts), 0) FROM batch_requests "
        "WHERE batch_id = ANY(%s)",
        load.db_ids,
    )
    assert rows is not None
    return f"{rows[0][0]} lines spent an attempt, at most {rows[0][1]}"


def test_fleet_frontend_stopped_mid_batch(
    fstack: Stack,
    teams: list[openai.OpenAI],
    send_counter: SendCounter,
    fleet_inflight: FleetInflight,
    fault_report: FaultReport,
    faults_db: str,
    fleet: Any,
) -> None:
    """The only deployment's frontend is SIGKILLed and started again 15 s later: the proxy in front
    of it (as a load balancer would) answers 502 meanwhile."""
    window = Window(send_counter, fleet_inflight)
    load = submit(teams, "frontend-stop")
    under_way(faults_db, load, share=0.3)
    log_before = len(log_of(fstack, "worker"))
    fleet.frontend.kill()
    stopped = time.monotonic()
    sends_at_stop = sum(send_counter.sends.values())
    time.sleep(15.0)
    sends_during = sum(send_counter.sends.values()) - sends_at_stop
    fleet.frontend.start()
    fleet.wait_ready(60)
    cleared = time.monotonic()
    at_clear = finished(faults_db, load)
    worker_log = log_of(fstack, "worker")[log_before:]
    rec = settle(
        "fleet frontend stopped 15 s",
        f"the deployment's circuit opened ({worker_log.count('circuit opened')}x); drains waited for half-open "
        f"probes ({sends_during} sends in {cleared - stopped:.0f} s) instead of spending attempts",
        load,
        db_url=faults_db,
        cleared_at=cleared,
        window=window,
        report=fault_report,
        finished_at_clear=at_clear,
    )
    rec.did += f"; {retries_spent(faults_db, load)}"
    assert "circuit opened" in worker_log
    assert sends_during <= 16 + 10, f"{sends_during} requests sent into the outage"


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class TwoHosts:
    stack: Stack  # its address: the balancer in front of both APIs
    balancer: FaultProxy
    db_url: str


@pytest.fixture
def two_hosts(
    faults_redis: RedisServer,
    faults_s3: Any,
    send_counter: SendCounter,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[TwoHosts]:
    """backfill as a deployment that outgrew one machine: on each of two "hosts" an API and a
    worker (each with a BACKFILL_HOME of its own), one scheduler, one address in front of both
    APIs (round robin), one database, one Redis, one object store."""
    name = f"backfill_faults_2h_{secrets.token_hex(4)}"
    db_url = create_database(PG_ADMIN_URL, name)
    r = redis.Redis.from_url(faults_redis.url + "/2")
    r.flushdb()
    ports = {"api-a": free_port(), "api-b": free_port()}
    balancer = FaultProxy([f"http://127.0.0.1:{p}" for p in ports.values()]).start()
    env = faults_env(
        home=tmp_path_factory.mktemp("two-hosts-home"),
        pg_url=db_url,
        redis_url=faults_redis.url + "/2",
        s3=faults_s3,
        fleet_url=send_counter.base_url,
    )
    s = Stack(env=env, logdir=tmp_path_factory.mktemp("two-hosts-logs"), api_port=balancer.port)
    try:
        for host in ("a", "b"):
            home = tmp_path_factory.mktemp(f"host-{host}")
            s.start(f"api-{host}", kind="api", port=ports[f"api-{host}"], home=home)
            s.start(f"worker-{host}", kind="worker", home=home)
        s.start("scheduler")
        for port in ports.values():  # each API answers on its own, not just one of them
            wait_until(
                f"the API on {port} answers",
                lambda p=port: _answers(f"http://127.0.0.1:{p}/health"),
                timeout_s=60,
            )
        s.wait_healthy()
        yield TwoHosts(s, balancer, db_url)
    finally:
        s.stop()
        balancer.stop()
        r.flushdb()
        drop_database(PG_ADMIN_URL, name)


def test_two_hosts_one_lost_mid_batch(
    two_hosts: TwoHosts,
    send_counter: SendCounter,
    fleet_inflight: FleetInflight,
    fault_report: FaultReport,
) -> None:
    stack, db = two_hosts.stack, two_hosts.db_url
    teams = make_teams(stack)  # through the one address
    window = Window(send_counter, fleet_inflight)
    load = submit(teams, "two-hosts", per_batch=100)
    under_way(db, load, share=0.25)
    worked = {h: log_of(stack, f"worker-{h}").count("drain[") for h in ("a", "b")}
    assert all(worked.values()), f"both hosts' workers should run drains: {worked}"
    stack.kill("api-a")  # host A is gone: its API and its worker at once
    stack.kill("worker-a")
    cleared = time.monotonic()
    at_clear = finished(db, load)
    status = [c.batches.retrieve(b).status for b, (c, _) in load.batches.items()]  # the one address still answers
    assert len(status) == len(load.batches)
    rec = settle(
        "one of two hosts lost (API + worker SIGKILLed)",
        "the balancer sent API calls to the other host; the dead worker's lines were reclaimed after its "
        "heartbeat lapsed (an attempt each) and host B's worker finished them; the limit held across both",
        load,
        db_url=db,
        cleared_at=cleared,
        window=window,
        report=fault_report,
        finished_at_clear=at_clear,
    )
    rec.did += f" ({resent(load, send_counter)} lines sent again; balancer: {two_hosts.balancer.stats})"


def test_logs_name_what_the_reconciler_did(fstack: Stack) -> None:
    """The reclaims above were logged by the reconciler, batch by batch."""
    assert re.search(r"reconciler: batch \w+: took \d+ lines back from lapsed drains", log_of(fstack, "scheduler"))
