"""Who holds a BACKFILL_HOME: one pid file per process of a `backfill up` (`run/<name>.pid`:
its PID and start time), so a second `backfill up` refuses while anything of an earlier run
still works on the same database, broker and objects, and says which process it is.

A PID alone could have been reused by an unrelated process since; the start time recorded
beside it tells the two apart (a file whose process is gone or is another is stale, removed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import psutil


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
