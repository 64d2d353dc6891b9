"""The capacity controller's law: how many batch requests the fleet can carry right now.

Idle capacity is the room between the interactive latency of the moment and the interactive
SLO, so the controller steers on latency, with the fleet's own telemetry as the sensor:

- decode pool: the workers' mean inter-token latency over the last window (every running
  sequence shares the engine's step time, so batch requests see what interactive ones see) and
  KV cache occupancy; prefill pool: time to first token and the engines' waiting queues;
- interactive requests in flight: streamed requests at the frontend (batch lines never stream),
  or its in-flight count minus the batch leases held, whichever is larger;
- what batch requests themselves saw: 429/503 answers, their prompt and output sizes.

On a split fleet the prefill engines' occupancy (requests running or waiting there) is a third
signal where a fleet sets a target for it: an interactive prompt queued behind batch prefills
misses its first-token SLO before the window's mean TTFT moves.

The law is AIMD-like. Grow in proportion to the room left while latency sits below the SLO
with a margin (and only while the leases are actually used; the mean TTFT against a fraction of
its SLO, as the SLO holds each request and the sensor reads a window's mean); cut in proportion to the overshoot
when the smoothed latency crosses the target; cut hard when a queue forms, a 429/503 arrives,
an engine preempts or its KV cache nears full, or latency crosses the SLO itself, and then
also shed: publish a target below the in-flight count so drains abort their youngest requests
and requeue them.

The smoothed latency moves a second or so after the load does, and on engines that serve requests
first come, first served a burst of interactive arrivals has missed its SLO by then. So the law
also fits the decoders' step time to what each holds (`StepModel`: window ITL against KV usage
and running sequences, least squares with forgetting) and caps the limit, every period, at the
batch the worst decoder can carry at the ITL target given what it holds now: an arrival's load
counts as soon as it lands on a decoder, and the excess is shed at once. (It replaced a cut on a
count of arrivals per period, which cut for bursts that needed none: bench.sim_harvest.) Engines
that schedule interactive requests first need neither (`engine_priority`), and a hard cut there
keeps more of the batch: an overshoot slows their steps, it queues no interactive prompt.

The KV model caps the limit (the cache's token capacity follows from its byte budget and the
bytes per token) and the engines' sequence slots cap it too, with a reserve kept for interactive
arrivals. Without fresh telemetry the limit falls to the floor: fail closed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from backfill.scheduler.capacity.telemetry import FleetSnapshot, KvModel, WorkerStats


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
    grow_below: float = 0.85  # grow while smoothed latency < this fraction of the target
    cut_above: float = 0.95  # cut while smoothed latency > this fraction of the target
    grow_gain: float = 0.5  # growth per period, as a fraction of the limit, scaled by the room left
    cut_gain: float = 2.0  # cut per period, as a fraction of in-flight, per unit of relative overshoot
    hard_cut: float = 0.5  # what is left of in-flight after a hard cut
    # ... on engines that schedule by priority (`engine_priority`): there an overshoot delays the
    # interactive requests by a longer step, not a queue behind batch work, so half is too much
    # (the simulated GB200 fleet: +5% batch tokens at 0.8, the same runs on the SLO, 20 seeds).
    priority_hard_cut: float = 0.8
    hold_s: float = 0.75  # no growth for this long after a cut
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
    # The mean time to first token a window may reach, as a fraction of the TTFT SLO: the SLO
    # bounds every request's TTFT, the sensor reads a window's mean, and once batch prefills
    # share the engine the slow tail runs about twice the mean (measured in the simulator).
    ttft_mean_target: float = 0.7
    # The window's TTFT quantile (the frontend's histogram, `FrontendStats.ttft_tail_s`) may
    # reach this fraction of the TTFT SLO. 0 leaves the tail out.
    ttft_tail_target: float = 0.0
    queue_periods: int = 3  # a waiting queue seen this many periods in a row has formed
    # Split fleets: the mean number of requests on each prefill engine (running + waiting,
    # smoothed with `prefill_busy_smoothing` per period) the batch may bring it to. The
    # first-token SLO binds each request, and an interactive prompt that lands behind queued batch
    # prefills misses it while the window's mean TTFT still looks fine; the engines' occupancy
    # moves first. 0 leaves it out (the default: what suits a fleet depends on how long a prefill
    # is against the TTFT SLO; 0.4 on the mocker fleet, while a prefill-bound fleet such as the
    # GB200 one sits above 1 with interactive work alone).
    prefill_busy_target: float = 0.0
    prefill_busy_smoothing: float = 0.1
    # The step-time model's cap: the worst decoder's predicted ITL with the batch at the limit
    # may reach this fraction of the ITL SLO; a cap this many requests below what is in flight
    # sheds to it (a smaller gap waits for requests to finish). Tuned in the simulator
    # (bench.sim_harvest): 0.9 and 2 held the SLO on every tuning run of the mocker fleets.
    step_model_target: float = 0.9
    step_model_shed_gap: float = 2.0
    # The engines schedule interactive requests before batch ones (vLLM's `--scheduling-policy
    # priority`, batch lines marked lowest by `BACKFILL_FLEET_PRIORITY_HINT`). Then a burst of
    # interactive prompts never queues behind batch prefills or waits for a decode slot, so the
    # smoothed latency is fast enough and the step-time model's cap is left out (it cost the
    # simulated GB200 fleet a quarter of its batch tokens, its prediction for the worst decoder
    # binding before the TTFT that limits that fleet), and batch prefills cannot stretch the
    # first-token tail past the mean, so the window's mean TTFT may reach the SLO itself.
    engine_priority: bool = False


class StepModel:
    """A decoder's step time (its window mean ITL) as a + b x KV usage + c x running sequences,
    fitted by least squares over every decoder's readings, older ones forgotten at `decay` per
    reading. The form is the one the Dynamo mocker and aiconfigurator's decode tables take: a
    fixed cost, attention over the cached tokens, per-sequence work.

    Windows the form does not explain (on an aggregated engine, steps stalled behind long
    prefills read 20x the decode step) would drag the fit for a long while: once fitted, a
    reading more than `TRUSTED` off the prediction counts with a weight that falls with its
    error (Huber's), and the model is trusted only while its recent readings' mean relative error
    (a moving average over ~10) is within `TRUSTED` (`trusted`). One reading far off does not
    stop it: that is what a decoder looks like in the period an arrival's context lands on it.
    """

    MIN_READINGS = 20
    TRUSTED = 0.25  # relative error

    def __init__(self, decay: float = 0.995) -> None:
        self.decay = decay
        self._xx = [[0.0] * 3 for _ in range(3)]  # decayed sums of x x' and x y
        self._xy = [0.0] * 3
        self.readings = 0
        self.error = 0.0  # moving average of the readings' relative error against the fit

    @staticmethod
    def _readings(workers: Sequence[WorkerStats]) -> list[WorkerStats]:
        return [w for w in workers if w.itl_s is not None and w.itl_s > 0 and w.itl_n > 0 and w.running > 0]

    def _error(self, coef: tuple[float, float, float], w: WorkerStats) -> float:
        assert w.itl_s is not None
        return abs(coef[0] + coef[1] * w.kv_usage + coef[2] * w.running - w.itl_s) / w.itl_s

    @property
    def trusted(self) -> bool:
        return self.coefficients() is not None and self.error <= self.TRUSTED

    def observe(self, workers: Sequence[WorkerStats]) -> None:
        d = self.decay
        coef = self.coefficients()
        for w in self._readings(workers):
            assert w.itl_s is not None
            err = self._error(coef, w) if coef is not None else 0.0
            self.error = 0.9 * self.error + 0.1 * err
            weight = 1.0 if err <= self.TRUSTED else self.TRUSTED / err
            x = (1.0, w.kv_usage, float(w.running))
            for i in range(3):
                self._xy[i] = d * self._xy[i] + weight * x[i] * w.itl_s
                for j in range(3):
                    self._xx[i][j] = d * self._xx[i][j] + weight * x[i] * x[j]
            self.readings += 1

    def coefficients(self) -> tuple[float, float, float] | None:
        """(a, b, c), or None before enough readings."""
        if self.readings < self.MIN_READINGS:
            return None
        a = [row[:] for row in self._xx]
        y = self._xy[:]
        for i in range(3):
            a[i][i] += 1e-6 * (self._xx[0][0] + 1.0)  # a touch of ridge: readings may be collinear
        for i in range(3):  # Gaussian elimination on the 3 x 3 normal equations
            if abs(a[i][i]) < 1e-12:
                return None
            for k in range(i + 1, 3):
                f = a[k][i] / a[i][i]
                for j in range(i, 3):
                    a[k][j] -= f * a[i][j]
                y[k] -= f * y[i]
        th = [0.0, 0.0, 0.0]
        for i in (2, 1, 0):
            th[i] = (y[i] - sum(a[i][j] * th[j] for j in range(i + 1, 3))) / a[i][i]
        return th[0], max(0.0, th[1]), max(0.0, th[2])  # more work never makes a step faster

    def batch_limit(
        self, workers: Sequence[WorkerStats], batch: int, kv_share_per_request: float, target_s: float
    ) -> float | None:
        """The batch requests in flight at which the worst decoder's predicted step time reaches
        `target_s`, each request adding 1/len(workers) of a sequence and of its KV share to each.
        None where the target is below an empty decoder's step: no batch level meets it, so it is
        not the batch's to meet (the other rules still cut for latency over the SLO)."""
        coef = self.coefficients()
        if coef is None or not workers:
            return None
        a, b, c = coef
        per_request = (b * kv_share_per_request + c) / len(workers)
        if per_request <= 1e-9 or target_s <= a:
            return None
        return min(batch + (target_s - (a + b * w.kv_usage + c * w.running)) / per_request for w in workers)


@dataclass(frozen=True)
class ObsDelta:
    """Batch observations since the previous period."""

    n: float = 0.0
    overloaded: float = 0.0
    failed: float = 0.0
    prompt_tokens: float = 0.0
    completion_tokens: float = 0.0
    dt_s: float = 0.0


class Controller:
    """The control law, free of I/O: one `step` per period."""

    def __init__(self, cfg: ControlConfig) -> None:
        self.cfg = cfg
        self.limit = float(cfg.floor)
        self._itl: float | None = None
        self._ttft: float | None = None
        self._ttft_tail: float | None = None
        self._itl_floor: float | None = None  # step time with (almost) no batch work
        self._hold_until = 0.0
        self._prefill_busy: float | None = None  # smoothed requests per prefill engine
        self._last_interactive = -1e9
        self._was_idle = False
        self._queued_for = 0
        self._kv_per_request = 1024.0  # prompt + output tokens of a batch request, learned
        self.step_model = StepModel()
        self.step_limit: float | None = None  # the step-time model's cap of the last period
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
            self._itl = self._ttft = self._ttft_tail = None
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
            self._itl = self._ttft = self._ttft_tail = None
        self._itl = self._smooth(self._itl, itl_raw)
        self._ttft = self._smooth(self._ttft, ttft_raw)
        tail_raw = fe.ttft_tail_s if cfg.ttft_tail_target > 0 else None
        self._ttft_tail = self._smooth(self._ttft_tail, tail_raw)
        if itl_raw is not None and b <= 2:
            self._itl_floor = itl_raw if self._itl_floor is None else 0.9 * self._itl_floor + 0.1 * itl_raw
        interactive = max(fe.streaming, fe.inflight - b)
        arrivals = fe.stream_arrivals
        if interactive or arrivals:
            self._last_interactive = now
        idle = cfg.idle_target > 1.0 and now - self._last_interactive >= cfg.idle_after_s
        # A queue on the engines that decode: their slots or KV ran out. A prefill engine's queue
        # is the TTFT the law already steers on, and a busy fleet's interactive load keeps one.
        decoding = [w for w in snap.workers if w.role != "prefill"]
        waiting = sum(w.waiting for w in decoding) + fe.queued
        queued = waiting >= max(2, 0.1 * sum(w.running for w in decoding))
        self._queued_for = self._queued_for + 1 if queued else 0
        queue_formed = self._queued_for >= cfg.queue_periods
        preempted = sum(w.preempted for w in snap.workers)
        overload = obs.overloaded + fe.rejected
        cap = self._cap(snap)
        kv = decode.kv_usage_max if decode is not None else 0.0

        # Latency as a fraction of the target of the moment: the worse of the two pools.
        scale = cfg.idle_target if idle else 1.0
        ttft_target = 1.0 if cfg.engine_priority else cfg.ttft_mean_target
        itl_slo, ttft_slo = cfg.slo.itl_s * scale, cfg.slo.ttft_s * scale * ttft_target
        tail_slo = cfg.slo.ttft_s * scale * cfg.ttft_tail_target
        pressure = max(
            (self._itl / itl_slo) if self._itl is not None else 0.0,
            (self._ttft / ttft_slo) if self._ttft is not None else 0.0,
            (self._ttft_tail / tail_slo) if self._ttft_tail is not None else 0.0,
        )
        raw_pressure = max(
            (itl_raw / itl_slo) if itl_raw is not None else 0.0,
            (ttft_raw / ttft_slo) if ttft_raw is not None else 0.0,
            (tail_raw / tail_slo) if tail_raw is not None else 0.0,
        )
        # Split fleets: how busy the prefill engines are against what the batch may bring them to
        # (it gates growth and cuts in proportion, like latency, but never cuts hard on its own).
        prefill_engines = [w for w in snap.workers if w.role == "prefill"]
        busy = 0.0
        if prefill_engines and cfg.prefill_busy_target > 0:
            occ = sum(w.running + w.waiting for w in prefill_engines) / len(prefill_engines)
            a = cfg.prefill_busy_smoothing
            self._prefill_busy = occ if self._prefill_busy is None else a * occ + (1 - a) * self._prefill_busy
            # With no interactive request for idle_after_s, no prompt waits behind the batch's.
            if now - self._last_interactive < cfg.idle_after_s:
                busy = self._prefill_busy / cfg.prefill_busy_target
        in_use = min(self.limit, float(b))
        self.step_limit = None
        if not cfg.engine_priority:
            self.step_model.observe(decoding)
        if not cfg.engine_priority and self.step_model.trusted:
            kv_tokens = cfg.kv.tokens(fe.kv_tokens_per_worker)
            kv_share = self._kv_per_request / kv_tokens if kv_tokens else 0.0
            self.step_limit = self.step_model.batch_limit(
                decoding, b, kv_share, cfg.step_model_target * cfg.slo.itl_s * scale
            )
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
                )
                if hit
            ),
            "",
        ):
            reason = hard
            self.limit = in_use * (cfg.priority_hard_cut if cfg.engine_priority else cfg.hard_cut)
            shed_to = int(self.limit)
            self._hold_until = now + cfg.hold_s
        elif self.step_limit is not None and self.step_limit < in_use - cfg.step_model_shed_gap:
            # What the decoders hold now (an arrival's context, say) leaves the batch less room
            # than it takes: give the excess back at once, before the smoothed ITL shows it.
            reason = "step-model"
            self.limit = max(0.0, self.step_limit)
            shed_to = int(self.limit)
        elif max(pressure, busy) > cfg.cut_above:
            reason = "cut" if pressure > cfg.cut_above else "prefill-busy"
            overshoot = (max(pressure, busy) - cfg.cut_above) / cfg.cut_above
            self.limit = in_use * max(cfg.hard_cut, 1.0 - cfg.cut_gain * overshoot)
            self._hold_until = now + cfg.hold_s
        elif now < self._hold_until:
            reason = "hold"
        elif max(pressure, busy) < cfg.grow_below and b >= int(0.7 * self.limit):
            # (int: with a fractional limit below one, no lease can be taken, and growth must
            # not wait for one.)
            reason = "grow"
            room = (cfg.grow_below - max(pressure, busy)) / cfg.grow_below
            self.limit += max(1.0, cfg.grow_gain * room * self.limit)
        else:
            reason = "steady"
        self._was_idle = idle
        if self.step_limit is not None and reason in ("grow", "steady"):
            # Growth stops at the model's cap; a cap a little below what is in flight holds it there.
            self.limit = min(self.limit, max(self.step_limit, in_use))
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


# What the capacity controller decided for one period: the law's output (`scheduler.capacity.law`),
# published by its loop (`scheduler.capacity.controller`) and recorded as metrics (`scheduler.metrics`).
#


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
