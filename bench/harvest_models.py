"""The harvest benchmark on a fleet serving two models (`bench.harvest --two-models`): `tiny-chat`
on two mocker workers and `tiny-chat-large` (four times its KV a token, half its speed) on one of
its own, behind one Dynamo frontend, as `backfill up` serves them.

Each model gets an interactive trace of its own (the large model's may be none: idle), and each
run a batch per model; backfill's side routes each model's lines to that model's lease pool,
steered in (c) by that model's own controller (its workers' metrics and the frontend's series
for that model). Runs: (a) interactive only (each model's SLO rule comes from its own (a)
figures, as in the one-model benchmark), (s<C>) a fixed limit C per model's pool, (c) the
controllers. The controllers share one SLO setting (the law has one): the busy model's.

Reported per model and run: the SLO attainment of that model's interactive requests, the batch
tokens/s of that model's batch (completion tokens of its lines finished inside the trace, read
from the database).
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.harvest_results import SloRule, meets, pct
from bench.harvest_setup import MODEL, flush_redis, prepare_batch, retire_batch

WARMUP_S = 6.0  # the batch side starts this long before the traces


@dataclass
class ModelResult:
    run: str
    model: str
    attainment: float  # % of this model's interactive requests meeting its SLO rule (nan: none)
    n: int
    ttft_p90: float
    itl_p90: float
    batch_tok_s: float
    batch_requests: int
    batch_failed: int


def _batch_done(batch_id: str, t0: float, t_end: float) -> tuple[int, int, int]:
    """(completion tokens, lines answered 200, lines answered otherwise) of the batch's lines
    finished inside [t0, t_end]."""
    from sqlalchemy import select

    from backfill.jobs.models import BatchRequest
    from backfill.storage.db import unit_of_work

    lo, hi = datetime.fromtimestamp(t0, UTC), datetime.fromtimestamp(t_end, UTC)
    with unit_of_work() as s:
        rows = s.execute(
            select(BatchRequest.status_code, BatchRequest.completion_tokens).where(
                BatchRequest.batch_id == batch_id, BatchRequest.finished_at >= lo, BatchRequest.finished_at <= hi
            )
        ).all()
    ok = [tokens for status, tokens in rows if status == 200]
    return sum(ok), len(ok), len(rows) - len(ok)


def run_one(
    name: str,
    kind: str,
    *,
    fleet: Any,
    specs: dict[str, dict[str, Any] | None],
    workdir: Path,
    env: dict[str, str],
    batch_lines: int,
    concurrency: int | None = None,
) -> dict[str, Any]:
    """The models' traces beside one batch load (kind a: none; s: a fixed limit per model's pool;
    c: the controllers); the raw interactive records and each model's batch figures."""
    from bench.harvest import _spawn

    salt = f"{name}{secrets.token_hex(2)}"
    duration = max(float(s["duration_s"]) for s in specs.values() if s)
    batches = {m: prepare_batch(f"{salt}-{m}", batch_lines, model=m) for m in specs} if kind != "a" else {}
    flush_redis()
    t0 = time.time() + WARMUP_S + 2.0
    t_end = t0 + duration
    outs = {m: workdir / f"{name}-{m}-interactive.json" for m, s in specs.items() if s}
    procs = [
        _spawn(
            "bench.loadgen",
            "interactive",
            base_url=fleet.base_url,
            model=m,
            spec=json.dumps(specs[m]),
            salt=f"{salt}-{m}",
            t0=t0,
            out=out,
        )
        for m, out in outs.items()
    ]
    if kind != "a":
        side_env = dict(env)
        side_env.update(
            BACKFILL_CAPACITY_CONTROL="true" if kind == "c" else "false", BACKFILL_MAX_INFLIGHT=str(concurrency)
        )
        procs.append(
            _spawn(
                "bench.backfill_side",
                env=side_env,
                t_start=t0 - WARMUP_S,
                t_end=t_end + 5,
                out=workdir / f"{name}-batch.json",
            )
        )
    try:
        for p in procs:
            p.wait(timeout=duration + 240)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    done = {m: _batch_done(b, t0, t_end) for m, b in batches.items()}
    for b in batches.values():
        retire_batch(b)
    time.sleep(2.0)  # let the fleet drain before the next run
    return {
        "t0": t0,
        "t_end": t_end,
        "interactive": {m: json.loads(out.read_text())["requests"] for m, out in outs.items()},
        "batch": done,
    }


def summarize(name: str, raw: dict[str, Any], model: str, slo: SloRule | None) -> ModelResult:
    reqs = raw["interactive"].get(model, [])
    ok = [r for r in reqs if r.get("status") == 200 and r.get("ttft") is not None]
    tokens, n_ok, n_failed = raw["batch"].get(model, (0, 0, 0))
    return ModelResult(
        run=name,
        model=model,
        attainment=100.0 * sum(meets(r, slo) for r in reqs) / len(reqs) if slo and reqs else float("nan"),
        n=len(reqs),
        ttft_p90=pct([r["ttft"] for r in ok], 0.9),
        itl_p90=pct([r["itl"] for r in ok if r.get("itl") is not None], 0.9),
        batch_tok_s=tokens / (raw["t_end"] - raw["t0"]),
        batch_requests=n_ok,
        batch_failed=n_failed,
    )


def _report(r: ModelResult) -> None:
    share = "   n/a" if r.n == 0 else f"{r.attainment:5.1f}%"
    print(
        f"  {r.run:<4} {r.model:<16} attainment {share} of {r.n:<4} "
        f"TTFT p90 {r.ttft_p90 * 1000:5.0f} ms  ITL p90 {r.itl_p90 * 1000:5.1f} ms  "
        f"batch {r.batch_tok_s:6.0f} tok/s ({r.batch_requests} req, {r.batch_failed} failed)",
        flush=True,
    )


def table(results: list[ModelResult]) -> str:
    rows = ["| run | model | interactive attainment | batch tok/s | batch requests |", "|---|---|---|---|---|"]
    for r in results:
        share = "no interactive load" if r.n == 0 else f"{r.attainment:.1f}% of {r.n}"
        rows.append(f"| {r.run} | {r.model} | {share} | {r.batch_tok_s:.0f} | {r.batch_requests} |")
    return "\n".join(rows)


def main(
    a: argparse.Namespace, *, spec: dict[str, Any], sweep: list[int], runs: set[str], env: dict[str, str], blocks: int
) -> None:
    """Called by `bench.harvest` with its parsed options, trace, sweep, environment and KV blocks."""
    import os
    import tempfile

    from backfill.devfleet.fleet import Fleet, large_model
    from bench.agent_trace import TRACES
    from bench.harvest import BLOCK_SIZE

    if a.large_trace != "none" and a.large_trace not in TRACES:
        raise SystemExit(f"--large-trace: none or one of {', '.join(TRACES)}")
    large_spec = None
    if a.large_trace != "none":
        large_spec = asdict(TRACES[a.large_trace])
        large_spec.update(duration_s=spec["duration_s"], seed=large_spec["seed"] + 1)
    fleet = Fleet(
        num_workers=2,
        speedup_ratio=1.0,
        num_gpu_blocks=blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=64,
        max_num_batched_tokens=8192,
        kv_bytes_per_token=a.kv_bytes_per_token,
        model_name=MODEL,
        more_models=[large_model(1.0)],
    )
    workdir = Path(tempfile.mkdtemp(prefix="harvest-models-"))
    env = dict(env)
    results: list[ModelResult] = []
    started = time.time()
    try:
        fleet.start()
        specs = {fleet.models[0]: spec, fleet.models[1]: large_spec}
        metrics = ",".join(
            [f"frontend={fleet.frontend_metrics_url}", *(f"{w.role}@{w.model}={w.metrics_url}" for w in fleet.workers)]
        )
        env.update(BACKFILL_FLEET_URLS=fleet.base_url, BACKFILL_FLEET_METRICS_URLS=metrics)
        os.environ["BACKFILL_FLEET_URLS"] = fleet.base_url  # this process validates each model's batch
        print(
            f"harvest two-models: fleet {fleet.base_url} ({', '.join(fleet.models)}), "
            f"traces {a.trace} / {a.large_trace}, {a.batch_lines} batch lines a model",
            flush=True,
        )

        def go(name: str, kind: str, conc: int | None = None) -> dict[str, Any]:
            return run_one(
                name,
                kind,
                fleet=fleet,
                specs=specs,
                workdir=workdir,
                env=env,
                batch_lines=a.batch_lines,
                concurrency=conc,
            )

        raw_a = go("a", "a")
        slos: dict[str, SloRule | None] = {}
        for m in fleet.models:
            base = summarize("a", raw_a, m, None)
            slos[m] = SloRule(2.0 * base.ttft_p90, 1.3 * base.itl_p90) if base.n else None
            if slos[m] is not None:
                print(
                    f"SLO of {m} from (a): TTFT <= {2000 * base.ttft_p90:.0f} ms, ITL <= {1300 * base.itl_p90:.1f} ms"
                )
        busy = slos[fleet.models[0]]
        assert busy is not None
        env.update(BACKFILL_SLO_TTFT_S=f"{busy.ttft_s:.4f}", BACKFILL_SLO_ITL_S=f"{busy.itl_s:.4f}")

        def record(name: str, raw: dict[str, Any]) -> None:
            for m in fleet.models:
                results.append(summarize(name, raw, m, slos[m]))
                _report(results[-1])

        record("a", raw_a)
        for c in sweep if "s" in runs else []:
            record(f"s{c}", go(f"s{c}", "s", c))
        if "c" in runs:
            record("c", go("c", "c", a.ceiling))
    finally:
        fleet.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    elapsed = time.time() - started
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    variant = f"two-models-kv{a.kv_bytes_per_token}" + ("-quick" if a.quick else "")
    summary = {
        "variant": variant,
        "traces": {MODEL: a.trace, "tiny-chat-large": a.large_trace},
        "slo": {m: asdict(s) if s else None for m, s in slos.items()},
        "results": [asdict(r) for r in results],
        "elapsed_s": elapsed,
    }
    (out / f"harvest-{variant}.json").write_text(json.dumps(summary, indent=1))
    print(f"({elapsed / 60:.1f} min)")
    print(table(results))
