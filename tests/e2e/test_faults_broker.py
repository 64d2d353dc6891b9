"""Redis (the broker, heartbeats and leases) restarted empty during a running load of several
batches from two teams. What it checks afterwards: tests/e2e/faults.py.
"""

from __future__ import annotations

import time

import openai
import pytest

from backfill.devfleet.services import RedisServer
from backfill.devfleet.stack import Stack
from tests.e2e.fault_probes import FaultReport, FleetInflight, SendCounter
from tests.e2e.faults import (
    Window,
    finished,
    reclaims_logged,
    resent_unaccounted,
    scheduler_log_marks,
    settle,
    submit,
    under_way,
)

pytestmark = pytest.mark.e2e


def test_redis_restarted_mid_batch(
    fstack: Stack,
    teams: list[openai.OpenAI],
    send_counter: SendCounter,
    fleet_inflight: FleetInflight,
    fault_report: FaultReport,
    faults_db: str,
    faults_redis: RedisServer,
) -> None:
    window = Window(send_counter, fleet_inflight, fstack)
    load = submit(teams, "redis-restart")
    under_way(faults_db, load)
    log_before = scheduler_log_marks(fstack)
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
