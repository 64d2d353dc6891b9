"""`backfill up` keeps all its state under BACKFILL_HOME and prints a short status: the URL, key,
model and fleet, then one line per batch event, and none of its components' log lines. Its
/metrics (capacity control on, against the simulated fleet) exports every metric the Grafana
dashboard plots."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.helpers import chat_line, jsonl, upload, wait_for

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "grafana" / "dashboards" / "backfill.json"


@dataclass(frozen=True)
class UpRun:
    cwd: Path
    home: Path
    terminal: str
    batch_id: str
    metrics: str


def _read(path: Path) -> str:
    return path.read_text(errors="replace")


@pytest.fixture(scope="module")
def up_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpRun]:
    """One `backfill up` in an empty working directory, one batch through it, then stopped."""
    from backfill.devfleet.processes import free_port

    tmp = tmp_path_factory.mktemp("up")
    cwd, home, out = tmp / "cwd", tmp / "home", tmp / "up.out"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BACKFILL_") or k == "BACKFILL_FLEET_HOME"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env["BACKFILL_HOME"] = str(home)
    proc = subprocess.Popen(
        [sys.executable, "-m", "backfill", "up", "--port", str(free_port())],
        env=env,
        cwd=cwd,
        stdout=out.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while "Batch events:" not in _read(out):
            assert proc.poll() is None and time.monotonic() < deadline, _read(out)[-3000:]
            time.sleep(0.5)
        text = _read(out)
        key = re.search(r"API key\s*:\s*(\S+)", text).group(1)  # type: ignore[union-attr]
        base = re.search(r"base URL\s*:\s*(\S+)", text).group(1)  # type: ignore[union-attr]
        client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
        f = upload(client, jsonl([chat_line(i) for i in range(5)]))
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert wait_for(client, b.id, {"completed", "failed"}, timeout_s=120).status == "completed"
        deadline = time.monotonic() + 10
        while f"{b.id}  completed" not in _read(out):
            assert time.monotonic() < deadline, _read(out)
            time.sleep(0.3)
        metrics = httpx.get(base.removesuffix("/v1") + "/metrics", timeout=10).text
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    yield UpRun(cwd=cwd, home=home, terminal=_read(out), batch_id=b.id, metrics=metrics)


def test_up_writes_nothing_in_its_working_directory(up_run: UpRun) -> None:
    assert list(up_run.cwd.iterdir()) == []
    home = up_run.home
    for kept in ("backfill.db", "bootstrap_key", "broker/control", "objects", "metrics", "logs/api.log", "fleet"):
        assert (home / kept).exists(), kept
    assert "GET /health 200" in _read(home / "logs" / "api.log")  # the access log went to its file


def test_up_prints_a_short_status_and_a_line_per_batch_event(up_run: UpRun) -> None:
    text = up_run.terminal
    assert re.search(r"model\s*:\s*tiny-chat", text), text
    assert re.search(r"fleet\s*:\s*http://127\.0\.0\.1:\d+/v1", text), text
    events = [line.split()[1:3] for line in text.splitlines() if re.match(r"\d\d:\d\d:\d\d  batch_", line)]
    b = up_run.batch_id
    # `finalizing` may come and go between two polls.
    assert [e for e in events if e[1] != "finalizing"] == [[b, "created"], [b, "in_progress"], [b, "completed"]], text
    # Short: none of the components' log lines (uvicorn, Celery, the controller's scrapes).
    assert len(text.splitlines()) < 30, text
    assert "INFO" not in text and "celery" not in text.lower() and "HTTP Request" not in text, text


def _dashboard_metric_names() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    return {name for expr in exprs for name in re.findall(r"\bbackfill_[a-z0-9_]+", expr)}


def test_the_dashboard_plots_only_metrics_backfill_exports(up_run: UpRun) -> None:
    exported = {s.name for f in text_string_to_metric_families(up_run.metrics) for s in f.samples}
    wanted = _dashboard_metric_names()
    assert "backfill_fleet_lease_limit" in wanted and "backfill_tokens_total" in wanted
    assert wanted - exported == set(), sorted(exported)
