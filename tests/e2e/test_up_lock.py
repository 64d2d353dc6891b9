"""The pid files that keep a second `backfill up` off a home an earlier run still holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from backfill.up import forget, holders, record


def test_a_live_process_holds_the_home_and_a_gone_or_reused_pid_does_not(tmp_path: Path) -> None:
    run = tmp_path / "run"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record(run, "worker", sleeper.pid)
        assert [(h.name, h.pid) for h in holders(run)] == [("worker", sleeper.pid)]
        # The same PID with another start time: another process since, the file is stale.
        (run / "api.pid").write_text(f"{sleeper.pid} 12345.0\n")
        assert [h.name for h in holders(run)] == ["worker"] and not (run / "api.pid").exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert holders(run) == [] and not (run / "worker.pid").exists()
    record(run, "up", sleeper.pid)
    forget(run, "up")
    assert holders(run) == []


def _up(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("BACKFILL_")}
    env["BACKFILL_HOME"] = str(home)
    return subprocess.run(
        [sys.executable, "-m", "backfill", "up", *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_an_earlier_up_is_named_as_the_one_to_stop(tmp_path: Path) -> None:
    home = tmp_path / "home"
    holders_ = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        record(home / "run", "api", holders_[0].pid)
        record(home / "run", "up", holders_[1].pid)
        done = _up(home)
        assert done.returncode == 1
        assert f"kill -INT {holders_[1].pid}" in done.stdout + done.stderr, done.stdout + done.stderr
    finally:
        for p in holders_:
            p.kill()
            p.wait()


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = _up(tmp_path / "home", "--port", str(port))
    out = done.stdout + done.stderr
    assert done.returncode == 1 and f"port {port} is in use" in out and "--port" in out, out
    assert "backfill is up" not in out and not (tmp_path / "home" / "fleet").exists()  # no fleet was started
