"""The `backfill` command: `up` (everything, embedded defaults), `api`, `worker`, `scheduler`, `migrate`."""

from __future__ import annotations

import gc
import logging
import os
import signal
from pathlib import Path
from typing import Annotated

import typer

from backfill.admin_cli import keys_app, prices_app, quotas_app, teams_app, usage
from backfill.batch_cli import batch_app

app = typer.Typer(help="backfill: OpenAI-compatible batch inference on a fleet's idle capacity.", no_args_is_help=True)
app.add_typer(teams_app, name="teams")
app.add_typer(keys_app, name="keys")
app.add_typer(prices_app, name="prices")
app.add_typer(quotas_app, name="quotas")
app.command("usage")(usage)
app.add_typer(batch_app, name="batch")


def _logging() -> None:
    logging.basicConfig(
        level=os.environ.get("BACKFILL_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every request at INFO: the capacity controller scrapes the fleet several times a second.
    logging.getLogger("httpx").setLevel(logging.WARNING)


@app.command()
def migrate() -> None:
    """Apply database migrations (idempotent)."""
    from backfill.migrate import upgrade

    upgrade()
    typer.echo("database is at the latest revision")


@app.command()
def api(
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8080,
    workers: Annotated[int, typer.Option(help="Uvicorn worker processes.")] = 1,
) -> None:
    """Serve the OpenAI Files and Batches API."""
    import uvicorn

    from backfill.storage.settings import get_settings

    _logging()
    # Behind a proxy every client would otherwise share the proxy's address (one sender's bad
    # keys would hold all of them back): trust the configured proxies' X-Forwarded-For.
    trusted_proxies = get_settings().forwarded_allow_ips.strip() or None
    # A factory: each worker process builds its own app; start-up runs in the app's lifespan.
    uvicorn.run(
        "backfill.api.app:create_app",
        factory=True,
        lifespan="on",
        host=host,
        port=port,
        workers=workers,
        log_level="info",
        access_log=False,
        proxy_headers=True,
        forwarded_allow_ips=trusted_proxies,
    )


@app.command()
def worker(
    concurrency: Annotated[int, typer.Option(help="Worker processes (drains + validation + finalization).")] = 0,
) -> None:
    """Run a Celery worker: validation, drains onto the fleet, finalization."""
    import backfill.scheduler.tasks  # noqa: F401  (registers the task bodies on the broker's app)
    from backfill.storage.broker import QueueName, get_celery_app
    from backfill.storage.objects import preload_s3_client
    from backfill.storage.settings import get_settings
    from backfill.worker_watchdog import install, kill_children, leave

    _logging()  # backfill's own loggers (validation, finalization, drains): Celery leaves the root logger alone
    s = get_settings()
    n = concurrency or s.drains + 2
    queues = ",".join(q.value for q in QueueName)
    install(s.drain_grace_s)  # told to stop, it is gone within the grace (plus a margin)
    # What every pool child would load again on its first task, loaded once here before the
    # pool forks: boto3 and the S3 client's descriptions (`storage.objects.preload_s3_client`).
    preload_s3_client()
    # Then what this process holds so far goes to the garbage collector's permanent generation,
    # which the children inherit: their full collections no longer walk the ~160K objects of
    # the imported modules (and leave those pages shared with this process).
    gc.collect()
    gc.freeze()
    code = 1
    try:
        get_celery_app().worker_main(
            [
                "worker",
                "--loglevel=INFO",
                f"--concurrency={n}",
                f"--queues={queues}",
                "--without-gossip",
                "--without-mingle",
            ]
        )
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        kill_children()  # a pool child left behind has nothing more to do
        leave(code)  # no interpreter finalizers: billiard's can deadlock on a dead pool


@app.command()
def scheduler(
    alive_file: Annotated[
        Path | None, typer.Option(help="Touched while the loop makes progress, for `backfill scheduler-alive`.")
    ] = None,
) -> None:
    """Run the scheduler loop (expiry, cancellation, reclaim, finalization, drains) and, with
    BACKFILL_CAPACITY_CONTROL on, the capacity controller that publishes the lease limit. Run
    two or more for a standby: one replica leads (a leader lease), the others wait to take over."""
    from backfill.scheduler.runtime import run_scheduler
    from backfill.storage.settings import get_settings

    _logging()
    stopping = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stopping.update(flag=True))
    try:
        run_scheduler(get_settings(), stop=lambda: stopping["flag"], alive_file=alive_file)
    except KeyboardInterrupt:
        pass
    # Its lease released and every tick's work committed: no interpreter finalizers (tearing down
    # the loaded modules took 1-2 s of a loaded 2-core machine, most of a stop's time).
    from backfill.worker_watchdog import leave

    leave(0)


@app.command()
def simulate(
    trace: Annotated[Path, typer.Option(help="Interactive trace (JSON; see docs/simulator.md).")],
    fleet: Annotated[
        str, typer.Option(help="Fleet file (JSON) or a bundled one: mocker-disagg, mocker-agg, gb200-glm53.")
    ],
    policy: Annotated[str, typer.Option(help="controller, none, or a fixed limit: static:16.")] = "controller",
    kv_bytes_per_token: Annotated[int | None, typer.Option(help="KV row size: 576 FP8, 352 NVFP4.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the batch lines.")] = 0,
) -> None:
    """What backfill would harvest on a fleet under an interactive trace, on a virtual clock."""
    import json

    from backfill.sim.control import Policy
    from backfill.sim.control import simulate as run
    from backfill.sim.engine import FleetSpec
    from backfill.sim.workload import Trace

    spec = FleetSpec.load(fleet, kv_bytes_per_token=kv_bytes_per_token)
    kind, _, limit = policy.partition(":")
    result = run(spec, Trace.load(trace), Policy(kind, limit=int(limit or 0)), seed=seed)
    typer.echo(json.dumps(result, indent=1))


@app.command("scheduler-alive")
def scheduler_alive(
    alive_file: Annotated[Path, typer.Argument(help="The scheduler's --alive-file.")],
    within_s: Annotated[float, typer.Option(help="Most seconds since the scheduler last made progress.")] = 60.0,
) -> None:
    """Exit 0 if the scheduler made progress within `--within-s` seconds (a liveness probe): a
    leader stuck in a step, or a standby stuck polling, stops touching its file."""
    from backfill.scheduler.leadership import AliveFile

    try:
        age_s = AliveFile.age_s(alive_file)
    except FileNotFoundError:
        age_s = float("inf")
    if age_s > within_s:
        typer.echo(f"the scheduler made no progress for {age_s:.0f} s", err=True)
        raise typer.Exit(1)


@app.command()
def up(
    port: Annotated[int, typer.Option(help="API port.")] = 8080,
    fleet_workers: Annotated[int, typer.Option(help="Simulated fleet: mocker workers.")] = 2,
    speedup: Annotated[float, typer.Option(help="Simulated fleet: speedup ratio of the mocker.")] = 10.0,
) -> None:
    """Run API + worker + scheduler together; on embedded defaults when nothing is configured
    (SQLite, a local object directory, a file broker, and the simulated Dynamo fleet). Prints the
    URL, key, model and fleet, then a line per batch event; all state stays in BACKFILL_HOME."""
    from backfill.up import run_up

    run_up(port=port, fleet_workers=fleet_workers, speedup=speedup)


def main() -> None:
    app()
