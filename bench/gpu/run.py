"""backfill beside a direct client and the engine itself, on one GPU, in one command.

Starts the bench engine (`bench.gpu.engine`: transformers' continuous batching behind an
OpenAI-compatible endpoint, a Llama-3.2-1B-shaped model with random weights) and `backfill up`
in its embedded mode (SQLite, a local object directory, the filesystem broker; no Dynamo: the
fleet is the engine, `BACKFILL_FLEET_URLS`) with the capacity controller off and a fixed limit
C (`BACKFILL_MAX_INFLIGHT=C`, `BACKFILL_FLEET_PRIORITY_HINT=none`). Then, for the same lines
(one chat turn of about `--prompt-tokens` tokens, exactly `--output-tokens` generated: the
engine ignores EOS):

1. `offline`: every line straight into the engine's batching manager, no HTTP (the engine's
   own batch throughput); once small to size N, then with the N lines;
2. phases alternated and repeated: `direct` (an asyncio client holding C requests in flight),
   `backfill` (upload, `batches.create`, poll, download), `direct`, `backfill`, ...: whichever
   runs first on a cold engine is slower, so each kind runs early and late.

N is chosen from the first offline run so a direct phase lasts about `--phase-s` (at least 4C
lines, so the per-batch fixed costs of backfill are amortised); `--lines` fixes it. A phase that
would not finish inside `--budget-s` is skipped and said so.

Each phase reports its time, lines/s and generated tokens/s, the requests in flight at the
engine (time-weighted mean over its busy window, and max) and the engine's mean running
sequences; a backfill phase also its upload, `batches.create` to the first request at the
engine, and last reply to `completed` (polled every 50 ms). The JSON of it all goes to
`--out` (gpu_bench.json) beside the engine's and backfill's logs.

    python -m bench.gpu.run --out results                            # the GPU run
    python -m bench.gpu.run --shape tiny --device cpu --lines 24 \\
        --concurrency 4 --prompt-tokens 32 --output-tokens 8         # the CPU smoke run

Last line: `gpu: C=.. N=.. offline_tok_s=.. direct_tok_s=.. backfill_tok_s=.. backfill_vs_direct=..`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.engine_gauge import RunningGauge

MODEL_ID = "llama-3.2-1b-random"
TERMINAL = {"completed", "failed", "expired", "cancelled"}
API_KEY = "sk-dev-gpu-bench-0000000000000000"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prompts(tokenizer_json: Path, n: int, tokens: int, seed: int = 0) -> list[str]:
    """n distinct texts of `tokens` tokens each (by the engine's tokenizer), distinct from the
    first token on so no two lines share a cached prefix."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgk"
    out = []
    for i in range(n):
        words = [f"item{i}"] + ["".join(rng.choices(letters, k=rng.randint(2, 8))) for _ in range(tokens)]
        text = " ".join(words)
        enc = tok.encode(text, add_special_tokens=False)
        cut = enc.offsets[min(tokens, len(enc.offsets)) - 1][1]
        out.append(text[:cut])
    return out


def make_lines(texts: list[str], output_tokens: int) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL_ID,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": output_tokens,
                "ignore_eos": True,
            },
        }
        for i, text in enumerate(texts)
    ]


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: its process exited ({proc.returncode}); the end of {log}:\n{tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{url} not up in {timeout_s:.0f} s; the end of {log}:\n{tail(log)}")


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


@contextlib.contextmanager
def started(cmd: list[str], log: Path, env: dict[str, str] | None = None, stop: int = signal.SIGTERM) -> Iterator[Any]:
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(stop)
                try:
                    proc.wait(timeout=45)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def smoke(engine: str) -> None:
    """One request answered in full, before anything is timed."""
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    r = httpx.post(f"{engine}/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    if r.json()["usage"]["completion_tokens"] != 4:
        raise RuntimeError(f"the engine generated {r.json()['usage']} for max_tokens=4")


def engine_stats(engine: str, reset: bool = False) -> dict[str, Any]:
    return dict(httpx.get(f"{engine}/bench/stats", params={"reset": int(reset)}, timeout=30).json())


def offline(engine: str, lines: list[dict[str, Any]]) -> dict[str, Any]:
    r = httpx.post(f"{engine}/bench/offline", json={"bodies": [x["body"] for x in lines]}, timeout=900)
    r.raise_for_status()
    res = dict(r.json())
    res.update(kind="offline", lines=len(lines), ok=len(lines) - res["errors"])
    res["tok_s"] = res["completion_tokens"] / res["seconds"]
    res["lines_s"] = len(lines) / res["seconds"]
    return res


async def _direct(base: str, lines: list[dict[str, Any]], concurrency: int, want: int) -> tuple[float, int, int]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    todo = iter(lines)
    ok = tokens = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal ok, tokens
        for line in todo:
            r = await client.post("/chat/completions", json=line["body"])
            if r.status_code == 200:
                n = int(r.json()["usage"]["completion_tokens"])
                tokens += n
                ok += n == want

    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=900) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return time.perf_counter() - t0, ok, tokens


def direct(engine: str, lines: list[dict[str, Any]], concurrency: int, want: int) -> dict[str, Any]:
    seconds, ok, tokens = asyncio.run(_direct(f"{engine}/v1", lines, concurrency, want))
    return {"kind": "direct", "lines": len(lines), "ok": ok, "seconds": seconds, "completion_tokens": tokens}


def via_backfill(api: str, lines: list[dict[str, Any]], want: int, run: int) -> dict[str, Any]:
    data = b"".join(json.dumps({**x, "custom_id": f"{x['custom_id']}-{run}"}).encode() + b"\n" for x in lines)
    with httpx.Client(base_url=f"{api}/v1", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300) as client:
        t_upload = time.time()
        r = client.post("/files", files={"file": ("bench.jsonl", data, "application/jsonl")}, data={"purpose": "batch"})
        r.raise_for_status()
        t_create = time.time()
        body = {"input_file_id": r.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        r = client.post("/batches", json=body)
        r.raise_for_status()
        batch = r.json()
        try:
            while batch["status"] not in TERMINAL:
                time.sleep(0.05)
                r = client.get(f"/batches/{batch['id']}")
                if r.status_code == 200:
                    batch = r.json()
                else:  # (the rate limit is off for the bench; any refusal only delays the poll)
                    time.sleep(float(r.headers.get("retry-after", "1")))
        finally:
            if batch["status"] not in TERMINAL:  # a phase that failed leaves no lines running into the next
                client.post(f"/batches/{batch['id']}/cancel")
        t_done = time.time()
        if batch["status"] != "completed" or not batch.get("output_file_id"):
            raise RuntimeError(f"batch ended {batch['status']}: {batch.get('errors')}")
        out = client.get(f"/files/{batch['output_file_id']}/content")
        t_out = time.time()
    ok = tokens = 0
    for raw in out.text.splitlines():
        line = json.loads(raw)
        response = line.get("response") or {}
        if response.get("status_code") == 200:
            n = int(response["body"]["usage"]["completion_tokens"])
            tokens += n
            ok += n == want
    return {
        "kind": "backfill",
        "lines": len(lines),
        "ok": ok,
        "seconds": t_done - t_create,
        "completion_tokens": tokens,
        "upload_s": t_create - t_upload,
        "download_s": t_out - t_done,
        "t_create": t_create,
        "t_done": t_done,
    }


def phase(kind: str, engine: str, fn: Any) -> dict[str, Any]:
    engine_stats(engine, reset=True)
    with RunningGauge(f"{engine}/metrics", every_s=0.25) as gauge:
        res = dict(fn())
    seen = engine_stats(engine)
    res["tok_s"] = res["completion_tokens"] / res["seconds"]
    res["lines_s"] = res["lines"] / res["seconds"]
    res["inflight_mean"] = seen["inflight_mean"]
    res["inflight_max"] = seen["inflight_max"]
    res["running_mean"] = gauge.busy_mean()
    if kind == "backfill" and seen["first_at"] is not None:
        res["create_to_first_s"] = seen["first_at"] - res.pop("t_create")
        res["last_to_completed_s"] = res.pop("t_done") - seen["last_at"]
    return res


def describe(res: dict[str, Any]) -> str:
    extra = ""
    if res["kind"] == "backfill" and "create_to_first_s" in res:
        extra = (
            f" upload={res['upload_s']:.2f}s create->first={res['create_to_first_s']:.2f}s"
            f" last->completed={res['last_to_completed_s']:.2f}s"
        )
    held = f" inflight_mean={res['inflight_mean']:.1f} max={res['inflight_max']}" if "inflight_mean" in res else ""
    running = f" running_mean={res['running_mean']:.1f}" if "running_mean" in res else ""
    return (
        f"{res['kind']:<8} lines={res['lines']} ok={res['ok']} {res['seconds']:.2f}s "
        f"lines/s={res['lines_s']:.1f} tok/s={res['tok_s']:.0f}{held}{running}{extra}"
    )


def up_env(home: Path, engine: str, concurrency: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BACKFILL_")}
    env.update(
        BACKFILL_HOME=str(home),
        BACKFILL_FLEET_URLS=f"{engine}/v1",
        BACKFILL_CAPACITY_CONTROL="off",
        BACKFILL_MAX_INFLIGHT=str(concurrency),
        BACKFILL_FLEET_PRIORITY_HINT="none",
        BACKFILL_BOOTSTRAP_API_KEY=API_KEY,
        BACKFILL_ENVIRONMENT="development",
        BACKFILL_RATE_LIMIT="off",  # the bench polls its batch every 50 ms
    )
    return env


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b", help="bench.gpu.engine's SHAPES (tiny: the CPU test)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", type=int, default=128, help="C: the direct client's and backfill's limit")
    parser.add_argument("--lines", type=int, default=0, help="N (0: sized from the first offline run)")
    parser.add_argument("--max-lines", type=int, default=6000)
    parser.add_argument("--phase-s", type=float, default=25.0, help="a direct phase's target length when sizing N")
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2, help="direct/backfill pairs")
    parser.add_argument("--budget-s", type=float, default=400.0, help="skip phases that would end past this")
    parser.add_argument("--engine-python", default=sys.executable, help="a Python with torch and transformers")
    parser.add_argument("--out", type=Path, default=None, help="where gpu_bench.json and the logs go")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu-bench-out-"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-bench-"))
    from backfill.devfleet.model import build_tiny_model

    tokenizer = build_tiny_model(work / "tokenizer")
    engine_port, api_port = free_port(), free_port()
    engine, api = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{api_port}"
    engine_cmd = [args.engine_python, "-m", "bench.gpu.engine", "--tokenizer", str(tokenizer), "--shape", args.shape]
    engine_cmd += ["--device", args.device, "--port", str(engine_port), "--model-id", MODEL_ID]
    up_cmd = [sys.executable, "-m", "backfill", "up", "--port", str(api_port)]
    results: dict[str, Any] = {"concurrency": args.concurrency, "shape": args.shape, "device": args.device}
    phases: list[dict[str, Any]] = []
    results["phases"] = phases

    def save() -> None:
        (out / "gpu_bench.json").write_text(json.dumps(results, indent=1))

    with contextlib.ExitStack() as stack:
        up = stack.enter_context(
            started(up_cmd, out / "up.log", env=up_env(work / "home", engine, args.concurrency), stop=signal.SIGINT)
        )
        try:
            engine_proc = stack.enter_context(started(engine_cmd, out / "engine.log"))
            wait_http(f"{engine}/v1/models", engine_proc, 600, out / "engine.log")
            smoke(engine)
        except (RuntimeError, httpx.HTTPError) as exc:
            # One lease, one try: an engine that fails with its CUDA graphs starts again without them.
            print(f"engine failed ({str(exc)[-1500:]}); starting it again without CUDA graphs", flush=True)
            results["engine_fallback"] = str(exc)[-1500:]
            stack.close()
            up = stack.enter_context(
                started(
                    up_cmd, out / "up.log", env=up_env(work / "home2", engine, args.concurrency), stop=signal.SIGINT
                )
            )
            engine_proc = stack.enter_context(started([*engine_cmd, "--no-cuda-graph"], out / "engine2.log"))
            wait_http(f"{engine}/v1/models", engine_proc, 600, out / "engine2.log")
            smoke(engine)
        results["engine_ready_s"] = time.monotonic() - t0
        wait_http(f"{api}/health", up, 180, out / "up.log")
        results["up_ready_s"] = time.monotonic() - t0
        print(
            f"engine ready at {results['engine_ready_s']:.0f}s, backfill up at {results['up_ready_s']:.0f}s", flush=True
        )
        n = args.lines
        if not n:
            sample = make_lines(
                prompts(tokenizer / "tokenizer.json", 2 * args.concurrency, args.prompt_tokens, seed=1),
                args.output_tokens,
            )
            calibration = offline(engine, sample)
            results["calibration"] = calibration
            print("calibrate " + describe(calibration), flush=True)
            # The direct client holds C where the offline run held all: size N on a guess of C/all.
            n = int(args.phase_s * calibration["tok_s"] / args.output_tokens)
            n = max(4 * args.concurrency, min(args.max_lines, n))
        lines = make_lines(prompts(tokenizer / "tokenizer.json", n, args.prompt_tokens), args.output_tokens)
        results["lines"] = n
        plan: list[tuple[str, Any]] = [("offline", lambda: offline(engine, lines))]
        for i in range(args.repeat):
            plan.append(("direct", lambda: direct(engine, lines, args.concurrency, args.output_tokens)))
            plan.append(("backfill", lambda i=i: via_backfill(api, lines, args.output_tokens, i)))
        for kind, fn in plan:
            last = next((p["seconds"] for p in reversed(phases) if p["kind"] in (kind, "direct")), None)
            if last is not None and time.monotonic() - t0 + 1.3 * last + 5 > args.budget_s:
                print(f"skipped   {kind}: it would end past --budget-s {args.budget_s:.0f}", flush=True)
                results.setdefault("skipped", []).append(kind)
                continue
            try:
                res = offline(engine, lines) if kind == "offline" else phase(kind, engine, fn)
            except (RuntimeError, httpx.HTTPError, KeyError, ValueError) as exc:
                print(f"failed    {kind}: {exc}", flush=True)
                results.setdefault("failed", []).append({"kind": kind, "error": str(exc)[-2000:]})
                continue
            phases.append(res)
            save()
            print(describe(res), flush=True)
    results["total_s"] = time.monotonic() - t0
    home = "home2" if "engine_fallback" in results else "home"  # (the files that come back are few)
    for name in ("worker", "scheduler", "api"):
        log = work / home / "logs" / f"{name}.log"
        if log.exists():  # the end of it: what comes back from the GPU machine is bounded
            (out / f"{name}.log").write_text(tail(log, 2_000_000))
    summary(results)
    save()
    return results


def summary(results: dict[str, Any]) -> None:
    phases = results["phases"]

    def tok_s(kind: str) -> list[float]:
        return [p["tok_s"] for p in phases if p["kind"] == kind]

    direct_, backfill_, offline_ = tok_s("direct"), tok_s("backfill"), tok_s("offline")
    ratio = (sum(backfill_) / len(backfill_)) / (sum(direct_) / len(direct_)) if direct_ and backfill_ else 0.0
    results["backfill_vs_direct"] = ratio
    results["all_ok"] = all(p["ok"] == p["lines"] for p in phases)
    print(
        f"gpu: C={results['concurrency']} N={results.get('lines')} offline_tok_s={','.join(f'{x:.0f}' for x in offline_)}"
        f" direct_tok_s={','.join(f'{x:.0f}' for x in direct_)} backfill_tok_s={','.join(f'{x:.0f}' for x in backfill_)}"
        f" backfill_vs_direct={ratio:.2f} all_ok={results['all_ok']} total_s={results['total_s']:.0f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
