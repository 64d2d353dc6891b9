"""Harvest benchmark: how much batch work fits into a fleet's idle capacity without breaking the
interactive SLO.

On the real Dynamo frontend + mocker workers, in a regime where interference comes from the
simulated engine (a small KV cache: decode step time grows with its occupancy), one interactive
trace (multi-turn agent sessions in bursts and quiet periods, streamed) is replayed unchanged
beside different batch loads:

  (a) interactive only: the SLO is derived from it;
  (b) + a naive batch client at a fixed high concurrency;
  (s) + backfill with a fixed lease limit, swept over a range: the best static setting;
  (o) + backfill with the oracle's lease limit: per 1 s window, the largest static setting at
      which that window's interactive requests did as well as in (a), known in advance and
      replayed as a time-varying limit (bench/harvest_oracle.py);
  (c) + backfill with the capacity controller publishing the lease limit.

backfill's side runs in a process of its own: the real Dispatcher (Postgres for the lines, Redis
for leases and the controller's published limit) and, for (c), the capacity controller, without
the Celery/API processes around them, since the machine has two cores and the fleet needs them.

SLO rule (per interactive request, from run (a)): TTFT <= 2 x (a)'s p90 TTFT and mean ITL <=
1.3 x (a)'s p90 ITL. Attainment = share of interactive requests meeting both.

    .venv/bin/python -m bench.harvest --quick           # ~7 minutes
    .venv/bin/python -m bench.harvest                   # ~23 minutes
    .venv/bin/python -m bench.harvest --disagg          # prefill/decode split fleet
    .venv/bin/python -m bench.harvest --kv-bytes-per-token 352
    .venv/bin/python -m bench.harvest --quick --disagg --trace ramp   # agent | lulls | ramp
    .venv/bin/python -m bench.harvest --quick --two-models   # two models, figures per model (bench/harvest_models.py)
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.harvest_oracle import LEAD_S, SPREAD_S, WINDOW_S, schedule_from_runs
from bench.harvest_results import RunResult, SloRule, meets, pct
from bench.harvest_setup import (
    MODEL,
    REDIS_URL,
    ROOT,
    drop_database,
    flush_redis,
    prepare_batch,
    retire_batch,
    setup_database,
)

__all__ = ["drop_database", "main", "setup_database"]  # bench/prefix.py sets up its database here too

BLOCK_SIZE = 64
# The interference regime's KV cache: 2048 blocks of 64 tokens at 576 bytes per token (an FP8
# MLA row). A leaner cache format fits more tokens into the same bytes.
KV_BUDGET_BYTES = 2048 * BLOCK_SIZE * 576
BATCH_LINES = 6000
WARMUP_S = 6.0  # the batch side starts this long before the trace


# -- one run ---------------------------------------------------------------------------------


class Sampler(threading.Thread):
    """Worker telemetry for the plot (KV occupancy, step time), twice a second."""

    def __init__(self, endpoints: list[Any], until: float) -> None:
        super().__init__(daemon=True)
        from backfill.scheduler.capacity.telemetry import FleetTelemetry

        self.tel = FleetTelemetry(endpoints)
        self.until = until
        self.rows: list[tuple[float, float, float | None, int]] = []

    def run(self) -> None:
        while time.time() < self.until:
            snap = self.tel.scrape()
            dec = snap.pool("decode")
            fe = snap.frontend
            self.rows.append(
                (
                    time.time(),
                    dec.kv_usage_max if dec else 0.0,
                    dec.itl_s if dec else None,
                    fe.inflight if fe else 0,
                )
            )
            time.sleep(0.5)
        self.tel.close()


def run_one(
    name: str,
    kind: str,
    *,
    fleet: Any,
    spec: dict[str, Any],
    workdir: Path,
    env: dict[str, str],
    concurrency: int | None = None,
    schedule: list[int] | None = None,
    window_s: float = WINDOW_S,
) -> dict[str, Any]:
    """Replays the trace beside one batch load; returns the raw records of both sides.
    `schedule` (kind o): the oracle's lease limit per window of `window_s` from the trace's start."""
    from backfill.storage.settings import MetricsEndpoint as Endpoint

    salt = f"{name}{secrets.token_hex(2)}"
    duration = float(spec["duration_s"])
    batch_id = prepare_batch(salt, BATCH_LINES) if kind in ("s", "o", "c") else None
    flush_redis()
    t0 = time.time() + WARMUP_S + 2.0
    t_end = t0 + duration
    inter_out, batch_out = workdir / f"{name}-interactive.json", workdir / f"{name}-batch.json"
    common = {"base-url": fleet.base_url, "salt": salt, "t0": t0}
    procs = [_spawn("bench.loadgen", "interactive", spec=json.dumps(spec), out=inter_out, **common)]
    if kind == "b":
        procs.append(
            _spawn(
                "bench.loadgen",
                "naive",
                **common,
                t_start=t0 - WARMUP_S,
                t_end=t_end + 5,
                concurrency=concurrency,
                out=batch_out,
            )
        )
    elif kind in ("s", "o", "c"):
        side_env = dict(env)
        # The oracle's limit is published where the controller's is, so admission runs controlled.
        side_env.update(
            BACKFILL_CAPACITY_CONTROL="true" if kind in ("o", "c") else "false",
            BACKFILL_MAX_INFLIGHT=str(concurrency),
        )
        oracle = {"limit_schedule": json.dumps(schedule), "t0": t0, "window_s": window_s} if kind == "o" else {}
        procs.append(
            _spawn("bench.backfill_side", env=side_env, t_start=t0 - WARMUP_S, t_end=t_end + 5, out=batch_out, **oracle)
        )
    endpoints = [Endpoint("frontend", fleet.frontend_metrics_url)] + [
        Endpoint(role, url) for role, url in fleet.worker_metrics_urls
    ]
    sampler = Sampler(endpoints, t_end + 5)
    sampler.start()
    try:
        for p in procs:
            p.wait(timeout=duration + 240)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    sampler.join(timeout=10)
    if batch_id:
        retire_batch(batch_id)
    time.sleep(2.0)  # let the fleet drain before the next run
    inter = json.loads(inter_out.read_text())
    batch = json.loads(batch_out.read_text()) if batch_out.exists() else {"done": [], "inflight": [], "decisions": []}
    return {"t0": t0, "t_end": t_end, "interactive": inter, "batch": batch, "telemetry": sampler.rows}


def _spawn(module: str, *args: str, env: dict[str, str] | None = None, **opts: Any) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", module, *args]
    for key, value in opts.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env)


def summarize(
    name: str, kind: str, raw: dict[str, Any], slo: SloRule | None, concurrency: int | None = None
) -> RunResult:
    reqs = raw["interactive"]["requests"]
    ok = [r for r in reqs if r.get("status") == 200 and r.get("ttft") is not None]
    ttft = [r["ttft"] for r in ok]
    itl = [r["itl"] for r in ok if r.get("itl") is not None]
    t0, t_end = raw["t0"], raw["t_end"]
    done = [d for d in raw["batch"].get("done", []) if t0 <= d[0] <= t_end]
    tokens = sum(d[2] for d in done if d[1] == 200)
    attainment = 100.0 * sum(meets(r, slo) for r in reqs) / len(reqs) if slo and reqs else float("nan")
    return RunResult(
        name=name,
        kind=kind,
        concurrency=concurrency,
        attainment=attainment,
        n=len(reqs),
        ttft_p50=pct(ttft, 0.5),
        ttft_p90=pct(ttft, 0.9),
        itl_p50=pct(itl, 0.5),
        itl_p90=pct(itl, 0.9),
        batch_tok_s=tokens / (t_end - t0),
        batch_requests=sum(1 for d in done if d[1] == 200),
        aborted_or_failed=sum(1 for d in done if d[1] != 200),
        loop_lag_p99_s=raw["interactive"].get("loop_lag_p99_s", 0.0),
        load_avg_1m=os.getloadavg()[0],
    )


# -- the whole benchmark ---------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short trace and sweep (a few minutes)")
    p.add_argument("--disagg", action="store_true", help="prefill/decode split fleet (1 prefill + 2 decode)")
    p.add_argument("--kv-bytes-per-token", type=int, default=576, help="KV row size: 576 FP8 MLA, 352 NVFP4")
    p.add_argument("--naive-concurrency", type=int, default=128)
    p.add_argument("--sweep", default="", help="static lease limits, comma-separated")
    p.add_argument("--ceiling", type=int, default=128, help="the controller's upper bound")
    p.add_argument("--runs", default="a,b,s,o,c", help="which runs (a always runs: it sets the SLO; o needs s)")
    p.add_argument("--oracle-window", type=float, default=WINDOW_S, help="the oracle's window (s)")
    p.add_argument("--oracle-lead", type=float, default=LEAD_S, help="how far ahead the oracle lowers its limit (s)")
    p.add_argument(
        "--oracle-spread", type=float, default=SPREAD_S, help="a window's miss counts this far either side (s)"
    )
    p.add_argument(
        "--oracle-idle-limit", type=int, default=0, help="the oracle's limit where (a) is idle (0: the --ceiling)"
    )
    p.add_argument("--duration", type=float, default=0.0, help="override the trace length (s)")
    p.add_argument(
        "--trace", default="agent", help="interactive trace: agent (default), lulls or ramp (bench/agent_trace.py)"
    )
    p.add_argument(
        "--two-models",
        action="store_true",
        help="a fleet serving tiny-chat and tiny-chat-large, a batch per model, figures per model (runs a,s,c)",
    )
    p.add_argument(
        "--large-trace", default="none", help="--two-models: the large model's interactive trace (none: idle)"
    )
    p.add_argument("--batch-lines", type=int, default=3000, help="--two-models: lines of each model's batch")
    p.add_argument("--out", default=str(ROOT / "bench" / "out"))
    p.add_argument("--keep", action="store_true", help="keep the raw per-request records (printed path)")
    a = p.parse_args(argv)

    from bench.agent_trace import TRACES

    if a.trace not in TRACES:
        p.error(f"--trace: one of {', '.join(TRACES)}")
    spec = asdict(TRACES[a.trace])
    if a.quick:
        spec.update(duration_s=50.0, cycle_s=spec["cycle_s"] * 5 / 6, burst_s=spec["burst_s"] * 6 / 7)
        sweep = [int(x) for x in (a.sweep or "4,8,16").split(",")]
    else:
        sweep = [int(x) for x in (a.sweep or "4,8,12,16,24,32").split(",")]
    if a.duration:
        spec["duration_s"] = a.duration
    runs = set(a.runs.split(","))
    if a.two_models:
        sweep = [int(x) for x in (a.sweep or "8").split(",")]
        runs &= {"a", "s", "c"}
    if "o" in runs and "s" not in runs:
        p.error("--runs: the oracle (o) is built from the static sweep (s)")
    variant = (
        ("disagg" if a.disagg else "agg")
        + f"-kv{a.kv_bytes_per_token}"
        + ("" if a.trace == "agent" else f"-{a.trace}")
        + ("-quick" if a.quick else "")
    )
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="harvest-"))
    blocks = KV_BUDGET_BYTES // (a.kv_bytes_per_token * BLOCK_SIZE)

    db_url = setup_database()
    home = workdir / "home"
    env = {
        **os.environ,
        "BACKFILL_DATABASE_URL": db_url,
        "BACKFILL_REDIS_URL": REDIS_URL,
        "BACKFILL_HOME": str(home),
        "BACKFILL_LEASE_TTL_S": "5",
        "BACKFILL_CAPACITY_FLOOR": "0",
        "BACKFILL_CAPACITY_CEILING": str(a.ceiling),
        "BACKFILL_KV_BYTES_PER_TOKEN": str(a.kv_bytes_per_token),
        "BACKFILL_KV_BUDGET_BYTES": str(KV_BUDGET_BYTES),
        "BACKFILL_LOG_LEVEL": "WARNING",
    }
    os.environ.update({k: v for k, v in env.items() if k.startswith("BACKFILL_")})
    if a.two_models:
        from bench import harvest_models

        try:
            harvest_models.main(a, spec=spec, sweep=sweep, runs=runs, env=env, blocks=blocks)
        finally:
            drop_database(db_url)
            shutil.rmtree(workdir, ignore_errors=True)
        return

    from backfill.devfleet.fleet import Fleet

    fleet = Fleet(
        num_workers=2,
        speedup_ratio=1.0,
        num_gpu_blocks=blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=64,
        max_num_batched_tokens=8192,
        kv_bytes_per_token=a.kv_bytes_per_token,
        disaggregated=a.disagg,
        num_prefill_workers=1,
        model_name=MODEL,
    )
    started = time.time()
    results: list[RunResult] = []
    raws: dict[str, dict[str, Any]] = {}
    try:
        fleet.start()
        metrics = ",".join(
            [f"frontend={fleet.frontend_metrics_url}"] + [f"{role}={url}" for role, url in fleet.worker_metrics_urls]
        )
        env.update(BACKFILL_FLEET_URLS=fleet.base_url, BACKFILL_FLEET_METRICS_URLS=metrics)
        print(f"harvest {variant}: fleet {fleet.base_url} ({blocks} KV blocks/decoder), trace {spec}", flush=True)

        def go(name: str, kind: str, conc: int | None = None, schedule: list[int] | None = None) -> dict[str, Any]:
            raw = run_one(
                name,
                kind,
                fleet=fleet,
                spec=spec,
                workdir=workdir,
                env=env,
                concurrency=conc,
                schedule=schedule,
                window_s=a.oracle_window,
            )
            raws[name] = raw
            return raw

        raw_a = go("a", "a")
        base = summarize("a", "a", raw_a, None)
        slo = SloRule(ttft_s=2.0 * base.ttft_p90, itl_s=1.3 * base.itl_p90)
        env.update(BACKFILL_SLO_TTFT_S=f"{slo.ttft_s:.4f}", BACKFILL_SLO_ITL_S=f"{slo.itl_s:.4f}")
        print(f"SLO from (a): TTFT <= {slo.ttft_s * 1000:.0f} ms, mean ITL <= {slo.itl_s * 1000:.1f} ms", flush=True)
        results.append(summarize("a", "a", raw_a, slo))
        _report(results[-1])
        if "b" in runs:
            results.append(summarize("b", "b", go("b", "b", a.naive_concurrency), slo, a.naive_concurrency))
            _report(results[-1])
        for c in sweep if "s" in runs else []:
            results.append(summarize(f"s{c}", "s", go(f"s{c}", "s", c), slo, c))
            _report(results[-1])
        if "o" in runs:
            schedule = schedule_from_runs(
                raws["a"],
                {c: raws[f"s{c}"] for c in sweep},
                lambda r: meets(r, slo),
                window_s=a.oracle_window,
                lead_s=a.oracle_lead,
                spread_s=a.oracle_spread,
                idle_limit=a.oracle_idle_limit or a.ceiling,
            )
            print(
                f"oracle schedule ({a.oracle_window:g} s windows, {a.oracle_lead:g} s lead, "
                f"{a.oracle_spread:g} s spread, {a.oracle_idle_limit or a.ceiling} when idle): {schedule}",
                flush=True,
            )
            results.append(summarize("o", "o", go("o", "o", max(schedule), schedule), slo))
            results[-1].extra["schedule"] = schedule
            _report(results[-1])
        if "c" in runs:
            results.append(summarize("c", "c", go("c", "c", a.ceiling), slo))
            _report(results[-1])
        # The same interactive-only run again: how much the figures drift by noise alone.
        if not a.quick and runs >= {"a", "b", "s", "c"}:
            results.append(summarize("a2", "a", go("a2", "a"), slo))
            _report(results[-1])
    finally:
        fleet.stop()
        drop_database(db_url)
        if a.keep:
            print(f"raw records kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    elapsed = time.time() - started

    from bench.harvest_report import final_line, plot, table_row, write_summary

    png = out_dir / f"harvest-{variant}.png"
    summary = out_dir / f"harvest-{variant}{'' if runs >= {'b', 'c'} else '-partial'}.json"
    if not runs >= {"b", "c"}:
        # Still written: bench.sim_calibrate compares a partial run ((a), a few statics, (c)).
        write_summary(summary, variant, spec, slo, results, elapsed, "")
        print(f"partial run ({a.runs}): no plot, no closing line; wrote {summary}")
        return
    plot(png, raws, results, slo)
    line = final_line(results)
    write_summary(summary, variant, spec, slo, results, elapsed, line)
    print(f"wrote {png} ({elapsed / 60:.1f} min)")
    print(table_row(results))
    print(line)


def _report(r: RunResult) -> None:
    conc = f" C={r.concurrency}" if r.concurrency else ""
    print(
        f"  ({r.kind}) {r.name:<4}{conc:<6} attainment {r.attainment:5.1f}% of {r.n}  "
        f"TTFT p50/p90 {r.ttft_p50 * 1000:4.0f}/{r.ttft_p90 * 1000:4.0f} ms  "
        f"ITL p50/p90 {r.itl_p50 * 1000:4.1f}/{r.itl_p90 * 1000:4.1f} ms  "
        f"batch {r.batch_tok_s:6.0f} tok/s ({r.batch_requests} req, {r.aborted_or_failed} failed)  "
        f"gen lag p99 {r.loop_lag_p99_s * 1000:.0f} ms  load {r.load_avg_1m:.1f}"
        + ("" if r.valid else "  INVALID: generator lag p99 over 10 ms"),
        flush=True,
    )


if __name__ == "__main__":
    main()
