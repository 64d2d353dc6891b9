"""Completion windows on the real stack, with the default set and prices (1h, 4h, 24h, 72h, 7d at
2.0, 1.5, 1.0, 0.8 and 0.6 times a model's general price): the official SDK creates a batch in
every window, each expiring that long after its creation; an unknown window is a 400 in OpenAI's
envelope; a batch runs to completion in the 1h and the 7d window and its ledger bills each
request at the window's price; `batch estimate` shows the cost in each window."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from typer.testing import CliRunner

from backfill.batch_cli import batch_app
from backfill.devfleet.fleet import Fleet
from backfill.devfleet.s3 import SeaweedS3
from backfill.devfleet.stack import Stack, launch_stack
from backfill.storage.settings import Settings
from tests.e2e.helpers import MODEL, chat_line, jsonl, wait_for

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = {name: Settings.model_fields[name].default for name in ("completion_windows", "window_price_multipliers")}
WINDOWS = {"1h": 3600, "4h": 4 * 3600, "24h": 86400, "72h": 3 * 86400, "7d": 7 * 86400}
# The general price, per million tokens in micros: $0.15 input, $0.075 cached, $0.60 output, 50% off.
GENERAL = {"input": 150_000, "cached": 75_000, "output": 600_000}
PRICE_ARGS = "--input 0.15 --cached-input 0.075 --output 0.60 --discount 50".split()
MULTIPLIER = {"1h": 2.0, "7d": 0.6}


@pytest.fixture(scope="module")
def windows_stack(
    redis_url: str, s3: SeaweedS3, fleet: Fleet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """A stack of its own at the default windows and prices (the session stack accepts 1h and 8s)."""
    settings = {
        "BACKFILL_COMPLETION_WINDOWS": DEFAULTS["completion_windows"],
        "BACKFILL_WINDOW_PRICE_MULTIPLIERS": DEFAULTS["window_price_multipliers"],
        "BACKFILL_TICK_INTERVAL_S": "0.5",
    }
    with launch_stack(
        tmp_path_factory.mktemp("windows"),
        settings=settings,
        s3=s3,
        fleet_url=fleet.base_url,
        name="windows",
        redis_url=redis_url.rsplit("/", 1)[0] + "/8",  # a broker of its own: not the session stack's
        flush=True,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def sdk(windows_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=windows_stack.base_url, api_key=windows_stack.key, max_retries=0, timeout=60)


def _upload(sdk: openai.OpenAI, lines: int) -> str:
    data = jsonl([chat_line(i, max_tokens=6) for i in range(lines)])
    return sdk.files.create(file=("w.jsonl", io.BytesIO(data)), purpose="batch").id


def test_the_defaults_are_what_this_module_expects() -> None:
    assert Settings(_env_file=None).completion_windows == WINDOWS  # type: ignore[call-arg]


def test_the_sdk_creates_a_batch_in_every_window(sdk: openai.OpenAI) -> None:
    file_id = _upload(sdk, 1)
    for window, seconds in WINDOWS.items():
        batch = sdk.batches.create(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window=window,  # type: ignore[arg-type]  # the SDK types only OpenAI's "24h"
        )
        assert batch.completion_window == window
        assert batch.expires_at is not None and batch.expires_at - batch.created_at == seconds
        again = sdk.batches.retrieve(batch.id)
        assert (again.completion_window, again.expires_at) == (window, batch.expires_at)
        sdk.batches.cancel(batch.id)  # nothing of these needs to run


def test_an_unknown_window_is_a_400_in_openais_envelope(sdk: openai.OpenAI) -> None:
    file_id = _upload(sdk, 1)
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="2h")  # type: ignore[arg-type]
    assert refused.value.status_code == 400
    assert refused.value.response.json() == {
        "error": {
            "message": "Invalid value: '2h'. Supported values are: '1h', '4h', '24h', '72h', '7d'.",
            "type": "invalid_request_error",
            "param": "completion_window",
            "code": "invalid_value",
        }
    }


def _by_hand(tokens: int, rate: float) -> int:
    """tokens x rate / 1e6 at 50% off, to the nearest micro, halves up (`jobs.billing.ledger.component_cost`)."""
    numerator = tokens * round(rate) * 50
    return (numerator + 50_000_000) // 100_000_000


def _ledger(stack: Stack, batch_id: str) -> list[dict[str, Any]]:
    import psycopg
    from psycopg.rows import dict_row

    with psycopg.connect(stack.database_url.replace("+psycopg", ""), row_factory=dict_row) as conn:
        return list(conn.execute("SELECT * FROM usage_ledger WHERE batch_id = %s ORDER BY line", (batch_id,)))


def test_a_batch_is_billed_at_its_windows_price(windows_stack: Stack, sdk: openai.OpenAI, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "backfill", "prices", "set", MODEL, "--json", *PRICE_ARGS],
        env=windows_stack.env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    general = json.loads(done.stdout)

    batches = {
        window: sdk.batches.create(
            input_file_id=_upload(sdk, 6),
            endpoint="/v1/chat/completions",
            completion_window=window,  # type: ignore[arg-type]
        ).id
        for window in MULTIPLIER
    }
    for window, batch_id in batches.items():
        batch = wait_for(sdk, batch_id, {"completed", "failed", "expired"}, timeout_s=240)
        assert batch.status == "completed" and batch.request_counts is not None, batch
        assert batch.request_counts.completed == 6
        rows = _ledger(windows_stack, batch_id.removeprefix("batch_"))
        assert len(rows) == 6 and {r["price_version"] for r in rows} == {general["version"]}
        m = MULTIPLIER[window]
        for r in rows:
            uncached = r["prompt_tokens"] - r["cached_tokens"]
            assert r["input_cost_micros"] == _by_hand(uncached, GENERAL["input"] * m), (window, r)
            assert r["cached_input_cost_micros"] == _by_hand(r["cached_tokens"], GENERAL["cached"] * m), (window, r)
            assert r["output_cost_micros"] == _by_hand(r["completion_tokens"], GENERAL["output"] * m), (window, r)
        cost = sdk.get(f"/batches/{batch_id}/cost", cast_to=object)
        assert isinstance(cost, dict) and cost["price_id"] == general["version"]
        assert round(float(cost["amount"]) * 1_000_000) == sum(r["cost_micros"] for r in rows)

    # The estimate prices the same file in every window, shortest (dearest) first.
    src = tmp_path / "est.jsonl"
    src.write_bytes(jsonl([chat_line(i, max_tokens=6) for i in range(6)]))
    shown = CliRunner().invoke(
        batch_app,
        [
            "estimate",
            str(src),
            "--window",
            "1h",
            "--json",
            "--base-url",
            windows_stack.base_url,
            "--api-key",
            windows_stack.key,
        ],
    )
    assert shown.exit_code == 0, shown.output
    report = json.loads(shown.stdout)
    table = report["costs_per_window"]
    assert [row["completion_window"] for row in table] == list(WINDOWS)
    assert [row["multiplier"] for row in table] == ["2.0", "1.5", "1.0", "0.8", "0.6"]
    amounts = [float(row["amount"]) for row in table]
    assert amounts == sorted(amounts, reverse=True) and amounts[0] > amounts[-1] > 0
    assert report["cost"]["amount"] == table[0]["amount"]  # --window 1h
