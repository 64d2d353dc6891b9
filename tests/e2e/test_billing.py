"""Teams, keys, isolation, quotas and a bill that reconciles to the token, on the real services.

Team A is made through the admin HTTP routes, team B through the CLI; prices are set with the
CLI. The reconciliation prices every output line by hand, in integer micros.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import BatchRequestCounts

from tests.contract.spec import validate
from tests.e2e.helpers import MODEL, chat_line, jsonl, read_lines, upload, wait_for

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]

# Per million tokens: $0.15 input, $0.075 cached input, $0.60 output, 50% batch discount.
RATES = {"input": 150_000, "cached": 75_000, "output": 600_000, "discount": 50}
# A shared prompt prefix long enough (about 900 tokens) for the fleet's KV cache to report hits.
PREFIX = " ".join(f"context{i}" for i in range(200)) + "\n"


def by_hand(tokens: int, rate: int) -> int:
    """The documented rule: tokens x rate / 1e6 x (100 - discount) / 100, nearest micro, halves up."""
    numerator = tokens * rate * (100 - RATES["discount"])
    return (numerator + 50_000_000) // 100_000_000


def cli(stack: Any, *args: str) -> Any:
    done = subprocess.run(
        [sys.executable, "-m", "backfill", *args, "--json"],
        env=stack.env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@dataclass
class TeamHandle:
    id: str  # bare team id; the API shows it as proj_<id>
    name: str
    key: str

    @property
    def project_id(self) -> str:
        return "proj_" + self.id

    def client(self, stack: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=stack.base_url, api_key=self.key, max_retries=0, timeout=60)

    def http(self, stack: Any) -> httpx.Client:
        return httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {self.key}"}, timeout=60)


@pytest.fixture(scope="module")
def admin(stack: Any) -> httpx.Client:
    key = stack.env["BACKFILL_ADMIN_API_KEY"]
    return httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _http_team(admin: httpx.Client, name: str) -> TeamHandle:
    r = admin.post("/organization/projects", json={"name": name})
    assert r.status_code == 200, r.text
    project = r.json()
    assert project["object"] == "organization.project" and project["id"].startswith("proj_")
    r = admin.post(f"/organization/projects/{project['id']}/api_keys", json={"name": "ci"})
    assert r.status_code == 200, r.text
    return TeamHandle(id=project["id"].removeprefix("proj_"), name=name, key=r.json()["value"])


@pytest.fixture(scope="module")
def teams(stack: Any, admin: httpx.Client) -> dict[str, TeamHandle]:
    tag = secrets.token_hex(3)
    a = _http_team(admin, f"alpha-{tag}")
    created = cli(stack, "teams", "create", f"beta-{tag}", "--weight", "2")
    key = cli(stack, "keys", "create", "--team", created["name"])
    assert key["key"].startswith("sk-bf-") and key["team_id"] == created["id"]
    b = TeamHandle(id=created["id"], name=created["name"], key=key["key"])
    return {"a": a, "b": b}


@pytest.fixture(scope="module")
def price(stack: Any) -> dict[str, Any]:
    row: dict[str, Any] = cli(
        stack, "prices", "set", MODEL, *"--input 0.15 --cached-input 0.075 --output 0.60 --discount 50".split()
    )
    assert row["input_micros_per_million"] == RATES["input"]
    assert row["cached_input_micros_per_million"] == RATES["cached"]
    assert row["output_micros_per_million"] == RATES["output"]
    return row


def _ledger(pg_url: str, team_id: str) -> list[dict[str, Any]]:
    import psycopg
    from psycopg.rows import dict_row

    with psycopg.connect(pg_url.replace("+psycopg", ""), row_factory=dict_row) as conn:
        return list(conn.execute("SELECT * FROM usage_ledger WHERE team_id = %s ORDER BY batch_id, line", (team_id,)))


def test_admin_routes_need_an_admin_key(stack: Any, teams: dict[str, TeamHandle]) -> None:
    for path in ("/organization/projects", "/organization/prices"):
        r = teams["a"].http(stack).get(path)
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
        assert httpx.get(stack.base_url + path).status_code == 401
    names = {
        p["name"]
        for p in httpx.get(
            stack.base_url + "/organization/projects",
            headers={"Authorization": f"Bearer {stack.env['BACKFILL_ADMIN_API_KEY']}"},
        ).json()["data"]
    }
    assert {teams["a"].name, teams["b"].name} <= names


def test_revoked_key_gets_401_at_once(stack: Any, admin: httpx.Client, teams: dict[str, TeamHandle]) -> None:
    b = teams["b"]
    # Through the CLI, by visible prefix.
    made = cli(stack, "keys", "create", "--team", b.name)
    h = {"Authorization": f"Bearer {made['key']}"}
    assert httpx.get(stack.base_url + "/batches", headers=h).status_code == 200
    revoked = cli(stack, "keys", "revoke", made["prefix"])
    assert revoked["revoked_at"] is not None
    r = httpx.get(stack.base_url + "/batches", headers=h)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    listed = {k["id"]: k for k in cli(stack, "keys", "list", "--team", b.name)}
    assert listed[made["id"]]["revoked_at"] is not None and "key" not in listed[made["id"]]
    # Through the admin route, by id.
    made = admin.post(f"/organization/projects/{b.project_id}/api_keys", json={}).json()
    h = {"Authorization": f"Bearer {made['value']}"}
    assert httpx.get(stack.base_url + "/files", headers=h).status_code == 200
    r = admin.delete(f"/organization/projects/{b.project_id}/api_keys/{made['id']}")
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert httpx.get(stack.base_url + "/files", headers=h).status_code == 401
    # Another project's key id answers 404.
    other = admin.post(f"/organization/projects/{teams['a'].project_id}/api_keys", json={}).json()
    assert admin.delete(f"/organization/projects/{b.project_id}/api_keys/{other['id']}").status_code == 404


def _same_404(foreign: httpx.Response, missing: httpx.Response, foreign_id: str, missing_id: str) -> None:
    assert foreign.status_code == missing.status_code == 404, (foreign.text, missing.text)
    validate(foreign.json(), "ErrorResponse")
    # Messages name the id (bare or prefixed): with the ids swapped the bodies are identical.
    bare = missing.text.replace(missing_id, foreign_id)
    for prefix in ("file-", "batch_"):
        bare = bare.replace(missing_id.removeprefix(prefix), foreign_id.removeprefix(prefix))
    assert foreign.json() == json.loads(bare)


def test_another_teams_ids_answer_404_like_missing_ones(stack: Any, teams: dict[str, TeamHandle]) -> None:
    a, b = teams["a"].client(stack), teams["b"].http(stack)
    f = upload(a, jsonl([chat_line(i, max_tokens=2) for i in range(3)]))
    batch = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    fake_file = "file-" + secrets.token_hex(12)
    fake_batch = "batch_" + secrets.token_hex(12)
    for method, path in (
        ("GET", "/files/{f}"),
        ("GET", "/files/{f}/content"),
        ("DELETE", "/files/{f}"),
        ("GET", "/batches/{b}"),
        ("POST", "/batches/{b}/cancel"),
    ):
        foreign = b.request(method, path.format(f=f.id, b=batch.id))
        missing = b.request(method, path.format(f=fake_file, b=fake_batch))
        _same_404(foreign, missing, f.id if "{f}" in path else batch.id, fake_file if "{f}" in path else fake_batch)
    body = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
    _same_404(
        b.post("/batches", json={**body, "input_file_id": f.id}),
        b.post("/batches", json={**body, "input_file_id": fake_file}),
        f.id,
        fake_file,
    )
    assert f.id not in {x["id"] for x in b.get("/files").json()["data"]}
    assert batch.id not in {x["id"] for x in b.get("/batches").json()["data"]}
    # Nothing the other team tried had any effect.
    done = wait_for(a, batch.id, {"completed"})
    assert done.request_counts.completed == 3 and a.files.retrieve(f.id).id == f.id
    assert f.id in {x.id for x in a.files.list()} and batch.id in {x.id for x in a.batches.list()}


def test_quotas_reject_with_token_limit_exceeded(stack: Any, admin: httpx.Client) -> None:
    c = _http_team(admin, f"gamma-{secrets.token_hex(3)}")
    client = c.client(stack)
    quota = f"/organization/projects/{c.project_id}/quotas"
    r = admin.post(quota, json={"model": MODEL, "max_enqueued_tokens": 60, "max_concurrent_batches": None})
    assert r.status_code == 200 and r.json()["max_enqueued_tokens"] == 60, r.text
    lines = [chat_line(i, max_tokens=20) for i in range(3)]  # about 3 x (9 + 20) tokens estimated
    f = upload(client, jsonl(lines))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_for(client, b.id, {"failed", "completed"})
    assert done.status == "failed" and done.errors is not None
    (error,) = done.errors.data
    assert error.code == "token_limit_exceeded", error
    assert "limit is 60" in (error.message or "") and "0 are already enqueued" in (error.message or "")
    assert done.request_counts.total == 0 and done.output_file_id is None  # nothing was dispatched

    # Concurrent batches: one long batch holds the only slot, the next one is refused.
    r = admin.post(quota, json={"model": MODEL, "max_enqueued_tokens": None, "max_concurrent_batches": 1})
    assert r.json()["max_concurrent_batches"] == 1
    long_batch = client.batches.create(
        input_file_id=upload(client, jsonl([chat_line(i, max_tokens=200) for i in range(400)])).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    wait_for(client, long_batch.id, {"in_progress"})
    second = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    refused = wait_for(client, second.id, {"failed", "in_progress", "completed"})
    client.batches.cancel(long_batch.id)
    assert refused.status == "failed" and refused.errors is not None, refused
    (error,) = refused.errors.data
    assert error.code == "token_limit_exceeded" and "1 batches are unfinished" in (error.message or "")
    wait_for(client, long_batch.id, {"cancelled"})
    listed = admin.get(quota).json()["data"]
    assert [(q["model"], q["max_concurrent_batches"]) for q in listed] == [(MODEL, 1)]


def _sum_usage(outputs: list[dict[str, Any]]) -> tuple[int, int, int]:
    usages = [o["response"]["body"]["usage"] for o in outputs]
    return (
        sum(u["prompt_tokens"] for u in usages),
        sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages),
        sum(u["completion_tokens"] for u in usages),
    )


def _cost_by_hand(outputs: list[dict[str, Any]]) -> int:
    total = 0
    for o in outputs:
        u = o["response"]["body"]["usage"]
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        total += by_hand(u["prompt_tokens"] - cached, RATES["input"])
        total += by_hand(cached, RATES["cached"])
        total += by_hand(u["completion_tokens"], RATES["output"])
    return total


def test_bill_reconciles_across_crashes_and_retries(
    stack: Any, fleet: Any, pg_url: str, admin: httpx.Client, teams: dict[str, TeamHandle], price: dict[str, Any]
) -> None:
    a, b = teams["a"], teams["b"]
    client = a.client(stack)
    started = int(time.time()) - 7200  # before anything this module ran

    # Batch 1 warms the prefix cache; two lines without max_tokens are refused by the fleet (4xx).
    warm = [chat_line(i, max_tokens=3 + i % 3, prefix=PREFIX) for i in range(20)]
    bad = [
        dict(chat_line(90 + i), body={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}) for i in range(2)
    ]
    f1 = upload(client, jsonl(warm + bad))
    b1 = client.batches.create(input_file_id=f1.id, endpoint="/v1/chat/completions", completion_window="24h")
    b1_done = wait_for(client, b1.id, {"completed"})
    assert (b1_done.request_counts.completed, b1_done.request_counts.failed) == (20, 2)

    # Batch 2 runs while the backfill worker is SIGKILLed and restarted, then a fleet worker dies
    # (requests routed to it come back 503 and are retried: forced retries).
    # Long enough answers, and enough waves of the stack's 32 leases (25), that the batch is still
    # running when its worker is killed, however late a loaded machine lets this test look (small
    # batches turn around in well under a second; 300 lines sometimes finished first).
    lines = [chat_line(i, max_tokens=300 + i % 5, prefix=PREFIX) for i in range(800)]
    f2 = upload(client, jsonl(lines))
    b2 = client.batches.create(input_file_id=f2.id, endpoint="/v1/chat/completions", completion_window="24h")
    # A new price version after creation must not reach batch 2: it is billed at the old one.
    cli(stack, "prices", "set", MODEL, "--input", "9", "--cached-input", "9", "--output", "9")
    b2_id = b2.id.removeprefix("batch_")
    _wait_completed(client, b2.id, 20)
    stack.kill("worker")
    killed_at = _counts(client, b2.id)
    time.sleep(1.0)
    stack.start("worker")
    assert killed_at.completed + killed_at.failed < len(lines), "the worker should die mid-batch"
    _wait_completed(client, b2.id, killed_at.completed + 10)  # the new worker is sending
    fleet.kill_worker(0)
    deadline = time.monotonic() + 20
    while _retried_lines(pg_url, [b2_id]) == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    fleet.restart_worker(0)
    b2_done = wait_for(client, b2.id, {"completed"}, timeout_s=240)
    assert killed_at.completed + killed_at.failed < len(lines), "the worker should die mid-batch"

    # Team B runs a little too, so that scoping has something to hide.
    bc = teams["b"].client(stack)
    fb = upload(bc, jsonl([chat_line(i, max_tokens=2) for i in range(4)]))
    bb = wait_for(
        bc,
        bc.batches.create(input_file_id=fb.id, endpoint="/v1/chat/completions", completion_window="24h").id,
        {"completed"},
    )

    outputs = read_lines(client, b1_done.output_file_id) + read_lines(client, b2_done.output_file_id)
    assert len(outputs) == 20 + b2_done.request_counts.completed
    batches = [b1_done, b2_done]
    team_ledger = _ledger(pg_url, a.id)
    ledger = [r for r in team_ledger if "batch_" + r["batch_id"] in {x.id for x in batches}]

    # 1. The ledger: one entry per executed request, nothing for the 4xx lines, at the old price.
    assert len(ledger) == len({(r["batch_id"], r["line"]) for r in ledger}) == len(outputs)
    assert {r["price_version"] for r in ledger} == {price["version"]}
    # 2. Tokens: ledger == sum of the batch usage objects == sum of the output files' usage.
    ledger_tokens = (
        sum(r["prompt_tokens"] for r in ledger),
        sum(r["cached_tokens"] for r in ledger),
        sum(r["completion_tokens"] for r in ledger),
    )
    batch_tokens = (
        sum(x.usage.input_tokens for x in batches),
        sum(x.usage.input_tokens_details.cached_tokens for x in batches),
        sum(x.usage.output_tokens for x in batches),
    )
    assert ledger_tokens == batch_tokens == _sum_usage(outputs)
    assert ledger_tokens[1] > 0, "the shared prefix should have hit the fleet's KV cache"
    # 3. Money: the ledger total equals the output files priced by hand; cached at the cached rate.
    ledger_micros = sum(r["cost_micros"] for r in ledger)
    assert ledger_micros == _cost_by_hand(outputs)
    assert sum(r["cached_input_cost_micros"] for r in ledger) == sum(
        by_hand(r["cached_tokens"], RATES["cached"]) for r in ledger
    )
    # 4. The same figures through the Usage and Costs APIs and the CLI.
    h = a.http(stack)
    usage = h.get(
        "/organization/usage/completions", params={"start_time": started, "bucket_width": "1h", "group_by": "model"}
    ).json()
    _check_page(usage, "organization.usage.completions.result")
    results = [r for bucket in usage["data"] for r in bucket["results"]]
    assert {r["model"] for r in results} == {MODEL}
    paged, pages = _paged_requests(h, started)
    assert paged == len(team_ledger) and pages >= 3  # two hours back and the current one
    # (The team's ledger also holds the isolation test's small batch.)
    assert sum(r["input_tokens"] for r in results) == sum(r["prompt_tokens"] for r in team_ledger)
    assert sum(r["input_cached_tokens"] for r in results) == sum(r["cached_tokens"] for r in team_ledger)
    assert sum(r["output_tokens"] for r in results) == sum(r["completion_tokens"] for r in team_ledger)
    assert sum(r["num_model_requests"] for r in results) == len(team_ledger)
    team_micros = sum(r["cost_micros"] for r in team_ledger)
    costs = h.get("/organization/costs", params={"start_time": started, "group_by": "line_item"}).json()
    _check_page(costs, "organization.costs.result")
    items = [r for bucket in costs["data"] for r in bucket["results"]]
    assert {r["amount"]["currency"] for r in items} == {"usd"}
    assert sum(round(r["amount"]["value"] * 1_000_000) for r in items) == team_micros
    cached_item = [r for r in items if r["line_item"] == f"{MODEL}, cached input"]
    assert sum(round(r["amount"]["value"] * 1_000_000) for r in cached_item) == sum(
        r["cached_input_cost_micros"] for r in team_ledger
    )
    cli_rows = cli(stack, "usage", "--team", a.name, "--days", "2")
    assert sum(r["cost_micros"] for r in cli_rows) == team_micros
    assert sum(r["requests"] for r in cli_rows) == len(team_ledger)

    # 5. Scoping: team B sees only its own usage, even when it asks for A's project; an admin sees both.
    b_usage = (
        teams["b"]
        .http(stack)
        .get(
            "/organization/usage/completions",
            params={"start_time": started, "group_by": "project_id", "project_ids": [a.project_id, b.project_id]},
        )
        .json()
    )
    b_results = [r for bucket in b_usage["data"] for r in bucket["results"]]
    assert {r["project_id"] for r in b_results} == {b.project_id}
    assert sum(r["num_model_requests"] for r in b_results) == bb.request_counts.completed == 4
    both = admin.get(
        "/organization/costs",
        params={"start_time": started, "group_by": "project_id", "project_ids": [a.project_id, b.project_id]},
    ).json()
    by_project: dict[str, int] = {}
    for bucket in both["data"]:
        for r in bucket["results"]:
            by_project[r["project_id"]] = by_project.get(r["project_id"], 0) + round(r["amount"]["value"] * 1_000_000)
    assert by_project[a.project_id] == team_micros
    assert by_project[b.project_id] == sum(r["cost_micros"] for r in _ledger(pg_url, b.id))

    retried = _retried_lines(pg_url, [b2_id])
    assert retried > 0, "the dead fleet worker should have forced retries"
    print(
        f"\nreconciliation: {len(ledger)} requests, tokens (input, cached, output) = {ledger_tokens}, "
        f"ledger {ledger_micros} micros == output files priced by hand {_cost_by_hand(outputs)} micros; "
        f"{retried} lines retried; worker killed at {killed_at.completed}/{len(lines)} done"
    )


def _check_page(page: dict[str, Any], result_object: str) -> None:
    """OpenAI's page / bucket / result shapes (the contract spec here covers Files and Batches only)."""
    assert page["object"] == "page" and isinstance(page["has_more"], bool) and "next_page" in page
    for bucket in page["data"]:
        assert bucket["object"] == "bucket" and bucket["end_time"] > bucket["start_time"]
        for r in bucket["results"]:
            assert r["object"] == result_object
            if result_object == "organization.costs.result":
                assert isinstance(r["amount"]["value"], float | int) and r["amount"]["currency"] == "usd"
                assert {"line_item", "project_id"} <= set(r)
            else:
                assert all(isinstance(r[k], int) for k in ("input_tokens", "output_tokens", "num_model_requests"))
                assert {"input_cached_tokens", "project_id", "model", "batch", "api_key_id", "user_id"} <= set(r)


def _paged_requests(h: httpx.Client, start_time: int) -> tuple[int, int]:
    """Walk the hourly buckets one page (one bucket) at a time: (requests, pages)."""
    params: dict[str, Any] = {"start_time": start_time, "bucket_width": "1h", "limit": 1}
    total, pages = 0, 0
    while True:
        page = h.get("/organization/usage/completions", params=params).json()
        assert len(page["data"]) == 1
        total += sum(r["num_model_requests"] for r in page["data"][0]["results"])
        pages += 1
        if not page["has_more"]:
            return total, pages
        params["page"] = page["next_page"]


def _counts(client: openai.OpenAI, batch_id: str) -> BatchRequestCounts:
    counts = client.batches.retrieve(batch_id).request_counts
    assert counts is not None
    return counts


def _wait_completed(client: openai.OpenAI, batch_id: str, n: int) -> None:
    deadline = time.monotonic() + 120
    while _counts(client, batch_id).completed < n:
        assert time.monotonic() < deadline, f"batch {batch_id} stalled below {n} completed"
        time.sleep(0.1)


def _retried_lines(pg_url: str, batch_ids: list[str]) -> int:
    import psycopg

    with psycopg.connect(pg_url.replace("+psycopg", "")) as conn:
        row = conn.execute(
            "SELECT count(*) FROM batch_requests WHERE batch_id = ANY(%s) AND attempts > 0", (batch_ids,)
        ).fetchone()
    return int(row[0]) if row else 0
