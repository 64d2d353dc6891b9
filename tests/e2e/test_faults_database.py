"""Postgres faults during a running load of several batches from two teams: the database
unreachable for 20 s (its connections cut; the machine's server keeps running), and a private
cluster stopped hard for 20 s and restarted with crash recovery. What each checks afterwards:
tests/e2e/faults.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import psycopg
import pytest

from backfill.devfleet.processes import free_port
from backfill.devfleet.s3 import SeaweedS3
from backfill.devfleet.services import PG_ADMIN_URL, PostgresCluster, RedisServer
from backfill.devfleet.stack import Stack
from tests.e2e.fault_probes import FaultReport, FleetInflight, SendCounter
from tests.e2e.faults import (
    Window,
    fault_stack,
    finished,
    make_teams,
    reclaims_logged,
    resent_unaccounted,
    scheduler_log_marks,
    settle,
    submit,
    under_way,
)

pytestmark = pytest.mark.e2e


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
    window = Window(send_counter, fleet_inflight, fstack)
    load = submit(teams, "pg-outage")
    under_way(faults_db, load)
    log_before = scheduler_log_marks(fstack)
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
    assert "replies given up" not in fstack.log("worker")


@dataclass
class PrivateStack:
    cluster: PostgresCluster
    db_url: str
    stack: Stack


@pytest.fixture
def pg_private_stack(
    faults_redis: RedisServer,
    faults_s3: SeaweedS3,
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
        with fault_stack(
            tmp_path_factory.mktemp("pg-restart"),
            redis_url=faults_redis.url + "/1",  # its own broker and leases, apart from `fstack`'s
            s3=faults_s3,
            counter=send_counter,
            pg_admin_url=cluster.admin_url,
        ) as s:
            yield PrivateStack(cluster, s.database_url, s)
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
    window = Window(send_counter, fleet_inflight, stack)
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
    assert reclaims_logged(stack) == [], "lines were taken from live drains"
    assert resent_unaccounted(db, load, send_counter) == 0, "a line was sent again without cause"
    assert "replies given up" not in stack.log("worker")
    assert all(p.poll() is None for p in stack.procs.values()), "a process died of the outage"
