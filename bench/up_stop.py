"""How long `backfill up` takes to stop after one SIGINT (Ctrl-C), and where the time goes.

Each run starts `backfill up` on a fresh home, waits for its banner and a few quiet seconds,
sends one SIGINT to `up` and watches every process of its tree (50 ms apart) until all are
gone; it prints, per run, when each component's processes were all gone (seconds after the
SIGINT), and at the end the min/median/max of the whole stop.

    python -m bench.up_stop --runs 5
    python -m bench.up_stop --runs 3 --batch-lines 300   # stopped mid-batch instead of idle
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

POLL_S = 0.05


def _component(p: psutil.Process, up_pid: int) -> str:
    try:
        cmd = p.cmdline()
        parent = p.ppid()
    except psutil.Error:
        return "?"
    if p.pid == up_pid:
        return "up"
    if cmd[1:3] == ["-m", "backfill"] and len(cmd) > 3:
        return cmd[3] if parent == up_pid else f"{cmd[3]}-child"
    text = " ".join(cmd)
    if "dynamo.frontend" in text:
        return "fleet-frontend"
    if "mocker" in text:
        return "fleet-mocker"
    if parent != up_pid and parent > 1:
        return "worker-child" if "celery" in text or "billiard" in text else "other"
    return "other"


def _start_batch(out: Path, lines: int) -> None:
    """A batch of long lines, until its first line is done: the SIGINT finds a drain mid-batch."""
    import json
    import re

    import openai

    text = out.read_text(errors="replace")
    key = re.search(r"API key\s*:\s*(\S+)", text).group(1)  # type: ignore[union-attr]
    base = re.search(r"base URL\s*:\s*(\S+)", text).group(1)  # type: ignore[union-attr]
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=2)
    body = "".join(
        json.dumps(
            {
                "custom_id": f"stop-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "tiny-chat",
                    "messages": [{"role": "user", "content": f"line {i}"}],
                    "max_tokens": 400,
                },
            }
        )
        + "\n"
        for i in range(lines)
    )
    f = client.files.create(file=("stop.jsonl", body.encode()), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 180
    while not ((c := client.batches.retrieve(b.id).request_counts) and c.completed):
        if time.monotonic() > deadline:
            raise RuntimeError("the batch ran no line in 180 s")
        time.sleep(0.3)


def one_run(home: Path, settle_s: float, batch_lines: int = 0, speedup: float = 10.0) -> tuple[float, dict[str, float]]:
    from backfill.devfleet.processes import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("BACKFILL_") or k == "BACKFILL_FLEET_HOME"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env["BACKFILL_HOME"] = str(home)
    out = home.parent / f"{home.name}.out"
    with out.open("wb") as sink:
        up = subprocess.Popen(
            [sys.executable, "-m", "backfill", "up", "--port", str(free_port()), "--speedup", str(speedup)],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 300
    while "Ctrl-C stops everything" not in out.read_text(errors="replace"):
        if up.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"`backfill up` did not come up:\n{out.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    time.sleep(settle_s)
    if batch_lines:
        _start_batch(out, batch_lines)
    root = psutil.Process(up.pid)
    tree = {p: _component(p, up.pid) for p in [root, *root.children(recursive=True)]}
    told = time.monotonic()
    up.send_signal(signal.SIGINT)
    gone: dict[str, float] = {}
    while True:
        now = time.monotonic() - told
        alive: set[str] = set()
        for p, name in tree.items():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.add(name)
            except psutil.Error:
                pass
        for name in set(tree.values()) - alive - set(gone):
            gone[name] = now
        if not alive:
            break
        if now > 120:
            raise RuntimeError(f"still running 120 s after SIGINT: {sorted(alive)}")
        time.sleep(POLL_S)
        up.poll()  # reap `up` itself once it exits
    return max(gone.values()), gone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--settle-s", type=float, default=3.0, help="idle seconds after the banner")
    parser.add_argument(
        "--batch-lines", type=int, default=0, help="stop mid-batch: a batch of this many long lines running"
    )
    parser.add_argument("--speedup", type=float, default=10.0, help="the simulated fleet's (1: long requests)")
    parser.add_argument("--verbose", action="store_true", help="print `up`'s record of each stop (logs/up.log)")
    args = parser.parse_args()
    totals: list[float] = []
    with tempfile.TemporaryDirectory(prefix="up-stop-") as tmp:
        for i in range(args.runs):
            total, gone = one_run(Path(tmp) / f"home{i}", args.settle_s, args.batch_lines, args.speedup)
            totals.append(total)
            parts = "  ".join(f"{name} {t:.2f}" for name, t in sorted(gone.items(), key=lambda kv: kv[1]))
            print(f"run {i + 1}: all gone {total:.2f} s after SIGINT   ({parts})", flush=True)
            if args.verbose:  # `up`'s own record of its stop
                up_log = Path(tmp) / f"home{i}" / "logs" / "up.log"
                for line in up_log.read_text().splitlines() if up_log.exists() else []:
                    print("    " + line)
    print(
        f"stop after one SIGINT, {args.runs} runs: min {min(totals):.2f} s, "
        f"median {statistics.median(totals):.2f} s, max {max(totals):.2f} s"
    )


if __name__ == "__main__":
    main()
