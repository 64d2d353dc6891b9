"""backfill's batch side on the simulated fleet, steered by the real controller.

What runs here is the scheduler's own code, on the simulation's clock:
- the capacity loop (`scheduler.capacity.controller.CapacityLoop`) with the law
  (`scheduler.capacity.law.Controller`), scraping the simulated fleet's Prometheus text through
  `FleetTelemetry` (its parser and per-window counters), publishing the limit and shed target;
- admission (`scheduler.capacity.admission.Admission`): the limit read back from the lease
  store, leases taken and given back, observations fed to the controller;
- shedding: each drain's share of the excess (`scheduler.drain.shedding.shed_count`), youngest
  first, the line back to pending;
- the release order: the batch's lines in the prefix-tree order of
  `jobs.execution.prefixes.plan_prefix_order`, the split over batches by
  `scheduler.drain.policy.FairPlanner`, and the deadline escalation of
  `scheduler.drain.escalation.Escalator` (one batch with a 24 h window: it never escalates here,
  and the run reports that it was asked);
- an in-memory `LeaseStore` with the protocol of `storage.leases`, on the simulated clock.

Policies: `none` (interactive only), `static` (a fixed limit), `schedule` (a limit per window,
published and shed to as the controller publishes its own: the oracle's), `controller`.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from backfill.jobs.execution.prefixes import FINGERPRINT_BYTES, plan_prefix_order
from backfill.jobs.sweeps import PendingBatch
from backfill.scheduler.capacity.admission import Admission, Observation, pool_of
from backfill.scheduler.capacity.controller import CapacityLoop
from backfill.scheduler.capacity.law import ControlConfig, Controller, Decision, Slo
from backfill.scheduler.capacity.telemetry import FleetTelemetry, KvModel
from backfill.scheduler.drain.escalation import Escalator
from backfill.scheduler.drain.policy import FairPlanner
from backfill.scheduler.drain.shedding import shed_count
from backfill.sim.engine import Clock, Fleet, FleetSpec, Req
from backfill.sim.workload import Trace
from backfill.storage.leases import limit_key, shed_key
from backfill.storage.settings import MetricsEndpoint

POOL = pool_of(0)
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)


class MemoryLeaseStore:
    """`storage.leases.LeaseStore` in memory, on the simulation's clock."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.pools: dict[str, dict[str, float]] = {}
        self.values: dict[str, tuple[str, float]] = {}
        self.n = 0
        # Per pool, no lease expires before this (a lower bound: renewals only move expiries
        # later), so the expired ones are looked for only from then on.
        self.expires_from: dict[str, float] = {}

    def _live(self, pool: str) -> dict[str, float]:
        now = self.clock.now
        held = self.pools.setdefault(pool, {})
        if now < self.expires_from.get(pool, -math.inf):
            return held
        for k in [k for k, t in held.items() if t <= now]:
            del held[k]
        self.expires_from[pool] = min(held.values(), default=math.inf)
        return held

    def acquire(self, pool: str, *, limit: int, n: int, ttl_s: float, settle: bool = True) -> list[str]:
        held = self._live(pool)
        out = []
        for _ in range(max(0, min(n, limit - len(held)))):
            self.n += 1
            lease = f"l{self.n}"
            held[lease] = expires = self.clock.now + ttl_s
            self.expires_from[pool] = min(self.expires_from[pool], expires)
            out.append(lease)
        return out

    def renew(self, pool: str, lease_ids: list[str], *, ttl_s: float) -> None:
        held = self._live(pool)
        expires = self.clock.now + ttl_s
        for lease in lease_ids:
            if lease in held:
                held[lease] = expires
        if lease_ids:
            self.expires_from[pool] = min(self.expires_from[pool], expires)

    def release(self, pool: str, lease_ids: list[str]) -> None:
        held = self.pools.get(pool, {})
        for lease in lease_ids:
            held.pop(lease, None)

    def count(self, pool: str) -> int:
        return len(self._live(pool))

    def heartbeat(self, holder: str, *, ttl_s: float) -> None:
        self.publish(f"hb:{holder}", "1", ttl_s=ttl_s)

    def alive(self, holders: list[str]) -> set[str]:
        return {h for h in holders if self.read(f"hb:{h}") is not None}

    def publish(self, name: str, value: str, *, ttl_s: float) -> None:
        self.values[name] = (value, self.clock.now + ttl_s)

    def read(self, name: str) -> str | None:
        got = self.values.get(name)
        return got[0] if got is not None and got[1] > self.clock.now else None

    def withdraw(self, name: str) -> None:
        self.values.pop(name, None)


class SimTelemetry(FleetTelemetry):
    """The real scraper, reading the simulated fleet's metrics text instead of HTTP."""

    fleet: Fleet | None = None

    def _get(self, url: str) -> str | None:
        assert self.fleet is not None
        return self.fleet.metrics_text(url)


class LineQueue:
    """The batch lines still to release, in plan order: the plan itself is never changed (an
    oracle snapshot shares it instead of copying it); lines shed back go on a stack in front."""

    def __init__(self, plan: tuple[tuple[int, int, int, int], ...]) -> None:
        self.plan = plan
        self.next = 0
        self.requeued: list[tuple[int, int, int, int]] = []

    def __len__(self) -> int:
        return len(self.plan) - self.next + len(self.requeued)

    def __bool__(self) -> bool:
        return len(self) > 0

    def popleft(self) -> tuple[int, int, int, int]:
        if self.requeued:
            return self.requeued.pop()
        self.next += 1
        return self.plan[self.next - 1]

    def appendleft(self, line: tuple[int, int, int, int]) -> None:
        self.requeued.append(line)


@functools.lru_cache(maxsize=64)
def _release_plan(
    seed: int, groups: int, preamble: int, unique: tuple[int, int], output: tuple[int, int]
) -> tuple[tuple[int, int, int, int], ...]:
    """Batch lines (line, group, prompt, max tokens) in the release order the prefix plan gives
    them: the lines under one preamble together. The same for every run of a seed and batch
    shape (the static sweep, the controller, the oracle's replays), so planned once."""
    rng = random.Random(seed * 9973 + 11)
    n = 4000
    lines, paths, kv = [], [], []
    pre_blocks = preamble // 64
    for i in range(n):
        group = i % groups
        prompt = preamble + rng.randint(*unique)
        out = rng.randint(*output)
        lines.append((i + 1, group, prompt, out))
        uniq = (prompt - preamble) // 64
        paths.append(
            group.to_bytes(FINGERPRINT_BYTES, "big") * pre_blocks + (i + 1).to_bytes(FINGERPRINT_BYTES, "big") * uniq
        )
        kv.append(prompt + out)
    plan = plan_prefix_order(paths, [line for line, *_ in lines], kv)
    order = sorted(range(n), key=lambda i: plan.rank[i])
    return tuple(lines[i] for i in order)


class _ClockFn:
    """A picklable `() -> now` for the code that takes a clock."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def __call__(self) -> float:
        return self.clock.now


@dataclass
class Policy:
    kind: str  # none | static | schedule | controller
    limit: int = 0
    schedule: list[int] = field(default_factory=list)
    # Per window, the shed target to publish with the limit (None: none). Empty: shed to the limit.
    sheds: list[int | None] = field(default_factory=list)
    window_s: float = 1.0
    control: dict[str, Any] = field(default_factory=dict)  # ControlConfig overrides

    @property
    def label(self) -> str:
        return {"none": "a", "static": f"s{self.limit}", "schedule": "oracle", "controller": "c"}[self.kind]


@dataclass(frozen=True)
class SloRule:
    ttft_s: float
    itl_s: float


def slo_set_by(a: Sim) -> SloRule:
    """The SLO an interactive-only run sets, by bench.harvest's rule: each request's TTFT <= 2x
    the run's p90 TTFT and its mean ITL <= 1.3x the run's p90 (no ITL bound if nothing streamed)."""
    o = a.outcomes()
    ttft = sorted(x.ttft for x in o if x.ttft is not None)
    itl = sorted(x.itl for x in o if x.itl is not None)

    def p90(xs: list[float]) -> float:
        return xs[min(len(xs) - 1, round(0.9 * (len(xs) - 1)))]

    return SloRule(2 * p90(ttft) if ttft else 0.0, 1.3 * p90(itl) if itl else 1e9)


@dataclass
class Outcome:
    rid: int
    arrival: float
    ttft: float | None
    itl: float | None
    done_at: float | None


class Sim:
    """One run: a trace, a fleet, a policy for the batch side."""

    LEASE_TTL_S = 5.0
    REFILL_S = 0.05
    SHED_CHECK_S = 0.1

    def __init__(
        self, spec: FleetSpec, trace: Trace, policy: Policy, *, slo: SloRule, seed: int = 0, tail_s: float = 30.0
    ) -> None:
        self.spec = spec
        self.trace = trace
        self.policy = policy
        self.slo = slo
        self.seed = seed
        self.tail_s = tail_s
        self.clock = Clock()
        self.clock.targets["sim"] = self
        self.fleet = Fleet(spec, self.clock, "sim")
        self.store = MemoryLeaseStore(self.clock)
        controlled = policy.kind in ("schedule", "controller")
        self.admission = Admission(
            self.store, fixed_limit=policy.limit, ttl_s=self.LEASE_TTL_S, controlled=controlled, floor=0
        )
        self.rid = 0
        self.sessions = trace.sessions
        self.interactive: list[Req] = []
        self.batch_done: list[tuple[float, int]] = []  # (time, output tokens)
        self.batch_inflight: dict[int, tuple[Req, str]] = {}
        self.batch_aborted = 0
        self.decisions: dict[str, int] = {}
        self.limits: list[tuple[float, int]] = []
        self.sheds: list[int | None] = []  # the controller's shed target beside each limit
        self.escalated = 0
        self.batch_on = policy.kind != "none"
        self.duration = trace.duration_s
        self._lines = self._plan_lines()
        self.loop: CapacityLoop | None = None
        self.planner = FairPlanner()
        self.escalator = Escalator()
        if policy.kind == "controller":
            self.loop = self._make_loop()
        for sid, s in enumerate(self.sessions):
            if s.start_s < self.duration:
                self.clock.at(s.start_s, "sim", "turn", sid, 0, trace.system_tokens)
        if self.batch_on:
            self.clock.at(0.0, "sim", "refill_tick")
            self.clock.at(0.0, "sim", "shed_tick")
            self.clock.at(0.0, "sim", "lease_tick")
            self.clock.at(0.0, "sim", "policy_tick")

    # -- set-up ----------------------------------------------------------------------------
    def _plan_lines(self) -> LineQueue:
        spec = self.spec
        return LineQueue(
            _release_plan(self.seed, spec.batch_groups, spec.batch_preamble, spec.batch_unique, spec.batch_output)
        )

    def _make_loop(self) -> CapacityLoop:
        spec = self.spec
        ctl: dict[str, Any] = dict(
            slo=Slo(ttft_s=self.slo.ttft_s, itl_s=self.slo.itl_s),
            floor=0,
            ceiling=128,
            kv=KvModel(
                bytes_per_token=spec.kv_bytes_per_token + spec.kv_extra_bytes_per_token,
                budget_bytes=spec.kv_budget_bytes,
            ),
            engine_priority=spec.priority,  # as an operator of a fleet with priority scheduling sets it
        )
        ctl.update(dict(spec.control))
        ctl.update(self.policy.control)
        endpoints = [MetricsEndpoint(role="frontend", url=self.fleet.urls["frontend"])] + [
            MetricsEndpoint(role=w.role, url=self.fleet.urls[f"w{w.index}"]) for w in self.fleet.workers
        ]
        tel = SimTelemetry(endpoints, clock=_ClockFn(self.clock))
        tel.fleet = self.fleet
        return CapacityLoop(
            Controller(ControlConfig(**ctl)),
            tel,
            self.store,
            observations=self.admission.logs[0],
            clock=_ClockFn(self.clock),
        )

    # -- interactive -----------------------------------------------------------------------
    def turn(self, sid: int, k: int, context: int) -> None:
        if self.clock.now >= self.duration:
            return
        t = self.sessions[sid].turns[k]
        prompt = context + t.new_tokens
        sys_n = self.trace.system_tokens
        key = f"S{sid}"
        self.rid += 1
        r = Req(
            self.rid,
            interactive=True,
            prompt=prompt,
            max_tokens=t.max_tokens,
            chain=((key, context), ("sys", sys_n)) if sys_n else ((key, context),),
            prefill_store=((key, prompt), ("sys", sys_n)) if sys_n else ((key, prompt),),
            finish_store=((key, prompt + t.max_tokens),),
            shared=("sys", sys_n) if sys_n else None,
        )
        r.session, r.turn = sid, k
        self.interactive.append(r)
        self.fleet.submit(r)

    def request_done(self, r: Req) -> None:
        if r.interactive:
            turns = self.sessions[r.session].turns
            if r.turn + 1 < len(turns):
                nxt = self.clock.now + turns[r.turn].think_s
                self.clock.at(nxt, "sim", "turn", r.session, r.turn + 1, r.prompt + r.max_tokens)
            return
        held = self.batch_inflight.pop(r.rid, None)
        if held is None:
            return
        self.store.release(POOL, [held[1]])
        self.batch_done.append((self.clock.now, r.max_tokens))
        self.admission.observe(
            Observation(200, self.clock.now - r.arrival, False, prompt_tokens=r.prompt, completion_tokens=r.max_tokens)
        )
        self.refill()

    # -- batch side ------------------------------------------------------------------------
    def limit(self) -> int:
        return self.admission.limit(0)

    def refill(self) -> None:
        if not self.batch_on or self.clock.now >= self.duration:
            return
        limit = self.limit()  # (once: nothing is published within a refill)
        want = limit - len(self.batch_inflight)
        if want <= 0 or not self._lines:
            return
        leases = self.store.acquire(POOL, limit=limit, n=want, ttl_s=self.LEASE_TTL_S)
        for lease in leases:
            line, group, prompt, out = self._lines.popleft()
            self.rid += 1
            pre = self.spec.batch_preamble
            r = Req(
                self.rid,
                interactive=False,
                prompt=prompt,
                max_tokens=out,
                chain=((f"g{group}", pre),),
                prefill_store=((f"g{group}", pre),),
                shared=(f"g{group}", pre),
            )
            r.line = line
            r.session = group
            self.batch_inflight[r.rid] = (r, lease)
            self.fleet.submit(r)

    def refill_tick(self) -> None:
        self.refill()
        if self.clock.now < self.duration:
            self.clock.at(self.clock.now + self.REFILL_S, "sim", "refill_tick")

    def shed_tick(self) -> None:
        target = self.admission.shed_target(0)
        if target is not None and self.batch_inflight:
            k = shed_count(self.store.count(POOL), target, len(self.batch_inflight))
            if k:
                youngest = sorted(self.batch_inflight.values(), key=lambda x: x[0].arrival, reverse=True)[:k]
                for r, lease in youngest:
                    del self.batch_inflight[r.rid]
                    self.fleet.abort(r)
                    self.store.release(POOL, [lease])
                    self._lines.appendleft((r.line, r.session, r.prompt, r.max_tokens))
                    self.batch_aborted += 1
        if self.clock.now < self.duration:
            self.clock.at(self.clock.now + self.SHED_CHECK_S, "sim", "shed_tick")

    def lease_tick(self) -> None:
        self.store.renew(POOL, [lease for _, lease in self.batch_inflight.values()], ttl_s=self.LEASE_TTL_S)
        # The planner's split and the deadline guard, on the batch's counters (one batch here).
        now_dt = EPOCH + timedelta(seconds=self.clock.now)
        remaining = len(self._lines) + len(self.batch_inflight)
        pending = [
            PendingBatch(
                batch_id="sim",
                team_id="sim",
                created_at=EPOCH,
                expires_at=EPOCH + timedelta(hours=24),
                total=4000,
                remaining=remaining,
                remaining_tokens=remaining * 700,
            )
        ]
        self.planner.plan(pending, 1, now=now_dt, rate_tokens_s=self.admission.batch_rate())
        self.escalated += len(
            self.escalator.decide(
                pending, now=now_dt, clock_s=self.clock.now, rate_tokens_s=self.admission.batch_rate()
            )
        )
        if self.clock.now < self.duration:
            self.clock.at(self.clock.now + 1.0, "sim", "lease_tick")

    def policy_tick(self) -> None:
        now = self.clock.now
        if self.policy.kind == "controller":
            assert self.loop is not None
            d: Decision = self.loop.once()
            self.decisions[d.reason] = self.decisions.get(d.reason, 0) + 1
            self.limits.append((now, d.limit))
            self.sheds.append(d.shed_to)
            period = self.loop.controller.cfg.period_s
        elif self.policy.kind == "schedule":
            w = self.policy.window_s
            k = math.floor(now / w + 1e-9)
            sched = self.policy.schedule
            limit = sched[k] if k < len(sched) else 0
            self.store.publish(limit_key(pool_of(0)), str(limit), ttl_s=2 * w)
            if not self.policy.sheds:
                self.store.publish(shed_key(pool_of(0)), str(limit), ttl_s=2 * w)
            elif k < len(self.policy.sheds) and self.policy.sheds[k] is not None:
                self.store.publish(shed_key(pool_of(0)), str(self.policy.sheds[k]), ttl_s=max(0.5, 2 * w))
            self.limits.append((now, limit))
            if not self.policy.sheds:
                self.shed_tick_once()  # (a replayed controller's sheds wait for the drains' tick, as its own)
            period = w
        else:
            period = 1.0
        self.refill()
        if now < self.duration:
            self.clock.at(now + period, "sim", "policy_tick")

    def shed_tick_once(self) -> None:
        target = self.admission.shed_target(0)
        if target is None or not self.batch_inflight:
            return
        k = shed_count(self.store.count(POOL), target, len(self.batch_inflight))
        for r, lease in sorted(self.batch_inflight.values(), key=lambda x: x[0].arrival, reverse=True)[:k]:
            del self.batch_inflight[r.rid]
            self.fleet.abort(r)
            self.store.release(POOL, [lease])
            self._lines.appendleft((r.line, r.session, r.prompt, r.max_tokens))
            self.batch_aborted += 1

    # -- running ---------------------------------------------------------------------------
    def run_until(self, t: float) -> None:
        self.clock.run_until(t)

    def finish(self) -> None:
        """The trace's end: no new batch work; interactive requests in flight run to their end."""
        self.run_until(self.duration)
        self.batch_on = False
        end = self.duration + self.tail_s
        while (
            self.clock.heap
            and self.clock.now < end
            and any(r.done_at is None and r.state != "aborted" for r in self.interactive)
        ):
            self.clock.run_until(min(end, self.clock.now + 1.0))

    # -- results ---------------------------------------------------------------------------
    def outcomes(self) -> list[Outcome]:
        out = []
        for r in self.interactive:
            ttft = None if r.first_at is None else r.first_at - r.arrival
            itl = None
            if r.done_at is not None and r.first_at is not None and r.max_tokens > 1:
                itl = (r.done_at - r.first_at) / (r.max_tokens - 1)
            out.append(Outcome(r.rid, r.arrival, ttft, itl, r.done_at))
        return out

    def meets(self, o: Outcome) -> bool:
        return (
            o.done_at is not None
            and o.ttft is not None
            and o.ttft <= self.slo.ttft_s
            and (o.itl is None or o.itl <= self.slo.itl_s)
        )

    def batch_tok_s(self) -> float:
        return sum(n for t, n in self.batch_done if t <= self.duration) / self.duration


def simulate(
    spec: FleetSpec, trace: Trace, policy: Policy, *, slo: SloRule | None = None, seed: int = 0
) -> dict[str, Any]:
    """One what-if run, as `backfill simulate` prints it: (a) sets the SLO unless one is given."""
    from statistics import median

    def summary(sim: Sim) -> dict[str, Any]:
        o = sim.outcomes()
        ttft = sorted(x.ttft for x in o if x.ttft is not None)
        itl = sorted(x.itl for x in o if x.itl is not None)

        def q(xs: list[float], p: float) -> float | None:
            return xs[min(len(xs) - 1, round(p * (len(xs) - 1)))] if xs else None

        return {
            "attainment": sum(sim.meets(x) for x in o) / max(1, len(o)),
            "interactive": len(o),
            "ttft_p50_s": q(ttft, 0.5),
            "ttft_p90_s": q(ttft, 0.9),
            "itl_p50_s": q(itl, 0.5) if itl else None,
            "itl_p90_s": q(itl, 0.9) if itl else None,
            "batch_output_tok_s": sim.batch_tok_s(),
            "batch_shed": sim.batch_aborted,
            "decisions": dict(sim.decisions),
            "median_limit": median(v for _, v in sim.limits) if sim.limits else None,
        }

    a = Sim(spec, trace, Policy("none"), slo=slo or SloRule(1e9, 1e9), seed=seed)
    a.finish()
    if slo is None:
        slo = a.slo = slo_set_by(a)
    run = Sim(spec, trace, policy, slo=slo, seed=seed)
    run.finish()
    gpus = (spec.prefill_workers if spec.mode == "disagg" else 0) + spec.decode_workers
    out: dict[str, Any] = {"fleet": spec.name, "trace": trace.name, "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s}}
    out["interactive_only"] = summary(a)
    out[policy.label] = summary(run)
    out["batch_output_tok_s_per_gpu"] = run.batch_tok_s() / max(1, gpus * spec.gpus_per_worker)
    return out
