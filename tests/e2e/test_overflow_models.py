"""Overflow per model on the real stack: an overflow URL serves the models its own `/v1/models`
lists, and gets the escalated lines of those models only.

The fleet is the session's two-model fleet (tiny-chat and tiny-chat-large) behind a fault proxy,
held to one batch request in flight per model (`BACKFILL_MAX_INFLIGHT=1`, no controller: no idle
capacity to speak of), so a batch with a 40 s window escalates. The overflow deployment is a
fleet of its own serving tiny-chat only, behind a fault proxy that counts what it is sent per
model. Both models' batches escalate at once, each past what the fleet and the relaxed extra run
in its window: tiny-chat's lines that would still miss go to the overflow and its batch completes;
tiny-chat-large's never do, so its batch expires with lines left, every one of them decided for
the overflow in the window's last stretch and none sent there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from backfill.devfleet.faultproxy import FaultProxy
from backfill.devfleet.fleet import LARGE_MODEL, Fleet
from backfill.devfleet.s3 import SeaweedS3
from backfill.devfleet.services import private_redis
from backfill.devfleet.stack import Stack, launch_stack
from backfill.scheduler.drain.escalation import OVERFLOW_PREFIX
from tests.e2e.helpers import MODEL, chat_line, jsonl, read_lines, upload, wait_for

pytestmark = pytest.mark.e2e

LINES = 150  # each batch's: more than the fleet and the relaxed extra run in its window
MAX_TOKENS = 512


@pytest.fixture(scope="module")
def overflow_fleet() -> Iterator[Fleet]:
    with Fleet(num_workers=1, speedup_ratio=5.0, model_name=MODEL) as f:
        yield f


@pytest.fixture(scope="module")
def fleet_proxy(fleet: Fleet) -> Iterator[FaultProxy]:
    assert fleet.models == [MODEL, LARGE_MODEL]
    with FaultProxy(fleet.origin) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def overflow_proxy(overflow_fleet: Fleet) -> Iterator[FaultProxy]:
    with FaultProxy(overflow_fleet.origin) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[str]:
    shared = redis_url.rsplit("/", 1)[0] + "/9"
    with private_redis(tmp_path_factory.mktemp("redis-overflow-models"), shared_url=shared) as url:
        yield url


@pytest.fixture(scope="module")
def ostack(
    own_redis: str,
    s3: SeaweedS3,
    fleet_proxy: FaultProxy,
    overflow_proxy: FaultProxy,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    settings = {
        "BACKFILL_COMPLETION_WINDOWS": "1h,40s",
        "BACKFILL_CAPACITY_CONTROL": "off",
        "BACKFILL_MAX_INFLIGHT": "1",
        "BACKFILL_ESCALATION_INFLIGHT": "2",
        "BACKFILL_OVERFLOW_URLS": overflow_proxy.base_url,
        "BACKFILL_OVERFLOW_MAX_INFLIGHT": "8",
        "BACKFILL_LEASE_TTL_S": "4",
        "BACKFILL_DRAIN_SLICE_S": "10",
        "BACKFILL_TICK_INTERVAL_S": "0.5",
        "BACKFILL_FLEET_MAX_RETRIES": "6",
        "BACKFILL_MODELS_CACHE_S": "2",
    }
    with launch_stack(
        tmp_path_factory.mktemp("overflow-models"),
        settings=settings,
        s3=s3,
        fleet_url=fleet_proxy.base_url,
        name="overflow-models",
        redis_url=own_redis,
        flush=True,
    ) as s:
        yield s


def _batch(client: Any, model: str, n: int, tag: str) -> Any:
    lines = [chat_line(i, model=model, max_tokens=MAX_TOKENS, prefix=f"{tag} {i} ") for i in range(n)]
    f = upload(client, jsonl(lines), name=f"{tag}.jsonl")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="40s")


def test_an_overflow_gets_only_the_lines_of_the_models_its_models_list_names(
    ostack: Stack, fleet_proxy: FaultProxy, overflow_proxy: FaultProxy
) -> None:
    import openai

    client = openai.OpenAI(base_url=ostack.base_url, api_key=ostack.key, max_retries=0, timeout=60)
    large = _batch(client, LARGE_MODEL, LINES, "large")
    small = _batch(client, MODEL, LINES, "small")
    small_done = wait_for(client, small.id, {"completed", "expired", "failed"}, timeout_s=240)
    large_done = wait_for(client, large.id, {"completed", "expired", "failed"}, timeout_s=240)

    # The overflow deployment lists tiny-chat only: not one tiny-chat-large line was sent there.
    assert overflow_proxy.by_model.get(LARGE_MODEL, 0) == 0
    assert fleet_proxy.by_model.get(LARGE_MODEL, 0) > 0
    # Late (it expired with lines left), so the escalation sent its lines left to the overflow step.
    assert large_done.status == "expired", large_done
    assert 0 < large_done.request_counts.completed < LINES, large_done.request_counts
    large_out = read_lines(client, large_done.output_file_id)
    assert not any(o["response"]["request_id"].startswith(OVERFLOW_PREFIX) for o in large_out)
    # tiny-chat's batch escalated to the overflow and finished there and on the fleet.
    assert small_done.status == "completed", small_done
    small_out = read_lines(client, small_done.output_file_id)
    over = [o for o in small_out if o["response"]["request_id"].startswith(OVERFLOW_PREFIX)]
    assert over, "nothing of tiny-chat's batch went to the overflow"
    assert overflow_proxy.by_model.get(MODEL, 0) >= len(over)
