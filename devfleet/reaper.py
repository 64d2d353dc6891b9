"""Who owns a fleet's process groups: the RUN_DIR/pids.json record, and reaping fleets
whose owning process died without stop() (e.g. a test run killed on timeout)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Sequence
from pathlib import Path

PIDS_FILE = "pids.json"


def _proc_start_ticks(pid: int) -> str | None:
    """Process start time (field 22 of /proc/PID/stat): tells a live owner from PID reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _process_env_has(pid: int, entry: str) -> bool:
    try:
        return entry.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def record_fleet_pids(run_dir: Path, pgids: Sequence[int]) -> None:
    """Write (atomically) this process as the owner of the fleet's process groups."""
    info = {
        "owner_pid": os.getpid(),
        "owner_start": _proc_start_ticks(os.getpid()),
        "pgids": list(pgids),
    }
    tmp = run_dir / f"{PIDS_FILE}.tmp"
    tmp.write_text(json.dumps(info))
    os.replace(tmp, run_dir / PIDS_FILE)


def forget_fleet_pids(run_dir: Path) -> None:
    """The fleet stopped cleanly: nothing of it is left to reap."""
    (run_dir / PIDS_FILE).unlink(missing_ok=True)


def reap_stale_fleets(run_root: Path) -> list[int]:
    """SIGKILL process groups of fleets whose owning process died without stop().

    Each fleet records its owner and process groups in RUN_DIR/pids.json. A group
    is killed only if its leader still carries that fleet's DYN_FILE_KV in its
    environment, so a recycled PID is never touched. Returns the killed pgids.
    """
    killed: list[int] = []
    for pid_file in Path(run_root).glob(f"*/{PIDS_FILE}"):
        try:
            info = json.loads(pid_file.read_text())
        except (OSError, ValueError):
            continue
        owner = info.get("owner_pid")
        if owner and _proc_start_ticks(owner) == info.get("owner_start"):
            continue  # owner still running: not stale
        marker = f"DYN_FILE_KV={pid_file.parent / 'kv'}"
        for pgid in info.get("pgids", []):
            if _process_env_has(pgid, marker):
                try:
                    os.killpg(pgid, signal.SIGKILL)
                    killed.append(pgid)
                except (ProcessLookupError, PermissionError):
                    pass
        pid_file.unlink(missing_ok=True)
    return killed
