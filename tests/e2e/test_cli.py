"""`backfill batch ...` over HTTP against the real stack: the Typer app in process (CliRunner)
and as a real subprocess configured by the OpenAI environment variables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner, Result

from backfill.batch_cli import batch_app
from backfill.devfleet.stack import Stack
from tests.e2e.helpers import MODEL, chat_line, jsonl, read_lines

pytestmark = pytest.mark.e2e

RUNNER = CliRunner()
ENTRY = "from backfill.batch_cli import batch_app; batch_app(prog_name='backfill batch')"


def bf(stack: Stack, *args: str, key: str | None = None) -> Result:
    return RUNNER.invoke(batch_app, [*args, "--base-url", stack.base_url, "--api-key", key or stack.key])


def bf_json(stack: Stack, *args: str, key: str | None = None, exit_code: int = 0) -> Any:
    result = bf(stack, *args, "--json", key=key)
    assert result.exit_code == exit_code, result.output
    return json.loads(result.stdout)


def bf_process(stack: Stack, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OPENAI_BASE_URL": stack.base_url, "OPENAI_API_KEY": stack.key}
    return subprocess.Popen(
        [sys.executable, "-c", ENTRY, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def write_jsonl(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_bytes(jsonl(lines))
    return path


def no_max_tokens(i: int) -> dict[str, Any]:
    """A line the mocker fleet answers with 400 (it needs max_tokens): it ends in the error file."""
    return dict(chat_line(i), body={"model": MODEL, "messages": [{"role": "user", "content": f"x{i}"}]})


def test_submit_wait_results_status_list(stack: Stack, client: Any, tmp_path: Path) -> None:
    lines = [chat_line(i, max_tokens=4 + i % 5) for i in range(20)]
    src = write_jsonl(tmp_path / "twenty.jsonl", lines)

    # The real command, configured by the environment as a user's shell would: --json prints the
    # final batch only.
    proc = bf_process(stack, "submit", str(src), "--wait", "--json", "--metadata", "job=cli", "--metadata", "n=20")
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    done = json.loads(stdout)
    assert done["status"] == "completed" and done["metadata"] == {"job": "cli", "n": "20"}
    assert done["request_counts"] == {"total": 20, "completed": 20, "failed": 0}
    assert done["usage"]["output_tokens"] == sum(line["body"]["max_tokens"] for line in lines)
    batch_id = done["id"]

    # In process, for people: the id first, a progress bar on stderr, a summary at the end.
    shown = bf(stack, "submit", str(src), "--wait")
    assert shown.exit_code == 0, shown.output
    out = shown.stdout.splitlines()
    assert out[0].startswith("batch_") and out[1].startswith(f"{out[0]} completed")
    assert "20 total, 20 completed, 0 failed" in shown.stdout
    assert "20/20" in shown.stderr and "tok/s" in shown.stderr

    got = bf(stack, "results", batch_id, "-o", str(tmp_path / "out"))
    assert got.exit_code == 0, got.output
    assert got.stdout.split("\n")[0].split()[:3] == ["output.jsonl", "20", "lines"]
    assert got.stdout.split("\n")[1].split() == ["error.jsonl", "none"]
    written = (tmp_path / "out" / "output.jsonl").read_text().splitlines()
    assert len(written) == 20
    assert sorted(json.loads(w)["custom_id"] for w in written) == sorted(line["custom_id"] for line in lines)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["output.jsonl"]
    files = bf_json(stack, "results", batch_id, "-o", str(tmp_path / "again"))["files"]
    assert files["output"]["lines"] == 20 and files["output"]["file_id"] == done["output_file_id"]
    assert files["error"] is None

    status = bf(stack, "status", batch_id)
    assert status.exit_code == 0, status.output
    for text in (batch_id, "completed", MODEL, "20 total, 20 completed, 0 failed", "job=cli, n=20"):
        assert text in status.stdout
    assert bf_json(stack, "status", batch_id) == done

    listed = bf(stack, "list")
    assert listed.exit_code == 0 and batch_id in listed.stdout and "20/20" in listed.stdout
    assert batch_id in {b["id"] for b in bf_json(stack, "list", "--limit", "100")}
    assert len(bf_json(stack, "list", "--limit", "1")) == 1


def test_cancel_ends_wait_with_failure_and_cancelled_lines_are_not_retried(stack: Stack, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "slow.jsonl", [chat_line(i, max_tokens=400) for i in range(1000)])
    proc = bf_process(stack, "submit", str(src), "--wait")
    assert proc.stdout is not None
    batch_id = proc.stdout.readline().strip()
    assert batch_id.startswith("batch_"), proc.communicate(timeout=30)
    # Cancelled once its lines exist (validation is over in well under a second now; a batch
    # cancelled while it validates has no lines to report as cancelled).
    deadline = time.monotonic() + 60
    while bf_json(stack, "status", batch_id)["status"] == "validating":
        assert time.monotonic() < deadline, "the batch never left validation"
        time.sleep(0.05)

    cancelled = bf(stack, "cancel", batch_id)
    assert cancelled.exit_code == 0, cancelled.output
    assert cancelled.stdout.strip() in (f"{batch_id}: cancelling", f"{batch_id}: cancelled")
    rest, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr
    assert f"{batch_id} cancelled" in rest and "Traceback" not in stderr

    files = bf_json(stack, "results", batch_id, "-o", str(tmp_path / "out"))["files"]
    errors = [json.loads(line) for line in (tmp_path / "out" / "error.jsonl").read_text().splitlines()]
    assert files["error"]["lines"] == len(errors) > 0
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    # Cancelled lines were the user's choice: retry-failed resubmits failed and expired ones only.
    assert bf_json(stack, "retry-failed", batch_id) == {"source_batch": batch_id, "lines": 0, "batch": None}

    again = bf(stack, "cancel", batch_id)
    assert again.exit_code == 2
    assert again.stderr.strip() == "error: 409 Cannot cancel a batch with status 'cancelled'."


def test_server_errors_end_in_one_line_and_exit_2(stack: Stack, tmp_path: Path) -> None:
    missing = bf(stack, "status", "batch_doesnotexist")
    assert missing.exit_code == 2 and missing.stdout == ""
    assert missing.stderr.startswith("error: 404 ") and missing.stderr.count("\n") == 1

    wrong_key = bf(stack, "list", key="sk-wrong")
    assert wrong_key.exit_code == 2 and wrong_key.stderr.startswith("error: 401 Incorrect API key")

    src = write_jsonl(tmp_path / "one.jsonl", [chat_line(1)])
    bad_window = bf(stack, "submit", str(src), "--window", "3d")
    assert bad_window.exit_code == 2 and bad_window.stderr.startswith("error: 400 ")
    assert "completion_window" in bad_window.stderr and "3d" in bad_window.stderr

    unreachable = RUNNER.invoke(batch_app, ["list", "--base-url", "http://127.0.0.1:9/v1", "--api-key", "sk-x"])
    assert unreachable.exit_code == 2 and unreachable.stderr.startswith("error: cannot reach http://127.0.0.1:9/v1")
    assert "Traceback" not in missing.output + wrong_key.output + bad_window.output + unreachable.output


def test_estimate_reports_every_bad_line_and_creates_nothing(stack: Stack, client: Any, tmp_path: Path) -> None:
    rows = [json.dumps(chat_line(i)) for i in range(6)]
    rows[2] = "{not json"
    rows[4] = json.dumps({**chat_line(4), "method": "GET"})
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(rows) + "\n")
    newest = client.batches.list(limit=1).data

    shown = bf(stack, "estimate", str(src))
    assert shown.exit_code == 1, shown.output
    assert "line 3: invalid_json_line" in shown.stdout and "line 5: invalid_method" in shown.stdout
    report = bf_json(stack, "estimate", str(src), exit_code=1)
    assert {(e["line"], e["code"]) for e in report["errors"]} == {(3, "invalid_json_line"), (5, "invalid_method")}
    assert report["lines"] == 6 and report["requests"] == 4 and report["model"] == MODEL
    assert report["max_output_tokens"] == 4 * 8 and report["prompt_tokens"] > 0
    assert client.batches.list(limit=1).data == newest

    # The served models come from the server: a model it does not serve is an error on its line.
    other = write_jsonl(tmp_path / "other.jsonl", [chat_line(1), chat_line(2)])
    assert bf(stack, "estimate", str(other)).exit_code == 0
    unknown = write_jsonl(tmp_path / "unknown.jsonl", [chat_line(1, model="no-such-model")])
    report = bf_json(stack, "estimate", str(unknown), exit_code=1)
    assert [(e["line"], e["code"]) for e in report["errors"]] == [(1, "model_not_found")]
    # Nothing prices or runs that model: no cost, and no forecast, each with the reason.
    assert report["cost"] is None and "No price is in force for model 'no-such-model'" in report["cost_note"]
    assert report["completion_forecast"] is None
    assert report["completion_forecast_note"].startswith("unknown: the fleet finished no batch work in the last")
    assert report["throughput"]["model"] == "no-such-model" and report["throughput"]["tokens_per_second"] == 0
    shown = bf(stack, "estimate", str(unknown))
    assert "completion        : unknown (the fleet finished no batch work" in shown.stdout


def test_team_key_sees_cost_so_far_and_an_estimate_with_cost_and_forecast(stack: Stack, tmp_path: Path) -> None:
    admin = stack.env["BACKFILL_ADMIN_API_KEY"]
    # A price for the 1h window only, so batches of other tests (24h) keep their prices.
    r = httpx.post(
        f"{stack.base_url}/organization/prices",
        headers={"Authorization": f"Bearer {admin}"},
        json={"model": MODEL, "completion_window": "1h", "input": "2", "cached_input": "1", "output": "10"},
    )
    assert r.status_code == 200, r.text
    price_id = r.json()["id"]
    src = write_jsonl(tmp_path / "ok.jsonl", [chat_line(i, max_tokens=7) for i in range(10)])
    # Everything below with the team's key (stack.key), which may not read the price list.
    report = bf_json(stack, "estimate", str(src), "--window", "1h")
    assert report["errors"] == [] and report["max_output_tokens"] == 70
    # At the batch discount (50%): 1 micro per prompt token, 5 per output token.
    micros = report["prompt_tokens"] + 5 * 70
    assert report["cost"] == {"amount": f"0.{micros:06d}", "currency": "usd", "price_id": price_id}

    # A batch runs with the team key: the progress bar and the summary show its cost so far.
    shown = bf(stack, "submit", str(src), "--window", "1h", "--wait")
    assert shown.exit_code == 0, shown.output
    batch_id = shown.stdout.splitlines()[0]
    status = bf_json(stack, "status", batch_id)
    cost, usage = status["cost"], status["usage"]
    assert status["status"] == "completed" and cost["currency"] == "usd" and cost["price_id"] == price_id
    assert (cost["requests"], cost["input_tokens"], cost["output_tokens"]) == (
        10,
        usage["input_tokens"],
        usage["output_tokens"],
    )
    # Each request's components are rounded to the micro once: within half a micro per request.
    cached = usage["input_tokens_details"]["cached_tokens"]
    exact = usage["input_tokens"] - cached + cached / 2 + 5 * usage["output_tokens"]
    assert abs(round(float(cost["amount"]) * 1_000_000) - exact) <= 10 / 2
    assert f"{cost['amount']} usd" in shown.stderr  # the live progress bar
    assert f"  cost     : {cost['amount']} usd" in shown.stdout  # the summary
    assert f"cost         {cost['amount']} usd so far (10 billed requests)" in bf(stack, "status", batch_id).stdout

    # Now that batch work has run, the estimate forecasts completion at the fleet's throughput.
    before = time.time()
    report = bf_json(stack, "estimate", str(src), "--window", "1h")
    throughput, forecast = report["throughput"], report["completion_forecast"]
    assert throughput["model"] == MODEL and throughput["requests"] >= 10 and throughput["busy_s"] >= 10
    assert throughput["busy_tokens_per_second"] >= throughput["tokens_per_second"] > 0
    assert forecast is not None and report["completion_forecast_note"] is None
    tokens = report["prompt_tokens"] + report["max_output_tokens"] + throughput["queued_tokens"]
    assert forecast["in_seconds"] == pytest.approx(tokens / throughput["busy_tokens_per_second"], abs=1e-3)
    at = datetime.fromisoformat(forecast["at"]).timestamp()
    assert at == pytest.approx(throughput["at"] + forecast["in_seconds"], abs=1e-3) and at >= before - 1
    text = bf(stack, "estimate", str(src), "--window", "1h").stdout
    assert "completion        : ~" in text and "tok/s, the busy rate over the last 300s)" in text
    assert f"cost              : at most 0.{micros:06d} usd" in text


def test_retry_failed_resubmits_exactly_the_failed_lines(stack: Stack, client: Any, tmp_path: Path) -> None:
    good = [chat_line(i) for i in range(10)]
    bad = [no_max_tokens(100 + i) for i in range(3)]
    ordered = [*good[:4], bad[0], bad[1], *good[4:], bad[2]]
    src = write_jsonl(tmp_path / "mixed.jsonl", ordered)
    done = bf_json(stack, "submit", str(src), "--window", "1h", "--metadata", "job=mixed", "--wait")
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 13, "completed": 10, "failed": 3}

    retry = bf_json(stack, "retry-failed", done["id"], "--wait")
    assert retry["source_batch"] == done["id"] and retry["lines"] == 3
    again = retry["batch"]
    assert again["endpoint"] == "/v1/chat/completions" and again["completion_window"] == "1h"
    assert again["metadata"] == {"job": "mixed", "retry_of": done["id"]}
    assert again["status"] == "completed" and again["request_counts"]["total"] == 3
    # Byte for byte the failed lines of the input, in input order.
    assert client.files.content(again["input_file_id"]).content == jsonl(bad)


def test_retry_failed_takes_the_expired_lines(stack: Stack, client: Any, tmp_path: Path) -> None:
    lines = [chat_line(i, max_tokens=400) for i in range(1000)]
    src = write_jsonl(tmp_path / "slow.jsonl", lines)
    expired = bf_json(stack, "submit", str(src), "--window", "8s", "--wait", exit_code=1)
    assert expired["status"] == "expired"
    errors = read_lines(client, expired["error_file_id"])
    assert errors and {e["error"]["code"] for e in errors} == {"batch_expired"}

    shown = bf(stack, "retry-failed", expired["id"])
    assert shown.exit_code == 0, shown.output
    first, retry_id = shown.stdout.splitlines()
    assert first == f"retrying {len(errors)} lines of {expired['id']}"
    retry = client.batches.retrieve(retry_id)
    assert retry.completion_window == "8s"
    resubmitted = client.files.content(retry.input_file_id).text.splitlines()
    assert [json.loads(line)["custom_id"] for line in resubmitted] == [e["custom_id"] for e in errors]
    bf(stack, "cancel", retry_id)  # leave the fleet to the next test
    deadline = time.monotonic() + 120
    while client.batches.retrieve(retry_id).status not in ("cancelled", "expired", "completed"):
        assert time.monotonic() < deadline
        time.sleep(0.5)
