"""The harvest oracle's schedule: per-window SLO results of the static sweep -> a limit per window."""

from __future__ import annotations

from typing import Any

import pytest

from bench.harvest_oracle import (
    holding_limits,
    limit_at,
    oracle_schedule,
    schedule_from_runs,
    spread_misses,
    window_misses,
    with_lead,
)


def ok(r: dict[str, Any]) -> bool:
    return bool(r["ok"])


def req(sent: float, end: float, good: bool = True) -> dict[str, Any]:
    return {"sent": sent, "end": end, "ok": good}


def test_a_request_counts_in_every_window_it_overlaps() -> None:
    t0 = 100.0
    counts, misses = window_misses([req(100.2, 102.5, good=False), req(103.9, 104.1)], t0, 5, ok)
    assert counts == [1, 1, 1, 1, 1]
    assert misses == [1, 1, 1, 0, 0]


def test_requests_outside_the_trace_are_clipped_to_its_windows() -> None:
    counts, misses = window_misses([req(99.0, 100.5, good=False), req(102.5, 109.0), req(104.5, 105.0)], 100.0, 3, ok)
    assert counts == [1, 0, 1]
    assert misses == [1, 0, 0]


def test_largest_limit_that_misses_no_more_than_interactive_alone() -> None:
    baseline = [0, 0, 1, 0]
    sweep = {
        4: [0, 0, 1, 0],
        8: [0, 1, 1, 0],
        16: [0, 2, 2, 1],
    }
    # window 0: all hold; 1: only 4; 2: (a) missed one itself, so 4 and 8 hold; 3: 4 and 8.
    assert holding_limits(baseline, sweep) == [16, 4, 8, 8]


def test_largest_holding_limit_even_if_a_smaller_one_missed() -> None:
    # The rule is literal: the largest limit at which the window held.
    assert holding_limits([0], {4: [1], 8: [0], 16: [1]}) == [8]


def test_no_holding_limit_is_zero() -> None:
    assert holding_limits([0, 0], {4: [1, 0], 8: [2, 0]}) == [0, 8]


def test_lead_lowers_the_limit_ahead_of_a_drop() -> None:
    assert with_lead([16, 16, 16, 4, 16, 16], 2) == [16, 4, 4, 4, 16, 16]
    assert with_lead([16, 4, 16], 0) == [16, 4, 16]


def test_schedule_needs_windows_of_equal_count() -> None:
    with pytest.raises(ValueError):
        oracle_schedule([0, 0], {4: [0]}, 1)


def test_schedule_from_raw_runs() -> None:
    """(a) clean; s4 clean; s8 hurts the request in the burst at 3-4 s; with a 1 s lead the
    oracle drops to 4 one window before it."""
    t0 = 1000.0

    def raw(requests: list[dict[str, Any]]) -> dict[str, Any]:
        return {"t0": t0, "t_end": t0 + 6.0, "interactive": {"requests": requests}}

    baseline = raw([req(t0 + 0.5, t0 + 0.8), req(t0 + 3.2, t0 + 3.9)])
    sweep = {
        4: raw([req(t0 + 0.5, t0 + 0.8), req(t0 + 3.2, t0 + 3.9)]),
        8: raw([req(t0 + 0.5, t0 + 0.8), req(t0 + 3.2, t0 + 3.9, good=False)]),
    }
    assert schedule_from_runs(baseline, sweep, ok, lead_s=1.0, spread_s=0.0) == [8, 8, 4, 4, 8, 8]
    # With a 1 s spread the miss in window 3 also fails windows 2 and 4 at 8 (and, 1 s ahead, 1).
    assert schedule_from_runs(baseline, sweep, ok, lead_s=1.0, spread_s=1.0) == [8, 4, 4, 4, 4, 8]


def test_limit_in_force_before_during_and_after_the_trace() -> None:
    schedule = [2, 4, 8]
    assert limit_at(schedule, 50.0, 45.0) == 2
    assert limit_at(schedule, 50.0, 51.5) == 4
    assert limit_at(schedule, 50.0, 99.0) == 8
    assert limit_at([], 50.0, 51.0) == 0


def test_a_miss_spreads_to_neighbouring_windows_at_its_own_limit() -> None:
    """s16 missed in window 2 only; with a spread of 1 it fails windows 1-3, where s8 still holds."""
    baseline = [0, 0, 0, 0, 0, 0]
    sweep = {4: [0] * 6, 8: [0] * 6, 16: [0, 0, 1, 0, 0, 0]}
    assert oracle_schedule(baseline, sweep, 0, 0) == [16, 16, 8, 16, 16, 16]
    assert oracle_schedule(baseline, sweep, 0, 1) == [16, 8, 8, 8, 16, 16]


def test_spread_counts_only_misses_beyond_interactive_alone() -> None:
    # (a) missed one in window 1 itself; s16's miss there is no evidence against s16.
    baseline = [0, 1, 0]
    assert spread_misses([0, 1, 0], baseline, 1) == [0, 0, 0]
    assert spread_misses([0, 2, 0], baseline, 1) == [1, 1, 1]
    assert oracle_schedule(baseline, {4: [0, 1, 0], 16: [0, 1, 0]}, 0, 1) == [16, 16, 16]


def test_windows_idle_in_interactive_alone_get_the_idle_limit_ahead_of_the_next_burst() -> None:
    baseline = [0, 0, 0, 0, 0, 0]
    sweep = {4: [0] * 6, 16: [0, 0, 0, 0, 1, 1]}
    idle = [False, True, True, True, False, False]
    assert oracle_schedule(baseline, sweep, 1, 0, idle=idle, idle_limit=128) == [16, 128, 128, 4, 4, 4]
    # An idle limit below the sweep's verdict lowers nothing.
    assert oracle_schedule(baseline, sweep, 0, 0, idle=idle, idle_limit=8) == [16, 16, 16, 16, 4, 4]


def test_idle_windows_come_from_interactive_alone() -> None:
    t0 = 0.0

    def raw(requests: list[dict[str, Any]]) -> dict[str, Any]:
        return {"t0": t0, "t_end": 4.0, "interactive": {"requests": requests}}

    baseline = raw([req(0.1, 0.5), req(3.2, 3.5)])
    sweep = {8: raw([req(0.1, 0.5), req(3.2, 3.5)])}
    assert schedule_from_runs(baseline, sweep, ok, lead_s=0.0, spread_s=0.0, idle_limit=64) == [8, 64, 64, 8]
