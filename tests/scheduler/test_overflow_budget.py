"""The overflow takes what the escalation decided, not the overflow pool's size: on Postgres,
drains claiming round after round (their lines still in flight) hold no more of a batch's lines
on the overflow than its overflow share, two drains at once included; a line given back by the
overflow and claimed again for the fleet no longer counts against the share."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import func, select

from backfill.jobs.execution.claims import claim_requests, release_for_retry
from backfill.jobs.models import BatchRequest, RequestState, utcnow
from backfill.scheduler.capacity.admission import Admission
from backfill.scheduler.drain.escalation import (
    OVERFLOW_PREFIX,
    EscalatedRelease,
    Escalation,
    EscalationLimits,
    Step,
    escalated_plan,
)
from backfill.scheduler.fleet.breaker import BreakerState
from backfill.storage.db import unit_of_work
from backfill.storage.leases import SqlLeaseStore
from tests.factories import make_batch, make_team
from tests.process_env import scratch_database

SHARE = 5  # the lines of the batch's remaining ones the escalation sends to the overflow
GROUP = 8  # a drain's claim group
POOL = 32  # the overflow deployment's in-flight limit


@pytest.fixture(scope="module")
def scratch_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    unset: dict[str, str | None] = {"BACKFILL_S3_ENDPOINT_URL": None, "BACKFILL_REDIS_URL": None}
    with scratch_database("backfill_overflow", tmp_path_factory.mktemp("overflow-home"), **unset) as url:
        yield url


def release_for(batch_id: str, share: int) -> EscalatedRelease:
    """A drain's escalated release with the escalation's decision fixed: `share` lines of the
    batch to the overflow (deployment 1, after the fleet's one)."""
    decided = {
        batch_id: Escalation(
            batch_id=batch_id,
            step=Step.overflow,
            min_rate=1.0,
            overflow_lines=share,
            expires_at=utcnow() + timedelta(hours=1),
        )
    }
    leases = SqlLeaseStore()
    return EscalatedRelease(
        admission=Admission(leases, fixed_limit=1, ttl_s=60, deployments=1),
        leases=leases,
        limits=EscalationLimits(relaxed_extra=0, overflow_limit=POOL, overflow_deployments=[1]),
        escalated=lambda: decided,
        relaxed_plan=lambda n: [],
        overflow_plan=lambda n: escalated_plan(decided, n, overflow=True),
    )


def on_overflow(batch_id: str) -> int:
    with unit_of_work() as s:
        return int(
            s.execute(
                select(func.count())
                .select_from(BatchRequest)
                .where(
                    BatchRequest.batch_id == batch_id,
                    BatchRequest.state == RequestState.running,
                    BatchRequest.request_id == OVERFLOW_PREFIX,
                )
            ).scalar_one()
        )


async def rounds(drains: list[tuple[EscalatedRelease, str]], n: int) -> list[int]:
    """`n` rounds of each drain taking escalated lines, none finishing; the lines each round took."""
    states = [BreakerState.closed, BreakerState.closed]
    took = []
    for _ in range(n):
        got = await asyncio.gather(*(d.take(GROUP, holder=h, states=states, held={}) for d, h in drains))
        took += [len(g) for g in got]
    return took


def test_overflow_in_flight_stays_within_the_share_round_after_round(scratch_db: str) -> None:
    with unit_of_work() as s:
        batch_id = make_batch(s, make_team(s), lines=60).id
    drains = [(release_for(batch_id, SHARE), "drain-a"), (release_for(batch_id, SHARE), "drain-b")]
    took = asyncio.run(rounds(drains, 6))
    # Before the budget every round claimed the share again, until the overflow pool was full.
    assert sum(took) == SHARE
    assert on_overflow(batch_id) == SHARE


def test_a_line_given_back_by_the_overflow_frees_its_place_in_the_share(scratch_db: str) -> None:
    with unit_of_work() as s:
        batch_id = make_batch(s, make_team(s), lines=20).id
    drain = release_for(batch_id, 2)
    asyncio.run(rounds([(drain, "drain-c")], 2))
    with unit_of_work() as s:
        lines = list(
            s.execute(
                select(BatchRequest.line).where(
                    BatchRequest.batch_id == batch_id, BatchRequest.request_id == OVERFLOW_PREFIX
                )
            ).scalars()
        )
    assert len(lines) == 2
    with unit_of_work() as s:  # the overflow refused it: back to pending, then the fleet's claim takes it
        assert release_for_retry(s, batch_id=batch_id, line=lines[0], claim_token="drain-c", not_before=utcnow())
    with unit_of_work() as s:
        again = claim_requests(s, batch_id=batch_id, limit=1, claim_token="drain-fleet")
    assert [r.line for r in again] == [lines[0]]
    assert on_overflow(batch_id) == 1  # running on the fleet now, not on the overflow
    assert asyncio.run(rounds([(drain, "drain-c")], 2)) == [1, 0]
    assert on_overflow(batch_id) == 2
