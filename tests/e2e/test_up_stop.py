"""`backfill up` as a new user meets it, on real processes: it stops whole whatever signals
arrive while it stops, a batch cut short finishes on the next run, its worker ends within its
grace when told to stop, an orphan of an earlier run keeps a new run off the home, a key
configured again after a rotation works, and lines without a length limit run on the
simulated fleet."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

from backfill.up import STOP_GRACE_S
from tests.e2e.helpers import chat_line, jsonl, read_lines, upload, wait_for, wait_until

pytestmark = pytest.mark.e2e
KEY_A = "sk-dev-up-stop-" + "a" * 24
KEY_B = "sk-dev-up-stop-" + "b" * 24
DRAIN_GRACE_S = 5.0
STOP_MARGIN_S = 30.0  # this machine is shared and slow: a bound on hanging, not a speed


class Up:
    """One `backfill up` on `home`, its terminal in `out`."""

    def __init__(self, tmp: Path, home: Path, name: str, **env_extra: str) -> None:
        from backfill.devfleet.processes import free_port

        self.out = tmp / f"{name}.out"
        env = {k: v for k, v in os.environ.items() if not k.startswith("BACKFILL_") or k == "BACKFILL_FLEET_HOME"}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        env.update(BACKFILL_HOME=str(home), BACKFILL_DRAIN_GRACE_S=str(DRAIN_GRACE_S), **env_extra)
        self.proc = subprocess.Popen(
            # speedup 1: a batch runs long enough to be cut short
            [sys.executable, "-m", "backfill", "up", "--port", str(free_port()), "--speedup", "1"],
            env=env,
            stdout=self.out.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_up(self) -> tuple[openai.OpenAI, str]:
        wait_until(
            lambda: self.text()[-3000:],
            lambda: "Ctrl-C stops everything" in self.text() or self.proc.poll() is not None,
            300,
        )
        text = self.text()
        assert self.proc.poll() is None, text[-3000:]
        key = re.search(r"API key\s*:\s*(\S+)", text).group(1)  # type: ignore[union-attr]
        base = re.search(r"base URL\s*:\s*(\S+)", text).group(1)  # type: ignore[union-attr]
        return openai.OpenAI(base_url=base, api_key=key, max_retries=0), key

    def tree(self) -> list[psutil.Process]:
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def component(self, name: str) -> psutil.Process:
        """The component's own process (a child of `up`; the worker's pool children look alike)."""
        return next(p for p in psutil.Process(self.proc.pid).children() if p.cmdline()[3:4] == [name])

    def stop(self) -> None:
        tree = self.tree()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=STOP_GRACE_S + STOP_MARGIN_S)
        assert_gone(tree)


def assert_gone(tree: list[psutil.Process], within_s: float = STOP_GRACE_S + STOP_MARGIN_S) -> None:
    def left() -> list[str]:
        return [f"{p.pid} {' '.join(p.cmdline()[:4])}" for p in tree if _running(p)]

    wait_until(lambda: f"still running: {left()}", lambda: not left(), within_s)


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill_tree(tree: list[psutil.Process]) -> None:
    for p in tree:
        try:
            p.kill()
        except psutil.Error:
            pass


def _long_batch(client: openai.OpenAI) -> tuple[str, list[str]]:
    lines = [chat_line(i, max_tokens=400) for i in range(300)]  # about a minute on the mocker
    f = upload(client, jsonl(lines))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")

    def started() -> bool:
        counts = client.batches.retrieve(b.id).request_counts
        return counts is not None and counts.completed > 0

    wait_until("the batch ran no line", started, 180, every_s=0.5)
    return b.id, [line["custom_id"] for line in lines]


def _no_limit_lines(endpoint: str) -> list[dict[str, Any]]:
    def body(i: int) -> dict[str, Any]:
        if endpoint == "/v1/chat/completions":
            return {"model": "tiny-chat", "messages": [{"role": "user", "content": f"tell me about {i}"}]}
        if endpoint == "/v1/completions":
            return {"model": "tiny-chat", "prompt": f"tell me about {i}"}
        return {"model": "tiny-chat", "input": f"tell me about {i}"}

    return [{"custom_id": f"n-{i}", "method": "POST", "url": endpoint, "body": body(i)} for i in range(3)]


def test_two_sigterms_stop_everything_and_the_next_runs_finish_the_batch(tmp_path: Path) -> None:
    home = tmp_path / "home"
    first = Up(tmp_path, home, "first", BACKFILL_BOOTSTRAP_API_KEY=KEY_A)
    try:
        client, key = first.wait_up()
        assert key == KEY_A
        batch_id, custom_ids = _long_batch(client)
        tree = first.tree()
        assert any("worker" in p.cmdline() for p in tree), [p.cmdline() for p in tree]
        assert client.batches.retrieve(batch_id).status == "in_progress"  # cut short, mid-drain
        first.proc.send_signal(signal.SIGTERM)
        time.sleep(1)
        first.proc.send_signal(signal.SIGTERM)
        first.proc.wait(timeout=STOP_GRACE_S + STOP_MARGIN_S)
        assert_gone(tree)  # the old `up` orphaned a deadlocked worker here, forever
        assert "still stopping" in first.text(), first.text()[-2000:]
    finally:
        _kill_tree(first.tree() if first.proc.poll() is None else [])

    # The next run (the configured key rotated to B) finishes the batch: nothing lost.
    second = Up(tmp_path, home, "second", BACKFILL_BOOTSTRAP_API_KEY=KEY_B)
    try:
        client, key = second.wait_up()
        assert key == KEY_B
        done = wait_for(client, batch_id, {"completed", "failed", "expired"}, timeout_s=600)
        assert done.status == "completed", done.errors
        assert sorted(o["custom_id"] for o in read_lines(client, done.output_file_id)) == sorted(custom_ids)
        # Lines with no length limit, through the official SDK: every one completes.
        for endpoint in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
            f = upload(client, jsonl(_no_limit_lines(endpoint)))
            b = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]
            done = wait_for(client, b.id, {"completed", "failed"}, timeout_s=300)
            out = read_lines(client, done.output_file_id)
            assert done.status == "completed" and len(out) == 3, (
                endpoint,
                done.errors,
                read_lines(client, done.error_file_id),
            )
            assert all(o["response"]["status_code"] == 200 for o in out), (endpoint, out)
        second.stop()
    finally:
        _kill_tree(second.tree() if second.proc.poll() is None else [])

    # A again: rotation revoked it, configuring it again restores it; the banner's key works.
    third = Up(tmp_path, home, "third", BACKFILL_BOOTSTRAP_API_KEY=KEY_A)
    try:
        client, key = third.wait_up()
        assert key == KEY_A
        assert client.models.list().data
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=str(client.base_url), api_key=KEY_B, max_retries=0).models.list()
        third.stop()
    finally:
        _kill_tree(third.tree() if third.proc.poll() is None else [])


def test_a_worker_told_twice_to_stop_ends_within_its_grace_and_an_orphan_holds_the_home(tmp_path: Path) -> None:
    home = tmp_path / "home"
    run = Up(tmp_path, home, "run")
    try:
        client, _ = run.wait_up()
        batch_id, _ = _long_batch(client)
        worker = run.component("worker")
        assert client.batches.retrieve(batch_id).status == "in_progress"
        tree = run.tree()
        told = time.monotonic()
        worker.send_signal(signal.SIGTERM)  # as a container runtime would: the main process alone
        time.sleep(1)
        worker.send_signal(signal.SIGTERM)
        wait_until("the worker did not exit", lambda: not _running(worker), DRAIN_GRACE_S + STOP_MARGIN_S)
        took = time.monotonic() - told
        assert took < DRAIN_GRACE_S + STOP_MARGIN_S
        run.proc.wait(timeout=STOP_GRACE_S + STOP_MARGIN_S)  # `up` saw its worker go and stopped
        assert_gone(tree)
    finally:
        _kill_tree(run.tree() if run.proc.poll() is None else [])

    # An orphan: `up` SIGKILLed while its worker cannot react (stopped) -> it still holds the home.
    held = Up(tmp_path, home, "held")
    tree: list[psutil.Process] = []
    try:
        held.wait_up()
        tree = held.tree()
        worker = held.component("worker")
        worker.suspend()
        held.proc.kill()
        held.proc.wait(timeout=10)
        refused = Up(tmp_path, home, "refused")
        assert refused.proc.wait(timeout=120) == 1
        assert f"worker (PID {worker.pid})" in refused.text(), refused.text()
    finally:
        for p in tree:
            try:
                p.resume()
            except psutil.Error:
                pass
        _kill_tree(tree)


def test_one_ctrl_c_stops_everything_with_nothing_logged_at_error(tmp_path: Path) -> None:
    """What an operator sees on Ctrl-C: every process gone, and no component's log with a line
    at ERROR (Celery logged `ForkPoolWorker ... exited with 'exitcode 70'` for every pool child:
    they took a stop signal from `up`'s group SIGTERM and another from their main process)."""
    home = tmp_path / "home"
    up = Up(tmp_path, home, "ctrl-c")
    try:
        up.wait_up()
        tree = up.tree()
        up.proc.send_signal(signal.SIGINT)
        up.proc.wait(timeout=STOP_GRACE_S + STOP_MARGIN_S)
        assert_gone(tree)
    finally:
        _kill_tree(up.tree() if up.proc.poll() is None else [])
    errors = [
        f"{log.name}: {line}"
        for log in sorted((home / "logs").glob("*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if re.search(r"\bERROR\b", line)
    ]
    assert errors == [], errors
