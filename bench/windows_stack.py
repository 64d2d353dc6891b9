"""Completion windows with no idle capacity (issue 21 B), on the real stack: today's policy and the
escalating one side by side.

A Dynamo mocker fleet (the harvest benchmark's interference regime: a small KV cache, decode step
time growing with its occupancy) carries a steady agent trace streamed straight at its frontend
(`bench.loadgen interactive`), heavy enough that the capacity controller, steering by the
fleet's telemetry to the interactive SLO, releases only a few leases. backfill's real processes
(API, worker, scheduler: `devfleet.stack.launch_stack`) take batches through the OpenAI SDK in
time-compressed windows (`BACKFILL_COMPLETION_WINDOWS`): several in a short window (a 1 h window
scaled down) submitted one after another, a few in a long one (24 h scaled down). It runs twice
on the same fleet and trace, a fresh stack each time:

  baseline:   today's policy: what the controller releases, the deadline guard's share of it
              (`BACKFILL_ESCALATION_INFLIGHT=0`, no overflow deployment);
  escalating: the relaxed step (`BACKFILL_ESCALATION_INFLIGHT`) and a second, small mocker fleet
              as the overflow deployment (`BACKFILL_OVERFLOW_URLS`).

The SLO rule is the harvest benchmark's (TTFT <= 2 x p90, mean ITL <= 1.3 x p90 of a short
interactive-only run first, unless given); the controller steers to the same. Per run: batches,
in_window (completed by expires_at), expired, overflow_share (output lines whose
response.request_id starts with "overflow-", over all lines submitted), the interactive SLO
attainment, and the controller's mean published limit (how much idle capacity it found).

    .venv/bin/python -m bench.windows_stack                 # ~9 minutes
    .venv/bin/python -m bench.windows_stack --short-window 90 --short-batches 5 --sessions 12
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.harvest_setup import MODEL, ROOT

BLOCK_SIZE = 64
KV_BYTES_PER_TOKEN = 576
KV_BUDGET_BYTES = 2048 * BLOCK_SIZE * KV_BYTES_PER_TOKEN  # the harvest benchmark's cache
SUBMIT_LEAD_S = 8.0  # the trace starts this long before the first batch (the controller settles)


@dataclass(frozen=True)
class Plan:
    short_window_s: int = 60
    long_window_s: int = 180
    short_batches: int = 4
    short_every_s: float = 30.0
    short_lines: int = 60
    long_batches: int = 2
    long_lines: int = 150
    sessions: int = 13  # agent sessions in flight, steadily
    extra: int = 8  # BACKFILL_ESCALATION_INFLIGHT in the escalating run
    overflow_inflight: int = 16

    @property
    def run_s(self) -> float:
        last_short = (self.short_batches - 1) * self.short_every_s + self.short_window_s
        return SUBMIT_LEAD_S + max(last_short, self.long_window_s if self.long_batches else 0) + 10.0


@dataclass
class RunFigures:
    policy: str
    batches: int
    in_window: int
    expired: int
    lines: int
    overflow_lines: int
    attainment: float
    interactive_requests: int
    mean_limit: float
    statuses: dict[str, int]
    by_window: dict[str, str]  # window -> "in_window/batches"

    @property
    def overflow_share(self) -> float:
        return self.overflow_lines / self.lines if self.lines else 0.0


def trace_spec(plan: Plan, duration_s: float) -> dict[str, Any]:
    """A steady agent load: the ramp trace's arrivals with trough and peak at `sessions`."""
    from bench.agent_trace import TraceSpec

    spec = TraceSpec(
        duration_s=duration_s, burst_sessions=plan.sessions, quiet_sessions=plan.sessions, seed=30, shape="ramp"
    )
    return asdict(spec)


def interactive(fleet_url: str, spec: dict[str, Any], out: Path, t0: float) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "bench.loadgen", "interactive", "--base-url", fleet_url, "--model", MODEL]
    cmd += ["--spec", json.dumps(spec), "--salt", secrets.token_hex(3), "--t0", str(t0), "--out", str(out)]
    return subprocess.Popen(cmd, cwd=ROOT)


def batch_file(tag: str, n: int) -> bytes:
    import orjson

    from bench.loadgen import batch_body

    return b"".join(
        orjson.dumps(
            {
                "custom_id": f"{tag}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": batch_body(i, tag, MODEL),
            }
        )
        + b"\n"
        for i in range(n)
    )


class LimitSampler(threading.Thread):
    """The controller's published lease limit on the reserved fleet, once a second."""

    def __init__(self, redis_url: str) -> None:
        super().__init__(daemon=True)
        from backfill.scheduler.capacity.admission import pool_of
        from backfill.storage.leases import RedisLeaseStore, limit_key

        self.store, self.key = RedisLeaseStore(redis_url), limit_key(pool_of(0))
        self.samples: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                value = self.store.read(self.key)
            except Exception:  # noqa: BLE001 -- a missed sample only; the stack may be going down
                continue
            self.samples.append(int(float(value)) if value is not None else 0)


def stack_settings(plan: Plan, *, fleet: Any, slo: Any, overflow_url: str | None) -> dict[str, str]:
    metrics = ",".join(
        [f"frontend={fleet.frontend_metrics_url}"] + [f"{role}={url}" for role, url in fleet.worker_metrics_urls]
    )
    return {
        "BACKFILL_COMPLETION_WINDOWS": f"{plan.short_window_s}s,{plan.long_window_s}s",
        "BACKFILL_CAPACITY_CONTROL": "on",
        "BACKFILL_FLEET_METRICS_URLS": metrics,
        "BACKFILL_SLO_TTFT_S": f"{slo.ttft_s:.4f}",
        "BACKFILL_SLO_ITL_S": f"{slo.itl_s:.4f}",
        "BACKFILL_CAPACITY_FLOOR": "0",
        "BACKFILL_CAPACITY_CEILING": "64",
        "BACKFILL_MAX_INFLIGHT": "64",
        "BACKFILL_KV_BYTES_PER_TOKEN": str(KV_BYTES_PER_TOKEN),
        "BACKFILL_KV_BUDGET_BYTES": str(KV_BUDGET_BYTES),
        "BACKFILL_LEASE_TTL_S": "5",
        "BACKFILL_DRAIN_SLICE_S": "10",
        "BACKFILL_TICK_INTERVAL_S": "0.5",
        "BACKFILL_LOG_LEVEL": "WARNING",
        # Today's policy: no relaxed step, no overflow deployment.
        "BACKFILL_ESCALATION_INFLIGHT": str(plan.extra if overflow_url else 0),
        "BACKFILL_OVERFLOW_URLS": overflow_url or "",
        "BACKFILL_OVERFLOW_MAX_INFLIGHT": str(plan.overflow_inflight),
    }


def run_policy(
    policy: str, plan: Plan, *, fleet: Any, s3: Any, slo: Any, overflow_url: str | None, workdir: Path
) -> RunFigures:
    import openai

    from backfill.devfleet.stack import launch_stack
    from bench.harvest_results import meets

    settings = stack_settings(plan, fleet=fleet, slo=slo, overflow_url=overflow_url)
    with launch_stack(workdir / policy, settings=settings, s3=s3, fleet_url=fleet.base_url, name="winbench") as stack:
        client = openai.OpenAI(base_url=stack.base_url, api_key=stack.key, max_retries=2, timeout=60)
        sampler = LimitSampler(stack.redis_url)
        sampler.start()
        t0 = time.time() + 2.0
        inter_out = workdir / f"{policy}-interactive.json"
        loadgen = interactive(fleet.base_url, trace_spec(plan, plan.run_s), inter_out, t0)
        schedule = [(SUBMIT_LEAD_S + i * plan.short_every_s, "short", i) for i in range(plan.short_batches)]
        schedule += [(SUBMIT_LEAD_S, "long", i) for i in range(plan.long_batches)]
        ids: list[str] = []
        lines = 0
        for at, kind, i in sorted(schedule):
            time.sleep(max(0.0, t0 + at - time.time()))
            n = plan.short_lines if kind == "short" else plan.long_lines
            window = plan.short_window_s if kind == "short" else plan.long_window_s
            tag = f"{policy}-{kind}{i}-{secrets.token_hex(2)}"
            f = client.files.create(file=(f"{tag}.jsonl", batch_file(tag, n)), purpose="batch")
            b = client.batches.create(
                input_file_id=f.id,
                endpoint="/v1/chat/completions",
                completion_window=f"{window}s",  # type: ignore[arg-type]  # the SDK types only "24h"
            )
            ids.append(b.id)
            lines += n
            print(f"  [{policy}] t={time.time() - t0:5.1f}s {kind} batch {b.id} ({n} lines, {window}s)", flush=True)
        final = wait_terminal(client, ids, until=t0 + plan.run_s + 60)
        loadgen.wait(timeout=240)
        sampler.stop.set()
        in_window = sum(1 for b in final if b.status == "completed" and b.completed_at <= b.expires_at)
        overflow_lines = 0
        for b in final:
            if b.output_file_id:
                for row in client.files.content(b.output_file_id).text.splitlines():
                    if row.strip() and str(json.loads(row)["response"].get("request_id") or "").startswith("overflow-"):
                        overflow_lines += 1
        reqs = json.loads(inter_out.read_text())["requests"]
        statuses: dict[str, int] = {}
        by_window: dict[str, list[int]] = {}
        for b in final:
            statuses[b.status] = statuses.get(b.status, 0) + 1
            made = by_window.setdefault(b.completion_window, [0, 0])
            made[0] += b.status == "completed" and b.completed_at <= b.expires_at
            made[1] += 1
        return RunFigures(
            policy=policy,
            batches=len(final),
            in_window=in_window,
            expired=statuses.get("expired", 0),
            lines=lines,
            overflow_lines=overflow_lines,
            attainment=sum(meets(r, slo) for r in reqs) / len(reqs) if reqs else float("nan"),
            interactive_requests=len(reqs),
            mean_limit=sum(sampler.samples) / len(sampler.samples) if sampler.samples else 0.0,
            statuses=statuses,
            by_window={w: f"{made}/{n}" for w, (made, n) in by_window.items()},
        )


def wait_terminal(client: Any, ids: list[str], *, until: float) -> list[Any]:
    """Every batch once it is completed, expired, failed or cancelled (or as it is at `until`)."""
    terminal = {"completed", "expired", "failed", "cancelled"}
    latest = {i: client.batches.retrieve(i) for i in ids}
    while time.time() < until and any(b.status not in terminal for b in latest.values()):
        time.sleep(2.0)
        latest = {i: (b if b.status in terminal else client.batches.retrieve(i)) for i, b in latest.items()}
    return list(latest.values())


def calibrate(fleet: Any, plan: Plan, workdir: Path, seconds: float) -> Any:
    """The SLO rule from an interactive-only run of the same trace (the harvest benchmark's rule)."""
    from bench.harvest_results import SloRule, pct

    out = workdir / "calibrate-interactive.json"
    interactive(fleet.base_url, trace_spec(plan, seconds), out, time.time() + 1.0).wait(timeout=seconds + 240)
    ok = [r for r in json.loads(out.read_text())["requests"] if r.get("status") == 200 and r.get("ttft") is not None]
    return SloRule(
        ttft_s=2.0 * pct([r["ttft"] for r in ok], 0.9),
        itl_s=1.3 * pct([r["itl"] for r in ok if r.get("itl") is not None], 0.9),
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Plan()
    for name, value in asdict(defaults).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    p.add_argument("--slo-ttft", type=float, default=0.0, help="skip the calibration run: TTFT bound (s)")
    p.add_argument("--slo-itl", type=float, default=0.0, help="with --slo-ttft: mean ITL bound (s)")
    p.add_argument("--calibrate-s", type=float, default=40.0)
    p.add_argument("--policies", default="baseline,escalating")
    a = p.parse_args(argv)
    plan = Plan(**{k: getattr(a, k) for k in asdict(defaults)})
    os.environ.setdefault("BACKFILL_LOG_LEVEL", "WARNING")

    from backfill.devfleet.fleet import Fleet
    from backfill.devfleet.s3 import SeaweedS3
    from backfill.devfleet.stack import BUCKET
    from bench.harvest_results import SloRule

    workdir = Path(tempfile.mkdtemp(prefix="windows-stack-"))
    started = time.time()
    fleet = Fleet(
        num_workers=2,
        speedup_ratio=1.0,
        num_gpu_blocks=KV_BUDGET_BYTES // (KV_BYTES_PER_TOKEN * BLOCK_SIZE),
        block_size=BLOCK_SIZE,
        max_num_seqs=64,
        max_num_batched_tokens=8192,
        kv_bytes_per_token=KV_BYTES_PER_TOKEN,
        model_name=MODEL,
    )
    overflow = Fleet(num_workers=1, speedup_ratio=5.0, model_name=MODEL)  # a small, separate deployment
    figures: dict[str, RunFigures] = {}
    with SeaweedS3() as s3:
        s3.create_bucket(BUCKET)
        try:
            fleet.start()
            if "escalating" in a.policies:
                overflow.start()
            slo = SloRule(a.slo_ttft, a.slo_itl) if a.slo_ttft else calibrate(fleet, plan, workdir, a.calibrate_s)
            print(f"windows_stack: {plan}\nSLO: TTFT <= {slo.ttft_s * 1000:.0f} ms, ITL <= {slo.itl_s * 1000:.1f} ms")
            for policy in a.policies.split(","):
                url = overflow.base_url if policy == "escalating" else None
                figures[policy] = f = run_policy(
                    policy, plan, fleet=fleet, s3=s3, slo=slo, overflow_url=url, workdir=workdir
                )
                print(
                    f"{policy}: batches={f.batches} in_window={f.in_window} expired={f.expired} "
                    f"overflow_share={f.overflow_share:.3f} slo_attainment={f.attainment:.3f} "
                    f"({f.interactive_requests} interactive) mean_limit={f.mean_limit:.1f} in_window_by_window={f.by_window}",
                    flush=True,
                )
        finally:
            overflow.stop()
            fleet.stop()
    print(f"({(time.time() - started) / 60:.1f} min; raw records in {workdir})")
    if {"baseline", "escalating"} <= set(figures):
        base, esc = figures["baseline"], figures["escalating"]
        print(
            f"windows: batches={esc.batches} in_window={esc.in_window} expired={esc.expired} "
            f"overflow_share={esc.overflow_share:.3f} slo_attainment={esc.attainment:.3f} "
            f"baseline_attainment={base.attainment:.3f}"
        )


if __name__ == "__main__":
    main()
