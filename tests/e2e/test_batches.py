"""The OpenAI SDK, unchanged, against backfill on real Postgres, Redis, S3 and a Dynamo fleet."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.contract.spec import validate
from tests.e2e.helpers import MODEL, chat_line, jsonl, read_lines, upload, wait_for

pytestmark = pytest.mark.e2e


def test_round_trip_chat_batch(client) -> None:
    lines = [chat_line(i, max_tokens=4 + i % 5, temperature=0.7, seed=i, logprobs=False) for i in range(300)]
    f = upload(client, jsonl(lines))
    validate(f.model_dump(), "OpenAIFile")
    assert f.purpose == "batch" and f.bytes == len(jsonl(lines))
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"job": "round-trip"}
    )
    validate(batch.model_dump(), "Batch")
    assert batch.status == "validating" and batch.id.startswith("batch_")

    seen_progress = False
    done = None
    import time

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch.id)
        validate(b.model_dump(), "Batch")
        if b.status == "in_progress" and 0 < b.request_counts.completed < 300:
            seen_progress = True  # counts move while running, not only at the end
        if b.status in ("completed", "failed", "expired", "cancelled"):
            done = b
            break
        time.sleep(0.2)
    assert done is not None and done.status == "completed", done
    assert seen_progress
    assert done.request_counts.total == 300 and done.request_counts.completed == 300
    assert done.request_counts.failed == 0 and done.error_file_id is None
    assert done.model == MODEL and done.metadata == {"job": "round-trip"}
    for stamp in ("created_at", "in_progress_at", "finalizing_at", "completed_at", "expires_at"):
        assert getattr(done, stamp), stamp

    out = read_lines(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(line["custom_id"] for line in lines)
    by_id = {o["custom_id"]: o for o in out}
    for line in lines:
        o = by_id[line["custom_id"]]
        assert o["id"].startswith("batch_req_") and o["error"] is None
        assert o["response"]["status_code"] == 200
        body = o["response"]["body"]
        assert body["usage"]["completion_tokens"] == line["body"]["max_tokens"]
    usage = done.usage
    assert usage.input_tokens == sum(o["response"]["body"]["usage"]["prompt_tokens"] for o in out)
    assert usage.output_tokens == sum(o["response"]["body"]["usage"]["completion_tokens"] for o in out)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens

    meta = client.files.retrieve(done.output_file_id)
    validate(meta.model_dump(), "OpenAIFile")
    assert meta.purpose == "batch_output"


def test_completions_endpoint_keeps_client_fields(client) -> None:
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": f"def f{i}(x):", "max_tokens": 3, "temperature": 0.2, "top_p": 0.9},
        }
        for i in range(20)
    ]
    f = upload(client, jsonl(lines))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    done = wait_for(client, b.id, {"completed", "failed"})
    assert done.status == "completed", done.errors
    out = read_lines(client, done.output_file_id)
    assert len(out) == 20 and all(o["response"]["body"]["object"] == "text_completion" for o in out)


def test_fleet_4xx_goes_to_error_file(client) -> None:
    # The mocker answers 400 without max_tokens: that is the fleet's verdict, kept verbatim.
    good = [chat_line(i) for i in range(5)]
    bad = [
        dict(chat_line(100 + i), body={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
        for i in range(3)
    ]
    f = upload(client, jsonl(good + bad))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_for(client, b.id, {"completed", "failed"})
    assert done.status == "completed"
    assert done.request_counts.completed == 5 and done.request_counts.failed == 3
    errors = read_lines(client, done.error_file_id)
    assert sorted(e["custom_id"] for e in errors) == [f"req-{100 + i}" for i in range(3)]
    for e in errors:
        assert 400 <= e["response"]["status_code"] < 500 and "max_tokens" in json.dumps(e["response"]["body"])
        assert e["error"] is None
    assert len(read_lines(client, done.output_file_id)) == 5


def test_validation_reports_every_problem_with_its_line(client) -> None:
    rows = [
        json.dumps(chat_line(1)),
        "{not json",
        json.dumps({**chat_line(2), "custom_id": "req-1"}),
        json.dumps({**chat_line(3), "method": "GET"}),
        json.dumps({**chat_line(4), "url": "/v1/embeddings"}),
        json.dumps({**chat_line(5), "body": "text"}),
        json.dumps(chat_line(6, stream=True)),
        json.dumps({k: v for k, v in chat_line(7).items() if k != "custom_id"}),
        json.dumps(chat_line(8, model="other-model")),
        "[1, 2]",
    ]
    f = upload(client, ("\n".join(rows) + "\n").encode())
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_for(client, b.id, {"failed", "completed"})
    assert done.status == "failed" and done.failed_at
    validate(done.model_dump(), "Batch")
    got = {(e.line, e.code) for e in done.errors.data}
    expected = {
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "invalid_method"),
        (5, "invalid_url"),
        (6, "invalid_body"),
        (7, "streaming_not_supported"),
        (8, "missing_custom_id"),
        (9, "mismatched_model"),
        (10, "invalid_request"),
    }
    assert expected <= got, got
    assert all(e.message for e in done.errors.data)


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"", "empty_file"),
        (b"\n\n", "empty_file"),
        (jsonl([chat_line(1, model="no-such-model")]), "model_not_found"),
        (jsonl([chat_line(i) for i in range(3001)]), "too_many_requests"),
    ],
)
def test_file_level_validation(client, payload: bytes, code: str) -> None:
    f = upload(client, payload)
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_for(client, b.id, {"failed", "completed"})
    assert done.status == "failed"
    assert code in {e.code for e in done.errors.data}


def test_oversize_upload_is_refused_while_streaming(stack) -> None:
    big = b"x" * (9 * 1024 * 1024)

    def chunks():
        yield b""  # no Content-Length: the cap must hold while streaming
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    boundary = "bfboundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()

    def body():
        yield head
        yield from chunks()
        yield f"\r\n--{boundary}--\r\n".encode()

    r = httpx.post(
        f"{stack.base_url}/files",
        content=body(),
        headers={"Authorization": f"Bearer {stack.key}", "Content-Type": f"multipart/form-data; boundary={boundary}"},
        timeout=60,
    )
    assert r.status_code == 413, r.text
    validate(r.json(), "ErrorResponse")
    assert r.json()["error"]["code"] == "file_too_large"


def test_file_api(client) -> None:
    data = jsonl([chat_line(i) for i in range(3)])
    ids = [upload(client, data, name=f"f{i}.jsonl").id for i in range(5)]
    content = client.files.content(ids[0]).read()
    assert content == data
    page = client.files.list(limit=2, order="desc")
    validate(page.model_dump(exclude_unset=False) | {"object": "list"}, "ListFilesResponse")
    assert len(page.data) == 2 and page.has_more
    every = [f.id for f in client.files.list(limit=2, purpose="batch")]
    assert set(ids) <= set(every) and len(every) == len(set(every))
    asc = client.files.list(order="asc", limit=10000).data
    assert [f.created_at for f in asc] == sorted(f.created_at for f in asc)
    deleted = client.files.delete(ids[-1])
    validate(deleted.model_dump(), "DeleteFileResponse")
    assert deleted.deleted and deleted.id == ids[-1]
    import openai

    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(ids[-1])


def test_batch_list_pagination(client) -> None:
    f = upload(client, jsonl([chat_line(0)]))
    made = [
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id
        for _ in range(5)
    ]
    first = client.batches.list(limit=2)
    validate(first.model_dump(), "ListBatchesResponse")
    assert len(first.data) == 2 and first.has_more
    assert first.data[0].id == made[-1]
    listed = [b.id for b in client.batches.list(limit=2)]
    assert listed[:5] == list(reversed(made))
    raw = httpx.get(
        f"{client.base_url}batches", params={"limit": 2}, headers={"Authorization": f"Bearer {client.api_key}"}
    ).json()
    assert raw["first_id"] == made[-1] and raw["last_id"] == made[-2]


def test_cancel_mid_run(client) -> None:
    lines = [chat_line(i, max_tokens=400) for i in range(1500)]
    f = upload(client, jsonl(lines))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    import time

    deadline = time.monotonic() + 60
    while client.batches.retrieve(b.id).request_counts.completed < 10:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    cancelling = client.batches.cancel(b.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = wait_for(client, b.id, {"cancelled"})
    validate(done.model_dump(), "Batch")
    out = read_lines(client, done.output_file_id)
    err = read_lines(client, done.error_file_id)
    assert len(out) + len(err) == 1500
    assert sorted(x["custom_id"] for x in out + err) == sorted(line["custom_id"] for line in lines)
    cancelled = [e for e in err if e["error"] and e["error"]["code"] == "batch_cancelled"]
    assert cancelled and all(e["response"] is None for e in cancelled)
    assert done.request_counts.completed == len(out) and done.request_counts.failed == len(err)
    import openai

    with pytest.raises(openai.ConflictError) as exc:
        client.batches.cancel(b.id)
    assert exc.value.status_code == 409


def test_expiry_keeps_finished_work(client) -> None:
    lines = [chat_line(i, max_tokens=600) for i in range(1200)]
    f = upload(client, jsonl(lines))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="8s")
    done = wait_for(client, b.id, {"expired", "completed"}, timeout_s=120)
    assert done.status == "expired" and done.expired_at
    out = read_lines(client, done.output_file_id)
    err = read_lines(client, done.error_file_id)
    assert len(out) + len(err) == 1200 and out, (len(out), len(err))
    assert all(e["error"]["code"] == "batch_expired" for e in err)
    assert {x["custom_id"] for x in out}.isdisjoint({x["custom_id"] for x in err})
