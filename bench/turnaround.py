"""Turnaround: how soon a small batch reaches the fleet, and how soon it is done after its last reply.

    .venv/bin/python -m bench.turnaround                        # both modes, 50 batches of 10 lines each
    .venv/bin/python -m bench.turnaround --mode up --batches 20

RL rollout submitters and eval sweeps send many small batches and wait for each, so the fixed
seconds between a batch's steps (validation picked up, a drain started, finalization started)
are most of their time. Each mode runs backfill against `devfleet.instant_fleet` (every request
answered at once) and sends `--batches` batches of `--lines` lines one after another, each
uploaded first and then created:

- `up`: `backfill up` on its embedded defaults (SQLite, a local object directory, Celery's
  filesystem broker), its fleet pointed at the instant fleet;
- `stack`: the production adapters (Postgres, Redis as broker and lease store, SeaweedFS),
  the API, worker and scheduler as separate processes (`devfleet.stack.launch_stack`).

Per batch, on one wall clock (the fleet is a thread of this process; the batch's timestamps are
read from its row): `create_to_first_request` (just before `batches.create` is sent to the
fleet's first request of the batch), `last_reply_to_completed` (the fleet's last answer to the
batch's `completed_at`) and `whole` (`batches.create` to `completed_at`). The breakdown shows
where the time goes: validation (create to `in_progress_at`), the drain's start (`in_progress_at`
to the first request) and finalization (last reply to `finalizing_at`, then to `completed_at`).
One `turnaround:` line per mode with the p50/p90 of each.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import sqlalchemy as sa

from backfill.devfleet.instant_fleet import InstantFleet
from backfill.devfleet.processes import free_port
from backfill.devfleet.stack import launch_stack

MODEL = "tiny-chat"
TAG = "turnaround-batch "
TERMINAL = ("completed", "failed", "expired", "cancelled")


class TimedFleet(InstantFleet):
    """The instant fleet, noting when each batch's first request came and its last answer left."""

    def __init__(self) -> None:
        super().__init__(model=MODEL)
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self._lock = threading.Lock()

    def _answer(self, method: bytes, path: bytes, body: bytes) -> tuple[int, bytes]:
        now = time.time()
        if method == b"POST":
            tag = _tag_of(body)
            if tag is not None:
                with self._lock:
                    self.first.setdefault(tag, now)
                    self.last[tag] = time.time()
        return super()._answer(method, path, body)


def _tag_of(body: bytes) -> str | None:
    try:
        content = json.loads(body)["messages"][0]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    if not isinstance(content, str) or not content.startswith(TAG):
        return None
    return content[len(TAG) :].split(" ", 1)[0]


@dataclass
class Timing:
    create_to_first: float
    last_to_completed: float
    whole: float
    validation: float  # create to in_progress_at
    drain_start: float  # in_progress_at to the first request
    to_finalizing: float  # the last reply to finalizing_at
    finalizing: float  # finalizing_at to completed_at


def write_lines(path: Path, tag: str, lines: int) -> None:
    with path.open("w") as f:
        for i in range(lines):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"{TAG}{tag} {i}"}], "max_tokens": 8}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
            f.write("\n")


def _epoch(value: datetime | str | None) -> float:
    if value is None:
        raise RuntimeError("the batch has no such timestamp")
    if isinstance(value, str):  # SQLite through a plain engine: the stored text
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        from datetime import UTC

        value = value.replace(tzinfo=UTC)
    return value.timestamp()


def run_batches(
    base_url: str, key: str, db_url: str, fleet: TimedFleet, *, batches: int, lines: int, warmup: int, workdir: Path
) -> list[Timing]:
    engine = sa.create_engine(db_url)
    headers = {"Authorization": f"Bearer {key}"}
    out: list[Timing] = []
    with httpx.Client(base_url=base_url, headers=headers, timeout=60) as http:
        for n in range(warmup + batches):
            tag = f"b{n}"
            path = workdir / f"{tag}.jsonl"
            write_lines(path, tag, lines)
            with path.open("rb") as f:
                uploaded = http.post("/files", files={"file": (path.name, f)}, data={"purpose": "batch"})
            uploaded.raise_for_status()
            created_at = time.time()
            r = http.post(
                "/batches",
                json={
                    "input_file_id": uploaded.json()["id"],
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                },
            )
            r.raise_for_status()
            batch_id = r.json()["id"].removeprefix("batch_")
            row = _wait_terminal(engine, batch_id, timeout_s=120)
            if row.status != "completed":
                raise RuntimeError(f"batch {batch_id} ended {row.status}")
            if n < warmup:
                continue
            first, last = fleet.first[tag], fleet.last[tag]
            if os.environ.get("TURNAROUND_TRACE"):
                print(f"{batch_id} created {created_at:.3f} first {first:.3f} last {last:.3f} row {tuple(row)}")
            in_progress, finalizing, completed = (
                _epoch(row.in_progress_at),
                _epoch(row.finalizing_at),
                _epoch(row.completed_at),
            )
            out.append(
                Timing(
                    create_to_first=first - created_at,
                    last_to_completed=completed - last,
                    whole=completed - created_at,
                    validation=in_progress - created_at,
                    drain_start=first - in_progress,
                    to_finalizing=finalizing - last,
                    finalizing=completed - finalizing,
                )
            )
    engine.dispose()
    return out


def _wait_terminal(engine: sa.Engine, batch_id: str, *, timeout_s: float) -> sa.Row[tuple[object, ...]]:
    query = sa.text(
        "SELECT status, in_progress_at, finalizing_at, completed_at FROM batches WHERE id = :id"
    ).bindparams(id=batch_id)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            row = conn.execute(query).one()
        if row.status in TERMINAL:
            return row
        time.sleep(0.01)
    raise RuntimeError(f"batch {batch_id} did not finish in {timeout_s:.0f} s")


def quantile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def report(mode: str, timings: list[Timing]) -> str:
    def pct(name: str) -> tuple[float, float]:
        values = [getattr(t, name) for t in timings]
        return quantile(values, 0.5), quantile(values, 0.9)

    print(f"\n{mode}: {len(timings)} batches; seconds, p50 / p90 / max")
    for name in Timing.__dataclass_fields__:
        values = [getattr(t, name) for t in timings]
        print(f"  {name:<20}{quantile(values, 0.5):>8.3f}{quantile(values, 0.9):>8.3f}{max(values):>8.3f}")
    (c50, c90), (l50, l90), (w50, w90) = pct("create_to_first"), pct("last_to_completed"), pct("whole")
    return (
        f"turnaround: mode={mode} batches={len(timings)} create_to_first_request_p50={c50:.3f} p90={c90:.3f} "
        f"last_reply_to_completed_p50={l50:.3f} p90={l90:.3f} whole_p50={w50:.3f} p90={w90:.3f}"
    )


def _wait_health(origin: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("`backfill up` exited:\n" + log.read_text(errors="replace")[-3000:])
        try:
            if httpx.get(f"{origin}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("`backfill up` did not come up:\n" + log.read_text(errors="replace")[-3000:])


@contextmanager
def backfill_up(workdir: Path, fleet_url: str, settings: dict[str, str]) -> Iterator[tuple[str, str, str]]:
    """`backfill up` on its embedded defaults with its own home; yields (base URL, key, database URL)."""
    home = workdir / "home"
    port = free_port()
    key = "sk-dev-turnaround-" + os.urandom(8).hex()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BACKFILL_")}
    env.update(
        {
            "BACKFILL_HOME": str(home),
            "BACKFILL_FLEET_URLS": fleet_url,
            "BACKFILL_BOOTSTRAP_API_KEY": key,
            "BACKFILL_CAPACITY_CONTROL": "off",
            "BACKFILL_RATE_LIMIT": "off",
            **settings,
        }
    )
    log = workdir / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "backfill", "up", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_health(f"http://127.0.0.1:{port}", proc, log)
        yield f"http://127.0.0.1:{port}/v1", key, f"sqlite:///{home / 'backfill.db'}"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_mode(mode: str, args: argparse.Namespace, settings: dict[str, str]) -> str:
    fleet = TimedFleet()
    with tempfile.TemporaryDirectory(prefix=f"turnaround-{mode}-") as tmp_s, fleet:
        tmp = Path(args.keep) / mode if args.keep else Path(tmp_s)
        tmp.mkdir(parents=True, exist_ok=True)
        if mode == "up":
            with backfill_up(tmp, fleet.base_url, settings) as (base_url, key, db_url):
                timings = run_batches(
                    base_url, key, db_url, fleet, batches=args.batches, lines=args.lines, warmup=2, workdir=tmp
                )
        else:
            with launch_stack(
                tmp / "stack",
                fleet_url=fleet.base_url,
                settings={"BACKFILL_CAPACITY_CONTROL": "off", **settings},
                name="turnaround",
            ) as stack:
                timings = run_batches(
                    stack.base_url,
                    stack.key,
                    stack.database_url,
                    fleet,
                    batches=args.batches,
                    lines=args.lines,
                    warmup=2,
                    workdir=tmp,
                )
        return report(mode, timings)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("up", "stack", "both"), default="both")
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--lines", type=int, default=10)
    ap.add_argument(
        "--setting", action="append", default=[], metavar="NAME=VALUE", help="a BACKFILL_ setting for every process"
    )
    ap.add_argument("--keep", metavar="DIR", help="work (homes, logs) in DIR and leave it there")
    args = ap.parse_args()
    settings = dict(item.split("=", 1) for item in args.setting)

    def _stop(*_: object) -> None:
        raise KeyboardInterrupt  # so the context managers stop every process this run started

    signal.signal(signal.SIGTERM, _stop)
    modes = ("up", "stack") if args.mode == "both" else (args.mode,)
    lines = [run_mode(mode, args, settings) for mode in modes]
    print()
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
