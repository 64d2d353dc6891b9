"""`backfill up`: the API, a worker and the scheduler on one machine (and the simulated Dynamo
fleet when no fleet is configured), with a short status on the terminal: where to send requests,
the key, the model, the fleet, then a line per batch event.

Everything it keeps is under BACKFILL_HOME, nothing in the working directory: the SQLite
database, objects, broker folders, the generated key, the metrics files (emptied at each start:
the processes that wrote them are gone), the components' logs (`logs/api.log`, ...; the terminal
gets none of their lines, so nothing floods it) and the simulated fleet's run directory.

Stopping: Ctrl-C (or SIGTERM) stops the components, each in a process group of its own (so the
terminal's Ctrl-C reaches `up` alone): SIGTERM to each component's process (a worker's main
process tells its pool; an idle worker leaves at once, a busy one once its drains have given
back what they hold, within their grace), the simulated fleet stops as soon as the worker is
gone (no drain holds a request then) beside the others, then SIGKILL of whatever group is left;
`logs/up.log` records when each was gone. Signals that arrive meanwhile never cut the stop
short: the first says what it waits for, the second SIGKILLs every component at once; that
holds however the stop began (a signal, a component that exited, a start-up that failed). A
component whose `up` was SIGKILLed gets SIGTERM from the kernel (parent death signal); until it
is gone its pid file (`run/`) keeps a new `up` off the same home.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import IO, Any

import httpx
import psutil
import typer
from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from backfill.api.wire import batch_id_out
from backfill.jobs.models import TERMINAL_STATUSES, Batch, BatchStatus, Team, utcnow
from backfill.worker_watchdog import leave

COMPONENTS = ("worker", "scheduler", "api")
STOP_GRACE_S = 30.0  # longer than a drain's shutdown grace (BACKFILL_DRAIN_GRACE_S, 20 s)
# A drain's shutdown grace under `up` unless configured: Ctrl-C stops within seconds, and what a
# drain has not finished by then goes back to pending without spending an attempt (the next
# `up` runs it); a deployment's 20 s lets long requests finish through a rolling restart.
UP_DRAIN_GRACE_S = 2.0
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
DEFAULT_MAX_TOKENS = 256  # the simulated model's default length limit (devfleet.length_front)
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
    from backfill.devfleet.fleet import Fleet, large_model
    from backfill.devfleet.reaper import PIDS_FILE, reap_stale_fleets

    run_dir = home / "fleet"
    reap_stale_fleets(home)  # a fleet whose `up` was killed: its processes go first
    if (run_dir / PIDS_FILE).exists():
        typer.secho(f"another `backfill up` runs with BACKFILL_HOME={home}", fg=typer.colors.RED)
        raise typer.Exit(1)
    shutil.rmtree(run_dir, ignore_errors=True)  # no stale discovery entries from a previous run
    fleet = Fleet(
        model_name="tiny-chat",
        num_workers=workers,
        speedup_ratio=speedup,
        # A second, larger and slower model on a worker of its own: `client.models.list()`
        # shows both, and each model's batch work runs on its own idle capacity.
        more_models=[large_model(speedup)],
        run_dir=run_dir,
        die_with_parent=True,
        default_max_tokens=DEFAULT_MAX_TOKENS,  # a request without max_tokens gets it, as on a real engine
    )
    fleet.start()
    return fleet


class Stopping:
    """The signal handler of `up`. A SIGINT/SIGTERM while running starts the stop
    (KeyboardInterrupt); once stopping, however the stop began (that signal, or `begin` when a
    component exited or start-up failed), none raises again, so no stop is left half done. The
    signals received while stopping are counted: the first says what it waits for, the second
    (and any after it) SIGKILLs every component (`kill_all`)."""

    def __init__(self) -> None:
        self.active = False
        self.signals_while_stopping = 0
        self.kill_all: Callable[[], None] = lambda: None

    def begin(self) -> None:
        """The stop starts (or has started): from now on a signal never raises."""
        self.active = True

    def __call__(self, *_: object) -> None:
        if not self.active:
            self.active = True
            raise KeyboardInterrupt
        self.signals_while_stopping += 1
        if self.signals_while_stopping == 1:
            _say(f"still stopping (the worker's drains have up to {STOP_GRACE_S:.0f} s); once more kills everything")
        else:
            _say("killing every component (SIGKILL)")
            self.kill_all()


def _say(line: str) -> None:
    """A line from a signal handler: os.write, since the main thread may be inside a print."""
    try:
        os.write(sys.stdout.fileno(), (line + "\n").encode())
    except (OSError, ValueError):
        pass


def _die_with_parent(libc: ctypes.CDLL | None) -> Callable[[], None]:
    """What the child runs before exec: SIGTERM it when `up` dies, even by SIGKILL (Linux); and
    take the signals `up` blocks while it starts the child (a mask survives exec) off its mask.
    `libc` is loaded in the parent: between fork and exec the child must not import (the import
    lock may be held by a thread that does not exist in the child) nor load a library."""

    prctl = libc.prctl if libc is not None else None  # (the symbol looked up here, too)
    deathsig = int(signal.SIGTERM)

    def in_child() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        if prctl is not None:
            prctl(1, deathsig)  # PR_SET_PDEATHSIG

    return in_child


def _signal(p: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.kill(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # pgid == pid: each component leads a session of its own
    except (ProcessLookupError, PermissionError):
        pass


@contextmanager
def _components(
    env: dict[str, str], logs: Path, port: int, stopping: Stopping, stop_fleet: Callable[[], None] | None = None
) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    from backfill.devfleet.processes import _LIBC
    from backfill.up import forget

    run_dir = Path(env["BACKFILL_HOME"]) / "run"
    files: list[IO[bytes]] = []
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        try:
            _start(env, logs, port, run_dir, files, procs, in_child=_die_with_parent(_LIBC))
            fleet_kill = stopping.kill_all

            def kill_all() -> None:
                for p in procs.values():
                    _signal_group(p, signal.SIGKILL)
                fleet_kill()

            stopping.kill_all = kill_all
            yield procs
        finally:
            # A `finally` of its own, before the stop: a signal landing here before `begin`
            # raises once (the handler begins the stop as it raises), so the stop below is
            # reached with every later signal harmless and is never left half done.
            stopping.begin()
    finally:
        record = _StopRecord(logs / "up.log")
        for p in procs.values():
            # The process alone, not its group: a worker's main process tells its pool children
            # itself (`scheduler.tasks`), then closes its pool. SIGTERM to the group as well made
            # billiard's children take a second SIGTERM from their main process and leave with
            # exit code 70, which Celery logs at ERROR for every child.
            _signal(p, signal.SIGTERM)
        record.said(f"SIGTERM to {', '.join(procs) or 'no component'}")
        deadline = time.monotonic() + STOP_GRACE_S
        # The worker first: once it is gone no drain holds a request (a drain told to stop gives
        # back what it has not finished), so the fleet stops beside the scheduler and the API
        # rather than after them (a fleet gone under a request in flight would spend its line's attempt).
        worker = procs.get("worker")
        if worker is not None:
            _wait(worker, deadline)
            _signal_group(worker, signal.SIGKILL)  # its pool, should any child outlive it
            worker.wait()
            record.gone("worker", worker)
        fleet_stop = threading.Thread(target=record.timed("fleet", stop_fleet), name="fleet-stop")
        fleet_stop.start()
        for name, p in procs.items():
            if p is not worker:
                _wait(p, deadline)
                _signal_group(p, signal.SIGKILL)  # what is left of a group, its leader gone or not
                p.wait()
                record.gone(name, p)
        for name in procs:
            forget(run_dir, name)
        fleet_stop.join()
        record.said("components and fleet stopped")
        record.write()
        for f in files:
            f.close()


def _wait(p: subprocess.Popen[bytes], deadline: float) -> None:
    try:
        p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass


class _StopRecord:
    """When each component was gone, as seconds after the stop began, for `logs/up.log`: where a
    slow stop spends its time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.started = time.monotonic()
        self.lines: list[str] = []

    def said(self, what: str) -> None:
        self.lines.append(
            f"{datetime.now().astimezone():%Y-%m-%d %H:%M:%S.%f} stop +{time.monotonic() - self.started:.2f} s: {what}"
        )

    def gone(self, name: str, p: subprocess.Popen[bytes]) -> None:
        self.said(f"{name} gone (exit code {p.returncode})")

    def timed(self, name: str, step: Callable[[], None] | None) -> Callable[[], None]:
        def run() -> None:
            if step is not None:
                step()
                self.said(f"{name} stopped")

        return run

    def write(self) -> None:
        try:
            with self.path.open("a") as f:
                f.write("".join(line + "\n" for line in self.lines))
        except OSError:
            pass


def _start(
    env: dict[str, str],
    logs: Path,
    port: int,
    run_dir: Path,
    files: list[IO[bytes]],
    procs: dict[str, subprocess.Popen[bytes]],
    *,
    in_child: Callable[[], None],
) -> None:
    """Migrate, then start the components into `procs` (their logs open in `files`), so the
    caller stops whatever was started if this raises."""
    from backfill.up import record

    exe = [sys.executable, "-m", "backfill"]
    args = {"worker": ["worker"], "scheduler": ["scheduler"], "api": ["api", "--port", str(port)]}
    with (logs / "migrate.log").open("wb") as out:
        done = subprocess.run([*exe, "migrate"], env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        _report_failure("migrate", logs)
        raise typer.Exit(1)
    for name in COMPONENTS:
        files.append((logs / f"{name}.log").open("wb"))
        # A signal waits until the process is started and on record: none is lost track of.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            procs[name] = subprocess.Popen(
                [*exe, *args[name]],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=files[-1],
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=in_child,
            )
            record(run_dir, name, procs[name].pid)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


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


def _watch(procs: dict[str, subprocess.Popen[bytes]], logs: Path) -> None:
    """Print batch events until a component exits (then say which, and why, from its log)."""
    from sqlalchemy.exc import SQLAlchemyError

    from backfill.storage.db import unit_of_work
    from backfill.up import BatchEvents

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
    """Run until stopped, then leave without the interpreter's finalizers: tearing down the
    modules `up` loaded took about a second of a loaded 2-core machine, after everything had
    stopped (its files are closed and its components reaped by then)."""
    code = 0
    try:
        _run_up(port=port, fleet_workers=fleet_workers, speedup=speedup)
    except typer.Exit as exit_:
        code = exit_.exit_code
    leave(code)


def _run_up(*, port: int, fleet_workers: int, speedup: float) -> None:
    from backfill.storage.metrics import clear_metrics_dir, metrics_dir
    from backfill.storage.settings import get_settings
    from backfill.up import banner, forget, holders, port_free, record

    stopping = Stopping()
    signal.signal(signal.SIGINT, stopping)
    signal.signal(signal.SIGTERM, stopping)  # a plain `kill` stops everything too
    s = get_settings()
    home = s.home
    run_dir = home / "run"
    if held := holders(run_dir):
        names = ", ".join(f"{h.name} (PID {h.pid})" for h in held)
        # Stop the earlier `up` itself (it stops the rest); a component left alone is killed by its PID.
        first = next((h for h in held if h.name == "up"), held[0])
        how = f"kill -INT {first.pid}" if first.name == "up" else f"kill {first.pid}"
        typer.secho(
            f"BACKFILL_HOME={home} is still held by an earlier `backfill up`: {names}; stop it ({how}) first",
            fg=typer.colors.RED,
        )
        raise typer.Exit(1)
    if not port_free(port):
        typer.secho(
            f"port {port} is in use on 127.0.0.1: start on another one with `backfill up --port N`",
            fg=typer.colors.RED,
        )
        raise typer.Exit(1)
    record(run_dir, "up", os.getpid())
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["BACKFILL_HOME"] = str(home)  # absolute: every component agrees on it
    # The embedded mode is a development setup: its generated key starts with sk-dev.
    env.setdefault("BACKFILL_ENVIRONMENT", "development")
    env.setdefault("BACKFILL_DRAIN_GRACE_S", str(UP_DRAIN_GRACE_S))
    _fleet_install_outside_cwd(home, env)
    clear_metrics_dir(metrics_dir())
    fleet = None
    try:
        try:
            fleet_line = ", ".join(s.fleet_urls)
            if not s.fleet_urls:
                from backfill.devfleet.install import default_venv_dir, is_dynamo_venv_ready

                installing = "" if is_dynamo_venv_ready(default_venv_dir()) else " (installing it first, once: minutes)"
                typer.echo(f"starting the simulated fleet (Dynamo frontend + mocker){installing}…")
                fleet = _start_fleet(home, workers=fleet_workers, speedup=speedup)
                stopping.kill_all = fleet.kill_now
                env["BACKFILL_FLEET_URLS"] = fleet.base_url
                fleet_line = (
                    f"{fleet.base_url}   (simulated: Dynamo frontend; {fleet.model_name} on {fleet_workers} mocker"
                    f" workers, {' and '.join(m for m in fleet.models[1:])} on one of its own)"
                )
                # The simulated fleet's own telemetry, so the capacity controller (on by default, `auto`)
                # steers on it as it would on a production fleet (BACKFILL_CAPACITY_CONTROL=off: fixed);
                # each worker named by its model, so each model's pool gets a controller of its own.
                env.setdefault(
                    "BACKFILL_FLEET_METRICS_URLS",
                    ",".join(
                        [
                            f"frontend={fleet.frontend_metrics_url}",
                            *(f"{w.role}@{w.model}={w.metrics_url}" for w in fleet.workers),
                        ]
                    ),
                )
            if not s.bootstrap_api_key:
                env["BACKFILL_BOOTSTRAP_API_KEY"] = bootstrap_key(home)
            key = env.get("BACKFILL_BOOTSTRAP_API_KEY", "")
            origin = f"http://127.0.0.1:{port}"
            with _components(env, logs, port, stopping, fleet.stop if fleet is not None else None) as procs:
                try:
                    _wait_ready(origin, procs, logs)
                    banner(base=f"{origin}/v1", origin=origin, key=key, fleet=fleet_line, home=home, logs=logs)
                    _watch(procs, logs)
                except KeyboardInterrupt:
                    typer.echo("stopping…")
        except KeyboardInterrupt:
            typer.echo("stopping…")
        finally:
            stopping.begin()  # (as in `_components`: a signal from here on never raises)
    finally:
        if fleet is not None:
            fleet.stop()
        forget(run_dir, "up")


# Who holds a BACKFILL_HOME: one pid file per process of a `backfill up` (`run/<name>.pid`:
# its PID and start time), so a second `backfill up` refuses while anything of an earlier run
# still works on the same database, broker and objects, and says which process it is.
#
# A PID alone could have been reused by an unrelated process since; the start time recorded
# beside it tells the two apart (a file whose process is gone or is another is stale, removed).


@dataclass(frozen=True)
class Holder:
    name: str
    pid: int


def _start_time(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def record(run_dir: Path, name: str, pid: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    started = _start_time(pid)
    path = run_dir / f"{name}.pid"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{pid} {started if started is not None else ''}\n")
    os.replace(tmp, path)  # never a half-written file for the next `up` to read


def forget(run_dir: Path, name: str) -> None:
    (run_dir / f"{name}.pid").unlink(missing_ok=True)


def holders(run_dir: Path) -> list[Holder]:
    """The processes named in `run_dir` that still run (stale files are removed)."""
    alive: list[Holder] = []
    for path in sorted(run_dir.glob("*.pid")) if run_dir.is_dir() else []:
        try:
            pid_text, _, started_text = path.read_text().strip().partition(" ")
            pid, started = int(pid_text), float(started_text) if started_text else None
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        now = _start_time(pid)
        # A zombie is gone in all but name; a start time that differs is another process.
        if now is not None and (started is None or abs(now - started) < 0.01) and not _zombie(pid):
            alive.append(Holder(path.stem, pid))
        else:
            path.unlink(missing_ok=True)
    return alive


def _zombie(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return True


def port_free(port: int) -> bool:
    """Whether the API can listen on 127.0.0.1:port (checked before anything starts, so a port
    in use is said plainly instead of a banner for someone else's server)."""
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no obstacle
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# What `backfill up` shows on its terminal: the batches' events, one line each, read from the
# database once a second (the components' own logs go to files under BACKFILL_HOME/logs).
#
# Only unfinished batches and the ones created in the last few seconds are read, so a poll costs
# the same however many batches the database holds; a batch that starts and ends between two polls
# still gets its lines.

RECENT = timedelta(seconds=10)  # overlap between polls, for a batch created and finished in between
MAX_ERROR_CHARS = 120


@dataclass(frozen=True)
class BatchEvent:
    at: datetime
    batch_id: str
    what: str  # "created" or the status it moved to
    detail: str

    def line(self) -> str:
        return (
            f"{self.at.astimezone():%H:%M:%S}  {batch_id_out(self.batch_id)}  {self.what:<11}  {self.detail}".rstrip()
        )


def _detail(batch: Batch, team: str, status: str) -> str:
    counts = f"{batch.completed} ok, {batch.failed} failed of {batch.total}"
    if status == "created":
        return f"team {team}"
    if status == BatchStatus.in_progress:
        return f"{batch.total} lines, model {batch.model}"
    if status == BatchStatus.failed and batch.errors:
        message = str(batch.errors[0].get("message", ""))
        more = f" (+{len(batch.errors) - 1} more)" if len(batch.errors) > 1 else ""
        return message[:MAX_ERROR_CHARS] + more
    if status == BatchStatus.completed and batch.completed_at is not None:
        return f"{counts} in {(batch.completed_at - batch.created_at).total_seconds():.1f} s"
    return counts if batch.total else ""


class BatchEvents:
    """Remembers the status it last reported for each batch it still watches."""

    def __init__(self) -> None:
        self._reported: dict[str, str] = {}
        self._last_poll = utcnow()

    def poll(self, session: Session) -> list[BatchEvent]:
        now = utcnow()
        since = min(self._last_poll, now) - RECENT
        watching = [b for b, status in self._reported.items() if status not in TERMINAL_STATUSES]
        rows = session.execute(
            select(Batch, Team.name)
            .join(Team, Team.id == Batch.team_id)
            .where(
                or_(
                    Batch.status.not_in(list(TERMINAL_STATUSES)),
                    Batch.created_at >= since,
                    Batch.id.in_(watching),  # to see the status it ends in
                )
            )
            .order_by(Batch.created_at, Batch.id)
        ).all()
        events: list[BatchEvent] = []
        present = set()
        for batch, team in rows:
            present.add(batch.id)
            before = self._reported.get(batch.id)
            if before is None:
                events.append(BatchEvent(now, batch.id, "created", _detail(batch, team, "created")))
            ran = batch.in_progress_at is not None and batch.status != BatchStatus.in_progress
            if ran and before in (None, BatchStatus.validating):
                # It ran and moved on between two polls (a small batch takes well under one):
                # its start is still news.
                events.append(BatchEvent(now, batch.id, "in_progress", _detail(batch, team, BatchStatus.in_progress)))
            if before != batch.status and batch.status != BatchStatus.validating:
                events.append(BatchEvent(now, batch.id, batch.status.value, _detail(batch, team, batch.status)))
            self._reported[batch.id] = batch.status
        # A finished batch that no longer shows up never changes again: stop watching it.
        for batch_id in [b for b, status in self._reported.items() if b not in present]:
            if self._reported[batch_id] in TERMINAL_STATUSES:
                del self._reported[batch_id]
        self._last_poll = now
        return events


def _models(base: str, key: str) -> str:
    try:
        r = httpx.get(f"{base}/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        ids = [m["id"] for m in r.json()["data"]] if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        ids = []
    return ", ".join(ids) or "(the fleet lists none yet)"


def banner(*, base: str, origin: str, key: str, fleet: str, home: Path, logs: Path) -> None:
    typer.secho("\nbackfill is up", fg=typer.colors.GREEN, bold=True)
    typer.echo(f"  base URL : {base}")
    typer.echo(f"  API key  : {key}")
    typer.echo(f"  model    : {_models(base, key)}")
    typer.echo(f"  fleet    : {fleet}")
    typer.echo(f"  metrics  : {origin}/metrics   ready: {origin}/ready")
    typer.echo(f"  state    : {home}   (logs in {logs})")
    typer.echo(
        f"  try      : OPENAI_BASE_URL={base} OPENAI_API_KEY={key} {sys.executable} -c"
        ' "import openai; print(openai.OpenAI().models.list())"'
    )
    typer.echo("Ctrl-C stops everything. Batch events:\n")
