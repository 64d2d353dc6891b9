"""The harvest in the simulator: the real controller against the oracle, on one short trace, two
seeds, both KV formats. A change that loses harvest fails here (bench/sim_harvest.py measures all
traces)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from backfill.sim.control import Policy, Sim, SloRule, slo_set_by
from backfill.sim.engine import FleetSpec
from backfill.sim.oracle import attainment, replay_of, search
from bench.sim_harvest import agent_trace, holds, main, one, summarize

FLOOR = 0.85  # issue 28's bar for this run: not met yet (0.83-0.86), so it is an expected failure
# What this law reaches here (0.83-0.86, the same every run: the simulator is deterministic), less
# a margin: a change that loses harvest, or the SLO, fails the suite, not just the bar above.
GUARD = 0.8


def _ratio(kv: int, seed: int) -> tuple[float, bool]:
    """The controller's batch throughput over the oracle's, and whether it held the SLO."""
    fleet = FleetSpec.load("mocker-disagg").with_kv(kv)
    trace = replace(agent_trace("agent", seed), duration_s=60.0)
    a = Sim(fleet, trace, Policy("none"), slo=SloRule(1e9, 1e9), seed=seed)
    a.finish()
    slo = a.slo = slo_set_by(a)
    floor = attainment(a) - 0.01
    allowed = {(r.session, r.turn) for r, x in zip(a.interactive, a.outcomes(), strict=True) if not a.meets(x)}
    c = Sim(fleet, trace, Policy("controller"), slo=slo, seed=seed)
    c.finish()
    oracle = search(
        fleet, trace, slo=slo, seed=seed, allowed=allowed, schedules=[replay_of(c)], floor=floor, improve_tries=16
    ).sim
    assert attainment(oracle) >= floor, "the oracle must hold the SLO"
    assert oracle.batch_tok_s() > 0
    return c.batch_tok_s() / oracle.batch_tok_s(), holds(summarize(c), summarize(a))


def test_oracle_holds_and_the_controller_keeps_up() -> None:
    got = [(kv, seed, *_ratio(kv, seed)) for kv in (576, 352) for seed in (0, 1)]
    lost = [(kv, seed, r, held) for kv, seed, r, held in got if r < GUARD or not held]
    assert not lost, f"controller/oracle below {GUARD} or off the SLO (kv, seed, ratio, held): {lost}"
    short = [(kv, seed, r, held) for kv, seed, r, held in got if r < FLOOR]
    if short:
        pytest.xfail(
            "controller/oracle batch tok/s "
            + ", ".join(f"kv{kv}/seed{seed} {r:.2f}" for kv, seed, r, _ in got)
            + f": below the {FLOOR}x floor"
        )


def test_nothing_the_bench_runs_beats_its_oracle() -> None:
    # The bench seeds the oracle with every run it makes on the oracle's seeds, the controller
    # steering to a larger SLO included (hindsight): unseeded, a controller at x1.05 held the SLO
    # and beat the oracle on 7 of the quick run's 12 cells, and on this trace.
    fleet = FleetSpec.load("mocker-disagg")
    trace = replace(agent_trace("ramp", 0), duration_s=60.0)
    rows = one(fleet, trace, 0, [4, 8, 16], True, improve_tries=4)["rows"]
    assert holds(rows["oracle"], rows["a"]), "the oracle must hold the SLO"
    assert any(k.startswith("c*") for k in rows), "the bolder controllers ran"
    for k, r in rows.items():
        if k != "oracle" and holds(r, rows["a"]):
            assert r.tok_s <= rows["oracle"].tok_s, (k, r.tok_s, rows["oracle"].tok_s)


def test_controller_only_runs_the_law_with_the_settings_given(capsys: pytest.CaptureFixture[str]) -> None:
    # `--set` reaches the controller: with a ceiling of 0 it sells nothing, where the fleet's own
    # settings sell batch tokens on the same runs.
    args = ["--controller-only", "--fleets", "mocker-disagg", "--seeds", "1"]
    main(args)
    assert "batch_tok_s_mean=0 " not in capsys.readouterr().out
    main([*args, "--set", "ceiling=0"])
    assert "slo_scale=1 ceiling=0 runs=10 batch_tok_s_mean=0 " in capsys.readouterr().out
    for bad in ("nope=1", "ceiling", "grow_below=fast", "slo=1"):
        with pytest.raises(SystemExit):
            main([*args, "--set", bad])
        assert "--set" in capsys.readouterr().err
