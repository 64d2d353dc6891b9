"""The late oracle's schedule transforms: drops made late, raises kept, scaled as a whole."""

from __future__ import annotations

from backfill.sim.oracle import Schedule
from bench.sim_late_oracle import best_holding, late, scaled


def test_a_drop_comes_late_and_a_raise_does_not() -> None:
    s = Schedule([10, 10, 4, 4, 10, 2, 2], window_s=1.0)
    assert late(s, 1.0).limits == [10, 10, 10, 4, 10, 10, 2]
    assert late(s, 2.0).limits == [10, 10, 10, 10, 10, 10, 10]


def test_no_delay_is_the_schedule_itself() -> None:
    s = Schedule([8, 3, 9], window_s=0.25, sheds=[None, 3, None])
    got = late(s, 0.0)
    assert (got.limits, got.sheds) == (s.limits, s.sheds)


def test_sheds_move_with_the_drops_in_periods_of_the_schedule() -> None:
    s = Schedule([8, 8, 3, 3, 3], window_s=0.25, sheds=[None, None, 3, None, None])
    got = late(s, 0.5)  # two periods
    assert got.limits == [8, 8, 8, 8, 3]
    assert got.sheds == [None, None, None, None, 3]


def test_scaling_rounds_down_limits_and_shed_targets() -> None:
    s = scaled(Schedule([10, 3], window_s=1.0, sheds=[None, 3]), 0.5)
    assert (s.limits, s.sheds) == ([5, 1], [None, 1])
    assert scaled(Schedule([7], window_s=1.0), 0.5).sheds is None


def test_the_largest_holding_scale_is_found_to_within_the_bisection() -> None:
    tried: list[float] = []

    def run(f: float) -> object | None:
        tried.append(f)
        return "run" if f <= 0.6 else None

    f, got = best_holding(run, steps=7)
    assert 0.6 - 1 / 2**7 <= f <= 0.6 and got == "run"
    assert best_holding(lambda f: "run")[0] == 1.0  # the plan holds as it is: nothing to take off
    assert best_holding(lambda f: None) == (0.0, None)
