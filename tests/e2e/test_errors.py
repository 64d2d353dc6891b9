"""Bad input and foreign ids always get the OpenAI error envelope with OpenAI's status."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.contract.spec import validate
from tests.e2e.helpers import chat_line, jsonl, upload

pytestmark = pytest.mark.e2e


def _envelope(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    validate(body, "ErrorResponse")
    return body["error"]


def test_401_without_or_with_a_bad_key(stack) -> None:
    for headers in ({}, {"Authorization": "Bearer sk-nope"}, {"Authorization": "Basic abc"}):
        for method, path in (("GET", "/files"), ("GET", "/batches"), ("POST", "/batches"), ("GET", "/models")):
            r = httpx.request(method, stack.base_url + path, headers=headers, json={})
            err = _envelope(r, 401)
            assert err["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=stack.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.batches.list()


def test_404_for_unknown_ids(client, stack) -> None:
    h = {"Authorization": f"Bearer {stack.key}"}
    for method, path in (
        ("GET", "/files/file-doesnotexist"),
        ("GET", "/files/file-doesnotexist/content"),
        ("DELETE", "/files/file-doesnotexist"),
        ("GET", "/files/garbage"),
        ("GET", "/batches/batch_doesnotexist"),
        ("GET", "/batches/nonsense"),
        ("POST", "/batches/batch_doesnotexist/cancel"),
        ("GET", "/nowhere"),
    ):
        err = _envelope(httpx.request(method, stack.base_url + path, headers=h), 404)
        assert err["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-missing", endpoint="/v1/chat/completions", completion_window="24h")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"endpoint": "/v1/chat/completions", "completion_window": "24h"}, "input_file_id"),
        ({"input_file_id": "F", "endpoint": "/v1/images/generations", "completion_window": "24h"}, "endpoint"),
        ({"input_file_id": "F", "endpoint": "/v1/chat/completions", "completion_window": "3d"}, "completion_window"),
        (
            {
                "input_file_id": "F",
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                "metadata": {f"k{i}": "v" for i in range(17)},
            },
            "metadata",
        ),
        (
            {
                "input_file_id": "F",
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                "metadata": {"k": "v" * 513},
            },
            "metadata.k",
        ),
        (
            {
                "input_file_id": "F",
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                "metadata": {"k" * 65: "v"},
            },
            "metadata",
        ),
        (
            {
                "input_file_id": "F",
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                "output_expires_after": {"anchor": "created_at", "seconds": 60},
            },
            "output_expires_after.seconds",
        ),
    ],
)
def test_400_for_bad_batch_requests(client, stack, body: dict, param: str) -> None:
    f = upload(client, jsonl([chat_line(0)]))
    body = {k: (f.id if v == "F" else v) for k, v in body.items()}
    r = httpx.post(stack.base_url + "/batches", json=body, headers={"Authorization": f"Bearer {stack.key}"})
    err = _envelope(r, 400)
    assert err["param"] == param, err


def test_400_for_bad_uploads(stack) -> None:
    h = {"Authorization": f"Bearer {stack.key}"}
    files = {"file": ("a.jsonl", b"{}\n")}
    err = _envelope(httpx.post(stack.base_url + "/files", headers=h, files=files, data={"purpose": "nope"}), 400)
    assert err["param"] == "purpose"
    err = _envelope(httpx.post(stack.base_url + "/files", headers=h, files=files), 400)
    assert err["param"] == "purpose"
    err = _envelope(httpx.post(stack.base_url + "/files", headers=h, data={"purpose": "batch"}), 400)
    err = _envelope(
        httpx.post(
            stack.base_url + "/files",
            headers=h,
            content=b"{}",
        ),
        400,
    )
    err = _envelope(
        httpx.post(
            stack.base_url + "/files",
            headers=h,
            files=files,
            data={"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "5"},
        ),
        400,
    )
    assert err["param"] == "expires_after.seconds"
    r = httpx.post(stack.base_url + "/batches", headers={**h, "Content-Type": "application/json"}, content=b"{oops")
    _envelope(r, 400)
    _envelope(httpx.get(stack.base_url + "/batches", headers=h, params={"limit": 0}), 400)
    _envelope(httpx.get(stack.base_url + "/batches", headers=h, params={"limit": 101}), 400)
    _envelope(httpx.get(stack.base_url + "/files", headers=h, params={"order": "sideways"}), 400)


def test_file_expiry_and_models(client) -> None:
    f = client.files.create(
        file=("e.jsonl", b"{}\n"), purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600}
    )
    assert f.expires_at == f.created_at + 3600
    models = client.models.list()
    assert "tiny-chat" in [m.id for m in models.data]
    assert client.models.retrieve("tiny-chat").id == "tiny-chat"


def test_oversize_json_body_is_refused(stack) -> None:
    h = {"Authorization": f"Bearer {stack.key}"}
    huge = {
        "input_file_id": "file-x",
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        "metadata": {"k": "v" * (2 * 1024 * 1024)},
    }
    err = _envelope(httpx.post(stack.base_url + "/batches", headers=h, json=huge), 413)
    assert err["code"] == "request_too_large"

    def chunked():  # no Content-Length: the cap holds while the body streams in
        yield b'{"metadata": {"k": "'
        for _ in range(3):
            yield b"v" * (1024 * 1024)
        yield b'"}}'

    r = httpx.post(stack.base_url + "/batches", headers={**h, "Content-Type": "application/json"}, content=chunked())
    assert _envelope(r, 413)["code"] == "request_too_large"


def test_hostile_filename_cannot_break_headers(client, stack) -> None:
    name = 'evil"\r\nX-Injected: 1\u00e9.jsonl'
    f = client.files.create(file=(name, b"{}\n"), purpose="batch")
    assert f.filename.startswith("evil") and f.filename.endswith("1\u00e9.jsonl")  # the SDK escapes " and CRLF
    r = httpx.get(f"{stack.base_url}/files/{f.id}/content", headers={"Authorization": f"Bearer {stack.key}"})
    assert r.status_code == 200 and r.content == b"{}\n"
    assert "x-injected" not in r.headers
    assert r.headers["content-disposition"].startswith('attachment; filename="evil')
    assert "\r" not in r.headers["content-disposition"] and "\n" not in r.headers["content-disposition"]
