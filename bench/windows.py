"""Completion windows with no idle capacity (issue 21 B): today's policy and the escalating one,
side by side, on one time-compressed trace.

A model of the fleet, stepped in simulated time, around the real decision code: the planner's
fair share (`scheduler.drain.policy.FairPlanner`) for the capacity the controller releases, and the
escalation (`scheduler.drain.escalation.Escalator`, `escalated_plan`) for what escalated batches get
beyond it. The fleet has `slots` sequences; interactive load takes about `load` of them, with
noise; the controller releases what is left below its target utilisation (`slo_util`, its
margin under the SLO). A step's interactive requests meet the SLO unless the fleet's sequences
exceed its slots (requests queue), so the attainment is the interactive-weighted share of the
steps without a queue. Escalated lines may take
`extra` slots beyond the release (step 1, their cost shows in the attainment) and, for the
lines that would still miss, `overflow` slots elsewhere (step 2).

    python -m bench.windows                 # 1 h windows as 60 s, a few 24 h ones as 1440 s
    python -m bench.windows --extra 8 --overflow 8 --seed 3   # (defaults: --extra 4 --overflow 16)

The same comparison on the real stack (fleet, controller, overflow deployment): bench/windows_stack.py.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from backfill.jobs.sweeps import PendingBatch
from backfill.scheduler.drain.escalation import EscalationConfig, Escalator, escalated_plan
from backfill.scheduler.drain.policy import FairPlanner

T0 = datetime(2026, 1, 1, tzinfo=UTC)
TOKENS = 1000  # per line
NORMAL, EXTRA, OVERFLOW = 0, 1, 2  # where a running line holds its slot


@dataclass
class SimBatch:
    id: str
    team: str
    created_s: float
    window_s: float
    total: int
    done: int = 0
    running: list[tuple[float, int]] = field(default_factory=list)  # (finishes at, NORMAL/EXTRA/OVERFLOW)
    finished_s: float | None = None
    overflow_lines: int = 0

    def pending_view(self) -> PendingBatch:
        remaining = self.total - self.done
        return PendingBatch(
            batch_id=self.id,
            team_id=self.team,
            created_at=T0 + timedelta(seconds=self.created_s),
            expires_at=T0 + timedelta(seconds=self.created_s + self.window_s),
            total=self.total,
            remaining=remaining,
            remaining_tokens=remaining * TOKENS,
        )

    def unstarted(self) -> int:
        return self.total - self.done - len(self.running)


@dataclass(frozen=True)
class Trace:
    slots: int = 64
    load: float = 0.9
    noise: float = 0.06
    slo_util: float = 0.92
    line_s: float = 2.0  # seconds a line holds a slot
    dt: float = 0.5
    short_window_s: float = 60.0  # a 1 h window, compressed 60x
    long_window_s: float = 1440.0  # a 24 h window, compressed 60x
    short_batches: int = 12
    short_lines: int = 120
    long_batches: int = 3
    long_lines: int = 600
    seed: int = 1


@dataclass
class Result:
    batches: int
    in_window: int
    expired: int
    overflow_share: float
    attainment: float


def make_batches(t: Trace) -> list[SimBatch]:
    rnd = random.Random(t.seed)
    out = [
        SimBatch(
            f"s{i}", f"team{i % 3}", created_s=i * t.short_window_s / 2, window_s=t.short_window_s, total=t.short_lines
        )
        for i in range(t.short_batches)
    ]
    out += [
        SimBatch(f"l{i}", "team-long", created_s=rnd.uniform(0, 60), window_s=t.long_window_s, total=t.long_lines)
        for i in range(t.long_batches)
    ]
    return out


def simulate(t: Trace, *, escalate: bool, extra: int, overflow: int) -> Result:
    rnd = random.Random(t.seed)
    batches = make_batches(t)
    planner = FairPlanner()
    escalator = Escalator(EscalationConfig())
    end_s = max(b.created_s + b.window_s for b in batches)
    now_s, met, weight = 0.0, 0.0, 0.0
    rate_tokens_s: float | None = None
    finished_tokens = 0.0
    while now_s < end_s:
        now = T0 + timedelta(seconds=now_s)
        for b in batches:  # lines that finish now; batches past their window expire
            ended = [r for r in b.running if r[0] <= now_s]
            b.running = [r for r in b.running if r[0] > now_s]
            b.done += len(ended)
            finished_tokens += len(ended) * TOKENS
            if b.finished_s is None and b.done == b.total:
                b.finished_s = now_s
        live = [b for b in batches if b.created_s <= now_s < b.created_s + b.window_s and b.done < b.total]
        interactive = max(0.0, rnd.gauss(t.load, t.noise)) * t.slots
        on_fleet = sum(1 for b in batches for r in b.running if r[1] == NORMAL)
        released = max(0, int(t.slo_util * t.slots - interactive) - on_fleet)
        by_id = {b.id: b for b in live}
        views = [b.pending_view() for b in live]

        def start(
            plan: list[tuple[str, int]], n: int, kind: int, by_id: dict[str, SimBatch] = by_id, at: float = now_s
        ) -> int:
            given = 0
            for batch_id, k in plan:
                b = by_id[batch_id]
                take = min(k, n - given, b.unstarted())
                b.running += [(at + t.line_s, kind)] * take
                b.overflow_lines += take if kind == OVERFLOW else 0
                given += take
            return given

        start(planner.plan(views, released, now=now, rate_tokens_s=rate_tokens_s), released, NORMAL)
        if escalate:
            escalations = escalator.decide(views, now=now, clock_s=now_s, rate_tokens_s=rate_tokens_s)
            room = extra - sum(1 for b in batches for r in b.running if r[1] == EXTRA)
            start(escalated_plan(escalations, room, overflow=False), room, EXTRA)
            room = overflow - sum(1 for b in batches for r in b.running if r[1] == OVERFLOW)
            start(escalated_plan(escalations, room, overflow=True), room, OVERFLOW)
        util = (interactive + sum(1 for b in batches for r in b.running if r[1] != OVERFLOW)) / t.slots
        met += interactive * (util <= 1.0)
        weight += interactive
        rate_tokens_s = finished_tokens / max(now_s, t.dt)
        now_s += t.dt
    in_window = sum(1 for b in batches if b.finished_s is not None and b.finished_s <= b.created_s + b.window_s)
    lines = sum(b.total for b in batches)
    return Result(
        batches=len(batches),
        in_window=in_window,
        expired=len(batches) - in_window,
        overflow_share=sum(b.overflow_lines for b in batches) / lines,
        attainment=met / weight if weight else 1.0,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", type=float, default=0.9)
    p.add_argument(
        "--extra",
        type=int,
        default=4,
        help="relaxed slots for escalated lines (BACKFILL_ESCALATION_INFLIGHT), default 4",
    )
    p.add_argument(
        "--overflow", type=int, default=16, help="overflow slots (BACKFILL_OVERFLOW_MAX_INFLIGHT), default 16"
    )
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    t = Trace(load=a.load, seed=a.seed)
    base = simulate(t, escalate=False, extra=0, overflow=0)
    esc = simulate(t, escalate=True, extra=a.extra, overflow=a.overflow)
    print(
        f"baseline: batches={base.batches} in_window={base.in_window} expired={base.expired} "
        f"slo_attainment={base.attainment:.3f}"
    )
    print(
        f"windows: batches={esc.batches} in_window={esc.in_window} expired={esc.expired} "
        f"overflow_share={esc.overflow_share:.3f} slo_attainment={esc.attainment:.3f} "
        f"baseline_attainment={base.attainment:.3f}"
    )


if __name__ == "__main__":
    main()
