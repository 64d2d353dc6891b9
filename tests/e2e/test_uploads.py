"""The official SDK's chunked upload (`client.uploads.upload_file_chunked`), unchanged, against
backfill on real Postgres, Redis, SeaweedFS and a Dynamo fleet; then a batch from the uploaded file."""

from __future__ import annotations

import hashlib
from pathlib import Path

import openai
import pytest

from tests.e2e.helpers import chat_line, jsonl, read_lines, wait_for

pytestmark = pytest.mark.e2e


def test_a_chunked_upload_becomes_a_batch_input(client: openai.OpenAI, tmp_path: Path) -> None:
    lines = [chat_line(i, max_tokens=3) for i in range(120)]
    data = jsonl(lines)
    path = tmp_path / "requests.jsonl"
    path.write_bytes(data)
    # Small parts (several of them, the last shorter): each below S3's 5 MiB minimum middle part,
    # so the file is made by the server-side concatenation.
    part_size = len(data) // 4 + 1
    upload = client.uploads.upload_file_chunked(
        file=path, mime_type="text/jsonl", purpose="batch", part_size=part_size, md5=hashlib.md5(data).hexdigest()
    )
    assert upload.status == "completed" and upload.bytes == len(data) and upload.filename == "requests.jsonl"
    assert upload.file is not None and upload.file.bytes == len(data) and upload.file.purpose == "batch"
    assert client.files.content(upload.file.id).content == data

    batch = client.batches.create(
        input_file_id=upload.file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_for(client, batch.id, {"completed", "failed", "expired", "cancelled"})
    assert done.status == "completed", done
    assert done.request_counts.total == done.request_counts.completed == len(lines)
    out = read_lines(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(line["custom_id"] for line in lines)


def test_sdk_errors_come_in_the_envelope(client: openai.OpenAI) -> None:
    upload = client.uploads.create(bytes=10, filename="x.jsonl", mime_type="text/jsonl", purpose="batch")
    part = client.uploads.parts.create(upload_id=upload.id, data=b"0123456789")
    with pytest.raises(openai.BadRequestError) as bad:
        client.uploads.complete(upload_id=upload.id, part_ids=[part.id], md5="0" * 32)
    assert bad.value.code == "md5_mismatch"
    with pytest.raises(openai.NotFoundError):
        client.uploads.cancel(upload_id="upload_nope")
