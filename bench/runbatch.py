"""backfill beside vLLM's own batch runner, on the same engine, model, file and cores.

For each size, one chat file goes through
- `vllm run-batch` (`python -m vllm.entrypoints.openai.run_batch -i IN -o OUT`): vLLM's offline
  runner, timed from launch to the output file written (its engine start-up included: that is
  its time to results), with nothing else running;
- backfill's real processes (API, worker, scheduler on Postgres, Redis, SeaweedFS) against a
  running `vllm serve` of the same engine arguments: timed from the upload to the output file
  downloaded (the server's start-up is not counted: it is already running).

Then the outputs are compared: the same custom_ids, every line answered, and the same line
shape (the keys of the line, its response, its body, a choice, the message and the usage).
Lines carry `ignore_eos` and a fixed `max_tokens`, so both runs generate the same token count.

    .venv/bin/python -m bench.runbatch --lines 5000 20000
    .venv/bin/python -m bench.runbatch --lines 2000 --pin 0:1   # engine on core 0, backfill on 1

With `--pin ENGINE:BACKFILL` (taskset's core lists) the engine (run-batch, or the server and
its engine core) runs on the first cores and backfill's processes (and this client) on the
second, so neither runner's engine shares its cores with anything. Each run also reports the
engine's mean running sequences (`vllm:num_requests_running`, sampled from its metrics over the
busy window): how full each runner kept the engine.

Last line: `runbatch: lines=N backfill_s=.. runbatch_s=.. ratio=..` (backfill_s / runbatch_s,
for the last size; one such line is printed per size).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.engine_gauge import RunningGauge, parse_cores, pinned

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/6")


def token_range(spec: str) -> tuple[int, int]:
    """`--max-tokens`: one count (`8`) or a range drawn from per line (`50-500`)."""
    lo, _, hi = spec.partition("-")
    return int(lo), int(hi or lo)


def make_lines(
    n: int, model: str, max_tokens: int | tuple[int, int], *, ignore_eos: bool = True
) -> list[dict[str, Any]]:
    """n chat lines; with a (lo, hi) range each line's max_tokens is drawn uniformly from it,
    seeded, so every runner and every run gets the same lines."""
    lo, hi = (max_tokens, max_tokens) if isinstance(max_tokens, int) else max_tokens
    rng = random.Random(n)
    return [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": f"Summarise item {i} of the catalogue in one line."}],
                "max_tokens": rng.randint(lo, hi),
            }
            | ({"ignore_eos": True} if ignore_eos else {}),
        }
        for i in range(n)
    ]


def shape(line: dict[str, Any]) -> tuple[tuple[str, ...], ...]:
    """The keys of a result line at each level a client reads."""
    response = line.get("response") or {}
    body = response.get("body") or {}
    choice = (body.get("choices") or [{}])[0]
    return (
        tuple(sorted(line)),
        tuple(sorted(response)),
        tuple(sorted(body)),
        tuple(sorted(choice)),
        tuple(sorted(choice.get("message") or {})),
        tuple(sorted(body.get("usage") or {})),
    )


def compare(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[str]:
    """What differs between the two outputs (empty: equivalent)."""
    problems = []
    ids_ours, ids_theirs = {x["custom_id"] for x in ours}, {x["custom_id"] for x in theirs}
    if ids_ours != ids_theirs or len(ours) != len(theirs):
        problems.append(f"custom_ids differ: {len(ids_ours ^ ids_theirs)} not in both; lines {len(ours)}/{len(theirs)}")
    for name, lines in (("backfill", ours), ("run-batch", theirs)):
        bad = [x["custom_id"] for x in lines if x.get("error") or (x.get("response") or {}).get("status_code") != 200]
        if bad:
            problems.append(f"{name}: {len(bad)} lines not answered 200 (first {bad[:3]})")
    shapes_ours, shapes_theirs = {shape(x) for x in ours}, {shape(x) for x in theirs}
    if shapes_ours != shapes_theirs:
        for level, (a, b) in enumerate(zip(min(shapes_ours), min(shapes_theirs), strict=True)):
            if a != b:
                problems.append(
                    f"line shape differs at level {level}: only backfill {sorted(set(a) - set(b))}, "
                    f"only run-batch {sorted(set(b) - set(a))}"
                )
    return problems


def run_vllm_batch(
    python: Path,
    engine_args: list[str],
    lines: list[dict[str, Any]],
    workdir: Path,
    *,
    cores: set[int] | None = None,
) -> tuple[float, list[dict[str, Any]], float]:
    """vLLM's runner on the file: its time, its output and its mean running sequences."""
    from backfill.devfleet.processes import LOOPBACK, free_port
    from backfill.devfleet.vllm import server_env
    from backfill.devfleet.vllm_install import RUN_BATCH_MODULE

    src, dst = workdir / "in.jsonl", workdir / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    dst.unlink(missing_ok=True)
    port = free_port()
    metrics = ["--enable-metrics", "--host", LOOPBACK, "--port", str(port)]
    started = time.perf_counter()
    with (
        open(workdir / "run-batch.log", "ab") as log,
        pinned(cores),
        RunningGauge(f"http://{LOOPBACK}:{port}/metrics") as gauge,
    ):
        rc = subprocess.call(
            [str(python), "-m", RUN_BATCH_MODULE, "-i", str(src), "-o", str(dst), *metrics, *engine_args],
            env=server_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    elapsed = time.perf_counter() - started
    if rc != 0:
        tail = (workdir / "run-batch.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"vllm run-batch failed (rc={rc}):\n{tail}")
    return elapsed, [json.loads(x) for x in dst.read_text().splitlines() if x.strip()], gauge.busy_mean()


def through_backfill(base_url: str, key: str, lines: list[dict[str, Any]]) -> tuple[float, list[dict[str, Any]]]:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=key, timeout=300)
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    started = time.perf_counter()
    f = client.files.create(file=("bench.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    if batch.status != "completed" or batch.output_file_id is None:
        raise RuntimeError(f"batch ended {batch.status}: {batch.errors}")
    text = client.files.content(batch.output_file_id).text
    elapsed = time.perf_counter() - started
    return elapsed, [json.loads(x) for x in text.splitlines() if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, nargs="+", default=[5_000, 20_000])
    ap.add_argument("--max-tokens", type=token_range, default=(8, 8), help="a count or a range: 50-500")
    ap.add_argument("--inflight", type=int, default=128, help="backfill's bound on requests in flight")
    ap.add_argument("--engine-arg", action="append", default=[], help="extra engine argument for both runs")
    ap.add_argument("--pin", default="", help="ENGINE:BACKFILL core lists (taskset form), e.g. 0:1")
    args = ap.parse_args()
    engine_cores = backfill_cores = None
    if args.pin:
        engine_spec, _, backfill_spec = args.pin.partition(":")
        engine_cores, backfill_cores = parse_cores(engine_spec), parse_cores(backfill_spec)
        # vLLM's CPU backend binds its OpenMP threads itself: to the engine's cores only.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = engine_spec

    from backfill.devfleet.stack import launch_stack
    from backfill.devfleet.vllm import VllmServer
    from backfill.devfleet.vllm_install import MODEL_NAME, build_vllm_model, ensure_vllm_venv

    python = ensure_vllm_venv()
    model = build_vllm_model(python=python)
    server = VllmServer(extra_args=args.engine_arg, startup_timeout_s=600)
    engine_args = server.engine_args(model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # vLLM's runner first, alone on the cores; then the server and backfill.
        theirs = {}
        for n in args.lines:
            theirs[n] = run_vllm_batch(
                python, engine_args, make_lines(n, MODEL_NAME, args.max_tokens), work, cores=engine_cores
            )
            print(f"run-batch {n} lines: {theirs[n][0]:.1f} s, running {theirs[n][2]:.1f}", flush=True)
        settings = {
            "BACKFILL_MAX_INFLIGHT": str(args.inflight),
            "BACKFILL_MAX_REQUESTS_PER_BATCH": str(max(args.lines)),
            "BACKFILL_MAX_FILE_BYTES": str(256 * 1024 * 1024),
            "BACKFILL_FLEET_PRIORITY_HINT": "none",  # the server runs the default (fcfs) policy
            "BACKFILL_CAPACITY_CONTROL": "false",
            "BACKFILL_LOG_LEVEL": "WARNING",
        }
        with contextlib.ExitStack() as serving:
            with pinned(engine_cores):  # the server and its engine core inherit the engine's cores
                serving.enter_context(server)
            serving.enter_context(pinned(backfill_cores))
            print(f"vllm serve ready in {server.startup_s:.0f} s", flush=True)
            with launch_stack(
                work / "stack",
                settings=settings,
                fleet_url=server.base_url,
                name="runbatch",
                redis_url=REDIS_URL,
                flush=True,
            ) as stack:
                through_backfill(stack.base_url, stack.key, make_lines(50, MODEL_NAME, args.max_tokens))  # warm-up
                for n in args.lines:
                    with RunningGauge(server.metrics_url) as gauge:
                        ours_s, ours = through_backfill(
                            stack.base_url, stack.key, make_lines(n, MODEL_NAME, args.max_tokens)
                        )
                    theirs_s, theirs_out, theirs_running = theirs[n]
                    problems = compare(ours, theirs_out)
                    rows.append((n, ours_s, theirs_s, problems, gauge.busy_mean(), theirs_running))
                    print(f"backfill {n} lines: {ours_s:.1f} s, running {gauge.busy_mean():.1f}", flush=True)

    pin = f" pin={args.pin}" if args.pin else ""
    print(f"max_tokens={args.max_tokens} inflight={args.inflight} cores={os.cpu_count()}{pin}")
    print(
        "| lines | backfill s | backfill req/s | backfill running | run-batch s | run-batch req/s | run-batch running | equivalent |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n, ours_s, theirs_s, problems, ours_running, theirs_running in rows:
        print(
            f"| {n} | {ours_s:.1f} | {n / ours_s:.1f} | {ours_running:.1f} | {theirs_s:.1f} | {n / theirs_s:.1f} | "
            f"{theirs_running:.1f} | {'yes' if not problems else '; '.join(problems)} |"
        )
    for n, ours_s, theirs_s, _, ours_running, theirs_running in rows:
        print(
            f"runbatch: lines={n} backfill_s={ours_s:.1f} runbatch_s={theirs_s:.1f} ratio={ours_s / theirs_s:.2f} "
            f"backfill_running={ours_running:.1f} runbatch_running={theirs_running:.1f}"
        )


if __name__ == "__main__":
    main()
