"""The harvest benchmark's third trace (ramp) and the oracle's figures in its closing line."""

from __future__ import annotations

from dataclasses import replace

from bench.agent_trace import TRACES, build_trace, ramp_level
from bench.harvest_report import final_line, table_row
from bench.harvest_results import RunResult


def in_flight(spec_name: str, t: float) -> int:
    sessions = build_trace(TRACES[spec_name])
    return sum(
        1 for s in sessions if s.start_s <= t < s.start_s + sum(u.max_tokens * 0.012 + u.think_s for u in s.turns)
    )


def test_ramp_has_no_clean_lull() -> None:
    spec = TRACES["ramp"]
    # After the first sessions are under way, the ramp never empties the fleet, unlike `lulls`.
    assert min(in_flight("ramp", t) for t in range(5, int(spec.duration_s) - 5)) >= 2
    assert min(in_flight("lulls", t) for t in range(5, int(TRACES["lulls"].duration_s) - 5)) == 0


def test_ramp_peaks_mid_trace_and_is_replayable() -> None:
    spec = TRACES["ramp"]
    assert ramp_level(spec, 0.0) == spec.quiet_sessions
    assert ramp_level(spec, spec.duration_s / 2) == spec.burst_sessions
    assert build_trace(spec) == build_trace(spec)
    # Quick mode shortens the trace; the ramp follows (one compressed day over 50 s).
    assert ramp_level(replace(spec, duration_s=50.0), 25.0) == spec.burst_sessions


def run(name: str, kind: str, attainment: float, tok_s: float, conc: int | None = None) -> RunResult:
    return RunResult(name, kind, conc, attainment, 69, 0.05, 0.08, 0.01, 0.012, tok_s, 10, 0, 0.002)


def test_closing_line_and_table_carry_the_oracle() -> None:
    results = [
        run("a", "a", 100.0, 0.0),
        run("b", "b", 0.0, 4000.0, 128),
        run("s4", "s", 100.0, 450.0, 4),
        run("s8", "s", 100.0, 900.0, 8),
        run("s16", "s", 90.0, 1500.0, 16),
        run("o", "o", 99.5, 1200.0),
        run("c", "c", 100.0, 1500.0),
    ]
    line = final_line(results)
    assert line.startswith("harvest: slo_attainment=100.0 baseline_attainment=100.0 batch_tput_vs_best_static=1.67")
    assert line.endswith("oracle_attainment=99.5 batch_tput_vs_oracle=1.25")
    row = table_row(results).splitlines()[-1]
    assert "99.5% at 1200 tok/s" in row and row.endswith("| 1.67x | 1.25x |")
    # Without an oracle run the line is what it always was.
    assert "oracle" not in final_line([r for r in results if r.kind != "o"])


def test_a_run_whose_generator_lagged_is_invalid_and_not_the_best_static() -> None:
    from bench.harvest_report import best_static

    lagged = replace(run("s8", "s", 100.0, 900.0, 8), loop_lag_p99_s=0.015)
    results = [run("a", "a", 100.0, 0.0), run("s4", "s", 100.0, 450.0, 4), lagged]
    assert not lagged.valid and results[1].valid
    best = best_static(results)
    assert best is not None and best.name == "s4"
