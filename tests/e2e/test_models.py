"""Many models, each on its own capacity: routing by model over two deployments.

Deployment X is the session's two-model fleet (tiny-chat on two workers, tiny-chat-large on one,
as `backfill up` serves them); deployment Y a fleet of its own serving tiny-chat only. Each is
reached through a fault proxy that counts the requests it sees per model, so a test can show
where every line went. backfill runs as real processes on a database and a Redis of their own.
The last test runs a stack of its own on the session's fleet alone, with capacity control on: a
controller per model, each on its own model's workers' metrics.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from backfill.devfleet.faultproxy import FaultProxy
from backfill.devfleet.fleet import LARGE_MODEL, Fleet
from backfill.devfleet.s3 import SeaweedS3
from backfill.devfleet.services import private_redis
from backfill.devfleet.stack import Stack, launch_stack
from tests.e2e.helpers import MODEL, chat_line, jsonl, read_lines, upload, wait_for, wait_until

pytestmark = pytest.mark.e2e

FIXED_LIMIT = 6  # BACKFILL_MAX_INFLIGHT here: each (deployment, model) pool's own bound


@pytest.fixture(scope="module")
def fleet_y() -> Iterator[Fleet]:
    with Fleet(num_workers=1, speedup_ratio=5.0, model_name=MODEL) as f:
        yield f


@pytest.fixture(scope="module")
def proxy_x(fleet: Fleet) -> Iterator[FaultProxy]:
    assert fleet.models == [MODEL, LARGE_MODEL]
    with FaultProxy(fleet.origin) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def proxy_y(fleet_y: Fleet) -> Iterator[FaultProxy]:
    with FaultProxy(fleet_y.origin) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[str]:
    shared = redis_url.rsplit("/", 1)[0] + "/8"
    with private_redis(tmp_path_factory.mktemp("redis-models"), shared_url=shared) as url:
        yield url


@pytest.fixture(scope="module")
def models_stack(
    own_redis: str, s3: SeaweedS3, proxy_x: FaultProxy, proxy_y: FaultProxy, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    settings = {
        "BACKFILL_MAX_INFLIGHT": str(FIXED_LIMIT),
        "BACKFILL_LEASE_TTL_S": "4",
        "BACKFILL_DRAIN_SLICE_S": "10",
        "BACKFILL_TICK_INTERVAL_S": "0.5",
        "BACKFILL_MODELS_CACHE_S": "2",
    }
    with launch_stack(
        tmp_path_factory.mktemp("models"),
        settings=settings,
        s3=s3,
        fleet_url=f"{proxy_x.base_url},{proxy_y.base_url}",
        name="models",
        redis_url=own_redis,
        flush=True,
    ) as s:
        yield s


@pytest.fixture
def mclient(models_stack: Stack) -> Any:
    import openai

    return openai.OpenAI(base_url=models_stack.base_url, api_key=models_stack.key, max_retries=0, timeout=60)


def _batch(client: Any, model: str, n: int, tag: str) -> Any:
    lines = [chat_line(i, model=model, max_tokens=16, prefix=f"{tag} {i} ") for i in range(n)]
    f = upload(client, jsonl(lines), name=f"{tag}.jsonl")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")


def test_both_models_listed(mclient: Any) -> None:
    assert {m.id for m in mclient.models.list().data} == {MODEL, LARGE_MODEL}


def test_lines_go_only_to_deployments_serving_their_model(
    mclient: Any, proxy_x: FaultProxy, proxy_y: FaultProxy
) -> None:
    before_x, before_y = proxy_x.by_model, proxy_y.by_model
    large = _batch(mclient, LARGE_MODEL, 40, "large")
    small = _batch(mclient, MODEL, 40, "small")
    for b, model in ((large, LARGE_MODEL), (small, MODEL)):
        done = wait_for(mclient, b.id, {"completed", "failed", "expired"}, timeout_s=240)
        assert done.status == "completed", done
        assert done.request_counts.completed == 40, done.request_counts
        assert {line["response"]["body"]["model"] for line in read_lines(mclient, done.output_file_id)} == {model}

    def seen(proxy: FaultProxy, before: dict[str, int], model: str) -> int:
        return proxy.by_model.get(model, 0) - before.get(model, 0)

    # Deployment Y does not serve the large model: not one of its lines reached it.
    assert seen(proxy_y, before_y, LARGE_MODEL) == 0
    assert seen(proxy_x, before_x, LARGE_MODEL) >= 40
    # The small model's lines were spread over both deployments that serve it.
    assert seen(proxy_x, before_x, MODEL) > 0 and seen(proxy_y, before_y, MODEL) > 0
    assert seen(proxy_x, before_x, MODEL) + seen(proxy_y, before_y, MODEL) >= 40


def test_a_model_no_deployment_serves_fails_validation(mclient: Any) -> None:
    b = _batch(mclient, "no-such-model", 3, "unknown")
    done = wait_for(mclient, b.id, {"failed", "completed"}, timeout_s=60)
    assert done.status == "failed"
    errors = done.errors.data
    assert errors and errors[0].line == 1 and "no-such-model" in errors[0].message, errors


def test_a_saturated_model_never_holds_back_the_others_batch(
    mclient: Any, models_stack: Stack, proxy_x: FaultProxy
) -> None:
    """Deployment X serves both models: the large model's long lines keep its pool full, and the
    small model's batch still runs at its own full fixed limit there, side by side (with one pool
    per deployment, the two shared one limit). The dashboard and /metrics show each pool."""
    slow = [chat_line(i, model=LARGE_MODEL, max_tokens=400, prefix=f"slow {i} ") for i in range(48)]
    # Enough small lines that both deployments serving the small model stay full of them.
    fast = [chat_line(i, model=MODEL, max_tokens=120, prefix=f"fast {i} ") for i in range(240)]
    batches = []
    for name, lines in (("slow", slow), ("fast", fast)):
        f = upload(mclient, jsonl(lines), name=f"{name}.jsonl")
        batches.append(
            mclient.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        )
    headers = {"Authorization": f"Bearer {models_stack.admin_key}"}
    both_full = False
    seen: dict[str, int] = {}
    with httpx.Client(base_url=models_stack.base_url, headers=headers, timeout=10) as http:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            pools = {p["pool"]: p for p in http.get("/dashboard/fleet").json()["pools"]}
            assert {f"fleet/{MODEL}", f"fleet/{LARGE_MODEL}", "fleet:1"} == set(pools), pools
            assert pools[f"fleet/{LARGE_MODEL}"]["model"] == LARGE_MODEL and pools["fleet:1"]["model"] is None
            for name, p in pools.items():
                assert p["limit"] == FIXED_LIMIT and p["batch_inflight"] <= FIXED_LIMIT, p
                seen[name] = max(seen.get(name, 0), p["batch_inflight"])
            if pools[f"fleet/{LARGE_MODEL}"]["batch_inflight"] == FIXED_LIMIT:
                both_full |= pools[f"fleet/{MODEL}"]["batch_inflight"] == FIXED_LIMIT
            if all(mclient.batches.retrieve(b.id).status in ("completed", "failed") for b in batches):
                break
            time.sleep(0.2)
        metrics = httpx.get(models_stack.base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    assert both_full, f"the small model's pool never ran at its full limit beside the large one's: {seen}"
    for b, n in zip(batches, (48, 240), strict=True):
        done = wait_for(mclient, b.id, {"completed", "failed", "expired"}, timeout_s=120)
        assert done.status == "completed" and done.request_counts.completed == n, done
    assert (
        f'backfill_capacity_pool_limit{{deployment="{proxy_x.base_url}",model="{LARGE_MODEL}",pool="fleet/{LARGE_MODEL}"}} {float(FIXED_LIMIT)}'
        in metrics
    )
    assert "backfill_capacity_pool_leases_held{deployment=" in metrics


# -- a controller per model, on the real stack ------------------------------------------------

WORDS = "def return self value import class lambda result items append while print format string list".split()


class InteractiveLoad:
    """Streamed chat requests with long unique prompts, `streams` at a time, sent straight to the
    Dynamo frontend (interactive traffic never goes through backfill) until stopped."""

    def __init__(self, base_url: str, model: str, streams: int) -> None:
        self.url, self.model, self.streams = base_url + "/chat/completions", model, streams
        self.stopping = threading.Event()
        self.served = 0
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _one(self, client: httpx.AsyncClient, k: int) -> None:
        rng = random.Random(k)
        while not self.stopping.is_set():
            prompt = " ".join(rng.choice(WORDS) for _ in range(1000))
            body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 100}
            async with client.stream("POST", self.url, json={**body, "stream": True}) as r:
                async for _ in r.aiter_lines():
                    pass
            self.served += 1

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=self.streams + 4)) as client:
            await asyncio.gather(*(self._one(client, k) for k in range(self.streams)))

    def __enter__(self) -> InteractiveLoad:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(timeout=120)


def test_interactive_load_on_one_model_holds_back_only_that_models_batch(
    fleet: Fleet, s3: SeaweedS3, redis_url: str, tmp_path: Path
) -> None:
    """The scheduler runs a capacity controller per model (each model's workers named in the
    metrics endpoints, as `backfill up` names them). Interactive load on the large model puts its
    latencies over the SLO: its controller cuts its pool's published limit to the floor and its
    batch waits, while the small model, idle, gets its whole ceiling for its batch; once the load
    is gone the large model's batch finishes too.

    The SLO sits below what the large model's interactive load gives (a tenth of a second to the
    first token, a few ms a token on the mocker) and the idle target far above it, so what a
    model's own batch work does to its latencies never cuts it: only interactive traffic does."""
    metrics = ",".join(
        [f"frontend={fleet.frontend_metrics_url}", *(f"{w.role}@{w.model}={w.metrics_url}" for w in fleet.workers)]
    )
    settings = {
        "BACKFILL_CAPACITY_CONTROL": "on",
        "BACKFILL_FLEET_METRICS_URLS": metrics,
        "BACKFILL_MAX_INFLIGHT": str(FIXED_LIMIT),  # the ceiling of each model's controller
        "BACKFILL_CAPACITY_FLOOR": "0",
        "BACKFILL_SLO_TTFT_S": "0.05",
        "BACKFILL_SLO_ITL_S": "0.002",
        "BACKFILL_CAPACITY_IDLE_TARGET": "200",
        "BACKFILL_LEASE_TTL_S": "4",
        "BACKFILL_DRAIN_SLICE_S": "10",
        "BACKFILL_TICK_INTERVAL_S": "0.5",
        "BACKFILL_MODELS_CACHE_S": "2",
    }
    busy, idle = f"fleet/{LARGE_MODEL}", f"fleet/{MODEL}"
    (tmp_path / "redis").mkdir()
    with (
        private_redis(tmp_path / "redis", shared_url=redis_url.rsplit("/", 1)[0] + "/10") as own_redis,
        launch_stack(
            tmp_path / "stack", settings=settings, s3=s3, fleet_url=fleet.base_url, name="permodel", redis_url=own_redis
        ) as stack,
    ):
        client = openai.OpenAI(base_url=stack.base_url, api_key=stack.key, max_retries=0, timeout=60)
        headers = {"Authorization": f"Bearer {stack.admin_key}"}
        with httpx.Client(base_url=stack.base_url, headers=headers, timeout=10) as http:

            def pools() -> dict[str, Any]:
                return {p["pool"]: p for p in http.get("/dashboard/fleet").json()["pools"]}

            # Both controllers steering, on an idle fleet: each has grown its pool's limit off the floor.
            wait_until(
                lambda: f"the controllers never published: {pools()}",
                lambda: all(p["limit"] >= 1 for p in pools().values()),
                timeout_s=60,
                every_s=0.5,
            )
            with InteractiveLoad(fleet.base_url, LARGE_MODEL, streams=12) as load:
                wait_until(
                    lambda: f"the busy model's limit never dropped to the floor: {pools()}",
                    lambda: pools()[busy]["limit"] == 0,
                    timeout_s=60,
                    every_s=0.5,
                )
                held_back = _batch(client, LARGE_MODEL, 24, "held")
                running = [chat_line(i, max_tokens=200, prefix=f"idle {i} ") for i in range(60)]
                f = upload(client, jsonl(running), name="idle.jsonl")
                free = client.batches.create(
                    input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
                )
                busy_limits: list[int] = []
                idle_inflight: list[int] = []
                while client.batches.retrieve(free.id).status not in ("completed", "failed", "expired"):
                    p = pools()
                    busy_limits.append(p[busy]["limit"])
                    idle_inflight.append(p[idle]["batch_inflight"])
                    assert load.thread.is_alive()
                    time.sleep(0.5)
                waited = client.batches.retrieve(held_back.id)
            served = load.served
        assert served > 12
        assert max(idle_inflight) == FIXED_LIMIT, idle_inflight  # the idle model's batch: its whole ceiling
        assert max(busy_limits) <= 1, busy_limits  # the busy model's pool: at the floor, or next to it
        # Its 24 short lines would have finished long before the idle model's 60 long ones.
        counts = waited.request_counts
        assert waited.status == "in_progress" and counts is not None and counts.completed < 24, counts
        done = wait_for(client, free.id, {"completed"}, timeout_s=10)
        assert done.request_counts.completed == 60, done.request_counts
        # The interactive load gone, the large model's controller gives its pool room again.
        done = wait_for(client, held_back.id, {"completed", "failed", "expired"}, timeout_s=240)
        assert done.status == "completed" and done.request_counts.completed == 24, done
