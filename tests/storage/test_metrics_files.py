"""prometheus-client's multiprocess files (`storage.metrics`): a forked child writes its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

ROOT = Path(__file__).resolve().parents[2]

# A counter counted in a process, then in a child it forks (as the worker's pool children are),
# then in the process again.
COUNT_ACROSS_A_FORK = """
import os
from backfill.storage.metrics import counter
lines = counter("forked_lines", "lines counted on both sides of a fork")
lines.inc()
pid = os.fork()
if pid == 0:
    lines.inc(2)
    os._exit(0)
os.waitpid(pid, 0)
lines.inc(4)
print(os.getpid(), pid)
"""


def test_a_forked_child_counts_in_a_file_of_its_own_and_the_sum_holds(tmp_path: Path) -> None:
    env = {**os.environ, "BACKFILL_METRICS_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", COUNT_ACROSS_A_FORK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    parent, child = done.stdout.split()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and files[0].startswith("counter_")
    assert {name.rsplit("-", 1)[-1].removesuffix(".db") for name in files} == {parent, child}
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    assert registry.get_sample_value("forked_lines_total") == 7
