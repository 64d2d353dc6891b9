from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from typing import Any

MODEL = "tiny-chat"


def chat_line(i: int, *, model: str = MODEL, max_tokens: int = 8, prefix: str = "", **extra: Any) -> dict[str, Any]:
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": f"{prefix}question {i}: what is {i} + {i}?"}],
            "max_tokens": max_tokens,
            **extra,
        },
    }


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def upload(client: Any, data: bytes, name: str = "batch.jsonl") -> Any:
    return client.files.create(file=(name, io.BytesIO(data)), purpose="batch")


def wait_until(
    what: str | Callable[[], str], cond: Callable[[], bool], timeout_s: float, every_s: float = 0.2
) -> float:
    """Poll `cond` every `every_s` until it holds; the seconds it took. After `timeout_s` the
    test fails, saying `what` (or what `what()` says then) did not happen."""
    started = time.monotonic()
    while not cond():
        if time.monotonic() - started >= timeout_s:
            raise AssertionError(f"{what() if callable(what) else what}: not within {timeout_s:.0f} s")
        time.sleep(every_s)
    return time.monotonic() - started


def wait_for(client: Any, batch_id: str, statuses: set[str], timeout_s: float = 180.0) -> Any:
    """The batch once its status is one of `statuses`."""
    latest: dict[str, Any] = {}

    def reached() -> bool:
        latest["batch"] = client.batches.retrieve(batch_id)
        return latest["batch"].status in statuses

    def stuck() -> str:
        return f"batch {batch_id} stuck in {latest['batch'].status}: {latest['batch'].request_counts}"

    wait_until(stuck, reached, timeout_s, every_s=0.3)
    return latest["batch"]


def read_lines(client: Any, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    text = client.files.content(file_id).text
    return [json.loads(line) for line in text.splitlines() if line.strip()]
