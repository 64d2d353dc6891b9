"""What the fault tests share (tests/e2e/test_faults_*.py, one file a kind of fault). Faults a
deployment meets, each during a running load of several batches from two teams, on
the real services: SIGTERM of a worker and of the scheduler, Redis restarted empty, Postgres
unreachable for 20 s (its connections cut) and Postgres itself stopped for 20 s and restarted (a
private cluster), a worker SIGKILLed repeatedly, a poison line (one that takes its worker down
every time it runs), SeaweedFS stopped while batches finalize, a mocker engine SIGKILLed, the
fleet frontend stopped, and one of two backfill "hosts" (API + worker, behind one round-robin
address) lost. The scheduler runs as two replicas in every scenario, as a deployment with a
standby does: one leads (the leader lease, `scheduler.leadership`), the other stands by; a
scenario that signals "the scheduler" signals the leader, and leaves both replicas running.

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
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import psycopg
import redis

from backfill.devfleet.s3 import SeaweedS3
from backfill.devfleet.services import PG_ADMIN_URL
from backfill.devfleet.stack import Stack, launch_stack
from tests.e2e.fault_probes import FaultRecord, FaultReport, FleetInflight, SendCounter
from tests.e2e.helpers import chat_line, jsonl, read_lines, upload, wait_until

LIMIT = 16  # BACKFILL_MAX_INFLIGHT: the published limit (no capacity controller here)
MAX_ATTEMPTS = 3
GRACE_S = 5.0
TTL_S = 3.0
TERMINAL = ("completed", "failed", "expired", "cancelled")
RECOVER_WITHIN_S = 60.0  # every batch terminal this long after the fault clears
SHORT = 30  # max_tokens of an ordinary line
SLOW = 1500  # max_tokens of a long line: a few seconds at the fleet
SETTINGS = {
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


# The scheduler's replicas (`backfill scheduler` twice, on one Redis): one leads, one stands by.
SCHEDULERS = ("scheduler", "scheduler-b")
LEADER_KEY = "backfill:leader:scheduler"  # the lease's Redis key: its value is the leader's token
LEADS = re.compile(r"this scheduler leads now \(token ([0-9a-f]{8})\)")  # a replica's new term


@contextmanager
def fault_stack(
    workdir: Path,
    *,
    redis_url: str,
    s3: SeaweedS3,
    counter: SendCounter,
    pg_admin_url: str = PG_ADMIN_URL,
    processes: Sequence[str] = ("api", "worker"),
    api_port: int | None = None,
) -> Iterator[Stack]:
    """A stack with the fault settings on a fresh database of `pg_admin_url`'s server and an
    emptied Redis database, its fleet reached through the send counter: `processes`, and the
    scheduler as two replicas (`SCHEDULERS`), one of them leading by the time it is handed out."""
    with launch_stack(
        workdir,
        settings=SETTINGS,
        processes=processes,
        api_port=api_port,
        s3=s3,
        fleet_url=counter.base_url,
        pg_admin_url=pg_admin_url,
        name="faults",
        redis_url=redis_url,
        flush=True,
    ) as stack:
        for name in SCHEDULERS:
            stack.start(name, kind="scheduler")
        wait_for_leader(stack)
        yield stack


# -- the scheduler's replicas ----------------------------------------------------------------


def leader_token(stack: Stack) -> str | None:
    """The first 8 characters of the leader lease's token (as the replicas log it), if held."""
    with redis.Redis.from_url(stack.redis_url, decode_responses=True, socket_timeout=2) as r:
        value = r.get(LEADER_KEY)
    return str(value)[:8] if value is not None else None


def replica_of(stack: Stack, token: str) -> str | None:
    """The replica that began the term `token`, from the replicas' logs."""
    for name in SCHEDULERS:
        if token in LEADS.findall(stack.log(name)):
            return name
    return None


def leader(stack: Stack) -> str | None:
    """The replica that leads now, if one does."""
    token = leader_token(stack)
    return None if token is None else replica_of(stack, token)


def wait_for_leader(stack: Stack, timeout_s: float = RECOVER_WITHIN_S) -> str:
    """The leading replica, once one leads (a lease that lapsed is taken within a TTL or two)."""
    found: list[str] = []

    def leads() -> bool:
        try:
            name = leader(stack)
        except redis.ConnectionError:  # (a scenario restarting Redis)
            return False
        found[:] = [name] if name else []
        return bool(found)

    wait_until("a scheduler replica leads", leads, timeout_s=timeout_s, every_s=0.1)
    return found[0]


def standby_of(name: str) -> str:
    """The other replica."""
    (other,) = [n for n in SCHEDULERS if n != name]
    return other


def replicas_running(stack: Stack) -> list[str]:
    return [n for n in SCHEDULERS if n in stack.procs and stack.procs[n].poll() is None]


def restart_replicas(stack: Stack) -> list[str]:
    """Start again each replica a scenario stopped (the next scenario finds two); returns them."""
    gone = [n for n in SCHEDULERS if n not in replicas_running(stack)]
    for name in gone:
        stack.procs.pop(name, None)
        stack.start(name, kind="scheduler")
    return gone


def scheduler_log_marks(stack: Stack) -> dict[str, int]:
    """Where each replica's log ends now: `scheduler_logs(stack, since=...)` reads on from there."""
    return {name: len(stack.log(name)) for name in SCHEDULERS}


def scheduler_logs(stack: Stack, since: Mapping[str, int] | None = None) -> str:
    """What the replicas logged (since `since`, by default from their start), one after the other."""
    marks = since or {}
    return "\n".join(stack.log(name)[marks.get(name, 0) :] for name in SCHEDULERS)


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


def sql(db_url: str, query: str, *args: Any) -> list[tuple[Any, ...]] | None:
    """A query on the stack's database; None while it cannot be reached."""
    try:
        with psycopg.connect(db_url.replace("+psycopg", ""), connect_timeout=2) as conn:
            return list(conn.execute(query, args).fetchall())
    except psycopg.OperationalError:
        return None


def finished(db_url: str, load: Load) -> int | None:
    rows = sql(db_url, "SELECT coalesce(sum(completed + failed), 0) FROM batches WHERE id = ANY(%s)", load.db_ids)
    return None if rows is None else int(rows[0][0])


def terminal(db_url: str, load: Load) -> bool:
    rows = sql(db_url, "SELECT status FROM batches WHERE id = ANY(%s)", load.db_ids)
    return rows is not None and all(s in ("completed", "failed", "expired", "cancelled") for (s,) in rows)


def under_way(db_url: str, load: Load, share: float = 0.2) -> None:
    wait_until(
        "the load got going", lambda: (finished(db_url, load) or 0) >= share * load.requests, timeout_s=120, every_s=0.1
    )


@dataclass
class Window:
    """What the fleet saw from the moment the load starts, and which scheduler replicas led."""

    counter: SendCounter
    gauge: FleetInflight
    stack: Stack
    scheduler_logs: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.counter.window()
        self.gauge.window()
        self.scheduler_logs = scheduler_log_marks(self.stack)

    def terms(self) -> int:
        """Leader terms begun since the window opened (a handover begins one)."""
        return len(LEADS.findall(scheduler_logs(self.stack, since=self.scheduler_logs)))


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
        ledger = sql(
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
        schedulers=len(replicas_running(window.stack)),
        leader_terms=window.terms(),
    )
    report.record(rec)
    assert (stuck, lost, duplicated, double_billed, over_cap) == (0, 0, 0, 0, 0), rec
    # What the next scenario starts from: a leader and a standby.
    assert rec.schedulers == len(SCHEDULERS), f"{len(SCHEDULERS)} scheduler replicas should be running: {rec}"
    if rec.max_over_limit is not None:
        assert rec.max_over_limit <= 1, rec
    return rec


def resent(load: Load, counter: SendCounter) -> int:
    """Lines the fleet saw more than once."""
    return sum(1 for _, lines in load.batches.values() for p in lines.values() if counter.sends[p] > 1)


def resent_unaccounted(db_url: str, load: Load, counter: SendCounter) -> int:
    """Lines sent more often than the attempts they spent explain (a retried 5xx spends one)."""
    rows = sql(db_url, "SELECT batch_id, custom_id, attempts FROM batch_requests WHERE batch_id = ANY(%s)", load.db_ids)
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


def reclaims_logged(stack: Stack, since: Mapping[str, int] | None = None) -> list[str]:
    """The reconciler's reclaims the replicas logged since `since` (`scheduler_log_marks`)."""
    return [ln for ln in scheduler_logs(stack, since).splitlines() if "lines back from lapsed drains" in ln]


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
