"""Why the engine idles: one backfill run against vLLM on CPU, watched from every side, plotted.

The engine (`vllm serve`, the tiny model, as `bench.runbatch` runs it) on the first cores, the
stack (API, worker, scheduler on Postgres, a private Redis and SeaweedFS) and this client on the
others (`--pin`), the capacity controller off and a fixed limit L (`BACKFILL_MAX_INFLIGHT`).
While one batch of N lines runs, every `--every` seconds:

- leases held (the lease store's count of the fleet pool);
- requests in flight at the fleet client, lines claimed, the drain's event-loop lag (probes
  wrapped around the drain's calls: `bench/idle_probe/sitecustomize.py`);
- the engine's running and waiting requests (`vllm:num_requests_running` / `_waiting`);
- each process's CPU (the engine's processes, backfill's API, worker (with its pool) and
  scheduler, Redis, SeaweedFS, and every Postgres backend together: the server is shared).

    .venv/bin/python -m bench.idle_engine --lines 3000 --limit 128 --pin 0:1 --png docs/idle-engine.png

Last line: `idle: L=.. lines=.. seconds=.. engine_running_mean=.. leases_mean=.. calls_mean=..`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.engine_gauge import parse_cores, pinned, read_gauge
from bench.runbatch import make_lines, through_backfill, token_range

PROBE_DIR = Path(__file__).parent / "idle_probe"


@dataclass
class Samples:
    t: list[float] = field(default_factory=list)
    series: dict[str, list[float]] = field(default_factory=dict)

    def add(self, t: float, **values: float) -> None:
        self.t.append(t)
        for k, v in values.items():
            self.series.setdefault(k, [0.0] * (len(self.t) - 1)).append(v)
        for vs in self.series.values():
            if len(vs) < len(self.t):
                vs.append(0.0)


def _probe_values(metrics_dir: Path) -> dict[str, float]:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(metrics_dir))  # type: ignore[no-untyped-call]
    out: dict[str, float] = {}
    for metric in registry.collect():
        for s in metric.samples:
            if s.name.startswith("bench_drain_") and not s.name.endswith("_created"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


class Watch:
    """Samples every side in a thread while the batch runs."""

    def __init__(self, *, engine_metrics: str, lease_count: Any, metrics_dir: Path, groups: dict[str, Any]) -> None:
        self.engine_metrics = engine_metrics
        self.lease_count = lease_count
        self.metrics_dir = metrics_dir
        self.groups = groups  # name -> callable giving the group's processes now
        self.samples = Samples()
        self._stop = threading.Event()
        self._cpu: dict[int, float] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watch:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _cpu_delta(self, procs: list[psutil.Process]) -> float:
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            now = t.user + t.system
            total += now - self._cpu.get(p.pid, now)
            self._cpu[p.pid] = now
        return total

    def _run(self, every_s: float = 0.5) -> None:
        last = time.monotonic()
        claimed_before = None
        while not self._stop.wait(every_s):
            now = time.monotonic()
            dt, last = now - last, now
            values: dict[str, float] = {
                "engine_running": read_gauge(self.engine_metrics) or 0.0,
                "engine_waiting": read_gauge(self.engine_metrics, "vllm:num_requests_waiting") or 0.0,
            }
            with contextlib.suppress(Exception):
                values["leases"] = float(self.lease_count())
            probe = _probe_values(self.metrics_dir)
            values["calls_in_flight"] = probe.get("bench_drain_fleet_calls_in_flight", 0.0)
            values["loop_lag_ms"] = 1000 * probe.get("bench_drain_loop_lag_seconds", 0.0)
            claimed = probe.get("bench_drain_claimed_lines_total", 0.0)
            values["claimed"] = claimed
            values["claims_per_s"] = 0.0 if claimed_before is None else (claimed - claimed_before) / dt
            claimed_before = claimed
            ours = 0.0
            for name, procs in self.groups.items():
                values[f"cpu_{name}"] = 100 * self._cpu_delta(procs()) / dt
                ours += values[f"cpu_{name}"]
            busy = psutil.cpu_times_percent(percpu=False)  # since the last call, the whole machine
            machine = (100 - busy.idle - busy.iowait) * (psutil.cpu_count() or 1)
            values["cpu_everything else"] = max(0.0, machine - ours)
            self.samples.add(now - self._t0, **values)


def _tree(pid: int) -> list[psutil.Process]:
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.Error:
        return []


def _is_core(p: psutil.Process) -> bool:
    """vLLM's engine core (the scheduler) or its worker (the model), not the API server."""
    try:
        title = p.name() + " " + " ".join(p.cmdline())
    except psutil.Error:
        return False
    return "EngineCore" in title or "VLLM::Worker" in title


def _hist_means(text: str, names: list[str]) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram in a Prometheus text page, over its label sets."""
    out: dict[str, tuple[float, float]] = {}
    for line in text.splitlines():
        for n in names:
            for part, i in (("_sum", 0), ("_count", 1)):
                if line.startswith(n + part) and line[len(n + part)] in " {":
                    acc = list(out.get(n, (0.0, 0.0)))
                    acc[i] += float(line.rsplit(" ", 1)[1])
                    out[n] = (acc[0], acc[1])
    return out


def _named(name: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["name"]) if (p.info["name"] or "").startswith(name)]


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def _client_latency(metrics_dir: Path) -> tuple[float, float]:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(metrics_dir))  # type: ignore[no-untyped-call]
    total = count = 0.0
    for metric in registry.collect():
        for x in metric.samples:
            if x.name == "backfill_fleet_request_duration_seconds_sum":
                total += x.value
            elif x.name == "backfill_fleet_request_duration_seconds_count":
                count += x.value
    return total, count


def busy_mean(values: list[float], busy: list[bool]) -> float:
    picked = [v for v, b in zip(values, busy, strict=True) if b]
    return sum(picked) / len(picked) if picked else 0.0


def plot(samples: Samples, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, t = samples.series, samples.t
    fig, axes = plt.subplots(4, 1, figsize=(11, 12), sharex=True)
    ax = axes[0]
    for k in ("leases", "calls_in_flight", "engine_running", "engine_waiting"):
        ax.plot(t, s.get(k, [0.0] * len(t)), label=k.replace("_", " "))
    ax.set_ylabel("requests")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(title, fontsize=10)
    axes[1].plot(t, s["claims_per_s"], color="tab:purple")
    axes[1].set_ylabel("lines claimed / s")
    axes[2].plot(t, s["loop_lag_ms"], color="tab:red")
    axes[2].set_ylabel("drain loop lag, ms\n(worst of 0.5 s)")
    ax = axes[3]
    for k in sorted(x for x in s if x.startswith("cpu_")):
        ax.plot(t, s[k], label=k.removeprefix("cpu_"))
    ax.set_ylabel("CPU, % of a core")
    ax.set_xlabel("seconds")
    ax.legend(loc="upper right", fontsize=8, ncol=3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=3000)
    ap.add_argument("--limit", type=int, nargs="+", default=[128], help="L: BACKFILL_MAX_INFLIGHT (one run each)")
    ap.add_argument("--max-tokens", type=token_range, default=(8, 8), help="a count or a range: 50-500")
    ap.add_argument("--pin", default="0:1", help="ENGINE:BACKFILL core lists ('' for none)")
    ap.add_argument("--setting", action="append", default=[], help="NAME=VALUE for backfill's processes")
    ap.add_argument("--png", type=Path, default=Path("bench/out/idle-engine.png"), help="-L<L> is added per run")
    args = ap.parse_args()
    engine_cores = backfill_cores = None
    if args.pin:
        engine_spec, _, backfill_spec = args.pin.partition(":")
        engine_cores, backfill_cores = parse_cores(engine_spec), parse_cores(backfill_spec)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = engine_spec

    from backfill.devfleet.vllm import VllmServer
    from backfill.devfleet.vllm_install import build_vllm_model, ensure_vllm_venv

    python = ensure_vllm_venv()
    build_vllm_model(python=python)
    server = VllmServer(startup_timeout_s=600)
    with contextlib.ExitStack() as serving:
        with pinned(engine_cores):
            serving.enter_context(server)
        serving.enter_context(pinned(backfill_cores))
        for limit in args.limit:
            run_one(server, limit, args)


def run_one(server: Any, limit: int, args: argparse.Namespace) -> None:
    import tempfile

    from backfill.devfleet.stack import launch_stack
    from backfill.devfleet.vllm_install import MODEL_NAME
    from backfill.storage.leases import RedisLeaseStore

    settings = {
        "BACKFILL_MAX_INFLIGHT": str(limit),
        "BACKFILL_MAX_REQUESTS_PER_BATCH": str(max(args.lines, 50)),
        "BACKFILL_MAX_FILE_BYTES": str(256 * 1024 * 1024),
        "BACKFILL_FLEET_PRIORITY_HINT": "none",
        "BACKFILL_CAPACITY_CONTROL": "off",
        "BACKFILL_LOG_LEVEL": "WARNING",
        "BACKFILL_BENCH_PROBE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(PROBE_DIR), os.environ.get("PYTHONPATH")])),
    }
    settings.update(dict(x.split("=", 1) for x in args.setting))
    png = args.png.with_name(f"{args.png.stem}-L{limit}{args.png.suffix}")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as held:
        stack = held.enter_context(
            launch_stack(Path(tmp) / "stack", settings=settings, fleet_url=server.base_url, name="idle")
        )
        through_backfill(stack.base_url, stack.key, make_lines(50, MODEL_NAME, args.max_tokens))  # warm-up
        leases = RedisLeaseStore(stack.redis_url)
        metrics_dir = Path(stack.env["BACKFILL_HOME"]) / "metrics"

        def engine_tree() -> list[psutil.Process]:
            return _tree(server.proc.pid) if server.proc is not None and server.proc.pid else []

        def tree_of(name: str) -> Callable[[], list[psutil.Process]]:
            return lambda: _tree(stack.procs[name].pid)

        groups: dict[str, Callable[[], list[psutil.Process]]] = {
            "vllm engine (core, worker)": lambda: [p for p in engine_tree() if _is_core(p)],
            "vllm api server": lambda: [p for p in engine_tree() if not _is_core(p)],
            "api": tree_of("api"),
            "worker": tree_of("worker"),
            "scheduler": tree_of("scheduler"),
            "postgres (all)": lambda: _named("postgres"),
            "redis": lambda: _named("redis-server"),
            "seaweedfs": lambda: _named("weed"),
        }
        watch = Watch(
            engine_metrics=server.metrics_url,
            lease_count=lambda: leases.count("fleet"),
            metrics_dir=metrics_dir,
            groups=groups,
        )
        vllm_names = [
            "vllm:e2e_request_latency_seconds",
            "vllm:request_queue_time_seconds",
            "vllm:request_inference_time_seconds",
        ]
        before = _hist_means(_get(server.metrics_url), vllm_names)
        claimed_at_start = _probe_values(metrics_dir).get("bench_drain_claimed_lines_total", 0.0)
        client_before = _client_latency(metrics_dir)
        psutil.cpu_times_percent(percpu=False)
        with watch:
            seconds, out = through_backfill(
                stack.base_url, stack.key, make_lines(args.lines, MODEL_NAME, args.max_tokens)
            )
        after = _hist_means(_get(server.metrics_url), vllm_names)
        client_after = _client_latency(metrics_dir)
    life = {}
    for n in vllm_names:
        d_sum, d_count = after[n][0] - before[n][0], after[n][1] - before[n][1]
        life[n.removeprefix("vllm:")] = d_sum / d_count if d_count else 0.0
    d_sum, d_count = client_after[0] - client_before[0], client_after[1] - client_before[1]
    life["fleet_client_request_seconds"] = d_sum / d_count if d_count else 0.0
    s = watch.samples.series
    busy = [r > 0 or c > 0 for r, c in zip(s["engine_running"], s["calls_in_flight"], strict=True)]
    summary = {k: busy_mean(v, busy) for k, v in s.items()}
    # The floor's window: while lines are still waiting to be claimed (the batch's tail, when
    # fewer than L lines are left, cannot fill the engine whatever the client does).
    waiting = [b and c < claimed_at_start + args.lines for b, c in zip(busy, s["claimed"], strict=True)]
    summary["engine_running_while_lines_wait"] = busy_mean(s["engine_running"], waiting)
    summary["calls_in_flight_while_lines_wait"] = busy_mean(s["calls_in_flight"], waiting)
    ok = sum(1 for x in out if (x.get("response") or {}).get("status_code") == 200)
    lo, hi = args.max_tokens
    tokens = f"{lo}" if lo == hi else f"{lo}-{hi}"
    title = (
        f"backfill -> vLLM on CPU, L={limit}, {args.lines} lines x {tokens} tokens, pin {args.pin or 'none'}:"
        f" {seconds:.0f} s, engine running {summary['engine_running']:.1f} (mean, busy)"
    )
    plot(watch.samples, png, title)
    record = {"limit": limit, "lines": args.lines, "max_tokens": args.max_tokens, "pin": args.pin}
    record |= {"settings": args.setting, "seconds": seconds, "ok": ok, "life": life, "summary": summary}
    png.with_suffix(".json").write_text(json.dumps(record | {"t": watch.samples.t, "series": s}))
    for k, v in sorted(summary.items()):
        print(f"  {k:<26} {v:8.1f}")
    print("  a request's life, mean s: " + ", ".join(f"{k}={v:.3f}" for k, v in life.items()))
    print(
        f"idle: L={limit} lines={args.lines} ok={ok} seconds={seconds:.1f} lines_s={args.lines / seconds:.1f}"
        f" engine_running_mean={summary['engine_running']:.1f}"
        f" engine_running_while_lines_wait={summary['engine_running_while_lines_wait']:.1f}"
        f" engine_waiting_mean={summary['engine_waiting']:.1f}"
        f" leases_mean={summary.get('leases', 0):.1f} calls_mean={summary['calls_in_flight']:.1f}"
        f" claims_per_s={summary['claims_per_s']:.1f} lag_ms_mean={summary['loop_lag_ms']:.1f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
