"""The harvest benchmark's oracle: a lease limit that knows the trace in advance.

The static sweep replays the same interactive trace beside each fixed lease limit. Cut each of
those runs into windows (1 s by default) and ask, per window: at which fixed limits did that
window's interactive requests do as well as they did alone (run (a))? The largest such limit is
what a clairvoyant controller could have published for that window. The oracle run replays that
schedule as a time-varying limit, published the way the controller publishes its own (so the
real Dispatcher obeys it), and its batch throughput is the yardstick for the controller's.

Choices, and why:
- A request counts in every window its life overlaps (sent .. end), not only the one it was sent
  in: its mean ITL is set by the batch load over its whole reply.
- A window holds at a limit when it has no more SLO misses there than it had in (a). A window
  (a) itself missed in would otherwise hold nowhere, though batch load did not cause the miss.
- A window with no interactive request in (a) holds at any limit (nothing there to hurt), so it
  gets `idle_limit` (the bound the controller has too), not just the largest swept one: capped
  at the sweep, the oracle would lose to the controller in every lull.
- The oracle lowers the limit `lead` windows ahead of need: lowering a limit sheds nothing, so
  batch requests admitted just before a burst run into it for a few seconds (their reply time).
  Knowing the trace in advance, the oracle can make room for it; the controller cannot.
- A window's verdict is one sample of a few requests: at a limit that misses 1 request in 10, a
  window of 5 requests still passes more often than not, so the plain per-window maximum picks
  that limit through most of a burst (on the quick agent trace: 91% attainment, against 100%
  for (a)). A miss `spread` windows away at the same limit counts as this window's too: the
  load there is about the same, and the window passed by chance.
- Elsewhere the schedule never exceeds the largest swept limit: the sweep is all it knows.
- The oracle run also publishes its limit as the shed target, as the controller does when it
  cuts: a drop aborts the youngest batch requests above it (lost work, as for the controller),
  rather than leaving a lull's many requests to run on into the next burst.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

WINDOW_S = 1.0
LEAD_S = 3.0  # about one batch reply (128-384 tokens at 10-15 ms per token)
SPREAD_S = 2.0

Meets = Callable[[dict[str, Any]], bool]


def window_misses(
    requests: Sequence[dict[str, Any]], t0: float, n_windows: int, meets: Meets, window_s: float = WINDOW_S
) -> tuple[list[int], list[int]]:
    """Per window: how many interactive requests overlap it, and how many of those missed the SLO.

    Times are absolute (`sent`, `end`, as the load generator records them); window k covers
    [t0 + k * window_s, t0 + (k + 1) * window_s)."""
    counts = [0] * n_windows
    misses = [0] * n_windows
    for r in requests:
        start = r["sent"] - t0
        end = max(start, r.get("end", r["sent"]) - t0)
        first = max(0, math.floor(start / window_s))
        last = min(n_windows - 1, math.floor(end / window_s))
        missed = not meets(r)
        for k in range(first, last + 1):
            counts[k] += 1
            misses[k] += missed
    return counts, misses


def holding_limits(baseline_misses: Sequence[int], sweep_misses: Mapping[int, Sequence[int]]) -> list[int]:
    """Per window, the largest swept limit whose run missed no more there than (a) did (0: none)."""
    out = []
    for k, allowed in enumerate(baseline_misses):
        holding = [limit for limit, misses in sweep_misses.items() if misses[k] <= allowed]
        out.append(max(holding, default=0))
    return out


def with_lead(limits: Sequence[int], lead_windows: int) -> list[int]:
    """Each window's limit lowered to the smallest of the next `lead_windows` windows' too."""
    return [min(limits[k : k + lead_windows + 1]) for k in range(len(limits))]


def spread_misses(misses: Sequence[int], baseline: Sequence[int], spread_windows: int) -> list[int]:
    """Per window, the most misses beyond (a)'s in any window within `spread_windows` of it."""
    excess = [max(0, m - b) for m, b in zip(misses, baseline, strict=True)]
    return [max(excess[max(0, k - spread_windows) : k + spread_windows + 1]) for k in range(len(excess))]


def oracle_schedule(
    baseline_misses: Sequence[int],
    sweep_misses: Mapping[int, Sequence[int]],
    lead_windows: int,
    spread_windows: int = 0,
    *,
    idle: Sequence[bool] = (),
    idle_limit: int = 0,
) -> list[int]:
    """The per-window lease limits the oracle run publishes. `idle`: the windows (a) had no
    interactive request in, which get `idle_limit` if that is above the sweep's own verdict."""
    n = len(baseline_misses)
    if any(len(m) != n for m in sweep_misses.values()) or (idle and len(idle) != n):
        raise ValueError("every run must be cut into the same windows")
    # Misses beyond (a)'s, spread to the neighbouring windows, against an allowance of none.
    spread = {c: spread_misses(m, baseline_misses, spread_windows) for c, m in sweep_misses.items()}
    limits = holding_limits([0] * n, spread)
    if idle:
        limits = [max(limit, idle_limit) if quiet else limit for limit, quiet in zip(limits, idle, strict=True)]
    return with_lead(limits, lead_windows)


def schedule_from_runs(
    baseline: dict[str, Any],
    sweep: Mapping[int, dict[str, Any]],
    meets: Meets,
    *,
    window_s: float = WINDOW_S,
    lead_s: float = LEAD_S,
    spread_s: float = SPREAD_S,
    idle_limit: int = 0,
) -> list[int]:
    """The oracle's schedule from raw harvest runs ((a) and the static sweep by limit)."""
    n_windows = math.ceil((baseline["t_end"] - baseline["t0"]) / window_s)

    def cut(raw: dict[str, Any]) -> tuple[list[int], list[int]]:
        return window_misses(raw["interactive"]["requests"], raw["t0"], n_windows, meets, window_s)

    counts, base_misses = cut(baseline)
    lead, spread = math.ceil(lead_s / window_s), math.ceil(spread_s / window_s)
    return oracle_schedule(
        base_misses,
        {c: cut(raw)[1] for c, raw in sweep.items()},
        lead,
        spread,
        idle=[n == 0 for n in counts],
        idle_limit=idle_limit,
    )


def limit_at(schedule: Sequence[int], t0: float, now: float, window_s: float = WINDOW_S) -> int:
    """The limit in force at `now`: the first window's before the trace, the last one's after."""
    if not schedule:
        return 0
    k = math.floor((now - t0) / window_s)
    return schedule[min(max(k, 0), len(schedule) - 1)]
