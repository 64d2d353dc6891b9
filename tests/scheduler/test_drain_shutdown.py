"""Shutdown, in process against the real fleet stand-in, Postgres and Redis: a drain told to stop
claims nothing more, lets what is in flight finish for the grace period, gives the rest back
without spending an attempt, and returns within the grace; the capacity controller withdraws
its limit when it stops."""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
import uuid
from typing import Any

from backfill.jobs.files import file_key
from backfill.jobs.models import BatchRequest, RequestState
from backfill.scheduler.capacity.admission import Admission
from backfill.scheduler.capacity.controller import CapacityLoop
from backfill.scheduler.capacity.law import ControlConfig, Controller, Slo
from backfill.scheduler.capacity.telemetry import FleetTelemetry
from backfill.scheduler.drain.dispatcher import Dispatcher
from backfill.scheduler.fleet.client import FleetClient
from backfill.storage.db import unit_of_work
from backfill.storage.leases import FLEET_POOL, RedisLeaseStore, limit_key
from backfill.storage.objects import get_object_store
from backfill.storage.settings import parse_metrics_endpoints
from tests.factories import make_batch, make_team
from tests.scheduler.test_reclaim import lines_of
from tests.scheduler.test_reclaim import scratch_db as scratch_db  # the fixture

MODEL = "tiny-chat"


def batch_from_lines(lines: list[dict[str, Any]]) -> str:
    """An in-progress batch over an input file in the object store, its lines indexed."""
    data = [json.dumps(line).encode() + b"\n" for line in lines]
    with unit_of_work() as s:
        team = make_team(s)
        file_id = uuid.uuid4().hex
        get_object_store().put(file_key(team.id, file_id), iter(data))
        # Its lines written here: each at its own offset and length in the input file.
        batch = make_batch(s, team, lines=0, model=MODEL, input_file_id=file_id, expires_in_s=3600, total=len(lines))
        offset = 0
        for n, raw in enumerate(data, start=1):
            s.add(BatchRequest(batch_id=batch.id, line=n, custom_id=f"r{n}", offset=offset, length=len(raw)))
            offset += len(raw)
        return batch.id


def chat(i: int, max_tokens: int) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"q {i}"}], "max_tokens": max_tokens}
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def drain_of(batch_id: str, leases: RedisLeaseStore, admission: Admission, fleet: FleetClient, **kw: Any) -> Dispatcher:
    """A drain over one batch's lines (the planner gives it every release), 3 attempts a line."""
    return Dispatcher(
        store=get_object_store(),
        leases=leases,
        admission=admission,
        fleet=fleet,
        planner=lambda n: [(batch_id, n)],
        max_attempts=3,
        **kw,
    )


def test_a_stopping_drain_finishes_in_flight_work_within_the_grace(scratch_db: str, fleet: Any, redis_url: str) -> None:
    # 6 short requests (well inside the grace) and 6 that run far longer than it.
    batch_id = batch_from_lines([chat(i, 8 if i <= 6 else 20000) for i in range(1, 13)])
    leases = RedisLeaseStore(redis_url, namespace=f"sd-{secrets.token_hex(4)}")
    admission = Admission(leases, fixed_limit=12, ttl_s=3.0)
    shutdown = threading.Event()
    grace_s = 3.0

    async def scenario() -> tuple[Dispatcher, float]:
        fleet_client = FleetClient([fleet.base_url], timeout_s=120)
        dispatcher = drain_of(batch_id, leases, admission, fleet_client, shutdown=shutdown, grace_s=grace_s)
        run = asyncio.create_task(dispatcher.run(60.0, max_drains=1))
        deadline = time.monotonic() + 30
        # Every line sent: answered already (the short ones may finish before the last is sent,
        # e.g. a new prefix goes with one line first) or in flight.
        while dispatcher.sent + len(dispatcher._calls) < 12:
            assert time.monotonic() < deadline, "the drain never got its lines in flight"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        shutdown.set()  # what SIGTERM does in a worker's pool child
        stopped_at = time.monotonic()
        await asyncio.wait_for(run, timeout=grace_s + 5)
        took = time.monotonic() - stopped_at
        await fleet_client.aclose()
        return dispatcher, took

    dispatcher, took = asyncio.run(scenario())
    assert took <= grace_s + 0.5, f"took {took:.1f} s to stop"
    rows = {r.line: r for r in lines_of(batch_id)}
    assert [rows[n].state for n in range(1, 7)] == [RequestState.succeeded] * 6
    # The long ones were aborted at the end of the grace: back to pending, no attempt spent.
    assert [(rows[n].state, rows[n].attempts, rows[n].claim_token) for n in range(7, 13)] == [
        (RequestState.pending, 0, None)
    ] * 6
    assert dispatcher.aborted == 6 and dispatcher.sent == 6
    assert leases.count("fleet") == 0 and leases.count("drains") == 0


def test_a_drain_told_to_stop_before_it_starts_takes_nothing(scratch_db: str, fleet: Any, redis_url: str) -> None:
    batch_id = batch_from_lines([chat(i, 8) for i in range(1, 4)])
    leases = RedisLeaseStore(redis_url, namespace=f"sd-{secrets.token_hex(4)}")
    shutdown = threading.Event()
    shutdown.set()

    async def scenario() -> int:
        client = FleetClient([fleet.base_url], timeout_s=30)
        try:
            dispatcher = drain_of(
                batch_id, leases, Admission(leases, fixed_limit=4, ttl_s=3.0), client, shutdown=shutdown
            )
            return await dispatcher.run(10.0, max_drains=1)
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == 0
    assert [r.state for r in lines_of(batch_id)] == [RequestState.pending] * 3


def test_a_stopping_controller_withdraws_its_limit(redis_url: str) -> None:
    leases = RedisLeaseStore(redis_url, namespace=f"sd-{secrets.token_hex(4)}")
    # No telemetry (nothing listens there): the controller publishes its floor.
    telemetry = FleetTelemetry(parse_metrics_endpoints("frontend=http://127.0.0.1:1/metrics")[0])
    loop = CapacityLoop(
        Controller(ControlConfig(slo=Slo(ttft_s=1.0, itl_s=0.05), floor=2, period_s=0.25)), telemetry, leases
    )
    stop = threading.Event()
    thread = threading.Thread(target=loop.run, args=(stop,))
    thread.start()
    deadline = time.monotonic() + 5
    while leases.read(limit_key(FLEET_POOL)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert leases.read(limit_key(FLEET_POOL)) == "2"
    stop.set()
    thread.join(timeout=5)
    # Gone at once, not a few periods later: a stopped controller publishes nothing.
    assert leases.read(limit_key(FLEET_POOL)) is None


def test_a_claim_group_spanning_batches_sends_each_line_its_own_body(
    scratch_db: str, fleet: Any, redis_url: str
) -> None:
    """Two batches number their lines alike; one claim group holds lines of both. Each line must
    be sent with its own request (bodies were once looked up by line number alone)."""
    short = batch_from_lines([chat(i, 4) for i in range(1, 9)])
    long_prompt = "word " * 300
    long = batch_from_lines(
        [
            {
                **chat(i, 4),
                "body": {**chat(i, 4)["body"], "messages": [{"role": "user", "content": long_prompt + str(i)}]},
            }
            for i in range(1, 9)
        ]
    )
    leases = RedisLeaseStore(redis_url, namespace=f"sd-{secrets.token_hex(4)}")

    async def scenario() -> None:
        client = FleetClient([fleet.base_url], timeout_s=60)
        try:
            dispatcher = Dispatcher(
                store=get_object_store(),
                leases=leases,
                admission=Admission(leases, fixed_limit=16, ttl_s=3.0),
                fleet=client,
                planner=lambda n: [(short, n // 2), (long, n)],
                max_attempts=3,
            )
            await dispatcher.run(30.0, max_drains=1)
        finally:
            await client.aclose()

    asyncio.run(scenario())
    short_tokens = [r.prompt_tokens for r in lines_of(short)]
    long_tokens = [r.prompt_tokens for r in lines_of(long)]
    assert all(r.state == RequestState.succeeded for r in lines_of(short) + lines_of(long))
    assert max(short_tokens) < 100 < min(long_tokens), (short_tokens, long_tokens)


def test_lines_a_drain_holds_but_never_sent_go_back_when_it_ends(scratch_db: str, redis_url: str) -> None:
    """A claim committed just as the database connection dropped looks failed to the drain: when
    it ends, whatever it still holds but never sent goes back to pending, no attempt spent (the
    reconciler would otherwise take it back a TTL later and count an attempt)."""
    from tests.scheduler.test_reclaim import running_batch

    leases = RedisLeaseStore(redis_url, namespace=f"sd-{secrets.token_hex(4)}")

    async def scenario() -> str:
        client = FleetClient(["http://127.0.0.1:1/v1"], timeout_s=5)  # never called: nothing to send
        try:
            dispatcher = Dispatcher(
                store=get_object_store(),
                leases=leases,
                admission=Admission(leases, fixed_limit=4, ttl_s=3.0),
                fleet=client,
                planner=lambda n: [],
                max_attempts=3,
            )
            held = running_batch(3, token=dispatcher.holder)
            await dispatcher.run(2.0, max_drains=1)
            return held
        finally:
            await client.aclose()

    batch_id = asyncio.run(scenario())
    assert [(r.state, r.attempts, r.claim_token) for r in lines_of(batch_id)] == [(RequestState.pending, 0, None)] * 3


def test_a_drain_past_its_slice_frees_its_slot_while_its_requests_finish(
    scratch_db: str, fleet: Any, redis_url: str
) -> None:
    """Claiming ends with the slice; the replies of long requests may take minutes more. The drain
    slot goes when claiming ends, so the scheduler can start a drain for work arriving meanwhile
    (before, a new batch waited for the reconciler: "no live drain on them (2 drain slots held)")."""
    batch_id = batch_from_lines([chat(i, 20000) for i in range(1, 5)])
    leases = RedisLeaseStore(redis_url, namespace=f"sd-{secrets.token_hex(4)}")
    admission = Admission(leases, fixed_limit=4, ttl_s=3.0)
    shutdown = threading.Event()

    async def scenario() -> tuple[int, int, int]:
        fleet_client = FleetClient([fleet.base_url], timeout_s=120)
        dispatcher = drain_of(batch_id, leases, admission, fleet_client, shutdown=shutdown, grace_s=1.0)
        run = asyncio.create_task(dispatcher.run(1.0, max_drains=1))
        deadline = time.monotonic() + 30
        while len(dispatcher._calls) < 4:
            assert time.monotonic() < deadline, "the drain never got its lines in flight"
            await asyncio.sleep(0.05)
        while time.monotonic() < deadline and leases.count("drains"):
            await asyncio.sleep(0.1)  # the slice (1 s) ends; the long replies are still coming
        seen = (leases.count("drains"), len(dispatcher._inflight), leases.count("fleet"))
        shutdown.set()
        await asyncio.wait_for(run, timeout=10)
        await fleet_client.aclose()
        return seen

    slots, inflight, capacity = asyncio.run(scenario())
    assert slots == 0, "the drain kept its slot while only finishing in-flight requests"
    assert inflight == 4 and capacity == 4  # still running, still holding their capacity leases
    assert leases.count("drains") == 0 and leases.count("fleet") == 0


def test_a_drain_ended_by_an_error_records_the_replies_of_what_it_sent(
    scratch_db: str, fleet: Any, redis_url: str
) -> None:
    """An error the release loop cannot handle ends the drain, but the requests it had sent are
    still out: their replies are waited for and recorded. (They were given back as never sent,
    so the next drain sent each again without an attempt: a Redis restart did that in CI.)"""
    batch_id = batch_from_lines([chat(i, 200) for i in range(1, 5)])
    leases = RedisLeaseStore(redis_url, namespace=f"sd-{secrets.token_hex(4)}")
    admission = Admission(leases, fixed_limit=8, ttl_s=3.0)
    plans = iter([[(batch_id, 4)]])

    def planner(n: int) -> list[tuple[str, int]]:
        try:
            return next(plans)
        except StopIteration:
            raise RuntimeError("the planner broke") from None

    async def scenario() -> tuple[str, int]:
        fleet_client = FleetClient([fleet.base_url], timeout_s=120)
        dispatcher = Dispatcher(
            store=get_object_store(),
            leases=leases,
            admission=admission,
            fleet=fleet_client,
            planner=planner,
            max_attempts=3,
        )
        try:
            await asyncio.wait_for(dispatcher.run(30.0, max_drains=1), timeout=60)
        except RuntimeError as exc:
            return str(exc), dispatcher.sent
        finally:
            await fleet_client.aclose()
        return "", dispatcher.sent

    error, sent = asyncio.run(scenario())
    assert error == "the planner broke"
    assert [(r.state, r.attempts) for r in lines_of(batch_id)] == [(RequestState.succeeded, 0)] * 4
    assert sent == 4
    assert leases.count("fleet") == 0 and leases.count("drains") == 0
