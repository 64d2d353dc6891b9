"""Load generators for the harvest benchmark, each meant to run in its own process.

`interactive`: replays the agent trace as streamed chat requests and records, per request, the
client-side time to first token and mean inter-token latency. It stays light on purpose (the
machine has two cores shared with the fleet): one event loop, orjson, no per-token work beyond a
timestamp, and a lag probe so a slow generator shows up in the results instead of in the SLO.

`naive`: a batch client that keeps a fixed number of requests in flight, no matter what.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

import httpx
import orjson

from bench.agent_trace import Session, TraceSpec, build_trace, reply_stub, system_prompt, tool_output, words

BATCH_PREFIXES = 8


def batch_body(i: int, salt: str, model: str) -> dict[str, Any]:
    """One batch request: a shared instruction (one of a few, so prefixes repeat) + a unique item."""
    rng = random.Random(i)
    group = i % BATCH_PREFIXES
    head = f"{salt} task {group} " + words(random.Random(1000 + group), 400)
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": head},
            {"role": "user", "content": words(rng, rng.randint(200, 400))},
        ],
        "max_tokens": rng.randint(128, 384),
    }


async def _lag_probe(samples: list[float], spikes: list[tuple[float, float]], stop: asyncio.Event) -> None:
    every_s = 0.05
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(every_s)
        lag = time.perf_counter() - t - every_s
        samples.append(lag)
        if lag > 0.02:
            spikes.append((time.time(), lag))


async def _turn(
    client: httpx.AsyncClient, url: str, model: str, messages: list[dict[str, str]], max_tokens: int
) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.time()
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    usage: dict[str, Any] = {}
    status = 0
    try:
        async with client.stream(
            "POST", url, content=orjson.dumps(body), headers={"Content-Type": "application/json"}
        ) as r:
            status = r.status_code
            if status != 200:
                await r.aread()
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    msg = orjson.loads(line[6:])
                    if msg.get("usage"):
                        usage = msg["usage"]
                    choices = msg.get("choices") or []
                    if choices and (choices[0].get("delta") or {}).get("content"):
                        if first is None:
                            first = now
                        last = now
                        chunks += 1
    except httpx.HTTPError as exc:
        return {"sent": sent, "end": time.time(), "status": 599, "error": repr(exc)[:200]}
    ttft = (first - t0) if first is not None else None
    itl = ((last - first) / (chunks - 1)) if first is not None and last is not None and chunks > 1 else None
    return {
        "sent": sent,
        "end": time.time(),
        "status": status,
        "ttft": ttft,
        "itl": itl,
        "chunks": chunks,
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
    }


async def run_interactive(base_url: str, model: str, spec: TraceSpec, salt: str, t0: float) -> dict[str, Any]:
    sessions = build_trace(spec)
    records: list[dict[str, Any]] = []
    lag: list[float] = []
    spikes: list[tuple[float, float]] = []
    stop = asyncio.Event()
    url = base_url + "/chat/completions"
    system = system_prompt(spec, salt)

    async def play(client: httpx.AsyncClient, s: Session) -> None:
        await asyncio.sleep(max(0.0, t0 + s.start_s - time.time()))
        messages = [{"role": "system", "content": system}]
        for k, turn in enumerate(s.turns):
            messages.append({"role": "user", "content": tool_output(spec, s, k)})
            rec = await _turn(client, url, model, messages, turn.max_tokens)
            rec.update(sid=s.sid, turn=k, burst=s.burst)
            records.append(rec)
            messages.append({"role": "assistant", "content": reply_stub(s, k, rec.get("completion_tokens") or 0)})
            await asyncio.sleep(turn.think_s)

    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        # The agents' shared instructions are hot in a running fleet: warm them (not recorded).
        warm = [{"role": "system", "content": system}, {"role": "user", "content": "ready"}]
        await asyncio.gather(*(_turn(client, url, model, warm, 1) for _ in range(4)))
        probe = asyncio.create_task(_lag_probe(lag, spikes, stop))
        await asyncio.gather(*(play(client, s) for s in sessions))
        stop.set()
        await probe
    lag.sort()
    return {
        "requests": records,
        "loop_lag_p99_s": lag[int(0.99 * (len(lag) - 1))] if lag else 0.0,
        "loop_lag_max_s": lag[-1] if lag else 0.0,
        "loop_lag_spikes": spikes,
    }


async def run_naive(
    base_url: str, model: str, concurrency: int, salt: str, t_start: float, t_end: float
) -> dict[str, Any]:
    """Fixed concurrency from t_start to t_end; requests still running at t_end are dropped."""
    done: list[tuple[float, int, int]] = []  # (finished, status, completion tokens)
    inflight = {"n": 0}
    samples: list[tuple[float, int]] = []
    url = base_url + "/chat/completions"
    counter = iter(range(10**9))

    async def worker(client: httpx.AsyncClient) -> None:
        while time.time() < t_end:
            body = batch_body(next(counter), salt, model)
            inflight["n"] += 1
            try:
                r = await client.post(url, content=orjson.dumps(body), headers={"Content-Type": "application/json"})
                tokens = (
                    (orjson.loads(r.content).get("usage") or {}).get("completion_tokens", 0)
                    if r.status_code == 200
                    else 0
                )
                done.append((time.time(), r.status_code, int(tokens)))
            except httpx.HTTPError:
                done.append((time.time(), 599, 0))
                await asyncio.sleep(0.2)
            finally:
                inflight["n"] -= 1

    async def sampler() -> None:
        while time.time() < t_end:
            samples.append((time.time(), inflight["n"]))
            await asyncio.sleep(0.25)

    await asyncio.sleep(max(0.0, t_start - time.time()))
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        tasks = [asyncio.create_task(worker(client)) for _ in range(concurrency)]
        await sampler()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"done": done, "inflight": samples}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["interactive", "naive"])
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", default="tiny-chat")
    p.add_argument("--spec", default="{}", help="TraceSpec fields as JSON")
    p.add_argument("--salt", default="run")
    p.add_argument("--t0", type=float, required=True)
    p.add_argument("--t-start", type=float, default=0.0)
    p.add_argument("--t-end", type=float, default=0.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.mode == "interactive":
        spec_fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(a.spec).items()}
        spec = TraceSpec(**spec_fields)
        result = asyncio.run(run_interactive(a.base_url, a.model, spec, a.salt, a.t0))
    else:
        result = asyncio.run(run_naive(a.base_url, a.model, a.concurrency, a.salt, a.t_start, a.t_end))
    with open(a.out, "wb") as f:
        f.write(orjson.dumps(result))
    sys.exit(0)


if __name__ == "__main__":
    main()
