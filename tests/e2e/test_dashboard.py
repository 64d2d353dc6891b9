"""The web dashboard in a real headless Chromium (Playwright driving Debian's chromium) against
the real stack: a team key and an admin key see their batches with progress, the fleet chart
fills while a batch runs, and the screenshot the README shows is taken here and checked."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from backfill.devfleet.stack import Stack
from tests.e2e.helpers import MODEL, chat_line, jsonl, upload, wait_for

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "docs" / "dashboard.png"
CHROMIUM = os.environ.get("BACKFILL_TEST_CHROMIUM", "/usr/bin/chromium")
DONE = {"completed", "failed", "expired", "cancelled"}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip package playwright is not installed")
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        pytest.skip(f"no Chromium at {CHROMIUM} (scripts/test.sh installs Debian's chromium)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield b
        finally:
            b.close()


def _open(browser: Any, stack: Stack, key: str) -> Any:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(stack.base_url.removesuffix("/v1") + "/dashboard")
    page.fill("#api-key", key)
    page.click("#key-form button[type=submit]")
    return page


def _pixel_spread(path: Path) -> float:
    from PIL import Image, ImageStat

    with Image.open(path) as image:
        return float(ImageStat.Stat(image.convert("L")).stddev[0])


def test_team_view_shows_its_batches_with_progress(browser: Any, stack: Stack, client: Any) -> None:
    batch = client.batches.create(
        input_file_id=upload(client, jsonl([chat_line(i) for i in range(12)])).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    assert wait_for(client, batch.id, DONE).status == "completed"
    page = _open(browser, stack, stack.key)
    try:
        row = page.wait_for_selector(f'tr[data-batch="{batch.id}"]', timeout=20_000)
        assert batch.id in row.inner_text() and "12/12 (100%)" in row.inner_text()
        assert "completed" in row.inner_text()
        assert not page.is_visible("th.team-col")  # a team key sees no team column
        assert "team default" in page.inner_text("#who")
        # Usage and cost per team and model come from the usage and costs routes.
        page.wait_for_selector("#usage tbody tr", timeout=40_000)
        assert "tiny-chat" in page.inner_text("#usage")
    finally:
        page.close()


@contextmanager
def interactive_traffic(fleet_url: str, streams: int = 3) -> Iterator[None]:
    """Requests sent straight to the fleet, as its interactive users would, while the block runs."""
    stop = threading.Event()

    def user(n: int) -> None:
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"hi {n}"}], "max_tokens": 64}
                try:
                    http.post(f"{fleet_url}/chat/completions", json=body)
                except httpx.HTTPError:
                    time.sleep(0.2)

    users = [threading.Thread(target=user, args=(n,), daemon=True) for n in range(streams)]
    for u in users:
        u.start()
    try:
        yield
    finally:
        stop.set()
        for u in users:
            u.join(timeout=35)


def test_admin_view_plots_the_fleet_while_a_batch_runs(browser: Any, stack: Stack, client: Any, fleet: Any) -> None:
    admin_key = stack.env["BACKFILL_ADMIN_API_KEY"]
    small = client.batches.create(
        input_file_id=upload(client, jsonl([chat_line(i) for i in range(20)])).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    assert wait_for(client, small.id, DONE).status == "completed"
    page = _open(browser, stack, admin_key)
    try:
        page.wait_for_selector(f'tr[data-batch="{small.id}"]', timeout=20_000)
        assert page.is_visible("th.team-col") and "all teams" in page.inner_text("#who")

        samples = []
        with interactive_traffic(fleet.base_url):
            time.sleep(4)  # interactive load alone first, then the batch on top of it
            big = client.batches.create(
                input_file_id=upload(client, jsonl([chat_line(i, max_tokens=48) for i in range(400)])).id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
            )
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                sample = httpx.get(
                    f"{stack.base_url}/dashboard/fleet", headers={"Authorization": f"Bearer {admin_key}"}
                ).json()
                samples.append(sample)
                if client.batches.retrieve(big.id).status in DONE:
                    break
                time.sleep(1.0)
            time.sleep(4)
        assert client.batches.retrieve(big.id).status == "completed"
        assert any((s["batch_inflight"] or 0) > 0 and (s["fleet_inflight"] or 0) > 0 for s in samples), samples
        assert any((s["interactive_inflight"] or 0) > 0 for s in samples), samples
        # The stack's fixed bound, per lease pool: one pool per model the deployment serves once the
        # API has read its catalogue, and the fleet's limit is their sum.
        assert sample["capacity_control"] is False and sample["pools"]
        assert all(p["limit"] == 32 for p in sample["pools"]), sample["pools"]
        assert sample["limit"] == 32 * len(sample["pools"])

        page.wait_for_selector(f'tr[data-batch="{big.id}"]', timeout=20_000)
        page.wait_for_function(
            "id => document.querySelector(`tr[data-batch='${id}']`).innerText.includes('400/400 (100%)')",
            arg=big.id,
            timeout=20_000,
        )
        # Rows are redrawn every few seconds: read them afresh.
        assert "default" in page.inner_text(f'tr[data-batch="{big.id}"]')  # the team, in the admin's column
        small_row = page.inner_text(f'tr[data-batch="{small.id}"]')
        assert "20/20 (100%)" in small_row
        # The chart holds the samples taken while the big batch ran: a batch area that left zero.
        assert page.locator("#chart svg polygon.area-batch").count() == 1
        assert page.eval_on_selector(
            "#chart svg polygon.area-batch",
            "p => p.getAttribute('points').split(' ').some(xy => Number(xy.split(',')[1]) < 212)",
        )
        page.wait_for_selector("#usage tbody tr", timeout=40_000)

        SCREENSHOT.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(SCREENSHOT), full_page=True)
        assert SCREENSHOT.stat().st_size > 20_000
        assert _pixel_spread(SCREENSHOT) > 10, "the screenshot is blank"
        text = page.inner_text("body")
        assert big.id in text and small.id in text and "400/400 (100%)" in text
    finally:
        page.close()
