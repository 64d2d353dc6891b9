"""The escalation decision (scheduler.drain.escalation) on batch counters alone."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from backfill.jobs.sweeps import PendingBatch
from backfill.scheduler.drain.escalation import EscalationConfig, Escalator, Step, escalated_plan

NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)
WINDOW_S = 3600.0


def batch(bid: str, *, total: int = 100, remaining: int = 100, elapsed_s: float = 0.0, team: str = "t") -> PendingBatch:
    created = NOW - timedelta(seconds=elapsed_s)
    return PendingBatch(
        batch_id=bid,
        team_id=team,
        created_at=created,
        expires_at=created + timedelta(seconds=WINDOW_S),
        total=total,
        remaining=remaining,
        remaining_tokens=remaining * 1000,
    )


def test_a_batch_the_fleet_rate_finishes_in_time_is_not_escalated() -> None:
    # 100 lines x 1000 tokens at 1000 tok/s: 100 s, far inside the window less its margin.
    out = Escalator().decide([batch("a")], now=NOW, clock_s=0.0, rate_tokens_s=1000.0)
    assert out == {}


def test_a_forecast_past_the_deadline_minus_the_margin_escalates_with_the_rate_it_needs() -> None:
    # 3000 s of work at 1000 tok/s; 3600 s left, less a 20% margin (720 s): 2880 s. Escalated.
    b = batch("a", total=3000, remaining=3000)
    out = Escalator().decide([b], now=NOW, clock_s=0.0, rate_tokens_s=1000.0)
    assert out["a"].step is Step.relaxed
    assert out["a"].overflow_lines == 0  # no rate measured yet: not to overflow
    assert abs(out["a"].min_rate - 3000 / 2880) < 1e-9


def test_idle_capacity_gone_escalates_once_behind_the_straight_line() -> None:
    esc = Escalator()
    # No throughput known at all (a fleet at its SLO releases nothing): not in the first 5%.
    assert esc.decide([batch("a", elapsed_s=60)], now=NOW, clock_s=0.0, rate_tokens_s=None) == {}
    # Past 5% of the window with nothing done: behind the line to the deadline minus the margin.
    assert esc.decide([batch("a", elapsed_s=600)], now=NOW, clock_s=0.0, rate_tokens_s=0.0)["a"].step is Step.relaxed
    # On the line: 50% done at 40% of the window.
    on_time = batch("b", total=100, remaining=50, elapsed_s=0.4 * WINDOW_S)
    assert Escalator().decide([on_time], now=NOW, clock_s=0.0, rate_tokens_s=None) == {}


def test_overflow_comes_after_the_relaxed_step_with_the_lines_that_would_still_miss() -> None:
    esc = Escalator(EscalationConfig(margin=0.2, overflow_margin=0.1, measure=0.05, smoothing=1.0))
    first = batch("a", total=1000, remaining=1000, elapsed_s=600)
    assert esc.decide([first], now=NOW, clock_s=0.0, rate_tokens_s=0.0)["a"].step is Step.relaxed
    # 200 s later (past the 180 s watch): 100 lines done at the relaxed step, 0.5 lines/s.
    later_now = NOW + timedelta(seconds=200)
    later = batch("a", total=1000, remaining=900, elapsed_s=600)  # the same batch
    e = esc.decide([later], now=later_now, clock_s=200.0, rate_tokens_s=0.0)["a"]
    # 2800 s left, less the 360 s overflow margin: 2440 s x 0.5 = 1220 >= 900 lines: no overflow.
    assert e.step is Step.relaxed
    # Slower: 10 lines more in 200 s (0.05 lines/s): 2240 s x 0.05 = 112 of 890 lines reachable.
    slower = batch("a", total=1000, remaining=890, elapsed_s=600)
    e = esc.decide([slower], now=NOW + timedelta(seconds=400), clock_s=400.0, rate_tokens_s=0.0)["a"]
    assert e.step is Step.overflow
    assert e.overflow_lines == 890 - 112


def test_the_last_stretch_sends_everything_left_to_overflow() -> None:
    esc = Escalator()
    late = batch("a", total=100, remaining=40, elapsed_s=0.95 * WINDOW_S)
    e = esc.decide([late], now=NOW, clock_s=0.0, rate_tokens_s=None)["a"]
    assert (e.step, e.overflow_lines) == (Step.overflow, 40)


def test_a_batch_stays_escalated_and_is_forgotten_when_done() -> None:
    esc = Escalator()
    b = batch("a", total=3000, remaining=3000)
    assert "a" in esc.decide([b], now=NOW, clock_s=0.0, rate_tokens_s=1000.0)
    # The forecast alone would no longer escalate it (a faster fleet), but it was escalated.
    assert "a" in esc.decide([b], now=NOW, clock_s=1.0, rate_tokens_s=100000.0)
    assert esc.decide([], now=NOW, clock_s=2.0, rate_tokens_s=1000.0) == {}
    assert esc.decide([b], now=NOW, clock_s=3.0, rate_tokens_s=100000.0) == {}


def test_plans_go_earliest_deadline_first_and_overflow_only_to_overflow_lines() -> None:
    esc = Escalator()
    soon = batch("soon", total=100, remaining=40, elapsed_s=0.95 * WINDOW_S)
    later = batch("later", total=3000, remaining=3000)
    out = esc.decide([later, soon], now=NOW, clock_s=0.0, rate_tokens_s=1000.0)
    assert escalated_plan(out, 8, overflow=False) == [("soon", 8), ("later", 8)]
    assert escalated_plan(out, 8, overflow=True) == [("soon", 40)]
    assert escalated_plan(out, 0, overflow=True) == []


def test_the_decision_is_a_pass_over_batches_at_thousands_of_them() -> None:
    pending = [batch(f"b{i}", team=f"t{i % 50}", total=1000, remaining=1000 - i % 900) for i in range(5000)]
    out = Escalator().decide(pending, now=NOW, clock_s=0.0, rate_tokens_s=50_000.0)
    assert all(e.step in (Step.relaxed, Step.overflow) for e in out.values())


def test_a_watch_longer_than_a_drain_reaches_overflow_across_drains() -> None:
    """Each drain makes its own planner (scheduler.tasks.drain); a 1 h window is watched for 180 s
    (5%) before its rate counts, six 30 s drains. The watch must outlive the drain's planner, or a
    late batch never reaches step 2 before the last stretch, when every line left goes at once."""
    from backfill.scheduler.capacity.admission import Admission
    from backfill.scheduler.runtime import make_planner

    admission = Admission(object(), fixed_limit=1, ttl_s=5.0)  # type: ignore[arg-type]  # no lease is taken
    clock, remaining, step = 600.0, 1000, Step.none
    while clock < 1200.0 and step is not Step.overflow:  # 10 minutes of 30 s drains
        planner = make_planner(admission=admission)
        for _ in range(3):  # the drain looks every 10 s; 0.1 lines/s get done (they need ~0.35)
            now = NOW + timedelta(seconds=clock - 600.0)
            b = batch("a", total=1000, remaining=remaining, elapsed_s=600.0)
            step = planner.escalator.decide([b], now=now, clock_s=clock, rate_tokens_s=0.0)["a"].step
            clock, remaining = clock + 10.0, remaining - 1
    assert step is Step.overflow, "still only relaxed after 10 minutes of 30 s drains"
