"""Escalation on the real stack (issue 21 B): a batch whose window the fleet's released capacity
cannot make first gets leases beyond the limit, then sends the lines that would still miss to the
overflow deployment; an overflow that fails opens its own breaker and loses nothing.

The fleet is the mocker fleet behind a counting proxy held to one batch request in flight
(`BACKFILL_MAX_INFLIGHT=1`, no controller: no idle capacity to speak of). The overflow deployment
is a fault proxy in front of a second counting proxy to the same fleet, so every send of a line,
to either path, is counted by its prompt.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from sqlalchemy import create_engine, text

from backfill.devfleet.faultproxy import Fault, FaultProxy
from backfill.devfleet.fleet import Fleet
from backfill.devfleet.processes import free_port
from backfill.devfleet.s3 import SeaweedS3
from backfill.devfleet.services import private_redis
from backfill.devfleet.stack import Stack, launch_stack
from backfill.scheduler.drain.escalation import OVERFLOW_PREFIX
from tests.e2e.fault_probes import SendCounter
from tests.e2e.helpers import MODEL, chat_line, jsonl, read_lines, upload, wait_for

pytestmark = pytest.mark.e2e

LINES = 150
MAX_TOKENS = 512


@pytest.fixture(scope="module")
def fleet_path(fleet: Fleet) -> Iterator[SendCounter]:
    counter = SendCounter(fleet.origin, free_port()).start()
    yield counter
    counter.stop()


@pytest.fixture(scope="module")
def overflow_counter(fleet: Fleet) -> Iterator[SendCounter]:
    counter = SendCounter(fleet.origin, free_port()).start()
    yield counter
    counter.stop()


@pytest.fixture(scope="module")
def overflow(overflow_counter: SendCounter) -> Iterator[FaultProxy]:
    with FaultProxy(overflow_counter.base_url.removesuffix("/v1")) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[str]:
    shared = redis_url.rsplit("/", 1)[0] + "/11"
    with private_redis(tmp_path_factory.mktemp("redis-escalation"), shared_url=shared) as url:
        yield url


@pytest.fixture(scope="module")
def estack(
    own_redis: str,
    s3: SeaweedS3,
    fleet_path: SendCounter,
    overflow: FaultProxy,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    settings = {
        "BACKFILL_COMPLETION_WINDOWS": "1h,40s",
        "BACKFILL_CAPACITY_CONTROL": "off",
        "BACKFILL_MAX_INFLIGHT": "1",
        "BACKFILL_ESCALATION_INFLIGHT": "2",
        "BACKFILL_OVERFLOW_URLS": overflow.base_url,
        "BACKFILL_OVERFLOW_MAX_INFLIGHT": "8",
        "BACKFILL_LEASE_TTL_S": "4",
        "BACKFILL_DRAIN_SLICE_S": "10",
        "BACKFILL_TICK_INTERVAL_S": "0.5",
        "BACKFILL_FLEET_MAX_RETRIES": "6",
    }
    with launch_stack(
        tmp_path_factory.mktemp("escalation"),
        settings=settings,
        s3=s3,
        fleet_url=fleet_path.base_url,
        name="escalation",
        redis_url=own_redis,
    ) as s:
        engine = create_engine(s.database_url)
        with engine.begin() as conn:  # $1 / $2 per million tokens, 50% batch discount
            conn.execute(
                text(
                    "INSERT INTO prices (model, input_micros_per_million, cached_input_micros_per_million, "
                    "output_micros_per_million, batch_discount_percent, effective_from, created_at) "
                    "VALUES (:m, 1000000, 500000, 2000000, 50, now() - interval '1 minute', now())"
                ),
                {"m": MODEL},
            )
        engine.dispose()
        yield s


@pytest.fixture
def eclient(estack: Stack) -> Any:
    import openai

    return openai.OpenAI(base_url=estack.base_url, api_key=estack.key, max_retries=0, timeout=60)


def run_batch(client: Any, window: str, tag: str, n: int = LINES) -> tuple[Any, list[dict[str, Any]], list[str]]:
    prompts = [f"{tag} {secrets.token_hex(3)} " for _ in range(n)]
    lines = [chat_line(i, max_tokens=MAX_TOKENS, prefix=prompts[i]) for i in range(n)]
    f = upload(client, jsonl(lines))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window=window)
    done = wait_for(client, b.id, {"completed", "expired", "failed"}, timeout_s=240)
    return (
        done,
        read_lines(client, done.output_file_id),
        [chat_line(i, prefix=prompts[i])["body"]["messages"][0]["content"] for i in range(n)],
    )


def sends_of(prompt: str, *counters: SendCounter) -> int:
    return sum(c.sends[prompt] for c in counters)


def test_relaxed_first_then_overflow_and_overflow_lines_billed_at_the_batch_price(
    eclient: Any, estack: Stack, fleet_path: SendCounter, overflow_counter: SendCounter, overflow: FaultProxy
) -> None:
    overflow.clear()
    first_overflow: list[float] = []
    fleet_max_before_overflow = [0]
    stop = threading.Event()

    def watch() -> None:  # the fleet path's in-flight maximum until the overflow's first send
        while not stop.wait(0.02):
            if overflow_counter.sends.total() and not first_overflow:
                first_overflow.append(time.monotonic())
            if not first_overflow:
                fleet_max_before_overflow[0] = max(fleet_max_before_overflow[0], fleet_path.inflight)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        done, out, prompts = run_batch(eclient, "40s", "order")
    finally:
        stop.set()
        watcher.join()
    assert done.status == "completed", done
    assert len(out) == LINES and all(o["response"]["status_code"] == 200 for o in out)
    over = [o for o in out if o["response"]["request_id"].startswith(OVERFLOW_PREFIX)]
    # Step 1 before step 2: beyond the limit of 1 on the fleet before any line went to overflow.
    assert fleet_max_before_overflow[0] > 1
    assert over, "the relaxed step alone made the window: nothing went to overflow"
    assert len(over) < LINES
    # Each line ran once, on one path.
    assert all(sends_of(p, fleet_path, overflow_counter) == 1 for p in prompts)
    # Billed once each, overflow lines at the batch's price, like the others.
    engine = create_engine(estack.database_url)
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT line, requests, prompt_tokens, cached_tokens, completion_tokens, cost_micros "
                "FROM usage_ledger WHERE batch_id = :b"
            ),
            {"b": done.id.removeprefix("batch_")},  # stored without the API's prefix
        ).all()
    engine.dispose()
    assert sum(r[1] for r in rows) == LINES
    per_line = {r[0]: r for r in rows if r[1] == 1}
    over_lines = {int(o["custom_id"].removeprefix("req-")) for o in over}
    assert over_lines <= set(per_line) or not per_line  # (rolled up already: counted above)

    def at_half(tokens: int, rate: int) -> int:  # tokens x rate / 1e6 x 50%, to the nearest micro
        return (tokens * rate * 50 + 50_000_000) // 100_000_000

    for _, _, prompt_tokens, cached, completion_tokens, cost in per_line.values():
        expected = at_half(prompt_tokens - cached, 1_000_000) + at_half(cached, 500_000)
        assert cost == expected + at_half(completion_tokens, 2_000_000)


# Every reply that is the provider's fault, not the line's: a server error, its rate limit, a key
# it refuses, a model it does not serve, a body it will not take (the fleet would have run it).
PROVIDER_FAULTS = [503, 429, 401, 403, 404, 400, 422]


@pytest.mark.parametrize("status", PROVIDER_FAULTS)
def test_a_failing_overflow_opens_its_breaker_and_loses_nothing(
    eclient: Any,
    estack: Stack,
    fleet_path: SendCounter,
    overflow_counter: SendCounter,
    overflow: FaultProxy,
    status: int,
) -> None:
    """Whatever the overflow answers, no line ends with the overflow's answer and none spends an
    attempt on it: the lines go back to the fleet, and the overflow's breaker opens."""
    overflow.clear()
    overflow.inject(Fault.error, for_s=600, status=status)
    errors_before = overflow.stats.get("error", 0)
    sends_before = overflow_counter.sends.total()
    r = redis.Redis.from_url(estack.redis_url, decode_responses=True)
    r.delete(f"backfill:breaker:{overflow.base_url}")  # the last case's opening, its cool-down grown
    opened = threading.Event()
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.1):
            if r.hget(f"backfill:breaker:{overflow.base_url}", "state") in ("open", "half_open"):
                opened.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        # More lines than the fleet path can finish in the window whatever the machine's load:
        # the last stretch of the window sends every line left to the overflow.
        done, out, prompts = run_batch(eclient, "40s", f"failing-{status}", n=2 * LINES)
    finally:
        stop.set()
        watcher.join()
        overflow.clear()
    assert overflow.stats.get("error", 0) > errors_before, "no line was sent to the overflow"
    assert opened.is_set(), "the overflow's breaker never opened"
    assert overflow_counter.sends.total() == sends_before  # nothing got through the failing overflow
    # Nothing lost: every line the fleet answered is in the output once; with the overflow gone
    # the rest may expire as today (its finished lines kept), none failed on the overflow's replies.
    assert done.status in ("completed", "expired"), done
    answered = [o for o in out if o["response"]["status_code"] == 200]
    assert len(answered) == len(out) == done.request_counts.completed
    errors = read_lines(eclient, done.error_file_id)
    # (request_counts.failed counts the expired lines too, as OpenAI's does.)
    assert all(e["error"]["code"] == "batch_expired" for e in errors)
    assert len(out) + len(errors) == len(prompts)
    assert not [o for o in out if o["response"]["request_id"].startswith(OVERFLOW_PREFIX)]
    assert all(sends_of(p, fleet_path, overflow_counter) <= 1 for p in prompts)
    assert sum(sends_of(p, fleet_path) for p in prompts) >= len(out)
