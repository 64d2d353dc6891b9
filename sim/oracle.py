"""The oracle: per window, the largest batch limit that keeps the interactive SLO, found by
forward search with backtracking on the simulator itself.

Window by window (1 s), from the simulation's state at the window's start (a snapshot), the
search tries limits (the cap first, then a binary search down to 0), publishing each as the
controller would publish its own (limit and shed target: a drop aborts the youngest batch
requests above it), simulates the window, and keeps the largest limit after which no
interactive request has missed its SLO or is already bound to (its first token later than the
TTFT bound, or a mean inter-token latency that even the fastest possible steps from here could
not bring under the ITL bound). Requests that missed with no batch work at all (run (a)) do not
count: batch work did not cause them. When even 0 fails, batch work admitted earlier is the
cause: the search backtracks to the latest earlier window in the failing request's life that
released batch work, lowers its limit, and searches forward again. So the schedule holds the
SLO by construction; its limit is the largest found, window by window, knowing the future.
"""

from __future__ import annotations

import copyreg
import math
import pickle
import threading
from dataclasses import dataclass

from backfill.sim.control import Policy, Sim, SloRule
from backfill.sim.engine import FleetSpec
from backfill.sim.workload import Trace

# A snapshot holds the scheduler objects' locks (admission's counters, the escalator): a fresh,
# unheld lock stands in for each, as nothing holds one between events.
copyreg.pickle(type(threading.Lock()), lambda _: (threading.Lock, ()))

LOOKBACK_S = 6.0  # how far before a failing request's arrival batch work may have hurt it


@dataclass
class OracleResult:
    schedule: list[int]
    sim: Sim
    tries: int
    backtracks: int
    unavoidable: int


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
) -> OracleResult:
    sim = Sim(spec, trace, Policy("schedule", window_s=window_s), slo=slo, seed=seed)
    t_min = sim.fleet.perf.min_decode_ms / 1000.0
    n = math.ceil(trace.duration_s / window_s)
    schedule: list[int] = []
    hi = [cap] * n
    snaps: list[bytes] = []
    tries = backtracks = 0
    allowed = set(allowed)
    k = 0
    while k < n:
        if len(snaps) <= k:
            snaps.append(pickle.dumps(sim, protocol=pickle.HIGHEST_PROTOCOL))
        end = min((k + 1) * window_s, trace.duration_s)

        def attempt(limit: int, k: int = k, end: float = end) -> tuple[Sim, list[float]]:
            s: Sim = pickle.loads(snaps[k])
            s.policy.schedule = [*schedule[:k], limit]
            s.run_until(end - 1e-9)  # the next window's tick is the next window's
            return s, _bound_to_miss(s, allowed, k * window_s, t_min)

        tries += 1
        s, bad = attempt(hi[k])
        if not bad:
            chosen, best = hi[k], s
        else:
            tries += 1
            s0, bad0 = attempt(0)
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
                del snaps[j + 1 :]
                sim = pickle.loads(snaps[j])
                k = j
                continue
            ok_l, ok_s, bad_l = 0, s0, hi[k]
            while bad_l - ok_l > 1:
                mid = (ok_l + bad_l) // 2
                tries += 1
                sm, bm = attempt(mid)
                if bm:
                    bad_l = mid
                else:
                    ok_l, ok_s = mid, sm
            chosen, best = ok_l, ok_s
        schedule.append(chosen)
        sim = best
        k += 1
    sim.policy.schedule = schedule
    sim.finish()
    return OracleResult(schedule, sim, tries, backtracks, len(allowed))
