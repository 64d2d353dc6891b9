"""The oracle is a limit: on a short trace nothing tried (a static setting, the controller) beats
it while holding the SLO, and its snapshots replay exactly."""

from __future__ import annotations

from dataclasses import replace

from backfill.sim.control import Policy, Sim, SloRule, slo_set_by
from backfill.sim.engine import FleetSpec
from backfill.sim.oracle import Snapshots, attainment, replay_of, search
from backfill.sim.workload import Trace
from bench.sim_harvest import agent_trace

STATICS = (2, 4, 8, 12, 16, 24, 32)


def _setup(kv: int, name: str = "ramp", seconds: float = 30.0) -> tuple[FleetSpec, Trace, SloRule, Sim]:
    fleet = FleetSpec.load("mocker-disagg").with_kv(kv)
    trace = replace(agent_trace(name, 0), duration_s=seconds)
    a = Sim(fleet, trace, Policy("none"), slo=SloRule(1e9, 1e9), seed=0)
    a.finish()
    slo = a.slo = slo_set_by(a)
    return fleet, trace, slo, a


def test_nothing_tried_beats_the_oracle() -> None:
    for kv in (576, 352):
        fleet, trace, slo, a = _setup(kv)
        floor = attainment(a) - 0.01
        allowed = {(r.session, r.turn) for r, o in zip(a.interactive, a.outcomes(), strict=True) if not a.meets(o)}
        statics = []
        for limit in STATICS:
            s = Sim(fleet, trace, Policy("static", limit=limit), slo=slo, seed=0)
            s.finish()
            statics.append(s)
        c = Sim(fleet, trace, Policy("controller"), slo=slo, seed=0)
        c.finish()
        res = search(
            fleet,
            trace,
            slo=slo,
            seed=0,
            allowed=allowed,
            runs=statics,
            schedules=[replay_of(c)],
            floor=floor,
            improve_tries=16,
        )
        got = res.sim.batch_tok_s()
        assert attainment(res.sim) >= floor, "the oracle holds the SLO"
        for s in statics:
            if attainment(s) >= floor:
                assert got >= s.batch_tok_s(), (kv, s.policy.label, s.batch_tok_s(), got)
        if attainment(c) >= attainment(res.sim):
            assert got >= c.batch_tok_s(), (kv, "controller", c.batch_tok_s(), got)


def test_a_snapshot_replays_exactly() -> None:
    fleet, trace, slo, _ = _setup(352, "agent", 20.0)
    sim = Sim(fleet, trace, Policy("schedule", schedule=[16] * 20), slo=slo, seed=0)
    sim.run_until(8.0)
    snaps = Snapshots()
    data = snaps.dumps(sim)
    copies = [snaps.loads(data), snaps.loads(data)]
    for s in [sim, *copies]:
        s.finish()
    want = (sim.batch_tok_s(), [(o.ttft, o.itl) for o in sim.outcomes()])
    for s in copies:
        assert (s.batch_tok_s(), [(o.ttft, o.itl) for o in s.outcomes()]) == want


def test_early_stops_only_drop_runs_that_fail_anyway() -> None:
    """A replay cut short (the attainment sure to end below the floor; a window sure to hold a
    late first token) is one the whole run would also have rejected."""
    from backfill.sim.oracle import _bound_to_miss, _finish_unless_below, _run_window, _watch

    fleet, trace, slo, a = _setup(352, "agent", 30.0)
    floor = attainment(a) - 0.01
    snaps = Snapshots()
    cut = kept = dropped = 0
    for limit in (8, 32, 64, 128):
        sim = Sim(fleet, trace, Policy("schedule", schedule=[limit] * 30), slo=slo, seed=0)
        for k in range(0, 30, 3):
            sim.run_until(k - 1e-9)
            data = snaps.dumps(sim)
            whole, early = snaps.loads(data), snaps.loads(data)
            whole.run_until(k + 1 - 1e-9)
            missed = _bound_to_miss(whole, set(), float(k), 0.0)
            watch = _watch(early, set(), float(k))
            if watch is None or not _run_window(early, float(k), k + 1 - 1e-9, watch, set()):
                cut += 1
                assert missed, (limit, k)
            else:
                assert early.clock.now == whole.clock.now
                assert _bound_to_miss(early, set(), float(k), 0.0) == missed
            whole, early = snaps.loads(data), snaps.loads(data)
            whole.finish()
            if _finish_unless_below(early, floor):
                kept += 1
                assert (early.batch_tok_s(), attainment(early)) == (whole.batch_tok_s(), attainment(whole))
            else:
                dropped += 1
                assert attainment(whole) < floor, (limit, k)
    assert cut and kept and dropped, "runs of every kind are looked at"
