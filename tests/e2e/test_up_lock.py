"""The pid files that keep a second `backfill up` off a home an earlier run still holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from backfill.up_lock import forget, holders, record


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
