"""Figures, the over-time PNG and the closing line of the harvest benchmark."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.harvest_results import RunResult, SloRule

HOLD_POINTS = 1.0  # a static setting "holds the SLO" within this many points of (a)


def best_static(results: list[RunResult]) -> RunResult | None:
    base = next(r for r in results if r.kind == "a")
    holding = [r for r in results if r.kind == "s" and r.valid and r.attainment >= base.attainment - HOLD_POINTS]
    return max(holding, key=lambda r: r.batch_tok_s, default=None)


def oracle(results: list[RunResult]) -> RunResult | None:
    return next((r for r in results if r.kind == "o"), None)


def _ratio(x: float, y: float) -> float:
    return x / y if y > 0 else math.inf


def final_line(results: list[RunResult]) -> str:
    base = next(r for r in results if r.kind == "a")
    c = next(r for r in results if r.kind == "c")
    b = next(r for r in results if r.kind == "b")
    s = best_static(results)
    o = oracle(results)
    vs_static = _ratio(c.batch_tok_s, s.batch_tok_s) if s else math.inf
    line = (
        f"harvest: slo_attainment={c.attainment:.1f} baseline_attainment={base.attainment:.1f} "
        f"batch_tput_vs_best_static={vs_static:.2f} batch_tput_vs_naive={_ratio(c.batch_tok_s, b.batch_tok_s):.2f}"
    )
    if o:
        # The oracle's own attainment says whether its yardstick is a fair one (within 1 point of a).
        line += f" oracle_attainment={o.attainment:.1f} batch_tput_vs_oracle={_ratio(c.batch_tok_s, o.batch_tok_s):.2f}"
    return line


TABLE_HEADER = (
    "| (a) | (b) naive | static: attainment (tok/s) | best static holding the SLO | oracle | (c) controller "
    "| vs best static | vs oracle |\n|---|---|---|---|---|---|---|---|"
)


def table_row(results: list[RunResult]) -> str:
    """The run as one row of the docs' harvest tables (header included)."""
    base = next(r for r in results if r.kind == "a")
    c = next(r for r in results if r.kind == "c")
    b = next((r for r in results if r.kind == "b"), None)
    s = best_static(results)
    o = oracle(results)
    sweep = [r for r in results if r.kind == "s"]
    cells = [
        f"{base.attainment:.1f}%",
        f"{b.attainment:.1f}% ({b.batch_tok_s:.0f})" if b else "-",
        " / ".join(f"s{r.concurrency} {r.attainment:.1f}% ({r.batch_tok_s:.0f})" for r in sweep) or "-",
        f"{s.name}: {s.batch_tok_s:.0f} tok/s" if s else "none",
        f"{o.attainment:.1f}% at {o.batch_tok_s:.0f} tok/s" if o else "-",
        f"**{c.attainment:.1f}% at {c.batch_tok_s:.0f} tok/s**",
        f"{_ratio(c.batch_tok_s, s.batch_tok_s):.2f}x" if s else "-",
        f"{_ratio(c.batch_tok_s, o.batch_tok_s):.2f}x" if o else "-",
    ]
    return TABLE_HEADER + "\n| " + " | ".join(cells) + " |"


def write_summary(
    path: Path,
    variant: str,
    spec: dict[str, Any],
    slo: SloRule,
    results: list[RunResult],
    elapsed_s: float,
    line: str,
) -> None:
    s = best_static(results)
    path.write_text(
        json.dumps(
            {
                "variant": variant,
                "trace": spec,
                "slo": asdict(slo),
                "runs": [asdict(r) | {"valid": r.valid} for r in results],
                "best_static": s.name if s else None,
                "elapsed_s": round(elapsed_s, 1),
                "line": line,
            },
            indent=2,
        )
    )


def _inflight(requests: list[dict[str, Any]], t0: float, grid: list[float]) -> list[int]:
    spans = [(r["sent"] - t0, r.get("end", r["sent"]) - t0) for r in requests]
    return [sum(1 for a, b in spans if a <= t < b) for t in grid]


def _rolling(points: list[tuple[float, float]], width: float, grid: list[float]) -> list[float]:
    out = []
    for t in grid:
        window = [v for x, v in points if t - width <= x <= t]
        out.append(sorted(window)[int(0.9 * (len(window) - 1))] if window else math.nan)
    return out


def plot(path: Path, raws: dict[str, dict[str, Any]], results: list[RunResult], slo: SloRule) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = best_static(results)
    shown = [("a", "interactive only", "tab:green"), ("b", "naive batch", "tab:red")]
    if s:
        shown.append((s.name, f"best static ({s.name})", "tab:orange"))
    if oracle(results):
        shown.append(("o", "oracle (limit known in advance)", "tab:purple"))
    shown.append(("c", "backfill controller", "tab:blue"))
    raw_a = raws["a"]
    duration = raw_a["t_end"] - raw_a["t0"]
    grid = [i * 0.5 for i in range(int(duration / 0.5) + 1)]

    fig, axes = plt.subplots(5, 1, figsize=(12, 15), sharex=True)
    ax = axes[0]
    ax.plot(grid, _inflight(raw_a["interactive"]["requests"], raw_a["t0"], grid), color="tab:green")
    ax.set_ylabel("interactive requests\nin flight")
    ax.set_title("Harvest: batch work in the fleet's idle capacity (same interactive trace in every run)")

    ax = axes[1]
    for name, label, color in shown[1:]:
        raw = raws[name]
        pts = [(t - raw["t0"], n) for t, n, *_ in raw["batch"].get("inflight", [])]
        ax.plot([x for x, _ in pts], [y for _, y in pts], color=color, label=f"{label}: in flight")
    for name, color, label in (("c", "tab:blue", "published limit"), ("o", "tab:purple", "oracle's limit")):
        dec = raws[name]["batch"].get("decisions", []) if name in raws else []
        if dec:
            t0 = raws[name]["t0"]
            ax.step(
                [d["t"] - t0 for d in dec],
                [d["limit"] for d in dec],
                where="post",
                color=color,
                ls=":",
                label=label,
            )
    ax.set_ylabel("batch requests\nin flight / leases")
    ax.legend(loc="upper right", fontsize=8)

    for ax, key, target, label in (
        (axes[2], "itl", slo.itl_s, "interactive mean ITL\n(rolling p90, ms)"),
        (axes[3], "ttft", slo.ttft_s, "interactive TTFT\n(rolling p90, ms)"),
    ):
        for name, run_label, color in shown:
            raw = raws[name]
            pts = [
                (r["sent"] - raw["t0"], r[key] * 1000) for r in raw["interactive"]["requests"] if r.get(key) is not None
            ]
            ax.plot(grid, _rolling(pts, 3.0, grid), color=color, label=run_label)
        ax.axhline(target * 1000, color="black", ls="--", lw=1, label="SLO")
        ax.set_ylabel(label)
        ax.legend(loc="upper right", fontsize=8)

    ax = axes[4]
    for name, label, color in shown[1:]:
        raw = raws[name]
        done = sorted((d[0] - raw["t0"], d[2]) for d in raw["batch"].get("done", []) if d[1] == 200)
        total, xs, ys = 0, [], []
        for t, tok in done:
            if 0 <= t <= duration:
                total += tok
                xs.append(t)
                ys.append(total / 1000)
        ax.plot(xs, ys, color=color, label=label)
    ax.set_ylabel("batch output\n(k tokens, cumulative)")
    ax.set_xlabel("seconds into the trace")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
