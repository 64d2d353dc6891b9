"""Scale: one large batch through backfill's real processes on the production adapters.

Postgres, Redis (broker + leases), SeaweedFS (S3) and the Dynamo frontend + mocker fleet at
speedup 0 (no simulated delay, so the fleet costs only CPU). One file is uploaded, validated,
run, finalized and downloaded; each phase is timed from the client's side. Every backfill
process (API, worker and its pool children, scheduler) is sampled for RSS and CPU time.

    .venv/bin/python -m bench.scale                                   # 200 MB, 50,000 lines
    .venv/bin/python -m bench.scale --lines 1000000 --line-bytes 200 --window 60s

With a window shorter than the run needs, the batch expires: its unfinished lines become
`batch_expired` error lines, so finalization and download still cover every line (the way to
measure a 1,000,000-line file on a machine whose fleet stand-in runs ~100 requests/s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import psycopg

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/8")
MODEL = "tiny-chat"
MB = 1024 * 1024
TERMINAL = ("completed", "failed", "expired", "cancelled")


def write_input(path: Path, lines: int, line_bytes: int) -> int:
    """JSONL of chat requests, each padded to about `line_bytes` (distinct prompts: no shared prefix)."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
    with path.open("wb") as f:
        for i in range(lines):
            head = {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": ""}]},
            }
            base = len(json.dumps(head)) + 1
            text = f"item {i}: "
            k = i
            while len(text) < line_bytes - base:
                text += words[k % len(words)] + " "
                k = k * 7 + 3
            head["body"]["messages"][0]["content"] = text[: max(8, line_bytes - base)]  # type: ignore[index]
            f.write(json.dumps(head).encode() + b"\n")
    return path.stat().st_size


@dataclass
class ProcessSampler:
    """Peak RSS and CPU seconds of process groups (a root and all its descendants), sampled."""

    roots: dict[str, int]
    peak_rss: dict[str, int] = field(default_factory=dict)
    loads: list[float] = field(default_factory=list)  # the machine's 1-minute load average, per sample
    # Peak RSS over the samples taken while `finalizing` is set (run_batch sets it while the batch
    # is finalizing): whose memory finalization itself raises.
    finalizing: bool = False
    peak_rss_finalizing: dict[str, int] = field(default_factory=dict)
    cpu: dict[int, float] = field(default_factory=dict)  # pid -> last seen user+system seconds
    # Who used the CPU while the batch finalized: every process on the machine, by group
    # (`machine_cpu`), between the polls that saw `finalizing` start and end.
    database: str = ""
    finalizing_cpu: dict[str, float] = field(default_factory=dict)
    _finalizing_from: dict[int, tuple[str, float]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def set_finalizing(self, finalizing: bool) -> None:
        if finalizing and not self.finalizing:
            self._finalizing_from = machine_cpu(self.roots, self.database)
        elif self.finalizing and not finalizing:
            for pid, (group, seconds) in machine_cpu(self.roots, self.database).items():
                _, before = self._finalizing_from.get(pid, (group, 0.0))
                self.finalizing_cpu[group] = self.finalizing_cpu.get(group, 0.0) + seconds - before
        self.finalizing = finalizing

    def sample(self) -> None:
        self.loads.append(os.getloadavg()[0])
        for name, pid in self.roots.items():
            try:
                root = psutil.Process(pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for p in procs:
                try:
                    rss = p.memory_info().rss
                    t = p.cpu_times()
                except psutil.Error:
                    continue
                key = f"{name}:{p.pid}"
                self.peak_rss[key] = max(self.peak_rss.get(key, 0), rss)
                if self.finalizing:
                    self.peak_rss_finalizing[key] = max(self.peak_rss_finalizing.get(key, 0), rss)
                self.cpu[p.pid] = max(self.cpu.get(p.pid, 0.0), t.user + t.system)

    def run(self) -> None:
        while not self._stop.wait(0.25):
            self.sample()

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()
        self.sample()

    def cpu_total(self) -> float:
        return sum(self.cpu.values())


def machine_cpu(roots: dict[str, int], database: str) -> dict[int, tuple[str, float]]:
    """Every process on the machine: pid -> (its group, user+system seconds so far). Groups: each
    backfill process with its children (by root name), this database's Postgres backends, the
    rest of Postgres, the S3 server, the fleet, this benchmark, and everything else (other work
    on a shared machine)."""
    groups: dict[int, str] = {}
    for name, pid in roots.items():
        try:
            root = psutil.Process(pid)
            groups |= {p.pid: name for p in (root, *root.children(recursive=True))}
        except psutil.Error:
            continue
    seen: dict[int, tuple[str, float]] = {}
    for p in psutil.process_iter(["name", "cmdline", "cpu_times"]):
        times, cmdline = p.info["cpu_times"], " ".join(p.info["cmdline"] or ())
        if times is None:
            continue
        if p.pid in groups:
            group = groups[p.pid]
        elif p.pid == os.getpid():
            group = "this benchmark"
        elif p.info["name"] == "postgres" or cmdline.startswith("postgres"):
            group = "postgres (this database)" if database and f" {database} " in cmdline else "postgres (rest)"
        elif "weed" in (p.info["name"] or ""):
            group = "S3 server"
        elif "dynamo" in cmdline or "mocker" in cmdline:
            group = "fleet"
        else:
            group = "other"
        seen[p.pid] = (group, times.user + times.system)
    return seen


def db_footprint(pg_url: str) -> list[tuple[str, int, int]]:

    url = pg_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ANALYZE")
        rows = conn.execute(
            "SELECT relname, n_live_tup, pg_total_relation_size(relid) FROM pg_stat_user_tables ORDER BY 3 DESC"
        ).fetchall()
    return [(str(r[0]), int(r[1]), int(r[2])) for r in rows]


def run_batch(
    base_url: str, key: str, path: Path, window: str, out_dir: Path, db_url: str, sampler: ProcessSampler
) -> dict[str, float]:
    """Upload, create, wait, download. The phases are timed from the batch's status changes as
    the database records them (polled every 10 ms, less often during a long finalization: a 9 MB
    finalization takes a fifth of a second, which the API polling a client does, every 0.2 s,
    cannot resolve)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=key, timeout=600, max_retries=2)
    t: dict[str, float] = {}
    start = time.perf_counter()
    with path.open("rb") as f:
        uploaded = client.files.create(file=(path.name, f), purpose="batch")
    t["upload"] = time.perf_counter() - start

    start = time.perf_counter()
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window=window)  # type: ignore[arg-type]  # backfill takes windows past OpenAI's one
    seen: dict[str, float] = {"validating": start}
    with psycopg.connect(db_url.replace("+psycopg", ""), autocommit=True) as conn:
        status = "validating"
        while status not in TERMINAL:
            # Every 10 ms; while finalizing, every 1/200 of the time it has taken so far (10-50 ms:
            # its end is seen at most 0.5% late). Polling costs CPU the finalization shares: every
            # 10 ms it was 0.5 s of this process's CPU during a 6.8 s finalization.
            finalizing = time.perf_counter() - seen[status] if status == "finalizing" else 0.0
            time.sleep(min(0.05, max(0.01, finalizing / 200)))
            row = conn.execute(
                "SELECT status, unindexed, total FROM batches WHERE id = %s", (batch.id.removeprefix("batch_"),)
            ).fetchone()
            status = str(row[0]) if row else status
            seen.setdefault(status, time.perf_counter())
            sampler.set_finalizing(status == "finalizing")
            if row and row[2] and row[1] == 0:  # the last part of the request index is in
                seen.setdefault("indexed", time.perf_counter())
    end = seen[status]
    batch = client.batches.retrieve(batch.id)
    seen.setdefault("finalizing", end)
    run_start = seen.get("in_progress", seen["finalizing"])
    t["validate"] = run_start - start
    t["run"] = seen["finalizing"] - run_start
    t["finalize"] = end - seen["finalizing"]
    # Validation writes the rest of a large index while the batch already runs.
    t["index"] = seen.get("indexed", end) - run_start
    if batch.status not in ("completed", "expired"):
        raise RuntimeError(f"batch ended {batch.status}: {batch.errors}")
    counts = batch.request_counts
    print(f"batch {batch.status}: {counts}")

    start = time.perf_counter()
    out_bytes = 0
    lines = 0
    for kind, file_id in (("output", batch.output_file_id), ("error", batch.error_file_id)):
        if not file_id:
            continue
        target = out_dir / f"{kind}.jsonl"
        with client.files.with_streaming_response.content(file_id) as response:
            response.stream_to_file(target)
        out_bytes += target.stat().st_size
        with target.open("rb") as fh:
            lines += sum(1 for _ in fh)
    t["download"] = time.perf_counter() - start
    t["result_bytes"] = out_bytes
    t["result_lines"] = lines
    t["succeeded"] = counts.completed if counts else 0
    return t


async def direct(fleet_url: str, path: Path, n: int, concurrency: int) -> int:
    """The baseline client: the same bodies posted straight to the fleet."""
    import httpx

    bodies = []
    with path.open("rb") as f:
        for _, raw in zip(range(n), f, strict=False):
            bodies.append(json.loads(raw)["body"])
    sem = asyncio.Semaphore(concurrency)
    ok = 0
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as client:

        async def one(body: dict[str, object]) -> None:
            nonlocal ok
            async with sem:
                r = await client.post(f"{fleet_url}/chat/completions", json=body)
                ok += r.status_code == 200

        await asyncio.gather(*(one(b) for b in bodies))
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=50_000)
    ap.add_argument("--line-bytes", type=int, default=4_000)
    ap.add_argument("--window", default="24h", help="completion window (a short one makes the batch expire)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--direct-lines", type=int, default=5_000, help="lines the direct client sends for its CPU figure")
    args = ap.parse_args()

    def _stop(*_: object) -> None:
        raise KeyboardInterrupt  # so the finally blocks stop every process this run started

    signal.signal(signal.SIGTERM, _stop)

    from backfill.devfleet.stack import launch_stack

    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        path = tmp / "scale.jsonl"
        size = write_input(path, args.lines, args.line_bytes)
        print(f"input: {args.lines} lines, {size / MB:.1f} MB")
        settings = {
            "BACKFILL_MAX_INFLIGHT": str(args.concurrency),
            # A fixed bound: this measures backfill's own machinery, not the controller.
            "BACKFILL_CAPACITY_CONTROL": "off",
            "BACKFILL_MAX_FILE_BYTES": str(size + MB),
            "BACKFILL_MAX_REQUESTS_PER_BATCH": str(max(args.lines, 50_000)),
            "BACKFILL_COMPLETION_WINDOWS": args.window,
            "BACKFILL_LOG_LEVEL": "WARNING",
        }
        with launch_stack(
            tmp / "stack",
            settings=settings,
            processes=("api", "scheduler"),
            fleet_speedup=0.0,
            model=MODEL,
            name="scale",
            redis_url=REDIS_URL,
            flush=True,
        ) as stack:
            # The worker at INFO: its validation and finalization lines say where the time went.
            stack.start("worker", extra_env={"BACKFILL_LOG_LEVEL": "INFO"})
            sampler = ProcessSampler({name: p.pid for name, p in stack.procs.items()})
            sampler.database = stack.database_url.split("?")[0].rsplit("/", 1)[-1]
            sampler.sample()
            cpu_before = sampler.cpu_total()
            sampler.start()
            phases = run_batch(stack.base_url, stack.key, path, args.window, tmp, stack.database_url, sampler)
            sampler.stop()
            backfill_cpu = sampler.cpu_total() - cpu_before
            footprint = db_footprint(stack.database_url)
            phase_lines = [
                line.split(" ", 3)[-1]
                for line in stack.log("worker").splitlines()
                if "backfill.validation" in line
                or "backfill.finalization" in line
                or "backfill.tasks: validation of" in line
            ]
            stack.stop()  # the direct client's CPU figure comes with backfill's processes gone

            n_direct = min(args.direct_lines, args.lines)
            cpu0 = time.process_time()
            ok = asyncio.run(direct(stack.fleet_url, path, n_direct, args.concurrency))
            direct_cpu = time.process_time() - cpu0

    assert phases["result_lines"] == args.lines, (phases["result_lines"], args.lines)
    executed = max(int(phases["succeeded"]), 1)
    print(f"\n{'phase':<10}{'seconds':>10}{'MB/s':>10}")
    for name, mb in (
        ("upload", size / MB),
        ("validate", size / MB),
        ("run", None),
        ("index", None),
        ("finalize", phases["result_bytes"] / MB),
        ("download", phases["result_bytes"] / MB),
    ):
        rate = f"{mb / phases[name]:>10.1f}" if mb is not None and phases[name] > 0 else f"{'':>10}"
        print(f"{name:<10}{phases[name]:>10.1f}{rate}")
    print("(index: the rest of the request index, written while the batch runs: part of run)")
    print("\nthe worker's own account:", *phase_lines, sep="\n  ")
    print(f"\nexecuted {executed} of {args.lines} lines; result files {phases['result_bytes'] / MB:.1f} MB")
    print(f"\n{'process':<22}{'peak RSS MB':>12}")
    for name, rss in sorted(sampler.peak_rss.items(), key=lambda kv: -kv[1]):
        print(f"{name:<22}{rss / MB:>12.1f}")
    finalizing = sorted(sampler.peak_rss_finalizing.items(), key=lambda kv: -kv[1])
    if finalizing:
        print("while finalizing: " + ", ".join(f"{name} {rss / MB:.1f}" for name, rss in finalizing[:3]))
    if sampler.finalizing_cpu:
        print(
            f"CPU seconds while finalizing ({phases['finalize']:.1f} s on {os.cpu_count()} CPUs): "
            + ", ".join(
                f"{g} {c:.2f}" for g, c in sorted(sampler.finalizing_cpu.items(), key=lambda kv: -kv[1]) if c >= 0.01
            )
        )
    print(f"\n{'table':<24}{'rows':>12}{'MB':>10}")
    for table, rows, nbytes in footprint:
        print(f"{table:<24}{rows:>12}{nbytes / MB:>10.1f}")
    cpu_ms = backfill_cpu * 1000 / executed
    direct_ms = direct_cpu * 1000 / max(ok, 1)
    print(
        f"\nCPU: backfill processes {backfill_cpu:.1f} s for {executed} executed requests; "
        f"direct client {direct_cpu:.1f} s for {ok}"
    )
    loads = sampler.loads
    print(
        f"load average (1 min) while backfill ran: start {loads[0]:.1f}, mean {sum(loads) / len(loads):.1f}, "
        f"max {max(loads):.1f} ({os.cpu_count()} CPUs; other work on the machine counts too)"
    )
    peak = max(sampler.peak_rss.values()) / MB
    print(
        f"scale: upload_mb_s={size / MB / phases['upload']:.1f} validate_mb_s={size / MB / max(phases['validate'], 1e-9):.1f} "
        f"finalize_mb_s={phases['result_bytes'] / MB / max(phases['finalize'], 1e-9):.1f} peak_rss_mb={peak:.0f} "
        f"finalizing_peak_rss_mb={max(sampler.peak_rss_finalizing.values(), default=0) / MB:.0f} "
        f"cpu_ms_per_request={cpu_ms:.2f} direct_cpu_ms_per_request={direct_ms:.2f}"
    )


if __name__ == "__main__":
    main()
