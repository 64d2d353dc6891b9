"""The oracle: the largest batch limit per window that keeps the interactive SLO, found on the
simulator itself, knowing the future.

Three stages, each exact on the simulator (every candidate is judged by its attainment and batch
throughput at the trace's end; a run is cut short only once it is sure to fail, which is the
verdict the rest of the run would have given: a request whose first token is late for good, or
an attainment that can no longer reach the floor):

1. A greedy forward search with backtracking. Window by window (1 s), from the simulation's
   state at the window's start (a snapshot), it tries limits (the cap first, then a binary
   search down to 0), publishing each as the controller would publish its own (limit and shed
   target: a drop aborts the youngest batch requests above it), simulates the window, and keeps
   the largest limit after which no interactive request has missed its SLO or is already bound
   to (its first token later than the TTFT bound, or a mean inter-token latency that even the
   fastest possible steps from here could not bring under the ITL bound). Requests that missed
   with no batch work at all (run (a)) do not count: batch work did not cause them. When even 0
   fails, batch work admitted earlier is the cause: the search backtracks to the latest earlier
   window in the failing request's life that released batch work, lowers its limit, and
   searches forward again.
2. The seeds: the greedy schedule, every static limit given (as finished runs, or as limits to
   run), and any other schedule given (e.g. the controller's run replayed: its limit and shed
   target, period by period). The best
   one that holds the SLO (attainment within 1 point of run (a)) is the starting point, so the
   oracle is never below a static setting or a schedule it was shown.
3. Improvement: block by block (8 s, then 2 s), raise the block's limits (x1.5, x1.2),
   replay from the block's start to the end, and keep the change when the SLO still holds and the
   batch throughput rose. A greedy per-window choice can take so much in one window that later
   windows must give it back (a static limit once beat it that way); this stage finds those.

Snapshots pickle the whole simulation except what can no longer change (the trace, the fleet
spec, the batch's release plan, finished requests), which all snapshots share by reference. The
greedy search runs a window's first limit on the simulation it already holds in that state,
without loading the snapshot.
"""

from __future__ import annotations

import copyreg
import io
import math
import pickle
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from backfill.sim.control import Policy, Sim, SloRule
from backfill.sim.engine import FleetSpec, Req
from backfill.sim.workload import Trace

# A snapshot holds the scheduler objects' locks (admission's counters, the escalator): a fresh,
# unheld lock stands in for each, as nothing holds one between events.
copyreg.pickle(type(threading.Lock()), lambda _: (threading.Lock, ()))

LOOKBACK_S = 6.0  # how far before a failing request's arrival batch work may have hurt it
IMPROVE_BLOCKS_S = (8.0, 2.0)  # seconds per block, one improvement pass each
IMPROVE_FACTORS = (1.5, 1.2)


@dataclass
class OracleResult:
    schedule: Schedule | None  # None: the best run was a seed given as a finished run
    sim: Sim
    tries: int
    backtracks: int
    unavoidable: int
    source: str = "greedy"  # which seed the result grew from
    improved: int = 0  # improvement steps kept


class Snapshots:
    """Pickled simulations sharing what no longer changes, by reference."""

    def __init__(self) -> None:
        self.shared: list[Any] = []
        self.ids: dict[int, int] = {}

    def _ref(self, obj: Any) -> int:
        i = self.ids.get(id(obj))
        if i is None:
            i = self.ids[id(obj)] = len(self.shared)
            self.shared.append(obj)  # kept alive, so its id is never reused
        return i

    def dumps(self, sim: Sim) -> bytes:
        frozen = {id(sim.trace), id(sim.sessions), id(sim.spec), id(sim.fleet.perf), id(sim._lines.plan)}
        ref = self._ref

        def persistent_id(obj: Any) -> int | None:
            if type(obj) is Req:
                return ref(obj) if obj.state in ("done", "aborted") else None
            return ref(obj) if id(obj) in frozen else None

        buf = io.BytesIO()
        p = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
        p.persistent_id = persistent_id  # type: ignore[method-assign]
        p.dump(sim)
        return buf.getvalue()

    def loads(self, data: bytes) -> Sim:
        u = pickle.Unpickler(io.BytesIO(data))
        u.persistent_load = self.shared.__getitem__  # type: ignore[method-assign]
        sim: Sim = u.load()
        return sim


def attainment(sim: Sim) -> float:
    o = sim.outcomes()
    return sum(sim.meets(x) for x in o) / max(1, len(o))


def run_schedule(spec: FleetSpec, trace: Trace, schedule: Schedule, *, slo: SloRule, seed: int) -> Sim:
    sim = Sim(spec, trace, schedule.policy(), slo=slo, seed=seed)
    sim.finish()
    return sim


@dataclass
class Schedule:
    """A limit per window, and optionally the shed target published beside it (None in a
    window: none; no list: shed to the limit), as the `schedule` policy replays it."""

    limits: list[int]
    window_s: float = 1.0
    sheds: list[int | None] | None = None

    def policy(self) -> Policy:
        return Policy("schedule", schedule=list(self.limits), window_s=self.window_s, sheds=list(self.sheds or []))


def replay_of(sim: Sim) -> Schedule:
    """A controller run's decisions as a schedule: its limit and shed target, period by period."""
    assert sim.loop is not None
    return Schedule([v for _, v in sim.limits], sim.loop.controller.cfg.period_s, list(sim.sheds))


def _bound_to_miss(sim: Sim, allowed: set[tuple[int, int]], since: float, t_min: float) -> list[float]:
    """Arrival times of the interactive requests that missed (or cannot meet) the SLO, among
    those finished since `since` or still running."""
    now = sim.clock.now
    slo = sim.slo
    bad = []
    for r in sim.interactive:
        if (r.session, r.turn) in allowed:
            continue
        if r.done_at is not None:
            if r.done_at < since:
                continue
            ttft = r.first_at - r.arrival if r.first_at is not None else math.inf
            itl = (r.done_at - r.first_at) / (r.max_tokens - 1) if r.max_tokens > 1 and r.first_at else 0.0
            if ttft > slo.ttft_s or itl > slo.itl_s:
                bad.append(r.arrival)
            continue
        if r.first_at is None:
            if now - r.arrival > slo.ttft_s:
                bad.append(r.arrival)
            continue
        if r.first_at - r.arrival > slo.ttft_s:
            bad.append(r.arrival)
            continue
        if r.max_tokens > 1 and r.state == "decode":
            w = sim.fleet.workers[r.worker]
            g = r.gen_base + (w.step_no - r.dec_step0)
            lb = ((now - r.first_at) + (r.max_tokens - g) * t_min) / (r.max_tokens - 1)
            if lb > slo.itl_s:
                bad.append(r.arrival)
    return bad


def _watch(sim: Sim, allowed: set[tuple[int, int]], since: float) -> list[int] | None:
    """At a window's start (just before `since`): the indices in `sim.interactive` of the
    requests that may yet turn out late for the window (no first token yet, or a late one and
    not done); None when one already is, for sure (a late first token and done in the window,
    or none yet past the bound with more than one token to go, so it cannot be done before
    `since`): then every limit fails the window."""
    now = sim.clock.now
    ttft_s = sim.slo.ttft_s
    out = []
    for i, r in enumerate(sim.interactive):
        if r.first_at is None:
            if (r.session, r.turn) in allowed:
                continue
            if now - r.arrival > ttft_s and r.max_tokens > 1:
                return None
            out.append(i)
        elif r.first_at - r.arrival > ttft_s and (r.done_at is None or r.done_at >= since):
            if (r.session, r.turn) in allowed:
                continue
            if r.done_at is not None:
                return None
            out.append(i)
    return out


def _run_window(sim: Sim, since: float, end: float, watch: list[int], allowed: set[tuple[int, int]]) -> bool:
    """Runs `sim` to `end`, or stops early (False) once a request is sure to be in
    `_bound_to_miss`'s answer at `end`: past `since`, one still without its first token after
    the TTFT bound, or one whose first token came late and is not done before `since`. It
    stops to look at each waiting request's bound (one arriving meanwhile has a later bound);
    cutting a run into pieces does not change what the simulation does."""
    ttft_s = sim.slo.ttft_s
    reqs = sim.interactive
    watched = [reqs[i] for i in watch]
    seen = len(reqs)
    sim.run_until(min(since, end))
    while True:
        if len(reqs) > seen:
            watched.extend(r for r in reqs[seen:] if (r.session, r.turn) not in allowed)
            seen = len(reqs)
        now = sim.clock.now
        nxt = math.inf
        left = []
        for r in watched:
            if r.first_at is None:
                if now - r.arrival > ttft_s:
                    return False
                nxt = min(nxt, r.arrival + ttft_s)
                left.append(r)
            elif r.first_at - r.arrival > ttft_s and (r.done_at is None or r.done_at >= since):
                return False
        watched = left
        if now >= end:
            return True
        sim.run_until(end if nxt >= end else min(end, max(nxt, now) + 1e-9))


def greedy(
    spec: FleetSpec,
    trace: Trace,
    *,
    slo: SloRule,
    seed: int,
    allowed: set[tuple[int, int]],
    cap: int = 128,
    window_s: float = 1.0,
    max_backtracks: int = 400,
    snaps: Snapshots | None = None,
) -> OracleResult:
    """Stage 1: the per-window forward search with backtracking."""
    store = snaps or Snapshots()
    sim = Sim(spec, trace, Policy("schedule", window_s=window_s), slo=slo, seed=seed)
    t_min = sim.fleet.perf.min_decode_ms / 1000.0
    n = math.ceil(trace.duration_s / window_s)
    schedule: list[int] = []
    hi = [cap] * n
    snaps_k: list[bytes] = []
    tries = backtracks = 0
    allowed = set(allowed)
    k = 0
    live: Sim | None = sim  # a simulation in the state of snaps_k[k], not yet run on
    while k < n:
        if len(snaps_k) <= k:
            assert live is not None
            snaps_k.append(store.dumps(live))
        end = min((k + 1) * window_s, trace.duration_s)
        if live is None:
            live = store.loads(snaps_k[k])
        watch = _watch(live, allowed, k * window_s)

        def attempt(
            limit: int, k: int = k, end: float = end, watch: list[int] | None = watch
        ) -> tuple[Sim | None, list[float]]:
            """The window run at `limit` to its end, and the arrivals of the requests that
            missed or are bound to. Every limit but 0 only needs to know whether any did: those
            runs stop at the first request sure to (the list then says only that one did)."""
            nonlocal live
            if limit and watch is None:
                return None, [math.nan]  # a request is late already, whatever the limit
            s, live = (live, None) if live is not None else (store.loads(snaps_k[k]), None)
            s.policy.schedule = [*schedule[:k], limit]
            if limit and not _run_window(s, k * window_s, end - 1e-9, watch or [], allowed):
                return s, [math.nan]
            s.run_until(end - 1e-9)  # the next window's tick is the next window's
            return s, _bound_to_miss(s, allowed, k * window_s, t_min)

        tries += 1
        s, bad = attempt(hi[k])
        if not bad:
            chosen, best = hi[k], s
        else:
            # Binary search to within an eighth (the improvement stage refines what matters);
            # 0 is tried only when nothing above it holds.
            ok_l, ok_s, bad_l = 0, None, hi[k]
            while bad_l - ok_l > max(1, ok_l // 8):
                mid = (ok_l + bad_l) // 2
                tries += 1
                sm, bm = attempt(mid)
                if bm:
                    bad_l = mid
                else:
                    ok_l, ok_s = mid, sm
            if ok_s is None:
                tries += 1
                s0, bad0 = attempt(0)
                assert s0 is not None  # (limit 0 always runs the window)
                if bad0:
                    arrivals = bad0
                    lo = min(arrivals) - LOOKBACK_S
                    j = next((j for j in range(k - 1, -1, -1) if schedule[j] > 0 and (j + 1) * window_s > lo), None)
                    if j is None or backtracks >= max_backtracks:
                        # Nothing the batch side did (or can still undo) causes it: not the oracle's to fix.
                        for r in s0.interactive:
                            if r.arrival in arrivals:
                                allowed.add((r.session, r.turn))
                        continue
                    backtracks += 1
                    hi[j] = int(schedule[j] * 0.7)
                    for m in range(j + 1, n):
                        hi[m] = cap
                    del schedule[j:]
                    del snaps_k[j + 1 :]
                    live = store.loads(snaps_k[j])
                    k = j
                    continue
                ok_s = s0
            chosen, best = ok_l, ok_s
        assert best is not None  # (a window that holds was run)
        schedule.append(chosen)
        sim = live = best
        k += 1
    sim.policy.schedule = schedule
    sim.finish()
    return OracleResult(Schedule(schedule, window_s), sim, tries, backtracks, len(allowed))


def _surely_below(sim: Sim, floor: float) -> bool:
    """Whether the run's attainment is sure to end below `floor` already: the requests sure to
    miss the SLO (a first token late, or none yet past the TTFT bound, or done with too slow a
    mean ITL) leave too few to reach it even if every request still to come met it. The
    requests still to come are bounded by each session's turns that could yet start before the
    trace's end (a turn starts no sooner than its previous one ended plus its think time)."""
    now = sim.clock.now
    slo = sim.slo
    missed = 0
    last: dict[int, Req] = {}
    for r in sim.interactive:
        if r.first_at is None:
            if now - r.arrival > slo.ttft_s:
                missed += 1
        elif r.first_at - r.arrival > slo.ttft_s:
            missed += 1
        elif r.done_at is not None and r.max_tokens > 1 and (r.done_at - r.first_at) / (r.max_tokens - 1) > slo.itl_s:
            missed += 1
        got = last.get(r.session)
        if got is None or r.turn > got.turn:
            last[r.session] = r
    if not missed:
        return False
    end = sim.duration + 1e-6  # (a margin for the sums' rounding: more turns is the safe side)
    to_come = 0
    for sid, session in enumerate(sim.sessions):
        latest = last.get(sid)
        if latest is None:
            k, t = 0, session.start_s
        else:
            k = latest.turn + 1
            t = (latest.done_at if latest.done_at is not None else now) + session.turns[latest.turn].think_s
        while k < len(session.turns) and t < end:
            to_come += 1
            t += session.turns[k].think_s
            k += 1
    most = len(sim.interactive) + to_come
    return (most - missed) / most < floor


def _finish_unless_below(sim: Sim, floor: float, every_s: float = 4.0) -> bool:
    """`sim.finish()`, stopping early (False) once the attainment is sure to end below `floor`
    (looked at every `every_s` of the trace; cutting a run into pieces changes nothing in it)."""
    t = sim.clock.now
    while t < sim.duration:
        t = min(sim.duration, t + every_s)
        sim.run_until(t)
        if _surely_below(sim, floor):
            return False
    sim.finish()
    return True


def improve(
    spec: FleetSpec,
    trace: Trace,
    schedule: Schedule,
    sim: Sim,
    *,
    slo: SloRule,
    seed: int,
    floor: float,
    cap: int = 128,
    max_tries: int = 60,
    snaps: Snapshots | None = None,
) -> tuple[Schedule, Sim, int, int]:
    """Stage 3: block-wise raises, each replayed to the end and kept only if the SLO holds and
    the batch throughput rose. Returns (schedule, run, tries, steps kept)."""
    store = snaps or Snapshots()
    w = schedule.window_s
    n = len(schedule.limits)
    best_tok = sim.batch_tok_s()
    tries = kept = 0

    # The snapshots at each block's start, under the schedule as it stands, taken as the blocks
    # are reached (a replay kept at block j moves the replay taking them back to j): the pass
    # may end at `max_tries` long before the trace's end.
    snaps_j: dict[int, bytes] = {}
    taker: Sim | None = None
    taker_next = 0

    def restart(j: int, base: Sim) -> None:
        nonlocal taker, taker_next
        base.policy = schedule.policy()
        taker, taker_next = base, j
        for m in [m for m in snaps_j if m >= j]:
            del snaps_j[m]

    def snapshot(j: int, size: int) -> bytes:
        nonlocal taker_next
        assert taker is not None
        while j not in snaps_j:
            taker.run_until(taker_next * w - 1e-9)
            snaps_j[taker_next] = store.dumps(taker)
            taker_next += size
        return snaps_j[j]

    def raised(j: int, size: int, f: float) -> Schedule:
        limits = list(schedule.limits)
        sheds = list(schedule.sheds) if schedule.sheds is not None else None
        for m in range(j, min(n, j + size)):
            limits[m] = min(cap, max(limits[m] + 1, math.ceil(limits[m] * f)))
            old = sheds[m] if sheds is not None else None
            if sheds is not None and old is not None:
                sheds[m] = min(limits[m], math.ceil(old * f))
        return Schedule(limits, w, sheds)

    for block_s in IMPROVE_BLOCKS_S:
        size = max(1, round(block_s / w))
        restart(0, Sim(spec, trace, schedule.policy(), slo=slo, seed=seed))
        for j in range(0, n, size):
            if all(v >= cap for v in schedule.limits[j : j + size]):
                continue
            for f in IMPROVE_FACTORS:
                if tries >= max_tries:
                    return schedule, sim, tries, kept
                trial = raised(j, size, f)
                tries += 1
                s = store.loads(snapshot(j, size))
                s.policy = trial.policy()
                if not _finish_unless_below(s, floor):
                    continue  # the SLO is broken for sure: rejected, as the whole run would be
                if s.batch_tok_s() > best_tok and attainment(s) >= floor:
                    schedule, sim, best_tok = trial, s, s.batch_tok_s()
                    kept += 1
                    if j + size < n:
                        restart(j, store.loads(snaps_j[j]))
                    break
    return schedule, sim, tries, kept


def search(
    spec: FleetSpec,
    trace: Trace,
    *,
    slo: SloRule,
    seed: int,
    allowed: set[tuple[int, int]],
    cap: int = 128,
    window_s: float = 1.0,
    max_backtracks: int = 400,
    runs: Sequence[Sim] = (),
    statics: Sequence[int] = (),
    schedules: Sequence[Schedule] = (),
    floor: float | None = None,
    improve_tries: int = 60,
) -> OracleResult:
    """The oracle's run. `runs`: finished runs of this trace to start from if better (a static
    setting's, say); `statics`: static limits to run as seeds; `schedules`: other seeds;
    `floor`: the attainment to hold (default: run (a)'s, less 1 point)."""
    snaps = Snapshots()
    if floor is None:
        a = Sim(spec, trace, Policy("none"), slo=slo, seed=seed)
        a.finish()
        floor = attainment(a) - 0.01
    n = math.ceil(trace.duration_s / window_s)
    g = greedy(
        spec, trace, slo=slo, seed=seed, allowed=allowed, cap=cap, window_s=window_s,
        max_backtracks=max_backtracks, snaps=snaps,
    )  # fmt: skip
    tries = g.tries
    assert g.schedule is not None
    seeds: list[tuple[str, Schedule | None, Sim]] = [("greedy", g.schedule, g.sim)]
    # The greedy limits without their shedding: a window's drop then waits for completions
    # instead of aborting work already half done.
    calm = Schedule(list(g.schedule.limits), window_s, [None] * n)
    seeds.append(("greedy-noshed", calm, run_schedule(spec, trace, calm, slo=slo, seed=seed)))
    tries += 1
    for r in runs:
        sched = Schedule([r.policy.limit] * n, window_s) if r.policy.kind == "static" else None
        seeds.append((r.policy.label, sched, r))
    done = {r.policy.limit for r in runs if r.policy.kind == "static"}
    for limit in statics:
        if limit not in done:
            tries += 1
            sched = Schedule([limit] * n, window_s)
            seeds.append((f"s{limit}", sched, run_schedule(spec, trace, sched, slo=slo, seed=seed)))
    for i, sched in enumerate(schedules):
        tries += 1
        seeds.append((f"seed{i}", sched, run_schedule(spec, trace, sched, slo=slo, seed=seed)))
    holding = [x for x in seeds if attainment(x[2]) >= floor] or seeds[:1]
    source, sched0, best = max(holding, key=lambda x: x[2].batch_tok_s())
    kept = 0
    if sched0 is not None and improve_tries > 0:
        sched0, best, t, kept = improve(
            spec, trace, sched0, best, slo=slo, seed=seed, floor=floor, cap=cap,
            max_tries=improve_tries, snaps=snaps,
        )  # fmt: skip
        tries += t
    return OracleResult(sched0, best, tries, g.backtracks, g.unavoidable, source, kept)
