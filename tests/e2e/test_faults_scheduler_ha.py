"""Two scheduler replicas, one leader (as in every fault scenario, `tests/e2e/faults.py`): SIGKILL
the leader mid-batch and the standby takes over; SIGSTOP the leader past its lease and the standby
takes over, and the old leader, resumed with SIGCONT, stands by and never acts as leader again.
Each scenario leaves both replicas running (a killed one is started again, as the standby).

What it checks, besides the promises every fault test checks (tests/e2e/faults.py: every batch
terminal, no line lost or duplicated, none billed twice, the fleet never above the limit): only
one replica leads at a time, and the standby leads within about 10 s of the leader's death.
"""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest

from backfill.devfleet.stack import Stack
from tests.e2e.fault_probes import FaultReport, FleetInflight, SendCounter
from tests.e2e.faults import (
    LEADS,
    Window,
    finished,
    leader_token,
    replica_of,
    resent_unaccounted,
    restart_replicas,
    settle,
    standby_of,
    submit,
    under_way,
    wait_for_leader,
)
from tests.e2e.helpers import wait_until

pytestmark = pytest.mark.e2e

TAKEOVER_WITHIN_S = 10.0
LEADER_TTL_S = 6.0  # BACKFILL_SCHEDULER_LEADER_TTL_S's default


def test_sigkill_the_leading_scheduler_mid_batch(
    fstack: Stack,
    teams: list[openai.OpenAI],
    send_counter: SendCounter,
    fleet_inflight: FleetInflight,
    fault_report: FaultReport,
    faults_db: str,
) -> None:
    restart_replicas(fstack)  # (after a scenario that failed before starting its replica again)
    wait_for_leader(fstack)
    window = Window(send_counter, fleet_inflight, fstack)
    load = submit(teams, "sigkill-leader", slow_each=2)
    under_way(faults_db, load)

    leader = wait_for_leader(fstack)
    token = leader_token(fstack)
    assert token is not None
    standby = standby_of(leader)
    standby_log_before = len(fstack.log(standby))
    assert not LEADS.search(fstack.log(standby)[window.scheduler_logs[standby] :]), "the standby led meanwhile"
    at_kill = finished(faults_db, load)

    fstack.kill(leader)
    killed = time.monotonic()
    wait_until(
        "the standby leads",
        lambda: bool(LEADS.search(fstack.log(standby)[standby_log_before:])),
        timeout_s=TAKEOVER_WITHIN_S + 10,
        every_s=0.05,
    )
    takeover_s = time.monotonic() - killed
    new_token = leader_token(fstack)
    assert new_token is not None and new_token != token
    assert replica_of(fstack, new_token) == standby
    restart_replicas(fstack)  # the killed replica comes back, as the standby now

    record = settle(
        "SIGKILL leading scheduler",
        f"standby scheduler led {takeover_s:.1f} s after the leader's SIGKILL (lease TTL 6 s); the killed "
        "replica, started again, stood by",
        load,
        db_url=faults_db,
        cleared_at=killed,
        window=window,
        report=fault_report,
        finished_at_clear=at_kill,
    )
    print(
        f"scheduler-ha: takeover_s={takeover_s:.1f} lost={record.lost} duplicated={record.duplicated} "
        f"fleet_peak={record.fleet_peak} limit={record.limit}"
    )
    assert takeover_s <= TAKEOVER_WITHIN_S
    assert resent_unaccounted(faults_db, load, send_counter) == 0


LOST = "lost the leader lease: standing by"


def test_sigstop_the_leading_scheduler_past_its_lease_then_resume_it(
    fstack: Stack,
    teams: list[openai.OpenAI],
    send_counter: SendCounter,
    fleet_inflight: FleetInflight,
    fault_report: FaultReport,
    faults_db: str,
) -> None:
    """A frozen leader (a stopped container, a long GC pause) is alive but renews nothing: the
    standby leads within 3 lease TTLs. Resumed, the old leader's clock and its next renewal both
    say it lost the lease, so it stops at its next step and stands by; nothing is lost, sent
    twice or billed twice."""
    restart_replicas(fstack)  # (after a scenario that failed before starting its replica again)
    wait_for_leader(fstack)
    window = Window(send_counter, fleet_inflight, fstack)
    load = submit(teams, "sigstop-leader", slow_each=2)
    under_way(faults_db, load)

    leader = wait_for_leader(fstack)
    token = leader_token(fstack)
    assert token is not None
    standby = standby_of(leader)
    standby_log_before = len(fstack.log(standby))
    at_pause = finished(faults_db, load)

    os.killpg(fstack.procs[leader].pid, signal.SIGSTOP)
    paused = time.monotonic()
    try:
        wait_until(
            "the standby leads",
            lambda: bool(LEADS.search(fstack.log(standby)[standby_log_before:])),
            timeout_s=3 * LEADER_TTL_S,
            every_s=0.05,
        )
        takeover_s = time.monotonic() - paused
        time.sleep(1.0)  # paused for longer than a TTL in all
    finally:
        leader_log_before = len(fstack.log(leader))
        os.killpg(fstack.procs[leader].pid, signal.SIGCONT)
    resumed = time.monotonic()
    wait_until("the resumed replica stands by", lambda: LOST in fstack.log(leader)[leader_log_before:], timeout_s=30)
    new_token = leader_token(fstack)
    assert new_token is not None and new_token != token
    assert replica_of(fstack, new_token) == standby

    record = settle(
        "SIGSTOP leading scheduler, then SIGCONT",
        f"standby led {takeover_s:.1f} s after the leader's SIGSTOP; the resumed leader stood by",
        load,
        db_url=faults_db,
        cleared_at=resumed,
        window=window,
        report=fault_report,
        finished_at_clear=at_pause,
    )
    print(
        f"scheduler-ha: paused takeover_s={takeover_s:.1f} lost={record.lost} duplicated={record.duplicated} "
        f"fleet_peak={record.fleet_peak} limit={record.limit}"
    )
    assert resent_unaccounted(faults_db, load, send_counter) == 0
    after_resume = fstack.log(leader)[leader_log_before:]
    assert not LEADS.search(after_resume), "the resumed replica led again while the standby lived"
    assert replica_of(fstack, leader_token(fstack) or "") == standby
