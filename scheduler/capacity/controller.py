"""The capacity controller at work: every period, scrape a deployment's telemetry, step the law
(`scheduler.capacity.law`) and publish what it decided (the limit, the shed target, the fleet's
batch rate) to the lease store, where admission and the drains read it; log what an operator
must see.

The law's names are re-exported here: callers build a controller and its loop from one place.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from backfill.scheduler.capacity.admission import ObservationLog, pool_of
from backfill.scheduler.capacity.law import Controller, Decision, ObsDelta
from backfill.scheduler.capacity.telemetry import FleetSnapshot, FleetTelemetry
from backfill.scheduler.fleet.routing import Pool
from backfill.scheduler.metrics import record_decision
from backfill.storage.leases import RATE_KEY, LeaseStore, kv_key, limit_key, obs_key, shed_key

log = logging.getLogger("backfill.capacity")


class CapacityLoop:
    """Runs the controller of one deployment every period: scrape its telemetry, decide, publish
    its limit and shed target (and, with `publish_rate`, the fleet's batch rate)."""

    def __init__(
        self,
        controller: Controller,
        telemetry: FleetTelemetry,
        leases: LeaseStore,
        *,
        observations: ObservationLog | None = None,
        on_decision: Callable[[float, Decision], None] | None = None,
        deployment: int | Pool = 0,
        publish_rate: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.controller = controller
        self.clock = clock  # the simulator (`backfill.sim`) steps the loop on a virtual clock
        self.telemetry = telemetry
        self.leases = leases
        self.deployment = deployment
        self.publish_rate = publish_rate
        self.observations = observations or ObservationLog(leases, key=obs_key(pool_of(deployment)))
        self.on_decision = on_decision
        self._last_totals: dict[str, float] | None = None
        self._last_at = clock()
        self._rate = 0.0

    def _obs_delta(self, now: float) -> ObsDelta:
        totals = self.observations.totals()
        prev, self._last_totals = self._last_totals, totals
        dt, self._last_at = now - self._last_at, now
        if prev is None:
            return ObsDelta()
        d = {k: max(0.0, totals.get(k, 0.0) - prev.get(k, 0.0)) for k in totals}
        return ObsDelta(
            n=d["n"],
            overloaded=d["overloaded"],
            failed=d["failed"],
            prompt_tokens=d["prompt_tokens"],
            completion_tokens=d["completion_tokens"],
            dt_s=dt,
        )

    def once(self) -> Decision:
        period = self.controller.cfg.period_s
        snap: FleetSnapshot | None
        try:
            snap = self.telemetry.scrape()
        except Exception:
            log.warning("telemetry scrape failed", exc_info=True)
            snap = None
        now = self.clock()
        obs = self._obs_delta(now)
        if obs.dt_s > 0:  # in the units of the batches' token estimates: prompt + output
            self._rate = 0.9 * self._rate + 0.1 * (obs.prompt_tokens + obs.completion_tokens) / obs.dt_s
        decision = self.controller.step(snap, self.leases.count(pool_of(self.deployment)), obs, now)
        # The limit lives a few periods: if this loop stops, admission falls back to the floor.
        ttl = max(1.0, 4 * period)
        self.leases.publish(limit_key(pool_of(self.deployment)), str(decision.limit), ttl_s=ttl)
        if self.controller.kv_budget_tokens:  # for the claims' prefix-group sizing (jobs.execution.claims)
            self.leases.publish(kv_key(pool_of(self.deployment)), str(self.controller.kv_budget_tokens), ttl_s=60.0)
        if decision.shed_to is not None:
            self.leases.publish(shed_key(pool_of(self.deployment)), str(decision.shed_to), ttl_s=max(0.5, 2 * period))
        if self.publish_rate:
            self.leases.publish(RATE_KEY, f"{self._rate:.1f}", ttl_s=60.0)
        record_decision(decision)
        if self.on_decision is not None:
            self.on_decision(time.time(), decision)
        return decision

    def run(self, stop: threading.Event) -> None:
        period = self.controller.cfg.period_s
        say = DecisionLog({self.deployment: self.telemetry})
        while not stop.is_set():
            started = time.monotonic()
            try:
                say(self.deployment, self.once())
            except Exception:
                log.exception("capacity step failed")
            stop.wait(max(0.0, period - (time.monotonic() - started)))
        self.withdraw()
        self.telemetry.close()

    def withdraw(self) -> None:
        """Take back the published limit and shed target at once (rather than let them lapse a few
        periods later): with no controller, admission falls back to the floor (fail closed)."""
        try:
            self.leases.withdraw(limit_key(pool_of(self.deployment)))
            self.leases.withdraw(shed_key(pool_of(self.deployment)))
            log.info("capacity controller stopped: limit withdrawn, admission falls back to the floor")
        except Exception:
            log.warning(
                "could not withdraw the published limit; it lapses within %.1f s",
                4 * self.controller.cfg.period_s,
                exc_info=True,
            )


class FleetCapacityLoop:
    """One controller per deployment, each on its own deployment's telemetry, leases and
    observations, stepped together from one thread: a deployment whose interactive traffic
    leaves no room gets a small limit, and that limit holds back nothing that goes elsewhere.
    The fleet's batch rate (for the planner's completion estimates) is their sum."""

    def __init__(self, loops: list[CapacityLoop]) -> None:
        if not loops:
            raise ValueError("no deployment to control")
        self.loops = loops
        for loop in loops:
            loop.publish_rate = False

    @property
    def period_s(self) -> float:
        return min(loop.controller.cfg.period_s for loop in self.loops)

    def once(self) -> dict[int | Pool, Decision]:
        """One step of every deployment's controller: their decisions, by deployment."""
        decisions: dict[int | Pool, Decision] = {}
        for loop in self.loops:
            try:
                decisions[loop.deployment] = loop.once()
            except Exception:
                log.exception("capacity step of %s failed", pool_of(loop.deployment))
        self.loops[0].leases.publish(RATE_KEY, f"{sum(loop._rate for loop in self.loops):.1f}", ttl_s=60.0)
        return decisions

    def run(self, stop: threading.Event) -> None:
        say = DecisionLog({loop.deployment: loop.telemetry for loop in self.loops})
        while not stop.is_set():
            started = time.monotonic()
            try:
                for deployment, d in self.once().items():
                    say(deployment, d)
            except Exception:
                log.exception("capacity step failed")
            stop.wait(max(0.0, self.period_s - (time.monotonic() - started)))
        self.withdraw()
        for loop in self.loops:
            loop.telemetry.close()

    def withdraw(self) -> None:
        for loop in self.loops:
            loop.withdraw()


_LOGGED = ("no-telemetry", "overload", "step-model", "over-slo", "queue", "wake")


class DecisionLog:
    """Logs a deployment's decision when its reason changes; while telemetry has never answered
    (auto mode on the fixed bound) a warning, repeated every `repeat_s`: an operator must see
    that the controller is not steering."""

    def __init__(self, telemetry: dict[int | Pool, FleetTelemetry], repeat_s: float = 300.0) -> None:
        self.telemetry = telemetry
        self.repeat_s = repeat_s
        self._last: dict[int | Pool, str] = {}
        self._warned: dict[int | Pool, float] = {}

    def __call__(self, deployment: int | Pool, d: Decision) -> None:
        changed = d.reason != self._last.get(deployment)
        self._last[deployment] = d.reason
        if d.reason == "unseen":
            now = time.monotonic()
            if changed or now - self._warned.get(deployment, -math.inf) >= self.repeat_s:
                self._warned[deployment] = now
                urls = ", ".join(e.url for e in self.telemetry[deployment].endpoints)
                log.warning(
                    "capacity control (auto): no answer yet from the fleet's metrics for %s (%s); admission "
                    "holds the fixed bound %d until they answer (BACKFILL_CAPACITY_CONTROL=off makes the "
                    "fixed bound a choice, =on fails closed without telemetry)",
                    pool_of(deployment),
                    urls,
                    d.limit,
                )
        elif changed and d.reason in _LOGGED:
            log.info("capacity %s: %s limit %d shed %s", d.reason, pool_of(deployment), d.limit, d.shed_to)
