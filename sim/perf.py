"""Step time as a function of what a step holds.

- `MockerPerf`: the Dynamo mocker's own polynomial model (ai-dynamo/dynamo, lib/mocker, the
  `PerfModel::Polynomial` variant): a prefill chunk of t new tokens takes
  4.209989e-07 t^2 + 1.518344e-02 t + 16.50142 ms; a decode step takes
  -25.74 u^2 + 54.01 u + 5.74 ms at KV occupancy u = active KV tokens / KV capacity. The mocker
  runs a step's prefill chunks one after another, then one decode pass, and sleeps their sum
  divided by its speedup ratio; a decode worker of a split fleet skips the prefill part. Where a
  fleet file sets them, each decode step also costs the host's work per step and per sequence
  in it (`step_overhead_ms`, `step_ms_per_seq`), fitted to the real mocker fleet here.
- `TablePerf`: a latency grid from NVIDIA's aiconfigurator-core (`backfill.sim.aic_table`),
  interpolated: prefill by (new tokens, cached prefix), decode by (batch, mean context); a mixed
  step costs the sum of its two parts. With speculative decoding (a grid compiled with MTP
  drafts), a decode step yields `tokens_per_step` tokens per sequence on average.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class Perf(Protocol):
    def prefill_ms(self, new_tokens: int, prefix: int) -> float: ...
    def decode_ms(self, batch: int, mean_context: float, kv_usage: float) -> float: ...

    @property
    def min_decode_ms(self) -> float: ...


@dataclass(frozen=True)
class MockerPerf:
    speedup_ratio: float = 1.0
    # The host's own work a decode step costs on the fleet as it runs here (the mocker's step
    # loop and each generated token's way through the worker and the frontend), beside the
    # modelled GPU time: real CPU time, so not divided by the speedup. Fitted to real runs
    # (`bench.sim_calibrate`; docs/simulator.md): 0 leaves the mocker's polynomial alone.
    step_overhead_ms: float = 0.0
    step_ms_per_seq: float = 0.0

    def prefill_ms(self, new_tokens: int, prefix: int) -> float:
        if new_tokens <= 0:
            return 0.0
        t = float(new_tokens)
        return (4.209989e-07 * t * t + 1.518344e-02 * t + 16.50142) / self.speedup_ratio

    def decode_ms(self, batch: int, mean_context: float, kv_usage: float) -> float:
        if batch <= 0:
            return 0.0
        u = kv_usage
        gpu = max(1.0, -25.74 * u * u + 54.01 * u + 5.74) / self.speedup_ratio
        return gpu + self.step_overhead_ms + self.step_ms_per_seq * batch

    @property
    def min_decode_ms(self) -> float:
        return 5.74 / self.speedup_ratio + self.step_overhead_ms + self.step_ms_per_seq


def _interp1(xs: list[float], ys: list[float], x: float) -> float:
    if x <= xs[0]:
        return ys[0] if len(xs) == 1 else ys[0] + (ys[1] - ys[0]) * (x - xs[0]) / (xs[1] - xs[0])
    i = min(bisect_right(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)  # extrapolates linearly past the last point


def _interp2(xs: list[float], ys: list[float], grid: list[list[float]], x: float, y: float) -> float:
    """`_interp1` along x of the rows interpolated along y, computing only the two rows that
    bracket x (the others do not enter the result; the same arithmetic, so the same figures).
    Both rows share the y axis, so the bracket along y is found once."""
    if len(xs) == 1 or len(ys) == 1:
        if len(xs) == 1:
            return _interp1(ys, grid[0], y)
        i = 1 if x <= xs[0] else min(bisect_right(xs, x), len(xs) - 1)
        x0, x1 = xs[i - 1], xs[i]
        y0, y1 = _interp1(ys, grid[i - 1], y), _interp1(ys, grid[i], y)
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    i = 1 if x <= xs[0] else min(bisect_right(xs, x), len(xs) - 1)
    j = 1 if y <= ys[0] else min(bisect_right(ys, y), len(ys) - 1)
    c0, c1 = ys[j - 1], ys[j]
    row = grid[i - 1]
    a, b = row[j - 1], row[j]
    y0 = a + (b - a) * (y - c0) / (c1 - c0)
    row = grid[i]
    a, b = row[j - 1], row[j]
    y1 = a + (b - a) * (y - c0) / (c1 - c0)
    x0, x1 = xs[i - 1], xs[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class TablePerf:
    new_tokens: list[float]
    prefix: list[float]
    prefill: list[list[float]]
    batch: list[float]
    context: list[float]
    decode: list[list[float]]
    scale: float = 1.0
    # Speculative decoding (MTP): the grid's decode step verifies the drafts, and each sequence
    # keeps this many tokens per step on average (the acceptance aiconfigurator does not model).
    # The simulator advances one token per step, so a step costs the grid's time over this.
    tokens_per_step: float = 1.0

    @classmethod
    def load(cls, path: Path, scale: float = 1.0, tokens_per_step: float = 1.0) -> TablePerf:
        t = json.loads(path.read_text())
        return cls(
            new_tokens=[float(v) for v in t["new_tokens"]],
            prefix=[float(v) for v in t["prefix"]],
            prefill=t["prefill_ms"],
            batch=[float(v) for v in t["batch"]],
            context=[float(v) for v in t["context"]],
            decode=t["decode_ms"],
            scale=scale,
            tokens_per_step=tokens_per_step,
        )

    def prefill_ms(self, new_tokens: int, prefix: int) -> float:
        if new_tokens <= 0:
            return 0.0
        return max(0.0, _interp2(self.new_tokens, self.prefix, self.prefill, new_tokens, prefix)) * self.scale

    def decode_ms(self, batch: int, mean_context: float, kv_usage: float) -> float:
        if batch <= 0:
            return 0.0
        step = max(1.0, _interp2(self.batch, self.context, self.decode, batch, mean_context))
        return step * self.scale / self.tokens_per_step

    @property
    def min_decode_ms(self) -> float:
        return min(min(row) for row in self.decode) * self.scale / self.tokens_per_step
