"""The `backfill` command: `up` (everything, embedded defaults), `api`, `worker`, `scheduler`, `migrate`."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
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

    _logging()
    # A factory: each worker process builds its own app; start-up runs in the app's lifespan.
    uvicorn.run(
        "api.app:create_app",
        factory=True,
        lifespan="on",
        host=host,
        port=port,
        workers=workers,
        log_level="info",
        access_log=False,
    )


@app.command()
def worker(
    concurrency: Annotated[int, typer.Option(help="Worker processes (drains + validation + finalization).")] = 0,
) -> None:
    """Run a Celery worker: validation, drains onto the fleet, finalization."""
    import scheduler.tasks  # noqa: F401  (registers the task bodies on the broker's app)
    from storage.broker import QueueName, celery_app
    from storage.settings import get_settings

    n = concurrency or get_settings().drains + 2
    queues = ",".join(q.value for q in QueueName)
    celery_app.worker_main(
        ["worker", "--loglevel=INFO", f"--concurrency={n}", f"--queues={queues}", "--without-gossip", "--without-mingle"]
    )


@app.command()
def scheduler() -> None:
    """Run the scheduler loop (expiry, cancellation, reclaim, finalization, drains) and, with
    BACKFILL_CAPACITY_CONTROL on, the capacity controller that publishes the lease limit."""
    from jobs.retention import RetentionPolicy
    from scheduler.leases import get_lease_store
    from scheduler.ticker import Ticker
    from storage.broker import send_task
    from storage.settings import get_settings

    _logging()
    s = get_settings()
    stopping = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stopping.update(flag=True))
    ticker = Ticker(
        leases=get_lease_store(),
        enqueue=send_task,
        drains=s.drains,
        retention_policy=RetentionPolicy(
            orphan_grace_s=s.orphan_grace_s, result_body_grace_s=s.result_body_retention_s
        ),
        retention_interval_s=s.retention_interval_s,
    )
    # The capacity controller beside the ticker: if this process dies, the limit it published
    # lapses and admission falls back to the floor (fail closed).
    control_stop = threading.Event()
    control: threading.Thread | None = None
    if s.capacity_control:
        from scheduler.runtime import make_capacity_loop

        loop = make_capacity_loop(s)
        control = threading.Thread(target=loop.run, args=(control_stop,), name="capacity", daemon=True)
        control.start()
    try:
        ticker.run_forever(s.tick_interval_s, stop=lambda: stopping["flag"])
    except KeyboardInterrupt:
        pass
    finally:
        control_stop.set()
        if control is not None:
            control.join(timeout=5)


def _bootstrap_key(home: Path) -> str:
    path = home / "bootstrap_key"
    if path.exists():
        return path.read_text().strip()
    key = "sk-dev-" + secrets.token_urlsafe(24)
    home.mkdir(parents=True, exist_ok=True)
    path.write_text(key + "\n")
    path.chmod(0o600)
    return key


@app.command()
def up(
    port: Annotated[int, typer.Option(help="API port.")] = 8080,
    fleet_workers: Annotated[int, typer.Option(help="Simulated fleet: mocker workers.")] = 2,
    speedup: Annotated[float, typer.Option(help="Simulated fleet: speedup ratio of the mocker.")] = 10.0,
) -> None:
    """Run API + worker + scheduler together; on embedded defaults when nothing is configured
    (SQLite, a local object directory, a file broker, and the simulated Dynamo fleet)."""
    from storage.settings import get_settings

    _logging()

    def _interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)  # a plain `kill` stops the fleet too
    s = get_settings()
    env = dict(os.environ)
    env.setdefault("BACKFILL_HOME", str(s.home))
    # The embedded mode is a development setup: its generated key starts with sk-dev.
    env.setdefault("BACKFILL_ENVIRONMENT", "development")
    fleet = None
    if not s.fleet_url_list:
        from devfleet.fleet import Fleet

        typer.echo("starting the simulated fleet (Dynamo frontend + mocker); the first run installs it…")
        fleet = Fleet(model_name="tiny-chat", num_workers=fleet_workers, speedup_ratio=speedup)
        fleet.start()
        env["BACKFILL_FLEET_URLS"] = fleet.base_url
        # The simulated fleet's own telemetry, so the capacity controller runs against it as it
        # would against a production fleet (BACKFILL_CAPACITY_CONTROL=false turns it off).
        env.setdefault("BACKFILL_CAPACITY_CONTROL", "true")
        env.setdefault(
            "BACKFILL_FLEET_METRICS_URLS",
            ",".join([f"frontend={fleet.frontend_metrics_url}", *(f"{w.role}={w.url}" for w in fleet.worker_metrics_urls)]),
        )
    if not s.bootstrap_api_key:
        env["BACKFILL_BOOTSTRAP_API_KEY"] = _bootstrap_key(s.home)
    key = env.get("BACKFILL_BOOTSTRAP_API_KEY", "")

    procs: list[subprocess.Popen[bytes]] = []
    exe = [sys.executable, "-m", "backfill"]
    try:
        subprocess.run([*exe, "migrate"], env=env, check=True)
        procs.append(subprocess.Popen([*exe, "worker"], env=env))
        procs.append(subprocess.Popen([*exe, "scheduler"], env=env))
        procs.append(subprocess.Popen([*exe, "api", "--port", str(port)], env=env))
        base = f"http://127.0.0.1:{port}/v1"
        _wait_http(f"http://127.0.0.1:{port}/health", procs)
        typer.secho("\nbackfill is up", fg=typer.colors.GREEN, bold=True)
        typer.echo(f"  base URL : {base}")
        typer.echo(f"  API key  : {key}")
        typer.echo(f"  fleet    : {env.get('BACKFILL_FLEET_URLS')}")
        typer.echo(
            f'  try      : OPENAI_BASE_URL={base} OPENAI_API_KEY={key} python -c "import openai; print(openai.OpenAI().models.list())"'
        )
        typer.echo("Ctrl-C stops everything.\n")
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        typer.secho("a component exited; stopping", fg=typer.colors.RED)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        typer.echo("stopping…")
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        if fleet is not None:
            fleet.stop()


def _wait_http(url: str, procs: list[subprocess.Popen[bytes]], timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise typer.Exit(1)
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not come up in {timeout_s:.0f}s")


def main() -> None:
    app()
