"""`backfill up`: the API, a worker and the scheduler on one machine (and the simulated Dynamo
fleet when no fleet is configured), with a short status on the terminal: where to send requests,
the key, the model, the fleet, then a line per batch event.

Everything it keeps is under BACKFILL_HOME, nothing in the working directory: the SQLite
database, objects, broker folders, the generated key, the metrics files (emptied at each start:
the processes that wrote them are gone), the components' logs (`logs/api.log`, ...; the terminal
gets none of their lines, so nothing floods it) and the simulated fleet's run directory.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import httpx
import typer

COMPONENTS = ("worker", "scheduler", "api")
STOP_GRACE_S = 30.0  # longer than a drain's shutdown grace (BACKFILL_DRAIN_GRACE_S, 20 s)
POLL_S = 1.0
LOG_TAIL_LINES = 25


def bootstrap_key(home: Path) -> str:
    path = home / "bootstrap_key"
    if path.exists():
        return path.read_text().strip()
    key = "sk-dev-" + secrets.token_urlsafe(24)
    home.mkdir(parents=True, exist_ok=True)
    path.write_text(key + "\n")
    path.chmod(0o600)
    return key


def _fleet_install_outside_cwd(home: Path, env: dict[str, str]) -> None:
    """The fleet's virtualenv and model live in the repository's `.fleet/` in a checkout; an
    installed copy would put them in the working directory, so there they go under the home."""
    if "BACKFILL_FLEET_HOME" in os.environ:
        return
    from backfill.devfleet import install

    package_root = Path(install.__file__).resolve().parent.parent
    if not ((package_root / "pyproject.toml").exists() or (package_root / ".git").exists()):
        os.environ["BACKFILL_FLEET_HOME"] = env["BACKFILL_FLEET_HOME"] = str(home / "fleet-install")


def _start_fleet(home: Path, *, workers: int, speedup: float) -> Any:
    from backfill.devfleet.fleet import Fleet
    from backfill.devfleet.reaper import PIDS_FILE, reap_stale_fleets

    run_dir = home / "fleet"
    reap_stale_fleets(home)  # a fleet whose `up` was killed: its processes go first
    if (run_dir / PIDS_FILE).exists():
        typer.secho(f"another `backfill up` runs with BACKFILL_HOME={home}", fg=typer.colors.RED)
        raise typer.Exit(1)
    shutil.rmtree(run_dir, ignore_errors=True)  # no stale discovery entries from a previous run
    fleet = Fleet(
        model_name="tiny-chat", num_workers=workers, speedup_ratio=speedup, run_dir=run_dir, die_with_parent=True
    )
    fleet.start()
    return fleet


@contextmanager
def _components(env: dict[str, str], logs: Path, port: int) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    exe = [sys.executable, "-m", "backfill"]
    args = {"worker": ["worker"], "scheduler": ["scheduler"], "api": ["api", "--port", str(port)]}
    files: list[IO[bytes]] = []
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        with (logs / "migrate.log").open("wb") as out:
            done = subprocess.run([*exe, "migrate"], env=env, stdout=out, stderr=subprocess.STDOUT)
        if done.returncode:
            _report_failure("migrate", logs)
            raise typer.Exit(1)
        for name in COMPONENTS:
            files.append((logs / f"{name}.log").open("wb"))
            procs[name] = subprocess.Popen([*exe, *args[name]], env=env, stdout=files[-1], stderr=subprocess.STDOUT)
        yield procs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in files:
            f.close()


def _report_failure(name: str, logs: Path) -> None:
    path = logs / f"{name}.log"
    typer.secho(f"{name} exited; the end of {path}:", fg=typer.colors.RED)
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    for line in lines[-LOG_TAIL_LINES:]:
        typer.echo("  " + line)


def _first_dead(procs: dict[str, subprocess.Popen[bytes]]) -> str | None:
    return next((name for name, p in procs.items() if p.poll() is not None), None)


def _wait_ready(origin: str, procs: dict[str, subprocess.Popen[bytes]], logs: Path, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (dead := _first_dead(procs)) is not None:
            _report_failure(dead, logs)
            raise typer.Exit(1)
        try:
            if httpx.get(f"{origin}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    typer.secho(f"{origin} did not come up in {timeout_s:.0f} s (see {logs})", fg=typer.colors.RED)
    raise typer.Exit(1)


def _models(base: str, key: str) -> str:
    try:
        r = httpx.get(f"{base}/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        ids = [m["id"] for m in r.json()["data"]] if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        ids = []
    return ", ".join(ids) or "(the fleet lists none yet)"


def _banner(*, base: str, origin: str, key: str, fleet: str, home: Path, logs: Path) -> None:
    typer.secho("\nbackfill is up", fg=typer.colors.GREEN, bold=True)
    typer.echo(f"  base URL : {base}")
    typer.echo(f"  API key  : {key}")
    typer.echo(f"  model    : {_models(base, key)}")
    typer.echo(f"  fleet    : {fleet}")
    typer.echo(f"  metrics  : {origin}/metrics   ready: {origin}/ready")
    typer.echo(f"  state    : {home}   (logs in {logs})")
    typer.echo(
        f'  try      : OPENAI_BASE_URL={base} OPENAI_API_KEY={key} python -c "import openai; print(openai.OpenAI().models.list())"'
    )
    typer.echo("Ctrl-C stops everything. Batch events:\n")


def _watch(procs: dict[str, subprocess.Popen[bytes]], logs: Path) -> None:
    """Print batch events until a component exits (then say which, and why, from its log)."""
    from sqlalchemy.exc import SQLAlchemyError

    from backfill.storage.db import unit_of_work
    from backfill.up_status import BatchEvents

    events = BatchEvents()
    warned = False
    while (dead := _first_dead(procs)) is None:
        try:
            with unit_of_work() as session:
                for event in events.poll(session):
                    typer.echo(event.line())
        except SQLAlchemyError as exc:
            if not warned:  # e.g. the database locked for a moment: the next poll catches up
                typer.secho(f"(could not read batch events: {type(exc).__name__})", fg=typer.colors.YELLOW)
                warned = True
        time.sleep(POLL_S)
    _report_failure(dead, logs)
    raise typer.Exit(1)


def run_up(*, port: int, fleet_workers: int, speedup: float) -> None:
    from backfill.storage.metrics import clear_metrics_dir, metrics_dir
    from backfill.storage.settings import get_settings

    def _interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)  # a plain `kill` stops the fleet too
    s = get_settings()
    home = s.home
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["BACKFILL_HOME"] = str(home)  # absolute: every component agrees on it
    # The embedded mode is a development setup: its generated key starts with sk-dev.
    env.setdefault("BACKFILL_ENVIRONMENT", "development")
    _fleet_install_outside_cwd(home, env)
    clear_metrics_dir(metrics_dir())
    fleet = None
    try:
        fleet_line = s.fleet_urls
        if not s.fleet_url_list:
            typer.echo("starting the simulated fleet (Dynamo frontend + mocker); the first run installs it…")
            fleet = _start_fleet(home, workers=fleet_workers, speedup=speedup)
            env["BACKFILL_FLEET_URLS"] = fleet.base_url
            fleet_line = f"{fleet.base_url}   (simulated: Dynamo frontend + {fleet_workers} mocker workers)"
            # The simulated fleet's own telemetry, so the capacity controller (on by default, `auto`)
            # steers on it as it would on a production fleet (BACKFILL_CAPACITY_CONTROL=off: fixed).
            env.setdefault(
                "BACKFILL_FLEET_METRICS_URLS",
                ",".join(
                    [
                        f"frontend={fleet.frontend_metrics_url}",
                        *(f"{w.role}={w.url}" for w in fleet.worker_metrics_urls),
                    ]
                ),
            )
        if not s.bootstrap_api_key:
            env["BACKFILL_BOOTSTRAP_API_KEY"] = bootstrap_key(home)
        key = env.get("BACKFILL_BOOTSTRAP_API_KEY", "")
        origin = f"http://127.0.0.1:{port}"
        with _components(env, logs, port) as procs:
            try:
                _wait_ready(origin, procs, logs)
                _banner(base=f"{origin}/v1", origin=origin, key=key, fleet=fleet_line, home=home, logs=logs)
                _watch(procs, logs)
            except KeyboardInterrupt:
                typer.echo("stopping…")
    except KeyboardInterrupt:
        typer.echo("stopping…")
    finally:
        if fleet is not None:
            fleet.stop()
