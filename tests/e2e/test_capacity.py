"""Capacity control and dispatch policy on the real services: the Dynamo frontend + mocker fleet in
the interference regime (a small KV cache, so batch load slows interactive decoding), Redis for
leases and the controller's published limit, Postgres for the lines. The Dispatcher and the
controller run in this process, exactly as a drain task and the scheduler run them."""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from backfill.scheduler.capacity.admission import Admission
from backfill.scheduler.capacity.controller import CapacityLoop
from backfill.scheduler.capacity.law import ControlConfig, Controller, Decision, Slo
from backfill.scheduler.capacity.telemetry import FleetTelemetry
from backfill.storage.leases import FLEET_POOL, RedisLeaseStore, limit_key
from backfill.storage.settings import MetricsEndpoint as Endpoint
from tests.conftest import ROOT
from tests.process_env import scratch_database

pytestmark = pytest.mark.e2e

MODEL = "tiny-chat"
WORDS = "def return self value import class lambda result items append while print format string list".split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def busy_fleet() -> Iterator[Any]:
    from backfill.devfleet.fleet import Fleet

    with Fleet(
        num_workers=2,
        speedup_ratio=1.0,
        num_gpu_blocks=2048,
        max_num_seqs=64,
        max_num_batched_tokens=8192,
        model_name=MODEL,
    ) as f:
        yield f


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A database of its own (the session stack's drains must not pick these batches up), used
    in-process through the usual settings."""
    with scratch_database("backfill_capacity", tmp_path_factory.mktemp("capacity-home")) as url:
        yield url


@pytest.fixture
def leases(redis_url: str) -> RedisLeaseStore:
    return RedisLeaseStore(redis_url, namespace=f"cap-{secrets.token_hex(4)}")


def make_batch(
    team: str, n: int, *, expires_in_s: float, max_tokens: int, prompt_words: int = 40, weight: int = 1
) -> str:
    """A validated, in-progress batch, through the same service functions the API uses."""
    from backfill.jobs import batches, files, teams
    from backfill.jobs.models import Team, new_id
    from backfill.jobs.validation.outcome import apply_validation
    from backfill.jobs.validation.scan import Limits, validate_lines
    from backfill.storage.db import unit_of_work
    from backfill.storage.objects import get_object_store

    rng = random.Random(team + str(n))
    data = b"".join(
        orjson.dumps(
            {
                "custom_id": f"{team}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"{team} {i} " + words(rng, prompt_words)}],
                    "max_tokens": max_tokens,
                },
            }
        )
        + b"\n"
        for i in range(n)
    )
    store = get_object_store()
    with unit_of_work() as s:
        team_row = teams.get_or_create_team(s, name=team)
        s.get(Team, team_row.id).weight = weight  # type: ignore[union-attr]
        team_id = team_row.id
    file_id = new_id()
    store.put(files.file_key(team_id, file_id), [data])
    window = f"{int(expires_in_s)}s"
    with unit_of_work() as s:
        files.record_upload(
            s,
            file_id=file_id,
            team_id=team_id,
            purpose="batch",
            filename="t.jsonl",
            size=len(data),
            expires_after_s=None,
            default_batch_expiry_s=86400,
        )
        batch_id = batches.create_batch(
            s,
            team_id=team_id,
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window=window,
            windows={window: int(expires_in_s)},
            multipliers={},
        ).id
    result = validate_lines(
        store.open(files.file_key(team_id, file_id)),
        endpoint="/v1/chat/completions",
        served_models={MODEL},
        limits=Limits(max_requests=n, max_line_bytes=1 << 20, max_errors=5),
    )
    with unit_of_work() as s:
        assert apply_validation(s, batch_id=batch_id, result=result) == "in_progress"
    return batch_id


def counts(*batch_ids: str) -> dict[str, int]:
    from backfill.jobs.models import Batch
    from backfill.storage.db import unit_of_work

    with unit_of_work() as s:
        return {b: s.get(Batch, b).completed for b in batch_ids}  # type: ignore[union-attr]


def retire(*batch_ids: str) -> None:
    from backfill.jobs import batches
    from backfill.storage.db import unit_of_work

    with unit_of_work() as s:
        for b in batch_ids:
            batches.cancel_batch(s, team_id=None, batch_id=b)


class Drain:
    """Dispatchers run back to back in a thread of their own, as a worker's drain tasks would."""

    def __init__(self, admission: Admission, leases: RedisLeaseStore, fleet_url: str) -> None:
        from backfill.scheduler.runtime import make_planner

        self.admission, self.leases, self.fleet_url = admission, leases, fleet_url
        self.planner = make_planner(refresh_s=0.25, admission=admission)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._loop()), daemon=True)

    async def _loop(self) -> None:
        from backfill.scheduler.drain.dispatcher import Dispatcher
        from backfill.scheduler.fleet.client import FleetClient
        from backfill.storage.objects import get_object_store

        fleet = FleetClient([self.fleet_url], timeout_s=120)

        async def one(offset_s: float) -> None:
            # Two staggered drains, as with BACKFILL_DRAINS=2: while one waits for its last
            # replies at the end of a slice, the other keeps releasing.
            await asyncio.sleep(offset_s)
            while not self.stopping.is_set():
                d = Dispatcher(
                    store=get_object_store(),
                    leases=self.leases,
                    admission=self.admission,
                    fleet=fleet,
                    planner=self.planner,
                    max_attempts=3,
                )
                await d.run(3.0, max_drains=8)
                await asyncio.sleep(0.05)

        try:
            await asyncio.gather(one(0.0), one(1.5))
        finally:
            await fleet.aclose()

    def __enter__(self) -> Drain:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(timeout=60)


def endpoints(fleet: Any) -> list[Endpoint]:
    return [Endpoint("frontend", fleet.frontend_metrics_url)] + [Endpoint(r, u) for r, u in fleet.worker_metrics_urls]


class Control:
    """The capacity loop in a thread, recording its decisions."""

    def __init__(self, cfg: ControlConfig, eps: list[Endpoint], leases: RedisLeaseStore) -> None:
        self.decisions: list[tuple[float, Decision]] = []
        self.loop = CapacityLoop(
            Controller(cfg), FleetTelemetry(eps), leases, on_decision=lambda t, d: self.decisions.append((t, d))
        )
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.loop.run, args=(self.stopping,), daemon=True)

    def limits(self, since: float, until: float | None = None) -> list[int]:
        return [d.limit for t, d in self.decisions if t >= since and (until is None or t < until)]

    def __enter__(self) -> Control:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)


def sample(fn: Callable[[], int], seconds: float, every_s: float = 0.1) -> list[int]:
    out = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        out.append(fn())
        time.sleep(every_s)
    return out


# -- leases ----------------------------------------------------------------------------------

DRAIN_SCRIPT = """
import asyncio, sys
from backfill.scheduler.capacity.admission import Admission
from backfill.scheduler.drain.dispatcher import Dispatcher
from backfill.scheduler.fleet.client import FleetClient
from backfill.storage.leases import RedisLeaseStore
from backfill.scheduler.runtime import make_planner
from backfill.storage.objects import get_object_store

url, ns, fleet_url = sys.argv[1:4]
leases = RedisLeaseStore(url, namespace=ns)
admission = Admission(leases, fixed_limit=8, ttl_s=2.0)

async def main():
    fleet = FleetClient([fleet_url], timeout_s=120)
    while True:
        d = Dispatcher(store=get_object_store(), leases=leases, admission=admission, fleet=fleet,
                       planner=make_planner(admission=admission), max_attempts=3)
        await d.run(60, max_drains=4)

asyncio.run(main())
"""


def test_leases_of_a_killed_worker_lapse(
    db: str, busy_fleet: Any, leases: RedisLeaseStore, redis_url: str, request: pytest.FixtureRequest
) -> None:
    from backfill.jobs import sweeps
    from backfill.scheduler.ticker import Ticker
    from backfill.storage.db import unit_of_work

    batch = make_batch("lapse", 40, expires_in_s=3600, max_tokens=3000)  # replies that take ~20 s
    request.addfinalizer(lambda: retire(batch))  # pass or fail, the module's later tests never see it
    proc = subprocess.Popen(
        [sys.executable, "-c", DRAIN_SCRIPT, redis_url, leases.ns, busy_fleet.base_url],
        env=dict(os.environ),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        holders: list[str] = []
        while leases.count(FLEET_POOL) < 8 or not holders:
            assert proc.poll() is None and time.monotonic() < deadline, "the drain never took its leases"
            time.sleep(0.2)
            with unit_of_work() as s:
                holders = sweeps.running_claim_tokens(s)
        assert len(holders) == 1 and leases.alive(holders) == set(holders)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # no goodbye: nothing gets released
        proc.wait()
    killed = time.monotonic()
    assert leases.count(FLEET_POOL) == 8  # still held: nobody released them
    while leases.count(FLEET_POOL) > 0:
        assert time.monotonic() - killed < 4.0, "leases outlived their TTL"
        time.sleep(0.05)
    assert time.monotonic() - killed >= 0.5  # they lapsed by TTL, not by a release
    assert leases.alive(holders) == set()
    # The scheduler's ticks hand the dead drain's lines back (once two ticks have seen its heartbeat
    # missing for a whole TTL), and the capacity is free again.
    ticker = Ticker(leases=leases, enqueue=lambda *_: None, drains=0)
    # Two whole heartbeat TTLs and then some: the reclaim waits one TTL from the first tick that
    # sees the heartbeat missing (a deadline of exactly one TTL raced it, losing by milliseconds).
    deadline = time.monotonic() + 2 * ticker.reconciler.heartbeat_ttl_s + 5
    while True:
        ticker.tick()
        with unit_of_work() as s:
            if sweeps.running_claim_tokens(s) == []:
                break
        assert time.monotonic() < deadline, "the dead drain's lines were never reclaimed"
        time.sleep(0.3)
    assert len(leases.acquire(FLEET_POOL, limit=8, n=8, ttl_s=1.0)) == 8


# -- the controller ---------------------------------------------------------------------------


async def _interactive(base_url: str, streams: int, seconds: float) -> int:
    """Many concurrent agent-like requests: long unique prompts, streamed replies."""
    url = base_url + "/chat/completions"
    stop = time.monotonic() + seconds
    done = 0

    async def one(client: httpx.AsyncClient, k: int) -> None:
        nonlocal done
        rng = random.Random(k)
        while time.monotonic() < stop:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": words(rng, 3500)}],
                "max_tokens": 150,
                "stream": True,
            }
            async with client.stream("POST", url, json=body) as r:
                async for _ in r.aiter_lines():
                    pass
            done += 1

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=streams + 4)) as client:
        await asyncio.gather(*(one(client, k) for k in range(streams)))
    return done


def test_concurrency_follows_interactive_latency(db: str, busy_fleet: Any, leases: RedisLeaseStore) -> None:
    batch = make_batch("follow", 4000, expires_in_s=3600, max_tokens=200, prompt_words=150)
    cfg = ControlConfig(slo=Slo(ttft_s=0.5, itl_s=0.014), floor=1, ceiling=64)
    admission = Admission(leases, fixed_limit=64, ttl_s=5.0, controlled=True, floor=1)
    with Control(cfg, endpoints(busy_fleet), leases) as control, Drain(admission, leases, busy_fleet.base_url):
        time.sleep(8.0)  # batch alone: the limit grows into the room under the SLO
        t1 = time.time()
        before = control.limits(t1 - 2.0)
        assert min(before) >= 8, before
        served = asyncio.run(_interactive(busy_fleet.base_url, streams=24, seconds=8.0))
        t2 = time.time()
        during = control.limits(t2 - 4.0, t2)
        time.sleep(8.0)  # interactive load gone: the room comes back
        after = control.limits(time.time() - 2.0)
    assert served > 24
    reasons = {d.reason for t, d in control.decisions if t1 <= t < t2}
    assert reasons & {"step-model", "over-slo", "cut", "queue"}, reasons
    level = sum(before) / len(before)
    assert sum(during) / len(during) <= 0.5 * level, (before, during)
    assert sum(after) / len(after) >= 0.7 * level, (before, after)
    retire(batch)


def test_no_telemetry_no_batch_work_beyond_the_floor(db: str, busy_fleet: Any, leases: RedisLeaseStore) -> None:
    from backfill.devfleet.processes import free_port

    batch = make_batch("blind", 3000, expires_in_s=3600, max_tokens=24)
    cfg = ControlConfig(slo=Slo(ttft_s=0.5, itl_s=0.014), floor=2, ceiling=64)
    admission = Admission(leases, fixed_limit=64, ttl_s=5.0, controlled=True, floor=2)
    with Control(cfg, endpoints(busy_fleet), leases) as control, Drain(admission, leases, busy_fleet.base_url):
        time.sleep(5.0)
        assert max(control.limits(time.time() - 2.0)) > 4  # with telemetry: well above the floor
        # The metrics stop answering (the loop's own telemetry now points at nothing).
        swapped = time.time()
        control.loop.telemetry = FleetTelemetry([Endpoint("frontend", f"http://127.0.0.1:{free_port()}/metrics")])
        # A step whose scrape began before the swap may still publish a limit from live
        # telemetry: wait for the loop's first blind decision, so the floor is what is published.
        deadline = time.monotonic() + 30.0
        while not any(t >= swapped and d.reason == "no-telemetry" for t, d in control.decisions):
            assert time.monotonic() < deadline, "the loop never noticed its telemetry was gone"
            time.sleep(0.05)
        # Requests already in flight finish (how long they take is the machine's, so wait for
        # them rather than a fixed time); then nothing new goes beyond the floor.
        while leases.count(FLEET_POOL) > 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        blind_from = time.time()
        held = sample(lambda: leases.count(FLEET_POOL), 4.0)
        done_before = counts(batch)[batch]
        time.sleep(1.0)
        assert counts(batch)[batch] > done_before  # the floor still trickles work through
    assert max(held) <= 2, held
    assert {d.reason for t, d in control.decisions if t >= blind_from} == {"no-telemetry"}
    # And with the controller gone altogether, its word lapses: admission falls back to the floor.
    time.sleep(1.2)
    assert leases.read(limit_key(FLEET_POOL)) is None and admission.limit() == 2
    retire(batch)


# -- the policy -------------------------------------------------------------------------------


def test_deadline_threatened_batch_overtakes_a_relaxed_one(db: str, busy_fleet: Any, leases: RedisLeaseStore) -> None:
    admission = Admission(leases, fixed_limit=8, ttl_s=5.0)
    relaxed = make_batch("relaxed", 3000, expires_in_s=3600, max_tokens=48)
    with Drain(admission, leases, busy_fleet.base_url):
        time.sleep(2.0)
        start = counts(relaxed)[relaxed]
        time.sleep(3.0)
        per_s = (counts(relaxed)[relaxed] - start) / 3.0  # the whole fleet's batch rate, in lines/s
        assert per_s > 2
        # Ten seconds of the whole rate, due in sixteen: on a fair half it would take twenty.
        n, window = int(per_s * 10), 16.0
        urgent = make_batch("urgent", n, expires_in_s=window, max_tokens=48)
        created = time.monotonic()
        base = counts(relaxed)[relaxed]
        while counts(urgent)[urgent] < n:
            assert time.monotonic() - created < window, f"missed its window: {counts(urgent)} of {n}"
            time.sleep(0.2)
        took = time.monotonic() - created
        relaxed_done = counts(relaxed)[relaxed] - base
    share = n / (n + relaxed_done)
    assert share >= 0.6, (share, took)  # more than its fair half: it overtook
    assert counts(relaxed)[relaxed] < 3000
    retire(relaxed, urgent)


def test_two_teams_share_fairly(db: str, busy_fleet: Any, leases: RedisLeaseStore) -> None:
    admission = Admission(leases, fixed_limit=8, ttl_s=5.0)
    # Team A's backlog is older and due sooner: plain EDF would serve it first, all of it.
    big = make_batch("team-a", 3000, expires_in_s=3600, max_tokens=48)
    with Drain(admission, leases, busy_fleet.base_url):
        time.sleep(2.0)
        small = make_batch("team-b", 150, expires_in_s=86400, max_tokens=48)
        start = counts(big, small)
        deadline = time.monotonic() + 40
        while counts(small)[small] < 150:
            assert time.monotonic() < deadline, counts(big, small)
            time.sleep(0.2)
        end = counts(big, small)
    a, b = end[big] - start[big], end[small] - start[small]
    assert 0.4 <= b / (a + b) <= 0.6, (a, b)
    assert end[big] < 1500  # the small batch finished long before the backlog
    retire(big, small)
