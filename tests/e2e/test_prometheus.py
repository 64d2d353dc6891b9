"""The Grafana dashboard's queries against a real Prometheus scraping the real stack.

Grafana itself is not run here (the compose stack runs it; the tests have no container engine),
but what it shows is only what Prometheus answers: every panel's PromQL must parse and run, the
scrape of the API's /metrics must be healthy, and after a batch the panels a user looks at
first (dispatch rate, tokens and cost by team, leases against the limit, API traffic,
finalization durations) must have series. Uses Debian's prometheus (scripts/test.sh installs it);
without it the module skips with the reason.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from backfill.devfleet.processes import free_port
from backfill.devfleet.stack import Stack
from tests.e2e.helpers import MODEL, chat_line, jsonl, upload, wait_for

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "grafana" / "dashboards" / "backfill.json"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
# Grafana's interval macros, as Grafana would expand them for a short time range.
MACROS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}
# Panels that must have data once a batch has run (title -> why it matters).
MUST_HAVE_DATA = {
    "Dispatch rate": "what backfill sends to the fleet",
    "Leases in use vs the published limit": "the batch share of the fleet",
    "Output tokens/s by team and model": "the teams' usage",
    "Cost by team and model (since the counters started)": "the teams' bill",
    "Finalization duration (p95)": "how long result files take",
    "API requests/s": "the API's traffic",
}


def _panel_queries() -> list[tuple[str, str]]:
    queries = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target.get("expr")
            if expr:
                for macro, value in MACROS.items():
                    expr = expr.replace(macro, value)
                queries.append((panel["title"], expr))
    return queries


@pytest.fixture(scope="module")
def prometheus(stack: Stack) -> Iterator[str]:
    if not Path(PROMETHEUS).exists():
        pytest.skip(f"no prometheus at {PROMETHEUS} (scripts/test.sh installs Debian's prometheus)")
    work = Path(tempfile.mkdtemp(prefix="prom-"))
    config = work / "prometheus.yml"
    # The repository's scrape config, pointed at this stack's API and scraping every second.
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: backfill\n"
        "    metrics_path: /metrics\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{stack.api_port}']}}]\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(work / "prometheus.log").open("wb"),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (work / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "prometheus did not get ready in 60 s"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)


def _query(url: str, expr: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    body: dict[str, Any] = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return body


def _team_key(stack: Stack) -> str:
    admin = {"Authorization": f"Bearer {stack.env['BACKFILL_ADMIN_API_KEY']}"}
    base = stack.base_url + "/organization"
    project = httpx.post(f"{base}/projects", headers=admin, json={"name": f"prom-{secrets.token_hex(4)}"}, timeout=30)
    key = httpx.post(f"{base}/projects/{project.json()['id']}/api_keys", headers=admin, json={}, timeout=30)
    value: str = key.json()["value"]
    return value


def test_every_dashboard_query_runs_and_the_main_panels_have_data(stack: Stack, prometheus: str) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key=_team_key(stack), max_retries=0, timeout=60)
    f = upload(client, jsonl([chat_line(i, model=MODEL) for i in range(20)]))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert wait_for(client, b.id, {"completed", "failed"}).status == "completed"

    # The scrape is healthy, and has seen the batch's counters (a few scrapes after it ended,
    # so every rate() has two points inside its window).
    deadline = time.monotonic() + 60
    while True:
        targets = httpx.get(f"{prometheus}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        cost = _query(prometheus, "sum(backfill_cost_usd_total)")["data"]["result"]
        if targets and targets[0]["health"] == "up" and cost:
            break
        assert time.monotonic() < deadline, f"no healthy scrape with backfill's counters in 60 s: {targets}"
        time.sleep(1)
    time.sleep(5)

    with_data: dict[str, bool] = {}
    queries = _panel_queries()
    assert len(queries) >= 20, "the dashboard lost its panels"
    for title, expr in queries:
        result = _query(prometheus, expr)["data"]["result"]  # fails on a query Prometheus rejects
        with_data[title] = with_data.get(title, False) or bool(result)
    assert set(MUST_HAVE_DATA) <= set(with_data), "a panel this test checks was renamed"
    missing = {title: why for title, why in MUST_HAVE_DATA.items() if not with_data[title]}
    empty = sorted(title for title, has in with_data.items() if not has)
    assert not missing, f"panels without data after a batch ran: {missing} (all empty: {empty})"
