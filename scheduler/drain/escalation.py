"""Escalation: what a batch that would miss its window gets beyond idle capacity.

The deadline guard (`scheduler.drain.policy.threatened`) gives threatened batches a share of what the
capacity controller releases; a fleet held at its interactive SLO for hours releases almost
nothing, and a share of nothing expires the batch. So a batch whose forecast finish passes its
deadline minus a margin is escalated, in two steps:

1. relaxed: its lines may take leases beyond the controller's limit, up to a bounded extra per
   pool (`BACKFILL_ESCALATION_INFLIGHT`; a deployment's, or its model's where it serves several):
   a bounded part of the interactive SLO budget, spent on these lines only, never on other batch work.
2. overflow: once the batch has been escalated long enough to measure the rate it actually gets,
   the lines that would still miss at that rate go to the overflow deployment
   (`BACKFILL_OVERFLOW_URLS`). In the last `overflow_margin` of the window every line left goes.

The forecast is made from the batch counters alone (`jobs.sweeps.PendingBatch`), as the policy's:
the batch's team's fair share of the fleet's batch throughput, its team's earlier-deadline
batches ahead of it. With no throughput known, a batch escalates once its progress falls behind
the straight line from its creation to its deadline minus the margin. The rate a batch gets is
measured from its own counters between decisions (kept here, one entry per running batch), so a
decision stays a pass over the batches, never over lines.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import IntEnum

from backfill.jobs.execution.claims import ClaimedRequest, claim_overflow
from backfill.jobs.sweeps import PendingBatch
from backfill.scheduler.capacity.admission import Admission, pool_of
from backfill.scheduler.drain.claiming import claim_lines
from backfill.scheduler.fleet.breaker import BreakerState
from backfill.scheduler.fleet.routing import FleetRoutes, Pool
from backfill.storage.db import unit_of_work
from backfill.storage.leases import LeaseStore

DEFAULT_REQUEST_TOKENS = 1000


class Step(IntEnum):
    none = 0
    relaxed = 1  # a bounded extra of the fleet, beyond idle capacity
    overflow = 2  # and the lines that would still miss go to the overflow deployment


@dataclass(frozen=True)
class EscalationConfig:
    margin: float = 0.2  # escalate when the forecast finish passes the deadline minus this share of the window
    overflow_margin: float = 0.1  # the last share of the window: every line left goes to overflow
    measure: float = 0.05  # share of the window a batch is watched, escalated, before its rate counts
    smoothing: float = 0.3  # EWMA weight of the newest rate sample


@dataclass(frozen=True)
class Escalation:
    batch_id: str
    step: Step
    min_rate: float  # lines/s the batch needs from now on to finish by its deadline minus the margin
    overflow_lines: int  # lines that would still miss at the rate it gets (step overflow only)
    expires_at: datetime


@dataclass
class _Progress:
    since: float  # when the batch was first seen escalated (seconds, the caller's clock)
    at: float
    done: int
    rate: float | None = None  # lines/s, smoothed


def _window_s(b: PendingBatch) -> float:
    return max(1e-9, (b.expires_at - b.created_at).total_seconds())


def _edf_key(b: PendingBatch) -> tuple[datetime, datetime, str]:
    return (b.expires_at, b.created_at, b.batch_id)


def forecast_seconds(
    pending: Sequence[PendingBatch], *, weights: Mapping[str, float], rate_tokens_s: float | None
) -> dict[str, float]:
    """Seconds until each batch would finish on its team's fair share of `rate_tokens_s`, after
    its team's earlier-deadline batches; inf without a rate."""
    if not rate_tokens_s or rate_tokens_s <= 0:
        return {b.batch_id: math.inf for b in pending}
    teams = {b.team_id for b in pending}
    total_weight = sum(max(weights.get(t, 1.0), 1e-9) for t in teams)
    out: dict[str, float] = {}
    for team in teams:
        team_rate = rate_tokens_s * max(weights.get(team, 1.0), 1e-9) / total_weight
        ahead = 0.0
        for b in sorted((b for b in pending if b.team_id == team), key=_edf_key):
            ahead += b.remaining_tokens or b.remaining * DEFAULT_REQUEST_TOKENS
            out[b.batch_id] = ahead / team_rate
    return out


class Escalator:
    """Decides each batch's step from its counters; keeps the measured rate of escalated batches.
    One serves every drain of a process (`scheduler.runtime.get_escalator`), so decisions are
    serialised: each is one pass over the batches."""

    def __init__(self, cfg: EscalationConfig | None = None) -> None:
        self.cfg = cfg or EscalationConfig()
        self._progress: dict[str, _Progress] = {}
        self._lock = threading.Lock()

    def decide(
        self,
        pending: Sequence[PendingBatch],
        *,
        now: datetime,
        clock_s: float,
        weights: Mapping[str, float] | None = None,
        rate_tokens_s: float | None = None,
    ) -> dict[str, Escalation]:
        """The escalated batches (step relaxed or overflow), by id; `clock_s` is a monotonic clock
        for the rate measurement. Batches not returned run on idle capacity as before."""
        with self._lock:
            return self._decide(pending, now=now, clock_s=clock_s, weights=weights, rate_tokens_s=rate_tokens_s)

    def _decide(
        self,
        pending: Sequence[PendingBatch],
        *,
        now: datetime,
        clock_s: float,
        weights: Mapping[str, float] | None,
        rate_tokens_s: float | None,
    ) -> dict[str, Escalation]:
        cfg = self.cfg
        live = [b for b in pending if b.remaining > 0]
        forecast = forecast_seconds(live, weights=weights or {}, rate_tokens_s=rate_tokens_s)
        out: dict[str, Escalation] = {}
        for b in live:
            window = _window_s(b)
            left_s = (b.expires_at - now).total_seconds()
            elapsed = window - left_s
            done = b.total - b.remaining
            if math.isinf(forecast[b.batch_id]):
                # No throughput to forecast with: behind the straight line to deadline - margin?
                on_time = b.total * min(1.0, elapsed / (window * (1 - cfg.margin)))
                late = elapsed >= cfg.measure * window and done < on_time
            else:
                late = forecast[b.batch_id] > left_s - cfg.margin * window
            p = self._progress.get(b.batch_id)
            if not late and p is None:
                continue
            if p is None:
                p = self._progress[b.batch_id] = _Progress(since=clock_s, at=clock_s, done=done)
            elif clock_s > p.at:
                sample = max(0, done - p.done) / (clock_s - p.at)
                p.rate = sample if p.rate is None else (1 - cfg.smoothing) * p.rate + cfg.smoothing * sample
                p.at, p.done = clock_s, done
            # Once escalated a batch stays so (in this process): its rate is measured with the extra.
            out[b.batch_id] = self._step(b, p, left_s=left_s, window=window, clock_s=clock_s)
        self._progress = {k: v for k, v in self._progress.items() if k in {b.batch_id for b in live}}
        return out

    def _step(self, b: PendingBatch, p: _Progress, *, left_s: float, window: float, clock_s: float) -> Escalation:
        cfg = self.cfg
        min_rate = b.remaining / max(1e-3, left_s - cfg.margin * window)
        overflow = 0
        if left_s <= cfg.overflow_margin * window:
            overflow = b.remaining  # the last stretch: everything left goes
        elif p.rate is not None and clock_s - p.since >= cfg.measure * window:
            reachable = p.rate * (left_s - cfg.overflow_margin * window)
            overflow = max(0, math.ceil(b.remaining - reachable))
        return Escalation(
            batch_id=b.batch_id,
            step=Step.overflow if overflow > 0 else Step.relaxed,
            min_rate=min_rate,
            overflow_lines=overflow,
            expires_at=b.expires_at,
        )


def escalated_plan(escalations: Mapping[str, Escalation], slots: int, *, overflow: bool) -> list[tuple[str, int]]:
    """Claim order for escalated leases: earliest deadline first, each batch up to what it is
    owed. For overflow leases, the overflow lines of step-overflow batches; for relaxed leases,
    every escalated batch (its remaining lines are claimed; the claim stops at what exists)."""
    if slots <= 0:
        return []
    chosen = sorted(
        (e for e in escalations.values() if not overflow or e.step is Step.overflow),
        key=lambda e: (e.expires_at, e.batch_id),
    )
    out: list[tuple[str, int]] = []
    for e in chosen:
        out.append((e.batch_id, e.overflow_lines if overflow else slots))
    return out


# A drain's escalated releases (`scheduler.drain.escalation`): leases and claims for escalated lines.
#
# Escalated lines take leases of the same per-deployment pools as every batch line, so renewal,
# release and the deployment's in-flight count need nothing new; only the limit they may fill to
# differs:
#
# - relaxed: a fleet deployment's controller limit plus `BACKFILL_ESCALATION_INFLIGHT`. Ordinary
#   lines stop at the limit, so the extra goes to escalated lines only, and while they hold it the
#   ordinary ones get nothing there. On a deployment serving several models the extra is taken in
#   the escalated batch's model's own pool (`fleet/MODEL`), over that pool's limit: it spends that
#   model's workers' SLO budget, as its ordinary lines fill that pool and no other.
# - overflow: the overflow deployments' pools (`pool_of(i)` for i after the fleet's), each up to
#   `BACKFILL_OVERFLOW_MAX_INFLIGHT`, only for the overflow lines of batches at that step, and
#   only while that deployment's circuit is closed (one probe while half-open or open, as the
#   fleet's): an overflow that fails opens its breaker and its lines go back to the fleet paths.
#
# A reply from an overflow deployment is shown as such in the output: its `response.request_id`
# carries the `overflow-` prefix (`overflow_request_id`), a string OpenAI's clients parse as any.

OVERFLOW_PREFIX = "overflow-"

Plan = Callable[[int], list[tuple[str, int]]]
Circuits = Callable[[list[Pool]], Awaitable[dict[Pool, BreakerState]]]


def overflow_request_id(request_id: str | None) -> str:
    """The request id an overflow line's output carries: the overflow's own id, prefixed."""
    return OVERFLOW_PREFIX + (request_id or "")


@dataclass(frozen=True)
class EscalationLimits:
    relaxed_extra: int  # leases per fleet pool beyond its limit, escalated lines only
    overflow_limit: int  # leases per overflow deployment
    overflow_deployments: list[int]  # indices after the fleet's (`FleetClient` order)


def claim_overflow_lines(plan: Plan, n: int, *, holder: str) -> list[ClaimedRequest]:
    """Claim up to `n` lines for the overflow, batch by batch in the plan's order, each batch
    within its overflow budget: the share the escalation decided less its lines running there
    (`jobs.execution.claims.claim_overflow`). The share is of the lines remaining, which count
    those in flight: without the budget every round would claim the share again, and the
    overflow pool would sit full whatever was decided."""
    out: list[ClaimedRequest] = []
    for batch_id, share in plan(n):
        if len(out) >= n:
            break
        with unit_of_work() as session:
            out += claim_overflow(
                session, batch_id=batch_id, share=share, limit=n - len(out), claim_token=holder, mark=OVERFLOW_PREFIX
            )
    return out


class EscalatedRelease:
    """Takes a drain's escalated leases and claims their lines; the drain sends them as any."""

    def __init__(
        self,
        *,
        admission: Admission,
        leases: LeaseStore,
        limits: EscalationLimits,
        escalated: Callable[[], dict[str, Escalation]],
        relaxed_plan: Plan,
        overflow_plan: Plan,
        model_of: Callable[[str], str | None] | None = None,
    ) -> None:
        self.admission = admission
        self.leases = leases
        self.limits = limits
        self.escalated = escalated
        self.relaxed_plan = relaxed_plan
        self.overflow_plan = overflow_plan
        self.model_of = model_of  # a batch's model, so its lines go only where it is served

    def is_overflow(self, deployment: int) -> bool:
        return deployment >= self.admission.deployments

    async def take(
        self,
        want: int,
        *,
        holder: str,
        states: list[BreakerState],
        held: Mapping[Pool, int],
        routes: FleetRoutes | None = None,
        circuits: Circuits | None = None,
    ) -> list[tuple[ClaimedRequest, str, Pool]]:
        """Up to `want` escalated lines with their leases: (line, lease, pool). `states`: each
        deployment's circuit (fleet, then overflow); `held`: this drain's lines per pool;
        `routes`: which deployments (overflow ones too) serve which model; `circuits`: the
        circuits of model pools (`FleetClient.pool_states`; without it a pool answers to its
        deployment's)."""
        escalations = await asyncio.to_thread(self.escalated)
        if not escalations:
            return []
        model_of = self.model_of if routes is not None else None
        models: list[str | None] = [None]
        if model_of is not None:
            models = sorted({model_of(b) for b in escalations}, key=lambda m: m or "")
        relaxed = await self._relaxed_room(models, states, held, routes, circuits)
        out = await self._by_model(want, holder, self.relaxed_plan, relaxed, model_of)
        if any(e.overflow_lines for e in escalations.values()) and self.limits.overflow_deployments:
            room = self._overflow_room(states, held)
            overflow = {
                m: {p: k for p, k in room.items() if routes is None or routes.serves(p.deployment, m)} for m in models
            }
            out += await self._by_model(want, holder, self.overflow_plan, overflow, model_of, overflow=True)
        return out

    async def _by_model(
        self,
        want: int,
        holder: str,
        plan: Plan,
        rooms: Mapping[str | None, dict[Pool, int]],
        model_of: Callable[[str], str | None] | None,
        *,
        overflow: bool = False,
    ) -> list[tuple[ClaimedRequest, str, Pool]]:
        """A round per model of the escalated batches, in that model's pools (`rooms`); without
        `model_of`, one round of every escalated batch (`rooms[None]`)."""
        if model_of is None:
            return await self._round(want, holder, plan, rooms[None], overflow=overflow)
        out: list[tuple[ClaimedRequest, str, Pool]] = []
        for model, room in rooms.items():

            def of_model(n: int, model: str | None = model) -> list[tuple[str, int]]:
                return [(b, k) for b, k in plan(n) if model_of(b) == model]

            if room and len(out) < want:
                out += await self._round(want - len(out), holder, of_model, room, overflow=overflow)
        return out

    async def _relaxed_room(
        self,
        models: list[str | None],
        states: list[BreakerState],
        held: Mapping[Pool, int],
        routes: FleetRoutes | None,
        circuits: Circuits | None,
    ) -> dict[str | None, dict[Pool, int]]:
        """Per model, the fleet pools its lines take (its own pool where a deployment serving
        several models has one), each up to that pool's limit plus the extra: the extra spends
        that model's workers' SLO budget, never another model's or the deployment's plain pool."""
        if self.limits.relaxed_extra <= 0:
            return {m: {} for m in models}
        deployments = range(self.admission.deployments)
        pools = {
            m: [
                routes.pool(d, m) if routes is not None else Pool(d)
                for d in deployments
                if routes is None or routes.serves(d, m)
            ]
            for m in models
        }
        wanted = sorted({p for ps in pools.values() for p in ps}, key=lambda p: (p.deployment, p.model or ""))
        own = await circuits([p for p in wanted if p.model is not None]) if circuits is not None else {}
        out: dict[str | None, dict[Pool, int]] = {}
        for m, ps in pools.items():
            room = {}
            for p in ps:
                if p.deployment >= len(states):
                    continue
                state = own.get(p, states[p.deployment])
                if state is BreakerState.closed or not held.get(p):
                    room[p] = self.admission.limit(p) + self.limits.relaxed_extra
            out[m] = room
        return out

    def _overflow_room(self, states: list[BreakerState], held: Mapping[Pool, int]) -> dict[Pool, int]:
        room = {}
        for d in self.limits.overflow_deployments:
            state = states[d] if d < len(states) else BreakerState.closed
            if state is BreakerState.closed:
                room[Pool(d)] = self.limits.overflow_limit
            elif not held.get(Pool(d)):  # one line to wait for the probe with
                room[Pool(d)] = min(1, self.limits.overflow_limit)
        return room

    async def _round(
        self, want: int, holder: str, plan: Plan, limits: dict[Pool, int], *, overflow: bool = False
    ) -> list[tuple[ClaimedRequest, str, Pool]]:
        if not limits:
            return []
        leases = await asyncio.to_thread(self._acquire, want, limits)
        if not leases:
            return []
        try:
            if overflow:
                claimed = await asyncio.to_thread(claim_overflow_lines, plan, len(leases), holder=holder)
            else:
                claimed = await asyncio.to_thread(claim_lines, plan, len(leases), holder=holder, kv_budget_tokens=None)
        except BaseException:
            await self._release(leases)
            raise
        await self._release(leases[len(claimed) :])
        return [(request, lease, p) for request, (lease, p) in zip(claimed, leases, strict=False)]

    def _acquire(self, want: int, limits: dict[Pool, int]) -> list[tuple[str, Pool]]:
        out: list[tuple[str, Pool]] = []
        for p, limit in limits.items():
            if len(out) >= want:
                break
            ids = self.leases.acquire(pool_of(p), limit=limit, n=want - len(out), ttl_s=self.admission.ttl_s)
            out += [(lease, p) for lease in ids]
        return out

    async def _release(self, leases: list[tuple[str, Pool]]) -> None:
        for lease, p in leases:
            await self.admission.release([lease], p)
