"""Faults of backfill's own processes, each during a running load of several batches from two
teams: SIGTERM of a worker and of the leading scheduler replica, a worker SIGKILLed repeatedly, a poison line
(one that takes its worker down every time it runs), and one of two backfill "hosts" (API +
worker, behind one round-robin address) lost. What each checks afterwards: tests/e2e/faults.py.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest

from backfill.devfleet.faultproxy import FaultProxy
from backfill.devfleet.processes import free_port, http_get
from backfill.devfleet.s3 import SeaweedS3
from backfill.devfleet.services import RedisServer
from backfill.devfleet.stack import Stack
from tests.e2e.fault_probes import FaultReport, FleetInflight, SendCounter
from tests.e2e.faults import (
    GRACE_S,
    LEADS,
    MAX_ATTEMPTS,
    RECOVER_WITHIN_S,
    Window,
    fault_stack,
    finished,
    make_teams,
    reclaims_logged,
    resent,
    resent_unaccounted,
    restart_replicas,
    scheduler_log_marks,
    scheduler_logs,
    settle,
    sql,
    standby_of,
    submit,
    terminal,
    terminate,
    under_way,
    wait_for_leader,
)
from tests.e2e.helpers import chat_line, read_lines, wait_until

pytestmark = pytest.mark.e2e


def test_sigterm_worker_mid_batch(
    fstack: Stack,
    teams: list[openai.OpenAI],
    send_counter: SendCounter,
    fleet_inflight: FleetInflight,
    fault_report: FaultReport,
    faults_db: str,
) -> None:
    window = Window(send_counter, fleet_inflight, fstack)
    # A few requests that run far longer than the grace: they are aborted at its end.
    slow = [chat_line(1000 + k, max_tokens=4000, prefix="sigterm-worker slow ") for k in range(4)]
    load = submit(teams, "sigterm-worker", extra=slow)
    under_way(faults_db, load)
    slow_ids = [ln["custom_id"] for ln in slow]
    wait_until(
        "a slow request in flight",
        lambda: bool(
            sql(faults_db, "SELECT 1 FROM batch_requests WHERE custom_id = ANY(%s) AND state = 'running'", slow_ids)
        ),
        timeout_s=60,
        every_s=0.1,
    )
    log_before = len(fstack.log("worker"))
    took = terminate(fstack, "worker", timeout_s=GRACE_S + 15)
    assert took <= GRACE_S + 5, f"the worker took {took:.1f} s to stop"
    stopped = re.findall(
        r"stopped ([\d.]+) s after the shutdown signal \((\d+) aborted", fstack.log("worker")[log_before:]
    )
    assert stopped, "no drain reported a graceful stop"
    aborted = sum(int(a) for _, a in stopped)
    assert aborted >= 1  # the slow ones did not fit the grace
    rows = sql(faults_db, "SELECT state, attempts FROM batch_requests WHERE custom_id = ANY(%s)", slow_ids)
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
    """SIGTERM to the leading replica (a rolling update, a node drained): its loop stops after
    its step, it lets go of the lease as it exits and the standby leads at its next poll."""
    window = Window(send_counter, fleet_inflight, fstack)
    load = submit(teams, "sigterm-scheduler")
    under_way(faults_db, load)
    leading = wait_for_leader(fstack)
    standby = standby_of(leading)
    log_before = scheduler_log_marks(fstack)
    took = terminate(fstack, leading, timeout_s=15)
    assert took <= 5, f"the scheduler took {took:.1f} s to stop"
    stopped = time.monotonic()
    wait_until(
        "the standby leads",
        lambda: bool(LEADS.search(fstack.log(standby)[log_before[standby] :])),
        timeout_s=RECOVER_WITHIN_S,
        every_s=0.05,
    )
    takeover_s = time.monotonic() - stopped
    at_clear = finished(faults_db, load)
    restart_replicas(fstack)  # the stopped replica comes back as the standby
    cleared = time.monotonic()
    settle(
        "SIGTERM leading scheduler",
        f"the leader's loop stopped after its step and it exited in {took:.1f} s, letting go of the lease; "
        f"the standby led {takeover_s:.1f} s later; running drains carried on; the stopped replica, started "
        "again, stood by",
        load,
        db_url=faults_db,
        cleared_at=cleared,
        window=window,
        report=fault_report,
        finished_at_clear=at_clear,
    )
    assert reclaims_logged(fstack, log_before) == []
    assert resent_unaccounted(faults_db, load, send_counter) == 0


def test_sigkill_worker_repeatedly(
    fstack: Stack,
    teams: list[openai.OpenAI],
    send_counter: SendCounter,
    fleet_inflight: FleetInflight,
    fault_report: FaultReport,
    faults_db: str,
) -> None:
    window = Window(send_counter, fleet_inflight, fstack)
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
    window = Window(send_counter, fleet_inflight, fstack)
    poison = chat_line(9999, max_tokens=20000, prefix="poison ")
    load = submit(teams[:1], "poison", per_batch=20, per_team=1, extra=[poison])
    (batch_id,) = load.db_ids
    prompt = poison["body"]["messages"][0]["content"]

    def poison_alone_in_flight() -> bool:
        rows = sql(faults_db, "SELECT custom_id, state FROM batch_requests WHERE batch_id = %s", batch_id)
        states = dict(rows or [])
        return states.get("req-9999") == "running" and all(
            s in ("succeeded", "failed") for c, s in states.items() if c != "req-9999"
        )

    def poison_row() -> tuple[str, int]:
        rows = sql(
            faults_db,
            "SELECT state, attempts FROM batch_requests WHERE batch_id = %s AND custom_id = 'req-9999'",
            batch_id,
        )
        return (str(rows[0][0]), int(rows[0][1])) if rows else ("unknown", -1)

    kills = 0
    while poison_row()[0] != "failed":
        assert kills < MAX_ATTEMPTS, "the poison line kept coming back"
        wait_until("the poison line runs alone", poison_alone_in_flight, timeout_s=90)
        # Its request has reached the fleet (a loaded worker may take a while from claim to send).
        wait_until(
            "the poison line reaches the fleet",
            lambda k=kills: send_counter.sends[prompt] > k,
            timeout_s=60,
            every_s=0.05,
        )
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
    assert kills == MAX_ATTEMPTS and send_counter.sends[prompt] == MAX_ATTEMPTS
    client, _ = load.batches[next(iter(load.batches))]
    b = client.batches.retrieve(next(iter(load.batches)))
    (err,) = read_lines(client, b.error_file_id)
    assert err["custom_id"] == "req-9999" and err["response"]["status_code"] == 500
    assert err["response"]["body"]["error"]["code"] == "max_attempts_exceeded"
    assert len(read_lines(client, b.output_file_id)) == 20 and rec.lost == 0


@dataclass
class TwoHosts:
    stack: Stack  # its address: the balancer in front of both APIs
    balancer: FaultProxy
    db_url: str


@pytest.fixture
def two_hosts(
    faults_redis: RedisServer,
    faults_s3: SeaweedS3,
    send_counter: SendCounter,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[TwoHosts]:
    """backfill as a deployment that outgrew one machine: on each of two "hosts" an API and a
    worker (each with a BACKFILL_HOME of its own), the scheduler's two replicas, one address in
    front of both APIs (round robin), one database, one Redis, one object store."""
    ports = {"api-a": free_port(), "api-b": free_port()}
    balancer = FaultProxy([f"http://127.0.0.1:{p}" for p in ports.values()]).start()
    try:
        with fault_stack(
            tmp_path_factory.mktemp("two-hosts"),
            redis_url=faults_redis.url + "/2",
            s3=faults_s3,
            counter=send_counter,
            processes=(),
            api_port=balancer.port,
        ) as s:
            for host in ("a", "b"):
                home = tmp_path_factory.mktemp(f"host-{host}")
                s.start(f"api-{host}", kind="api", port=ports[f"api-{host}"], home=home)
                s.start(f"worker-{host}", kind="worker", home=home)
            for port in ports.values():  # each API answers on its own, not just one of them
                wait_until(
                    f"the API on {port} answers",
                    lambda p=port: http_get(f"http://127.0.0.1:{p}/health", timeout=1)[0] == 200,
                    timeout_s=60,
                )
            s.wait_healthy()
            yield TwoHosts(s, balancer, s.database_url)
    finally:
        balancer.stop()


def test_two_hosts_one_lost_mid_batch(
    two_hosts: TwoHosts,
    send_counter: SendCounter,
    fleet_inflight: FleetInflight,
    fault_report: FaultReport,
) -> None:
    stack, db = two_hosts.stack, two_hosts.db_url
    teams = make_teams(stack)  # through the one address
    window = Window(send_counter, fleet_inflight, stack)
    load = submit(teams, "two-hosts", per_batch=100)
    under_way(db, load, share=0.25)
    worked = {h: stack.log(f"worker-{h}").count("drain[") for h in ("a", "b")}
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
    """The reclaims above were logged by the reconciler (of the replica leading then), batch by batch."""
    assert re.search(r"reconciler: batch \w+: took \d+ lines back from lapsed drains", scheduler_logs(fstack))
