"""What a harvest run measured, shared by the benchmark (bench/harvest.py) and its report
(bench/harvest_report.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SloRule:
    ttft_s: float
    itl_s: float


@dataclass
class RunResult:
    name: str
    kind: str  # a | b | s | o (oracle) | c
    concurrency: int | None
    attainment: float
    n: int
    ttft_p50: float
    ttft_p90: float
    itl_p50: float
    itl_p90: float
    batch_tok_s: float
    batch_requests: int
    aborted_or_failed: int
    loop_lag_p99_s: float
    load_avg_1m: float = 0.0  # the machine's load average as the run ended
    extra: dict[str, Any] = field(default_factory=dict)

    # A run whose load generator lagged this much measured the machine, not the fleet: marked
    # invalid, and left out of the best static setting and the closing line.
    MAX_LAG_S = 0.010

    @property
    def valid(self) -> bool:
        return self.loop_lag_p99_s <= self.MAX_LAG_S


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def meets(r: dict[str, Any], slo: SloRule) -> bool:
    if r.get("status") != 200 or r.get("ttft") is None:
        return False
    return r["ttft"] <= slo.ttft_s and (r.get("itl") is None or r["itl"] <= slo.itl_s)
