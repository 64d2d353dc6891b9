"""Prefix benchmark: how much of the prompt tokens a fleet could serve from its KV cache does
backfill's release order get, and what that does to batch throughput.

On the real Dynamo frontend (KV router) + two mocker workers with prefill at a quarter speed (a
2K-token prefill costs ~120 ms of simulated engine time, so cache hits show in throughput) and
decode at full speed, each with a KV cache of 128 blocks of 64 tokens: small enough that order decides the hit rate (the shared workloads'
distinct prefixes are several times the cache; with the default 16384 blocks everything fits
and any order hits). Each workload runs as one batch whose lines are shuffled, twice:

  random  the shuffled file in line order, every request as soon as a lease allows;
  prefix  backfill's order (jobs/execution/prefixes.py, jobs/execution/claims.py) with the KV budget of the two
          workers' caches (KvModel x workers x the controller's batch share).

backfill's side runs in a process of its own (bench/prefix_side.py): the real Dispatcher with a
fixed lease limit, Postgres for the lines, Redis for the leases. Cached tokens come from each
response's usage (`prompt_tokens_details.cached_tokens`); the theoretical maximum from the
workload's own token streams (every whole block computed once, every other use a hit); the
router's spread from each worker's request counter.

    .venv/bin/python -m bench.prefix                      # every workload at the issue's sizes
    .venv/bin/python -m bench.prefix --runs 3             # the same, three times (noise)
    .venv/bin/python -m bench.prefix --workloads eval,unique --scale 0.3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.harvest import drop_database, setup_database
from bench.prefix_report import RunRow, final_line, table
from bench.prefix_workloads import MODEL, WORKLOADS, Text, Tokens, Workload, max_cached_tokens

ROOT = Path(__file__).resolve().parent.parent
# A Redis database of its own: each run starts by flushing it (leases, heartbeats, drain slots),
# so the benchmark refuses to start on one that holds anything.
REDIS_URL = os.environ.get("PREFIX_REDIS_URL", "redis://127.0.0.1:6379/15")
BLOCK = 64
BLOCKS_PER_WORKER = 128
WORKERS = 2
# Prefill at a quarter of the mocker's speed (a 2K-token prefill costs ~120 ms of engine time, as
# on a large model), decode at full speed (x4 on top): at speed 1 a prefill is so cheap that the
# two cores, not the engines, set the pace, and cache hits cannot show in throughput.
SPEEDUP = 0.25
DECODE_SPEEDUP = 4.0
INFLIGHT = 64
# The tiny model's KV row: 4 layers x 2 (K, V) x 2 KV heads x 64 dims x 2 bytes.
KV_BYTES_PER_TOKEN = 2048


def kv_budget_tokens() -> int:
    """The KV tokens batch work may fill: the controller's KV model of one decoder, times the
    decoders, times the share of the cache it leaves to batch work."""
    from backfill.scheduler.capacity.law import ControlConfig, Slo
    from backfill.scheduler.capacity.telemetry import KvModel

    kv = KvModel(bytes_per_token=KV_BYTES_PER_TOKEN, budget_bytes=BLOCKS_PER_WORKER * BLOCK * KV_BYTES_PER_TOKEN)
    return int(kv.tokens(0) * WORKERS * ControlConfig(slo=Slo(ttft_s=1.0, itl_s=0.05)).kv_batch_share)


def prepare_batch(work: Workload, salt: str, model_dir: Path) -> str:
    """The workload as one batch with its lines shuffled, validated as the service does (the
    model's tokenizer for fingerprints)."""
    import orjson

    from backfill.jobs import batches, files, teams
    from backfill.jobs.execution.prefixes import tokenizer_blocks
    from backfill.jobs.models import new_id
    from backfill.jobs.validation.outcome import apply_validation
    from backfill.jobs.validation.scan import Limits, validate_lines
    from backfill.storage.db import unit_of_work
    from backfill.storage.objects import get_object_store

    order = list(range(len(work.bodies)))
    random.Random(salt).shuffle(order)
    data = b"".join(
        orjson.dumps(
            {"custom_id": f"{salt}-{i}", "method": "POST", "url": "/v1/chat/completions", "body": work.bodies[i]}
        )
        + b"\n"
        for i in order
    )
    store = get_object_store()
    with unit_of_work() as s:
        team_id = teams.get_or_create_team(s, name=f"prefix-{work.name}").id
    file_id = new_id()
    key = files.file_key(team_id, file_id)
    store.put(key, [data])
    with unit_of_work() as s:
        files.record_upload(
            s,
            file_id=file_id,
            team_id=team_id,
            purpose="batch",
            filename=f"{work.name}.jsonl",
            size=len(data),
            expires_after_s=None,
            default_batch_expiry_s=86400,
        )
        batch_id = batches.create_batch(
            s,
            team_id=team_id,
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            windows={"24h": 86400},
            multipliers={},
        ).id
    result = validate_lines(
        store.open(key),
        endpoint="/v1/chat/completions",
        served_models={MODEL},
        limits=Limits(max_requests=len(order), max_line_bytes=1 << 22, max_errors=10),
        blocks=tokenizer_blocks(model_dir),
    )
    with unit_of_work() as s:
        status = apply_validation(s, batch_id=batch_id, result=result)
    if status != "in_progress":
        raise RuntimeError(f"{work.name} batch did not validate: {status} {result.errors[:3]}")
    return batch_id


def release_in_line_order(batch_id: str) -> None:
    """The random baseline: the shuffled file in line order, no prefix groups, no waiting."""
    from sqlalchemy import update

    from backfill.jobs.models import BatchRequest
    from backfill.storage.db import unit_of_work

    with unit_of_work() as s:
        s.execute(
            update(BatchRequest)
            .where(BatchRequest.batch_id == batch_id)
            .values(prefix_rank=BatchRequest.line, after_line=None, prefix_tokens=0)
        )


def batch_figures(batch_id: str) -> dict[str, Any]:
    from sqlalchemy import func, select, update

    from backfill.jobs.models import BatchRequest, RequestState
    from backfill.storage.db import unit_of_work

    with unit_of_work() as s:
        prompt, cached, last = s.execute(
            select(
                func.sum(BatchRequest.prompt_tokens),
                func.sum(BatchRequest.cached_tokens),
                func.max(BatchRequest.finished_at),
            ).where(BatchRequest.batch_id == batch_id)
        ).one()
        # Requests in flight (mean over the run) and claim-to-finish: from the lines' own times
        # (a retried line counts its last try).
        busy_s, median_s = s.execute(
            select(
                func.sum(func.extract("epoch", BatchRequest.finished_at - BatchRequest.claimed_at)),
                func.percentile_cont(0.5).within_group(
                    func.extract("epoch", BatchRequest.finished_at - BatchRequest.claimed_at)
                ),
            ).where(BatchRequest.batch_id == batch_id, BatchRequest.finished_at.is_not(None))
        ).one()
        states = dict(
            s.execute(
                select(BatchRequest.state, func.count())
                .where(BatchRequest.batch_id == batch_id)
                .group_by(BatchRequest.state)
            ).all()
        )
        # Whatever a run left (a timeout) must not count as in flight for the next one.
        s.execute(
            update(BatchRequest)
            .where(
                BatchRequest.batch_id == batch_id, BatchRequest.state.in_([RequestState.pending, RequestState.running])
            )
            .values(state=RequestState.cancelled, claim_token=None)
        )
    return {
        "prompt": int(prompt or 0),
        "cached": int(cached or 0),
        "last": last,
        "states": states,
        "busy_s": float(busy_s or 0.0),
        "median_s": float(median_s or 0.0),
    }


def worker_requests(fleet: Any) -> list[float]:
    """Requests each mocker worker has served so far (its `generate` endpoint's counter)."""
    import httpx

    out = []
    for _, url in fleet.worker_metrics_urls:
        total = 0.0
        for line in httpx.get(url, timeout=10).text.splitlines():
            if line.startswith("dynamo_component_request_duration_seconds_count{") and 'endpoint="generate"' in line:
                total += float(line.rsplit(" ", 1)[1])
        out.append(total)
    return out


def run_one(
    work: Workload,
    mode: str,
    run: int,
    *,
    fleet: Any,
    env: dict[str, str],
    workdir: Path,
    tokens: Tokens,
    model_dir: Path,
) -> RunRow:
    salt = f"{work.name}-{mode}-{run}-{secrets.token_hex(3)}"
    batch_id = prepare_batch(work, salt, model_dir)
    streams = [tokens.request(b) for b in work.bodies]
    requests = sum(work.samples) if work.samples else len(work.bodies)
    best = max_cached_tokens(
        [s for s, k in zip(streams, work.samples or [1] * len(streams), strict=True) for _ in range(k)]
    )
    if mode == "random":
        release_in_line_order(batch_id)
    import redis

    redis.Redis.from_url(REDIS_URL).flushdb()
    before = worker_requests(fleet)
    out = workdir / f"{salt}.json"
    cmd = [sys.executable, "-m", "bench.prefix_side", "--batch-id", batch_id, "--out", str(out), "--expand-n"]
    if mode == "prefix":
        cmd += ["--kv-budget-tokens", str(kv_budget_tokens())]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=1500)
    side = json.loads(out.read_text())
    after = worker_requests(fleet)
    fig = batch_figures(batch_id)
    wall = (fig["last"].timestamp() if fig["last"] else side["ended"]) - side["started"]
    served = [a - b for a, b in zip(after, before, strict=True)]
    return RunRow(
        workload=work.name,
        label=work.label,
        shared=work.shared,
        mode=mode,
        run=run,
        lines=len(work.bodies),
        requests=requests,
        prompt_tokens=fig["prompt"],
        cached_tokens=fig["cached"],
        max_cached_tokens=best,
        wall_s=wall,
        succeeded=fig["states"].get("succeeded", 0),
        spread=[x / max(sum(served), 1) for x in served],
        mean_in_flight=fig["busy_s"] / wall if wall > 0 else 0.0,
        median_claim_to_finish_s=fig["median_s"],
        drain_cpu_s=float(side.get("cpu_s", 0.0)),
        claims=int(side.get("claims", 0)),
        claimed=int(side.get("claimed", 0)),
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="eval1,eval,rollouts,sysprompt,agents,unique,rollouts_n")
    p.add_argument("--scale", type=float, default=1.0, help="scale the line counts (1.0: the issue's sizes)")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "bench" / "out"))
    a = p.parse_args(argv)
    names = [n for n in a.workloads.split(",") if n]
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        raise SystemExit(f"unknown workloads: {sorted(unknown)}; known: {sorted(WORKLOADS)}")

    import redis

    if redis.Redis.from_url(REDIS_URL).dbsize():
        raise SystemExit(f"{REDIS_URL} is in use (each run flushes it): set PREFIX_REDIS_URL to an empty database")

    from backfill.devfleet import install, model
    from backfill.devfleet.fleet import Fleet

    model_dir = Path(model.build_tiny_model(install.default_model_dir(MODEL), name=MODEL))
    tokens = Tokens(model_dir)
    workdir = Path(tempfile.mkdtemp(prefix="prefix-"))
    db_url = setup_database()
    env = {
        **os.environ,
        "BACKFILL_DATABASE_URL": db_url,
        "BACKFILL_REDIS_URL": REDIS_URL,
        "BACKFILL_HOME": str(workdir / "home"),
        "BACKFILL_LEASE_TTL_S": "5",
        "BACKFILL_CAPACITY_CONTROL": "false",
        "BACKFILL_MAX_INFLIGHT": str(INFLIGHT),
        "BACKFILL_LOG_LEVEL": "WARNING",
    }
    os.environ.update({k: v for k, v in env.items() if k.startswith("BACKFILL_")})
    fleet = Fleet(
        num_workers=WORKERS,
        speedup_ratio=SPEEDUP,
        num_gpu_blocks=BLOCKS_PER_WORKER,
        block_size=BLOCK,
        model_name=MODEL,
        model_path=model_dir,
        worker_args=["--decode-speedup-ratio", str(DECODE_SPEEDUP)],
    )
    rows: list[RunRow] = []
    started = time.time()
    try:
        fleet.start()
        env["BACKFILL_FLEET_URLS"] = fleet.base_url
        print(
            f"prefix: fleet {fleet.base_url}, {WORKERS} mockers x {BLOCKS_PER_WORKER} KV blocks of {BLOCK} tokens, "
            f"prefill speedup {SPEEDUP}, decode x{DECODE_SPEEDUP}, {INFLIGHT} leases, KV budget {kv_budget_tokens()} tokens, scale {a.scale}",
            flush=True,
        )
        for run in range(a.runs):
            for name in names:
                # Alternate which order goes first, so a drift in the machine's load cancels out.
                for mode in ("random", "prefix") if run % 2 == 0 else ("prefix", "random"):
                    # The same shape, new text: the first order's blocks must not help the second.
                    work = WORKLOADS[name](Text(tokens, f"{name}-{mode}-{run}"), a.scale)
                    row = run_one(
                        work, mode, run, fleet=fleet, env=env, workdir=workdir, tokens=tokens, model_dir=model_dir
                    )
                    rows.append(row)
                    print("  " + row.summary(), flush=True)
    finally:
        fleet.stop()
        drop_database(db_url)
        redis.Redis.from_url(REDIS_URL).flushdb()  # leave it empty for the next run
        shutil.rmtree(workdir, ignore_errors=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(f"\n{len(rows)} runs in {(time.time() - started) / 60:.1f} min; per-run figures in {out / 'prefix.json'}\n")
    print(table(rows))
    print(final_line(rows))


if __name__ == "__main__":
    main()
