"""Several fleet deployments behind backfill, a circuit breaker per deployment shared through
Redis, and faults between backfill and the fleet.

Two real Dynamo fleets (a frontend + one mocker each). Deployment A is reached through a fault
proxy (5xx, timeouts, resets, stalled bodies); deployment B directly, and its frontend is
killed mid-batch. backfill runs as real processes on a database and a Redis of their own, so
the session's other stack never drains these batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import redis

from backfill.devfleet.faultproxy import Fault, FaultProxy
from backfill.devfleet.fleet import Fleet
from backfill.devfleet.processes import free_port
from backfill.devfleet.s3 import SeaweedS3
from backfill.devfleet.services import private_redis
from backfill.devfleet.stack import Stack, launch_stack
from backfill.scheduler.fleet.breaker import BreakerPolicy, BreakerState
from backfill.scheduler.fleet.client import FleetClient
from tests.e2e.fault_probes import FleetInflight
from tests.e2e.helpers import MODEL, chat_line, jsonl, read_lines, upload, wait_for, wait_until

pytestmark = pytest.mark.e2e

FLEET_TIMEOUT_S = 6.0  # BACKFILL_FLEET_TIMEOUT_S here: a held request costs this long
MAX_ATTEMPTS = 4  # BACKFILL_FLEET_MAX_RETRIES here
CHAT = "/v1/chat/completions"
FAULT_TABLE: list[dict[str, Any]] = []


@pytest.fixture(scope="module")
def fleet_a() -> Iterator[Fleet]:
    with Fleet(num_workers=1, speedup_ratio=5.0, model_name=MODEL) as f:
        yield f


@pytest.fixture(scope="module")
def fleet_b() -> Iterator[Fleet]:
    with Fleet(num_workers=1, speedup_ratio=5.0, model_name=MODEL) as f:
        yield f


@pytest.fixture(scope="module")
def proxy_a(fleet_a: Fleet) -> Iterator[FaultProxy]:
    with FaultProxy(fleet_a.origin) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[str]:
    """A Redis of its own: broker, leases and breakers of this module's stack only (without the
    redis-server binary, another database on the shared server)."""
    shared = redis_url.rsplit("/", 1)[0] + "/10"
    with private_redis(tmp_path_factory.mktemp("redis-deployments"), shared_url=shared) as url:
        yield url


@pytest.fixture(scope="module")
def stack2(
    own_redis: str,
    s3: SeaweedS3,
    proxy_a: FaultProxy,
    fleet_b: Fleet,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Stack]:
    settings = {
        "BACKFILL_MAX_REQUESTS_PER_BATCH": "3000",
        "BACKFILL_MAX_INFLIGHT": "32",
        "BACKFILL_LEASE_TTL_S": "4",
        "BACKFILL_DRAIN_SLICE_S": "10",
        "BACKFILL_TICK_INTERVAL_S": "0.5",
        "BACKFILL_FLEET_MAX_RETRIES": str(MAX_ATTEMPTS),
        "BACKFILL_FLEET_TIMEOUT_S": str(FLEET_TIMEOUT_S),
    }
    with launch_stack(
        tmp_path_factory.mktemp("deployments"),
        settings=settings,
        s3=s3,
        fleet_url=f"{proxy_a.base_url},{fleet_b.base_url}",
        name="deployments",
        redis_url=own_redis,
    ) as s:
        yield s
    _print_fault_table(request)


@pytest.fixture(scope="module")
def own_db(stack2: Stack) -> str:
    return stack2.database_url


@pytest.fixture
def client2(stack2: Stack) -> Any:
    import openai

    return openai.OpenAI(base_url=stack2.base_url, api_key=stack2.key, max_retries=0, timeout=60)


def breaker_state(redis_url: str, deployment: str) -> str:
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    return str(r.hget(f"backfill:breaker:{deployment}", "state") or BreakerState.closed)


def restart_frontend(fleet: Fleet) -> None:
    assert fleet.frontend is not None
    fleet.frontend.start()
    fleet.wait_ready(60)


def body(max_tokens: int = 4) -> dict[str, Any]:
    return chat_line(0, max_tokens=max_tokens)["body"]  # type: ignore[no-any-return]


# -- the fault proxy itself ---------------------------------------------------------------


def test_fault_proxy_injects_each_fault(fleet_a: Fleet) -> None:
    timeout = httpx.Timeout(5.0, read=1.0)
    with FaultProxy(fleet_a.origin) as proxy, httpx.Client(timeout=timeout, trust_env=False) as c:
        url = proxy.base_url + "/chat/completions"
        assert c.post(url, json=body()).status_code == 200
        proxy.inject(Fault.error, count=2, status=502)
        assert [c.post(url, json=body()).status_code for _ in range(3)] == [502, 502, 200]
        proxy.inject(Fault.error, count=1)
        assert c.get(proxy.base_url + "/models").status_code == 200  # only POSTs meet faults
        assert c.post(url, json=body()).status_code == 503
        proxy.inject(Fault.reset, count=1)
        with pytest.raises(httpx.TransportError) as reset:
            c.post(url, json=body())
        assert not isinstance(reset.value, httpx.TimeoutException)
        proxy.inject(Fault.timeout, count=1)
        with pytest.raises(httpx.ReadTimeout):
            c.post(url, json=body())
        proxy.inject(Fault.stall, count=1)
        with c.stream("POST", url, json=body()) as resp:
            assert resp.status_code == 200 and int(resp.headers["content-length"]) > 0  # headers came
            with pytest.raises(httpx.ReadTimeout):
                resp.read()
        proxy.inject(Fault.error, for_s=0.5)
        assert c.post(url, json=body()).status_code == 503
        time.sleep(0.6)
        assert c.post(url, json=body()).status_code == 200
        assert proxy.stats == {"forwarded": 3, "passed": 1, "error": 4, "reset": 1, "timeout": 1, "stall": 1}


# -- the fleet client over several deployments, in this process ----------------------------


def test_fleet_client_fails_over_and_never_waits_on_a_stalled_body(fleet_a: Fleet, own_redis: str) -> None:
    async def go() -> None:
        dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens: connections are refused
        with FaultProxy(fleet_a.origin) as proxy:
            fleet = FleetClient([dead, proxy.base_url], timeout_s=30, body_idle_timeout_s=1.0, redis_url=own_redis)
            try:
                replies = await asyncio.gather(*(fleet.post(CHAT, body()) for _ in range(12)))
                assert [r.status_code for r in replies] == [200] * 12  # refused ones went to the other
                assert {r.deployment for r in replies} == {proxy.base_url}
                assert await fleet.breakers[0].state() is BreakerState.open
                assert breaker_state(own_redis, dead) == "open"  # where every worker sees it
                proxy.inject(Fault.stall, count=1)
                stalled = await fleet.post(CHAT, body())
                assert stalled.status_code == 504 and stalled.transient and stalled.sent
                assert stalled.latency_s < 5  # the body's idle timeout, not the 30 s for the exchange
                assert (await fleet.post(CHAT, body())).status_code == 200
            finally:
                await fleet.aclose()

    asyncio.run(go())


def test_an_open_circuit_stops_sending_and_the_probe_closes_it(fleet_a: Fleet, own_redis: str) -> None:
    """One deployment answering 5xx for 2 s: the breaker opens after min_failures, the client
    waits instead of sending, half-open probes go one at a time, and the first success closes it."""

    async def go() -> None:
        policy = BreakerPolicy(cooldown_s=0.5)
        with FaultProxy(fleet_a.origin) as proxy:
            fleet = FleetClient([proxy.base_url], timeout_s=10, redis_url=own_redis, breaker_policy=policy)
            try:
                proxy.inject(Fault.error, for_s=2.0)
                started = time.monotonic()
                replies = []
                while not replies or replies[-1].status_code != 200:
                    assert time.monotonic() - started < 10
                    replies.append(await fleet.post(CHAT, body()))
                # Without the breaker this loop sends hundreds of requests into the outage.
                assert proxy.stats["error"] <= policy.min_failures + 2.0 / policy.cooldown_s + 1, proxy.stats
                assert all(r.sent for r in replies)  # every caller waited for a probe, none gave up
                assert await fleet.breakers[0].state() is BreakerState.closed

                # A caller that may wait only 0.3 s gives up without sending anything.
                brief = FleetClient(
                    [proxy.base_url], timeout_s=10, redis_url=own_redis, breaker_policy=policy, open_wait_s=0.3
                )
                try:
                    proxy.inject(Fault.error, for_s=60)
                    for _ in range(policy.min_failures):
                        assert (await brief.post(CHAT, body())).status_code == 503
                    errors_before = proxy.stats["error"]
                    gave_up = await brief.post(CHAT, body())
                    assert gave_up.status_code == 503 and gave_up.transient and not gave_up.sent
                    assert gave_up.latency_s < 1.0 and proxy.stats["error"] == errors_before
                finally:
                    proxy.clear()
                    await brief.aclose()
            finally:
                await fleet.aclose()

    asyncio.run(go())


# -- backfill on two deployments ----------------------------------------------------------


@dataclass
class Load:
    """Batches submitted every `every_s` seconds from a thread, as clients keep doing."""

    client: Any
    lines: int = 150
    every_s: float = 2.0
    batches: dict[str, list[str]] = field(default_factory=dict)  # batch id -> its custom ids
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def submit(self) -> None:
        tag = secrets.token_hex(3)
        lines = [chat_line(i, max_tokens=8, prefix=f"{tag} ") for i in range(self.lines)]
        for line in lines:
            line["custom_id"] = f"{tag}-{line['custom_id']}"
        f = upload(self.client, jsonl(lines))
        b = self.client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
        self.batches[b.id] = [line["custom_id"] for line in lines]

    def __enter__(self) -> Load:
        def run() -> None:
            while not self._stop.wait(self.every_s):
                self.submit()

        self.submit()
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)


def check_every_line_once(client: Any, batches: dict[str, list[str]], db_url: str) -> dict[str, int]:
    """Every batch completed with exactly one output or error line per request, the ledger one
    row per executed request, no line sent more often than the cap. Returns the tallies."""
    import psycopg

    lost = duplicated = failed = 0
    for batch_id, ids in batches.items():
        done = wait_for(client, batch_id, {"completed"}, timeout_s=240)
        out = [o["custom_id"] for o in read_lines(client, done.output_file_id)]
        err = read_lines(client, done.error_file_id)
        got = out + [e["custom_id"] for e in err]
        lost += len(set(ids) - set(got))
        duplicated += len(got) - len(set(got))
        failed += len(err)
        assert not err, err[:3]  # a healthy deployment was always there: no line needed to fail
    with psycopg.connect(db_url.replace("+psycopg", "")) as conn:
        ledger, distinct = conn.execute(
            "SELECT count(*), count(DISTINCT (batch_id, line)) FROM usage_ledger"
        ).fetchone()  # type: ignore[misc]
        (max_attempts,) = conn.execute("SELECT coalesce(max(attempts), 0) FROM batch_requests").fetchone()  # type: ignore[misc]
    total = sum(len(ids) for ids in batches.values())
    assert (lost, duplicated) == (0, 0)
    assert ledger == distinct, "a request billed twice"
    assert max_attempts < MAX_ATTEMPTS
    return {"lines": total, "lost": lost, "duplicated": duplicated, "failed": failed, "max_attempts": max_attempts}


def test_a_stopped_frontend_mid_batch_leaves_the_batch_to_the_other(
    client2: Any, stack2: Stack, fleet_b: Fleet, own_redis: str, own_db: str
) -> None:
    lines = [chat_line(i, max_tokens=8) for i in range(800)]
    b = client2.batches.create(input_file_id=upload(client2, jsonl(lines)).id, endpoint=CHAT, completion_window="24h")
    wait_until("batch under way", lambda: client2.batches.retrieve(b.id).request_counts.completed >= 100, 120)
    assert fleet_b.frontend is not None
    fleet_b.frontend.kill()
    try:
        opened_s = wait_until("B's circuit open", lambda: breaker_state(own_redis, fleet_b.base_url) == "open", 20)
        assert client2.batches.retrieve(b.id).status == "in_progress", "the batch should outlast the stop"
        tally = check_every_line_once(client2, {b.id: [line["custom_id"] for line in lines]}, own_db)
    finally:
        restart_frontend(fleet_b)
    # B is back: a half-open probe finds it and closes its circuit while new work flows.
    started = time.monotonic()
    with Load(client2, lines=100, every_s=3.0) as load:
        closed_s = wait_until("B's circuit closed", lambda: breaker_state(own_redis, fleet_b.base_url) == "closed", 60)
    check_every_line_once(client2, load.batches, own_db)
    FAULT_TABLE.append(
        dict(
            fault="frontend B killed mid-batch",
            did=f"circuit B open after {opened_s:.1f} s; lines on A",
            recover=f"{time.monotonic() - started:.0f} s after restart (closed at {closed_s:.1f} s)",
            **tally,
        )
    )


def test_faults_through_the_proxy_leave_every_batch_whole(
    client2: Any, stack2: Stack, proxy_a: FaultProxy, fleet_b: Fleet, own_redis: str, own_db: str
) -> None:
    with Load(client2) as load:
        wait_until("load under way", lambda: proxy_a.stats.get("forwarded", 0) >= 50, 120)
        for fault in (Fault.error, Fault.timeout, Fault.reset, Fault.stall):
            # A held request fails only when the client's timeout ends it: watch that long too.
            late = FLEET_TIMEOUT_S + 2 if fault in (Fault.timeout, Fault.stall) else 0.0
            p = run_phase(proxy_a, own_redis, fault, span_s=4.0, late_s=late)
            assert p.opened_s is not None, f"{fault}: circuit A never opened"
            FAULT_TABLE.append(
                dict(
                    fault=f"{fault.value} on A for 4 s",
                    did=f"{p.met} requests met it; circuit A open at {p.opened_s:.1f} s",
                    recover=f"{p.recovered_s:.1f} s after the fault cleared",
                )
            )
        # Every deployment failing at once: B's frontend dies while A answers 5xx.
        assert fleet_b.frontend is not None
        fleet_b.frontend.kill()
        try:
            p = run_phase(proxy_a, own_redis, Fault.error, span_s=5.0)
            b_state = breaker_state(own_redis, fleet_b.base_url)
        finally:
            restart_frontend(fleet_b)
        assert p.opened_s is not None and b_state == "open", (p, b_state)
        FAULT_TABLE.append(
            dict(
                fault="B killed + 5xx on A for 5 s",
                did=f"{p.met} requests met it; both circuits open, drains wait for a probe",
                recover=f"{p.recovered_s:.1f} s after A's fault cleared",
            )
        )
    tally = check_every_line_once(client2, load.batches, own_db)
    FAULT_TABLE.append(dict(fault="(all proxy phases)", did=f"{len(load.batches)} batches", recover="", **tally))


def test_each_deployment_holds_its_own_limit(
    client2: Any, stack2: Stack, fleet_a: Fleet, fleet_b: Fleet, own_redis: str, own_db: str
) -> None:
    """Leases are per deployment: both take lines, and neither fleet's own in-flight gauge passes
    its limit (BACKFILL_MAX_INFLIGHT, per deployment) by more than one lease."""
    limit = int(stack2.env["BACKFILL_MAX_INFLIGHT"])
    r = redis.Redis.from_url(own_redis, decode_responses=True)
    pools = {"A": "backfill:lease:fleet", "B": "backfill:lease:fleet:1"}
    held = {k: 0 for k in pools}
    lines = [chat_line(i, max_tokens=64, prefix="per-deployment ") for i in range(600)]
    with FleetInflight(fleet_a.frontend_metrics_url) as gauge_a, FleetInflight(fleet_b.frontend_metrics_url) as gauge_b:
        b = client2.batches.create(
            input_file_id=upload(client2, jsonl(lines)).id, endpoint=CHAT, completion_window="24h"
        )
        while client2.batches.retrieve(b.id).status not in ("completed", "failed"):
            for k, key in pools.items():
                held[k] = max(held[k], r.zcount(key, time.time(), "+inf"))
            time.sleep(0.1)
    tally = check_every_line_once(client2, {b.id: [line["custom_id"] for line in lines]}, own_db)
    peaks = {"A": gauge_a.max_seen, "B": gauge_b.max_seen}
    assert all(held.values()), f"both deployments should have carried lines: {held}"
    assert all(v is not None and v <= limit + 1 for v in peaks.values()), (peaks, limit)
    FAULT_TABLE.append(
        dict(
            fault="(per-deployment limits)",
            did=f"leases held at most {held}; fleet in-flight peaks {peaks} (limit {limit} each)",
            recover="",
            **tally,
        )
    )


@dataclass
class Phase:
    met: int  # requests that met the fault
    opened_s: float | None  # when A's circuit opened, from the fault's start
    recovered_s: float  # from the fault's end until A took lines again (forwarded, circuit closed)


def run_phase(proxy: FaultProxy, redis_url: str, fault: Fault, *, span_s: float, late_s: float = 0.0) -> Phase:
    a = proxy.base_url
    met_before = proxy.stats.get(fault.value, 0)
    started = time.monotonic()
    proxy.inject(fault, for_s=span_s)
    opened = None
    forwarded_at_clear: int | None = None
    while True:
        elapsed = time.monotonic() - started
        if forwarded_at_clear is None and elapsed >= span_s:
            forwarded_at_clear = proxy.stats.get("forwarded", 0)
        if opened is None and breaker_state(redis_url, a) != "closed":
            opened = elapsed
        if elapsed >= span_s + late_s:
            break
        time.sleep(0.05)
    assert forwarded_at_clear is not None
    wait_until(
        f"{a} back in use",
        lambda: proxy.stats.get("forwarded", 0) > forwarded_at_clear and breaker_state(redis_url, a) == "closed",
        60,
        every_s=0.05,
    )
    return Phase(proxy.stats.get(fault.value, 0) - met_before, opened, time.monotonic() - started - span_s)


def _print_fault_table(request: pytest.FixtureRequest) -> None:
    if not FAULT_TABLE:
        return
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        print("\nfault | what the service did | time to recover | lines | lost | duplicated | failed | max attempts")
        for row in FAULT_TABLE:
            print(
                " | ".join(
                    str(row.get(k, ""))
                    for k in ("fault", "did", "recover", "lines", "lost", "duplicated", "failed", "max_attempts")
                )
            )
