"""The prefix benchmark's closing line summarizes the workloads it names."""

from __future__ import annotations

from bench.prefix_report import RunRow, final_line


def _row(workload: str, mode: str, *, cached: int, max_cached: int, lines_per_s: float, shared: bool = True) -> RunRow:
    return RunRow(
        workload=workload,
        label=workload,
        shared=shared,
        mode=mode,
        run=1,
        lines=100,
        requests=100,
        prompt_tokens=10_000,
        cached_tokens=cached,
        max_cached_tokens=max_cached,
        wall_s=100 / lines_per_s,
        succeeded=100,
    )


def test_the_closing_line_leaves_out_what_cannot_be_cached_and_names_the_slowest_workload() -> None:
    rows = [
        _row("eval", "random", cached=2000, max_cached=8000, lines_per_s=10.0),
        _row("eval", "prefix", cached=7600, max_cached=8000, lines_per_s=40.0),
        _row("agents", "random", cached=3000, max_cached=8000, lines_per_s=8.0),
        _row("agents", "prefix", cached=7200, max_cached=8000, lines_per_s=6.0),
        # n samples in one request: neither order caches anything, so it says nothing of the share.
        _row("rollouts_n", "random", cached=0, max_cached=6000, lines_per_s=5.0),
        _row("rollouts_n", "prefix", cached=0, max_cached=6000, lines_per_s=5.0),
        _row("unique", "random", cached=0, max_cached=0, lines_per_s=20.0, shared=False),
        _row("unique", "prefix", cached=0, max_cached=0, lines_per_s=20.0, shared=False),
    ]
    line = final_line(rows)
    assert line.startswith("prefix: cached_share_of_max=0.90 over=eval,agents ")
    assert "tput_vs_random=0.75 lowest_at=agents over=eval,agents,rollouts_n,unique " in line
    assert line.endswith("unique_tput_vs_random=1.00")
