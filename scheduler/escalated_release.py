"""A drain's escalated releases (`scheduler.escalation`): leases and claims for escalated lines.

Escalated lines take leases of the same per-deployment pools as every batch line, so renewal,
release and the deployment's in-flight count need nothing new; only the limit they may fill to
differs:

- relaxed: a fleet deployment's controller limit plus `BACKFILL_ESCALATION_INFLIGHT`. Ordinary
  lines stop at the limit, so the extra goes to escalated lines only, and while they hold it the
  ordinary ones get nothing there.
- overflow: the overflow deployments' pools (`pool_of(i)` for i after the fleet's), each up to
  `BACKFILL_OVERFLOW_MAX_INFLIGHT`, only for the overflow lines of batches at that step, and
  only while that deployment's circuit is closed (one probe while half-open or open, as the
  fleet's): an overflow that fails opens its breaker and its lines go back to the fleet paths.

A reply from an overflow deployment is shown as such in the output: its `response.request_id`
carries the `overflow-` prefix (`overflow_request_id`), a string OpenAI's clients parse as any.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from backfill.jobs.claims import ClaimedRequest
from backfill.scheduler.admission import Admission, pool_of
from backfill.scheduler.breaker import BreakerState
from backfill.scheduler.claiming import claim_lines
from backfill.scheduler.escalation import Escalation
from backfill.scheduler.leases import LeaseStore

OVERFLOW_PREFIX = "overflow-"

Plan = Callable[[int], list[tuple[str, int]]]


def overflow_request_id(request_id: str | None) -> str:
    """The request id an overflow line's output carries: the overflow's own id, prefixed."""
    return OVERFLOW_PREFIX + (request_id or "")


@dataclass(frozen=True)
class EscalationLimits:
    relaxed_extra: int  # leases per fleet deployment beyond its limit, escalated lines only
    overflow_limit: int  # leases per overflow deployment
    overflow_deployments: list[int]  # indices after the fleet's (`FleetClient` order)


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
    ) -> None:
        self.admission = admission
        self.leases = leases
        self.limits = limits
        self.escalated = escalated
        self.relaxed_plan = relaxed_plan
        self.overflow_plan = overflow_plan

    def is_overflow(self, deployment: int) -> bool:
        return deployment >= self.admission.deployments

    async def take(
        self, want: int, *, holder: str, states: list[BreakerState], held: dict[int, int]
    ) -> list[tuple[ClaimedRequest, str, int]]:
        """Up to `want` escalated lines with their leases: (line, lease, deployment). `states`:
        each deployment's circuit (fleet, then overflow); `held`: this drain's lines per deployment."""
        escalations = await asyncio.to_thread(self.escalated)
        if not escalations:
            return []
        out = await self._round(want, holder, self.relaxed_plan, self._relaxed_room(states, held))
        if any(e.overflow_lines for e in escalations.values()) and self.limits.overflow_deployments:
            out += await self._round(want, holder, self.overflow_plan, self._overflow_room(states, held))
        return out

    def _relaxed_room(self, states: list[BreakerState], held: dict[int, int]) -> dict[int, int]:
        if self.limits.relaxed_extra <= 0:
            return {}
        return {
            d: self.admission.limit(d) + self.limits.relaxed_extra
            for d in range(self.admission.deployments)
            if d < len(states) and (states[d] is BreakerState.closed or not held.get(d))
        }

    def _overflow_room(self, states: list[BreakerState], held: dict[int, int]) -> dict[int, int]:
        room = {}
        for d in self.limits.overflow_deployments:
            state = states[d] if d < len(states) else BreakerState.closed
            if state is BreakerState.closed:
                room[d] = self.limits.overflow_limit
            elif not held.get(d):  # one line to wait for the probe with
                room[d] = min(1, self.limits.overflow_limit)
        return room

    async def _round(
        self, want: int, holder: str, plan: Plan, limits: dict[int, int]
    ) -> list[tuple[ClaimedRequest, str, int]]:
        if not limits:
            return []
        leases = await asyncio.to_thread(self._acquire, want, limits)
        if not leases:
            return []
        try:
            claimed = await asyncio.to_thread(claim_lines, plan, len(leases), holder=holder, kv_budget_tokens=None)
        except BaseException:
            await self._release(leases)
            raise
        await self._release(leases[len(claimed) :])
        return [(request, lease, d) for request, (lease, d) in zip(claimed, leases, strict=False)]

    def _acquire(self, want: int, limits: dict[int, int]) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        for d, limit in limits.items():
            if len(out) >= want:
                break
            ids = self.leases.acquire(pool_of(d), limit=limit, n=want - len(out), ttl_s=self.admission.ttl_s)
            out += [(lease, d) for lease in ids]
        return out

    async def _release(self, leases: list[tuple[str, int]]) -> None:
        for lease, d in leases:
            await self.admission.release([lease], d)
