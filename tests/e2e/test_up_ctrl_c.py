"""One Ctrl-C of `backfill up`, on real processes (its components and the simulated fleet): an idle
`up` is gone whole, its idle worker leaving at once and the fleet stopping after the worker, with
nothing at ERROR; a `up` stopped mid-batch gives the lines its drains held back to pending without
spending an attempt (none failed because the fleet went away first), and the next `up` on the
same home completes every line once. How fast is for `bench.up_stop` to say, not these tests."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path

import openai
import psutil
import pytest

from backfill.up import STOP_GRACE_S
from tests.e2e.helpers import chat_line, jsonl, read_lines, upload, wait_for, wait_until

pytestmark = pytest.mark.e2e
STOP_MARGIN_S = 30.0  # this machine is shared and slow: a bound on hanging, not a speed


class Up:
    """One `backfill up` on `home` with its own defaults (the drains' grace included)."""

    def __init__(self, tmp: Path, home: Path, name: str, *, speedup: float) -> None:
        from backfill.devfleet.processes import free_port

        self.out = tmp / f"{name}.out"
        env = {k: v for k, v in os.environ.items() if not k.startswith("BACKFILL_") or k == "BACKFILL_FLEET_HOME"}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        env["BACKFILL_HOME"] = str(home)
        with self.out.open("wb") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "backfill", "up", "--port", str(free_port()), "--speedup", str(speedup)],
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_up(self) -> openai.OpenAI:
        wait_until(
            lambda: self.text()[-3000:],
            lambda: "Ctrl-C stops everything" in self.text() or self.proc.poll() is not None,
            300,
        )
        text = self.text()
        assert self.proc.poll() is None, text[-3000:]
        key = re.search(r"API key\s*:\s*(\S+)", text).group(1)  # type: ignore[union-attr]
        base = re.search(r"base URL\s*:\s*(\S+)", text).group(1)  # type: ignore[union-attr]
        return openai.OpenAI(base_url=base, api_key=key, max_retries=2)

    def tree(self) -> list[psutil.Process]:
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def ctrl_c(self) -> None:
        """One SIGINT; then every process of the tree (components, pool, fleet) is gone."""
        tree = self.tree()
        assert any("dynamo.frontend" in " ".join(p.cmdline()) for p in tree), [p.cmdline() for p in tree]
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=STOP_GRACE_S + STOP_MARGIN_S)

        def left() -> list[str]:
            return [f"{p.pid} {' '.join(p.cmdline()[:4])}" for p in tree if _running(p)]

        wait_until(lambda: f"still running: {left()}", lambda: not left(), STOP_MARGIN_S)

    def kill(self) -> None:
        for p in self.tree() if self.proc.poll() is None else []:
            try:
                p.kill()
            except psutil.Error:
                pass


def _running(p: psutil.Process) -> bool:
    try:
        return bool(p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _errors(home: Path) -> list[str]:
    return [
        f"{log.name}: {line}"
        for log in sorted((home / "logs").glob("*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if re.search(r"\bERROR\b", line)
    ]


def _stop_record(home: Path) -> list[str]:
    """What `up` recorded of its stop, in order: `<component> gone`, `fleet stopped`, ..."""
    return [line.split(": ", 1)[1] for line in (home / "logs" / "up.log").read_text().splitlines() if " stop +" in line]


def test_an_idle_up_stops_whole_on_one_ctrl_c_its_worker_at_once_the_fleet_after_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    up = Up(tmp_path, home, "idle", speedup=10)
    try:
        up.wait_up()
        up.ctrl_c()
    finally:
        up.kill()
    assert _errors(home) == []
    worker_log = (home / "logs" / "worker.log").read_text(errors="replace")
    # Celery's warm shutdown of an idle pool waited seconds on nothing: the worker left at once.
    assert "leaving now, without waiting for its idle pool" in worker_log, worker_log[-2000:]
    record = _stop_record(home)
    assert record[0] == "SIGTERM to worker, scheduler, api", record
    gone = [line.split(" ")[0] for line in record if " gone " in line]
    assert sorted(gone) == ["api", "scheduler", "worker"], record
    # The fleet stops once no drain can hold a request: after the worker is gone.
    assert record.index("fleet stopped") > record.index("worker gone (exit code 0)"), record
    assert all(line.endswith("(exit code 0)") for line in record if line.startswith(("worker", "scheduler"))), record


def test_a_batch_in_flight_at_ctrl_c_goes_back_to_pending_and_the_next_up_completes_every_line_once(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    first = Up(tmp_path, home, "first", speedup=1)  # long requests: the drains hold some at the SIGINT
    lines = [chat_line(i, max_tokens=400, prefix="ctrl-c ") for i in range(200)]
    try:
        client = first.wait_up()
        f = upload(client, jsonl(lines))
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_until(
            "the batch ran no line",
            lambda: (c := client.batches.retrieve(batch.id).request_counts) is not None and c.completed > 0,
            180,
            every_s=0.5,
        )
        first.ctrl_c()
    finally:
        first.kill()
    assert _errors(home) == []
    worker_log = (home / "logs" / "worker.log").read_text(errors="replace")
    aborted = [int(n) for n in re.findall(r"after the shutdown signal \((\d+) aborted and requeued\)", worker_log)]
    assert aborted and sum(aborted) > 0, worker_log[-3000:]  # the drains held requests, cut short
    with sqlite3.connect(home / "backfill.db") as db:  # (the home holds this batch alone)
        states = Counter(dict(db.execute("SELECT state, count(*) FROM batch_requests GROUP BY state")))
        spent = db.execute("SELECT count(*) FROM batch_requests WHERE state = 'pending' AND attempts > 0").fetchone()[0]
    assert sum(states.values()) == len(lines), states
    assert states["failed"] == 0 and states["running"] == 0 and states["pending"] > 0, states
    assert spent == 0, f"{spent} lines given back with an attempt spent"

    second = Up(tmp_path, home, "second", speedup=10)
    try:
        client = second.wait_up()
        done = wait_for(client, batch.id, {"completed", "failed", "expired"}, timeout_s=600)
        assert done.status == "completed", done.errors
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (len(lines), 0)
        out = read_lines(client, done.output_file_id)
        assert sorted(o["custom_id"] for o in out) == sorted(line["custom_id"] for line in lines)  # each once
        assert all(o["response"]["status_code"] == 200 for o in out)
        assert read_lines(client, done.error_file_id) == []
        second.ctrl_c()
    finally:
        second.kill()
    assert _errors(home) == []
