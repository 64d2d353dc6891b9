"""The capacity controller: how many batch requests the fleet can carry right now.

Idle capacity is the room between the interactive latency of the moment and the interactive
SLO, so the controller steers on latency, with the fleet's own telemetry as the sensor:

- decode pool: the workers' mean inter-token latency over the last window (every running
  sequence shares the engine's step time, so batch requests see what interactive ones see) and
  KV cache occupancy; prefill pool: time to first token and the engines' waiting queues;
- interactive requests in flight: streamed requests at the frontend (batch lines never stream),
  or its in-flight count minus the batch leases held, whichever is larger;
- what batch requests themselves saw: 429/503 answers, their prompt and output sizes.

The law is AIMD-like. Grow in proportion to the room left while latency sits below the SLO
with a margin (and only while the leases are actually used); cut in proportion to the overshoot
when the smoothed latency crosses the target; cut hard when a queue forms, a 429/503 arrives,
an engine preempts or its KV cache nears full, latency crosses the SLO itself, or interactive
requests surge, and then
also shed: publish a target below the in-flight count so drains abort their youngest requests
and requeue them. The KV model caps the limit (the cache's token capacity follows from its byte
budget and the bytes per token) and the engines' sequence slots cap it too, with a reserve kept
for interactive arrivals. Without fresh telemetry the limit falls to the floor: fail closed.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from backfill.scheduler.admission import RATE_KEY, ObservationLog, kv_key, limit_key, obs_key, pool_of, shed_key
from backfill.scheduler.leases import LeaseStore
from backfill.scheduler.metrics import record_decision
from backfill.scheduler.telemetry import FleetSnapshot, FleetTelemetry, KvModel

log = logging.getLogger("backfill.capacity")


@dataclass(frozen=True)
class Slo:
    ttft_s: float  # interactive time to first token
    itl_s: float  # interactive mean inter-token latency


@dataclass(frozen=True)
class ControlConfig:
    slo: Slo
    floor: int = 0
    ceiling: int = 256
    period_s: float = 0.25
    stale_s: float = 1.5  # telemetry older than this counts as none
    grow_below: float = 0.8  # grow while smoothed latency < this fraction of the target
    cut_above: float = 0.92  # cut while smoothed latency > this fraction of the target
    grow_gain: float = 0.5  # growth per period, as a fraction of the limit, scaled by the room left
    cut_gain: float = 2.0  # cut per period, as a fraction of in-flight, per unit of relative overshoot
    hard_cut: float = 0.5  # what is left of in-flight after a hard cut
    hold_s: float = 0.75  # no growth for this long after a cut
    surge_requests: int = 3  # interactive arrivals in one period that count as a surge
    # With no interactive request in flight for idle_after_s, nobody is waiting on a token: the
    # latency target stretches to idle_target x SLO, and the first interactive arrival sheds
    # back down to what the SLO allows. 1.0 disables this.
    idle_after_s: float = 1.0
    idle_target: float = 1.0
    seq_reserve: float = 0.25  # share of the engines' sequence slots never given to batch
    kv_batch_share: float = 0.8  # share of the KV cache batch requests may fill at most
    kv_full: float = 0.9  # KV occupancy of the fullest decoder at which preemption is near
    kv: KvModel = field(default_factory=lambda: KvModel(bytes_per_token=0))
    # `BACKFILL_CAPACITY_CONTROL=auto`: the limit while the fleet's telemetry has never answered
    # (the fixed bound), so a fleet without metrics still gets work; once telemetry has been
    # seen, losing it fails closed to the floor like `on`. None (`on`): always the floor.
    unseen_limit: int | None = None
    # EWMA weight of the newest latency window: the SLO is on a request's mean inter-token
    # latency over its whole reply (a second or two), not on any 0.25 s window.
    smoothing: float = 0.25
    queue_periods: int = 3  # a waiting queue seen this many periods in a row has formed


@dataclass(frozen=True)
class ObsDelta:
    """Batch observations since the previous period."""

    n: float = 0.0
    overloaded: float = 0.0
    failed: float = 0.0
    prompt_tokens: float = 0.0
    completion_tokens: float = 0.0
    dt_s: float = 0.0


@dataclass(frozen=True)
class Decision:
    limit: int
    shed_to: int | None
    reason: str
    interactive: int = 0
    batch: int = 0
    itl_s: float | None = None
    ttft_s: float | None = None
    kv_usage: float = 0.0
    cap: int = 0
    idle: bool = False


class Controller:
    """The control law, free of I/O: one `step` per period."""

    def __init__(self, cfg: ControlConfig) -> None:
        self.cfg = cfg
        self.limit = float(cfg.floor)
        self._itl: float | None = None
        self._ttft: float | None = None
        self._itl_floor: float | None = None  # step time with (almost) no batch work
        self._hold_until = 0.0
        self._last_interactive = -1e9
        self._was_idle = False
        self._queued_for = 0
        self._kv_per_request = 1024.0  # prompt + output tokens of a batch request, learned
        self.seen = False  # whether complete telemetry has ever arrived
        # KV cache tokens the decoders leave to batch work, from the KV model (None: unknown).
        self.kv_budget_tokens: int | None = None

    def _smooth(self, prev: float | None, new: float | None) -> float | None:
        if new is None:
            return prev
        if prev is None:
            return new
        a = self.cfg.smoothing
        return a * new + (1 - a) * prev

    def _cap(self, snap: FleetSnapshot) -> int:
        cfg = self.cfg
        cap = cfg.ceiling
        fe = snap.frontend
        decoders = sum(1 for w in snap.workers if w.role in ("agg", "decode"))
        if fe is not None and decoders:
            if fe.max_num_seqs:
                cap = min(cap, int(fe.max_num_seqs * decoders * (1 - cfg.seq_reserve)))
            kv_tokens = cfg.kv.tokens(fe.kv_tokens_per_worker)
            if kv_tokens:
                self.kv_budget_tokens = int(kv_tokens * decoders * cfg.kv_batch_share)
                cap = min(cap, int(self.kv_budget_tokens / self._kv_per_request))
        return max(cap, cfg.floor)

    def _fits(self, b: int, itl: float | None, target: float) -> int:
        """In-flight batch requests that would bring the step time down to `target`, taking the
        part of the step time above the no-batch floor as proportional to the load."""
        floor = self._itl_floor if self._itl_floor is not None else 0.5 * self.cfg.slo.itl_s
        if itl is None or itl <= target or itl <= floor:
            return b
        return max(0, int(b * max(0.0, target - floor) / (itl - floor)))

    def step(self, snap: FleetSnapshot | None, batch_inflight: int, obs: ObsDelta, now: float) -> Decision:
        cfg = self.cfg
        if snap is None or not snap.complete or now - snap.at > cfg.stale_s:
            # Fail closed, and start again from the floor once telemetry is back.
            self.limit = float(cfg.floor)
            self._itl = self._ttft = None
            if not self.seen and cfg.unseen_limit is not None:
                return Decision(cfg.unseen_limit, None, "unseen", batch=batch_inflight)
            return Decision(cfg.floor, None, "no-telemetry", batch=batch_inflight)
        self.seen = True
        fe = snap.frontend
        assert fe is not None
        if obs.n:
            per = (obs.prompt_tokens + obs.completion_tokens) / obs.n
            if per > 0:
                self._kv_per_request = 0.8 * self._kv_per_request + 0.2 * per
        decode = snap.pool("decode")
        prefill = snap.pool("prefill")
        # Engine figures first; the frontend's (which mix in batch requests' own queueing)
        # where a pool does not report them (e.g. disaggregated prefill workers and TTFT).
        itl_raw = decode.itl_s if decode is not None and decode.itl_s is not None else fe.itl_s
        ttft_raw = prefill.ttft_s if prefill is not None and prefill.ttft_s is not None else fe.ttft_s
        b = batch_inflight
        if itl_raw is None and ttft_raw is None and fe.inflight == 0 and b == 0:
            # Nothing running, so nothing measured: the last latency is stale, not a reading. Kept,
            # it would hold a limit cut to a floor of 0 there for good (no work, no new figure).
            self._itl = self._ttft = None
        self._itl = self._smooth(self._itl, itl_raw)
        self._ttft = self._smooth(self._ttft, ttft_raw)
        if itl_raw is not None and b <= 2:
            self._itl_floor = itl_raw if self._itl_floor is None else 0.9 * self._itl_floor + 0.1 * itl_raw
        interactive = max(fe.streaming, fe.inflight - b)
        arrivals = fe.stream_arrivals
        if interactive or arrivals:
            self._last_interactive = now
        idle = cfg.idle_target > 1.0 and now - self._last_interactive >= cfg.idle_after_s
        waiting = sum(w.waiting for w in snap.workers) + fe.queued
        queued = waiting >= max(2, 0.1 * sum(w.running for w in snap.workers))
        self._queued_for = self._queued_for + 1 if queued else 0
        queue_formed = self._queued_for >= cfg.queue_periods
        preempted = sum(w.preempted for w in snap.workers)
        overload = obs.overloaded + fe.rejected
        cap = self._cap(snap)
        kv = decode.kv_usage_max if decode is not None else 0.0

        # Latency as a fraction of the target of the moment: the worse of the two pools.
        scale = cfg.idle_target if idle else 1.0
        itl_slo, ttft_slo = cfg.slo.itl_s * scale, cfg.slo.ttft_s * scale
        pressure = max(
            (self._itl / itl_slo) if self._itl is not None else 0.0,
            (self._ttft / ttft_slo) if self._ttft is not None else 0.0,
        )
        raw_pressure = max(
            (itl_raw / itl_slo) if itl_raw is not None else 0.0,
            (ttft_raw / ttft_slo) if ttft_raw is not None else 0.0,
        )
        in_use = min(self.limit, float(b))
        shed_to: int | None = None
        if self._was_idle and not idle:
            # Interactive work is back after a quiet spell: give back, at once, what the SLO
            # (not the stretched idle target) cannot carry.
            reason = "wake"
            shed_to = self._fits(b, self._itl, cfg.cut_above * cfg.slo.itl_s)
            self.limit = min(in_use, float(shed_to))
            self._hold_until = now + cfg.hold_s
        elif hard := next(
            (
                name
                for name, hit in (
                    ("overload", overload),
                    ("preempted", preempted),
                    ("kv-full", kv >= cfg.kv_full),
                    ("queue", queue_formed),
                    ("over-slo", pressure >= 1.0 or raw_pressure >= 1.5),
                    ("surge", arrivals >= cfg.surge_requests and b),
                )
                if hit
            ),
            "",
        ):
            reason = hard
            self.limit = in_use * cfg.hard_cut
            shed_to = int(self.limit)
            self._hold_until = now + cfg.hold_s
        elif pressure > cfg.cut_above:
            reason = "cut"
            overshoot = (pressure - cfg.cut_above) / cfg.cut_above
            self.limit = in_use * max(cfg.hard_cut, 1.0 - cfg.cut_gain * overshoot)
            self._hold_until = now + cfg.hold_s
        elif now < self._hold_until:
            reason = "hold"
        elif pressure < cfg.grow_below and b >= int(0.7 * self.limit):
            # (int: with a fractional limit below one, no lease can be taken, and growth must
            # not wait for one.)
            reason = "grow"
            room = (cfg.grow_below - pressure) / cfg.grow_below
            self.limit += max(1.0, cfg.grow_gain * room * self.limit)
        else:
            reason = "steady"
        self._was_idle = idle
        self.limit = min(max(self.limit, float(cfg.floor)), float(cap))
        if shed_to is not None:
            shed_to = max(shed_to, cfg.floor)
            if shed_to >= b:
                shed_to = None
        return Decision(
            limit=int(self.limit),
            shed_to=shed_to,
            reason=reason,
            interactive=interactive,
            batch=b,
            itl_s=self._itl,
            ttft_s=self._ttft,
            kv_usage=kv,
            cap=cap,
            idle=idle,
        )


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
        deployment: int = 0,
        publish_rate: bool = True,
    ) -> None:
        self.controller = controller
        self.telemetry = telemetry
        self.leases = leases
        self.deployment = deployment
        self.publish_rate = publish_rate
        self.observations = observations or ObservationLog(leases, key=obs_key(deployment))
        self.on_decision = on_decision
        self._last_totals: dict[str, float] | None = None
        self._last_at = time.monotonic()
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
        now = time.monotonic()
        obs = self._obs_delta(now)
        if obs.dt_s > 0:  # in the units of the batches' token estimates: prompt + output
            self._rate = 0.9 * self._rate + 0.1 * (obs.prompt_tokens + obs.completion_tokens) / obs.dt_s
        decision = self.controller.step(snap, self.leases.count(pool_of(self.deployment)), obs, now)
        # The limit lives a few periods: if this loop stops, admission falls back to the floor.
        ttl = max(1.0, 4 * period)
        self.leases.publish(limit_key(self.deployment), str(decision.limit), ttl_s=ttl)
        if self.controller.kv_budget_tokens:  # for the claims' prefix-group sizing (jobs.claims)
            self.leases.publish(kv_key(self.deployment), str(self.controller.kv_budget_tokens), ttl_s=60.0)
        if decision.shed_to is not None:
            self.leases.publish(shed_key(self.deployment), str(decision.shed_to), ttl_s=max(0.5, 2 * period))
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
            self.leases.withdraw(limit_key(self.deployment))
            self.leases.withdraw(shed_key(self.deployment))
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

    def once(self) -> dict[int, Decision]:
        """One step of every deployment's controller: their decisions, by deployment."""
        decisions = {}
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


_LOGGED = ("no-telemetry", "overload", "surge", "over-slo", "queue", "wake")


class DecisionLog:
    """Logs a deployment's decision when its reason changes; while telemetry has never answered
    (auto mode on the fixed bound) a warning, repeated every `repeat_s`: an operator must see
    that the controller is not steering."""

    def __init__(self, telemetry: dict[int, FleetTelemetry], repeat_s: float = 300.0) -> None:
        self.telemetry = telemetry
        self.repeat_s = repeat_s
        self._last: dict[int, str] = {}
        self._warned: dict[int, float] = {}

    def __call__(self, deployment: int, d: Decision) -> None:
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


def shed_count(total: int, target: int, mine: int) -> int:
    """How many of this drain's in-flight requests to abort: its share of the excess."""
    if total <= target or mine <= 0 or total <= 0:
        return 0
    return min(mine, math.ceil((total - target) * mine / total))
