"""Dispatch policy math: EDF within a team, weighted fair share across teams, deadline forecast."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta

from backfill.jobs.sweeps import PendingBatch
from backfill.scheduler.drain.policy import FairPlanner, PolicyConfig, plan, threatened

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def batch(
    bid: str, team: str, *, remaining: int, expires_in_s: float, created_s_ago: float = 0.0, tokens: int = 100
) -> PendingBatch:
    return PendingBatch(
        batch_id=bid,
        team_id=team,
        created_at=NOW - timedelta(seconds=created_s_ago),
        expires_at=NOW + timedelta(seconds=expires_in_s),
        total=remaining,
        remaining=remaining,
        remaining_tokens=remaining * tokens,
    )


def shares(planner: FairPlanner, pending: list[PendingBatch], rounds: int, slots: int, **kw: object) -> Counter[str]:
    """Run `rounds` decisions, taking exactly what was planned, and count releases per batch."""
    got: Counter[str] = Counter()
    for _ in range(rounds):
        left = slots
        for bid, k in planner.plan(pending, slots, now=NOW, **kw):  # type: ignore[arg-type]
            take = min(k, left)
            got[bid] += take
            left -= take
            if not left:
                break
    return got


def test_earliest_deadline_first_within_a_team() -> None:
    late = batch("late", "t", remaining=100, expires_in_s=7200, created_s_ago=60)
    soon = batch("soon", "t", remaining=100, expires_in_s=3600)
    assert plan([late, soon], 10, now=NOW)[0] == ("soon", 10)


def test_plan_lists_the_rest_for_short_claims() -> None:
    a = batch("a", "t", remaining=3, expires_in_s=100)
    b = batch("b", "t", remaining=50, expires_in_s=200)
    out = plan([a, b], 10, now=NOW)
    assert out[0] == ("a", 3) and out[1] == ("b", 7)
    assert plan([], 10, now=NOW) == [] and plan([a], 0, now=NOW) == []


def test_a_big_backlog_does_not_starve_a_small_batch() -> None:
    # Team A's huge batch is older and due earlier: plain EDF would give it everything.
    big = batch("big", "A", remaining=1_000_000, expires_in_s=3600, created_s_ago=600)
    small = batch("small", "B", remaining=200, expires_in_s=86400)
    got = shares(FairPlanner(), [big, small], rounds=10, slots=16)
    assert got["small"] == got["big"] == 80


def test_team_weights_set_the_split() -> None:
    a = batch("a", "A", remaining=10_000, expires_in_s=3600)
    b = batch("b", "B", remaining=10_000, expires_in_s=3600)
    got = shares(FairPlanner(), [a, b], rounds=30, slots=10, weights={"A": 2.0, "B": 1.0})
    assert abs(got["a"] / got["b"] - 2.0) < 0.1


def test_fair_share_counts_tokens_not_requests() -> None:
    heavy = batch("heavy", "A", remaining=10_000, expires_in_s=3600, tokens=3000)
    light = batch("light", "B", remaining=10_000, expires_in_s=3600, tokens=1000)
    got = shares(FairPlanner(), [heavy, light], rounds=40, slots=10)
    assert abs(got["light"] / got["heavy"] - 3.0) < 0.2


def test_an_idle_team_earns_no_credit() -> None:
    planner = FairPlanner()
    a = batch("a", "A", remaining=100_000, expires_in_s=3600)
    shares(planner, [a], rounds=50, slots=10)  # A alone for a while
    b = batch("b", "B", remaining=100_000, expires_in_s=3600)
    got = shares(planner, [a, b], rounds=10, slots=10)
    assert 40 <= got["b"] <= 60  # B does not get 500 releases in a row for A's head start


def test_forecast_flags_batches_that_would_miss_on_their_fair_share() -> None:
    relaxed = batch("relaxed", "A", remaining=10_000, expires_in_s=86400)
    tight = batch("tight", "B", remaining=1000, expires_in_s=120)  # 100k tokens in 2 minutes
    pending = [relaxed, tight]
    # At 2000 tokens/s, B's half share (1000/s) needs 100 s: more than 0.8 x 120 s.
    assert threatened(pending, now=NOW, weights={}, rate_tokens_s=2000) == {"tight"}
    # Fast enough on its share: nothing threatened; no rate known: nothing to forecast with.
    assert threatened(pending, now=NOW, weights={}, rate_tokens_s=5000) == set()
    assert threatened(pending, now=NOW, weights={}, rate_tokens_s=None) == set()


def test_forecast_counts_earlier_deadlines_of_the_same_team() -> None:
    first = batch("first", "A", remaining=500, expires_in_s=40)
    second = batch("second", "A", remaining=500, expires_in_s=60)
    # Alone, each fits in its window at 2000 tokens/s; after `first`, `second` does not.
    assert threatened([first, second], now=NOW, weights={}, rate_tokens_s=2000) == {"second"}


def test_threatened_batch_gets_its_guaranteed_share_on_top() -> None:
    relaxed = batch("relaxed", "A", remaining=100_000, expires_in_s=86400, created_s_ago=60)
    tight = batch("tight", "B", remaining=100_000, expires_in_s=60)
    planner = FairPlanner(PolicyConfig(guaranteed_share=0.5))
    got = shares(planner, [relaxed, tight], rounds=20, slots=10, rate_tokens_s=1000)
    # Half of all releases are guaranteed, and it still takes its fair half of the rest.
    assert got["tight"] == 150 and got["relaxed"] == 50
    even = shares(FairPlanner(PolicyConfig(guaranteed_share=0.5)), [relaxed, tight], rounds=20, slots=10)
    assert even["tight"] == even["relaxed"] == 100  # without a forecast: plain fair share
