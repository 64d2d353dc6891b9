"""The prefix benchmark's figures: one row per run, the table over runs, the closing line."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class RunRow:
    workload: str
    label: str
    shared: bool
    mode: str  # random | prefix
    run: int
    lines: int
    requests: int  # what the fleet ran (a line with n counts n)
    prompt_tokens: int
    cached_tokens: int
    max_cached_tokens: int
    wall_s: float
    succeeded: int
    spread: list[float] = field(default_factory=list)  # share of requests per worker
    mean_in_flight: float = 0.0  # lines in flight, mean over the run (from their claim and finish times)
    median_claim_to_finish_s: float = 0.0
    drain_cpu_s: float = 0.0  # the drain process's CPU over the run
    claims: int = 0  # claim statements the drain ran (one per batch a round plans)
    claimed: int = 0  # lines they took (a retried line counts each time)

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def share_of_max(self) -> float:
        return self.cached_tokens / self.max_cached_tokens if self.max_cached_tokens else 1.0

    @property
    def lines_per_s(self) -> float:
        return self.succeeded / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> str:
        spread = "/".join(f"{x * 100:.0f}" for x in self.spread)
        return (
            f"{self.workload:<10} {self.mode:<6} run {self.run}: {self.succeeded}/{self.lines} lines in "
            f"{self.wall_s:6.1f} s = {self.lines_per_s:6.1f}/s; cached {self.cached_share * 100:5.1f}% of prompt "
            f"tokens = {self.share_of_max * 100:5.1f}% of the max ({self.max_cached_tokens} tok); workers {spread}%; "
            f"{self.mean_in_flight:.0f} in flight, claim to finish {self.median_claim_to_finish_s:.2f} s (median); "
            f"drain CPU {self.drain_cpu_s * 1000 / max(self.lines, 1):.2f} ms a line; "
            f"{self.claims} claims took {self.claimed} lines"
        )


def _runs(rows: list[RunRow], workload: str, mode: str) -> list[RunRow]:
    return [r for r in rows if r.workload == workload and r.mode == mode]


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def _span(xs: list[float], fmt: str) -> str:
    """The mean, and the range when there were several runs."""
    if len(xs) < 2:
        return format(_mean(xs), fmt)
    return f"{format(_mean(xs), fmt)} ({format(min(xs), fmt)}-{format(max(xs), fmt)})"


def ratio(rows: list[RunRow], workload: str) -> float:
    """Throughput of backfill's order over the random order: mean of the per-run ratios."""
    pairs = [
        (p.lines_per_s, r.lines_per_s)
        for p in _runs(rows, workload, "prefix")
        for r in _runs(rows, workload, "random")
        if p.run == r.run and r.lines_per_s > 0
    ]
    return _mean([a / b for a, b in pairs])


def table(rows: list[RunRow]) -> str:
    out = [
        "| workload | requests | order | cached / prompt tokens | cached / max possible | lines/s | vs random | worker spread |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for workload in dict.fromkeys(r.workload for r in rows):
        for mode in ("random", "prefix"):
            runs = _runs(rows, workload, mode)
            if not runs:
                continue
            spread = "/".join(f"{_mean([r.spread[i] for r in runs]) * 100:.0f}" for i in range(len(runs[0].spread)))
            versus = f"{ratio(rows, workload):.2f}x" if mode == "prefix" else ""
            out.append(
                f"| {runs[0].label if mode == 'random' else ''} | {runs[0].requests} | {mode} | "
                f"{_span([r.cached_share * 100 for r in runs], '.1f')}% | "
                f"{_span([r.share_of_max * 100 for r in runs], '.1f')}% | "
                f"{_span([r.lines_per_s for r in runs], '.1f')} | {versus} | {spread}% |"
            )
    return "\n".join(out)


def final_line(rows: list[RunRow]) -> str:
    """The closing line, over the workloads it names: `cached_share_of_max`, the lowest share of
    the possible cached tokens prefix order got among the workloads where some could be cached
    (one where neither order cached any, such as n samples in one request, has nothing to
    measure); `tput_vs_random`, prefix order's lowest throughput against random order's among
    every workload run in both orders, and where it was; `unique_tput_vs_random`, the control's."""
    names = list(dict.fromkeys(r.workload for r in rows))
    cacheable = [
        w
        for w in names
        if _runs(rows, w, "prefix")
        and any(r.shared for r in _runs(rows, w, "prefix"))
        and any(r.cached_tokens and r.max_cached_tokens for r in rows if r.workload == w)
    ]
    x = min((_mean([r.share_of_max for r in _runs(rows, w, "prefix")]) for w in cacheable), default=float("nan"))
    both = [w for w in names if _runs(rows, w, "prefix") and _runs(rows, w, "random")]
    ratios = {w: ratio(rows, w) for w in both}
    worst = min(ratios, key=lambda w: ratios[w], default="")
    y = ratios.get(worst, float("nan"))
    z = ratio(rows, "unique")
    return (
        f"prefix: cached_share_of_max={x:.2f} over={','.join(cacheable) or '-'} "
        f"tput_vs_random={y:.2f} lowest_at={worst or '-'} over={','.join(both) or '-'} unique_tput_vs_random={z:.2f}"
    )
