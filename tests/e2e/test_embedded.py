"""The README's first command: `backfill up` on embedded defaults (SQLite, a local object
directory, the filesystem broker, the simulated Dynamo fleet it starts itself)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.e2e.helpers import chat_line, jsonl, read_lines, upload, wait_for

pytestmark = pytest.mark.e2e


def test_backfill_up_runs_a_batch(tmp_path: Path) -> None:
    from backfill.devfleet.processes import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BACKFILL_") or k == "BACKFILL_FLEET_HOME"}
    env["BACKFILL_HOME"] = str(tmp_path / "home")
    log = (tmp_path / "up.log").open("w+b")
    proc = subprocess.Popen(
        [sys.executable, "-m", "backfill", "up", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        text = ""
        # The status block ends with this line: wait for all of it, not its first line (the
        # key and fleet lines may not be written yet when "backfill is up" is).
        while "Ctrl-C stops everything" not in text:
            assert proc.poll() is None, text[-3000:]
            assert time.monotonic() < deadline, text[-3000:]
            time.sleep(0.5)
            text = (tmp_path / "up.log").read_text(errors="replace")
        key = re.search(r"API key\s*:\s*(\S+)", text).group(1)  # type: ignore[union-attr]
        base = re.search(r"base URL\s*:\s*(\S+)", text).group(1)  # type: ignore[union-attr]
        fleet_port = re.search(r"fleet\s*:\s*http://[\d.]+:(\d+)", text).group(1)  # type: ignore[union-attr]
        assert (tmp_path / "home" / "backfill.db").exists()

        client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
        lines = [chat_line(i) for i in range(200)]
        f = upload(client, jsonl(lines))
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        done = wait_for(client, b.id, {"completed", "failed"}, timeout_s=180)
        assert done.status == "completed", done.errors
        out = read_lines(client, done.output_file_id)
        assert sorted(o["custom_id"] for o in out) == sorted(line["custom_id"] for line in lines)
        assert all(json.dumps(o["response"]["body"]["usage"]) for o in out)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    # `up` stops what it started, the simulated fleet included.
    leftover = subprocess.run(["pgrep", "-f", f"http-port {fleet_port}"], capture_output=True, text=True).stdout
    assert not leftover.strip()
