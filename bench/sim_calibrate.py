"""The simulator against a real run: the same trace and runs, side by side.

Reads what `bench.harvest` wrote for a real run on the Dynamo frontend + mocker fleet (its JSON:
the trace's parameters, the SLO it derived from (a), every run's interactive TTFT and ITL
percentiles, attainment and batch tok/s), replays the same trace and the same runs ((a), the
static limits it ran, the controller) in the simulator on the matching fleet file, and prints
both with the simulator's error. The issue's bounds: TTFT and ITL p50/p90 and batch tok/s within
15%, attainment within 3 points. Each side judges attainment by its own (a), as each would on
its own; the real SLO applied to the simulator's requests is printed beside it.

    .venv/bin/python -m bench.harvest --disagg --runs a,s,c --sweep 8,16   # the real run (~15 min)
    .venv/bin/python -m bench.sim_calibrate bench/out/harvest-disagg-kv576.json --fleet mocker-disagg
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from backfill.sim.control import Policy, Sim, SloRule, slo_set_by
from backfill.sim.engine import FleetSpec
from backfill.sim.workload import Trace
from bench.agent_trace import TraceSpec
from bench.harvest_results import pct
from bench.sim_harvest import trace_from_spec

BOUND = 0.15  # relative error allowed on latencies and batch tok/s
ATTAIN_PTS = 3.0


def trace_of(params: dict[str, Any], name: str) -> Trace:
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}
    return trace_from_spec(name, TraceSpec(**fields))


def figures(sim: Sim, slo: SloRule) -> dict[str, float]:
    o = sim.outcomes()
    ttft = [x.ttft for x in o if x.ttft is not None]
    itl = [x.itl for x in o if x.itl is not None]
    met = sum(x.ttft is not None and x.ttft <= slo.ttft_s and (x.itl is None or x.itl <= slo.itl_s) for x in o)
    return {
        "attainment": 100.0 * sum(sim.meets(x) for x in o) / max(1, len(o)),
        "attainment_real_slo": 100.0 * met / max(1, len(o)),
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p90": pct(ttft, 0.9),
        "itl_p50": pct(itl, 0.5),
        "itl_p90": pct(itl, 0.9),
        "batch_tok_s": sim.batch_tok_s(),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("real", type=Path, help="bench.harvest's JSON for the real run")
    p.add_argument("--fleet", default="mocker-disagg", help="the simulator's fleet file for that fleet")
    p.add_argument("--kv-bytes-per-token", type=int, default=None, help="default: the real run's variant")
    a = p.parse_args(argv)
    real = json.loads(a.real.read_text())
    variant = real["variant"]
    kv = a.kv_bytes_per_token or int(variant.split("-kv")[1].split("-")[0])
    fleet = FleetSpec.load(a.fleet).with_kv(kv)
    trace = trace_of(real["trace"], variant)
    base = Sim(fleet, trace, Policy("none"), slo=SloRule(1e9, 1e9))
    base.finish()
    slo = base.slo = slo_set_by(base)
    real_slo = SloRule(real["slo"]["ttft_s"], real["slo"]["itl_s"])
    print(
        f"{variant} on {fleet.name} (KV {kv} B/token), trace {trace.duration_s:.0f} s; "
        f"SLO real TTFT {real_slo.ttft_s * 1e3:.0f} ms / ITL {real_slo.itl_s * 1e3:.1f} ms, "
        f"simulated {slo.ttft_s * 1e3:.0f} ms / {slo.itl_s * 1e3:.1f} ms"
    )
    cols = ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90", "batch_tok_s")
    print(
        f"{'run':>4} | {'attain % real/sim (sim on real SLO)':>36} | "
        + " | ".join(f"{c + ' real/sim':>24}" for c in cols)
        + " | within bounds"
    )
    misses = compared = 0
    for run in real["runs"]:
        kind, name = run["kind"], run["name"]
        if kind == "a":
            sim = base
        elif kind == "s":
            sim = Sim(fleet, trace, Policy("static", limit=int(run["concurrency"])), slo=slo)
        elif kind == "c":
            sim = Sim(fleet, trace, Policy("controller"), slo=slo)
        else:
            continue  # the naive client and the replayed oracle have no counterpart here
        if sim is not base:
            sim.finish()
        f = figures(sim, real_slo)
        ok = [abs(f["attainment"] - run["attainment"]) <= ATTAIN_PTS]
        cells = []
        for c in cols:
            r, s = run[c], f[c]
            scale = 1e3 if c != "batch_tok_s" else 1.0
            err = (s - r) / r if r else 0.0
            ok.append(abs(err) <= BOUND or (r == 0 and s == 0))
            cells.append(f"{r * scale:7.1f}/{s * scale:7.1f} ({err:+4.0%})")
        misses += not all(ok)
        compared += 1
        print(
            f"{name:>4} | {run['attainment']:9.1f} / {f['attainment']:5.1f} ({f['attainment_real_slo']:5.1f}){'':>11} | "
            + " | ".join(f"{c:>24}" for c in cells)
            + f" | {'yes' if all(ok) else 'no'}"
        )
    print(f"calibration: variant={variant} runs_within_bounds={compared - misses}/{compared}")


if __name__ == "__main__":
    main()
