"""Which requests fill the capacity.

Three rules, cheapest first to explain:

1. Weighted fair share across teams: each released request charges its team's virtual time by
   the request's token estimate divided by the team's weight, and the team with the smallest
   virtual time goes next. A team that was idle starts at the smallest virtual time of the busy
   ones, so idleness earns no credit, and a team's million-request backlog never starves
   another team's small batch.
2. Earliest deadline first within a team.
3. A completion forecast guards the deadlines: at the batch throughput the fleet gives batch
   work now, a batch that would not finish in its window on its fair share (after the team's
   earlier-deadline batches) is threatened, and threatened batches, earliest deadline first, get
   a guaranteed share of releases on top of fair share (a rescue is not charged to the team),
   so a batch never expires while capacity existed.

A decision looks at batches (from their live counters), never at pending lines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from backfill.jobs.sweeps import PendingBatch

DEFAULT_REQUEST_TOKENS = 1000


@dataclass(frozen=True)
class PolicyConfig:
    guaranteed_share: float = 0.5  # of releases, for threatened batches
    deadline_safety: float = 0.8  # plan to finish within this fraction of the time left


def _request_tokens(b: PendingBatch) -> float:
    return b.remaining_tokens / b.remaining if b.remaining and b.remaining_tokens else DEFAULT_REQUEST_TOKENS


def _edf_key(b: PendingBatch) -> tuple[datetime, datetime, str]:
    return (b.expires_at, b.created_at, b.batch_id)


def threatened(
    pending: Sequence[PendingBatch],
    *,
    now: datetime,
    weights: Mapping[str, float],
    rate_tokens_s: float | None,
    safety: float = 0.8,
) -> set[str]:
    """Batches that would miss their window on their team's fair share of `rate_tokens_s`."""
    if not rate_tokens_s or rate_tokens_s <= 0:
        return set()
    teams = {b.team_id for b in pending}
    total_weight = sum(max(weights.get(t, 1.0), 1e-9) for t in teams)
    out: set[str] = set()
    for team in teams:
        team_rate = rate_tokens_s * max(weights.get(team, 1.0), 1e-9) / total_weight
        ahead = 0.0  # EDF within the team: earlier-deadline batches run first
        for b in sorted((b for b in pending if b.team_id == team), key=_edf_key):
            ahead += b.remaining_tokens or b.remaining * DEFAULT_REQUEST_TOKENS
            left_s = (b.expires_at - now).total_seconds() * safety
            if ahead / team_rate > left_s:
                out.add(b.batch_id)
    return out


class FairPlanner:
    """Keeps the virtual times and the guaranteed-share credit between decisions."""

    def __init__(self, cfg: PolicyConfig | None = None) -> None:
        self.cfg = cfg or PolicyConfig()
        self.vtime: dict[str, float] = {}
        self._credit = 0.0

    def plan(
        self,
        pending: Sequence[PendingBatch],
        slots: int,
        *,
        now: datetime,
        weights: Mapping[str, float] | None = None,
        rate_tokens_s: float | None = None,
    ) -> list[tuple[str, int]]:
        """Split `slots` releases over batches: (batch_id, how many) in claim order, followed by
        every other batch with work in priority order, so a short claim can be filled in."""
        weights = weights or {}
        live = [b for b in pending if b.remaining > 0]
        if slots <= 0 or not live:
            return []
        by_team: dict[str, list[PendingBatch]] = {}
        for b in sorted(live, key=_edf_key):
            by_team.setdefault(b.team_id, []).append(b)
        # Idle teams are forgotten; returning ones start level with the busy ones.
        self.vtime = {t: v for t, v in self.vtime.items() if t in by_team}
        floor = min(self.vtime.values(), default=0.0)
        for t in by_team:
            self.vtime.setdefault(t, floor)
        late = threatened(live, now=now, weights=weights, rate_tokens_s=rate_tokens_s, safety=self.cfg.deadline_safety)
        urgent = sorted((b for b in live if b.batch_id in late), key=_edf_key)
        left = {b.batch_id: b.remaining for b in live}
        given: dict[str, int] = {}

        def give(b: PendingBatch, *, charge: bool) -> None:
            given[b.batch_id] = given.get(b.batch_id, 0) + 1
            left[b.batch_id] -= 1
            if charge:
                self.vtime[b.team_id] += _request_tokens(b) / max(weights.get(b.team_id, 1.0), 1e-9)

        for _ in range(slots):
            self._credit += self.cfg.guaranteed_share if urgent else 0.0
            pick = next((b for b in urgent if left[b.batch_id] > 0), None) if self._credit >= 1.0 else None
            if pick is not None:
                # A rescue, not the team's turn: it does not count against the team's share.
                self._credit -= 1.0
                give(pick, charge=False)
                continue
            teams = [t for t, bs in by_team.items() if any(left[b.batch_id] > 0 for b in bs)]
            if not teams:
                break
            team = min(teams, key=lambda t: (self.vtime[t], _edf_key(by_team[t][0])))
            give(next(b for b in by_team[team] if left[b.batch_id] > 0), charge=True)
        if not urgent:
            self._credit = 0.0
        order = list(given.items())
        tail = [(b.batch_id, left[b.batch_id]) for b in (*urgent, *sorted(live, key=_edf_key)) if left[b.batch_id] > 0]
        seen = set(given)
        for batch_id, k in tail:
            if batch_id not in seen:
                seen.add(batch_id)
                order.append((batch_id, k))
        return order


def plan(pending: Sequence[PendingBatch], slots: int, *, now: datetime) -> list[tuple[str, int]]:
    """Stateless form (equal weights, no forecast): one decision on its own."""
    return FairPlanner().plan(pending, slots, now=now)
