from __future__ import annotations

import io
import json
import time
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


def wait_for(client: Any, batch_id: str, statuses: set[str], timeout_s: float = 180.0) -> Any:
    deadline = time.monotonic() + timeout_s
    batch = client.batches.retrieve(batch_id)
    while batch.status not in statuses:
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} stuck in {batch.status}: {batch.request_counts}")
        time.sleep(0.3)
        batch = client.batches.retrieve(batch_id)
    return batch


def read_lines(client: Any, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    text = client.files.content(file_id).text
    return [json.loads(line) for line in text.splitlines() if line.strip()]
