"""Fleet faults during a running load of several batches from two teams: a mocker engine
SIGKILLed, and the fleet frontend stopped. What each checks afterwards: tests/e2e/faults.py.
"""

from __future__ import annotations

import time

import openai
import pytest

from backfill.devfleet.fleet import Fleet
from backfill.devfleet.stack import Stack
from tests.e2e.fault_probes import FaultReport, FleetInflight, SendCounter
from tests.e2e.faults import (
    Load,
    Window,
    finished,
    settle,
    sql,
    submit,
    under_way,
)

pytestmark = pytest.mark.e2e


def test_mocker_worker_killed_mid_batch(
    fstack: Stack,
    teams: list[openai.OpenAI],
    send_counter: SendCounter,
    fleet_inflight: FleetInflight,
    fault_report: FaultReport,
    faults_db: str,
    fleet: Fleet,
) -> None:
    """One of the fleet's two engines is SIGKILLed with requests on it, and started again 5 s later
    (its stale registration lingers at the frontend meanwhile)."""
    window = Window(send_counter, fleet_inflight, fstack)
    load = submit(teams, "mocker-kill", slow_each=2)
    under_way(faults_db, load, share=0.3)
    log_before = len(fstack.log("worker"))
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
    assert "circuit opened" not in fstack.log("worker")[log_before:]


def retries_spent(db_url: str, load: Load) -> str:
    rows = sql(
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
    fleet: Fleet,
) -> None:
    """The only deployment's frontend is SIGKILLed and started again 15 s later: the proxy in front
    of it (as a load balancer would) answers 502 meanwhile."""
    window = Window(send_counter, fleet_inflight, fstack)
    load = submit(teams, "frontend-stop")
    under_way(faults_db, load, share=0.3)
    log_before = len(fstack.log("worker"))
    fleet.frontend.kill()
    stopped = time.monotonic()
    sends_at_stop = sum(send_counter.sends.values())
    time.sleep(15.0)
    sends_during = sum(send_counter.sends.values()) - sends_at_stop
    fleet.frontend.start()
    fleet.wait_ready(60)
    cleared = time.monotonic()
    at_clear = finished(faults_db, load)
    worker_log = fstack.log("worker")[log_before:]
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
