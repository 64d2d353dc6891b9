"""End-to-end throughput: a batch through backfill vs. a direct asyncio client.

Both send the same requests to the same fleet (real Dynamo frontend + mocker workers) at the
same concurrency. backfill runs as its real processes on the production adapters (Postgres,
Redis broker and leases, SeaweedFS S3). Prints both throughputs and their ratio in one run.

    .venv/bin/python -m bench.e2e_throughput --requests 10000 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.runbatch import make_lines, token_range

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/9")
MODEL = "tiny-chat"


async def direct(fleet_url: str, lines: list[dict[str, object]], concurrency: int) -> float:
    """The baseline: an asyncio client holding `concurrency` requests in flight straight to the
    fleet, on aiohttp (the fleet client's own library: httpx's pool cost several times more a
    request at this concurrency, which would flatter backfill)."""
    import aiohttp

    bodies = iter([json.dumps(line["body"]).encode() for line in lines])
    url = f"{fleet_url}/chat/completions"
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:

        async def sender() -> None:
            for body in bodies:  # each sender takes the next body: `concurrency` in flight
                for _ in range(5):
                    async with client.post(url, data=body, headers={"content-type": "application/json"}) as r:
                        text = await r.read()
                        if r.status == 200:
                            break
                    await asyncio.sleep(0.5)
                else:
                    raise RuntimeError(f"direct request failed: {r.status} {text[:200]!r}")

        started = time.perf_counter()
        await asyncio.gather(*(sender() for _ in range(concurrency)))
        return time.perf_counter() - started


def through_backfill(base_url: str, key: str, lines: list[dict[str, object]]) -> tuple[float, int]:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=key, timeout=120)
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    started = time.perf_counter()
    f = client.files.create(file=("bench.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    elapsed = time.perf_counter() - started
    if batch.status != "completed" or batch.output_file_id is None:
        raise RuntimeError(f"batch ended {batch.status}: {batch.errors}")
    out = client.files.content(batch.output_file_id).text.splitlines()
    return elapsed, len(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=token_range, default=(16, 16), help="a count or a range: 50-500")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds of both paths")
    ap.add_argument("--fleet-workers", type=int, default=2)
    ap.add_argument("--speedup", type=float, default=10.0, help="mocker speedup ratio (simulated time per wall second)")
    args = ap.parse_args()

    from backfill.devfleet.stack import launch_stack

    # The mocker answers max_tokens tokens whatever the prompt, so no ignore_eos.
    lines = make_lines(args.requests, MODEL, args.max_tokens, ignore_eos=False)
    settings = {
        "BACKFILL_MAX_INFLIGHT": str(args.concurrency),
        # A fixed bound: this measures backfill's own machinery, not the controller.
        "BACKFILL_CAPACITY_CONTROL": "off",
        "BACKFILL_LOG_LEVEL": "WARNING",
    }
    with (
        tempfile.TemporaryDirectory() as tmp,
        launch_stack(
            Path(tmp),
            settings=settings,
            fleet_workers=args.fleet_workers,
            fleet_speedup=args.speedup,
            model=MODEL,
            name="bench",
            redis_url=REDIS_URL,
            flush=True,
        ) as stack,
    ):
        # Warm both paths (connections, the fleet's first requests) before timing.
        asyncio.run(direct(stack.fleet_url, lines[:200], args.concurrency))
        through_backfill(stack.base_url, stack.key, lines[:200])
        # Rounds alternate which path goes first (direct, backfill; backfill, direct; ...), so a
        # change in the machine's load over the run weighs on both alike.
        direct_times: list[float] = []
        backfill_times: list[float] = []
        for i in range(args.rounds):
            for path in ("direct", "backfill") if i % 2 == 0 else ("backfill", "direct"):
                if path == "direct":
                    direct_times.append(asyncio.run(direct(stack.fleet_url, lines, args.concurrency)))
                else:
                    seconds, n_out = through_backfill(stack.base_url, stack.key, lines)
                    assert n_out == args.requests, (n_out, args.requests)
                    backfill_times.append(seconds)
                print(
                    f"  round {i + 1} {path}: {(direct_times if path == 'direct' else backfill_times)[-1]:.1f} s",
                    flush=True,
                )

    direct_s, backfill_s = statistics.median(direct_times), statistics.median(backfill_times)
    ratios = [d / b for d, b in zip(direct_times, backfill_times, strict=True)]
    d_rps, b_rps = args.requests / direct_s, args.requests / backfill_s
    print(
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}: "
        f"requests={args.requests} concurrency={args.concurrency} max_tokens={args.max_tokens} fleet_workers={args.fleet_workers}"
    )
    print(f"{'path':<28}{'seconds':>10}{'req/s':>10}")
    print(f"{'direct asyncio client':<28}{direct_s:>10.1f}{d_rps:>10.1f}")
    print(f"{'backfill (upload->output)':<28}{backfill_s:>10.1f}{b_rps:>10.1f}")
    print(
        f"e2e: backfill_rps={b_rps:.1f} direct_rps={d_rps:.1f} ratio={b_rps / d_rps:.2f} "
        f"(per round: {', '.join(f'{r:.2f}' for r in ratios)}; medians of {args.rounds} rounds)"
    )


if __name__ == "__main__":
    main()
